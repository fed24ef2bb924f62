"""Benchmark: a burst of rollouts on the local Kubernetes cluster under pods, warm and reuse.

The same burst (default 100 images x 4 rollouts, one lane per image, concurrency 100) runs
three times against the running cluster from ``hack/cluster`` (10 kwok nodes, simulated
start latency: 3 s uncached pull, 0.1 s cached, 1 s boot):

* ``pods``  - a plain Pod per rollout, deleted after (strategy ``cold``): the baseline;
* ``warm``  - agent-sandbox: a SandboxWarmPool per image, a fresh SandboxClaim per rollout;
* ``reuse`` - agent-sandbox: a claim per lane kept across rollouts, reset in the pod.

Each mode uses its own namespace and its own image tags, so no mode finds images that an
earlier mode left cached on the nodes. The episode is cheap for the cluster: two commands
with ``--think`` seconds of policy (model) time between them, as in an RL rollout; with no
think time every lane issues commands back to back and the exec path (apiserver -> kwok ->
a host process, about 40 exec/s on 2 shared cores) rather than the control plane sets TTFC. API requests are counted from the apiserver's own ``/metrics``
(``apiserver_request_total`` by verb, delta over the mode's run, every client included: the
controller, kwok and the provisioner too), and pods created from its ``POST pods`` count.

    python hack/cluster/cluster.py up
    .venv/bin/python bench/k8s_burst.py [--images 100] [--rollouts 4] [--concurrency 100]

Writes ``k8s_burst.txt``, ``k8s_burst.json`` and ``k8s_burst_ttfc_cdf.png`` to ``--out``.
Targets: reuse creates <= 1/3.5 as many pods as pods; reuse max TTFC >= 10x below pods's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import time
import uuid
from collections import Counter, deque
from pathlib import Path

from _plot import ttfc_cdf

from sandpool.core import PoolLimits, SandboxPool, Task, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend, PodImage
from sandpool.core.metrics import Workload
from sandpool.testing.kwok import exec_prefix

MODES = {
    "pods": ("pods", "cold"),
    "warm": ("agent-sandbox", "warm"),
    "reuse": ("agent-sandbox", "reuse"),
}
_METRIC = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$")
_WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY")


def default_kubeconfig() -> Path:
    if kc := os.environ.get("SANDPOOL_CLUSTER_KUBECONFIG"):
        return Path(kc)
    run = Path(
        os.environ.get("SANDPOOL_CLUSTER_RUN_DIR") or Path.home() / ".cache/sandpool/cluster/run"
    )
    return Path(json.loads((run / "state.json").read_text())["kubeconfig"])


def make_repo(path: Path) -> str:
    """A small git repository standing in for every task image; returns its HEAD."""
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@b",
    }
    if not (path / ".git").is_dir():
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "init", "-q", str(path)], check=True)
        (path / "main.py").write_text("print('hello')\n")
        subprocess.run(["git", "-C", str(path), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(path), "commit", "-qm", "base"], check=True, env=env)
    return subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


async def scrape(backend: KubernetesBackend) -> tuple[Counter, int]:
    """``apiserver_request_total`` summed by verb, and ``POST pods`` answered 201."""
    http = await backend._ensure_client()
    async with http.session.get(http.url("/metrics"), headers=await http.headers()) as resp:
        text = await resp.text()
    by_verb: Counter = Counter()
    pods_created = 0
    for line in text.splitlines():
        if not (mm := _METRIC.match(line)):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', mm.group("labels")))
        value = int(float(mm.group("value")))
        by_verb[labels.get("verb", "?")] += value
        if (
            labels.get("verb"),
            labels.get("resource"),
            labels.get("subresource"),
            labels.get("code"),
        ) == ("POST", "pods", "", "201"):
            pods_created += value
    return by_verb, pods_created


async def run_mode(
    name: str, args, kubeconfig: Path, source: Path, commit: str, admin: KubernetesBackend
) -> dict:
    mode, strategy = MODES[name]
    tag = f"{name}-{uuid.uuid4().hex[:6]}"  # fresh image names: nothing cached on the nodes
    tasks = [
        Task(
            instance_id=f"img{i}",
            repo="bench/repo",
            base_commit=commit,
            image=f"sandpool.bench/img-{i}:{tag}",
            problem_statement="burst",
        )
        for i in range(args.images)
    ]
    namespace = f"bench-{tag}"
    backend = KubernetesBackend(
        kubeconfig,
        namespace=namespace,
        mode=mode,
        qps=args.qps,
        burst=args.burst,
        image_map=lambda n: PodImage(n, workdir_source=str(source)),
        exec_prefix=exec_prefix,
    )
    http = await admin._ensure_client()
    await http.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    await asyncio.sleep(1.0)  # the service-account controller makes "default" (pods need it)

    async def episode(lease) -> float:
        await lease.exec("git status --porcelain")
        await asyncio.sleep(args.think)  # the policy thinking (model time) between commands
        return float((await lease.exec("echo ok")).text == "ok\n")

    verbs0, pods0 = await scrape(admin)
    t0 = time.monotonic()
    results = []
    async with SandboxPool(
        backend,
        strategy,
        PoolLimits(
            claim_timeout=900, create_timeout=600, create_rate=args.qps, create_burst=args.burst
        ),
    ) as pool:
        slots = await pool.prepare(tasks, args.concurrency, rollouts_per_task=args.rollouts)
        t_ready = time.monotonic()
        gate = asyncio.Semaphore(args.concurrency)
        lanes = {t.image: deque((t, i) for i in range(args.rollouts)) for t in tasks}

        async def lane(q: deque) -> None:
            async with gate:
                while q:
                    task, i = q.popleft()
                    results.append(
                        await run_rollout(pool, task, episode, rollout=i, retries=2, policy="burst")
                    )

        await asyncio.gather(
            *(lane(q) for img, q in lanes.items() for _ in range(slots.get(img, 1)))
        )
        t_burst = time.monotonic()
        report = pool.report(
            Workload(
                tasks=len(tasks),
                images=len(tasks),
                rollouts=len(results),
                concurrency=args.concurrency,
                backend=f"kubernetes/{mode}",
                strategy=strategy,
                policies=["burst"],
            ),
            results,
            t_burst - t0,
        )
        client_stats = backend.api_stats
    # Closing deleted the run's objects; count the API traffic of the whole mode, teardown included.
    verbs1, pods1 = await scrape(admin)
    await http.request("DELETE", f"/api/v1/namespaces/{namespace}", ok_missing=True)
    delta = {v: verbs1[v] - verbs0[v] for v in verbs1 if verbs1[v] - verbs0[v]}
    return {
        "mode": name,
        "backend_mode": mode,
        "strategy": strategy,
        "namespace": namespace,
        "prepare_s": t_ready - t0,
        "burst_s": t_burst - t_ready,
        "wall_s": t_burst - t0,
        "pods_created": pods1 - pods0,
        "apiserver_requests_by_verb": delta,
        "apiserver_writes": sum(delta.get(v, 0) for v in _WRITE_VERBS),
        "client_writes": client_stats.get("writes", 0),
        "client_stats": client_stats,
        "report": json.loads(report.model_dump_json()),
        "_report": report,
    }


def table(runs: dict[str, dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"

    rows = [
        ("TTFC mean (ms)", lambda r: ms(r["_report"].ttfc.mean_s)),
        ("TTFC p50 (ms)", lambda r: ms(r["_report"].ttfc.p50_s)),
        ("TTFC p99 (ms)", lambda r: ms(r["_report"].ttfc.p99_s)),
        ("TTFC max (ms)", lambda r: ms(r["_report"].ttfc.max_s)),
        ("pods created", lambda r: str(r["pods_created"])),
        ("API writes (apiserver)", lambda r: str(r["apiserver_writes"])),
        (
            "  POST/PATCH/DELETE",
            lambda r: "/".join(
                str(r["apiserver_requests_by_verb"].get(v, 0)) for v in ("POST", "PATCH", "DELETE")
            ),
        ),
        ("  exec (CONNECT)", lambda r: str(r["apiserver_requests_by_verb"].get("CONNECT", 0))),
        ("API writes (sandpool)", lambda r: str(r["client_writes"])),
        (
            "completed/infra/task",
            lambda r: "/".join(str(v) for v in r["_report"].failures.values()),
        ),
        ("resets / quarantines", lambda r: f"{r['_report'].resets} / {r['_report'].quarantines}"),
        ("prepare (s)", lambda r: f"{r['prepare_s']:.1f}"),
        ("burst (s)", lambda r: f"{r['burst_s']:.1f}"),
        ("wall time (s)", lambda r: f"{r['wall_s']:.1f}"),
    ]
    names = list(runs)
    lines = [f"{'':<24}" + "".join(f"{n:>10}" for n in names)]
    lines += [f"{label:<24}" + "".join(f"{fn(runs[n]):>10}" for n in names) for label, fn in rows]
    return "\n".join(lines)


def verdicts(runs: dict[str, dict]) -> list[str]:
    if "pods" not in runs or "reuse" not in runs:
        return []
    base, reuse = runs["pods"], runs["reuse"]
    pod_ratio = base["pods_created"] / max(1, reuse["pods_created"])
    ttfc_ratio = (base["_report"].ttfc.max_s or 0) / (reuse["_report"].ttfc.max_s or float("inf"))
    checks = [
        (f"pods created: pods/reuse = {pod_ratio:.2f}x >= 3.5x", pod_ratio >= 3.5),
        (f"TTFC max: pods/reuse = {ttfc_ratio:.1f}x >= 10x", ttfc_ratio >= 10),
    ]
    return [f"{'PASS' if ok else 'MISS'}  {text}" for text, ok in checks]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--modes", default="pods,warm,reuse")
    ap.add_argument(
        "--think",
        type=float,
        default=20.0,
        help="seconds of policy (model) time between the episode's two commands",
    )
    ap.add_argument("--qps", type=float, default=50.0, help="client-side writes per second")
    ap.add_argument("--burst", type=int, default=100, help="client-side write burst")
    ap.add_argument("--kubeconfig", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args()
    kubeconfig = args.kubeconfig or default_kubeconfig()
    args.out.mkdir(parents=True, exist_ok=True)
    source = (args.out / "k8s_burst_repo").resolve()
    commit = make_repo(source)
    runs: dict[str, dict] = {}
    admin = KubernetesBackend(kubeconfig)  # namespaces and /metrics; it creates nothing labelled
    try:
        for name in args.modes.split(","):
            runs[name] = await run_mode(name, args, kubeconfig, source, commit, admin)
            r = runs[name]
            print(
                f"{name}: {r['_report'].failures} in {r['wall_s']:.1f} s, pods {r['pods_created']}",
                flush=True,
            )
    finally:
        await admin.aclose()
    head = (
        f"k8s burst: {args.images} images x {args.rollouts} rollouts, concurrency "
        f"{args.concurrency}, think {args.think:g} s, client qps {args.qps:g} burst {args.burst}"
    )
    text = "\n".join([head, table(runs), "", *verdicts(runs)])
    print(text)
    (args.out / "k8s_burst.txt").write_text(text + "\n")
    (args.out / "k8s_burst.json").write_text(
        json.dumps(
            {n: {k: v for k, v in r.items() if k != "_report"} for n, r in runs.items()}, indent=2
        )
    )
    ttfc_cdf({n: r["_report"] for n, r in runs.items()}, args.out / "k8s_burst_ttfc_cdf.png",
             "TTFC CDF, Kubernetes burst (kwok nodes)")
    print(f"wrote {args.out}/k8s_burst.{{txt,json}} and k8s_burst_ttfc_cdf.png")


if __name__ == "__main__":
    asyncio.run(main())
