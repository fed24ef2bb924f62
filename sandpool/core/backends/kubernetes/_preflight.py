"""Preflight: check the cluster can run the backend, and say what to fix in one sentence."""

from __future__ import annotations

import asyncio
import logging
import re

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._images import PodImages
from sandpool.core.backends.kubernetes._manifests import PodImage, ns_path
from sandpool.core.backends.kubernetes._watch import Informer

__all__ = ["Preflight", "overcreation_warning"]

log = logging.getLogger("sandpool.kubernetes")

#: First agent-sandbox release whose SandboxWarmPool controller gates creates on its own
#: expectations (upstream PR 1266, fixing issue 1215); earlier ones over-create when pods
#: cannot reach Ready (about 5x the replicas observed upstream).
OVERCREATION_FIXED = (0, 5, 4)


def overcreation_warning(version: str) -> str | None:
    """The warning for an agent-sandbox controller ``version`` (``v0.5.3``, ``0.5.0rc1``...)
    that has the warm-pool over-creation bug (agent-sandbox issue 1215), else None (fixed,
    or not a version this can read)."""
    m_ = re.match(r"v?(\d+)\.(\d+)\.(\d+)", version.strip())
    if m_ is None:
        return None
    if tuple(int(x) for x in m_.groups()) >= OVERCREATION_FIXED:
        return None
    return (
        f"agent-sandbox controller {version} has the SandboxWarmPool over-creation bug "
        "(agent-sandbox issue 1215: a pool whose pods cannot all reach Ready creates several "
        "times its replicas); upgrade to v0.5.4 or later, or run it with "
        "--sandbox-warm-pool-concurrent-workers=1 and keep warm pools within capacity"
    )


class Preflight:
    """The checks that the cluster can run one backend.

    Args:
        http: The HTTP layer.
        namespace: Where the backend makes its objects.
        run_id: The run-id label value (of the controller probe's objects).
        mode: ``"agent-sandbox"`` or ``"pods"``.
        sandbox_objects: Whether Sandbox objects are made (one more resource's verbs).
        images: The PodSpec of the controller probe's template.
        warmpools: The run's shared SandboxWarmPool watch (agent-sandbox mode; started
            before :meth:`check_controller`).
        controller_timeout: Seconds the controller may take to answer the probe.
        controller_version: The controller's version, or None to look for its Deployment.
    """

    def __init__(
        self,
        http: KubeHttp,
        namespace: str,
        run_id: str,
        *,
        mode: str,
        sandbox_objects: bool,
        images: PodImages,
        warmpools: Informer | None,
        controller_timeout: float,
        controller_version: str | None,
    ) -> None:
        self._http = http
        self.namespace = namespace
        self.run_id = run_id
        self.mode = mode
        self.sandbox_objects = sandbox_objects
        self._images = images
        self._warmpools = warmpools
        self.controller_timeout = controller_timeout
        self.controller_version = controller_version

    async def check_cluster(self) -> None:
        """Check, in order: the API answers; the namespace exists; the agent-sandbox CRDs
        are served (agent-sandbox mode); RBAC allows every verb the backend uses
        (SelfSubjectAccessReview); the runtime class exists.

        Raises:
            BackendUnavailable: With the failed check and its fix.
        """
        http = self._http
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
        runtime_class = self._images.runtime_class
        if runtime_class:
            rc = await http.request(
                "GET", f"/apis/node.k8s.io/v1/runtimeclasses/{runtime_class}", ok_missing=True
            )
            if rc is None:
                raise errors.BackendUnavailable(
                    f"runtimeClass {runtime_class!r} does not exist in the cluster; install "
                    "its handler and RuntimeClass (e.g. gVisor's runsc) or pass runtime_class=None"
                )

    async def check_controller(self) -> None:
        """Check the agent-sandbox controller reconciles (a probe SandboxWarmPool of 0
        replicas gets a status), and warn when its version has the over-creation bug.

        Raises:
            BackendUnavailable: The controller did not answer within ``controller_timeout``.
        """
        await self._probe_controller(self._http)
        await self._check_controller_version(self._http)

    async def _check_controller_version(self, http: KubeHttp) -> None:
        """Warn when the agent-sandbox controller has the warm-pool over-creation bug.

        The version is ``controller_version`` when given, else the image tag of a Deployment
        running an ``agent-sandbox-controller`` image (when the user may list Deployments).
        """
        version, where = self.controller_version, "controller_version"
        if version is None:
            try:
                deps = await http.request("GET", "/apis/apps/v1/deployments", ok_missing=True)
            except errors.InfraError:  # RBAC or no apps API: the version stays unknown
                deps = None
            for dep in (deps or {}).get("items", []):
                for c in dep["spec"]["template"]["spec"].get("containers", []):
                    image = c.get("image", "")
                    if "agent-sandbox-controller" in image and ":" in image.rsplit("/", 1)[-1]:
                        version = image.rsplit(":", 1)[1]
                        where = f"deployment {dep['metadata']['namespace']}/{dep['metadata']['name']}"
        if version is None:
            log.info("agent-sandbox controller version unknown: cannot check for the warm-pool "
                     "over-creation bug (agent-sandbox issue 1215; pass controller_version=)")
            return
        if warning := overcreation_warning(version):
            log.warning("%s (%s)", warning, where)

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
        sandbox_verbs = ["patch"]  # spec.operatingMode: a lease's suspend and resume
        if self.sandbox_objects:
            sandbox_verbs += ["create", "delete", "deletecollection"]
        ext += [(v, m.CORE_GROUP, m.SANDBOX, "") for v in sandbox_verbs]
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
            ns_path(self.namespace, m.TEMPLATE),
            ok_exists=True,
            body=m.template(name, self.run_id, "probe", pi, self._images.spec(pi)),
        )
        await http.request(
            "POST",
            ns_path(self.namespace, m.WARMPOOL),
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
                        "DELETE", f"{ns_path(self.namespace, res)}/{name}", ok_missing=True
                    )
                except errors.InfraError as exc:
                    log.warning("could not delete probe %s/%s: %s", res, name, exc)

