"""Pods: what a pod's status means (Ready, a start that will never succeed, death), the
``pods`` mode's plain pods, and the wait for a pod to be Ready (on the shared pod watch).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._images import PodImages
from sandpool.core.backends.kubernetes._manifests import ns_path
from sandpool.core.backends.kubernetes._watch import Informer

__all__ = ["Pods", "cond", "death_evidence", "pod_death", "pod_ready", "pod_start_failure"]

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


def cond(obj: Mapping[str, Any] | None, ctype: str) -> Mapping[str, Any] | None:
    """The condition of type ``ctype`` in ``obj``'s status, or None."""
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
    status = pod.get("status") or {}
    # Init containers (the scratch volume's filler) pull the image first: their failure is the
    # pod's; one that ran to completion (exit 0) is not.
    inits = [(cs, True) for cs in status.get("initContainerStatuses") or []]
    for cs, init in [*inits, *((cs, False) for cs in status.get("containerStatuses") or [])]:
        state = cs.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in _START_FAIL_WAITING:
            return f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')}".strip()
        term = state.get("terminated") or {}
        if term and not (init and term.get("exitCode") == 0):
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


def death_evidence(pod: Mapping[str, Any] | None) -> list[str]:
    """What in a dead pod's status shows its own processes killed it, one sentence each: a
    container the kubelet reports ``OOMKilled`` (the runtime saw a memory-cgroup OOM of its
    container or pod: the limit the pod's processes share was reached). Anything else (a
    SIGKILL from the node, an eviction, a delete) is no evidence: the policy cannot signal the
    agent, its container's pid 1."""
    out = []
    for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("reason") == "OOMKilled":
            out.append(f"the kubelet reports its container {cs.get('name')} OOMKilled: the memory "
                       "limit its processes share was reached")
    return out


class Pods:
    """Plain pods of one run, and the wait for any of its pods to be Ready.

    Args:
        http: The HTTP layer.
        namespace: Where the pods are.
        run_id: The run-id label value.
        images: Task image -> PodImage and PodSpec.
        watch: The run's shared pod watch (started before :meth:`wait_ready`).
        ready_timeout: Seconds a pod may take to become Ready.
    """

    def __init__(
        self, http: KubeHttp, namespace: str, run_id: str, images: PodImages, watch: Informer,
        ready_timeout: float,
    ) -> None:
        self._http = http
        self.namespace = namespace
        self.run_id = run_id
        self._images = images
        self._watch = watch
        self.ready_timeout = ready_timeout

    async def create(self, image: str, n: int) -> str:
        """Create plain pod ``sp-<run>-p<n>`` of ``image``; return its name (not waiting)."""
        pod_name = f"sp-{self.run_id}-p{n}"
        pi = self._images.resolve(image)
        await self._http.request(
            "POST",
            ns_path(self.namespace, "pods"),
            body=m.pod(pod_name, self.run_id, image, pi, self._images.spec(pi, image)),
        )
        return pod_name

    async def wait_ready(self, pod_name: str, *, replacing: str | None = None) -> dict[str, Any]:
        """Wait for pod ``pod_name`` to be Ready (and not being deleted); return it. With
        ``replacing`` (a pod UID), only a pod of another UID counts.

        Raises:
            SandboxStartError: The pod will never start (:func:`pod_start_failure`).
            InfraTimeout: Not Ready within ``ready_timeout``.
        """

        def check(pod: dict[str, Any] | None) -> dict[str, Any] | None:
            if pod is None or (replacing and pod["metadata"].get("uid") == replacing):
                return None
            if pod_ready(pod) and not pod["metadata"].get("deletionTimestamp"):
                return pod
            if why := pod_start_failure(pod):
                raise errors.SandboxStartError(f"pod {self.namespace}/{pod_name}: {why}")
            return None

        try:
            return await self._watch.wait(pod_name, check, self.ready_timeout)
        except TimeoutError:
            raise errors.InfraTimeout(
                f"pod {self.namespace}/{pod_name} was not Ready within {self.ready_timeout:.0f} s"
            ) from None

    async def wait_gone(self, pod_name: str, uid: str) -> None:
        """Wait until pod ``pod_name`` of ``uid`` is gone from the API (deleted, not only
        being deleted; a pod of that name and another UID does not count).

        Raises:
            InfraTimeout: Not within ``ready_timeout``.
        """

        def check(pod: dict[str, Any] | None) -> bool | None:
            return True if pod is None or pod["metadata"].get("uid") != uid else None

        try:
            await self._watch.wait(pod_name, check, self.ready_timeout)
        except TimeoutError:
            raise errors.InfraTimeout(
                f"pod {self.namespace}/{pod_name} was not deleted within {self.ready_timeout:.0f} s"
            ) from None
