"""Benchmark: suspend and resume of a leased pod on the local Kubernetes cluster (kwok).

Suspend and resume go through agent-sandbox's Sandbox ``spec.operatingMode``: the suspend
snapshots the pod and sets its Sandbox ``Suspended`` (it returns once the controller has deleted
the pod), and the resume sets it ``Running``, then opens the new pod's agent session, records it
pristine and restores the snapshot into it, verified. Printed beside, from the same run:

* the same suspend and resume with ``mode="pods"`` (no Sandbox to keep: the pod is deleted, and
  the resume restores into a new pod of a new claim);
* an exec round trip on the lease, a snapshot alone, and a claim restored from the same snapshot
  (``pool.claim(task, from_snapshot=snap)``, a new pod: no sandbox is left idle, so every
  resume and claim here starts a pod).

Each repeat writes ``--mb`` MB into the repo first, so every snapshot carries that much. Uses
the cluster started with ``hack/cluster/cluster.py up`` (``SANDPOOL_CLUSTER_RUN_DIR``, or
``~/.cache/sandpool/cluster/run``). kwok's pods start after the provisioner's simulated pull
and boot (``provisioner.json``), which is included in every new pod's figure.

    python hack/cluster/cluster.py up
    nice .venv/bin/python bench/k8s_suspend.py [--repeats 10] [--mb 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k8s_burst import default_kubeconfig, make_repo, run_dir  # noqa: E402

from sandpool.core import PoolLimits, SandboxPool, Task  # noqa: E402
from sandpool.core.backends.kubernetes import KubernetesBackend  # noqa: E402
from sandpool.core.paths import sandpool_home  # noqa: E402
from tests.cluster.kwok_images import workdir_image  # noqa: E402

IMAGE = "sandpool.bench/suspend:1"


def _ms(xs: list[float], q: float = 0.5) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def _row(label: str, xs: list[float]) -> str:
    return f"  {label:<52} p50 {_ms(xs):8.1f} ms  p95 {_ms(xs, 0.95):8.1f} ms"


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


async def _timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = await coro
    return time.perf_counter() - t0, out


async def run(mode: str, kubeconfig: Path, namespace: str, source: Path, head: str, repeats: int,
              mb: int) -> dict[str, list[float]]:
    backend = KubernetesBackend(kubeconfig, namespace=namespace, mode=mode,
                                run_id=uuid.uuid4().hex[:8],
                                image_map=lambda n: workdir_image(n, source))
    task = Task(instance_id="suspend-0", repo="b/suspend", base_commit=head, image=IMAGE,
                problem_statement="p")
    out: dict[str, list[float]] = {"exec": [], "snapshot": [], "suspend": [], "resume": [],
                                   "claim": []}
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=4)) as pool:
        async with pool.claim(task) as lease:
            for i in range(repeats):
                write = f"head -c {mb << 20} /dev/urandom > big{i % 2}.bin && echo ok"
                assert (await lease.exec(write, timeout=300)).ok
                out["exec"].append((await _timed(lease.exec("true")))[0])
                out["snapshot"].append((await _timed(lease.snapshot()))[0])
                out["suspend"].append((await _timed(lease.suspend()))[0])
                snap = lease.parked
                out["resume"].append((await _timed(lease.resume()))[0])
                dt, child = await _timed(pool.acquire(task, from_snapshot=snap))
                out["claim"].append(dt)
                await child.release(reusable=False)  # no idle pod left: each resume starts one
        assert pool.counters.quarantines == 0, pool.counters.quarantine_reasons
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--mb", type=int, default=1, help="MB written into the repo before each suspend")
    ap.add_argument("--namespace", default="default")
    args = ap.parse_args()
    kubeconfig = default_kubeconfig()
    source = sandpool_home() / "bench-k8s-suspend" / "repo"
    head = make_repo(source)
    prov = json.loads((run_dir() / "provisioner.json").read_text())
    print(f"bench/k8s_suspend.py: {args.repeats} repeats, {args.mb} MB changed per snapshot; kwok "
          f"pod start: pull {prov['pull_ms']} ms (cached {prov['cached_pull_ms']} ms), boot "
          f"{prov['boot_ms']} ms; {_load()}")
    for mode, what in (("agent-sandbox", "Sandbox spec.operatingMode"),
                       ("pods", "baseline: pod deleted, new claim")):
        r = await run(mode, kubeconfig, args.namespace, source, head, args.repeats, args.mb)
        print(f"\n{mode} ({what})")
        print(_row("exec round trip", r["exec"]))
        print(_row("snapshot alone (the part of a suspend that saves)", r["snapshot"]))
        print(_row("suspend (snapshot, pod released)", r["suspend"]))
        print(_row("resume (new pod, pristine record, restore, verify)", r["resume"]))
        print(_row("claim from the same snapshot", r["claim"]))
        print(f"  ({_load()})")


if __name__ == "__main__":
    asyncio.run(main())
