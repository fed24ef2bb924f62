"""A sandbox pool driven by its own event loop on a background thread, for synchronous callers.

Gymnasium's API is synchronous; the pool is asyncio. :class:`BackgroundPool` owns one event
loop running on one daemon thread and submits coroutines to it. The loop keeps running between
calls, so the work the pool does in the background (the in-place reset of a released sandbox,
warm-pool fills) proceeds while the trainer is busy elsewhere, instead of landing on the next
``reset()``. Driving a loop with ``run_until_complete`` per call would freeze that work between
calls, which is why this design was chosen.

Envs that share a ``BackgroundPool`` share its sandboxes and its report. It cannot cross a
process boundary: each ``AsyncVectorEnv`` worker builds its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from sandpool.core import errors
from sandpool.core.base import Backend
from sandpool.core.metrics import Report, RolloutResult, Workload
from sandpool.core.pool import PoolLimits, PoolState, SandboxPool
from sandpool.core.strategies import Strategy
from sandpool.core.task import Task

log = logging.getLogger("sandpool.gymnasium")

__all__ = ["BACKENDS", "BackgroundPool", "check_backend", "make_backend"]

T = TypeVar("T")

#: Seconds :meth:`BackgroundPool.close` waits for the pool to delete its sandboxes.
_CLOSE_TIMEOUT_S = 120.0
#: Seconds :meth:`BackgroundPool.close` lets closed sockets finish closing before it stops the loop.
_DRAIN_TIMEOUT_S = 2.0


#: The backend names ``backend=`` accepts (a :class:`~sandpool.core.base.Backend` instance also works).
BACKENDS = ("local", "kubernetes")


def _backend_class(name: str) -> type[Backend]:
    if name == "local":
        from sandpool.core.backends.local import LocalBackend

        return LocalBackend
    # Importing the name raises BackendUnavailable, naming the extra, without the client.
    return importlib.import_module("sandpool.core.backends.kubernetes").KubernetesBackend


def check_backend(backend: Backend | str, options: Mapping[str, Any] | None = None) -> None:
    """Check ``backend``/``options`` as :func:`make_backend` would, without building anything.

    Raises:
        ConfigError: Unknown name, an option the backend does not take, or ``options``
            given with an instance.
        BackendUnavailable: The Kubernetes client library is not installed (names the extra).
    """
    if isinstance(backend, Backend):
        if options:
            raise errors.ConfigError("backend_options apply to a backend name, not to a Backend instance")
        return
    if backend not in BACKENDS:
        raise errors.ConfigError(
            f"backend={backend!r} is not known; use one of {list(BACKENDS)} or a Backend instance")
    cls = _backend_class(backend)
    try:
        inspect.signature(cls).bind(**dict(options or {}))
    except TypeError as exc:  # an unknown or missing keyword: name it and where they are listed
        raise errors.ConfigError(
            f"backend_options for backend={backend!r}: {exc}; see {cls.__module__}.{cls.__name__}"
        ) from None


def make_backend(backend: Backend | str, options: Mapping[str, Any] | None = None) -> Backend:
    """Return a backend instance for a name or pass an instance through.

    Args:
        backend: ``"local"`` (bubblewrap), ``"kubernetes"`` (agent-sandbox or plain pods, see
            :class:`~sandpool.core.backends.kubernetes.KubernetesBackend`) or a
            :class:`~sandpool.core.base.Backend`.
        options: Keyword arguments for the named backend's constructor, e.g.
            ``{"images_root": "/data/images"}`` (local) or ``{"kubeconfig": "~/.kube/config",
            "namespace": "rl", "image_map": ...}`` (kubernetes); not allowed with an instance.

    Raises:
        ConfigError: Unknown name, an option the backend does not take, or ``options`` given
            with an instance.
        BackendUnavailable: The Kubernetes client library is not installed (names the extra).
    """
    check_backend(backend, options)
    if isinstance(backend, Backend):
        return backend
    return _backend_class(backend)(**dict(options or {}))


async def _close(pool: SandboxPool) -> None:
    await pool.aclose()
    # Sockets the backend closed (the Kubernetes client's TLS connections) finish closing on
    # later loop iterations (the close_notify exchange); stopping the loop first would leave
    # them open until garbage collection. Wait for the loop to hold none, briefly.
    loop = asyncio.get_running_loop()
    transports = getattr(loop, "_transports", None)  # selector loops' fd -> transport map
    deadline = loop.time() + _DRAIN_TIMEOUT_S
    while transports and any(not t.is_closing() for t in list(transports.values())):
        if loop.time() > deadline:
            return
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # a closing transport closes its socket on the next iteration


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, pool: SandboxPool) -> None:
    # A finalizer: holds no reference to the BackgroundPool itself.
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # collected on its own loop: cannot block here
        loop.create_task(_close(pool)).add_done_callback(lambda _: loop.stop())
        return
    if thread.is_alive():
        fut = asyncio.run_coroutine_threadsafe(_close(pool), loop)
        try:
            fut.result(_CLOSE_TIMEOUT_S)
        except BaseException:  # noqa: BLE001 - shutting down; the backend's die-with-parent is the backstop
            fut.cancel()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CLOSE_TIMEOUT_S)
    if not thread.is_alive():
        loop.close()


class BackgroundPool:
    """A :class:`~sandpool.core.pool.SandboxPool` plus the event-loop thread that drives it.

    Usage::

        shared = BackgroundPool(backend="local", strategy="reuse")
        envs = [gym.make("sandpool/SWE-v0", tasks=tasks, pool=shared) for _ in range(4)]
        ...
        print(shared.report().render_text())
        shared.close()                      # deletes every sandbox; also runs at GC and exit

    Nothing starts at construction but the loop thread and the backend preflight; sandboxes
    start on the first claim (or :meth:`prepare`).

    Args:
        pool: An unopened pool that no event loop has used yet; default builds one from
            ``backend``, ``strategy`` and ``limits``.
        backend: ``"local"``, ``"kubernetes"`` or a :class:`~sandpool.core.base.Backend`
            (ignored with ``pool``); see :func:`make_backend`.
        strategy: ``"cold"``, ``"warm"``, ``"reuse"`` or a :class:`Strategy` (ignored with ``pool``).
        limits: Pool limits (ignored with ``pool``).
        backend_options: Constructor arguments for a named backend, e.g. ``images_root``.
        metrics: Prometheus series for the pool, as ``SandboxPool(metrics=...)`` takes them
            (ignored with ``pool``: give that pool its own).

    Raises:
        BackendUnavailable: The backend's preflight failed (e.g. no bubblewrap; a kubeconfig
            that is missing or does not load, an unreachable cluster).
        ConfigError: Bad backend, backend option or strategy.
    """

    def __init__(
        self,
        pool: SandboxPool | None = None,
        *,
        backend: Backend | str = "local",
        strategy: str | Strategy = "reuse",
        limits: PoolLimits | None = None,
        backend_options: Mapping[str, Any] | None = None,
        metrics: Any = None,
    ) -> None:
        if pool is None:
            pool = SandboxPool(make_backend(backend, backend_options), strategy, limits or PoolLimits(),
                               metrics=metrics)
        elif pool.state is not PoolState.UNOPENED:
            raise errors.ConfigError(
                "BackgroundPool needs an unopened SandboxPool (an opened one belongs to the event "
                "loop that opened it); pass SandboxPool(...) before `open()`"
            )
        self.pool = pool
        #: Every finished episode of every env using this pool, in order.
        self.results: list[RolloutResult] = []
        #: Largest number of envs stepping at once, for the report's workload.
        self.concurrency = 1
        self._tasks: dict[str, Task] = {}
        self._t0 = time.monotonic()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandpool-gym-loop",
                                        daemon=True)
        self._thread.start()
        # weakref.finalize also runs at interpreter exit, so an env that is never closed still
        # deletes its sandboxes.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, pool)
        try:
            self.run(pool.open())
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<BackgroundPool {state} {self.pool!r} episodes={len(self.results)}>"

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the pool was collected)."""
        return not self._finalizer.alive

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the pool lives on."""
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the pool's loop and block until it finishes.

        An exception in the calling thread while waiting (``KeyboardInterrupt``) cancels the
        coroutine and propagates.

        Args:
            coro: The coroutine.
            timeout: Seconds to wait; ``None`` waits as long as the coroutine's own timeouts.

        Returns:
            What ``coro`` returns.

        Raises:
            PoolClosed: The pool was closed.
            RuntimeError: Called from the loop's own thread (it would deadlock).
            TimeoutError: ``timeout`` passed (the coroutine is cancelled).
            Exception: Whatever ``coro`` raises.
        """
        if self.closed:
            coro.close()
            raise errors.PoolClosed("this BackgroundPool was closed; make a new one")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BackgroundPool.run called from its own event loop thread; await instead")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"pool operation did not finish within {timeout} s") from None
        except BaseException:
            fut.cancel()
            raise

    def note_tasks(self, tasks: Sequence[Task], concurrency: int) -> None:
        """Record the tasks and concurrency of an env using this pool (for the workload)."""
        for t in tasks:
            self._tasks.setdefault(t.instance_id, t)
        self.concurrency = max(self.concurrency, concurrency)

    def prefetch(self, tasks: Sequence[Task], *, rollouts_per_task: int = 1,
                 concurrency: int | None = None) -> None:
        """Start hydrating and warming the next batch's images (see
        :meth:`SandboxPool.prefetch`) without waiting; a failure is logged, and the claims
        of that batch then start their sandboxes themselves."""
        if self.closed:
            return
        fut = asyncio.run_coroutine_threadsafe(
            self.pool.prefetch(tasks, rollouts_per_task=rollouts_per_task,
                               concurrency=concurrency), self._loop)
        fut.add_done_callback(_log_prefetch)

    def prepare(self, tasks: Sequence[Task], concurrency: int) -> dict[str, int]:
        """Hydrate the tasks' images and fill warm pools for ``concurrency`` episodes at once.

        Optional: without it, the first claims start sandboxes on demand. Blocks until the
        warm pools are filled.

        Returns:
            Warm slots per image (see :meth:`SandboxPool.prepare`).

        Raises:
            ImageNotFound: An image is not built.
        """
        self.note_tasks(tasks, concurrency)
        return self.run(self.pool.prepare(tasks, concurrency))

    def report(self, wall_time_s: float | None = None) -> Report:
        """Build the run report over every finished episode of every env sharing this pool.

        Infra failures appear under ``failures["infra_failed"]`` and
        ``infra_errors_by_kind``, never in the reward summary.

        Args:
            wall_time_s: Wall time to report; default is the time since construction.
        """
        images = {t.image for t in self._tasks.values()}
        workload = Workload(tasks=len(self._tasks), images=len(images), rollouts=len(self.results),
                            concurrency=self.concurrency, backend=self.pool.backend.name,
                            strategy=self.pool.strategy.name)
        wall = wall_time_s if wall_time_s is not None else time.monotonic() - self._t0

        async def build() -> Report:  # on the loop thread, where the counters change
            return self.pool.report(workload, list(self.results), wall)

        return self.run(build())

    def close(self) -> None:
        """Delete every sandbox, close the backend and stop the loop thread. Idempotent."""
        self._finalizer()


def _log_prefetch(fut: concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled() and (exc := fut.exception()) is not None:
        log.warning("prefetching the next batch failed (its claims will start sandboxes): %s", exc)
