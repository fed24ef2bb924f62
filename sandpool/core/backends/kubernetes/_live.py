"""The run's live sandboxes: a Ready pod made a sandbox, its death, its end.

:class:`LiveSandboxes` turns a Ready pod into a :class:`KubernetesSandbox`: it opens the
sandbox's agent session (or adopts the one opened on the warm pod, :mod:`._presession`),
falls back to one pod exec per command where the agent cannot run, and starts the backend's
service (:mod:`._service`). It marks a sandbox dead as soon as the shared pod watch shows its
pod deleted, failed or replaced, and closes the sessions of the sandboxes it holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from sandpool.core.backends.kubernetes._exec import ExecTarget
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._images import PodImages
from sandpool.core.backends.kubernetes._pods import death_evidence, pod_death
from sandpool.core.backends.kubernetes._presession import Presessions
from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox
from sandpool.core.backends.kubernetes._session import AgentSession, AgentUnavailable
from sandpool.core.backends.kubernetes._watch import Informer
from sandpool.core.pristine import adopt_record
from sandpool.core.service import ServiceSpec

__all__ = ["LiveSandboxes"]

log = logging.getLogger("sandpool.kubernetes")


class LiveSandboxes:
    """The sandboxes of one run, from their pod's Ready to their delete.

    Args:
        http: The HTTP layer (every sandbox's exec channel goes over it; fallbacks are
            counted in its telemetry).
        namespace: Where the pods are.
        run_id: The run-id label value (the prefix of every sandbox id).
        container: The container commands run in.
        images: Task image -> PodImage (workdir, head).
        pods: The run's shared pod watch (deaths).
        presessions: Sessions opened on warm pods before their claim, or None.
        agent: Run sandpool's agent over one exec stream per sandbox; False: one pod exec
            per command.
        python: The interpreter command that runs the agent.
        attach: The agent is its container's pid 1, reached over attach (:mod:`._entrypoint`).
        containers: The pods run containers (``agent_entrypoint``): a sandbox without its
            agent there is never reset in place (:meth:`KubernetesSandbox.changes_outside_repo`).
        agent_timeout: Seconds the agent may take to say it is ready before the fallback.
        service: The service each sandbox starts before it is handed out, or None.
    """

    def __init__(
        self,
        http: KubeHttp,
        namespace: str,
        run_id: str,
        container: str,
        images: PodImages,
        pods: Informer,
        presessions: Presessions | None,
        *,
        agent: bool,
        python: str,
        agent_timeout: float,
        service: ServiceSpec | None,
        attach: bool = False,
        containers: bool = False,
    ) -> None:
        self._http = http
        self._attach = attach
        self._containers = containers
        self.namespace = namespace
        self.run_id = run_id
        self.container = container
        self._images = images
        self._pods = pods
        self._presessions = presessions
        self.agent = agent
        self.python = python
        self.agent_timeout = agent_timeout
        self.service = service
        self.agent_fallbacks = 0  #: images whose agent could not start
        self.fallback_sandboxes = 0  #: sandboxes whose commands each open a pod exec
        self._agent_unavailable: dict[str, str] = {}  # image -> why the agent cannot run
        self._by_id: dict[str, KubernetesSandbox] = {}
        self._by_pod: dict[str, KubernetesSandbox] = {}
        pods.subscribe(None, self._on_pod)

    def __len__(self) -> int:
        return len(self._by_id)

    def _on_pod(self, pod: dict[str, Any] | None) -> None:
        if pod is None:  # deletions seen at a re-list
            for name, sb in list(self._by_pod.items()):
                if self._pods.get(name) is None:
                    sb._mark_dead("the pod was deleted")
            return
        sb = self._by_pod.get(pod["metadata"]["name"])
        if sb is not None and (why := pod_death(pod, sb.pod_uid)):
            same = pod["metadata"].get("uid") == sb.pod_uid  # a replacement's status is not its
            sb._mark_dead(why, death_evidence(pod) if same else [])

    async def start(
        self, image: str, pod: Mapping[str, Any], sid: str, claim: str | None,
        owner: tuple[str, str],
    ) -> KubernetesSandbox:
        """Make Ready ``pod`` of ``image`` sandbox ``<run>-<sid>``, deleted later through
        ``owner`` (resource, name: its claim, Sandbox object or pod); return it once its
        agent session (or fallback) and service are up.

        On failure the sandbox is forgotten; the caller deletes ``owner``.

        Raises:
            SandboxStartError: The service did not start.
            SandboxDied, ExecTransportError, BackendUnavailable: The session could not open.
        """
        pod_name = pod["metadata"]["name"]
        pi = self._images.resolve(image)
        target = ExecTarget(namespace=self.namespace, pod=pod_name, container=self.container,
                            sandbox_id=f"{self.run_id}-{sid}", workdir=pi.workdir)
        sb = KubernetesSandbox(self._http, target.sandbox_id, image, target,
                               pod["metadata"]["uid"], claim, agent_python=self.python)
        sb.head = pi.head
        sb.image_id = image_identity(pod, self.container, pi.image, pi.head)
        sb.owner = owner
        sb.in_container = self._containers
        self._by_id[sb.id] = sb
        self._by_pod[pod_name] = sb
        try:
            if why := pod_death(self._pods.get(pod_name), sb.pod_uid):
                sb._mark_dead(why)
            elif not self.agent:
                self._fallback(sb, "agent_off")
            elif image in self._agent_unavailable:
                self._fallback(sb, "agent_unavailable")
            else:
                await self._open_session(sb)
            if self.service is not None:  # while the pool warms: the claim finds it running
                try:
                    await sb.start_service(self.service)
                except BaseException:  # the session (and the service with it) ends
                    sb._mark_dead("its service did not start")
                    await sb._close_session()
                    raise
            await sb.record_fresh()  # before any command of a rollout
        except BaseException:  # the caller deletes its object; this sandbox never was
            self._forget(sb)
            raise
        return sb

    def _forget(self, sb: KubernetesSandbox) -> None:
        self._by_id.pop(sb.id, None)
        if self._by_pod.get(sb.pod) is sb:
            del self._by_pod[sb.pod]

    async def remove(self, sb: KubernetesSandbox, why: str = "deleted by sandpool") -> None:
        """Forget ``sb``, mark it dead (``why``) and close its session (its object is deleted,
        or its Sandbox suspended, by the caller)."""
        self._forget(sb)
        sb._mark_dead(why)
        await sb._close_session()

    async def aclose(self) -> None:
        """Mark every sandbox dead (``backend closed``) and close their sessions."""
        live = list(self._by_id.values())
        for sb in live:
            sb._mark_dead("backend closed")
        self._by_id.clear()
        self._by_pod.clear()
        await asyncio.gather(*(sb._close_session() for sb in live))

    def _fallback(self, sb: KubernetesSandbox, reason: str) -> None:
        """Record that ``sb`` runs its commands as one pod exec each: counted per sandbox in
        ``fallback_sandboxes`` and ``sandpool_kube_exec_fallbacks_total{reason}``, logged
        (debug) per sandbox; the per-image warning is :meth:`_open_session`'s."""
        self.fallback_sandboxes += 1
        self._http.telemetry.exec_fallback(reason)
        if reason == "agent_off" and self.fallback_sandboxes == 1:
            log.info("agent=False: every command of run %s's sandboxes opens a pod exec (an "
                     "API-server stream)", self.run_id)
        log.debug("sandbox %s (pod %s): one pod exec per command (%s)", sb.id, sb.pod, reason)

    async def _open_session(self, sb: KubernetesSandbox) -> None:
        """Start ``sb``'s agent session, or adopt the one opened on its warm pod; on failure
        fall back to one exec per command (logged once per image, counted in
        ``agent_fallbacks``)."""
        if self._presessions is not None:
            pre = await self._presessions.take(sb.pod, sb.pod_uid)
            if pre is not None:
                sb.attach(pre.session)
                if pre.recorded is not None:  # then start's record_fresh has nothing to do
                    sb.adopt_fresh(pre.recorded)
                sb.recorded = pre.recorded is not None and adopt_record(sb, pre.recorded)
                return
        session = AgentSession(self._http, sb._target, sb.id, self.python,
                               attach=self._attach)
        try:
            await session.start(self.agent_timeout)
        except AgentUnavailable as exc:
            if sb._dead is not None:
                raise sb._died() from None
            self._agent_unavailable[sb.image] = str(exc)
            if self._presessions is not None:
                self._presessions.no_agent(sb.image)
            self.agent_fallbacks += 1
            log.warning(
                "image %s: sandpool's agent cannot run in its pods (%s); its sandboxes fall "
                "back to one pod exec per command (each command opens an API-server stream)",
                sb.image,
                exc,
            )
            self._fallback(sb, "agent_unavailable")
            return
        sb.attach(session)


def image_identity(pod: Mapping[str, Any], container: str, image: str, head: str | None) -> str:
    """The build of the image a pod runs: its container's ``imageID`` (the digest the node
    pulled), else the image reference and the commit its workdir is at."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container and cs.get("imageID"):
            return str(cs["imageID"])
    return f"{image}@{head or ''}"
