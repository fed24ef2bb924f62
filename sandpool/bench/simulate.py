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

The defaults are calibrated from the kwok runs of ``bench/k8s_burst.py`` on the 2-core
development machine (:data:`sandpool.bench.predict.MEASURED` lists every figure, with its
source); :func:`sandpool.bench.predict.compare` gives the model's error on each of them.
The real node's runs (``bench/real_node.py``) are not among them: their burst ran one image
under several names, whose shared layers are pulled once, and the model has no layers.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import simpy

from sandpool.bench.simcluster import Cluster, SimParams, image_size, place_windows
from sandpool.core.metrics import TTFCStats

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
    cl = [Cluster(env, p, f"c{i}", rng) for i in range(clusters)]
    names = [f"sim-img-{i}" for i in range(images)]
    home = {n: cl[int(hashlib.sha256(n.encode()).hexdigest(), 16) % clusters] for n in names}
    ttfc: list[float] = []
    gate = simpy.Resource(env, capacity=concurrency or images * rollouts)
    windows_n = [1]

    def command(c: Cluster) -> simpy.Event:
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

    def runplace_windows(body) -> Iterator[simpy.Event]:
        by_cluster: dict[Cluster, list[str]] = {}
        for n in names:
            by_cluster.setdefault(home[n], []).append(n)
        procs = [env.process(clusterplace_windows(c, imgs, body)) for c, imgs in by_cluster.items()]
        yield simpy.AllOf(env, procs)

    def clusterplace_windows(c: Cluster, imgs: list[str], body) -> Iterator[simpy.Event]:
        windows, node_of = place_windows(imgs, p, p.nodes)
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

    def warm_window(c: Cluster, window: list[str], node_of: dict) -> Iterator[simpy.Event]:
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

    def reuse_window(c: Cluster, window: list[str], node_of: dict) -> Iterator[simpy.Event]:
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
        done = env.process(runplace_windows(warm_window if mode == "warm" else reuse_window))
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
