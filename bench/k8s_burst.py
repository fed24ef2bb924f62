"""Benchmark: the seed's burst on the local Kubernetes cluster: pods vs warm and reuse with placement.

A burst of ``--images`` images x ``--rollouts`` rollouts (``--shape seed``: 4,578 x 4, the
published agent-sandbox result) runs three ways against the running cluster from
``hack/cluster`` (best started with ``up --image-model=seed``: image sizes above 1.2 GB,
per-node image disk that cannot hold the corpus with LRU eviction, pull bandwidth shared by
a node's concurrent pulls; the model's parameters are printed with every result):

* ``pods``  - the plain-Kubernetes baseline: a Pod per rollout (strategy ``cold``), deleted
  after; images pulled when a pod asks; one pod exec per command (today's exec path);
* ``warm``  - agent-sandbox with placement: images planned onto nodes and prepulled, a
  SandboxWarmPool per image (pods steered by node affinity), a SandboxClaim per rollout;
* ``reuse`` - placement and prepull, one Sandbox object per image (``--reuse-lanes``) held
  across its rollouts, which run back to back on it, reset in the pod; commands over one
  agent session per sandbox; deletes batched.

When the corpus does not fit the nodes' image disks, the placement plan cuts it into
windows; the next window's images are prepulled while the current window runs. Every mode
uses its own namespace and image tags (nothing cached from an earlier mode).

Figures, side by side from one run: TTFC mean, p99, max; pods created; API writes
(sandpool's own, and every client's from the apiserver's ``/metrics``); exec streams;
wall time; and the peak memory, CPU and etcd size seen while each mode ran.

    python hack/cluster/cluster.py up --image-model=seed
    nice .venv/bin/python bench/k8s_burst.py --images 100          # or --shape seed

Writes ``k8s_burst.{txt,json}``, ``k8s_burst_ttfc_cdf.png`` and ``k8s_burst_timeline.png``
(pods and pulls in flight) to ``--out``. Targets: reuse max TTFC >= 45x below pods, reuse
mean TTFC >= 10x below, pods created >= 3.5x fewer, sandpool writes per reused rollout <= 0.6.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imagemodel import image_size  # noqa: E402  (the cluster's own image model)

from sandpool.core import PoolLimits, SandboxPool, Task, run_rollout  # noqa: E402
from sandpool.core.backends.kubernetes import KubernetesBackend  # noqa: E402
from sandpool.core.metrics import TTFCStats  # noqa: E402
from tests.cluster.kwok_images import workdir_image  # noqa: E402

SHAPES = {"seed": (4578, 4), "small": (20, 4)}
_METRIC = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$")
_WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


def run_dir() -> Path:
    return Path(
        os.environ.get("SANDPOOL_CLUSTER_RUN_DIR") or Path.home() / ".cache/sandpool/cluster/run"
    )


def default_kubeconfig() -> Path:
    if kc := os.environ.get("SANDPOOL_CLUSTER_KUBECONFIG"):
        return Path(kc)
    return Path(json.loads((run_dir() / "state.json").read_text())["kubeconfig"])


def make_repo(path: Path) -> str:
    """A small git repository standing in for every task image; returns its HEAD."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}
    if not (path / ".git").is_dir():
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "init", "-q", str(path)], check=True)
        (path / "main.py").write_text("print('hello')\n")
        subprocess.run(["git", "-C", str(path), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(path), "commit", "-qm", "base"], check=True, env=env)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


async def scrape(backend: KubernetesBackend) -> tuple[Counter, int]:
    """``apiserver_request_total`` summed by verb, and ``POST pods`` answered 201."""
    by_verb, pods, _ = await scrape_all(backend)
    return by_verb, pods


