"""The simulated clusters of :mod:`sandpool.bench.simulate`: what the model holds, per cluster.

Built on SimPy (processes over one simulated clock); every latency below is in seconds on
that clock, sizes in GB, bandwidth in MB/s, each a field of :class:`SimParams`. An
operation costs a wall time (its median when nothing else is in flight) of which some is
CPU; where the pods, the control plane and sandpool share one machine's ``host_cpus`` (a
kwok cluster: every pod is a process of this machine), those CPU seconds are shared by
everything in flight and ``host_load`` jobs of other work (:class:`Shared`, at most one CPU
each), so a burst slows every operation in it; 0: nothing shared (a real cluster's nodes
run their own pods).

* **nodes** (:class:`Node`): each has ``disk_gb`` of image disk (least recently used images
  not in use are evicted to make room) and ``bandwidth_mbps`` of pull bandwidth shared
  equally by its pulls in flight (processor sharing, as ``hack/cluster/imagemodel.py`` does
  on kwok); a pod whose image is being pulled on its node waits for that pull; then
  ``cached_pull_s`` and ``boot_s``. Image sizes follow the seed image model
  (``min + lognormal``, seeded by name: :func:`image_size`).
* **node agent**: a pod bound to a node is taken up by one of ``provision_workers`` (kwok's
  provisioner: a workdir copy and an ``Exec`` per pod), ``provision_s`` of which
  ``cpu_pod_s`` CPU (the pod's whole CPU: API server, scheduler, node agent, its delete),
  before its pull starts;
* **scheduler**: binds a pod to a node that runs (or starts) a pod of its image with
  probability ``image_locality``, else to any node (pods that request no resources score
  alike; an image merely cached on a node does not draw a pod there): on kwok, set from
  the image pulls of the pods bursts (more than one per image, fewer than one per pod);
  while every node holds ``node_pods`` pods a pod waits (placement, :func:`place_windows`,
  pins warm and reuse pods to their image's node);
* **API server**: ``api_seats`` writes executing at once, each ``api_write_s``; a write that
  finds every seat taken is rejected with 429 and ``Retry-After: 1`` (APF's Reject);
* **sandpool's writes**: through the creation-rate controller of :mod:`sandpool.core.rate`
  (the same class, on the simulated clock), retried on 429 as the client does; a run's
  preflight makes ``preflight_writes`` (``preflight_writes_pods`` in pods mode);
* **the agent-sandbox controller**: ``controller_workers`` claim reconciles at once, each
  binding a claim to a warm sandbox in ``controller_s`` (``cpu_claim_s`` CPU); one warm-pool
  reconcile at a time refills a pool (a write each), at ``refill_per_s`` per pool (0: unpaced);
  with ``exact`` (the burst announced up front, as ``bench/k8s_burst.py`` does) each warm
  pool holds its image's claims from the start and is lowered after each claim (one PATCH
  in flight per pool); the warm-pool controller's pass after the claim (``reconcile_s``,
  one at a time) refills a pod, then deleted, when it runs before that PATCH landed;
* **sandboxes**: the agent session opens and the pristine state is recorded in ``agent_s``
  (``cpu_agent_s``; before the claim when presessions are on); a command's round trip is
  lognormal with median ``exec_s`` (``exec_pod_s`` for the pods baseline's pod exec) and
  ``exec_sigma`` (CPU ``cpu_exec_s``, ``cpu_exec_pod_s``), an in-place reset ``reset_s``
  (``cpu_reset_s``), a reuse sandbox's first claim checks out the task's commit in
  ``checkout_s`` (``cpu_checkout_s``); every other latency is scaled by a uniform factor in
  ``[1 - jitter, 1 + jitter]`` (:meth:`Cluster.lat`). A pod exec of the pods baseline fails
  with probability ``exec_pod_fail``.

The defaults are this machine's kwok cluster: each operation measured one at a time by
``bench/sim_calibrate.py``; from the bursts of ``bench/k8s_burst.py``, ``image_locality``
and ``reconcile_s`` (their pulls and pods), ``cpu_claim_s`` (a claim's CPU with what it
sets off in the control plane, which one claim at a time cannot separate from its refill's:
fitted to the warm burst at 40 images x 4, concurrency 40) and ``cpu_exec_s`` (a command's
CPU among a hundred lanes, twice its CPU alone: fitted to the reuse burst at 100 images x
4); ``host_load``, other work's jobs on the machine, is 0 (the runs' load averages are
printed beside them); :func:`sandpool.bench.predict.real_cluster`
swaps in the real node's figures. How the rollouts of a burst use these is
:func:`sandpool.bench.simulate.simulate`'s.
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
    node_pods: int = 110
    bandwidth_mbps: float = 400.0
    image_min_gb: float = 1.2
    image_median_gb: float = 2.5
    image_sigma: float = 0.6
    image_locality: float = 0.55
    host_cpus: float = 2.0
    host_load: float = 0.0
    provision_workers: int = 8
    provision_s: float = 0.053
    cpu_pod_s: float = 0.098
    cached_pull_s: float = 0.1
    boot_s: float = 0.4
    api_seats: int = 40
    api_write_s: float = 0.003
    qps: float = 50.0
    preflight_writes: int = 19
    preflight_writes_pods: int = 8
    burst: int = 100
    adaptive_rate: bool = True
    controller_workers: int = 50
    controller_s: float = 0.11
    cpu_claim_s: float = 0.075
    refill_per_s: float = 0.0
    exact: bool = True
    reconcile_s: float = 0.5
    agent_s: float = 0.232
    cpu_agent_s: float = 0.153
    presessions: bool = True
    exec_s: float = 0.0067
    cpu_exec_s: float = 0.01
    exec_pod_s: float = 0.032
    cpu_exec_pod_s: float = 0.035
    exec_sigma: float = 0.5
    exec_pod_fail: float = 0.0
    reset_s: float = 0.173
    cpu_reset_s: float = 0.088
    checkout_s: float = 0.0104
    cpu_checkout_s: float = 0.009
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


class Shared:
    """``capacity`` units per second shared equally by the jobs in flight (processor
    sharing), at most ``per_job`` each: a node's pull bandwidth, or a host's CPUs."""

    def __init__(self, env: simpy.Environment, capacity: float, per_job: float = math.inf,
                 background: float = 0.0) -> None:
        self.env, self.capacity, self.per_job = env, capacity, per_job
        self.background = background  # jobs of other work, always in flight
        self.jobs: dict[Any, list[Any]] = {}  # key -> [units left, done event]
        self._t = 0.0
        self._proc: simpy.Process | None = None

    def _rate(self) -> float:
        return min(self.per_job, self.capacity / max(1.0, len(self.jobs) + self.background))

    def run(self, units: float, key: Any = None) -> simpy.Event:
        """An event that fires once ``units`` are done (the job of ``key`` already in flight:
        its event)."""
        if key is not None and key in self.jobs:
            return self.jobs[key][1]
        done = self.env.event()
        if units <= 0:
            return done.succeed()
        self._advance()
        self.jobs[key if key is not None else object()] = [units, done]
        if self._proc is not None and self._proc.is_alive:
            self._proc.interrupt()
        else:
            self._proc = self.env.process(self._run())
        return done

    def _advance(self) -> None:
        if self.jobs:
            share = self._rate() * (self.env.now - self._t)
            for job in self.jobs.values():
                job[0] -= share
        self._t = self.env.now

    def _run(self) -> Iterator[simpy.Event]:
        while self.jobs:
            try:
                yield self.env.timeout(max(0.0, min(j[0] for j in self.jobs.values()) / self._rate()))
            except simpy.Interrupt:
                continue
            self._advance()
            for key in [k for k, j in self.jobs.items() if j[0] <= 1e-9 * self.capacity]:
                self.jobs.pop(key)[1].succeed()


class Node:
    """Image disk with LRU eviction and processor-shared pull bandwidth."""

    def __init__(self, env: simpy.Environment, p: SimParams, name: str) -> None:
        self.env, self.p, self.name = env, p, name
        self.cache: OrderedDict[str, float] = OrderedDict()
        self.in_use: Counter[str] = Counter()
        self.link = Shared(env, p.bandwidth_mbps * MB)
        self.used = 0.0
        self.pods = 0
        self.held: list[Any] = []  # the cluster's pod slots its pods hold
        self.pulls = 0

    def pull(self, image: str, size: float) -> simpy.Event:
        """An event that fires once ``image`` is on this node."""
        if image in self.cache:
            self.cache.move_to_end(image)
            return self.env.timeout(0)
        if image in self.link.jobs:
            return self.link.jobs[image][1]
        for old in [i for i in self.cache if not self.in_use[i]]:
            if self.used + size <= self.p.disk_gb * GB:
                break
            self.used -= self.cache.pop(old)
        self.used += size
        self.pulls += 1
        done = self.link.run(size, key=image)
        done.callbacks.append(lambda _: self.cache.__setitem__(image, size))
        return done


class Cluster:
    """One cluster: nodes, API server, controller, and sandpool's client to it."""

    def __init__(self, env: simpy.Environment, p: SimParams, name: str,
                 rng: random.Random) -> None:
        self.env, self.p, self.name, self.rng = env, p, name, rng
        self.nodes = [Node(env, p, f"{name}-n{i}") for i in range(p.nodes)]
        self.seats = simpy.Resource(env, capacity=p.api_seats)
        self.controller = simpy.Resource(env, capacity=p.controller_workers)
        self.refiller = simpy.Resource(env, capacity=1)
        self.provisioner = simpy.Resource(env, capacity=p.provision_workers)
        self.cpu = (Shared(env, p.host_cpus, per_job=1.0, background=p.host_load)
                    if p.host_cpus else None)
        self.rate = AdaptiveRate(RateControl(p.qps, p.burst, adaptive=p.adaptive_rate,
                                             min_rate=min(0.5, p.qps)), cluster=name, now=0.0)
        self._room = env.event()
        self.slots = simpy.Resource(env, capacity=p.nodes * p.node_pods)
        self._fifo = simpy.Resource(env, capacity=1)
        self.writes = self.all_writes = self.pods = self.retried = 0
        self.cpu_used = 0.0  # CPU seconds of the operations run

    def lat(self, s: float) -> float:
        return s * (1 + self.p.jitter * (2 * self.rng.random() - 1))

    def op(self, wall_s: float, cpu_s: float) -> Iterator[simpy.Event]:
        """An operation of ``wall_s`` (jittered) of which ``cpu_s`` is CPU, shared with
        everything in flight on the host when there is one."""
        yield self.env.timeout(self.lat(max(0.0, wall_s - cpu_s)))
        self.cpu_used += cpu_s
        yield self.cpu.run(cpu_s) if self.cpu is not None else self.env.timeout(cpu_s)

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
        """The scheduler's pick among the nodes with room for one more pod: one with the
        image at ``image_locality``, else any (pods that request nothing score alike)."""
        room = [n for n in self.nodes if n.pods < self.p.node_pods]
        having = [n for n in room if n.in_use[image]]
        if having and self.rng.random() < self.p.image_locality:
            return min(having, key=lambda n: n.pods)
        return self.rng.choice(room)

    def start_pod(self, image: str, node: Node | None) -> Iterator[simpy.Event]:
        """Schedule, provision, pull and boot a pod of ``image``; returns its node once it
        is Ready."""
        self.pods += 1
        self.all_writes += 4  # the kubelet's status patches, the provisioner's Exec and note
        slot = self.slots.request()  # a pod waits while every node is full
        yield slot
        node = node or self.node_for(image)
        node.held.append(slot)
        node.pods += 1
        node.in_use[image] += 1
        with self.provisioner.request() as turn:
            yield turn
            yield from self.op(self.p.provision_s, self.p.cpu_pod_s)
        yield node.pull(image, image_size(image, self.p))
        yield self.env.timeout(self.lat(self.p.cached_pull_s) + self.lat(self.p.boot_s))
        return node

    def agent_start(self) -> Iterator[simpy.Event]:
        """Open a sandbox's agent session and record its pristine state."""
        yield from self.op(self.p.agent_s, self.p.cpu_agent_s)

    def command(self, pod_exec: bool) -> Iterator[simpy.Event]:
        """One command's round trip: over the agent, or as one pod exec."""
        wall, cpu = ((self.p.exec_pod_s, self.p.cpu_exec_pod_s) if pod_exec
                     else (self.p.exec_s, self.p.cpu_exec_s))
        yield from self.op(cpu + (wall - cpu) * self.rng.lognormvariate(0.0, self.p.exec_sigma),
                           cpu)

    def stop_pod(self, image: str, node: Node) -> None:
        self.slots.release(node.held.pop())
        node.pods -= 1
        node.in_use[image] -= 1
        self.all_writes += 1


def place_windows(images: list[str], p: SimParams, slots_per_image: int
                  ) -> tuple[list[list[str]], dict[str, int]]:
    """Placement: sandpool's own plan (:func:`~sandpool.core.backends.kubernetes._placement.plan`,
    as ``bench/k8s_burst.py`` makes it) over ``p.nodes`` nodes of ``disk_gb`` and ``node_pods``;
    returns the windows and each image's node index."""
    from sandpool.core.backends.kubernetes._placement import NodeCapacity, plan

    nodes = [NodeCapacity(str(i), p.disk_gb * GB, p.node_pods) for i in range(p.nodes)]
    made = plan(images, {i: image_size(i, p) for i in images}, nodes,
                slots_per_image=slots_per_image)
    return [list(w) for w in made.windows], {i: int(n) for i, n in made.node_of.items()}
