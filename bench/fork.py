"""Benchmark: fork, snapshot, restore, suspend and resume on the local backend.

Everything runs on one ``reuse`` pool of the default pack's first task, warm sandboxes ready,
and every figure is printed beside its baseline from the same run:

* **fork vs replay**: ``lease.fork(1)`` of a sandbox that ran a k-step prefix (k = 5, 20;
  each step one shell command, as an agent's; the first writes 1 MB or 100 MB), against
  the way to get the same state without a fork: a fresh claim plus replaying the k steps.
  The first fork of a state copies what changed; later forks of it share the copy (p50).
* **snapshot and restore vs bytes changed** (1 MB, 100 MB, 1 GB in one file): the first
  snapshot of the change (it is copied and hashed), a snapshot after one more small step
  (only that step is copied), and a claim restored from the snapshot (stack, verify). The
  same on a large image (the task's image plus ``--large-image-mb`` of files in its repo)
  shows the cost follows the change, not the image.
* **suspend / resume**: the cgroup freezer, against a bare exec round trip.
* **an OCI image** (``--oci``, or ``--oci-only`` for this part alone; the SWE-bench-shaped
  test image): fork vs replay again, at each of ``--sizes``. Its repo's layers are stacked as
  an image directory's are; what changed outside the repo (little here) is replayed into each
  child's root.

The load average is printed with the figures (2 cores shared: compare ratios, not ms).

    .venv/bin/python bench/fork.py [--repeats 10] [--sizes 1,100,1000] [--large-image-mb 1000]
                                   [--oci | --oci-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandpool.core import PoolLimits, SandboxPool  # noqa: E402
from sandpool.core.backends.local import LocalBackend, image_dir  # noqa: E402
from sandpool.core.paths import sandpool_home  # noqa: E402
from sandpool.core.task import Task  # noqa: E402
from sandpool.envs.taskpack import abuild_default_pack  # noqa: E402
from sandpool.envs.tasks import load_tasks  # noqa: E402

MB = 1 << 20


def _step(i: int) -> str:
    """Step i of the prefix: a small edit and a look at the tree, as an agent's step."""
    return f"echo 'step {i}' >> notes.txt && git status --short | wc -l"


def _ms(xs: list[float], q: float = 0.5) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


async def _timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = await coro
    return time.perf_counter() - t0, out


async def fork_vs_replay(pool: SandboxPool, task: Task, k: int, big_mb: int, repeats: int) -> dict:
    prefix = [f"head -c {big_mb * MB} /dev/urandom > big.bin && echo ok"] + [_step(i) for i in range(k - 1)]
    async with pool.claim(task) as parent:
        for cmd in prefix:
            assert (await parent.exec(cmd, timeout=600)).ok
        forks = []
        for _ in range(repeats + 1):
            dt, kids = await _timed(parent.fork(1))
            forks.append(dt)
            await kids[0].release()
    replays = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lease = await pool.acquire(task)
        for cmd in prefix:
            assert (await lease.exec(cmd, timeout=600)).ok
        replays.append(time.perf_counter() - t0)
        await lease.release()
    return {"k": k, "changed_mb": big_mb, "first_fork": forks[0], "fork": forks[1:], "replay": replays}


async def snapshot_costs(pool: SandboxPool, task: Task, mb: int, repeats: int) -> dict:
    cold, warm, restore = [], [], []
    async with pool.claim(task) as lease:
        assert (await lease.exec(f"head -c {mb * MB} /dev/urandom > big.bin && echo ok", timeout=900)).ok
        for i in range(repeats):
            # A new ctime: the file counts as changed again, so this snapshot copies it.
            assert (await lease.exec("touch big.bin")).ok
            dt, snap = await _timed(lease.snapshot())
            cold.append(dt)
            assert (await lease.exec(_step(i))).ok
            dt, snap = await _timed(lease.snapshot())
            warm.append(dt)
            dt, child = await _timed(pool.acquire(task, from_snapshot=snap))
            restore.append(dt)
            await child.release()
    return {"mb": mb, "cold": cold, "warm": warm, "restore": restore, "size_bytes": snap.size_bytes}


async def suspend_resume(pool: SandboxPool, task: Task, repeats: int) -> dict:
    sus, res, rtt = [], [], []
    async with pool.claim(task) as lease:
        assert (await lease.exec("nohup sleep 600 >/dev/null 2>&1 &")).ok
        for _ in range(repeats):
            rtt.append((await _timed(lease.exec("true")))[0])
            sus.append((await _timed(lease.suspend()))[0])
            res.append((await _timed(lease.resume()))[0])
    return {"suspend": sus, "resume": res, "exec": rtt}


