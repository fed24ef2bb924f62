"""Plain pods: what a pod's status means (Ready, a start that will never succeed, death),
the ``pods`` mode's create, and the wait that turns a Ready pod into a sandbox.

:class:`PodsMixin` is part of :class:`~.backend.KubernetesBackend` (it uses the backend's
client, pod watch and image map); it is split out so each seam reads on its own.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._exec import ExecTarget
from sandpool.core.backends.kubernetes._manifests import PodImage, ns_path
from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox
from sandpool.core.backends.kubernetes._service import start_service
from sandpool.core.backends.kubernetes._session import AgentSession, AgentUnavailable

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes.backend import KubernetesBackend

__all__ = ["PodsMixin", "cond", "pod_death", "pod_ready", "pod_start_failure"]

log = logging.getLogger("sandpool.kubernetes")
# OCI reference: [host[:port]/]path[:tag][@digest], lower-case path components.
_IMAGE_REF = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)

_START_FAIL_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
# Claim Ready=False reasons that never resolve by waiting.


def cond(obj: Mapping[str, Any] | None, ctype: str) -> Mapping[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """True when the pod is Running with its Ready condition True."""
    c = cond(pod, "Ready")
    return (
        (pod.get("status") or {}).get("phase") == "Running"
        and c is not None
        and c.get("status") == "True"
    )


def pod_start_failure(pod: Mapping[str, Any]) -> str | None:
    """Why a starting pod will never become Ready, or None while it may still."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if err := (meta.get("annotations") or {}).get(m.PROVISION_ERROR):
        return f"provisioning failed: {err}"
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in _START_FAIL_WAITING:
            return f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')}".strip()
        term = state.get("terminated") or {}
        if term:
            return f"container {cs.get('name')} terminated: {term.get('reason', '')} (exit {term.get('exitCode')})"
    if status.get("phase") in ("Failed", "Succeeded"):
        return f"pod phase {status['phase']}: {status.get('reason', '')} {status.get('message', '')}".strip()
    sched = cond(pod, "PodScheduled")
    if sched and sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        msg = sched.get("message", "")
        # Capacity frees up as other pods end; a selector, taint or runtime class never does.
        if msg and not re.search(r"Insufficient|Too many pods", msg):
            return f"unschedulable: {msg}"
    return None


def pod_death(pod: Mapping[str, Any] | None, uid: str) -> str | None:
    """Why a Ready pod with UID ``uid`` is no longer usable, or None while it is."""
    if pod is None:
        return "the pod was deleted"
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("uid") != uid:
        return "the pod was replaced by a new one of the same name"
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term:
            return f"container {cs.get('name')} terminated: {term.get('reason', '')} (exit {term.get('exitCode')})"
    if status.get("phase") in ("Failed", "Succeeded"):
        return f"pod {status['phase'].lower()}: {status.get('reason', '')} {status.get('message', '')}".strip()
    if meta.get("deletionTimestamp"):
        return f"the pod is being deleted{' (' + status['reason'] + ')' if status.get('reason') else ''}"
    return None


