"""agent-sandbox claims: one SandboxTemplate and one SandboxWarmPool per image, one
SandboxClaim per sandbox, and the waits on their status.

:class:`ClaimsMixin` is part of :class:`~.backend.KubernetesBackend` (it uses the backend's
client, watches and image map); it is split out so each seam reads on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._manifests import ns_path
from sandpool.core.backends.kubernetes._pods import cond, pod_start_failure
from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes.backend import KubernetesBackend

__all__ = ["ClaimsMixin"]

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


class ClaimsMixin:
    """The agent-sandbox seam of :class:`~.backend.KubernetesBackend`."""

    async def hydrate(self: KubernetesBackend, image: str) -> None:
        """Validate ``image`` and (agent-sandbox mode) create its SandboxTemplate once.

        With ``sandbox_objects`` the template is made only when a warm pool needs it (a
        reusing strategy's Sandbox objects carry their pod template themselves).

        Raises:
            ImageNotFound: See :meth:`pod_image`.
            BackendUnavailable, ApiError, ConfigError: The template could not be created.
        """
        self.pod_image(image)
        if self.mode != "agent-sandbox" or self.sandbox_objects:
            return
        await self._ensure_template(image)

    async def _ensure_template(self: KubernetesBackend, image: str) -> None:
        pi = self.pod_image(image)
        if image in self._templates:
            return
        http = await self._ensure_client()
        name = self._obj_name(image)
        await http.request(
            "POST",
            ns_path(self.namespace, m.TEMPLATE),
            ok_exists=True,
            body=m.template(name, self.run_id, image, pi, self._pod_spec(pi, image)),
        )
        self._templates[image] = name

    async def _ensure_pool(self: KubernetesBackend, image: str, replicas: int | None) -> str:
        """Create the image's SandboxWarmPool, or patch its replicas when they change."""
        await self._ensure_template(image)
        http = await self._ensure_client()
        lock = self._pool_locks.setdefault(image, asyncio.Lock())
        async with lock:
            cur = self._pools.get(image)
            name = self._obj_name(image)
            if cur is None:
                n = replicas or 0
                await http.request(
                    "POST",
                    ns_path(self.namespace, m.WARMPOOL),
                    ok_exists=True,
                    body=m.warm_pool(name, self.run_id, image, self._templates[image], n),
                )
                self._pools[image] = (name, n)
                self._image_of_key[m.image_key(image)] = image
            elif replicas is not None and cur[1] != replicas:
                await http.request(
                    "PATCH",
                    f"{ns_path(self.namespace, m.WARMPOOL)}/{name}",
                    body={"spec": {"replicas": replicas}},
                    content_type="application/merge-patch+json",
                )
                self._pools[image] = (name, replicas)
        return name

    async def set_warm_target(self: KubernetesBackend, image: str, n: int, *, reuse: bool) -> int:
        """Apply the strategy's warm target for ``image``; return how many the pool keeps itself.

        agent-sandbox mode: without reuse the SandboxWarmPool holds the ``n`` warm sandboxes
        and each claim takes one (returns 0: the pool claims per rollout); with reuse the pool
        holds ``n`` claimed sandboxes across rollouts (returns ``n``) and the SandboxWarmPool
        keeps only ``reuse_spares`` spares, so no pod is made that is never used.
        pods mode: the pool keeps ``n`` warm pods itself (returns ``n``). With reuse and
        ``sandbox_objects``, the pool's ``n`` sandboxes are Sandbox objects (one write each:
        no template, warm pool or claim) and nothing is made here.
        """
        if self.mode == "pods":
            return n
        if reuse and self.sandbox_objects:
            self._direct.add(image)
            return n
        await self._ensure_pool(image, min(self.reuse_spares, n) if reuse else n)
        return n if reuse else 0

    async def wait_warm(self: KubernetesBackend) -> None:
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

    async def _create_claim(self: KubernetesBackend, image: str, n: int) -> KubernetesSandbox:
        """Claim ``sp-<run>-c<n>`` on the image's warm pool; return its sandbox once Ready."""
        http = await self._ensure_client()
        pool = await self._ensure_pool(image, None)
        claim_name = f"sp-{self.run_id}-c{n}"
        await http.request(
            "POST",
            ns_path(self.namespace, m.CLAIM),
            body=m.claim(claim_name, self.run_id, image, pool),
        )
        try:
            sandbox_name = await self._await_claim(claim_name)
            return await self._await_pod(
                image, sandbox_name, claim_name, claim_name, owner=(m.CLAIM, claim_name)
            )
        except BaseException:
            await self._delete_object(m.CLAIM, claim_name)
            raise

    async def _create_sandbox_object(
        self: KubernetesBackend, image: str, n: int
    ) -> KubernetesSandbox:
        """Create Sandbox ``sp-<run>-s<n>`` (the controller makes its pod of the same name);
        return it once its pod is Ready."""
        http = await self._ensure_client()
        name = f"sp-{self.run_id}-s{n}"
        pi = self.pod_image(image)
        await http.request(
            "POST",
            ns_path(self.namespace, m.SANDBOX),
            body=m.sandbox(name, self.run_id, image, pi, self._pod_spec(pi, image)),
        )
        try:
            return await self._await_pod(image, name, name, None, owner=(m.SANDBOX, name))
        except BaseException:
            await self._delete_object(m.SANDBOX, name)
            raise

    async def _await_claim(self: KubernetesBackend, claim_name: str) -> str:
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
            ready = cond(obj, "Ready")
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
            ready = cond(obj, "Ready") or {}
            raise errors.InfraTimeout(
                f"SandboxClaim {claim_name} was not Ready within {self.ready_timeout:.0f} s "
                f"(last: {ready.get('reason', 'no status')}: {ready.get('message', '')})".rstrip()
            ) from None
        finally:
            for off in offs:
                off()

