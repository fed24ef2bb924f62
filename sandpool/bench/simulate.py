"""A discrete-event model of a burst on Kubernetes, for shapes no machine here can run.

``sandpool bench --simulate`` runs the burst of ``bench/k8s_burst.py`` (``pods``: a Pod per
rollout; ``warm``: placement, prepull, a SandboxWarmPool per image and a SandboxClaim per
rollout; ``reuse``: placement, prepull, one Sandbox per image reset between its rollouts) in
this model instead of on a cluster, over one or several clusters, and reports the same
figures, marked as predicted. Built on SimPy (processes over one simulated clock). What it
models, per cluster:

* **nodes**: each has ``disk_gb`` of image disk (least recently used images not in use are
  evicted to make room) and ``bandwidth_mbps`` of pull bandwidth shared equally by its pulls
  in flight (processor sharing, as ``hack/cluster/imagemodel.py`` does on kwok); a pod whose
  image is being pulled on its node waits for that pull; then ``cached_pull_s`` and
  ``boot_s``. Image sizes follow the seed image model (``min + lognormal``, seeded by name).
* **node agent**: pods bound to nodes are taken up one at a time, ``provision_s`` each,
  before their pulls start (kwok's provisioner: a workdir copy and an ``Exec`` per pod; a
  real kubelet per node starts its pods' pulls at once: 0);
* **scheduler**: binds a pod to a node that has or is pulling its image with probability
  ``image_locality``, else to the node with the fewest pods (placement pins warm and reuse
  pods to their image's node);
* **API server**: ``api_seats`` writes executing at once, each ``api_write_s``; a write that
  finds every seat taken is rejected with 429 and ``Retry-After: 1`` (APF's Reject);
* **sandpool's writes**: through the creation-rate controller of :mod:`sandpool.core.rate`
  (the same class, on the simulated clock), retried on 429 as the client does;
* **the agent-sandbox controller**: ``controller_workers`` reconciles at once, each
  ``controller_s``, binding claims to warm sandboxes and refilling warm pools at
  ``refill_per_s`` per pool (0: unpaced);
* **sandboxes**: the agent session opens in ``agent_s`` and the pristine state is recorded in
  ``record_s`` (before the claim when presessions are on), a command's round trip is
  lognormal with median ``exec_s`` (``exec_pod_s`` for the pods baseline's pod exec) and
  ``exec_sigma``, an in-place reset ``reset_s``; every other latency is scaled by a uniform
  factor in ``[1 - jitter, 1 + jitter]``. A pod exec of the pods baseline fails with
  probability ``exec_pod_fail`` (as kwok's did under load), and the rollout is retried on a
  new pod, its TTFC counted from that attempt's claim (as
  :func:`~sandpool.core.rollout.run_rollout` reports it).

The defaults are calibrated from the kwok runs of ``bench/k8s_burst.py`` on the 2-core
development machine (:data:`sandpool.bench.predict.MEASURED` lists every figure, with its
source); :func:`sandpool.bench.predict.compare` gives the model's error on each of them.
The real node's runs (``bench/real_node.py``) are not among them: their burst ran one image
under several names, whose shared layers are pulled once, and the model has no layers.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import simpy

from sandpool.core.metrics import TTFCStats
from sandpool.core.rate import AdaptiveRate, RateControl

__all__ = ["SimParams", "SimResult", "simulate"]

GB, MB = 1e9, 1e6


@dataclass(frozen=True)
class SimParams:
    """One cluster and the workload's timings (seconds, GB, MB/s); see the module docstring.

    Usage: ``simulate("reuse", images=4578, rollouts=4, params=SimParams(), clusters=3)``.
    """

    nodes: int = 10
    disk_gb: float = 100.0
    bandwidth_mbps: float = 400.0
    image_min_gb: float = 1.2
    image_median_gb: float = 2.5
    image_sigma: float = 0.6
    provision_s: float = 0.0
    cached_pull_s: float = 0.1
    boot_s: float = 1.0
    image_locality: float = 1.0
    api_seats: int = 40
    api_write_s: float = 0.05
    qps: float = 50.0
    burst: int = 100
    adaptive_rate: bool = True
    controller_workers: int = 1
    controller_s: float = 0.35
    refill_per_s: float = 0.0
    agent_s: float = 1.5
    record_s: float = 0.9
    presessions: bool = False
    exec_s: float = 0.42
    exec_pod_s: float = 0.6
    exec_sigma: float = 0.5
    exec_pod_fail: float = 0.0
    reset_s: float = 1.0
    think_s: float = 5.0
    delete_batch_s: float = 0.5
    jitter: float = 0.2
    seed: int = 1


@dataclass
class SimResult:
    """What one simulated mode gave: the fields of a k8s_burst run, predicted."""

    mode: str
    images: int
    rollouts: int
    clusters: int
    ttfc_samples: list[float]
    pods_created: int
    sandpool_writes: int
    all_writes: int
    retried_429: int
    wall_s: float
    windows: int
    rate_lowest: float
    timeline: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def ttfc(self) -> TTFCStats:
        return TTFCStats.from_samples(self.ttfc_samples)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "predicted": True, "images": self.images,
                "rollouts": self.rollouts, "clusters": self.clusters,
                "ttfc": self.ttfc.model_dump(), "pods_created": self.pods_created,
                "sandpool_writes": self.sandpool_writes, "all_writes": self.all_writes,
                "retried_429": self.retried_429, "wall_s": self.wall_s,
                "windows": self.windows, "rate_lowest": self.rate_lowest}


@functools.lru_cache(maxsize=1 << 16)
def image_size(image: str, p: SimParams) -> float:
    """Bytes of ``image`` under the seed image model (the law of hack/cluster's model)."""
    rng = random.Random(int.from_bytes(hashlib.sha256(image.encode()).digest()[:8], "big"))
    extra = max(p.image_median_gb - p.image_min_gb, 0.01)
    return (p.image_min_gb + rng.lognormvariate(math.log(extra), p.image_sigma)) * GB


class _Node:
    """Image disk with LRU eviction and processor-shared pull bandwidth."""

    def __init__(self, env: simpy.Environment, p: SimParams, name: str) -> None:
        self.env, self.p, self.name = env, p, name
        self.cache: OrderedDict[str, float] = OrderedDict()
        self.in_use: Counter[str] = Counter()
        self.active: dict[str, list[Any]] = {}  # image -> [bytes left, done event, size]
        self.used = 0.0
        self.pods = 0
        self._t = 0.0
        self._proc: simpy.Process | None = None

    def has(self, image: str) -> bool:
        return image in self.cache or image in self.active

    def pull(self, image: str, size: float) -> simpy.Event:
        """An event that fires once ``image`` is on this node."""
        if image in self.cache:
            self.cache.move_to_end(image)
            return self.env.timeout(0)
        if image in self.active:
            return self.active[image][1]
        for old in [i for i in self.cache if not self.in_use[i]]:
            if self.used + size <= self.p.disk_gb * GB:
                break
            self.used -= self.cache.pop(old)
        self.used += size
        self._advance()
        self.active[image] = [size, self.env.event(), size]
        self._kick()
        return self.active[image][1]

    def _advance(self) -> None:
        if self.active:
            share = self.p.bandwidth_mbps * MB / len(self.active) * (self.env.now - self._t)
            for a in self.active.values():
                a[0] -= share
        self._t = self.env.now

    def _kick(self) -> None:
        if self._proc is not None and self._proc.is_alive:
            self._proc.interrupt()
        else:
            self._proc = self.env.process(self._run())

    def _run(self) -> Iterator[simpy.Event]:
        while self.active:
            share = self.p.bandwidth_mbps * MB / len(self.active)
            try:
                yield self.env.timeout(max(0.0, min(a[0] for a in self.active.values()) / share))
            except simpy.Interrupt:
                continue
            self._advance()
            for image in [i for i, a in self.active.items() if a[0] <= 1.0]:
                _, done, size = self.active.pop(image)
                self.cache[image] = size
                done.succeed()


class _Cluster:
    """One cluster: nodes, API server, controller, and sandpool's client to it."""

    def __init__(self, env: simpy.Environment, p: SimParams, name: str,
                 rng: random.Random) -> None:
        self.env, self.p, self.name, self.rng = env, p, name, rng
        self.nodes = [_Node(env, p, f"{name}-n{i}") for i in range(p.nodes)]
        self.seats = simpy.Resource(env, capacity=p.api_seats)
        self.controller = simpy.PriorityResource(env, capacity=p.controller_workers)
        self.provisioner = simpy.Resource(env, capacity=1)
        self.rate = AdaptiveRate(RateControl(p.qps, p.burst, adaptive=p.adaptive_rate,
                                             min_rate=min(0.5, p.qps)), cluster=name, now=0.0)
        self._room = env.event()
        self._fifo = simpy.Resource(env, capacity=1)
        self.writes = self.all_writes = self.pods = self.retried = 0

    def lat(self, s: float) -> float:
        return s * (1 + self.p.jitter * (2 * self.rng.random() - 1))

    # -- API writes --------------------------------------------------------------------

    def write(self) -> Iterator[simpy.Event]:
        """One of sandpool's writes: through its rate controller, retried on 429."""
        while True:
            with self._fifo.request() as turn:  # first come first served, as acquire() is
                yield turn
                while (wait := self.rate.take(self.env.now)) > 0:
                    if wait == math.inf:
                        self._room = self.env.event() if self._room.triggered else self._room
                        yield self._room
                    else:
                        yield self.env.timeout(wait)
            self.writes += 1
            t0 = self.env.now
            if self.seats.count >= self.seats.capacity:
                self.rate.answered(self.env.now, 429, 0.001, retry_after=1.0)
                self._release()
                self.retried += 1
                yield self.env.timeout(1.0 + 0.5 * self.rng.random())
                continue
            with self.seats.request() as seat:
                yield seat
                yield self.env.timeout(self.lat(self.p.api_write_s))
            self.rate.answered(self.env.now, 201, self.env.now - t0)
            self._release()
            return

    def _release(self) -> None:
        self.rate.release()
        if not self._room.triggered:
            self._room.succeed()

    # -- pods --------------------------------------------------------------------------

    def node_for(self, image: str) -> _Node:
        having = [n for n in self.nodes if n.has(image) or n.in_use[image]]
        if having and self.rng.random() < self.p.image_locality:
            return min(having, key=lambda n: n.pods)
        return min(self.nodes, key=lambda n: n.pods)

    def start_pod(self, image: str, node: _Node | None) -> Iterator[simpy.Event]:
        """Schedule, pull and boot a pod of ``image``; returns once it is Ready."""
        self.pods += 1
        self.all_writes += 4  # the kubelet's status patches, the provisioner's Exec and note
        node = node or self.node_for(image)
        node.pods += 1
        node.in_use[image] += 1
        if self.p.provision_s > 0:
            with self.provisioner.request() as turn:
                yield turn
                yield self.env.timeout(self.lat(self.p.provision_s))
        yield node.pull(image, image_size(image, self.p))
        yield self.env.timeout(self.lat(self.p.cached_pull_s) + self.lat(self.p.boot_s))
        return node

    def stop_pod(self, image: str, node: _Node) -> None:
        node.pods -= 1
        node.in_use[image] -= 1
        self.all_writes += 1


def _windows(images: list[str], p: SimParams, nodes: int) -> tuple[list[list[str]], dict]:
    """Placement: images onto nodes by size (first fit, largest first), in windows that fit
    the nodes' disks (the plan bench/k8s_burst.py makes with ``KubernetesBackend.place``)."""
    cap = p.disk_gb * GB * 0.9
    windows: list[list[str]] = []
    node_of: dict[str, int] = {}
    left = sorted(images, key=lambda i: -image_size(i, p))
    while left:
        free = [cap] * nodes
        window, rest = [], []
        for image in left:
            size = image_size(image, p)
            n = max(range(nodes), key=lambda k: free[k])
            if free[n] >= size:
                free[n] -= size
                node_of[image] = n
                window.append(image)
            else:
                rest.append(image)
        if not window:  # an image larger than a node's disk: place it alone
            window, rest = rest[:1], rest[1:]
            node_of[window[0]] = 0
        windows.append(window)
        left = rest
    return windows, node_of


def simulate(mode: str, *, images: int, rollouts: int, params: SimParams | None = None,
             clusters: int = 1, concurrency: int | None = None) -> SimResult:
    """Run the burst of ``images`` x ``rollouts`` in ``mode`` (``pods``, ``warm``, ``reuse``)
    over ``clusters`` identical clusters (images spread over them by affinity), every lane
    at once unless ``concurrency`` bounds the rollouts in flight.

    Raises:
        ValueError: An unknown mode.
    """
    if mode not in ("pods", "warm", "reuse"):
        raise ValueError(f"mode={mode!r}: use pods, warm or reuse")
    p = params or SimParams()
    env = simpy.Environment()
    rng = random.Random(p.seed)
    cl = [_Cluster(env, p, f"c{i}", rng) for i in range(clusters)]
    names = [f"sim-img-{i}" for i in range(images)]
    home = {n: cl[int(hashlib.sha256(n.encode()).hexdigest(), 16) % clusters] for n in names}
    ttfc: list[float] = []
    gate = simpy.Resource(env, capacity=concurrency or images * rollouts)
    windows_n = [1]

    def command(c: _Cluster) -> simpy.Event:
        median = p.exec_pod_s if mode == "pods" else p.exec_s
        return env.timeout(median * rng.lognormvariate(0.0, p.exec_sigma))

    def pods_rollout(image: str) -> Iterator[simpy.Event]:
        c = home[image] if clusters > 1 else cl[0]
        with gate.request() as g:
            yield g
            while True:
                t0 = env.now
                yield from c.write()  # POST pod
                node = yield from c.start_pod(image, None)
                yield command(c)
                if rng.random() >= p.exec_pod_fail:
                    break
                yield from c.write()  # the failed attempt's pod is deleted
                c.stop_pod(image, node)
            ttfc.append(env.now - t0)
            yield env.timeout(c.lat(p.think_s))
            yield command(c)
            yield from c.write()  # DELETE pod
            c.stop_pod(image, node)

    def run_windows(body) -> Iterator[simpy.Event]:
        by_cluster: dict[_Cluster, list[str]] = {}
        for n in names:
            by_cluster.setdefault(home[n], []).append(n)
        procs = [env.process(cluster_windows(c, imgs, body)) for c, imgs in by_cluster.items()]
        yield simpy.AllOf(env, procs)

    def cluster_windows(c: _Cluster, imgs: list[str], body) -> Iterator[simpy.Event]:
        windows, node_of = _windows(imgs, p, p.nodes)
        windows_n[0] = max(windows_n[0], len(windows))
        pulls = [c.nodes[node_of[i]].pull(i, image_size(i, p)) for i in windows[0]]
        for wi, window in enumerate(windows):
            yield simpy.AllOf(env, pulls)
            if wi + 1 < len(windows):  # the next window pulls while this one runs
                nxt = windows[wi + 1]
                pulls = [c.nodes[node_of[i]].pull(i, image_size(i, p)) for i in nxt]
                for i in nxt:
                    c.nodes[node_of[i]].in_use[i] += 1  # pinned: not evicted meanwhile
            for i in window:
                c.nodes[node_of[i]].in_use[i] += 1
            yield from body(c, window, node_of)
            for i in window:
                c.nodes[node_of[i]].in_use[i] -= 1
            if wi + 1 < len(windows):
                for i in windows[wi + 1]:
                    c.nodes[node_of[i]].in_use[i] -= 1

    def warm_window(c: _Cluster, window: list[str], node_of: dict) -> Iterator[simpy.Event]:
        ready: dict[str, simpy.Store] = {i: simpy.Store(env) for i in window}
        live = [True]

        def replica(image: str, refill: bool = False) -> Iterator[simpy.Event]:
            with c.controller.request(priority=1 if refill else 0) as w:
                yield w
                if refill and not live[0]:
                    return  # the window's warm pools were deleted meanwhile
                yield env.timeout(c.lat(p.controller_s))
            c.all_writes += 2  # the controller's Sandbox and Pod
            node = yield from c.start_pod(image, c.nodes[node_of[image]])
            if p.presessions:
                yield env.timeout(c.lat(p.agent_s) + c.lat(p.record_s))
            yield ready[image].put(node)

        def refill(image: str) -> Iterator[simpy.Event]:
            if p.refill_per_s > 0:
                yield env.timeout(1.0 / p.refill_per_s)
            if live[0]:
                env.process(replica(image, refill=True))

        for i in window:
            yield from c.write()  # template
            yield from c.write()  # warm pool
        starts = [env.process(replica(i)) for i in window for _ in range(rollouts)]
        yield simpy.AllOf(env, starts)

        def rollout(image: str) -> Iterator[simpy.Event]:
            with gate.request() as g:
                yield g
                t0 = env.now
                yield from c.write()  # claim
                with c.controller.request() as w:
                    yield w
                    yield env.timeout(c.lat(p.controller_s))
                node = yield ready[image].get()
                env.process(refill(image))
                if not p.presessions:
                    yield env.timeout(c.lat(p.agent_s) + c.lat(p.record_s))
                yield command(c)
                ttfc.append(env.now - t0)
                yield env.timeout(c.lat(p.think_s))
                yield command(c)
                c.stop_pod(image, node)

        yield simpy.AllOf(env, [env.process(rollout(i)) for i in window for _ in range(rollouts)])
        live[0] = False
        for _ in range(max(1, int(len(window) * rollouts * p.delete_batch_s / 10))):
            yield from c.write()  # batched deletes of the window's claims and pools

    def reuse_window(c: _Cluster, window: list[str], node_of: dict) -> Iterator[simpy.Event]:
        def lane(image: str) -> Iterator[simpy.Event]:
            yield from c.write()  # the image's Sandbox object
            node = yield from c.start_pod(image, c.nodes[node_of[image]])
            yield env.timeout(c.lat(p.agent_s) + c.lat(p.record_s))
            for _ in range(rollouts):
                with gate.request() as g:
                    yield g
                    t0 = env.now
                    yield command(c)
                    ttfc.append(env.now - t0)
                    yield env.timeout(c.lat(p.think_s))
                    yield command(c)
                    yield env.timeout(c.lat(p.reset_s))
            c.stop_pod(image, node)

        yield simpy.AllOf(env, [env.process(lane(i)) for i in window])
        for _ in range(max(1, int(len(window) / 20))):
            yield from c.write()  # batched deletes

    if mode == "pods":
        done = simpy.AllOf(env, [env.process(pods_rollout(i)) for i in names
                                 for _ in range(rollouts)])
    else:
        done = env.process(run_windows(warm_window if mode == "warm" else reuse_window))
    env.run(until=done)
    return SimResult(
        mode=mode, images=images, rollouts=rollouts, clusters=clusters, ttfc_samples=ttfc,
        pods_created=sum(c.pods for c in cl), sandpool_writes=sum(c.writes for c in cl),
        all_writes=sum(c.all_writes + c.writes for c in cl),
        retried_429=sum(c.retried for c in cl), wall_s=env.now, windows=windows_n[0],
        rate_lowest=min(c.rate.lowest for c in cl))


def error(predicted: float, measured: float) -> float:
    """Relative error of a prediction (0.2: 20 % off)."""
    return abs(predicted - measured) / measured if measured else math.inf


def with_params(p: SimParams, **kw: Any) -> SimParams:
    """``p`` with some parameters changed."""
    return replace(p, **kw)


def summary(results: list[SimResult], labels: list[str] | None = None) -> str:
    """The table of a k8s_burst run, for predicted results (marked so); each column headed
    by its mode, shape and clusters, or by ``labels``."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}"

    rows = [
        ("TTFC mean (ms)", lambda r: ms(r.ttfc.mean_s)),
        ("TTFC p50 (ms)", lambda r: ms(r.ttfc.p50_s)),
        ("TTFC p99 (ms)", lambda r: ms(r.ttfc.p99_s)),
        ("TTFC max (ms)", lambda r: ms(r.ttfc.max_s)),
        ("rollouts", lambda r: str(len(r.ttfc_samples))),
        ("pods created", lambda r: str(r.pods_created)),
        ("API writes, all clients", lambda r: str(r.all_writes)),
        ("API writes, sandpool", lambda r: str(r.sandpool_writes)),
        ("  per rollout", lambda r: f"{r.sandpool_writes / max(1, len(r.ttfc_samples)):.3f}"),
        ("  429s retried", lambda r: str(r.retried_429)),
        ("  lowest write rate (/s)", lambda r: f"{r.rate_lowest:.3g}"),
        ("windows", lambda r: str(r.windows)),
        ("wall time (s)", lambda r: f"{r.wall_s:.1f}"),
    ]
    head = labels or [f"{r.mode} {r.images}x{r.rollouts} {r.clusters}c" for r in results]
    width = max(14, *(len(h) + 2 for h in head))
    lines = ["PREDICTED (discrete-event model, not a run)",
             f"{'':<26}" + "".join(f"{h:>{width}}" for h in head)]
    lines += [f"{label:<26}" + "".join(f"{fn(r):>{width}}" for r in results) for label, fn in rows]
    return "\n".join(lines)
