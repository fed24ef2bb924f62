"""The seed's burst on the local Kubernetes cluster: ``sandpool bench --backend kubernetes`` with
what the kwok cluster adds (its image model and the tasks' stand-in repository).

A burst of ``--images`` images x ``--rollouts`` rollouts (``--shape seed``: 4,578 x 4, the
published agent-sandbox result) runs as ``pods``, ``warm`` and ``reuse`` (see
:mod:`sandpool.bench.kubernetes`) against the running cluster from ``hack/cluster`` (best
started with ``up --image-model=seed``: image sizes above 1.2 GB, per-node image disk that
cannot hold the corpus with LRU eviction, pull bandwidth shared by a node's concurrent pulls;
the model's parameters are printed with every result). Each mode gets images named afresh,
so nothing one mode pulled is cached for the next.

    python hack/cluster/cluster.py up --image-model=seed
    nice .venv/bin/python bench/k8s_burst.py --images 100          # or --shape seed

Writes ``k8s_burst.{txt,json}``, ``k8s_burst_ttfc_cdf.png`` and ``k8s_burst_timeline.png``
(pods by phase, and image pulls in flight from the image model) to ``--out``. Targets: reuse
max TTFC >= 45x below pods, reuse mean TTFC >= 10x below, pods created >= 3.5x fewer,
sandpool writes per reused rollout <= 0.6.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imagemodel import image_size  # noqa: E402  (the cluster's own image model)

from sandpool.bench import BenchConfig  # noqa: E402
from sandpool.bench.kubernetes import ClusterHooks, KubeOptions, run_kubernetes, scrape_apiserver  # noqa: E402
from sandpool.core import Task  # noqa: E402
from tests.cluster.kwok_images import workdir_image  # noqa: E402

SHAPES = {"seed": (4578, 4), "small": (20, 4)}


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


async def scrape(backend) -> tuple:
    """``apiserver_request_total`` summed by verb, and ``POST pods`` answered 201."""
    by_verb, pods, _ = await scrape_apiserver(backend)
    return by_verb, pods


def cluster_model() -> dict:
    """The cluster's image model parameters (state.json / provisioner.json)."""
    st = json.loads((run_dir() / "state.json").read_text())
    if st.get("image_model"):
        return {"model": "seed", **st["image_model"], "nodes": st["nodes"]}
    prov = json.loads((run_dir() / "provisioner.json").read_text())
    return {"model": "flat", "pull_ms": prov["pull_ms"], "cached_pull_ms": prov["cached_pull_ms"],
            "boot_ms": prov["boot_ms"], "nodes": st["nodes"]}


def model_timeline(t0: float, t1: float) -> list[tuple[float, dict[str, float]]]:
    """Pods on nodes and image pulls in flight, summed over nodes, from image-model.jsonl."""
    path = run_dir() / "image-model.jsonl"
    if not path.exists():
        return []
    last: dict[str, tuple[int, int]] = {}
    out = []
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        last[ev["node"]] = (ev["pods"], ev["pulls"])
        if t0 <= ev["t"] <= t1:
            out.append((ev["t"], {"pods on nodes": float(sum(p for p, _ in last.values())),
                                  "image pulls in flight": float(sum(q for _, q in last.values()))}))
    return out


def cluster_cpu_s() -> float:
    """CPU seconds used so far by the cluster's components and every process under them
    (kwok's pods run as host processes under kwok; a reaped child's time is its parent's)."""
    roots = {p["pid"] for p in json.loads((run_dir() / "state.json").read_text())["processes"].values()}
    tick = os.sysconf("SC_CLK_TCK")
    parent, spent = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            f = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parent[int(entry.name)] = int(f[1])
        spent[int(entry.name)] = sum(int(x) for x in f[11:15]) / tick  # utime stime cutime cstime

    def under(pid: int) -> bool:
        while pid > 1:
            if pid in roots:
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(s for pid, s in spent.items() if under(pid))


def hooks(source: Path, model: dict) -> ClusterHooks:
    sizes = ((lambda images: {i: image_size(i, model) for i in images}) if model["model"] == "seed"
             else None)  # flat model: no sizes; 1 GB each for the plan
    return ClusterHooks(image_map=lambda n: workdir_image(n, source), image_sizes=sizes,
                        node_disk_bytes=model.get("disk_gb", 1e6) * 1e9, timeline=model_timeline,
                        describe=model, cpu=cluster_cpu_s)


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
                    help="seconds of policy (model) time between the episode's commands")
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
    concurrency = args.concurrency if args.concurrency > 0 else args.images * args.rollouts
    args.out.mkdir(parents=True, exist_ok=True)
    source = (args.out / "k8s_burst_repo").resolve()
    commit = make_repo(source)
    model = cluster_model()

    def tasks(mode: str) -> list[Task]:
        tag = f"{mode}-{uuid.uuid4().hex[:6]}"  # fresh image names: nothing cached on the nodes
        return [Task(instance_id=f"img{i}", repo="bench/repo", base_commit=commit,
                     image=f"sandpool.bench/img-{i}:{tag}", problem_statement="burst")
                for i in range(args.images)]

    cfg = BenchConfig(backend="kubernetes", strategies=tuple(args.modes.split(",")), tasks="(kwok burst)",
                      limit=args.images, rollouts=args.rollouts, concurrency=concurrency, out=args.out,
                      kubeconfig=args.kubeconfig or default_kubeconfig())
    opts = KubeOptions(think_s=args.think, qps=args.qps, burst=args.burst, ready_timeout=args.ready_timeout,
                       reuse_lanes=args.reuse_lanes,
                       presessions=None if args.presessions < 0 else args.presessions,
                       baseline_agent=args.baseline_agent, controller_version=args.controller_version)
    print(f"cluster: {json.dumps(model)}", flush=True)
    report = await run_kubernetes(cfg, tasks=tasks, opts=opts, hooks=hooks(source, model),
                                  say=lambda line: print(line, flush=True))
    print(report.render_text())
    paths = report.write(args.out, "k8s_burst")
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    asyncio.run(main())