def large_image(task: Task, extra_mb: int) -> tuple[Path, Task]:
    """The task's image with ``extra_mb`` of files added to its repo (built once, cached)."""
    root = sandpool_home() / "bench-images"
    name = f"sandpool.bench/large-{extra_mb}mb:1"
    src = image_dir(sandpool_home() / "images", task.image)
    dst = image_dir(root, name)
    if not (dst / "image.json").exists():
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        meta = json.loads((src / "image.json").read_text())
        subprocess.run(["cp", "-a", meta["repo"], str(dst / "repo")], check=True)
        vendor = dst / "repo" / "vendor"
        vendor.mkdir()
        for i in range(extra_mb):
            (vendor / f"blob{i:05d}.bin").write_bytes(os.urandom(MB))
        (dst / "image.json").write_text(json.dumps({**meta, "name": name, "repo": str(dst / "repo")}))
    return root, task.model_copy(update={"image": name, "instance_id": task.instance_id + "-large"})


async def fork_table(pool: SandboxPool, task: Task, sizes: list[int], repeats: int) -> None:
    """Print fork vs a fresh claim + replaying a k-step prefix (k = 5, 20) at each size."""
    for big in sizes:
        for k in (5, 20):
            r = await fork_vs_replay(pool, task, k, big, repeats)
            print(_row(f"claim + replay {k} steps, {big} MB changed", r["replay"]))
            print(_row(f"fork of it (first fork: {r['first_fork'] * 1000:.0f} ms)", r["fork"],
                       _ms(r["replay"])))
    print(f"  ({_load()})")


def _row(label: str, xs: list[float], base: float | None = None) -> str:
    ratio = f"{base / _ms(xs):8.1f}x" if base else ""
    return f"  {label:<46} p50 {_ms(xs):9.1f} ms  p95 {_ms(xs, 0.95):9.1f} ms {ratio}"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--sizes", default="1,100,1000", help="MB changed, comma-separated")
    ap.add_argument("--large-image-mb", type=int, default=1000, help="MB added to the large image")
    ap.add_argument("--oci", action="store_true", help="also fork vs replay on the OCI test image")
    ap.add_argument("--oci-only", action="store_true", help="only fork vs replay on the OCI test image")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    print(f"bench/fork.py: {args.repeats} repeats; {_load()}")
    if not args.oci_only:
        await image_dirs(args, sizes)
    if args.oci or args.oci_only:
        from sandpool.bench.workload import oci_tasks
        from sandpool.core.images import ImageStore

        store = ImageStore()
        (oci,) = await asyncio.to_thread(oci_tasks, 1, store)
        async with SandboxPool(LocalBackend(store=store), "reuse", PoolLimits(max_live=8)) as pool:
            await pool.prepare([oci] * 4, 4)
            print(f"\nfork vs a fresh claim + replaying the prefix on an OCI image ({oci.image}; "
                  "the fork's speed-up at right)")
            await fork_table(pool, oci, sizes, args.repeats)


async def image_dirs(args: argparse.Namespace, sizes: list[int]) -> None:
    """Every figure on the default pack's first task (an image directory)."""
    task = load_tasks(await abuild_default_pack())[0]
    print(f"\nthe default pack's task {task.instance_id}")
    limits = PoolLimits(max_live=8)
    async with SandboxPool(LocalBackend(), "reuse", limits) as pool:
        await pool.prepare([task] * 4, 4)
        print("\nfork vs a fresh claim + replaying the prefix (the fork's speed-up at right)")
        await fork_table(pool, task, [1, 100], args.repeats)
        print("\nsnapshot and restore vs bytes changed (one file), task image "
              f"({_du(task.image)} MB repo)")
        for mb in sizes:
            r = await snapshot_costs(pool, task, mb, max(2, args.repeats // (1 + mb // 100)))
            print(_row(f"{mb} MB: snapshot, the change copied and hashed", r["cold"]))
            print(_row(f"{mb} MB: snapshot after one more step", r["warm"]))
            print(_row(f"{mb} MB: claim restored from it (stack + verify)", r["restore"]))
        r = await suspend_resume(pool, task, args.repeats)
        print("\nsuspend / resume (the cgroup freezer)")
        print(_row("exec round trip (baseline)", r["exec"]))
        print(_row("suspend", r["suspend"]))
        print(_row("resume", r["resume"]))
        print(f"  ({_load()})")
    root, big_task = large_image(task, args.large_image_mb)
    async with SandboxPool(LocalBackend(root), "reuse", limits) as pool:
        await pool.prepare([big_task] * 2, 2)
        print(f"\nthe same on a large image ({args.large_image_mb} MB more in its repo)")
        for mb in [s for s in sizes if s <= 100]:
            r = await snapshot_costs(pool, big_task, mb, max(2, args.repeats // (1 + mb // 100)))
            print(_row(f"{mb} MB: snapshot, the change copied and hashed", r["cold"]))
            print(_row(f"{mb} MB: claim restored from it (stack + verify)", r["restore"]))
    print(f"  ({_load()})")


def _du(image: str) -> int:
    meta = json.loads((image_dir(sandpool_home() / "images", image) / "image.json").read_text())
    out = subprocess.run(["du", "-sm", meta["repo"]], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out else 0


if __name__ == "__main__":
    asyncio.run(main())
