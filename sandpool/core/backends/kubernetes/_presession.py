"""Agent sessions opened on warm-pool pods before they are claimed.

With a SandboxWarmPool per image (agent-sandbox mode, a strategy that claims per rollout),
a claim binds a pod that has been Ready for a while; opening its agent session only then
puts the agent's start (a Python interpreter, seconds on a loaded node) on the claim path.
:class:`PresessionMixin` watches the run's pods (the backend's one pod watch) and opens the
session of each Ready pod of a warm pool as it becomes Ready, up to
``KubernetesBackend(presessions=N)`` at once; the claim that binds the pod adopts it
(:meth:`_take_presession`). The warm pool's Sandbox objects and so their pods are named
``<warm pool>-<suffix>`` by the controller, and keep that name when claimed.

A pre-opened session is the agent of a pod no rollout has touched, so adopting it is the same
as opening it at the claim; one whose pod is deleted, replaced or not adopted by close is
closed. On kwok each session is a host process (about 10 MB), hence the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._exec import ExecTarget
from sandpool.core.backends.kubernetes._pods import pod_ready
from sandpool.core.backends.kubernetes._session import AgentSession

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes.backend import KubernetesBackend

__all__ = ["PresessionMixin"]

log = logging.getLogger("sandpool.kubernetes")


@dataclass(eq=False)
class _Pre:
    uid: str
    task: asyncio.Task[AgentSession | None]


class PresessionMixin:
    """The pre-opened sessions seam of :class:`~.backend.KubernetesBackend`."""

    def _presession_on_pod(self: KubernetesBackend, pod: dict[str, Any]) -> None:
        """Start the session of a newly Ready, unclaimed warm-pool pod; drop one whose pod
        went away or was replaced."""
        meta = pod["metadata"]
        name = meta["name"]
        pre = self._pre.get(name)
        if pre is not None:
            if pre.uid != meta.get("uid") or meta.get("deletionTimestamp"):
                self._drop_presession(name)
            return
        if (len(self._pre) >= self.presessions or name in self._by_pod or self._closed
                or meta.get("deletionTimestamp") or not pod_ready(pod)):
            return
        image = self._image_of_key.get((meta.get("labels") or {}).get(m.IMAGE_LABEL, ""))
        if image is None or image in self._agent_unavailable or image not in self._pools:
            return
        if not name.startswith(self._pools[image][0] + "-"):
            return  # not a warm-pool pod (a claim's cold start, a Sandbox object, a prepull)
        pi = self.pod_image(image)
        try:
            prefix = tuple(self.exec_prefix(pod, pi.workdir, True)) if self.exec_prefix else ()
        except (KeyError, ValueError):
            return  # the claim's own start reports it
        target = ExecTarget(namespace=self.namespace, pod=name, container=self.container,
                            sandbox_id=f"{self.run_id}-pre-{name}", workdir=pi.workdir,
                            session_prefix=prefix)
        self._pre[name] = _Pre(meta["uid"], asyncio.get_running_loop().create_task(
            self._open_presession(target), name=f"sandpool-presession-{name}"))

    async def _open_presession(self: KubernetesBackend, target: ExecTarget) -> AgentSession | None:
        session = AgentSession(self._http, target, target.sandbox_id, self.agent_python)
        try:
            await session.start(self.agent_timeout)
        except Exception as exc:  # noqa: BLE001 - the claim opens its own session then
            log.debug("pre-opening the agent session of pod %s failed: %s", target.pod, exc)
            return None
        return session

    async def _take_presession(
        self: KubernetesBackend, pod: str, uid: str
    ) -> AgentSession | None:
        """The pre-opened (or opening) session of ``pod`` if it is still that pod's and alive;
        the caller owns it then."""
        pre = self._pre.pop(pod, None)
        if pre is None:
            return None
        if pre.uid != uid:
            self._close_later(pre)
            return None
        session = await pre.task
        if session is None or not session.alive:
            if session is not None:
                await session.aclose()
            return None
        self.presessions_adopted += 1
        return session

    def _drop_presession(self: KubernetesBackend, name: str) -> None:
        pre = self._pre.pop(name, None)
        if pre is not None:
            self._close_later(pre)

    def _close_later(self: KubernetesBackend, pre: _Pre) -> None:
        async def close() -> None:
            with contextlib.suppress(Exception):
                session = await pre.task
                if session is not None:
                    await session.aclose()

        task = asyncio.get_running_loop().create_task(close())
        self._pre_closing.add(task)
        task.add_done_callback(self._pre_closing.discard)

    async def _close_presessions(self: KubernetesBackend) -> None:
        """Close every session not adopted (at close)."""
        for name in list(self._pre):
            self._drop_presession(name)
        if self._pre_closing:
            await asyncio.gather(*self._pre_closing, return_exceptions=True)
