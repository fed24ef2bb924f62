"""``sandpool`` as a NeMo Gym sandbox provider (entry-point group ``nemo_gym.sandbox_providers``).

NeMo Gym's sandbox-using servers pick a provider by config; with sandpool installed this block
gives them warm, in-place-reset sandboxes::

    sandbox:
      sandpool:                 # the provider name; its mapping is a ``sandpool:`` block
        tasks: default
        strategy: reuse
        concurrency: 8

The provider implements NeMo Gym's ``SandboxProvider`` protocol: ``create`` returns once the
sandbox answers commands, then ``exec``, ``upload_file``/``download_file``, ``status``,
``close`` and ``aclose``; NeMo Gym's ``AsyncSandbox`` and its synchronous ``Sandbox`` wrapper
both drive it.

``create`` claims a sandbox for a task: ``spec.metadata["instance_id"]`` (or
``spec.provider_options["instance_id"]``) names it in the task source; otherwise the first task
whose image is ``spec.image`` is used; otherwise ``provider_options["base_commit"]`` must say
which commit of ``spec.image`` to check out.

Provider instances with the same settings on the same event loop share one pool, so sandboxes
released by one ``AsyncSandbox`` are reset in place and reused by the next. NeMo Gym calls
``aclose`` after every sandbox; the shared pool stays warm for ``linger_s`` seconds after its
last provider closes, then deletes its sandboxes (at once for the synchronous ``Sandbox``,
whose private event loop ends with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxExecResult,
    SandboxHandle,
    SandboxSpec,
    SandboxStatus,
)
from sandpool.core import errors
from sandpool.core.pool import Lease, PoolState, SandboxPool
from sandpool.core.task import Task
from sandpool.integrations.nemo_gym.config import PoolSettings, validate_settings

__all__ = ["SandpoolProvider"]

#: The user a sandpool sandbox runs commands as.
_SANDBOX_USERS = (None, 1000, "1000", "sandbox")


@dataclass(eq=False)
class _SharedPool:
    settings: PoolSettings
    pool: SandboxPool
    tasks: list[Task]
    refs: int = 0
    closer: asyncio.TimerHandle | None = None
    closing: set[asyncio.Task[None]] = field(default_factory=set)


# One pool per (event loop, settings); entries leave when their pool closes.
_POOLS: dict[tuple[int, str], _SharedPool] = {}
_OPENING: dict[tuple[int, str], asyncio.Lock] = {}


class SandpoolProvider:
    """NeMo Gym sandbox provider backed by a sandpool :class:`SandboxPool`.

    Args:
        linger_s: Seconds the shared pool stays warm after its last provider's ``aclose``.
        **settings: A ``sandpool:`` block (see
            :class:`~sandpool.integrations.nemo_gym.config.PoolSettings`).

    Raises:
        ConfigError: A setting is invalid; the message names the key (``sandpool.strategy``).
    """

    name = "sandpool"

    def __init__(self, linger_s: float = 60.0, **settings: Any) -> None:
        self.settings = validate_settings(settings, where="sandpool")
        if linger_s < 0:
            raise errors.ConfigError(f"sandpool.linger_s: must be >= 0 seconds, got {linger_s}")
        self.linger_s = float(linger_s)
        self._shared: _SharedPool | None = None
        self._handles: dict[str, SandboxHandle] = {}

    def __repr__(self) -> str:
        return f"<SandpoolProvider sandboxes={len(self._handles)} pool={self._shared and self._shared.pool!r}>"

    @property
    def pool(self) -> SandboxPool | None:
        """The shared pool this provider draws from, once its first ``create`` opened it."""
        return self._shared.pool if self._shared is not None else None

    async def _pool(self) -> _SharedPool:
        if self._shared is not None and self._shared.pool.state is PoolState.OPEN:
            return self._shared
        loop = asyncio.get_running_loop()
        key = (id(loop), self.settings.model_dump_json())
        async with _OPENING.setdefault(key, asyncio.Lock()):
            shared = _POOLS.get(key)
            if shared is None:
                tasks = await self.settings.load_tasks()
                pool = self.settings.build_pool()
                await pool.open()
                if self.settings.prepare and tasks:
                    await pool.prepare(tasks, concurrency=self.settings.concurrency)
                shared = _POOLS[key] = _SharedPool(self.settings, pool, tasks)
            if shared.closer is not None:
                shared.closer.cancel()
                shared.closer = None
            shared.refs += 1
        self._shared = shared
        return shared

    def _task_for(self, spec: SandboxSpec, tasks: list[Task]) -> Task:
        opts = spec.provider_options or {}
        instance_id = spec.metadata.get("instance_id") or opts.get("instance_id")
        if instance_id:
            for t in tasks:
                if t.instance_id == instance_id:
                    return t
            raise errors.TaskValidationError(
                f"instance_id {instance_id!r} is not in the task source ({self.settings.tasks!r})",
                field="instance_id")
        if spec.image:
            for t in tasks:
                if t.image == spec.image:
                    return t
            if opts.get("base_commit"):
                return Task(instance_id=f"adhoc:{spec.image}", repo=spec.image, image=spec.image,
                            base_commit=opts["base_commit"], problem_statement="")
        raise errors.TaskValidationError(
            "the sandbox spec names no task: set metadata.instance_id to a task of the task "
            "source, or image to a task image (with provider_options.base_commit if no task "
            "uses that image)", field="instance_id")

    def _lease(self, handle: SandboxHandle) -> Lease:
        lease = handle.raw
        if not isinstance(lease, Lease):
            raise TypeError(f"handle {handle.sandbox_id!r} was not made by the sandpool provider")
        return lease

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Claim a ready sandbox at the task's base commit.

        ``spec.ready_timeout_s`` bounds the claim (default: ``claim_timeout_s``).

        Returns:
            A handle whose ``raw`` is the :class:`~sandpool.core.pool.Lease`.

        Raises:
            SandboxCreateError: No sandbox became ready (an infra failure; retryable).
            InputError: The spec names no known task, or the image is not built.
        """
        shared = await self._pool()
        task = self._task_for(spec, shared.tasks)
        try:
            lease = await shared.pool.acquire(task, timeout=spec.ready_timeout_s)
        except errors.InfraError as exc:
            raise SandboxCreateError(f"sandpool could not claim a sandbox for {task.instance_id}: "
                                     f"{exc.kind}: {exc}") from exc
        handle = SandboxHandle(sandbox_id=lease.id, provider_name=self.name, raw=lease)
        self._handles[lease.id] = handle
        return handle

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        """Run ``command`` under ``bash -c``; a timeout gives exit code 124 and ``error_type="timeout"``.

        Args:
            handle: From :meth:`create`.
            command: The shell command.
            cwd: Working directory (default: the task repo).
            env: Extra environment variables.
            timeout_s: Seconds before the process group is killed (see
                :meth:`PoolSettings.tool_timeout`: ``exec_timeout_s`` when unset, at most
                ``max_exec_timeout_s``).
            user: Only the sandbox's own user (``None``, ``1000`` or ``"sandbox"``) is supported.

        Raises:
            ValueError: Another ``user`` was asked for.
            InfraError: The sandbox died or its channel broke (never a command result).
        """
        if user not in _SANDBOX_USERS:
            raise ValueError(f"sandpool sandboxes run commands as uid 1000 only, not {user!r}")
        lease = self._lease(handle)
        res = await lease.exec(command, timeout=self.settings.tool_timeout(timeout_s),
                               cwd=cwd, env=env, max_output=self.settings.max_output_bytes)
        return SandboxExecResult(stdout=res.text, stderr=res.err_text, return_code=res.exit_code,
                                 error_type="timeout" if res.timed_out else None)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        """Copy local file ``source_path`` to ``target_path`` in the sandbox (parents made).

        Raises:
            FileNotFoundError: ``source_path`` does not exist.
            InfraError: As :meth:`exec`.
        """
        data = await asyncio.to_thread(Path(source_path).read_bytes)
        await self._lease(handle).write_file(target_path, data)

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None:
        """Copy sandbox file ``source_path`` to local ``target_path`` (parents made).

        Raises:
            FileNotFoundError: ``source_path`` does not exist in the sandbox.
            InfraError: As :meth:`exec`.
        """
        data = await self._lease(handle).read_file(source_path)
        target = Path(target_path)
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        """``RUNNING`` while leased and alive, ``ERROR`` after an infra failure, else ``STOPPED``."""
        lease = self._lease(handle)
        if lease.released:
            return SandboxStatus.STOPPED
        if lease.broken is not None or not lease.sandbox.alive():
            return SandboxStatus.ERROR
        return SandboxStatus.RUNNING

    async def close(self, handle: SandboxHandle) -> None:
        """Release the sandbox: reset in place for reuse, or deleted if it broke. Idempotent."""
        lease = self._lease(handle)
        self._handles.pop(handle.sandbox_id, None)
        if not lease.released:
            await lease.release(reusable=lease.broken is None and lease.sandbox.alive())

    async def aclose(self) -> None:
        """Release this provider's open sandboxes and its reference to the shared pool.

        The pool closes ``linger_s`` seconds after its last provider closed (at once when
        ``linger_s`` is 0, or off the main thread). Idempotent.
        """
        for handle in list(self._handles.values()):
            await self.close(handle)
        shared, self._shared = self._shared, None
        if shared is None:
            return
        shared.refs -= 1
        if shared.refs > 0:
            return
        # NeMo Gym's synchronous ``Sandbox`` runs each sandbox on a private loop in its own
        # thread and closes that loop after ``stop()``: a timer there would never fire.
        if self.linger_s == 0 or threading.current_thread() is not threading.main_thread():
            await _close_shared(shared)
            return
        loop = asyncio.get_running_loop()

        def _later() -> None:
            task = loop.create_task(_close_shared(shared))
            shared.closing.add(task)
            task.add_done_callback(shared.closing.discard)

        shared.closer = loop.call_later(self.linger_s, _later)


async def _close_shared(shared: _SharedPool) -> None:
    if shared.refs > 0:
        return
    for key, value in list(_POOLS.items()):
        if value is shared:
            del _POOLS[key]
            _OPENING.pop(key, None)
    with contextlib.suppress(errors.SandpoolError):
        await shared.pool.aclose()
