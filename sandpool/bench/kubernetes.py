"""``sandpool bench --backend kubernetes``: a burst of rollouts on a cluster, three ways.

* ``pods``: the plain-Kubernetes baseline: a Pod per rollout (strategy ``cold``), deleted
  after; its image pulled when the pod asks; one pod exec per command;
* ``warm``: agent-sandbox with placement: images planned onto nodes and prepulled, a
  SandboxWarmPool per image (pods steered by node affinity) holding the burst's claims of
  that image, their agent sessions open (the pool is told the burst up front:
  ``prepare(exact=True)``), a SandboxClaim per rollout;
* ``reuse``: placement and prepull, one Sandbox object per image lane held across its
  rollouts, which run back to back on it, reset in the pod; commands over one agent session
  per sandbox; deletes batched.

When the images do not fit the nodes' image disks, the placement plan cuts them into windows;
the next window's images are prepulled while the current one runs. Every mode runs in its own
namespace (created and deleted here).

Each rollout runs the first command (TTFC), the same command again (the exec round trip in a
claimed sandbox), waits ``think_s`` (the policy's model time) and runs ``echo ok``. The figures
beside TTFC: pods created, API writes (sandpool's, and every client's from the apiserver's
``/metrics``), exec streams, and a timeline of pods by phase (plus what :class:`ClusterHooks`
adds, e.g. image pulls in flight on a simulated cluster).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandpool.bench.kubemonitor import Monitor, scrape_apiserver
from sandpool.bench.report import BenchReport, StrategyResult, load_now
from sandpool.bench.workload import FIRST_COMMAND, Probes
from sandpool.core.errors import ConfigError
from sandpool.core.task import Task

__all__ = ["MODES", "ClusterHooks", "KubeOptions", "run_kubernetes", "scrape_apiserver"]

MODES = ("pods", "warm", "reuse")
_WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


@dataclass
class KubeOptions:
    """How the Kubernetes burst runs.

    Attributes:
        think_s: Seconds of policy (model) time between a rollout's commands.
        qps / burst: Client-side write rate and burst.
        ready_timeout: Seconds a pod may take to become ready.
        reuse_lanes: ``reuse``: sandboxes per image; its rollouts run back to back on them.
        presessions: ``warm``: agent sessions opened on warm pods before their claim, at most
            this many at once (None: the concurrency; 0: off).
        baseline_agent: ``pods``: commands over an agent session too (default: one exec each).
        controller_version: The agent-sandbox controller's version (its CRD fields).
        agent_timeout: Seconds the in-pod agent may take to start.
    """

    think_s: float = 0.0
    qps: float = 50.0
    burst: int = 100
    ready_timeout: float = 1800.0
    reuse_lanes: int = 1
    presessions: int | None = None
    baseline_agent: bool = False
    controller_version: str | None = None
    agent_timeout: float = 120.0


@dataclass
class ClusterHooks:
    """What a particular cluster adds (defaults fit a user's own cluster).

    Attributes:
        image_map: Task image name -> :class:`~sandpool.core.backends.kubernetes.PodImage`
            (None: the image name is pulled as is).
        image_sizes: Bytes per image, for placement (default: 1 GB each).
        node_disk_bytes: Image disk per node, for placement windows (default: no limit).
        timeline: ``(t0, t1) -> [(time, series name -> value)]`` extra series for the
            timeline plot (e.g. image pulls in flight).
        describe: What to print about the cluster with every result.
        cpu: CPU seconds the cluster's own processes have used so far (a kwok cluster's
            pods are processes of this machine); a mode's ``cpu_s`` is its difference plus
            the bench process's own (None: not measured).
    """

    image_map: Callable[[str], Any] | None = None
    image_sizes: Callable[[Sequence[str]], Mapping[str, float]] | None = None
    node_disk_bytes: float = 1e15
    timeline: Callable[[float, float], list[tuple[float, dict[str, float]]]] | None = None
    describe: dict[str, Any] = field(default_factory=dict)
    cpu: Callable[[], float] | None = None


async def _default_service_account(http, namespace: str, timeout: float = 60.0) -> None:
    """Wait until the service-account controller has made ``default`` (pods need it)."""
    deadline = time.monotonic() + timeout
    while True:
        found = await http.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default",
                                   ok_missing=True)
        if found or time.monotonic() > deadline:
            return  # past the deadline the pods' own errors say what is missing
        await asyncio.sleep(0.2)


def _make_backend(kubeconfig, name: str, namespace: str, opts: KubeOptions, hooks: ClusterHooks,
                  presessions: int):
    from sandpool.core.backends.kubernetes import KubernetesBackend

    placed = name != "pods"
    return KubernetesBackend(
        kubeconfig, namespace=namespace, mode="pods" if name == "pods" else "agent-sandbox",
        qps=opts.qps, burst=opts.burst, ready_timeout=opts.ready_timeout, image_map=hooks.image_map,
        agent=name != "pods" or opts.baseline_agent, sandbox_objects=name == "reuse",
        delete_batch_s=0.5 if placed else None, controller_version=opts.controller_version,
        agent_timeout=opts.agent_timeout, presessions=presessions if name == "warm" else 0)


async def _run_mode(name: str, tasks: list[Task], kubeconfig, admin, mon: Monitor, *, rollouts: int,
                    concurrency: int, opts: KubeOptions, hooks: ClusterHooks,
                    say: Callable[[str], None]) -> StrategyResult:
    from sandpool.core import PoolLimits, SandboxPool, run_rollout

    namespace = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    placed = name != "pods"
    presessions = concurrency if opts.presessions is None else opts.presessions
    backend = _make_backend(kubeconfig, name, namespace, opts, hooks, presessions)
    http = await admin._client()
    await http.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    await _default_service_account(http, namespace)
    mon.namespace = namespace
    strategy = {"pods": "cold", "warm": "warm", "reuse": "reuse"}[name]
    by_image = {t.image: t for t in tasks}
    images = list(by_image)
    probes = Probes()

    async def episode(lease) -> float:
        t0 = time.monotonic()
        await lease.exec(FIRST_COMMAND)
        t1 = time.monotonic()
        await lease.exec(FIRST_COMMAND)
        probes.add(lease.ttfc_s, t1 - t0, time.monotonic() - t1)
        if opts.think_s:
            await asyncio.sleep(opts.think_s)  # the policy thinking (model time)
        return float((await lease.exec("echo ok")).text == "ok\n")

    verbs0, pods0, _ = await scrape_apiserver(admin)
    load0, w0, t0 = load_now()[0], time.time(), time.monotonic()
    cpu0 = (hooks.cpu() if hooks.cpu else None, time.process_time())
    results, prepulls, counters, closed = [], [], [], []
    plan, prepare_s = None, 0.0
    if placed:
        sizes = hooks.image_sizes(images) if hooks.image_sizes else {i: 1e9 for i in images}
        plan = await backend.place(images, sizes, slots_per_image=rollouts if name == "warm" else 1,
                                   node_disk_bytes=hooks.node_disk_bytes)
        windows = [list(w) for w in plan.windows]
        say(plan.describe())
    else:
        windows = [images]
    limits = PoolLimits(claim_timeout=opts.ready_timeout, create_timeout=opts.ready_timeout,
                        create_rate=opts.qps, create_burst=opts.burst)
    next_pull = asyncio.create_task(backend.prepull(plan.windows[0], name="w0")) if plan else None
    try:
        for wi, window in enumerate(windows):
            tp = time.monotonic()
            if next_pull is not None:
                prepulls.append(await next_pull)
                next_pull = None
            if plan and wi + 1 < len(plan.windows):  # the next window pulls while this one runs
                next_pull = asyncio.create_task(backend.prepull(plan.windows[wi + 1], name=f"w{wi + 1}"))
            # A pool closes its backend: each window's pool gets one of its own, pinned by the plan.
            wbackend = backend
            if plan and len(plan.windows) > 1:
                wbackend = _make_backend(kubeconfig, name, namespace, opts, hooks, presessions)
                wbackend.pin_nodes(plan.node_of)
            async with SandboxPool(wbackend, strategy, limits) as pool:
                wtasks = [by_image[i] for i in window]
                # reuse: a lane per image sandbox, its rollouts back to back; else every lane at once.
                lanes_n = len(wtasks) * opts.reuse_lanes if name == "reuse" else concurrency
                slots = await pool.prepare(wtasks, lanes_n, rollouts_per_task=rollouts, exact=True)
                prepare_s += time.monotonic() - tp
                gate = asyncio.Semaphore(concurrency)
                queues = {t.image: deque((t, i) for i in range(rollouts)) for t in wtasks}

                async def lane(q: deque) -> None:
                    async with gate:
                        while q:
                            task, i = q.popleft()
                            results.append(await run_rollout(pool, task, episode, rollout=i, retries=2,
                                                             policy="burst"))

                await asyncio.gather(*(lane(q) for img, q in queues.items()
                                       for _ in range(slots.get(img, 1))))
                counters.append(pool.counters.model_copy(deep=True))
                if wbackend is not backend:
                    closed.append(wbackend.api_stats)
            say(f"  {name} window {wi}: {len(window)} images done at {time.monotonic() - t0:.0f} s")
    finally:
        if next_pull is not None:
            next_pull.cancel()
        wall = time.monotonic() - t0
        client_cpu = time.process_time() - cpu0[1]
        cluster_cpu = hooks.cpu() - cpu0[0] if cpu0[0] is not None and hooks.cpu else None
        stats = backend.api_stats
        rates = [r.trace() for r in backend.write_rates.values()]
        await backend.aclose()
        mon.namespace = None
        for st in closed:  # the windows' backends
            for k in ("writes", "execs", "agent_fallbacks", "presessions_adopted"):
                stats[k] = stats.get(k, 0) + st.get(k, 0)
            for k, v in st["writes_by"].items():
                stats["writes_by"][k] = stats["writes_by"].get(k, 0) + v
        w1 = time.time()
        verbs1, pods1, _ = await scrape_apiserver(admin)  # after close: long-running CONNECTs counted
        await http.request("DELETE", f"/api/v1/namespaces/{namespace}", ok_missing=True)
    delta = {v: verbs1[v] - verbs0[v] for v in verbs1 if verbs1[v] - verbs0[v]}
    preflight = sum(v for k, v in stats["writes_by"].items() if "selfsubjectaccessreviews" in k)
    n = max(1, len(results))
    series = [(x["t"], {f"pods {k}": float(v) for k, v in x.get("pods", {}).items()})
              for x in mon.window(w0, w1)]
    if hooks.timeline:
        series += hooks.timeline(w0, w1)
    extra: dict[str, Any] = {
        "pods created": pods1 - pods0,
        "API writes, all clients": sum(delta.get(v, 0) for v in _WRITE_VERBS),
        "API writes, sandpool": stats["writes"],
        "sandpool writes / rollout": round(stats["writes"] / n, 3),
        "of which preflight": preflight,
        "exec streams (sandpool)": stats["execs"],
        "exec streams / rollout": round(stats["execs"] / n, 2),
        "sessions opened before claim": stats.get("presessions_adopted", 0),
        "exec streams (apiserver)": delta.get("CONNECT", 0),
        "windows": len(windows), "prepare+prepull (s)": round(prepare_s, 1),
        "retried attempts": sum(max(0, (r.attempts or 1) - 1) for r in results),
        **mon.peaks(w0, w1),
        "_namespace": namespace, "_t0": w0, "timeline": series, "prepulls": prepulls,
        "plan": plan.as_dict() if plan else None,
        "quarantine reasons": [q for c in counters for q in c.quarantine_reasons],
        "apiserver requests by verb": delta,
        "write rate": [r.describe() for r in rates],
        "_write_rate": [r.model_dump() for r in rates],
    }
    return StrategyResult.from_results(
        name, results, probes,
        sandboxes_created=sum(c.created for c in counters), resets=sum(c.resets for c in counters),
        quarantines=sum(c.quarantines for c in counters), wall_s=wall,
        cpu_s=None if cluster_cpu is None else cluster_cpu + client_cpu, cpu_client_s=client_cpu,
        load=(load0, load_now()[0]), extra=extra)


def _targets(report: BenchReport) -> None:
    from sandpool.bench.report import Target

    r = report.results
    if "pods" in r and "reuse" in r:
        base, reuse = r["pods"], r["reuse"]

        def ratio(a: float | None, b: float | None) -> float:
            return (a or 0) / b if b else float("inf")

        for text, v, want in (
                ("reuse max TTFC {:.1f}x below pods (target >= 45x)", ratio(base.ttfc.max_s, reuse.ttfc.max_s), 45),
                ("reuse mean TTFC {:.1f}x below pods (target >= 10x)", ratio(base.ttfc.mean_s, reuse.ttfc.mean_s), 10),
                ("pods created {:.2f}x fewer (target >= 3.5x)",
                 ratio(base.extra["pods created"], reuse.extra["pods created"]), 3.5)):
            report.targets.append(Target(text=text.format(v), met=v >= want))
        wpr = reuse.extra["sandpool writes / rollout"]
        report.targets.append(Target(text=f"sandpool writes per reused rollout {wpr:.3f} (target <= 0.6)",
                                     met=wpr <= 0.6))


async def run_kubernetes(cfg, *, tasks: list[Task] | Callable[[str], list[Task]] | None = None,
                         opts: KubeOptions | None = None,
                         hooks: ClusterHooks | None = None,
                         say: Callable[[str], None] = print) -> BenchReport:
    """Run the burst ``cfg`` describes on the cluster of ``cfg.kubeconfig``; return the report.

    Args:
        cfg: The :class:`~sandpool.bench.run.BenchConfig` (strategies from :data:`MODES`).
        tasks: The tasks, or mode name -> tasks (e.g. images named afresh per mode, so nothing
            one mode pulled is cached on the nodes for the next); default: ``cfg.tasks`` read
            as a task file, at most ``cfg.limit``.
        opts: How the burst runs.
        hooks: What the cluster adds.
        say: Receives progress lines.

    Raises:
        ConfigError: A strategy is not one of :data:`MODES`, or no task file was given.
    """
    from sandpool.core.backends.kubernetes import KubernetesBackend

    opts, hooks = opts or KubeOptions(), hooks or ClusterHooks()
    unknown = [s for s in cfg.strategies if s not in MODES]
    if unknown:
        raise ConfigError(f"--strategies: {','.join(unknown)} not known on Kubernetes; pick from {','.join(MODES)}")
    if tasks is None:
        from sandpool.envs.tasks import load_tasks

        if not Path(cfg.tasks).is_file():
            raise ConfigError(f"--tasks {cfg.tasks}: on Kubernetes give a task file whose images the "
                              "cluster can pull")
        tasks = load_tasks(cfg.tasks)[:cfg.limit]
    per_mode = tasks if callable(tasks) else (lambda _mode, t=tasks: t)
    images = len({t.image for t in per_mode(cfg.strategies[0])})
    title = (f"sandpool bench, kubernetes: {images} images x {cfg.rollouts} rollouts, concurrency "
             f"{cfg.concurrency}, think {opts.think_s:g} s, client qps {opts.qps:g} burst {opts.burst}")
    report = BenchReport(title=title, machine={"cpus": os.cpu_count(), "cluster": hooks.describe,
                                               "load_start": [round(x, 1) for x in load_now()]})
    admin = KubernetesBackend(cfg.kubeconfig)  # namespaces and /metrics; it creates nothing labelled
    mon = Monitor(admin)
    mon.start()
    try:
        for name in cfg.strategies:
            try:
                report.results[name] = await _run_mode(
                    name, per_mode(name), cfg.kubeconfig, admin, mon, rollouts=cfg.rollouts,
                    concurrency=cfg.concurrency, opts=opts, hooks=hooks, say=say)
            except Exception as exc:  # noqa: BLE001 - the other modes' results are kept and reported
                report.notes.append(f"{name}: FAILED: {type(exc).__name__}: {exc}")
                say(report.notes[-1])
                continue
            r = report.results[name]
            say(f"{name}: {r.outcomes} in {r.wall_s:.1f} s, pods {r.extra['pods created']}")
    finally:
        await mon.stop()
        await admin.aclose()
    report.machine["load_end"] = [round(x, 1) for x in load_now()]
    if hooks.describe:
        report.notes.append(f"cluster: {json.dumps(hooks.describe)}")
    report.notes += [f"[{n}] quarantined: {q}" for n, r in report.results.items()
                     for q in r.extra.get("quarantine reasons", [])]
    report.notes += [f"[{n}] placement: {json.dumps(r.extra['plan'])[:300]}" for n, r in report.results.items()
                     if r.extra.get("plan")]
    _targets(report)
    return report
