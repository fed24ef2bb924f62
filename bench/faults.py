"""Fault matrix: each fault injected during a real batch, fault x outcome counts, with the
accounting identity checked and orphans counted afterwards.

    .venv/bin/python bench/faults.py [--tasks 2] [--rollouts 2] [--faults sigkill,oom,...]

Every row is one real batch (``run_batch``, ``reuse`` strategy, concurrency 2) of the default
task pack's first ``--tasks`` tasks x ``--rollouts`` rollouts on the local backend, with one
fault injected:

==================  ==============================================================================
``none``            the baseline: no fault
``sigkill``         the host SIGKILLs the sandbox in the middle of each task's first rollout
                    (as an eviction or a host OOM would): infra, retried on a fresh sandbox
``oom``             the policy allocates 4x its memory limit first: the kernel kills its process,
                    the agent survives, the policy goes on (its result)
``forkbomb``        the policy holds every pid it may have and keeps forking, until its command's
                    timeout: the agent stays in control, the reset cleans up
``disk_full``       the policy fills its disk quota, then cannot write its patch: scored task_failed
``bad_rows``        a row whose base commit is not in its image, and a torn row: rejected, the
                    batch goes on
``runner_kill9``    the runner is killed with SIGKILL after its first journaled result, a torn
                    line is appended to the journal, and the run is resumed with ``resume=True``
==================  ==============================================================================

After each batch: ``requested = completed + infra_failed + task_failed + rejected`` is checked,
every (task, rollout) must appear exactly once (``lost``, ``dup``), and orphans of the run are
counted: overlay mounts, cgroups, state directories and processes left on the host.
With ``--k8s-faults`` the Kubernetes rows follow (``bench/_k8s_faults.py``: a pod or its kwok
node deleted, kube-apiserver restarted, an APF 429 storm, the agent-sandbox controller
restarted) on the cluster in ``--cluster-run-dir``:

    SANDPOOL_CLUSTER_RUN_DIR=~/.cache/sandpool/cluster/faults python hack/cluster/cluster.py up --nodes 3
    .venv/bin/python bench/faults.py --faults '' --k8s-faults k8s_none,pod_deleted,... \
        --cluster-run-dir ~/.cache/sandpool/cluster/faults

With ``--real-faults`` the real-node rows follow (``bench/_real_faults.py``: a real pod deleted,
its container killed through the CRI, the kubelet stopped until the node is NotReady,
containerd restarted, an image that cannot be pulled, a container OOMKilled) on that cluster's
real node (``cluster.py up --real-nodes 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _k8s_faults import K8S_FAULTS, run_k8s_fault
from _real_faults import REAL_FAULTS, run_real_fault

from sandpool.core import ResourceLimits
from sandpool.core.backends.local import LocalBackend
from sandpool.core.metrics import Outcome, RejectedTask, Report
from sandpool.core.paths import sandpool_home
from sandpool.envs.policies import OraclePolicy, Policy
from sandpool.envs.runner import read_journal, run_batch
from sandpool.envs.taskpack import abuild_default_pack
from sandpool.envs.tasks import load_tasks

FAULTS = ("none", "sigkill", "oom", "forkbomb", "disk_full", "bad_rows", "runner_kill9")
_LIMITS = ResourceLimits(cpus=1.0, memory_bytes=512 * 2**20, pids=128, disk_bytes=256 * 2**20)


class FaultyOracle(OraclePolicy):
    """The oracle, after doing the fault's damage first (``name`` stays ``oracle``)."""

    def __init__(self, fault: str, backend: LocalBackend) -> None:
        self.fault, self.backend = fault, backend
        self.killed: set[str] = set()

    async def act(self, lease, task) -> None:  # type: ignore[no-untyped-def]
        if self.fault == "sigkill" and task.instance_id not in self.killed:
            self.killed.add(task.instance_id)
            await lease.exec("true")
            self.backend.kill(lease.sandbox)  # from outside, mid-rollout
        elif self.fault == "oom":
            # Written, not only reserved: the pages count against the memory limit.
            await lease.exec(f"python -c 'x = b\"x\" * {4 * _LIMITS.memory_bytes}'", timeout=60)
        elif self.fault == "forkbomb":
            await lease.exec("for i in 1 2 3 4; do (while :; do sleep 1000 & done 2>/dev/null) & done; "
                             "sleep 1000", timeout=5)
        elif self.fault == "disk_full":
            # Past the quota in the repo, then every block left (in /tmp, on the same quota).
            await lease.exec(f"dd if=/dev/zero of=fill bs=1M count={_LIMITS.disk_bytes >> 20} 2>/dev/null; "
                             "dd if=/dev/zero of=/tmp/fill bs=4k 2>/dev/null; true", timeout=120)
        await super().act(lease, task)


def orphans(run_id: str) -> dict[str, int]:
    """What run ``run_id`` left on this host: mounts, cgroups, state dirs, processes."""
    mounts = sum(run_id in line for line in Path("/proc/self/mountinfo").read_text().splitlines())
    cgroups = sum(1 for c in Path("/sys/fs/cgroup").glob(f"*/sandpool/{run_id}"))
    state = int((sandpool_home() / "local" / run_id).exists())
    procs = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and p.name != str(os.getpid()):
            try:
                procs += f"/local/{run_id}/".encode() in (p / "cmdline").read_bytes()
            except OSError:
                pass
    return {"mounts": mounts, "cgroups": cgroups, "state_dirs": state, "processes": procs}


