"""A discrete-event model of a burst on Kubernetes, for shapes no machine here can run.

``sandpool bench --simulate`` runs the burst of ``bench/k8s_burst.py`` (``pods``: a Pod per
rollout; ``warm``: placement, prepull, a SandboxWarmPool per image and a SandboxClaim per
rollout; ``reuse``: placement, prepull, one Sandbox per image reset between its rollouts) in
this model instead of on a cluster, over one or several clusters, and reports the same
figures, marked as predicted.

:mod:`sandpool.bench.simcluster` holds what is modelled per cluster (nodes, scheduler, API
server, sandpool's write rate, the agent-sandbox controller, sandbox latencies) and its
parameters, :class:`SimParams`; this module runs a burst's rollouts over those clusters
(:func:`simulate`) and prints the predicted table (:func:`summary`). When a pod exec of the
pods baseline fails, the rollout is retried on a new pod, its TTFC counted from that
attempt's claim (as :func:`~sandpool.core.rollout.run_rollout` reports it).

The defaults are the local kwok cluster's (see :mod:`sandpool.bench.simcluster`);
:data:`sandpool.bench.predict.MEASURED` lists the bursts measured there, with their source
and load, and :func:`sandpool.bench.predict.compare` gives the model's error on each figure.
Predictions for a real cluster take the real node's pod start, agent, command and reset
figures (``bench/real_node.py``; :func:`sandpool.bench.predict.real_cluster`); its own
burst is not among the checks (one image under several names, whose shared layers are
pulled once: the model has no layers).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import simpy

from sandpool.bench.simcluster import Cluster, Node, SimParams, image_size, place_windows
from sandpool.core.metrics import TTFCStats
from sandpool.core.strategies import get_strategy

__all__ = ["SimParams", "SimResult", "simulate"]


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
    prepulls: int = 0
    pulls: int = 0
    cpu_s: float = 0.0
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

def simulate(mode: str, *, images: int, rollouts: int, params: SimParams | None = None,
             clusters: int = 1, concurrency: int | None = None) -> SimResult:
    """Run the burst of ``images`` x ``rollouts`` in ``mode`` (``pods``, ``warm``, ``reuse``)
    over ``clusters`` identical clusters (images spread over them by affinity), as
    ``bench/k8s_burst.py`` runs it: ``concurrency`` rollouts at once (default: every
    rollout), split into lanes per image by the strategy's plan
    (:meth:`~sandpool.core.strategies.Strategy.plan`: the warm pool's size under ``warm``),
    each lane running its image's rollouts one after another; ``reuse`` runs one lane per
    image.

    Raises:
        ValueError: An unknown mode.
    """
    if mode not in ("pods", "warm", "reuse"):
        raise ValueError(f"mode={mode!r}: use pods, warm or reuse")
    p = params or SimParams()
    env = simpy.Environment()
    rng = random.Random(p.seed)
    cl = [Cluster(env, p, f"c{i}", rng) for i in range(clusters)]
    names = [f"sim-img-{i}" for i in range(images)]
    home = {n: cl[int(hashlib.sha256(n.encode()).hexdigest(), 16) % clusters] for n in names}
    ttfc: list[float] = []
    conc = concurrency or images * rollouts
    gate = simpy.Resource(env, capacity=conc)
    strategy = get_strategy({"pods": "cold", "warm": "warm", "reuse": "reuse"}[mode])
    windows_n = [1]
    prepulls = [0]

    def lanes(imgs: list[str], slots: dict[str, int], rollout) -> simpy.Event:
        """Each image's rollouts over its lanes, one after another on a lane; a lane holds
        one of the ``concurrency`` places while it has rollouts left (as the bench's does)."""
        left = dict.fromkeys(imgs, rollouts)

        def lane(image: str) -> Iterator[simpy.Event]:
            with gate.request() as g:
                yield g
                while left[image]:
                    left[image] -= 1
                    yield from rollout(image)

        return simpy.AllOf(env, [env.process(lane(i)) for i in imgs for _ in range(slots[i])])

    def pods_rollout(image: str) -> Iterator[simpy.Event]:
        c = home[image]
        while True:
            t0 = env.now
            yield from c.write()  # POST pod
            node = yield from c.start_pod(image, None)
            yield from c.command(mode == "pods")
            if rng.random() >= p.exec_pod_fail:
                break
            yield from c.write()  # the failed attempt's pod is deleted
            c.stop_pod(image, node)
        ttfc.append(env.now - t0)
        yield from c.command(mode == "pods")  # the round trip, again
        yield env.timeout(c.lat(p.think_s))
        yield from c.command(mode == "pods")
        yield from c.write()  # DELETE pod
        c.stop_pod(image, node)

    def run_windows(body) -> Iterator[simpy.Event]:
        by_cluster: dict[Cluster, list[str]] = {}
        for n in names:
            by_cluster.setdefault(home[n], []).append(n)
        procs = [env.process(cluster_windows(c, imgs, body)) for c, imgs in by_cluster.items()]
        yield simpy.AllOf(env, procs)

    def cluster_windows(c: Cluster, imgs: list[str], body) -> Iterator[simpy.Event]:
        windows, node_of = place_windows(imgs, p, rollouts if mode == "warm" else 1)
        windows_n[0] = max(windows_n[0], len(windows))
        pulls = [c.nodes[node_of[i]].pull(i, image_size(i, p)) for i in windows[0]]
        n = sum(len({node_of[i] for i in w}) for w in windows)  # a prepull pod per node
        prepulls[0] += n
        c.pods += n
        for _ in range(n + len(windows)):
            yield from c.write()  # the prepull pods, and a collection delete per window
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

    def warm_window(c: Cluster, window: list[str], node_of: dict) -> Iterator[simpy.Event]:
        slots = strategy.plan(dict.fromkeys(window, rollouts), conc)
        ready: dict[str, simpy.Store] = {i: simpy.Store(env) for i in window}
        in_flight, again = dict.fromkeys(window, False), dict.fromkeys(window, False)
        waiting: dict[str, list[simpy.Event]] = {i: [] for i in window}

        def reconcile(image: str, lowered: simpy.Event) -> Iterator[simpy.Event]:
            """The warm-pool controller's pass after a claim took a member: a refill, made
            then deleted, unless the pool was lowered first."""
            with c.refiller.request() as w:
                yield w
                if lowered.triggered:
                    return
                yield env.timeout(c.lat(p.reconcile_s))
            c.pods += 1  # the refill, deleted as the newest unready member once lowered
            c.all_writes += 3
            yield from c.op(p.cpu_pod_s, p.cpu_pod_s)
        live = [True]

        def replica(image: str, refill: bool = False) -> Iterator[simpy.Event]:
            with c.refiller.request() as w:  # one warm-pool reconcile at a time
                yield w
                if refill and not live[0]:
                    return  # the window's warm pools were deleted meanwhile
                yield env.timeout(c.lat(p.api_write_s))
            c.all_writes += 2  # the controller's Sandbox and Pod
            node = yield from c.start_pod(image, c.nodes[node_of[image]])
            if p.presessions:
                yield from c.agent_start()
            yield ready[image].put(node)

        def refill(image: str) -> Iterator[simpy.Event]:
            if p.exact:  # lowered after the claim, racing the controller's refill
                lowered = env.event()
                env.process(reconcile(image, lowered))
                if in_flight[image]:  # one PATCH per image at a time, of the newest count
                    again[image] = True
                    waiting[image].append(lowered)
                    return
                in_flight[image] = True
                mine = [lowered]
                while True:
                    again[image] = False
                    yield from c.write()
                    for ev in mine:
                        ev.succeed()
                    if not again[image]:
                        break
                    mine, waiting[image] = waiting[image], []
                in_flight[image] = False
                return
            if p.refill_per_s > 0:
                yield env.timeout(1.0 / p.refill_per_s)
            if live[0]:
                env.process(replica(image, refill=True))

        for i in window:
            yield from c.write()  # template
            yield from c.write()  # warm pool
        held = dict.fromkeys(window, rollouts) if p.exact else slots
        yield simpy.AllOf(env, [env.process(replica(i)) for i in window for _ in range(held[i])])

        def rollout(image: str) -> Iterator[simpy.Event]:
            t0 = env.now
            yield from c.write()  # claim
            with c.controller.request() as w:
                yield w
                yield from c.op(p.controller_s, p.cpu_claim_s)
            node = yield ready[image].get()
            env.process(refill(image))
            if not p.presessions:
                yield from c.agent_start()
            yield from c.command(mode == "pods")
            ttfc.append(env.now - t0)
            yield from c.command(mode == "pods")  # the round trip, again
            yield env.timeout(c.lat(p.think_s))
            yield from c.command(mode == "pods")
            c.stop_pod(image, node)

        yield lanes(window, slots, rollout)
        live[0] = False
        for _ in range(max(1, int(len(window) * rollouts * p.delete_batch_s / 10))):
            yield from c.write()  # batched deletes of the window's claims and pools

    def reuse_window(c: Cluster, window: list[str], node_of: dict) -> Iterator[simpy.Event]:
        node_by: dict[str, Node] = {}
        checked_out: set[str] = set()

        def sandbox(image: str) -> Iterator[simpy.Event]:
            yield from c.write()  # the image's Sandbox object
            node_by[image] = yield from c.start_pod(image, c.nodes[node_of[image]])
            yield from c.agent_start()

        def rollout(image: str) -> Iterator[simpy.Event]:
            t0 = env.now
            if image not in checked_out:  # a sandbox's first claim checks out the commit
                checked_out.add(image)
                yield from c.op(p.checkout_s, p.cpu_checkout_s)
            yield from c.command(mode == "pods")
            ttfc.append(env.now - t0)
            yield from c.command(mode == "pods")  # the round trip, again
            yield env.timeout(c.lat(p.think_s))
            yield from c.command(mode == "pods")
            yield from c.op(p.reset_s, p.cpu_reset_s)

        yield simpy.AllOf(env, [env.process(sandbox(i)) for i in window])
        yield lanes(window, dict.fromkeys(window, 1), rollout)
        for i in window:
            c.stop_pod(i, node_by[i])
        for _ in range(max(1, int(len(window) / 20))):
            yield from c.write()  # batched deletes

    def preflight(c: Cluster) -> Iterator[simpy.Event]:
        for _ in range(p.preflight_writes if mode != "pods" else p.preflight_writes_pods):
            yield from c.write()  # SelfSubjectAccessReviews (and the controller probe)

    env.run(until=simpy.AllOf(env, [env.process(preflight(c)) for c in cl]))
    if mode == "pods":
        slots = strategy.plan(dict.fromkeys(names, rollouts), conc)
        done = lanes(names, slots, pods_rollout)
    else:
        done = env.process(run_windows(warm_window if mode == "warm" else reuse_window))
    env.run(until=done)
    return SimResult(
        mode=mode, images=images, rollouts=rollouts, clusters=clusters, ttfc_samples=ttfc,
        pods_created=sum(c.pods for c in cl), sandpool_writes=sum(c.writes for c in cl),
        all_writes=sum(c.all_writes + c.writes for c in cl),
        retried_429=sum(c.retried for c in cl), wall_s=env.now, windows=windows_n[0],
        rate_lowest=min(c.rate.lowest for c in cl), prepulls=prepulls[0],
        pulls=sum(n.pulls for c in cl for n in c.nodes), cpu_s=sum(c.cpu_used for c in cl))


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