async def scrape_all(backend: KubernetesBackend) -> tuple[Counter, int, float]:
    """Requests by verb, pods created, and the etcd database size (bytes) the apiserver sees."""
    http = await backend._client()
    async with http.session.get(http.url("/metrics"), headers=await http.headers()) as resp:
        text = await resp.text()
    by_verb: Counter = Counter()
    pods_created = 0
    db = 0.0
    for line in text.splitlines():
        if not (mm := _METRIC.match(line)):
            continue
        name, value = mm.group("name"), float(mm.group("value"))
        if name == "apiserver_storage_size_bytes":
            db = max(db, value)
        if name != "apiserver_request_total":
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', mm.group("labels")))
        by_verb[labels.get("verb", "?")] += int(value)
        key = (labels.get("verb"), labels.get("resource"), labels.get("subresource"),
               labels.get("code"))
        if key == ("POST", "pods", "", "201"):
            pods_created += int(value)
    return by_verb, pods_created, db


class Monitor:
    """Samples the machine every ``period`` s: memory available, CPU busy, etcd size, and
    (from the cluster's image-model log) pods and pulls in flight."""

    def __init__(self, admin: KubernetesBackend, period: float = 2.0) -> None:
        self.admin, self.period = admin, period
        self.samples: list[dict] = []
        self._task: asyncio.Task | None = None

    @staticmethod
    def _cpu() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f), f[3] + f[4]

    async def _run(self) -> None:
        t0, i0 = self._cpu()
        while True:
            await asyncio.sleep(self.period)
            t1, i1 = self._cpu()
            busy = 1 - (i1 - i0) / max(1, t1 - t0)
            t0, i0 = t1, i1
            mem = {k: int(v.split()[0]) * 1024 for k, v in
                   (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
                   if k in ("MemTotal", "MemAvailable")}
            try:
                _, _, db = await scrape_all(self.admin)
            except Exception:  # noqa: BLE001 - a missed sample is not a result
                db = float("nan")
            self.samples.append({"t": time.time(), "cpu_busy": busy, "load1": os.getloadavg()[0],
                                 "mem_used_gb":
                                 (mem["MemTotal"] - mem["MemAvailable"]) / 1e9, "etcd_db_mb": db / 1e6})

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def peaks(self, t0: float, t1: float) -> dict:
        s = [x for x in self.samples if t0 <= x["t"] <= t1]
        if not s:
            return {}
        return {"cpu_busy_mean": sum(x["cpu_busy"] for x in s) / len(s),
                "cpu_busy_max": max(x["cpu_busy"] for x in s),
                "load1_mean": sum(x["load1"] for x in s) / len(s),
                "load1_max": max(x["load1"] for x in s),
                "mem_used_gb_max": max(x["mem_used_gb"] for x in s),
                "etcd_db_mb_max": max(x["etcd_db_mb"] for x in s)}


def model_timeline(t0: float, t1: float) -> list[tuple[float, int, int]]:
    """(time, pods in flight, pulls in flight) summed over nodes, from image-model.jsonl."""
    path = run_dir() / "image-model.jsonl"
    if not path.exists():
        return []
    last: dict[str, tuple[int, int]] = {}
    out = []
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        last[ev["node"]] = (ev["pods"], ev["pulls"])
        if t0 <= ev["t"] <= t1:
            out.append((ev["t"], sum(p for p, _ in last.values()), sum(q for _, q in last.values())))
    return out


def cluster_model() -> dict:
    """The cluster's image model parameters (state.json / provisioner.json)."""
    st = json.loads((run_dir() / "state.json").read_text())
    if st.get("image_model"):
        return {"model": "seed", **st["image_model"], "nodes": st["nodes"]}
    prov = json.loads((run_dir() / "provisioner.json").read_text())
    return {"model": "flat", "pull_ms": prov["pull_ms"], "cached_pull_ms": prov["cached_pull_ms"],
            "boot_ms": prov["boot_ms"], "nodes": st["nodes"]}


def sizes_of(images: list[str], model: dict) -> dict[str, float]:
    if model["model"] == "seed":
        return {i: image_size(i, model) for i in images}
    return {i: 1e9 for i in images}  # flat model: no sizes; 1 GB each for the plan


async def run_mode(name: str, args, kubeconfig: Path, source: Path, commit: str,
                   admin: KubernetesBackend, model: dict, mon: Monitor) -> dict:
    tag = f"{name}-{uuid.uuid4().hex[:6]}"  # fresh image names: nothing cached on the nodes
    images = [f"sandpool.bench/img-{i}:{tag}" for i in range(args.images)]
    tasks = {img: Task(instance_id=f"img{i}", repo="bench/repo", base_commit=commit, image=img,
                       problem_statement="burst") for i, img in enumerate(images)}
    namespace = f"bench-{tag}"
    placed = name != "pods"
    def make_backend() -> KubernetesBackend:
        return KubernetesBackend(
            kubeconfig, namespace=namespace, mode="pods" if name == "pods" else "agent-sandbox",
            qps=args.qps, burst=args.burst, ready_timeout=args.ready_timeout,
            image_map=lambda n: workdir_image(n, source),
            agent=name != "pods" or args.baseline_agent,
            sandbox_objects=name == "reuse", delete_batch_s=0.5 if placed else None,
            controller_version=args.controller_version,
            agent_timeout=120.0,  # python's start on 2 shared, overloaded cores takes tens of s
            presessions=args.presessions if name == "warm" else 0,
        )

    # The planning backend places and prepulls across windows; a pool closes its backend,
    # so each window's pool gets a backend of its own with the plan's node affinities.
    backend = make_backend()
    closed: list[dict] = []
    strategy = {"pods": "cold", "warm": "warm", "reuse": "reuse"}[name]
    http = await admin._client()
    await http.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    await asyncio.sleep(1.0)  # the service-account controller makes "default" (pods need it)

    async def episode(lease) -> float:
        await lease.exec("git status --porcelain")
        await asyncio.sleep(args.think)  # the policy thinking (model time) between commands
        return float((await lease.exec("echo ok")).text == "ok\n")

    verbs0, pods0, _ = await scrape_all(admin)
    t0 = time.monotonic()
    w0 = time.time()
    results, plan, prepulls, pools = [], None, [], []
    slots_per_image = args.rollouts if name == "warm" else 1
    if placed:
        plan = await backend.place(images, sizes_of(images, model), slots_per_image=slots_per_image,
                                   node_disk_bytes=model.get("disk_gb", 1e6) * 1e9)
        windows = [list(w) for w in plan.windows]
        print(plan.describe(), flush=True)
    else:
        windows = [images]
    limits = PoolLimits(claim_timeout=1800, create_timeout=1800, create_rate=args.qps,
                        create_burst=args.burst)
    prepare_s = 0.0
    next_pull = (asyncio.create_task(backend.prepull(plan.windows[0], name="w0"))
                 if plan else None)
    for wi, window in enumerate(windows):
        tp = time.monotonic()
        if next_pull is not None:
            prepulls.append(await next_pull)
            next_pull = None
        if plan and wi + 1 < len(plan.windows):  # the next window pulls while this one runs
            next_pull = asyncio.create_task(
                backend.prepull(plan.windows[wi + 1], name=f"w{wi + 1}"))
        wbackend = make_backend() if plan and len(plan.windows) > 1 else backend
        if wbackend is not backend:
            wbackend.pin_nodes(plan.node_of)
        async with SandboxPool(wbackend, strategy, limits) as pool:
            wtasks = [tasks[i] for i in window]
            # reuse: one sandbox per image, its rollouts back to back on it (the pool's
            # reuse plan splits the lanes over the images); the others: every lane at once.
            lanes_n = len(wtasks) * args.reuse_lanes if name == "reuse" else args.concurrency
            slots = await pool.prepare(wtasks, lanes_n, rollouts_per_task=args.rollouts)
            prepare_s += time.monotonic() - tp
            gate = asyncio.Semaphore(args.concurrency)
            lanes = {t.image: deque((t, i) for i in range(args.rollouts)) for t in wtasks}

            async def lane(q: deque) -> None:
                async with gate:
                    while q:
                        task, i = q.popleft()
                        results.append(await run_rollout(pool, task, episode, rollout=i,
                                                         retries=2, policy="burst"))

            await asyncio.gather(*(lane(q) for img, q in lanes.items()
                                   for _ in range(slots.get(img, 1))))
            pools.append(pool.counters.model_copy(deep=True))
            if wbackend is not backend:
                closed.append(wbackend.api_stats)
        print(f"  {name} window {wi}: {len(window)} images done at "
              f"{time.monotonic() - t0:.0f} s", flush=True)
    wall = time.monotonic() - t0
    stats = backend.api_stats
    await backend.aclose()
    for st in closed:  # the windows' backends
        stats["writes"] += st["writes"]
        stats["execs"] += st["execs"]
        stats["agent_fallbacks"] += st["agent_fallbacks"]
        stats["presessions_adopted"] = stats.get("presessions_adopted", 0) + st.get(
            "presessions_adopted", 0)
        for k, v in st["writes_by"].items():
            stats["writes_by"][k] = stats["writes_by"].get(k, 0) + v
    w1 = time.time()
    verbs1, pods1, _ = await scrape_all(admin)  # after close: long-running CONNECTs counted
    await http.request("DELETE", f"/api/v1/namespaces/{namespace}", ok_missing=True)
    delta = {v: verbs1[v] - verbs0[v] for v in verbs1 if verbs1[v] - verbs0[v]}
    outcomes = Counter(r.outcome.value for r in results)
    preflight = sum(v for k, v in stats["writes_by"].items() if "selfsubjectaccessreviews" in k)
    return {
        "mode": name, "strategy": strategy, "namespace": namespace,
        "ttfc": TTFCStats.from_samples([r.ttfc_s for r in results if r.ttfc_s is not None])
        .model_dump(),
        "ttfc_samples": [r.ttfc_s for r in results if r.ttfc_s is not None],
        "rollouts": len(results), "outcomes": dict(outcomes),
        "retried_attempts": sum(max(0, (r.attempts or 1) - 1) for r in results),
        "resets": sum(p.resets for p in pools), "quarantines": sum(p.quarantines for p in pools),
        "pool_counters": [p.model_dump() for p in pools],
        "prepare_s": prepare_s, "wall_s": wall, "windows": len(windows),
        "prepulls": prepulls, "plan": plan.as_dict() if plan else None,
        "plan_text": plan.describe() if plan else None,
        "pods_created": pods1 - pods0,
        "apiserver_requests_by_verb": delta,
        "apiserver_writes": sum(delta.get(v, 0) for v in _WRITE_VERBS),
        "sandpool_writes": stats["writes"], "sandpool_preflight_writes": preflight,
        "sandpool_writes_by": stats["writes_by"],
        "exec_streams": stats["execs"], "agent_fallbacks": stats["agent_fallbacks"],
        "presessions_adopted": stats.get("presessions_adopted", 0),
        "exec_streams_apiserver": delta.get("CONNECT", 0),
        "resources": mon.peaks(w0, w1), "timeline": model_timeline(w0, w1), "t0": w0,
    }


def table(runs: dict[str, dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"

    rows = [
        ("TTFC mean (ms)", lambda r: ms(r["ttfc"]["mean_s"])),
        ("TTFC p50 (ms)", lambda r: ms(r["ttfc"]["p50_s"])),
        ("TTFC p99 (ms)", lambda r: ms(r["ttfc"]["p99_s"])),
        ("TTFC max (ms)", lambda r: ms(r["ttfc"]["max_s"])),
        ("rollouts completed", lambda r: f"{r['outcomes'].get('completed', 0)}/{r['rollouts']}"),
        ("  attempts retried", lambda r: str(r.get("retried_attempts", 0))),
        ("pods created", lambda r: str(r["pods_created"])),
        ("API writes, all clients", lambda r: str(r["apiserver_writes"])),
        ("API writes, sandpool", lambda r: str(r["sandpool_writes"])),
        ("  per rollout", lambda r: f"{r['sandpool_writes'] / max(1, r['rollouts']):.3f}"),
        ("  of which preflight", lambda r: str(r["sandpool_preflight_writes"])),
        ("exec streams (sandpool)", lambda r: str(r["exec_streams"])),
        ("  sessions opened before claim", lambda r: str(r.get("presessions_adopted", 0))),
        ("exec streams (apiserver)", lambda r: str(r["exec_streams_apiserver"])),
        ("  per rollout", lambda r: f"{r['exec_streams'] / max(1, r['rollouts']):.2f}"),
        ("resets / quarantines", lambda r: f"{r['resets']} / {r['quarantines']}"),
        ("windows", lambda r: str(r["windows"])),
        ("prepare+prepull (s)", lambda r: f"{r['prepare_s']:.1f}"),
        ("wall time (s)", lambda r: f"{r['wall_s']:.1f}"),
        ("CPU busy mean/max", lambda r: "{:.0%}/{:.0%}".format(
            r["resources"].get("cpu_busy_mean", 0), r["resources"].get("cpu_busy_max", 0))),
        ("load avg 1m mean/max", lambda r: "{:.0f}/{:.0f}".format(
            r["resources"].get("load1_mean", 0), r["resources"].get("load1_max", 0))),
        ("memory used max (GB)", lambda r: f"{r['resources'].get('mem_used_gb_max', 0):.1f}"),
        ("etcd db max (MB)", lambda r: f"{r['resources'].get('etcd_db_mb_max', 0):.0f}"),
    ]
    names = list(runs)
    lines = [f"{'':<26}" + "".join(f"{n:>12}" for n in names)]
    lines += [f"{label:<26}" + "".join(f"{fn(runs[n]):>12}" for n in names) for label, fn in rows]
    return "\n".join(lines)


def verdicts(runs: dict[str, dict]) -> list[str]:
    if "pods" not in runs or "reuse" not in runs:
        return []
    base, reuse = runs["pods"], runs["reuse"]

    def ratio(a, b):
        return (a or 0) / b if b else float("inf")

    checks = [
        ("reuse max TTFC {:.1f}x below pods >= 45x",
         ratio(base["ttfc"]["max_s"], reuse["ttfc"]["max_s"]), 45),
        ("reuse mean TTFC {:.1f}x below pods >= 10x",
         ratio(base["ttfc"]["mean_s"], reuse["ttfc"]["mean_s"]), 10),
        ("pods created {:.2f}x fewer >= 3.5x",
         ratio(base["pods_created"], reuse["pods_created"]), 3.5),
    ]
    out = [f"{'PASS' if v >= want else 'MISS'}  {text.format(v)}" for text, v, want in checks]
    wpr = reuse["sandpool_writes"] / max(1, reuse["rollouts"])
    out.append(f"{'PASS' if wpr <= 0.6 else 'MISS'}  sandpool writes per reused rollout "
               f"{wpr:.3f} <= 0.6")
    return out


def plots(runs: dict[str, dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        xs = sorted(s * 1000 for s in r["ttfc_samples"])
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{name} (max {xs[-1]:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first command (ms, log scale)")
    ax.set_ylabel("fraction of rollouts")
    ax.set_title(f"TTFC CDF, {title}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "k8s_burst_ttfc_cdf.png", dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.4 * len(runs)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs.items()):
        tl = r["timeline"]
        if tl:
            ts = [t - r["t0"] for t, _, _ in tl]
            ax.step(ts, [p for _, p, _ in tl], where="post", label="pods on nodes")
            ax.step(ts, [q for _, _, q in tl], where="post", label="image pulls in flight")
        ax.set_title(f"{name}", fontsize=9)
        ax.set_xlabel("seconds since the mode started")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"pods and pulls in flight, {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "k8s_burst_timeline.png", dpi=120)
    plt.close(fig)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="seed: 4578 images x 4 rollouts (sets --images/--rollouts)")
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=0,
                    help="rollout lanes at once (default: every lane, the whole burst)")
    ap.add_argument("--modes", default="pods,warm,reuse")
    ap.add_argument("--think", type=float, default=5.0,
                    help="seconds of policy (model) time between the episode's two commands")
    ap.add_argument("--qps", type=float, default=50.0, help="client-side writes per second")
    ap.add_argument("--burst", type=int, default=100, help="client-side write burst")
    ap.add_argument("--ready-timeout", type=float, default=1800.0)
    ap.add_argument("--baseline-agent", action="store_true",
                    help="give the pods baseline the agent session too (default: exec per command)")
    ap.add_argument("--reuse-lanes", type=int, default=1,
                    help="reuse: sandboxes (lanes) per image; its rollouts run back to back")
    ap.add_argument("--presessions", type=int, default=-1,
                    help="warm: agent sessions opened on warm-pool pods before their claim, at "
                    "most this many at once (default: --concurrency; 0: off)")
    ap.add_argument("--controller-version", default="v1.0.3")
    ap.add_argument("--kubeconfig", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args()
    if args.shape:
        args.images, args.rollouts = SHAPES[args.shape]
    if args.concurrency <= 0:
        args.concurrency = args.images * args.rollouts
    if args.presessions < 0:
        args.presessions = args.concurrency
    kubeconfig = args.kubeconfig or default_kubeconfig()
    args.out.mkdir(parents=True, exist_ok=True)
    source = (args.out / "k8s_burst_repo").resolve()
    commit = make_repo(source)
    model = cluster_model()
    head = (f"k8s burst: {args.images} images x {args.rollouts} rollouts, concurrency "
            f"{args.concurrency}, think {args.think:g} s, client qps {args.qps:g} burst "
            f"{args.burst}; cluster: {json.dumps(model)}")
    print(head, flush=True)
    runs: dict[str, dict] = {}
    admin = KubernetesBackend(kubeconfig)  # namespaces and /metrics; it creates nothing labelled
    mon = Monitor(admin)
    mon.start()
    try:
        for name in args.modes.split(","):
            try:
                runs[name] = await run_mode(name, args, kubeconfig, source, commit, admin, model,
                                            mon)
            except Exception as exc:  # noqa: BLE001 - partial results are kept and reported
                print(f"{name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
                continue
            r = runs[name]
            print(f"{name}: {r['outcomes']} in {r['wall_s']:.1f} s, pods {r['pods_created']}",
                  flush=True)
    finally:
        await mon.stop()
        await admin.aclose()
    plans = [f"[{n}] {r['plan_text']}" for n, r in runs.items() if r.get("plan_text")]
    reasons = [f"[{n}] quarantined {q}" for n, r in runs.items()
               for pc in r.get("pool_counters", []) for q in pc.get("quarantine_reasons", [])]
    text = "\n".join([head, table(runs), "", *verdicts(runs), "", *reasons, *plans])
    print(text)
    (args.out / "k8s_burst.txt").write_text(text + "\n")
    (args.out / "k8s_burst.json").write_text(json.dumps(
        {"args": vars(args) | {"out": str(args.out), "kubeconfig": str(kubeconfig)},
         "cluster": model, "runs": runs, "samples": mon.samples}, indent=1, default=str))
    plots(runs, args.out, f"{args.images} images x {args.rollouts} rollouts, {model['model']} "
          "image model (kwok)")
    print(f"wrote {args.out}/k8s_burst.{{txt,json}}, k8s_burst_ttfc_cdf.png, k8s_burst_timeline.png")


if __name__ == "__main__":
    asyncio.run(main())
