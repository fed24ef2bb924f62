"""The Kubernetes backend: agent-sandbox warm pools and claims, or a plain Pod per sandbox.

``mode="agent-sandbox"`` (targets agent-sandbox ``v1beta1``): one SandboxTemplate per image
(at hydration), one SandboxWarmPool per image whose ``replicas`` the strategy sets (see
:meth:`KubernetesBackend.set_warm_target`), and one SandboxClaim per sandbox the pool holds.
``mode="pods"``: one plain Pod per sandbox, deleted after (the plain-Kubernetes baseline).

Everything created carries the label ``sandpool.io/run-id=<run_id>``; :meth:`aclose` and
:func:`gc` delete by that label, so a run removes what it made and nothing else.
Readiness and death come from one shared watch per resource (:class:`~._watch.Informer`):
pods, and in agent-sandbox mode claims and warm pools.

The backend is composed of parts (the package's layout), each given what it uses when it is
made (:mod:`._parts` makes them from the backend's options); no part reads another's state.
``create`` is the one place that sequences them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sandpool.core import changeset, errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes import _suspend
from sandpool.core.backends.kubernetes._gc import gc
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._images import ImageMap
from sandpool.core.backends.kubernetes._parts import make_parts
from sandpool.core.backends.kubernetes._placement import PlacementPlan
from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox
from sandpool.core.base import Backend, Sandbox
from sandpool.core.rate import AdaptiveRate
from sandpool.core.paths import sandpool_home
from sandpool.core.service import ServiceSpec
from sandpool.core.snapshot import Snapshot
from sandpool.core.telemetry import Telemetry

__all__ = ["ImageMap", "KubernetesBackend", "KubernetesSandbox", "gc"]


class KubernetesBackend(Backend):
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
        qps: Client-side write requests per second: the start, and the most the adaptive
            rate climbs back to (see ``adaptive_rate``).
        burst: Writes allowed back to back at ``qps``.
        adaptive_rate: Let the write rate follow this cluster's answers: 429, ``Retry-After``,
            5xx, lost connections and writes slower than 1 s back it off, fast writes bring it
            back (:mod:`sandpool.core.rate`). False keeps ``qps`` fixed.
        cluster: The cluster's name in reports and metrics (default: the API server's
            host:port).
        max_inflight: REST requests in flight at once (watches and exec streams excluded).
        runtime_class: ``runtimeClassName`` of the pods (e.g. ``"gvisor"``), or None.
        node_selector: ``nodeSelector`` of the pods.
        tolerations: ``tolerations`` of the pods (Kubernetes Toleration dicts).
        resources: The container's ``resources`` (ResourceRequirements dict; default requests
            100m CPU and 256Mi memory).
        image_map: Task image -> :class:`PodImage` (see :data:`ImageMap`).
        container: Container name in the pod.
        command: The container's command (it must keep running; exec does the work).
        ready_timeout: Seconds a claim or pod may take to become Ready before ``InfraTimeout``.
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
        presessions: Open the agent session of up to this many Ready warm-pool pods, and
            record their pristine state through it, before they are claimed (agent-sandbox
            mode, a strategy that claims per rollout), so a warm claim is exec-ready; the
            bound grows to the warm targets the pool announces. See :mod:`._presession`.
            0: off.
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
            the pod spec and reached with :meth:`KubernetesSandbox.connect_service`
            (:mod:`._service`). No ``binds``: no host directory is bound into a pod.
        disk_bytes: Cap in bytes on what a sandbox writes: its workdir (the image's, copied
            in), ``/tmp`` and service directory on a memory-backed volume of that size (ENOSPC
            in the pod past it), the rest of the root read-only (``_manifests.scratch_volume``).
            None: no cap (the volume on the node's disk with ``agent_entrypoint``, else none).
        agent_entrypoint: Make the agent its container's pid 1 (over ``pods/attach``;
            :mod:`._entrypoint`), out of the policy's reach, and every pod's root read-only
            (see ``disk_bytes``); the reset holds what else a pod can write (``/dev``...) to
            its fresh record, never passing a pod without the agent (:meth:`KubernetesSandbox.
            changes_outside_repo`). Use it where nodes run containers; off, the agent is
            exec'd into a container that sleeps (a kwok node runs no container command).
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
        adaptive_rate: bool = True,
        cluster: str | None = None,
        max_inflight: int = 64,
        runtime_class: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        tolerations: Sequence[Mapping[str, Any]] | None = None,
        resources: Mapping[str, Any] | None = None,
        image_map: ImageMap | None = None,
        container: str = "sandbox",
        command: Sequence[str] = ("sleep", "infinity"),
        ready_timeout: float = 90.0,
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
        service: ServiceSpec | None = None,
        disk_bytes: int | None = None,
        agent_entrypoint: bool = False,
    ) -> None:
        self.kubeconfig = str(Path(kubeconfig).expanduser()) if kubeconfig else None
        self.namespace = namespace
        self.mode = mode
        parts = make_parts(
            kubeconfig=self.kubeconfig, namespace=namespace, mode=mode, run_id=run_id, qps=qps,
            burst=burst, adaptive_rate=adaptive_rate, cluster=cluster, max_inflight=max_inflight,
            runtime_class=runtime_class, node_selector=node_selector, tolerations=tolerations,
            resources=resources, image_map=image_map, container=container, command=command,
            ready_timeout=ready_timeout, reuse_spares=reuse_spares, agent=agent,
            controller_timeout=controller_timeout, controller_version=controller_version,
            agent_python=agent_python, agent_timeout=agent_timeout, presessions=presessions,
            sandbox_objects=sandbox_objects, delete_batch_s=delete_batch_s, service=service,
            api_retries=api_retries, disk_bytes=disk_bytes, agent_entrypoint=agent_entrypoint)
        self.run_id, self.throttle, self._http = parts.run_id, parts.throttle, parts.http
        self._images, self._watches, self._claims = parts.images, parts.watches, parts.claims
        self._presessions, self._live, self._pods = parts.presessions, parts.live, parts.pods
        self._placement, self._preflight = parts.placement, parts.preflight
        self._deleter = parts.deleter
        self._sandbox_objects = sandbox_objects
        self._announced: dict[str, int] = {}  # image -> warm sandboxes claimed per rollout
        #: Snapshot change sets of this run's pods, on this host (removed with the run).
        self.snapshots = sandpool_home() / "kube-snapshots" / self.run_id
        self._seq = itertools.count(1)
        self._preflight_ok = False
        self._closed = False

    def __repr__(self) -> str:
        return (f"<KubernetesBackend {self.mode} ns={self.namespace} run={self.run_id} "
                f"live={len(self._live)} images={len(self._images)} writes={self.api_writes}>")

    @property  # type: ignore[override]
    def telemetry(self) -> Telemetry:
        """Where control-plane requests are recorded (set by the pool that takes it)."""
        return self._http.telemetry

    @telemetry.setter
    def telemetry(self, value: Telemetry) -> None:
        self._http.telemetry = value

    @property
    def api_writes(self) -> int:
        """Write requests (POST/PUT/PATCH/DELETE, every attempt) this backend sent."""
        return self._http.writes

    @property
    def write_rates(self) -> dict[str, AdaptiveRate]:
        """This cluster's write bucket, by the cluster's name."""
        return {self.throttle.rate.cluster: self.throttle.rate}

    @property
    def api_execs(self) -> int:
        """Exec and attach streams this backend opened (agent sessions, per-command execs)."""
        return self._http.execs

    @property
    def presessions_adopted(self) -> int:
        """Claims that adopted a session opened on their warm pod (see ``presessions``)."""
        return self._presessions.adopted if self._presessions is not None else 0

    @property
    def api_stats(self) -> dict[str, Any]:
        """Requests sent, by kind: writes (and ``writes_by`` verb and resource), reads, exec
        streams opened, agent fallbacks (images whose agent could not start), fallback
        sandboxes (whose commands each open a pod exec), retries (REST, watch and exec
        handshakes), in-flight peak."""
        h, live = self._http, self._live
        return {"writes": h.writes, "reads": h.reads, "execs": h.execs,
                "agent_fallbacks": live.agent_fallbacks,
                "presessions_adopted": self.presessions_adopted,
                "fallback_sandboxes": live.fallback_sandboxes, "retried": h.retried,
                "inflight_peak": self.throttle.inflight_peak, "writes_by": dict(h.writes_by)}

    async def _client(self) -> KubeHttp:
        """The HTTP layer, open.

        Raises:
            PoolClosed: After :meth:`aclose`.
            BackendUnavailable: The kubeconfig is missing or cannot be used.
        """
        if self._closed:
            raise errors.PoolClosed("this KubernetesBackend was closed; make a new one")
        await self._http.open()
        return self._http

    async def _watch(self) -> None:
        """List and start every watch of the run, once."""
        await self._client()
        await self._watches.start()

    # -- images, warm pools, placement -------------------------------------------------------

    async def hydrate(self, image: str) -> None:
        """Validate ``image`` and (agent-sandbox mode) create its SandboxTemplate once.

        With ``sandbox_objects`` the template is made only when a warm pool needs it (a
        reusing strategy's Sandbox objects carry their pod template themselves).

        Raises:
            ImageNotFound: Not in the image map (or the map raised it), or an invalid image
                reference.
            BackendUnavailable, ApiError, ConfigError: The template could not be created.
        """
        self._images.resolve(image)
        if self._claims is not None and not self._sandbox_objects:
            await self._client()
            await self._claims.hydrate(image)

    async def set_warm_target(self, image: str, n: int, *, reuse: bool) -> int:
        """Apply the strategy's warm target for ``image``; return how many the pool keeps itself.

        agent-sandbox mode: see :meth:`Claims.set_warm_target` (the SandboxWarmPool holds
        the warm sandboxes without reuse; with reuse only ``reuse_spares`` spares).
        pods mode: the pool keeps ``n`` warm pods itself (returns ``n``).
        """
        if self._claims is None:
            return n
        await self._client()
        kept = await self._claims.set_warm_target(image, n, reuse=reuse)
        if self._presessions is not None:  # sessions for every warm sandbox claimed per rollout
            self._announced[image] = n - kept
            self._presessions.announce(sum(self._announced.values()))
        return kept

    async def wait_warm(self) -> None:
        """Wait until every SandboxWarmPool of this run has its replicas Ready (shared watch)
        and, with ``presessions``, their pods exec-ready (see :meth:`Presessions.settle`;
        at most ``agent_timeout`` more).

        Raises:
            InfraTimeout: Not within 4 x ``ready_timeout``.
        """
        if self._claims is None or not self._claims.warm_pools:
            return
        await self._watch()
        await self._claims.wait_warm()
        if self._presessions is not None:
            await self._presessions.settle(self._announced, self._live.agent_timeout)

    async def place(self, images: Sequence[str], sizes: Mapping[str, float],
                    **kw: Any) -> PlacementPlan:
        """Plan ``images`` onto the schedulable nodes and steer their pods there; see
        :meth:`Placement.place` (the arguments and errors). Call before :meth:`hydrate`."""
        await self._client()
        return await self._placement.place(images, sizes, **kw)

    def pin_nodes(self, node_of: Mapping[str, str]) -> None:
        """Steer each image's pods to its node (image -> node, e.g. a plan's ``node_of``
        from another backend's :meth:`place`). Call before :meth:`hydrate`."""
        self._images.pin(node_of)

    async def prepull(self, window: Mapping[str, str], *, name: str,
                      timeout: float = 1800) -> dict[str, Any]:
        """Pull each node's images of ``window`` (image -> node) onto it; see
        :meth:`Placement.prepull` (the result and errors)."""
        await self._watch()
        return await self._placement.prepull(window, name=name, timeout=timeout)

    async def preflight(self) -> None:
        """Check the cluster can run this backend; raise one clear sentence if not.

        Checks, in order: the kubeconfig loads; the API answers; the namespace exists; the
        agent-sandbox CRDs are served (agent-sandbox mode); RBAC allows every verb the
        backend uses (SelfSubjectAccessReview); the runtime class exists; the agent-sandbox
        controller reconciles (a probe SandboxWarmPool of 0 replicas gets a status).

        Raises:
            BackendUnavailable: With the failed check and its fix.
        """
        if self._preflight_ok:
            return
        await self._client()
        await self._preflight.check_cluster()
        await self._watch()
        if self.mode == "agent-sandbox":
            await self._preflight.check_controller()
        self._preflight_ok = True

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
        await self._watch()
        n = next(self._seq)
        claims, claim = self._claims, None
        if claims is None:
            owner = ("pods", await self._pods.create(image, n))
        elif claims.is_direct(image):
            owner = (m.SANDBOX, await claims.create_sandbox(image, n))
        else:
            claim = await claims.create_claim(image, n)
            owner = (m.CLAIM, claim)
        try:
            pod_name = owner[1]
            if claims is not None and claim is not None:
                pod_name = await claims.wait_bound(claim)
            pod = await self._pods.wait_ready(pod_name)
            sb = await self._live.start(image, pod, owner[1], claim, owner)
            sb.snapshots = self.snapshots
            sb.sandbox_name = pod_name if claims is not None else None
            return sb
        except BaseException:
            await self._deleter.delete(*owner)
            raise

    async def delete(self, sandbox: Sandbox) -> None:
        """Delete the sandbox's SandboxClaim or Sandbox (the controller deletes its pod) or
        its pod (at once, or batched: ``delete_batch_s``).

        Idempotent; never raises for a sandbox that is already gone, and logs (does not
        raise) an API failure, which ``sandpool gc --run-id`` cleans up later.
        """
        assert isinstance(sandbox, KubernetesSandbox)
        await self._live.remove(sandbox)
        await self._deleter.delete(*sandbox.owner)

    # -- suspend / resume: the Sandbox's spec.operatingMode (see _suspend) -----------------

    async def park(self, sandbox: Sandbox) -> bool:
        """Release the sandbox's pod, keeping its Sandbox object and claim; see
        :func:`._suspend.park` (False for a plain pod: the pool deletes it)."""
        assert isinstance(sandbox, KubernetesSandbox)
        if self._claims is None:
            return False
        return await _suspend.park(sandbox, self._live, self._claims, self._pods)

    async def unpark(self, sandbox: Sandbox) -> KubernetesSandbox:
        """A sandbox on the new pod of a parked sandbox's Sandbox; see :func:`._suspend.unpark`."""
        assert isinstance(sandbox, KubernetesSandbox) and self._claims is not None
        sb = await _suspend.unpark(sandbox, self._live, self._claims, self._pods)
        sb.snapshots = self.snapshots
        return sb

    async def discard_snapshot(self, snap: Snapshot, *, keep: Snapshot | None = None) -> None:
        """Remove ``snap``'s change set from this run's store (unless ``keep`` holds it)."""
        changeset.discard(self.snapshots, snap, keep)

    async def aclose(self) -> None:
        """Delete everything this run made (by its run-id label) and close the client.

        Never raises for a failed delete: it logs a warning naming the ``sandpool gc`` command.
        """
        if self._closed:
            return
        try:
            if self._presessions is not None:
                await self._presessions.aclose()
            await self._live.aclose()
            if self._http.writes:  # it may have created something
                await self._deleter.delete_run()
        finally:
            self._closed = True
            changeset.remove_store(self.snapshots)
            await self._watches.aclose()
            await self._http.aclose()
