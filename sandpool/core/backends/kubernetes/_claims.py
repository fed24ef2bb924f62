"""agent-sandbox objects: one SandboxTemplate and one SandboxWarmPool per image, one
SandboxClaim per sandbox (or, for reused sandboxes, one Sandbox object each), and the waits
on their status.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._images import PodImages
from sandpool.core.backends.kubernetes._manifests import ns_path
from sandpool.core.backends.kubernetes._pods import cond, pod_start_failure
from sandpool.core.backends.kubernetes._watch import Informer

__all__ = ["Claims"]

# The controller's message when the API server refused the claim's pod as invalid (a limit
# below its request, a bad field): it retries the same pod forever.
_INVALID_POD = re.compile(r'Pod "[^"]*" is invalid: ')


def _invalid_pod(ready: Mapping[str, Any]) -> bool:
    return ready.get("reason") == "ReconcilerError" and bool(
        _INVALID_POD.search(ready.get("message", "")))

# Claim Ready=False reasons that never resolve by waiting. Not TemplateNotFound or
# WarmPoolNotFound: the controller (v1.0.3) retries those, and sandpool creates both objects
# before any claim, so they are its cache catching up (one really gone ends at ready_timeout).
_CLAIM_TERMINAL = frozenset(
    {
        "InvalidMetadata",
        "EnvVarsInjectionRejected",
        "VolumeClaimTemplatesError",
        "ClaimExpired",
        "SandboxExpired",
    }
)


class Claims:
    """The agent-sandbox objects of one run.

    Args:
        http: The HTTP layer.
        namespace: Where the objects are.
        run_id: The run-id label value (and part of every object name).
        images: Task image -> PodImage and PodSpec.
        claims: The run's shared SandboxClaim watch (started before a claim is awaited).
        warmpools: The run's shared SandboxWarmPool watch (likewise for :meth:`wait_warm`).
        pods: The run's shared pod watch (a cold-started claim's pod failure shows there).
        ready_timeout: Seconds a claim may take to be Ready.
        reuse_spares: With a reusing strategy, warm (unclaimed) replicas kept per image.
        sandbox_objects: With a reusing strategy, make each sandbox a Sandbox object.
    """

    def __init__(
        self,
        http: KubeHttp,
        namespace: str,
        run_id: str,
        images: PodImages,
        *,
        claims: Informer,
        warmpools: Informer,
        pods: Informer,
        ready_timeout: float,
        reuse_spares: int,
        sandbox_objects: bool,
    ) -> None:
        self._http = http
        self.namespace = namespace
        self.run_id = run_id
        self._images = images
        self._claims = claims
        self._warmpools = warmpools
        self._pods = pods
        self.ready_timeout = ready_timeout
        self.reuse_spares = reuse_spares
        self.sandbox_objects = sandbox_objects
        self._templates: dict[str, str] = {}  # image -> template name
        self._pools: dict[str, tuple[str, int]] = {}  # image -> (warm pool name, replicas)
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self._image_of_key: dict[str, str] = {}  # image label value -> warm pool image
        self._direct: set[str] = set()  # images whose sandboxes are Sandbox objects

    @property
    def warm_pools(self) -> Mapping[str, tuple[str, int]]:
        """Image -> (SandboxWarmPool name, replicas asked) of every warm pool made."""
        return self._pools

    def object_name(self, image: str) -> str:
        """The name of ``image``'s template and warm pool."""
        return f"sp-{self.run_id}-{m.slug(image)}-{m.image_key(image)}"

    def is_direct(self, image: str) -> bool:
        """True when ``image``'s sandboxes are Sandbox objects (see :meth:`set_warm_target`)."""
        return image in self._direct

    def warm_pool_image(self, pod: Mapping[str, Any]) -> str | None:
        """The image whose warm pool made ``pod`` (its Sandbox, so the pod, is named
        ``<warm pool>-<suffix>`` by the controller), else None (a cold-started claim's pod,
        a Sandbox object's, a prepull pod)."""
        meta = pod.get("metadata") or {}
        image = self._image_of_key.get((meta.get("labels") or {}).get(m.IMAGE_LABEL, ""))
        if image is None or image not in self._pools:
            return None
        return image if meta.get("name", "").startswith(self._pools[image][0] + "-") else None

    async def hydrate(self, image: str) -> None:
        """Create ``image``'s SandboxTemplate once, unless its sandboxes will be Sandbox
        objects (``sandbox_objects``: made only when a warm pool needs it).

        Raises:
            ImageNotFound: See :meth:`PodImages.resolve`.
            BackendUnavailable, ApiError, ConfigError: The template could not be created.
        """
        if not self.sandbox_objects:
            await self._ensure_template(image)

    async def _ensure_template(self, image: str) -> None:
        pi = self._images.resolve(image)
        if image in self._templates:
            return
        name = self.object_name(image)
        await self._http.request(
            "POST",
            ns_path(self.namespace, m.TEMPLATE),
            ok_exists=True,
            body=m.template(name, self.run_id, image, pi, self._images.spec(pi, image)),
        )
        self._templates[image] = name

    async def _ensure_pool(self, image: str, replicas: int | None) -> str:
        """Create the image's SandboxWarmPool, or patch its replicas when they change."""
        await self._ensure_template(image)
        lock = self._pool_locks.setdefault(image, asyncio.Lock())
        async with lock:
            cur = self._pools.get(image)
            name = self.object_name(image)
            if cur is None:
                n = replicas or 0
                await self._http.request(
                    "POST",
                    ns_path(self.namespace, m.WARMPOOL),
                    ok_exists=True,
                    body=m.warm_pool(name, self.run_id, image, self._templates[image], n),
                )
                self._pools[image] = (name, n)
                self._image_of_key[m.image_key(image)] = image
            elif replicas is not None and cur[1] != replicas:
                await self._http.request(
                    "PATCH",
                    f"{ns_path(self.namespace, m.WARMPOOL)}/{name}",
                    body={"spec": {"replicas": replicas}},
                    content_type="application/merge-patch+json",
                )
                self._pools[image] = (name, replicas)
        return name

    async def set_warm_target(self, image: str, n: int, *, reuse: bool) -> int:
        """Apply the strategy's warm target for ``image``; return how many the pool keeps itself.

        Without reuse the SandboxWarmPool holds the ``n`` warm sandboxes and each claim takes
        one (returns 0: the pool claims per rollout); with reuse the pool holds ``n`` claimed
        sandboxes across rollouts (returns ``n``) and the SandboxWarmPool keeps only
        ``reuse_spares`` spares, so no pod is made that is never used. With reuse and
        ``sandbox_objects``, the pool's ``n`` sandboxes are Sandbox objects (one write each:
        no template, warm pool or claim) and nothing is made here.
        """
        if reuse and self.sandbox_objects:
            self._direct.add(image)
            return n
        await self._ensure_pool(image, min(self.reuse_spares, n) if reuse else n)
        return n if reuse else 0

    async def wait_warm(self) -> None:
        """Wait until every SandboxWarmPool of this run has its replicas Ready (shared watch).

        Raises:
            InfraTimeout: Not within 4 x ``ready_timeout``.
        """

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

    async def create_claim(self, image: str, n: int) -> str:
        """Claim ``sp-<run>-c<n>`` on the image's warm pool; return the claim's name (not
        waiting: see :meth:`wait_bound`)."""
        pool = await self._ensure_pool(image, None)
        claim_name = f"sp-{self.run_id}-c{n}"
        await self._http.request(
            "POST",
            ns_path(self.namespace, m.CLAIM),
            body=m.claim(claim_name, self.run_id, image, pool),
        )
        return claim_name

    async def create_sandbox(self, image: str, n: int) -> str:
        """Create Sandbox ``sp-<run>-s<n>`` (the controller makes its pod of the same name);
        return its name (not waiting)."""
        name = f"sp-{self.run_id}-s{n}"
        pi = self._images.resolve(image)
        await self._http.request(
            "POST",
            ns_path(self.namespace, m.SANDBOX),
            body=m.sandbox(name, self.run_id, image, pi, self._images.spec(pi, image)),
        )
        return name

    async def set_operating_mode(self, sandbox_name: str, mode: str) -> None:
        """Set Sandbox ``sandbox_name``'s ``spec.operatingMode`` (agent-sandbox v1beta1):
        ``"Suspended"`` makes the controller delete its pod and keep the Sandbox object (and
        the claim that owns it); ``"Running"`` makes it create a new pod, named like the
        Sandbox, from the Sandbox's pod template.

        Raises:
            SandboxDied: The Sandbox object is gone (deleted, or its claim was).
            ApiError, BackendUnavailable, ConfigError: The patch failed (RBAC needs ``patch``
                on ``sandboxes``).
        """
        got = await self._http.request(
            "PATCH",
            f"{ns_path(self.namespace, m.SANDBOX)}/{sandbox_name}",
            body={"spec": {"operatingMode": mode}},
            content_type="application/merge-patch+json",
            ok_missing=True,
        )
        if got is None:
            raise errors.SandboxDied(f"Sandbox {self.namespace}/{sandbox_name} is gone: it cannot "
                                     f"be set {mode}")

    async def wait_bound(self, claim_name: str) -> str:
        """Wait until claim ``claim_name`` is Ready; return its sandbox's (so its pod's) name.

        Raises:
            SandboxStartError: The claim failed for good (a terminal Ready=False reason), was
                deleted, or its cold-started pod will never start.
            InfraTimeout: Not Ready within ``ready_timeout``.
        """
        claims, pods = self._claims, self._pods
        seen = False

        def check() -> str | None:
            nonlocal seen
            obj = claims.get(claim_name)
            if obj is None:
                if seen:
                    raise errors.SandboxStartError(
                        f"SandboxClaim {claim_name} was deleted before it was Ready"
                    )
                return None
            seen = True
            ready = cond(obj, "Ready")
            if (
                ready is not None
                and ready.get("status") == "False"
                and (ready.get("reason") in _CLAIM_TERMINAL or _invalid_pod(ready))
            ):
                raise errors.SandboxStartError(
                    f"SandboxClaim {claim_name} failed: {ready['reason']}: {ready.get('message', '')}"
                )
            name = ((obj.get("status") or {}).get("sandbox") or {}).get("name")
            if ready is not None and ready.get("status") == "True" and name:
                return name
            # A cold-started claim's pod is named after the claim, an adopted warm sandbox's
            # after that sandbox: surface a start that will never succeed (a pull that fails)
            # at once rather than at the ready timeout.
            for pod_name in dict.fromkeys((claim_name, name) if name else (claim_name,)):
                pod = pods.get(pod_name)
                if pod is not None and (why := pod_start_failure(pod)):
                    raise errors.SandboxStartError(
                        f"SandboxClaim {claim_name}: pod {pod_name}: {why}"
                    )
            return None

        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def on_change(_: object) -> None:
            if fut.done():
                return
            try:
                value = check()
            except errors.SandpoolError as exc:
                fut.set_exception(exc)
                return
            if value is not None:
                fut.set_result(value)

        offs = [claims.subscribe(claim_name, on_change), pods.subscribe(claim_name, on_change)]
        try:
            on_change(None)
            return await asyncio.wait_for(fut, self.ready_timeout)
        except TimeoutError:
            ready = cond(claims.get(claim_name), "Ready") or {}
            raise errors.InfraTimeout(
                f"SandboxClaim {claim_name} was not Ready within {self.ready_timeout:.0f} s "
                f"(last: {ready.get('reason', 'no status')}: {ready.get('message', '')})".rstrip()
            ) from None
        finally:
            for off in offs:
                off()
