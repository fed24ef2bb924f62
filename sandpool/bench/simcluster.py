"""The simulated clusters of :mod:`sandpool.bench.simulate`: what the model holds, per cluster.

Built on SimPy (processes over one simulated clock); every latency below is in seconds on
that clock, sizes in GB, bandwidth in MB/s, each a field of :class:`SimParams`:

* **nodes** (:class:`Node`): each has ``disk_gb`` of image disk (least recently used images
  not in use are evicted to make room) and ``bandwidth_mbps`` of pull bandwidth shared
  equally by its pulls in flight (processor sharing, as ``hack/cluster/imagemodel.py`` does
  on kwok); a pod whose image is being pulled on its node waits for that pull; then
  ``cached_pull_s`` and ``boot_s``. Image sizes follow the seed image model
  (``min + lognormal``, seeded by name: :func:`image_size`).
* **node agent**: pods bound to nodes are taken up one at a time, ``provision_s`` each,
  before their pulls start (kwok's provisioner: a workdir copy and an ``Exec`` per pod; a
  real kubelet per node starts its pods' pulls at once: 0);
* **scheduler**: binds a pod to a node that has or is pulling its image with probability
  ``image_locality``, else to the node with the fewest pods (placement,
  :func:`place_windows`, pins warm and reuse pods to their image's node);
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
  factor in ``[1 - jitter, 1 + jitter]`` (:meth:`Cluster.lat`). A pod exec of the pods
  baseline fails with probability ``exec_pod_fail`` (as kwok's did under load).

How the rollouts of a burst use these is :func:`sandpool.bench.simulate.simulate`'s.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import simpy

from sandpool.core.rate import AdaptiveRate, RateControl

__all__ = ["Cluster", "Node", "SimParams", "image_size", "place_windows"]

GB, MB = 1e9, 1e6


@dataclass(frozen=True)
class SimParams:
    """One cluster and the workload's timings (seconds, GB, MB/s); see this module's docstring.

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

@functools.lru_cache(maxsize=1 << 16)
def image_size(image: str, p: SimParams) -> float:
    """Bytes of ``image`` under the seed image model (the law of hack/cluster's model)."""
    rng = random.Random(int.from_bytes(hashlib.sha256(image.encode()).digest()[:8], "big"))
    extra = max(p.image_median_gb - p.image_min_gb, 0.01)
    return (p.image_min_gb + rng.lognormvariate(math.log(extra), p.image_sigma)) * GB


class Node:
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


class Cluster:
    """One cluster: nodes, API server, controller, and sandpool's client to it."""

    def __init__(self, env: simpy.Environment, p: SimParams, name: str,
                 rng: random.Random) -> None:
        self.env, self.p, self.name, self.rng = env, p, name, rng
        self.nodes = [Node(env, p, f"{name}-n{i}") for i in range(p.nodes)]
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

    def node_for(self, image: str) -> Node:
        having = [n for n in self.nodes if n.has(image) or n.in_use[image]]
        if having and self.rng.random() < self.p.image_locality:
            return min(having, key=lambda n: n.pods)
        return min(self.nodes, key=lambda n: n.pods)

    def start_pod(self, image: str, node: Node | None) -> Iterator[simpy.Event]:
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

    def stop_pod(self, image: str, node: Node) -> None:
        node.pods -= 1
        node.in_use[image] -= 1
        self.all_writes += 1


def place_windows(images: list[str], p: SimParams, nodes: int) -> tuple[list[list[str]], dict]:
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