class PodsMixin:
    """The pod seam of :class:`~.backend.KubernetesBackend`: what an image becomes in a pod,
    create a plain pod, wait for a pod to be Ready, delete objects."""

    def pod_image(self: KubernetesBackend, image: str) -> PodImage:
        """Resolve task image ``image`` through ``image_map`` and validate it.

        Raises:
            ImageNotFound: Not in the map, an invalid image reference, or a missing
                ``workdir_source`` directory.
        """
        if image in self._images:
            return self._images[image]
        if self.image_map is None:
            pi = PodImage(image)
        elif callable(self.image_map):
            pi = self.image_map(image)
        else:
            try:
                pi = self.image_map[image]
            except KeyError:
                raise errors.ImageNotFound(
                    f"image {image!r} is not in the backend's image_map"
                ) from None
        if not _IMAGE_REF.match(pi.image):
            raise errors.ImageNotFound(
                f"image {image!r} maps to {pi.image!r}, which is not a valid container image "
                "reference ([registry/]path[:tag][@sha256:digest], lower-case path)"
            )
        if pi.workdir_source is not None and not Path(pi.workdir_source).is_dir():
            raise errors.ImageNotFound(
                f"image {image!r}: workdir_source {pi.workdir_source} is not a directory; build the "
                "image first (sandpool build-pack) or fix the image_map"
            )
        self._images[image] = pi
        return pi

    async def _create_pod(self: KubernetesBackend, image: str, n: int) -> KubernetesSandbox:
        """``pods`` mode: create pod ``sp-<run>-p<n>`` of ``image`` and wait until it is Ready."""
        http = await self._ensure_client()
        pod_name = f"sp-{self.run_id}-p{n}"
        pi = self.pod_image(image)
        await http.request(
            "POST",
            ns_path(self.namespace, "pods"),
            body=m.pod(pod_name, self.run_id, image, pi, self._pod_spec(pi, image)),
        )
        try:
            return await self._await_pod(image, pod_name, pod_name, None, owner=("pods", pod_name))
        except BaseException:
            await self._delete_object("pods", pod_name)
            raise

    async def _await_pod(
        self: KubernetesBackend,
        image: str,
        pod_name: str,
        sid: str,
        claim: str | None,
        *,
        owner: tuple[str, str],
    ) -> KubernetesSandbox:
        """Wait for ``pod_name`` to be Ready; return its sandbox, deleted later through
        ``owner`` (resource, name: the claim, Sandbox object or pod)."""
        assert self._pods is not None

        def check(pod: dict[str, Any] | None) -> dict[str, Any] | None:
            if pod is None:
                return None
            if pod_ready(pod) and not pod["metadata"].get("deletionTimestamp"):
                return pod
            if why := pod_start_failure(pod):
                raise errors.SandboxStartError(f"pod {self.namespace}/{pod_name}: {why}")
            return None

        try:
            pod = await self._pods.wait(pod_name, check, self.ready_timeout)
        except TimeoutError:
            raise errors.InfraTimeout(
                f"pod {self.namespace}/{pod_name} was not Ready within {self.ready_timeout:.0f} s"
            ) from None
        pi = self.pod_image(image)
        try:
            prefix = tuple(self.exec_prefix(pod, pi.workdir, False)) if self.exec_prefix else ()
            session_prefix = (
                tuple(self.exec_prefix(pod, pi.workdir, True)) if self.exec_prefix else ()
            )
        except (KeyError, ValueError) as exc:
            raise errors.SandboxStartError(f"pod {pod_name}: exec_prefix: {exc}") from None
        target = ExecTarget(
            namespace=self.namespace,
            pod=pod_name,
            container=self.container,
            sandbox_id=f"{self.run_id}-{sid}",
            workdir=pi.workdir,
            prefix=prefix,
            session_prefix=session_prefix,
        )
        sb = KubernetesSandbox(
            self, target.sandbox_id, image, target, pod["metadata"]["uid"], claim
        )
        sb.head = pi.head
        sb.owner = owner
        self._live[sb.id] = sb
        self._by_pod[pod_name] = sb
        if why := pod_death(self._pods.get(pod_name), sb.pod_uid):
            sb._mark_dead(why)
        elif not self.agent:
            self._exec_fallback(sb, "agent_off")
        elif image in self._agent_unavailable:
            self._exec_fallback(sb, "agent_unavailable")
        else:
            try:
                await self._open_session(sb)
            except BaseException:  # the caller deletes its object; this sandbox never was
                self._live.pop(sb.id, None)
                self._by_pod.pop(pod_name, None)
                raise
        if self.service is not None:  # while the pool warms: the claim finds it running
            try:
                await start_service(sb, self.service)
            except BaseException:  # as above; the session (and the service with it) ends
                sb._mark_dead("its service did not start")
                await sb._close_session()
                self._live.pop(sb.id, None)
                self._by_pod.pop(pod_name, None)
                raise
        return sb

    def _exec_fallback(self: KubernetesBackend, sb: KubernetesSandbox, reason: str) -> None:
        """Record that ``sb`` runs its commands as one pod exec each: counted per sandbox in
        ``api_stats["fallback_sandboxes"]`` and ``sandpool_kube_exec_fallbacks_total{reason}``,
        logged (debug) per sandbox; the per-image warning is :meth:`_open_session`'s."""
        self.fallback_sandboxes += 1
        self.telemetry.exec_fallback(reason)
        if reason == "agent_off" and self.fallback_sandboxes == 1:
            log.info("agent=False: every command of run %s's sandboxes opens a pod exec (an "
                     "API-server stream)", self.run_id)
        log.debug("sandbox %s (pod %s): one pod exec per command (%s)", sb.id, sb.pod, reason)

    async def _open_session(self: KubernetesBackend, sb: KubernetesSandbox) -> None:
        """Start ``sb``'s agent session; on failure fall back to one exec per command (logged
        once per image, counted in ``api_stats["agent_fallbacks"]``). A session opened on the
        pod while it waited in its warm pool (:mod:`._presession`) is adopted instead."""
        if self._pre and (pre := await self._take_presession(sb.pod, sb.pod_uid)) is not None:
            pre.client.name = sb.id
            sb._session = pre
            sb.protocol = pre.protocol
            return
        session = AgentSession(self._http, sb._target, sb.id, self.agent_python)
        try:
            await session.start(self.agent_timeout)
        except AgentUnavailable as exc:
            if sb._dead is not None:
                raise sb._died() from None
            self._agent_unavailable[sb.image] = str(exc)
            self.agent_fallbacks += 1
            log.warning(
                "image %s: sandpool's agent cannot run in its pods (%s); its sandboxes fall "
                "back to one pod exec per command (each command opens an API-server stream)",
                sb.image,
                exc,
            )
            self._exec_fallback(sb, "agent_unavailable")
            return
        sb._session = session
        sb.protocol = session.protocol

    async def _delete_object(self: KubernetesBackend, resource: str, name: str) -> None:
        """Delete one object now, or (``delete_batch_s``) with others of its resource in one
        collection delete by ``sandpool.io/obj in (...)`` within that many seconds."""
        if self.delete_batch_s is not None:
            self._pending_deletes.setdefault(resource, set()).add(name)
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush_deletes_later())
            return
        http = await self._ensure_client()
        query = {"propagationPolicy": "Background"}
        if resource == "pods":
            query["gracePeriodSeconds"] = "0"
        try:
            await http.request(
                "DELETE",
                f"{ns_path(self.namespace, resource)}/{name}",
                query=query,
                ok_missing=True,
            )
        except errors.InfraError as exc:  # gc by run id removes what this could not
            self._log_delete_failure(resource, name, exc)

    def _log_delete_failure(self: KubernetesBackend, resource: str, name: str, exc: Exception) -> None:
        log.warning(
            "deleting %s/%s failed: %s (sandpool gc --run-id %s removes it)",
            resource, name, exc, self.run_id,
        )

    async def _flush_deletes_later(self: KubernetesBackend) -> None:
        await asyncio.sleep(self.delete_batch_s or 0)
        await self._flush_deletes()

    async def _flush_deletes(self: KubernetesBackend) -> None:
        """Send every pending delete: one collection delete per resource per 100 names."""
        pending, self._pending_deletes = self._pending_deletes, {}
        http = await self._ensure_client()
        for resource, names in pending.items():
            ordered = sorted(names)
            for i in range(0, len(ordered), 100):
                chunk = ordered[i : i + 100]
                query = {
                    "labelSelector": f"{m.RUN_ID_LABEL}={self.run_id},"
                    f"{m.OBJ_LABEL} in ({','.join(chunk)})",
                    "propagationPolicy": "Background",
                }
                if resource == "pods":
                    query["gracePeriodSeconds"] = "0"
                try:
                    await http.request(
                        "DELETE", ns_path(self.namespace, resource), query=query, ok_missing=True
                    )
                except errors.InfraError as exc:
                    self._log_delete_failure(resource, f"{{{len(chunk)} objects}}", exc)
