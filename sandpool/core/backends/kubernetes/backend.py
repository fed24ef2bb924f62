"""The Kubernetes backend: agent-sandbox warm pools and claims, or a plain Pod per sandbox.

``mode="agent-sandbox"`` (targets agent-sandbox ``v1beta1``): one SandboxTemplate per image
(at hydration), one SandboxWarmPool per image whose ``replicas`` the strategy sets (see
:meth:`KubernetesBackend.set_warm_target`), and one SandboxClaim per sandbox the pool holds.
``mode="pods"``: one plain Pod per sandbox, deleted after (the plain-Kubernetes baseline).

Everything created carries the label ``sandpool.io/run-id=<run_id>``; :meth:`aclose` and
:func:`gc` delete by that label, so a run removes what it made and nothing else.
Readiness and death come from one shared watch per resource (:class:`Informer`): pods, and
in agent-sandbox mode claims and warm pools.

The class is assembled from its seams: :mod:`._claims` (templates, warm pools, claims),
:mod:`._pods` (plain pods, pod status), :mod:`._preflight`, :mod:`._sandbox` (the sandbox
and its exec channel, :mod:`._exec`), :mod:`._presession` (sessions opened on warm pods) and
:mod:`._gc`. This module holds the shared state: the client, the watches, the image map and
the live sandboxes; it is ~410 lines because the constructor documents every option of the
backend in one place (about 120 of them are its docstring).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._claims import ClaimsMixin
from sandpool.core.backends.kubernetes._errors import translate
from sandpool.core.backends.kubernetes._gc import delete_run, gc
from sandpool.core.backends.kubernetes._http import KubeHttp, Throttle
from sandpool.core.backends.kubernetes._manifests import PodImage, ns_path
from sandpool.core.backends.kubernetes._pods import PodsMixin, pod_death
from sandpool.core.backends.kubernetes._preflight import PreflightMixin
from sandpool.core.backends.kubernetes._presession import PresessionMixin
from sandpool.core.backends.kubernetes._prepull import PlacementMixin
from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox
from sandpool.core.backends.kubernetes._service import PodService
from sandpool.core.backends.kubernetes._watch import Informer
from sandpool.core.base import Backend, Sandbox

__all__ = ["ExecPrefix", "ImageMap", "KubernetesBackend", "KubernetesSandbox", "PodService", "gc"]

log = logging.getLogger("sandpool.kubernetes")

#: Maps a task's ``image`` to what its pod runs: a mapping, or a function (may raise
#: ImageNotFound). None means ``PodImage(image)``: the task image is the container image.
ImageMap = Mapping[str, PodImage] | Callable[[str], PodImage]
#: ``(ready pod object, image workdir, session) -> argv`` put before every exec's argv in that
#: pod, ``session`` True for the agent session's one stream (may raise KeyError/ValueError:
#: the sandbox fails to start). Only clusters whose pod
#: exec is not a container exec need one (the kwok test cluster:
#: :func:`sandpool.testing.kwok.exec_prefix`).
ExecPrefix = Callable[[Mapping[str, Any], str, bool], Sequence[str]]

_MODES = ("agent-sandbox", "pods")
_DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}}

def kubeconfig_path() -> str:
    """The kubeconfig used when none is given: the first path of ``$KUBECONFIG``, else
    ``~/.kube/config`` (as kubectl and kubernetes_asyncio choose it)."""
    env = os.environ.get("KUBECONFIG", "")
    first = next((p for p in env.split(os.pathsep) if p), "")
    return str(Path(first or "~/.kube/config").expanduser())


class KubernetesBackend(ClaimsMixin, PodsMixin, PreflightMixin, PlacementMixin, PresessionMixin,
                        Backend):
    """Creates sandboxes as pods on a Kubernetes cluster, through agent-sandbox or directly.

    Usage::

        backend = KubernetesBackend(kubeconfig="~/.kube/config", namespace="rl",
                                    image_map={"swe/toolz:1": PodImage("mirror/toolz:1")})
        async with SandboxPool(backend, strategy="reuse") as pool:
            await pool.prepare(tasks, concurrency=64)

    Args:
        kubeconfig: Path of the kubeconfig (default: ``$KUBECONFIG`` or ``~/.kube/config``).
        namespace: Where every object is created.
        mode: ``"agent-sandbox"`` (templates, warm pools, claims) or ``"pods"`` (a plain Pod
            per sandbox).
        run_id: Label value put on everything created (default: 8 random hex digits).
        qps: Client-side sustained write requests per second.
        burst: Writes allowed back to back.
        max_inflight: REST requests in flight at once (watches and exec streams excluded).
        runtime_class: ``runtimeClassName`` of the pods (e.g. ``"gvisor"``), or None.
        node_selector: ``nodeSelector`` of the pods.
        tolerations: ``tolerations`` of the pods (Kubernetes Toleration dicts).
        resources: The container's ``resources`` (ResourceRequirements dict; default requests
            100m CPU and 256Mi memory).
        image_map: Task image -> :class:`PodImage` (see :data:`ImageMap`); for the local
            task pack on the kwok cluster use :func:`sandpool.testing.kwok.local_pack_image_map`.
        container: Container name in the pod.
        command: The container's command (it must keep running; exec does the work).
        ready_timeout: Seconds a claim or pod may take to become Ready before ``InfraTimeout``.
        exec_prefix: See :data:`ExecPrefix`; None on a real cluster. The kwok test cluster
            needs :func:`sandpool.testing.kwok.exec_prefix`.
        reuse_spares: With a reusing strategy, warm (unclaimed) replicas kept per image as
            spares for quarantined or dead sandboxes (each is one more pod).
        controller_timeout: Seconds preflight waits for the agent-sandbox controller to answer.
        controller_version: The agent-sandbox controller's version (``v1.0.3``), for
            preflight's check of the warm-pool over-creation bug; None looks for a
            Deployment running its image.
        agent: Run sandpool's agent in each pod over one long-lived exec stream (the commands
            of a sandbox never open API-server streams of their own; see :mod:`._session`).
            False, or an image where the agent cannot start (no ``agent_python``; logged once
            per image, counted in ``api_stats["agent_fallbacks"]``), uses one pod exec per
            command (:mod:`._exec`); every such sandbox counts in
            ``api_stats["fallback_sandboxes"]`` and ``sandpool_kube_exec_fallbacks_total``.
        agent_python: The interpreter command that runs the agent in the image.
        agent_timeout: Seconds the agent may take to say it is ready before the fallback.
        presessions: Open the agent session of up to this many Ready warm-pool pods before
            they are claimed (agent-sandbox mode, a strategy that claims per rollout), so
            a claim does not wait for the agent's start; see :mod:`._presession`. 0: off.
        sandbox_objects: With a reusing strategy, make each held sandbox an agent-sandbox
            Sandbox object (one write per sandbox) instead of a template, warm pool and claim
            per image (three); see :meth:`set_warm_target`.
        delete_batch_s: Batch deletes: a deleted sandbox's object is removed with the others
            of the next ``delete_batch_s`` seconds in one collection delete (by the
            per-object label ``sandpool.io/obj``); None deletes each at once.
        api_retries: Retries after the first attempt of every API request on 429, 5xx
            (honouring ``Retry-After``) and connection errors: REST, and exec handshakes (the
            agent session's stream, per-command exec, file transfer over it). Past them the
            error is an infra error (``ApiError``, ``ExecTransportError``).
        service: A long-lived process each pod starts (through its agent session) before
            its sandbox is handed out, spared by the in-place reset; its port is declared in
            the pod spec and reached with :meth:`KubernetesSandbox.open_port` (:mod:`._service`).
    """

    name = "kubernetes"

    def __init__(
        self,
        kubeconfig: str | Path | None = None,
        *,
        namespace: str = "default",
        mode: str = "agent-sandbox",
        run_id: str | None = None,
        qps: float = 50.0,
        burst: int = 100,
        max_inflight: int = 64,
        runtime_class: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        tolerations: Sequence[Mapping[str, Any]] | None = None,
        resources: Mapping[str, Any] | None = None,
        image_map: ImageMap | None = None,
        container: str = "sandbox",
        command: Sequence[str] = ("sleep", "infinity"),
        ready_timeout: float = 90.0,
        exec_prefix: ExecPrefix | None = None,
        reuse_spares: int = 0,
        controller_timeout: float = 15.0,
        controller_version: str | None = None,
        agent: bool = True,
        agent_python: str = "python3",
        agent_timeout: float = 30.0,
        sandbox_objects: bool = False,
        presessions: int = 0,
        delete_batch_s: float | None = None,
        api_retries: int = 6,
        service: PodService | None = None,
    ) -> None:
        if mode not in _MODES:
            raise errors.ConfigError(f"mode={mode!r} is not known; use one of {list(_MODES)}")
        if run_id is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?", run_id):
            raise errors.ConfigError(
                f"run_id={run_id!r} must be 1-16 lower-case letters, digits or '-'"
            )
        self.kubeconfig = str(Path(kubeconfig).expanduser()) if kubeconfig else None
        self.namespace = namespace
        self.mode = mode
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.throttle = Throttle(qps, burst, max_inflight)
        self.runtime_class = runtime_class
        self.node_selector = dict(node_selector or {})
        self.tolerations = [dict(t) for t in tolerations or []]
        self.resources = dict(resources or _DEFAULT_RESOURCES)
        self.image_map = image_map
        self.container = container
        self.command = list(command)
        self.ready_timeout = ready_timeout
        self.exec_prefix = exec_prefix
        self.reuse_spares = reuse_spares
        self.controller_timeout = controller_timeout
        self.controller_version = controller_version
        self.agent = agent
        self.agent_python = agent_python
        self.agent_timeout = agent_timeout
        self.presessions = presessions
        self.presessions_adopted = 0
        self._pre: dict = {}  # pod -> its pre-opened session (._presession)
        self._pre_closing: set[asyncio.Task[None]] = set()
        self._image_of_key: dict[str, str] = {}  # image label value -> warm pool image
        self.agent_fallbacks = 0  # images whose agent could not start
        self.fallback_sandboxes = 0  # sandboxes whose commands each open a pod exec
        self._agent_unavailable: dict[str, str] = {}  # image -> why the agent cannot run
        self.sandbox_objects = sandbox_objects
        self.delete_batch_s = delete_batch_s
        if api_retries < 0:
            raise errors.ConfigError(f"api_retries={api_retries} must be 0 or more")
        self.api_retries = api_retries
        self.service = service
        self._direct: set[str] = set()  # images whose sandboxes are Sandbox objects
        self._pending_deletes: dict[str, set[str]] = {}  # resource -> names (batched)
        self._flusher: asyncio.Task[None] | None = None
        self._node_of: dict[str, str] = {}  # image -> node (placement: required affinity)
        self._http: KubeHttp | None = None  # type: ignore[assignment]
        self._client: Any = None
        self._start_lock = asyncio.Lock()
        self._pods: Informer | None = None
        self._claims: Informer | None = None
        self._warmpools: Informer | None = None
        self._images: dict[str, PodImage] = {}
        self._templates: dict[str, str] = {}  # image -> template name
        self._pools: dict[str, tuple[str, int]] = {}  # image -> (warm pool name, replicas)
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self._live: dict[str, KubernetesSandbox] = {}
        self._by_pod: dict[str, KubernetesSandbox] = {}
        self._seq = itertools.count(1)
        self._preflight_ok = False
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<KubernetesBackend {self.mode} ns={self.namespace} run={self.run_id} "
            f"live={len(self._live)} images={len(self._images)} writes={self.api_writes}>"
        )

    @property
    def api_writes(self) -> int:
        """Write requests (POST/PUT/PATCH/DELETE, every attempt) this backend sent."""
        return self._http.writes if self._http is not None else 0

    @property
    def api_stats(self) -> dict[str, Any]:
        """Requests sent, by kind: writes (and ``writes_by`` verb and resource), reads, exec
        streams opened, agent fallbacks (images whose agent could not start), fallback
        sandboxes (whose commands each open a pod exec), retries (REST, watch and exec
        handshakes), in-flight peak."""
        h = self._http
        if h is None:
            return {}
        return {
            "writes": h.writes,
            "reads": h.reads,
            "execs": h.execs,
            "agent_fallbacks": self.agent_fallbacks,
            "presessions_adopted": self.presessions_adopted,
            "fallback_sandboxes": self.fallback_sandboxes,
            "retried": h.retried,
            "inflight_peak": self.throttle.inflight_peak,
            "writes_by": dict(h.writes_by),
        }

    # -- client and watches ------------------------------------------------------------------

    async def _ensure_client(self) -> KubeHttp:
        if self._closed:
            raise errors.PoolClosed("this KubernetesBackend was closed; make a new one")
        if self._http is not None:
            return self._http
        async with self._start_lock:
            if self._http is None:
                try:
                    from kubernetes_asyncio.client import ApiClient, Configuration
                    from kubernetes_asyncio.config import load_kube_config
                except ImportError as exc:
                    raise errors.BackendUnavailable(
                        "the kubernetes backend needs kubernetes_asyncio; install sandpool[kubernetes]"
                    ) from exc
                cfg = Configuration()
                path = self.kubeconfig or kubeconfig_path()
                if not Path(path).is_file():
                    raise errors.BackendUnavailable(
                        f"kubeconfig {path} does not exist; pass kubeconfig=, set $KUBECONFIG, "
                        "or start the test cluster (hack/cluster/cluster.py up)"
                    )
                try:
                    await load_kube_config(
                        config_file=path, client_configuration=cfg, persist_config=False
                    )
                except Exception as exc:  # noqa: BLE001 - translated at the one boundary
                    raise translate(exc, f"loading kubeconfig {path}") from exc
                cfg.connection_pool_maxsize = 0  # unbounded sockets: the Throttle bounds REST
                self._client = ApiClient(configuration=cfg)
                self._http = KubeHttp(self._client, self.throttle, retries=self.api_retries)
                self._http.telemetry = self.telemetry  # the pool's (set when it took this backend)
        return self._http

    async def _ensure_watches(self) -> None:
        await self._ensure_client()
        sel = f"{m.RUN_ID_LABEL}={self.run_id}"
        async with self._start_lock:
            if self._pods is None:
                pods = Informer(self._http, ns_path(self.namespace, "pods"), sel)
                await pods.start()
                pods.subscribe(None, self._on_pod)
                self._pods = pods
            if self.mode == "agent-sandbox" and self._claims is None:
                claims = Informer(self._http, ns_path(self.namespace, m.CLAIM), sel)
                pools = Informer(self._http, ns_path(self.namespace, m.WARMPOOL), sel)
                await asyncio.gather(claims.start(), pools.start())
                self._claims, self._warmpools = claims, pools

    def _on_pod(self, pod: dict[str, Any] | None) -> None:
        # Death detection for every live sandbox, from the one shared pod watch.
        if pod is None:
            for name, sb in list(self._by_pod.items()):
                if self._pods is not None and self._pods.get(name) is None:
                    sb._mark_dead("the pod was deleted")
            for name in list(self._pre):
                if self._pods is not None and self._pods.get(name) is None:
                    self._drop_presession(name)
            return
        if self.presessions:
            self._presession_on_pod(pod)
        sb = self._by_pod.get(pod["metadata"]["name"])
        if sb is not None and (why := pod_death(pod, sb.pod_uid)):
            sb._mark_dead(why)

    # -- images ------------------------------------------------------------------------------

    def _pod_spec(self, pi: PodImage, image: str | None = None) -> dict[str, Any]:
        spec = m.pod_spec(
            pi,
            container=self.container,
            command=self.command,
            resources=self.resources,
            runtime_class=self.runtime_class,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            node=self._node_of.get(image) if image is not None else None,
        )
        if self.service is not None:
            spec["containers"][0]["ports"] = [{"name": "service", "containerPort": self.service.port}]
        return spec

    def _obj_name(self, image: str) -> str:
        return f"sp-{self.run_id}-{m.slug(image)}-{m.image_key(image)}"

    # -- create / delete ---------------------------------------------------------------------

    async def create(self, image: str) -> KubernetesSandbox:
        """Claim (agent-sandbox) or create (pods) a sandbox of ``image``; return once it is Ready.

        Raises:
            ImageNotFound: Unknown or invalid image.
            SandboxStartError: The claim or pod failed (image pull, unschedulable, provisioning,
                terminal claim condition); surfaced as soon as the watch shows it.
            InfraTimeout: Not Ready within ``ready_timeout``.
            ApiError, BackendUnavailable: The API refused or kept failing.
        """
        await self.hydrate(image)
        await self._ensure_watches()
        n = next(self._seq)
        if self.mode == "pods":
            return await self._create_pod(image, n)
        if image in self._direct:
            return await self._create_sandbox_object(image, n)
        return await self._create_claim(image, n)

    async def delete(self, sandbox: Sandbox) -> None:
        """Delete the sandbox's SandboxClaim or Sandbox (the controller deletes its pod) or
        its pod (at once, or batched: ``delete_batch_s``).

        Idempotent; never raises for a sandbox that is already gone, and logs (does not
        raise) an API failure, which ``sandpool gc --run-id`` cleans up later.
        """
        assert isinstance(sandbox, KubernetesSandbox)
        self._live.pop(sandbox.id, None)
        if self._by_pod.get(sandbox.pod) is sandbox:
            del self._by_pod[sandbox.pod]
        sandbox._mark_dead("deleted by sandpool")
        await sandbox._close_session()
        await self._delete_object(*sandbox.owner)

    async def aclose(self) -> None:
        """Delete everything this run made (by its run-id label) and close the client.

        Never raises for a failed delete: it logs a warning naming the ``sandpool gc`` command.
        """
        if self._closed:
            return
        try:
            await self._close_presessions()
            live = list(self._live.values())
            for sb in live:
                sb._mark_dead("backend closed")
            await asyncio.gather(*(sb._close_session() for sb in live))
            if self._flusher is not None:
                self._flusher.cancel()  # the delete by run id below removes what it held
            self._live.clear()
            self._by_pod.clear()
            if self._http is not None and self._http.writes:  # it may have created something
                try:
                    await delete_run(self._http, self.namespace, self.run_id)
                except errors.SandpoolError as exc:
                    log.warning(
                        "could not delete run %s's objects in %s: %s; run `sandpool gc "
                        "--run-id %s --namespace %s`",
                        self.run_id,
                        self.namespace,
                        exc,
                        self.run_id,
                        self.namespace,
                    )
        finally:
            self._closed = True
            for inf in (self._pods, self._claims, self._warmpools):
                if inf is not None:
                    await inf.aclose()
            if self._client is not None:
                await self._client.close()


