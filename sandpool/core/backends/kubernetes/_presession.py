"""Agent sessions opened on warm-pool pods before they are claimed.

With a SandboxWarmPool per image (agent-sandbox mode, a strategy that claims per rollout),
a claim binds a pod that has been Ready for a while; opening its agent session only then
puts the agent's start (a Python interpreter, seconds on a loaded node) on the claim path.
:class:`Presessions` follows the run's pods (the shared pod watch) and opens the session of
each Ready pod of a warm pool as it becomes Ready, up to ``KubernetesBackend(presessions=N)``
at once; the claim that binds the pod adopts it (:meth:`Presessions.take`). The warm pool's
Sandbox objects and so their pods are named ``<warm pool>-<suffix>`` by the controller, and
keep that name when claimed.

A pre-opened session is the agent of a pod no rollout has touched, so adopting it is the same
as opening it at the claim. Through it the pod's pristine state is recorded too (its repo,
and on a container node what it can write outside it, :meth:`KubernetesSandbox.record_fresh`;
git's index refreshed), as the pool would right after the claim, so a warm claim is ready to
run the rollout's first command. One whose pod is deleted, replaced or not adopted by close
is closed. On kwok each session is a host process (about 10 MB), hence the bound, which
grows with the warm targets the pool announces (:meth:`Presessions.announce`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sandpool.core.backends.kubernetes._exec import ExecTarget
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._images import PodImages
from sandpool.core.backends.kubernetes._pods import pod_ready
from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox
from sandpool.core.backends.kubernetes._session import AgentSession, AgentUnavailable
from sandpool.core.backends.kubernetes._watch import Informer
from sandpool.core.reset import record_pristine

__all__ = ["Opened", "Presessions"]

log = logging.getLogger("sandpool.kubernetes")


@dataclass(eq=False)
class _Pre:
    uid: str
    task: asyncio.Task[Opened | None]


@dataclass(eq=False)
class Opened:
    """A session opened on a warm pod, and the handle its pristine state was recorded
    through (None when the record failed: the pool records it after the claim)."""

    session: AgentSession
    recorded: KubernetesSandbox | None


class Presessions:
    """Sessions opened on Ready warm-pool pods, for their claims to adopt.

    Args:
        http: The HTTP layer.
        namespace: Where the pods are.
        run_id: The run-id label value.
        container: The container the agent runs in.
        images: Task image -> PodImage (the image workdir).
        pods: The run's shared pod watch; every change of a pod is considered.
        warm_pool_image: The image whose warm pool made a pod, or None for any other pod.
        limit: Sessions open (or opening) at once.
        python: The interpreter command that runs the agent.
        attach: The agent is its container's pid 1, reached over attach (:mod:`._entrypoint`).
        timeout: Seconds the agent may take to say it is ready.
    """

    def __init__(
        self,
        http: KubeHttp,
        namespace: str,
        run_id: str,
        container: str,
        images: PodImages,
        pods: Informer,
        warm_pool_image: Callable[[Mapping[str, Any]], str | None],
        *,
        limit: int,
        python: str,
        timeout: float,
        attach: bool = False,
    ) -> None:
        self._http = http
        self._attach = attach
        self.namespace = namespace
        self.run_id = run_id
        self.container = container
        self._images = images
        self._pods = pods
        self._warm_pool_image = warm_pool_image
        self.limit = self._configured = limit
        self.python = python
        self.timeout = timeout
        self.adopted = 0  #: sessions a claim adopted
        self._pre: dict[str, _Pre] = {}  # pod -> its pre-opened session
        self._taken: set[str] = set()  # pods a sandbox was made of (never pre-opened again)
        self._no_agent: set[str] = set()  # images whose agent could not start
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False
        self._changed = asyncio.Event()  # a session was started or an image given up
        pods.subscribe(None, self._on_pod)

    def __len__(self) -> int:
        return len(self._pre)

    @property
    def pending(self) -> Mapping[str, asyncio.Task[Opened | None]]:
        """Pod -> the task opening (or that opened) its session, for every session held."""
        return {name: pre.task for name, pre in self._pre.items()}

    @property
    def closing(self) -> int:
        """Sessions being closed (dropped, or not adopted by close)."""
        return len(self._closing)

    def _on_pod(self, pod: dict[str, Any] | None) -> None:
        """Start the session of a newly Ready, unclaimed warm-pool pod; drop one whose pod
        went away or was replaced."""
        if pod is None:  # deletions seen at a re-list
            for name in list(self._pre):
                if self._pods.get(name) is None:
                    self._drop(name)
            self._taken.intersection_update(self._pods.cache)
            return
        meta = pod["metadata"]
        name = meta["name"]
        pre = self._pre.get(name)
        if pre is not None:
            if pre.uid != meta.get("uid") or meta.get("deletionTimestamp"):
                self._drop(name)
            return
        if (len(self._pre) >= self.limit or name in self._taken or self._closed
                or meta.get("deletionTimestamp") or not pod_ready(pod)):
            return
        image = self._warm_pool_image(pod)
        if image is None or image in self._no_agent:
            return
        target = ExecTarget(namespace=self.namespace, pod=name, container=self.container,
                            sandbox_id=f"{self.run_id}-pre-{name}",
                            workdir=self._images.resolve(image).workdir)
        self._pre[name] = _Pre(meta["uid"], asyncio.get_running_loop().create_task(
            self._open(target, image, meta["uid"]), name=f"sandpool-presession-{name}"))
        self._changed.set()

    async def _open(self, target: ExecTarget, image: str, uid: str) -> Opened | None:
        session = AgentSession(self._http, target, target.sandbox_id, self.python,
                               attach=self._attach)
        try:
            await session.start(self.timeout)
        except AgentUnavailable as exc:  # the claim falls back (and says why) itself
            self.no_agent(image)
            log.debug("pre-opening the agent session of pod %s failed: %s", target.pod, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the claim opens its own session then
            log.debug("pre-opening the agent session of pod %s failed: %s", target.pod, exc)
            return None
        probe = KubernetesSandbox(self._http, target.sandbox_id, image, target, uid, None,
                                  agent_python=self.python)
        probe.head = self._images.resolve(image).head
        probe.attach(session)
        try:
            await probe.record_fresh(timeout=self.timeout)  # a contained pod's outside, first
            await record_pristine(probe, refresh_index=True, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - the pool records it after the claim then
            log.debug("recording pod %s before its claim failed: %s", target.pod, exc)
            return Opened(session, None)
        return Opened(session, probe)

    def announce(self, sessions: int) -> None:
        """The pool announced warm targets of ``sessions`` sandboxes claimed per rollout:
        keep up to that many sessions open (never below the configured bound)."""
        self.limit = max(self._configured, sessions)

    async def take(self, pod: str, uid: str) -> Opened | None:
        """The pre-opened (or opening) session of ``pod`` if it is still that pod's and alive;
        the caller owns it then. Called for every pod a sandbox is made of: none is
        pre-opened afterwards."""
        self._taken.add(pod)
        pre = self._pre.pop(pod, None)
        if pre is None:
            return None
        if pre.uid != uid:
            self._close_later(pre)
            return None
        opened = await pre.task
        if opened is None or not opened.session.alive:
            if opened is not None:
                await opened.session.aclose()
            return None
        self.adopted += 1
        return opened

    def no_agent(self, image: str) -> None:
        """Open no session on ``image``'s pods: its agent cannot start there."""
        self._no_agent.add(image)
        self._changed.set()

    async def settle(self, warm: Mapping[str, int], timeout: float) -> int:
        """Wait until the warm pods of ``warm`` (image -> warm sandboxes) have their sessions
        opened and their pristine state recorded, or tried, within the bound; images whose
        agent cannot start are left out. Returns the sessions ready for a claim to adopt,
        possibly fewer than asked once ``timeout`` seconds have passed (their claims then
        wait for them or open their own)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            want = min(self.limit, sum(n for i, n in warm.items() if i not in self._no_agent))
            tasks = [p.task for p in self._pre.values()]
            pending = [t for t in tasks if not t.done()]
            left = deadline - loop.time()
            if (len(tasks) >= want and not pending) or left <= 0 or self._closed:
                break
            self._changed.clear()
            changed = loop.create_task(self._changed.wait())
            try:
                await asyncio.wait([*pending, changed], timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
        return sum(1 for t in tasks if t.done() and not t.cancelled() and t.result() is not None
                   and t.result().recorded is not None)

    def _drop(self, name: str) -> None:
        pre = self._pre.pop(name, None)
        if pre is not None:
            self._close_later(pre)

    def _close_later(self, pre: _Pre) -> None:
        async def close() -> None:
            with contextlib.suppress(Exception):
                opened = await pre.task
                if opened is not None:
                    await opened.session.aclose()

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Close every session not adopted; open no more."""
        self._closed = True
        for name in list(self._pre):
            self._drop(name)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
