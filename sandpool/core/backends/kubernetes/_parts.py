"""The parts of a :class:`~.backend.KubernetesBackend`, made from its options.

:func:`make_parts` checks the options no one part owns (``mode``, ``api_retries``,
``disk_bytes``, ``service.binds``, ``run_id``) and makes each part, giving it what it uses:
the HTTP layer and its throttle, the image -> pod spec map, one shared watch per resource
(pods; in agent-sandbox mode claims and warm pools too, selected by the run id's label;
:class:`Watches`), and the parts over them. The options are those of
:class:`~.backend.KubernetesBackend`, documented there.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._claims import Claims
from sandpool.core.backends.kubernetes._entrypoint import entrypoint
from sandpool.core.backends.kubernetes._gc import Deleter
from sandpool.core.backends.kubernetes._http import KubeHttp, Throttle
from sandpool.core.backends.kubernetes._images import ImageMap, PodImages
from sandpool.core.backends.kubernetes._live import LiveSandboxes
from sandpool.core.backends.kubernetes._manifests import ns_path
from sandpool.core.backends.kubernetes._pods import Pods
from sandpool.core.backends.kubernetes._preflight import Preflight
from sandpool.core.backends.kubernetes._prepull import Placement
from sandpool.core.backends.kubernetes._presession import Presessions
from sandpool.core.backends.kubernetes._watch import Informer
from sandpool.core.service import ServiceSpec

__all__ = ["MODES", "Parts", "Watches", "make_parts"]

MODES = ("agent-sandbox", "pods")
_DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}}


class Watches:
    """The run's shared watches, started together once and closed together."""

    def __init__(self, informers: list[Informer]) -> None:
        self.informers = informers
        self._lock = asyncio.Lock()
        self._started = False

    async def start(self) -> None:
        """List and start every watch, once (concurrent callers wait for the first)."""
        if not self._started:
            async with self._lock:
                if not self._started:
                    await asyncio.gather(*(w.start() for w in self.informers))
                    self._started = True

    async def aclose(self) -> None:
        """Close every watch."""
        for watch in self.informers:
            await watch.aclose()


@dataclass(frozen=True)
class Parts:
    """One backend's parts; ``claims`` and ``presessions`` are None where the options have
    none (pods mode; presessions off)."""

    run_id: str
    throttle: Throttle
    http: KubeHttp
    images: PodImages
    watches: Watches
    claims: Claims | None
    presessions: Presessions | None
    live: LiveSandboxes
    pods: Pods
    placement: Placement
    preflight: Preflight
    deleter: Deleter


def make_parts(
    *, kubeconfig: str | None, namespace: str, mode: str, run_id: str | None, qps: float,
    burst: int, adaptive_rate: bool, cluster: str | None, max_inflight: int,
    runtime_class: str | None, node_selector: Mapping[str, str] | None,
    tolerations: Sequence[Mapping[str, Any]] | None, resources: Mapping[str, Any] | None,
    image_map: ImageMap | None, container: str, command: Sequence[str], ready_timeout: float,
    reuse_spares: int, controller_timeout: float, controller_version: str | None, agent: bool,
    agent_python: str, agent_timeout: float, sandbox_objects: bool, presessions: int,
    delete_batch_s: float | None, api_retries: int, service: ServiceSpec | None,
    disk_bytes: int | None, agent_entrypoint: bool,
) -> Parts:
    """Check the options and make the parts of a backend (no request is sent).

    ``kubeconfig`` is a path already expanded, or None; ``run_id`` None draws 8 random hex
    digits.

    Raises:
        ConfigError: An unknown ``mode``, a negative ``api_retries``, a ``disk_bytes`` not
            positive, a ``service`` with ``binds``, an invalid ``run_id``, or ``qps``,
            ``burst``, ``max_inflight`` not positive; each naming the option and its fix.
    """
    if mode not in MODES:
        raise errors.ConfigError(f"mode={mode!r} is not known; use one of {list(MODES)}")
    if api_retries < 0:
        raise errors.ConfigError(f"api_retries={api_retries} must be 0 or more")
    if disk_bytes is not None and disk_bytes <= 0:
        raise errors.ConfigError(f"disk_bytes={disk_bytes} must be positive (or None)")
    if service is not None and service.binds:
        raise errors.ConfigError("ServiceSpec.binds: no host directory is bound into a pod; "
                                 "put the service's code in the image or a volume")
    attach = agent and agent_entrypoint
    ns = namespace
    run = m.check_run_id(run_id) if run_id is not None else uuid.uuid4().hex[:8]
    throttle = Throttle(qps, burst, max_inflight, adaptive=adaptive_rate, cluster=cluster or "")
    http = KubeHttp(None, throttle, kubeconfig=kubeconfig, retries=api_retries)
    images = PodImages(
        image_map, container=container, command=command,
        resources=resources or _DEFAULT_RESOURCES, runtime_class=runtime_class,
        node_selector=node_selector or {}, tolerations=tolerations or [],
        service_port=service.port if service is not None else None,
        disk_bytes=disk_bytes, entrypoint=entrypoint(agent_python) if attach else None,
    )
    sel = f"{m.RUN_ID_LABEL}={run}"
    pod_watch = Informer(http, ns_path(ns, "pods"), sel)
    claims: Claims | None = None
    watches = [pod_watch]
    pool_watch = None
    if mode == "agent-sandbox":
        claim_watch = Informer(http, ns_path(ns, m.CLAIM), sel)
        pool_watch = Informer(http, ns_path(ns, m.WARMPOOL), sel)
        watches += [claim_watch, pool_watch]
        claims = Claims(http, ns, run, images, claims=claim_watch, warmpools=pool_watch,
                        pods=pod_watch, ready_timeout=ready_timeout,
                        reuse_spares=reuse_spares, sandbox_objects=sandbox_objects)
    sessions: Presessions | None = None
    if claims is not None and agent and presessions > 0:
        sessions = Presessions(
            http, ns, run, container, images, pod_watch, claims.warm_pool_image,
            limit=presessions, python=agent_python, timeout=agent_timeout, attach=attach)
    live = LiveSandboxes(
        http, ns, run, container, images, pod_watch, sessions, agent=agent,
        python=agent_python, agent_timeout=agent_timeout, service=service, attach=attach,
        containers=agent_entrypoint)
    return Parts(
        run_id=run, throttle=throttle, http=http, images=images, watches=Watches(watches),
        claims=claims, presessions=sessions, live=live,
        pods=Pods(http, ns, run, images, pod_watch, ready_timeout),
        placement=Placement(http, ns, run, images, pod_watch),
        preflight=Preflight(
            http, ns, run, mode=mode, sandbox_objects=sandbox_objects, images=images,
            warmpools=pool_watch, controller_timeout=controller_timeout,
            controller_version=controller_version),
        deleter=Deleter(http, ns, run, delete_batch_s),
    )