def _check(report: Report, journal: Path, task_ids: list[str], k: int) -> dict[str, int]:
    keys = [(r.task_id, r.rollout) for r in read_journal(journal)]
    want = {(t, i) for t in task_ids for i in range(k)}
    got = [(r.task_id, r.rollout) for r in report.rollouts]
    return {"lost": len(want - set(got)), "dup": len(got) - len(set(got)),
            "journal_dup": len(keys) - len(set(keys)), "unaccounted": report.unaccounted}


async def run_fault(fault: str, tasks, k: int, out: Path) -> dict:
    journal = out / f"{fault}.rollouts.jsonl"
    journal.unlink(missing_ok=True)
    rejected: list[RejectedTask] = []
    batch = list(tasks)
    run_ids: list[str] = []
    if fault == "bad_rows":
        bad = tasks[0].model_copy(update={"instance_id": "bad-base-commit", "base_commit": "ab" * 20})
        batch.append(bad)
        rejected.append(RejectedTask(task_id=None, row=99, reason="row 99: not valid JSON (torn row)"))
    if fault == "runner_kill9":
        child = subprocess.Popen([sys.executable, __file__, "--child", str(journal), "--tasks",
                                  str(len(tasks)), "--rollouts", str(k)], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        run_ids.append(child.stdout.readline().strip())
        while not journal.exists() or not journal.read_text().count("\n"):  # its first result
            await asyncio.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        with journal.open("a") as f:
            f.write('{"task_id": "' + tasks[0].instance_id + '", "rollout": 1, "outc')  # torn
    backend = LocalBackend(limits=_LIMITS)
    run_ids.append(backend.run_id)
    policy = FaultyOracle(fault if fault != "runner_kill9" else "none", backend)
    t0 = time.monotonic()
    report = await run_batch(batch, [policy], backend, rollouts_per_task=k, concurrency=2,
                             strategy="reuse", results_path=journal, resume=fault == "runner_kill9",
                             rejected=rejected)
    row = {"fault": fault, "backend": "local", "requested": report.workload.rollouts,
           **{o.value: report.failures[o.value] for o in Outcome},
           **_check(report, journal, [t.instance_id for t in batch] + (["<row 99>"] if rejected else []), k),
           "resolved": report.reward.resolved, "resets": report.resets, "quarantines": report.quarantines,
           "infra_errors": report.infra_errors_by_kind, "warnings": report.warnings,
           "wall_s": round(time.monotonic() - t0, 1)}
    left = [orphans(r) for r in run_ids]
    row["orphans"] = {key: sum(o[key] for o in left) for key in left[0]}
    return row


def render(rows: list[dict]) -> str:
    """The fault x outcome table."""
    cols = ["fault", "requested", "completed", "infra_failed", "task_failed", "rejected", "unaccounted",
            "lost", "dup", "resolved", "orphans"]
    lines = ["  ".join(f"{c:>12}" for c in cols)]
    for r in rows:
        cells = [*(r[c] for c in cols[:-1]), sum(r["orphans"].values())]
        lines.append("  ".join(f"{x!s:>12}" for x in cells))
    ok = all(r["unaccounted"] == 0 and r["lost"] == 0 and r["dup"] == 0 and not sum(r["orphans"].values())
             for r in rows)
    lines.append("identity requested = completed + infra_failed + task_failed + rejected, nothing lost, "
                 f"nothing duplicated, no orphan: {'HOLDS' if ok else 'BROKEN'}")
    return "\n".join(lines)


async def _tasks(n: int):
    return load_tasks(await abuild_default_pack())[:n]


async def _child(journal: Path, n: int, k: int) -> None:
    backend = LocalBackend(limits=_LIMITS)
    print(backend.run_id, flush=True)
    await run_batch(await _tasks(n), [OraclePolicy()], backend, rollouts_per_task=k, concurrency=1,
                    strategy="reuse", results_path=journal)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--out", type=Path, default=Path("reports/faults"))
    ap.add_argument("--k8s-faults", default="",
                    help=f"also these Kubernetes faults ({','.join(K8S_FAULTS)}), on a running cluster")
    ap.add_argument("--real-faults", default="",
                    help=f"also these real-node faults ({','.join(REAL_FAULTS)}), on a running cluster")
    ap.add_argument("--cluster-run-dir", type=Path,
                    default=Path(os.environ.get("SANDPOOL_CLUSTER_RUN_DIR")
                                 or Path.home() / ".cache/sandpool/cluster/run"))
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        await _child(args.child, args.tasks, args.rollouts)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    faults = [f for f in args.faults.split(",") if f]
    tasks = await _tasks(args.tasks) if faults else []
    for fault in faults:
        rows.append(await run_fault(fault, tasks, args.rollouts, args.out))
        print(f"{fault}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    for fault in [f for f in args.k8s_faults.split(",") if f]:
        kubeconfig = Path(json.loads((args.cluster_run_dir / "state.json").read_text())["kubeconfig"])
        rows.append(await run_k8s_fault(fault, kubeconfig, args.cluster_run_dir, args.out / "k8s"))
        print(f"{fault}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    real = [f for f in args.real_faults.split(",") if f]
    if real:
        from sandpool.envs.taskpack.oci import build_test_images

        root = build_test_images()
        task_row = json.loads((root / "swe-task.json").read_text())
        images = [f"sandpool.test/faults/swe-calc-{i}:1" for i in range(2)]
        for img in images:
            subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"
                                                / "cluster.py"), "push", f"oci:{root / 'layout'}:swe", img],
                           check=True, env=dict(os.environ, SANDPOOL_CLUSTER_RUN_DIR=str(args.cluster_run_dir)))
    for fault in real:
        rows.append(await run_real_fault(fault, args.cluster_run_dir, task_row, images))
        print(f"{fault}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    text = render(rows)
    print(text)
    (args.out / "faults.txt").write_text(text + "\n")
    (args.out / "faults.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
