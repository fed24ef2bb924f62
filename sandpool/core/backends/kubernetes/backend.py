"""The Kubernetes backend: agent-sandbox warm pools and claims, or a plain Pod per sandbox.

``mode="agent-sandbox"`` (targets agent-sandbox ``v1beta1``): one SandboxTemplate per image
(at hydration), one SandboxWarmPool per image whose ``replicas`` the strategy sets (see
:meth:`KubernetesBackend.set_warm_target`), and one SandboxClaim per sandbox the pool holds.
``mode="pods"``: one plain Pod per sandbox, deleted after (the plain-Kubernetes baseline).

Everything created carries the label ``sandpool.io/run-id=<run_id>``; :meth:`aclose` and
:func:`gc` delete by that label, so a run removes what it made and nothing else.
Readiness and death come from one shared watch per resource (:class:`Informer`): pods, and
in agent-sandbox mode claims and warm pools.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._errors import translate
from sandpool.core.backends.kubernetes._exec import PROCS, ExecTarget, build_argv, run_exec
from sandpool.core.backends.kubernetes._http import KubeHttp, Throttle
from sandpool.core.backends.kubernetes._manifests import PodImage
from sandpool.core.backends.kubernetes._watch import Informer
from sandpool.core.base import Backend, ExecResult, Sandbox

__all__ = ["ImageMap", "KubernetesBackend", "KubernetesSandbox", "gc", "local_pack_image_map"]

log = logging.getLogger("sandpool.kubernetes")

#: Maps a task's ``image`` to what its pod runs: a mapping, or a function (may raise
#: ImageNotFound). None means ``PodImage(image)``: the task image is the container image.
ImageMap = Mapping[str, PodImage] | Callable[[str], PodImage]

_MODES = ("agent-sandbox", "pods")
_DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}}
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
_CLAIM_TERMINAL = frozenset(
    {
        "TemplateNotFound",
        "WarmPoolNotFound",
        "InvalidMetadata",
        "EnvVarsInjectionRejected",
        "VolumeClaimTemplatesError",
        "ClaimExpired",
        "SandboxExpired",
    }
)
_FILE_CHUNK = 48 << 10  # bytes per write_file exec (base64 in one argv element < 128 KiB)


def local_pack_image_map(images_root: Path | str | None = None) -> Callable[[str], PodImage]:
    """The image map that runs the local task pack's images on the local (kwok) cluster.

    Task image ``name`` becomes ``PodImage(image=name, workdir_source=<its repo dir>)``, with
    the image's venv on ``PATH``: ``<images_root>/<safe name>/image.json`` (the local
    backend's image directory, :func:`sandpool.core.backends.local.image_dir`) gives the
    repo the cluster copies into each pod's workdir, so the same tasks run on both backends.
    The image name itself is only a label on kwok (nothing is pulled).

    Raises (when called):
        ImageNotFound: The image directory is missing or malformed.
    """
    from sandpool.core.backends.local import LocalBackend

    local = LocalBackend(images_root)

    def resolve(name: str) -> PodImage:
        img = local.image(name)
        return PodImage(
            image=name,
            workdir=img.workdir,
            workdir_source=img.repo,
            head=img.head,
            env={
                "VIRTUAL_ENV": img.venv,
                "PATH": f"{img.venv}/bin:/usr/local/bin:/usr/bin:/bin",
                "HOME": "/tmp",
                "LANG": "C.UTF-8",
                "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_AUTHOR_NAME": "sandbox",
                "GIT_AUTHOR_EMAIL": "sandbox@localhost",
                "GIT_COMMITTER_NAME": "sandbox",
                "GIT_COMMITTER_EMAIL": "sandbox@localhost",
            },
        )

    return resolve


class KubernetesSandbox(Sandbox):
    """One pod (claimed through a SandboxClaim, or created directly) spoken to over exec.

    Created by :meth:`KubernetesBackend.create`; not constructed directly.

    Attributes:
        pod: The pod name.
        pod_uid: The pod's UID when it became Ready (a pod re-created under the same name is
            a different sandbox: this one counts as dead).
        claim: The SandboxClaim name (agent-sandbox mode), else None.
        protocol: The exec channel protocol last negotiated (``v5.channel.k8s.io``...).
    """

    def __init__(
        self,
        backend: KubernetesBackend,
        sid: str,
        image: str,
        target: ExecTarget,
        pod_uid: str,
        claim: str | None,
    ) -> None:
        self.id = sid
        self.image = image
        self.workdir = target.workdir
        self.pod = target.pod
        self.pod_uid = pod_uid
        self.claim = claim
        self.protocol: str | None = None
        self._backend = backend
        self._target = target
        self._seq = itertools.count(1)
        self._dead: str | None = None

    def __repr__(self) -> str:
        state = f"dead: {self._dead}" if self._dead else "alive"
        return f"<KubernetesSandbox {self.id} pod={self.pod} claim={self.claim} {state}>"

    def alive(self) -> bool:
        """False once the shared pod watch saw the pod deleted, evicted, failed or replaced."""
        return self._dead is None

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason

    def _died(self) -> errors.SandboxDied:
        return errors.SandboxDied(
            f"sandbox {self.id} (pod {self._target.namespace}/{self.pod}): {self._dead}"
        )

    def _abs(self, path: str) -> str:
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self.workdir) / p)

    async def _run(
        self,
        cmd: str | list[str],
        *,
        timeout: float,
        cwd: str | None,
        env: dict[str, str] | None,
        max_output: int,
    ) -> tuple[ExecResult, str]:
        if self._dead is not None:
            raise self._died()
        exec_id = f"{self.id}.{next(self._seq)}"
        argv = build_argv(
            self._target,
            exec_id,
            cmd,
            timeout=timeout,
            cwd=self._abs(cwd or self.workdir),
            env=env or {},
            max_output=max_output,
        )
        try:
            res, self.protocol = await run_exec(
                self._backend._http, self._target, argv, timeout=timeout, max_output=max_output
            )
        except errors.ExecTransportError:
            if self._dead is not None:  # the stream broke because the pod went away
                raise self._died() from None
            raise
        if self._dead is not None:  # the pod died while the command ran: its result is void
            raise self._died()
        return res, exec_id

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output: int = 1 << 20,
    ) -> ExecResult:
        """Run ``cmd`` in the pod through the exec subresource; see :meth:`Sandbox.exec`.

        Raises:
            SandboxDied: The pod was deleted, evicted, OOM-killed or replaced.
            ExecTransportError: The WebSocket failed or ended without an exit status.
        """
        return (await self._run(cmd, timeout=timeout, cwd=cwd, env=env, max_output=max_output))[0]

    async def read_file(self, path: str) -> bytes:
        """Return the bytes of ``path`` (``cat`` over binary frames); see :meth:`Sandbox.read_file`.

        Raises:
            FileNotFoundError: No such regular file in the pod.
            SandboxDied, ExecTransportError: As :meth:`exec`.
        """
        res = await self.exec(
            ["/bin/sh", "-c", '[ -f "$1" ] || exit 44; exec cat -- "$1"', "sh", self._abs(path)],
            timeout=120.0,
            max_output=1 << 31,
        )
        if res.exit_code == 44:
            raise FileNotFoundError(f"{path} in sandbox {self.id}: not a regular file")
        if not res.ok:
            raise errors.ExecTransportError(
                f"reading {path} in sandbox {self.id} failed "
                f"(exit {res.exit_code}): {res.err_text.strip()[:200]}"
            )
        return res.stdout

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` as base64 chunks over exec, then rename into place.

        Raises:
            SandboxDied, ExecTransportError: As :meth:`exec`; also when the pod refuses the write.
        """
        dest = self._abs(path)
        chunks = [data[i : i + _FILE_CHUNK] for i in range(0, len(data), _FILE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            script = 'set -e; mkdir -p "$(dirname "$1")"; ' if i == 0 else "set -e; "
            script += 'printf %s "$2" | base64 -d ' + (
                '> "$1.sp-part"' if i == 0 else '>> "$1.sp-part"'
            )
            if last:
                script += '; chmod "$3" "$1.sp-part"; mv -f "$1.sp-part" "$1"'
            res = await self.exec(
                [
                    "/bin/sh",
                    "-c",
                    script,
                    "sh",
                    dest,
                    base64.b64encode(chunk).decode(),
                    f"{mode:o}",
                ],
                timeout=120.0,
            )
            if not res.ok:
                raise errors.ExecTransportError(
                    f"writing {path} in sandbox {self.id} failed (exit {res.exit_code}): "
                    f"{res.err_text.strip()[:200]}"
                )

    async def processes(self) -> list[str]:
        """Command lines of the processes started by this sandbox's execs, except the asking one.

        Only processes carrying this sandbox's ``SANDPOOL_SANDBOX`` marker are seen: on kwok
        the pod's exec runs on the host, and host processes are never listed or touched.
        """
        res = await self._run(
            ["/bin/sh", "-c", PROCS, "sh", self.id, "list"],
            timeout=30.0,
            cwd="/",
            env=None,
            max_output=1 << 20,
        )
        return [line for line in res[0].text.splitlines() if line.strip()]

    async def kill_strays(self) -> int:
        """SIGKILL every process carrying this sandbox's marker but the asking exec; return how many."""
        res = await self._run(
            ["/bin/sh", "-c", PROCS, "sh", self.id, "kill"],
            timeout=30.0,
            cwd="/",
            env=None,
            max_output=1 << 20,
        )
        try:
            return int(res[0].text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise errors.ExecTransportError(
                f"kill_strays in sandbox {self.id}: unexpected answer {res[0].text[:100]!r}"
            ) from None


def _cond(obj: Mapping[str, Any] | None, ctype: str) -> Mapping[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """True when the pod is Running with its Ready condition True."""
    c = _cond(pod, "Ready")
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
    sched = _cond(pod, "PodScheduled")
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


def _ns_path(namespace: str, resource: str) -> str:
    if resource == "pods":
        return f"/api/v1/namespaces/{namespace}/pods"
    return f"/apis/{m.EXT_GROUP}/{m.VERSION}/namespaces/{namespace}/{resource}"


class KubernetesBackend(Backend):
    """Creates sandboxes as pods on a Kubernetes cluster, through agent-sandbox or directly.

    Usage::

        backend = KubernetesBackend(kubeconfig="~/.kube/config", namespace="rl",
                                    image_map=local_pack_image_map())   # kwok test cluster
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
            cluster use :func:`local_pack_image_map`.
        container: Container name in the pod.
        command: The container's command (it must keep running; exec does the work).
        ready_timeout: Seconds a claim or pod may take to become Ready before ``InfraTimeout``.
        host_exec: True when pod exec runs on the node host (kwok), which confines each exec
            to the pod's workdir and private ``/tmp`` (see :mod:`._exec`); None detects it
            from the pod annotation ``sandpool.io/workdir`` the local cluster sets.
        reuse_spares: With a reusing strategy, warm (unclaimed) replicas kept per image as
            spares for quarantined or dead sandboxes (each is one more pod).
        controller_timeout: Seconds preflight waits for the agent-sandbox controller to answer.
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
        host_exec: bool | None = None,
        reuse_spares: int = 0,
        controller_timeout: float = 15.0,
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
        self.host_exec = host_exec
        self.reuse_spares = reuse_spares
        self.controller_timeout = controller_timeout
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
    def api_stats(self) -> dict[str, int]:
        """Requests sent, by kind: writes, reads, exec streams, retries, in-flight peak."""
        h = self._http
        if h is None:
            return {}
        return {
            "writes": h.writes,
            "reads": h.reads,
            "execs": h.execs,
            "retried": h.retried,
            "inflight_peak": self.throttle.inflight_peak,
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
                try:
                    await load_kube_config(
                        config_file=self.kubeconfig, client_configuration=cfg, persist_config=False
                    )
                except Exception as exc:  # noqa: BLE001 - translated at the one boundary
                    raise translate(
                        exc, f"loading kubeconfig {self.kubeconfig or '(default)'}"
                    ) from exc
                cfg.connection_pool_maxsize = 0  # unbounded sockets: the Throttle bounds REST
                self._client = ApiClient(configuration=cfg)
                self._http = KubeHttp(self._client, self.throttle)
        return self._http

    async def _ensure_watches(self) -> None:
        await self._ensure_client()
        sel = f"{m.RUN_ID_LABEL}={self.run_id}"
        async with self._start_lock:
            if self._pods is None:
                pods = Informer(self._http, _ns_path(self.namespace, "pods"), sel)
                await pods.start()
                pods.subscribe(None, self._on_pod)
                self._pods = pods
            if self.mode == "agent-sandbox" and self._claims is None:
                claims = Informer(self._http, _ns_path(self.namespace, m.CLAIM), sel)
                pools = Informer(self._http, _ns_path(self.namespace, m.WARMPOOL), sel)
                await asyncio.gather(claims.start(), pools.start())
                self._claims, self._warmpools = claims, pools

    def _on_pod(self, pod: dict[str, Any] | None) -> None:
        # Death detection for every live sandbox, from the one shared pod watch.
        if pod is None:
            for name, sb in list(self._by_pod.items()):
                if self._pods is not None and self._pods.get(name) is None:
                    sb._mark_dead("the pod was deleted")
            return
        sb = self._by_pod.get(pod["metadata"]["name"])
        if sb is not None and (why := pod_death(pod, sb.pod_uid)):
            sb._mark_dead(why)

    # -- preflight ---------------------------------------------------------------------------

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
        http = await self._ensure_client()
        try:
            await http.request("GET", "/version")
        except errors.InfraError as exc:
            raise errors.BackendUnavailable(
                f"the Kubernetes API at {http.host} is not reachable ({exc}); start the cluster "
                "or fix the kubeconfig"
            ) from None
        try:
            ns = await http.request("GET", f"/api/v1/namespaces/{self.namespace}", ok_missing=True)
        except errors.BackendUnavailable:  # may not read namespaces: the RBAC check speaks next
            ns = {}
        if ns is None:
            raise errors.BackendUnavailable(
                f"namespace {self.namespace!r} does not exist; create it "
                f"(kubectl create namespace {self.namespace}) or pass namespace=..."
            )
        if self.mode == "agent-sandbox":
            for group, want in (
                (m.EXT_GROUP, {m.TEMPLATE, m.WARMPOOL, m.CLAIM}),
                (m.CORE_GROUP, {m.SANDBOX}),
            ):
                found = await http.request("GET", f"/apis/{group}/{m.VERSION}", ok_missing=True)
                have = {r["name"] for r in (found or {}).get("resources", [])}
                if not want <= have:
                    raise errors.BackendUnavailable(
                        f"the agent-sandbox CRDs are not installed: {group}/{m.VERSION} does not "
                        f"serve {sorted(want - have)}; install agent-sandbox's k8s/crds "
                        "(and its controller with --extensions), or use mode='pods'"
                    )
        await self._check_rbac(http)
        if self.runtime_class:
            rc = await http.request(
                "GET", f"/apis/node.k8s.io/v1/runtimeclasses/{self.runtime_class}", ok_missing=True
            )
            if rc is None:
                raise errors.BackendUnavailable(
                    f"runtimeClass {self.runtime_class!r} does not exist in the cluster; install "
                    "its handler and RuntimeClass (e.g. gVisor's runsc) or pass runtime_class=None"
                )
        await self._ensure_watches()
        if self.mode == "agent-sandbox":
            await self._probe_controller(http)
        self._preflight_ok = True

    def _needed_verbs(self) -> list[tuple[str, str, str, str]]:
        core = [
            ("get", "", "pods", ""),
            ("list", "", "pods", ""),
            ("watch", "", "pods", ""),
            ("create", "", "pods", "exec"),
            ("get", "", "pods", "exec"),
        ]
        if self.mode == "pods":
            return core + [
                ("create", "", "pods", ""),
                ("delete", "", "pods", ""),
                ("deletecollection", "", "pods", ""),
            ]
        ext = []
        for res, verbs in (
            (m.TEMPLATE, ("create", "delete", "deletecollection")),
            (m.WARMPOOL, ("create", "patch", "list", "watch", "delete", "deletecollection")),
            (m.CLAIM, ("create", "list", "watch", "delete", "deletecollection")),
        ):
            ext += [(v, m.EXT_GROUP, res, "") for v in verbs]
        return core + ext

    async def _check_rbac(self, http: KubeHttp) -> None:
        async def review(verb: str, group: str, resource: str, sub: str) -> tuple[str, bool, str]:
            attrs = {
                "namespace": self.namespace,
                "verb": verb,
                "group": group,
                "resource": resource,
            }
            if sub:
                attrs["subresource"] = sub
            body = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attrs},
            }
            ans = await http.request(
                "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body=body
            )
            st = (ans or {}).get("status") or {}
            what = (
                f"{verb} {resource}{'/' + sub if sub else ''}{' (' + group + ')' if group else ''}"
            )
            return what, bool(st.get("allowed")), st.get("reason", "")

        results = await asyncio.gather(*(review(*v) for v in self._needed_verbs()))
        denied = [w for w, ok, _ in results if not ok]
        if denied:
            raise errors.BackendUnavailable(
                f"RBAC denies {', '.join(denied)} in namespace {self.namespace!r} to the "
                "kubeconfig's user; grant these verbs with a Role and RoleBinding"
            )

    async def _probe_controller(self, http: KubeHttp) -> None:
        assert self._warmpools is not None
        name = f"sp-{self.run_id}-probe"
        pi = PodImage("sandpool/probe:0")  # never started: the pool has 0 replicas
        await http.request(
            "POST",
            _ns_path(self.namespace, m.TEMPLATE),
            ok_exists=True,
            body=m.template(name, self.run_id, "probe", pi, self._pod_spec(pi)),
        )
        await http.request(
            "POST",
            _ns_path(self.namespace, m.WARMPOOL),
            ok_exists=True,
            body=m.warm_pool(name, self.run_id, "probe", name, 0),
        )
        try:
            await self._warmpools.wait(
                name,
                lambda o: True if o and (o.get("status") or {}).get("observedGeneration") else None,
                self.controller_timeout,
            )
        except TimeoutError:
            raise errors.BackendUnavailable(
                f"the agent-sandbox controller is not running: a SandboxWarmPool got no status "
                f"within {self.controller_timeout:.0f} s; start agent-sandbox-controller with "
                "--extensions=true watching this namespace"
            ) from None
        finally:
            for res in (m.WARMPOOL, m.TEMPLATE):
                try:
                    await http.request(
                        "DELETE", f"{_ns_path(self.namespace, res)}/{name}", ok_missing=True
                    )
                except errors.InfraError as exc:
                    log.warning("could not delete probe %s/%s: %s", res, name, exc)

    # -- images ------------------------------------------------------------------------------

    def pod_image(self, image: str) -> PodImage:
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

    def _pod_spec(self, pi: PodImage) -> dict[str, Any]:
        return m.pod_spec(
            pi,
            container=self.container,
            command=self.command,
            resources=self.resources,
            runtime_class=self.runtime_class,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
        )

    def _obj_name(self, image: str) -> str:
        return f"sp-{self.run_id}-{m.slug(image)}-{m.image_key(image)}"

    async def hydrate(self, image: str) -> None:
        """Validate ``image`` and (agent-sandbox mode) create its SandboxTemplate once.

        Raises:
            ImageNotFound: See :meth:`pod_image`.
            BackendUnavailable, ApiError, ConfigError: The template could not be created.
        """
        pi = self.pod_image(image)
        if self.mode != "agent-sandbox" or image in self._templates:
            return
        http = await self._ensure_client()
        name = self._obj_name(image)
        await http.request(
            "POST",
            _ns_path(self.namespace, m.TEMPLATE),
            ok_exists=True,
            body=m.template(name, self.run_id, image, pi, self._pod_spec(pi)),
        )
        self._templates[image] = name

    async def _ensure_pool(self, image: str, replicas: int | None) -> str:
        """Create the image's SandboxWarmPool, or patch its replicas when they change."""
        await self.hydrate(image)
        http = await self._ensure_client()
        lock = self._pool_locks.setdefault(image, asyncio.Lock())
        async with lock:
            cur = self._pools.get(image)
            name = self._obj_name(image)
            if cur is None:
                n = replicas or 0
                await http.request(
                    "POST",
                    _ns_path(self.namespace, m.WARMPOOL),
                    ok_exists=True,
                    body=m.warm_pool(name, self.run_id, image, self._templates[image], n),
                )
                self._pools[image] = (name, n)
            elif replicas is not None and cur[1] != replicas:
                await http.request(
                    "PATCH",
                    f"{_ns_path(self.namespace, m.WARMPOOL)}/{name}",
                    body={"spec": {"replicas": replicas}},
                    content_type="application/merge-patch+json",
                )
                self._pools[image] = (name, replicas)
        return name

    async def set_warm_target(self, image: str, n: int, *, reuse: bool) -> int:
        """Apply the strategy's warm target for ``image``; return how many the pool keeps itself.

        agent-sandbox mode: without reuse the SandboxWarmPool holds the ``n`` warm sandboxes
        and each claim takes one (returns 0: the pool claims per rollout); with reuse the pool
        holds ``n`` claimed sandboxes across rollouts (returns ``n``) and the SandboxWarmPool
        keeps only ``reuse_spares`` spares, so no pod is made that is never used.
        pods mode: the pool keeps ``n`` warm pods itself (returns ``n``).
        """
        if self.mode == "pods":
            return n
        await self._ensure_pool(image, min(self.reuse_spares, n) if reuse else n)
        return n if reuse else 0

    async def wait_warm(self) -> None:
        """Wait until every SandboxWarmPool of this run has its replicas Ready (shared watch).

        Raises:
            InfraTimeout: Not within 4 x ``ready_timeout``.
        """
        if self.mode != "agent-sandbox" or not self._pools:
            return
        await self._ensure_watches()
        assert self._warmpools is not None

        def filled(want: int) -> Callable[[dict[str, Any] | None], bool | None]:
            return lambda o: (
                True if o and ((o.get("status") or {}).get("readyReplicas") or 0) >= want else None
            )

        try:
            await asyncio.gather(
                *(
                    self._warmpools.wait(name, filled(n), self.ready_timeout * 4)
                    for name, n in self._pools.values()
                    if n > 0
                )
            )
        except TimeoutError:
            short = [
                name
                for name, n in self._pools.values()
                if n > 0
                and ((self._warmpools.get(name) or {}).get("status") or {}).get("readyReplicas", 0)
                < n
            ]
            raise errors.InfraTimeout(
                f"{len(short)} SandboxWarmPools did not fill within {self.ready_timeout * 4:.0f} s "
                f"(e.g. {short[:3]})"
            ) from None

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
        http = await self._ensure_client()
        n = next(self._seq)
        if self.mode == "pods":
            pod_name = f"sp-{self.run_id}-p{n}"
            pi = self.pod_image(image)
            await http.request(
                "POST",
                _ns_path(self.namespace, "pods"),
                body=m.pod(pod_name, self.run_id, image, pi, self._pod_spec(pi)),
            )
            try:
                return await self._await_pod(image, pod_name, pod_name, None)
            except BaseException:
                await self._delete_object("pods", pod_name)
                raise
        pool = await self._ensure_pool(image, None)
        claim_name = f"sp-{self.run_id}-c{n}"
        await http.request(
            "POST",
            _ns_path(self.namespace, m.CLAIM),
            body=m.claim(claim_name, self.run_id, image, pool),
        )
        try:
            sandbox_name = await self._await_claim(claim_name)
            return await self._await_pod(image, sandbox_name, claim_name, claim_name)
        except BaseException:
            await self._delete_object(m.CLAIM, claim_name)
            raise

    async def _await_claim(self, claim_name: str) -> str:
        assert self._claims is not None and self._pods is not None
        seen = False

        def check(_: object) -> str | None:
            nonlocal seen
            obj = self._claims.get(claim_name)  # type: ignore[union-attr]
            if obj is None:
                if seen:
                    raise errors.SandboxStartError(
                        f"SandboxClaim {claim_name} was deleted before it was Ready"
                    )
                return None
            seen = True
            ready = _cond(obj, "Ready")
            if (
                ready is not None
                and ready.get("status") == "False"
                and ready.get("reason") in _CLAIM_TERMINAL
            ):
                raise errors.SandboxStartError(
                    f"SandboxClaim {claim_name} failed: {ready['reason']}: {ready.get('message', '')}"
                )
            name = ((obj.get("status") or {}).get("sandbox") or {}).get("name")
            if ready is not None and ready.get("status") == "True" and name:
                return name
            # A cold-started claim's pod is named after the claim: surface its failure early.
            pod = self._pods.get(claim_name)  # type: ignore[union-attr]
            if pod is not None and (why := pod_start_failure(pod)):
                raise errors.SandboxStartError(
                    f"SandboxClaim {claim_name}: pod {claim_name}: {why}"
                )
            return None

        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def on_change(_: object) -> None:
            if fut.done():
                return
            try:
                value = check(None)
            except errors.SandpoolError as exc:
                fut.set_exception(exc)
                return
            if value is not None:
                fut.set_result(value)

        offs = [
            self._claims.subscribe(claim_name, on_change),
            self._pods.subscribe(claim_name, on_change),
        ]
        try:
            on_change(None)
            return await asyncio.wait_for(fut, self.ready_timeout)
        except TimeoutError:
            obj = self._claims.get(claim_name)
            ready = _cond(obj, "Ready") or {}
            raise errors.InfraTimeout(
                f"SandboxClaim {claim_name} was not Ready within {self.ready_timeout:.0f} s "
                f"(last: {ready.get('reason', 'no status')}: {ready.get('message', '')})".rstrip()
            ) from None
        finally:
            for off in offs:
                off()

    async def _await_pod(
        self, image: str, pod_name: str, sid: str, claim: str | None
    ) -> KubernetesSandbox:
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
        host_wd = (pod["metadata"].get("annotations") or {}).get(m.HOST_WORKDIR, "")
        host_exec = self.host_exec if self.host_exec is not None else bool(host_wd)
        if host_exec and not host_wd:
            raise errors.SandboxStartError(
                f"pod {pod_name}: host_exec=True but the pod has no {m.HOST_WORKDIR} annotation"
            )
        target = ExecTarget(
            namespace=self.namespace,
            pod=pod_name,
            container=self.container,
            sandbox_id=f"{self.run_id}-{sid}",
            workdir=pi.workdir,
            host_exec=host_exec,
            host_workdir=host_wd,
        )
        sb = KubernetesSandbox(
            self, target.sandbox_id, image, target, pod["metadata"]["uid"], claim
        )
        sb.head = pi.head
        self._live[sb.id] = sb
        self._by_pod[pod_name] = sb
        if why := pod_death(self._pods.get(pod_name), sb.pod_uid):
            sb._mark_dead(why)
        return sb

    async def _delete_object(self, resource: str, name: str) -> None:
        http = await self._ensure_client()
        query = {"propagationPolicy": "Background"}
        if resource == "pods":
            query["gracePeriodSeconds"] = "0"
        try:
            await http.request(
                "DELETE",
                f"{_ns_path(self.namespace, resource)}/{name}",
                query=query,
                ok_missing=True,
            )
        except errors.InfraError as exc:  # gc by run id removes what this could not
            log.warning(
                "deleting %s/%s failed: %s (sandpool gc --run-id %s removes it)",
                resource,
                name,
                exc,
                self.run_id,
            )

    async def delete(self, sandbox: Sandbox) -> None:
        """Delete the sandbox's SandboxClaim (the controller deletes its pod) or its pod.

        Idempotent; never raises for a sandbox that is already gone, and logs (does not
        raise) an API failure, which ``sandpool gc --run-id`` cleans up later.
        """
        assert isinstance(sandbox, KubernetesSandbox)
        self._live.pop(sandbox.id, None)
        if self._by_pod.get(sandbox.pod) is sandbox:
            del self._by_pod[sandbox.pod]
        sandbox._mark_dead("deleted by sandpool")
        if sandbox.claim is not None:
            await self._delete_object(m.CLAIM, sandbox.claim)
        else:
            await self._delete_object("pods", sandbox.pod)

    async def aclose(self) -> None:
        """Delete everything this run made (by its run-id label) and close the client.

        Never raises for a failed delete: it logs a warning naming the ``sandpool gc`` command.
        """
        if self._closed:
            return
        try:
            for sb in list(self._live.values()):
                sb._mark_dead("backend closed")
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


_GC_ORDER = (m.CLAIM, m.WARMPOOL, m.TEMPLATE, "pods")


async def delete_run(http: KubeHttp, namespace: str, run_id: str) -> dict[str, int]:
    """Delete every object labelled ``sandpool.io/run-id=<run_id>`` in ``namespace``.

    One list and one ``deletecollection`` per resource: claims first (their sandboxes and
    pods follow by owner references), then warm pools, templates and plain pods.

    Returns:
        Objects found per resource.
    """
    sel = {"labelSelector": f"{m.RUN_ID_LABEL}={run_id}"}
    found: dict[str, int] = {}
    for res in _GC_ORDER:
        path = _ns_path(namespace, res)
        listed = await http.request("GET", path, query=sel, ok_missing=True)
        found[res] = len((listed or {}).get("items", []))
        if found[res]:
            q = dict(sel, propagationPolicy="Background")
            if res == "pods":
                q["gracePeriodSeconds"] = "0"
            await http.request("DELETE", path, query=q, ok_missing=True)
    return found


async def gc(
    run_id: str,
    *,
    kubeconfig: str | Path | None = None,
    namespace: str = "default",
    agent_sandbox: bool = True,
) -> dict[str, int]:
    """Remove what run ``run_id`` left in ``namespace`` (``sandpool gc --run-id``).

    Args:
        run_id: The run id label value.
        kubeconfig: The kubeconfig path.
        namespace: The namespace.
        agent_sandbox: Also delete claims, warm pools and templates (skipped, not an error, when
            the CRDs are not installed).

    Returns:
        Objects found (and deleted) per resource.

    Raises:
        BackendUnavailable: The cluster is unreachable or RBAC denies the deletes.
    """
    backend = KubernetesBackend(
        kubeconfig,
        namespace=namespace,
        run_id=run_id,
        mode="agent-sandbox" if agent_sandbox else "pods",
    )
    try:
        http = await backend._ensure_client()
        return await delete_run(http, namespace, run_id)
    finally:
        backend._closed = True
        if backend._client is not None:
            await backend._client.close()
