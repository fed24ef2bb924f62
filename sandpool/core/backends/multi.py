"""One pool over several clusters: a backend composed of several backends, with placement.

:class:`MultiClusterBackend` takes named member backends (one
:class:`~sandpool.core.backends.kubernetes.KubernetesBackend` per kubeconfig, typically) and
places each creation on one of them by a policy:

* ``round-robin``: the clusters in turn;
* ``least-loaded``: the cluster with the fewest of this pool's live sandboxes per unit of
  capacity;
* ``capacity-weighted``: in proportion to each cluster's capacity (smooth weighted round
  robin, as nginx balances upstreams: deterministic, never two in a row past the weights);
* ``image-affinity``: every sandbox of an image on the image's home cluster (weighted
  rendezvous hashing of the image name over the clusters, so an image's home does not move
  when another cluster comes or goes), so its pulls and warm pool are paid once.

A warm target (:meth:`set_warm_target`) is split over the clusters by the same policy.

A cluster goes away when a creation on it fails because it cannot be reached (a connection
refused or reset after the member's retries: ``ApiError`` without a status, or
``BackendUnavailable``): it is marked down, the creation is retried on another cluster
(counted as a failover), its warm targets move to the others, and nothing more is placed on
it. The sandboxes it held die with their channels (their rollouts fail as infra and are
retried by the accountant, and counted there); their deletes and the member's close are
bounded by ``down_timeout``, leaving what they could not remove to ``sandpool gc``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from sandpool.core import errors
from sandpool.core.base import Backend, Sandbox
from sandpool.core.metrics import ClusterStats
from sandpool.core.rate import AdaptiveRate
from sandpool.core.telemetry import Telemetry

__all__ = ["PLACEMENTS", "MultiClusterBackend"]

log = logging.getLogger("sandpool.clusters")

#: The placement policies, by name.
PLACEMENTS = ("round-robin", "least-loaded", "capacity-weighted", "image-affinity")


@dataclass(eq=False)
class _Member:
    name: str
    backend: Backend
    capacity: float
    live: set[Sandbox] = field(default_factory=set)  # its sandboxes not deleted (by identity:
    # two clusters' backends may give the same id)
    created: int = 0
    failed: int = 0
    failovers: int = 0  # creations that failed here and were placed elsewhere
    lost: int = 0  # sandboxes found dead when deleted
    down: str | None = None
    down_at: float | None = None
    current: float = 0.0  # smooth weighted round robin's running weight
    hydrated: set[str] = field(default_factory=set)

    def stats(self, t0: float) -> ClusterStats:
        return ClusterStats(
            cluster=self.name, capacity=self.capacity, created=self.created,
            live=len(self.live), failed_creates=self.failed, failovers=self.failovers,
            lost=self.lost, down=self.down,
            down_at_s=None if self.down_at is None else self.down_at - t0)


class MultiClusterBackend(Backend):
    """Several clusters behind one backend; each creation placed on one by ``placement``.

    Usage::

        backend = MultiClusterBackend(
            {"east": KubernetesBackend("east.kubeconfig", namespace="rl"),
             "west": KubernetesBackend("west.kubeconfig", namespace="rl")},
            placement="capacity-weighted", capacity={"east": 3, "west": 1})
        async with SandboxPool(backend, strategy="warm") as pool: ...

    Args:
        clusters: Cluster name -> its backend (each used by this backend alone; closed with it).
        placement: One of :data:`PLACEMENTS`.
        capacity: Cluster name -> its weight (for ``least-loaded``, ``capacity-weighted`` and
            ``image-affinity``; default 1 each), e.g. its nodes or its share of a quota.
        down_timeout: Seconds a delete, and the close, of a cluster that went down may take
            before its objects are left to ``sandpool gc``.

    Raises:
        ConfigError: No cluster, an unknown placement, or a capacity that is not positive or
            names no cluster.
    """

    def __init__(self, clusters: Mapping[str, Backend], *, placement: str = "least-loaded",
                 capacity: Mapping[str, float] | None = None, down_timeout: float = 30.0) -> None:
        if not clusters:
            raise errors.ConfigError("clusters is empty: give at least one name -> backend")
        if placement not in PLACEMENTS:
            raise errors.ConfigError(f"placement={placement!r} is not known; use one of "
                                     f"{list(PLACEMENTS)}")
        capacity = dict(capacity or {})
        if unknown := set(capacity) - set(clusters):
            raise errors.ConfigError(f"capacity names clusters that are not given: "
                                     f"{sorted(unknown)}; use the names of clusters=")
        if bad := [n for n, c in capacity.items() if not c > 0]:
            raise errors.ConfigError(f"capacity of {bad} must be positive")
        self.placement = placement
        self.down_timeout = down_timeout
        self._members = [_Member(n, b, float(capacity.get(n, 1.0))) for n, b in clusters.items()]
        for m in self._members:  # name each cluster's write bucket after the cluster
            for rate in m.backend.write_rates.values():
                rate.cluster = rate.cluster or m.name
        self.name = "+".join(sorted({m.backend.name for m in self._members}))
        self._owner: dict[Sandbox, _Member] = {}
        self._warm: dict[str, tuple[int, bool]] = {}  # image -> (warm target, reuse)
        self._rr = itertools.count()
        self._t0 = time.monotonic()
        self._telemetry: Telemetry | None = None
        self._moving: set[asyncio.Task[None]] = set()  # warm targets moving off a lost cluster

    def __repr__(self) -> str:
        return "<MultiClusterBackend {} {}>".format(self.placement, ", ".join(
            f"{m.name}={len(m.live)}{' DOWN' if m.down else ''}" for m in self._members))

    @property  # type: ignore[override]
    def telemetry(self) -> Telemetry:
        return self._telemetry or self._members[0].backend.telemetry

    @telemetry.setter
    def telemetry(self, value: Telemetry) -> None:
        self._telemetry = value
        for m in self._members:
            m.backend.telemetry = value

    @property
    def clusters(self) -> list[str]:
        """The clusters' names, in the order given."""
        return [m.name for m in self._members]

    def cluster_of(self, sandbox: Sandbox) -> str | None:
        """The name of the cluster ``sandbox`` runs on (None once it is deleted)."""
        m = self._owner.get(sandbox)
        return None if m is None else m.name

    def _up(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[_Member]:
        up = [m for m in self._members if m.down is None and m.name not in exclude]
        if not up:
            why = "; ".join(f"{m.name}: {m.down}" for m in self._members if m.down)
            raise errors.BackendUnavailable(f"no cluster left to place a sandbox on ({why})")
        return up

    # -- placement -------------------------------------------------------------------------

    def _choose(self, image: str, exclude: set[str]) -> _Member:
        up = self._up(exclude)
        if self.placement == "round-robin":
            return up[next(self._rr) % len(up)]
        if self.placement == "least-loaded":
            return min(up, key=lambda m: len(m.live) / m.capacity)
        if self.placement == "capacity-weighted":
            total = sum(m.capacity for m in up)
            for m in up:
                m.current += m.capacity
            best = max(up, key=lambda m: m.current)
            best.current -= total
            return best
        return max(up, key=lambda m: _rendezvous(image, m.name, m.capacity))

    def _shares(self, image: str, n: int) -> dict[str, int]:
        """``n`` warm sandboxes of ``image`` split over the clusters that are up."""
        up = self._up()
        if self.placement == "image-affinity":
            home = max(up, key=lambda m: _rendezvous(image, m.name, m.capacity))
            return {m.name: n if m is home else 0 for m in up}
        weights = [m.capacity if self.placement != "round-robin" else 1.0 for m in up]
        exact = [n * w / sum(weights) for w in weights]
        share = [math.floor(x) for x in exact]
        for i in sorted(range(len(up)), key=lambda i: share[i] - exact[i])[:n - sum(share)]:
            share[i] += 1  # largest remainders first
        return {m.name: k for m, k in zip(up, share, strict=True)}

    # -- the Backend contract --------------------------------------------------------------

    async def preflight(self) -> None:
        """Preflight every cluster; one that fails is marked down (logged), and only when
        every one fails does this raise.

        Raises:
            BackendUnavailable: No cluster passed (each one's reason given).
        """
        async def one(m: _Member) -> None:
            try:
                await m.backend.preflight()
            except errors.SandpoolError as exc:
                self._mark_down(m, exc)

        await asyncio.gather(*(one(m) for m in self._members))
        self._up()

    async def hydrate(self, image: str) -> None:
        """Validate ``image`` on the cluster the policy would place it on first (the others
        hydrate it at their first creation of it).

        Raises:
            ImageNotFound: As the member raises it.
        """
        m = (max(self._up(), key=lambda m: _rendezvous(image, m.name, m.capacity))
             if self.placement == "image-affinity" else self._up()[0])
        await m.backend.hydrate(image)
        m.hydrated.add(image)

    async def set_warm_target(self, image: str, n: int, *, reuse: bool) -> int:
        """Split the warm target of ``image`` over the clusters that are up (by the policy)
        and return how many the pool keeps itself (the members' sum)."""
        self._warm[image] = (n, reuse)
        shares = self._shares(image, n)
        kept = await asyncio.gather(*(m.backend.set_warm_target(image, shares[m.name], reuse=reuse)
                                      for m in self._up()))
        return sum(kept)

    async def wait_warm(self) -> None:
        await asyncio.gather(*(m.backend.wait_warm() for m in self._up()))

    async def create(self, image: str) -> Sandbox:
        """Create a sandbox of ``image`` on the cluster the policy picks; if that cluster
        cannot be reached, mark it down and place the sandbox on another.

        Raises:
            BackendUnavailable: Every cluster is down.
            ImageNotFound, SandboxStartError, InfraTimeout, ApiError: As the member raised it
                (a cluster that answered: the failure is the image's or the sandbox's).
        """
        tried: set[str] = set()
        while True:
            m = self._choose(image, tried)
            try:
                sandbox = await m.backend.create(image)
            except errors.SandpoolError as exc:
                m.failed += 1
                if m.down is None and not _unreachable(exc):
                    raise
                self._mark_down(m, exc)
                m.failovers += 1
                tried.add(m.name)
                continue
            if m.down is not None:  # it went down while this one started: it is stranded
                await self._delete_on(m, sandbox)
                tried.add(m.name)
                continue
            m.created += 1
            m.live.add(sandbox)
            self._owner[sandbox] = m
            return sandbox

    async def delete(self, sandbox: Sandbox) -> None:
        """Delete ``sandbox`` on its cluster (bounded by ``down_timeout`` on one that is
        down). Never raises."""
        m = self._owner.pop(sandbox, None)
        if m is None:
            return
        m.live.discard(sandbox)
        m.lost += not sandbox.alive()
        await self._delete_on(m, sandbox)

    async def park(self, sandbox: Sandbox) -> bool:
        """Park ``sandbox`` on its own cluster (see :meth:`Backend.park
        <sandpool.core.base.Backend.park>`); False when that cluster cannot park, or is down.

        Raises:
            InfraError: As the member raised it.
        """
        m = self._owner.get(sandbox)
        if m is None or m.down is not None:
            return False
        return await m.backend.park(sandbox)

    async def unpark(self, sandbox: Sandbox) -> Sandbox:
        """Run parked ``sandbox`` again on its own cluster; the new handle takes its place
        there (a parked sandbox never moves: its identity is that cluster's object).

        Raises:
            SandboxDied: Its cluster went down meanwhile (the pool claims another).
            InfraError: As the member raised it.
        """
        m = self._owner.get(sandbox)
        if m is None:
            raise errors.SandboxDied(f"sandbox {sandbox.id} is not parked on any cluster")
        if m.down is not None:
            raise errors.SandboxDied(f"cluster {m.name} of parked sandbox {sandbox.id} "
                                     f"is down: {m.down}")
        new = await m.backend.unpark(sandbox)
        if new is not sandbox:
            self._owner.pop(sandbox, None)
            m.live.discard(sandbox)
            self._owner[new] = m
            m.live.add(new)
        return new

    async def _delete_on(self, m: _Member, sandbox: Sandbox) -> None:
        if m.down is None:
            await m.backend.delete(sandbox)
            return
        try:
            await asyncio.wait_for(m.backend.delete(sandbox), self.down_timeout)
        except TimeoutError:
            log.warning("cluster %s is down: sandbox %s was not deleted; run `sandpool gc` "
                        "against it once it is back", m.name, sandbox.id)

    async def aclose(self) -> None:
        """Close every cluster's backend (one that is down within ``down_timeout``)."""
        async def one(m: _Member) -> None:
            try:
                if m.down is None:
                    await m.backend.aclose()
                else:
                    await asyncio.wait_for(m.backend.aclose(), self.down_timeout)
            except TimeoutError:
                log.warning("cluster %s is down: its objects were not all deleted; run "
                            "`sandpool gc` against it once it is back", m.name)

        for task in self._moving:
            task.cancel()
        await asyncio.gather(*(one(m) for m in self._members), *self._moving,
                             return_exceptions=True)

    @property
    def api_writes(self) -> int:
        return sum(m.backend.api_writes for m in self._members)

    @property
    def write_rates(self) -> dict[str, AdaptiveRate]:
        return {r.cluster: r for m in self._members for r in m.backend.write_rates.values()}

    @property
    def cluster_stats(self) -> list[ClusterStats]:
        """Per cluster: sandboxes created and live, failed creations, failovers, and when
        and why it went down."""
        return [m.stats(self._t0) for m in self._members]

    # -- a cluster going away --------------------------------------------------------------

    def _mark_down(self, m: _Member, exc: BaseException) -> None:
        if m.down is not None:
            return
        m.down = f"{type(exc).__name__}: {exc}"
        m.down_at = time.monotonic()
        log.warning("cluster %s went away (%s); its %d sandboxes are lost and new ones go to "
                    "the others", m.name, m.down, len(m.live))
        if any(x.down is None for x in self._members) and self._warm:
            task = asyncio.get_running_loop().create_task(self._move_warm_targets())
            self._moving.add(task)
            task.add_done_callback(self._moving.discard)

    async def _move_warm_targets(self) -> None:
        """Give the clusters still up the warm targets of the one that went down."""
        for image, (n, reuse) in list(self._warm.items()):
            try:
                await self.set_warm_target(image, n, reuse=reuse)
            except errors.SandpoolError as exc:  # the next creation finds out for itself
                log.warning("moving the warm target of %s failed: %s", image, exc)


def _unreachable(exc: BaseException) -> bool:
    """True when ``exc`` says the cluster could not be reached at all (not that it refused
    or failed this one sandbox)."""
    return isinstance(exc, errors.BackendUnavailable) or (
        isinstance(exc, errors.ApiError) and exc.status is None)


def _rendezvous(image: str, cluster: str, weight: float) -> float:
    """Weighted rendezvous (highest random weight) score of ``cluster`` for ``image``."""
    h = int.from_bytes(hashlib.sha256(f"{image}\0{cluster}".encode()).digest()[:8], "big")
    u = (h + 0.5) / 2**64  # uniform in (0, 1)
    return -weight / math.log(u)
