"""Benchmark: cold vs warm vs reuse on the local backend, same workload, side by side.

Runs N tasks x k rollouts (default 8 x 4) at concurrency 8 from the default task pack under each
strategy, prints the figures side by side, and writes ``local_strategies.json``,
``local_strategies.txt`` and ``local_strategies_ttfc_cdf.png`` (CDF of TTFC) to ``--out``.

    .venv/bin/python bench/local_strategies.py [--tasks 8] [--rollouts 4] [--concurrency 8]
        [--strategies cold,warm,reuse]
    .venv/bin/python bench/local_strategies.py --images oci   # + the same on OCI images

``--images oci`` also runs the workload on OCI images (``bench/_oci_images.py``: one
SWE-bench-shaped image per task, layers shared) and prints, side by side with the current
images: cold start, warm and reuse TTFC, reset time and disk per image. Target: OCI cold start
within 1.5x of the current images', reuse TTFC unchanged.

Reset mean and max are the in-place reset's time (restore + verification) per release under
``reuse``. ``--reset-rounds N`` also times the reset next to its baseline (the git-level reset
it replaced) on one sandbox per image, alternating after the same rollout (``bench/_reset_ab.py``):

    .venv/bin/python bench/local_strategies.py --strategies reuse --reset-rounds 3

Targets on a 2-core machine: warm TTFC p50 <= 20 ms; reuse max TTFC >= 10x below cold max;
reuse creates no more sandboxes than the concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from _plot import ttfc_cdf

from sandpool.core.backends.local import LocalBackend  
from sandpool.core.metrics import Report  
from sandpool.envs.policies import NoopPolicy, OraclePolicy  
from sandpool.envs.runner import run_batch  
from sandpool.envs.taskpack import abuild_default_pack  
from sandpool.envs.tasks import load_tasks  

STRATEGIES = ("cold", "warm", "reuse")


def _spread(tasks, n):
    """Pick ``n`` tasks round-robin across images, so every image is in the workload."""
    by: dict[str, list] = {}
    for t in tasks:
        by.setdefault(t.image, []).append(t)
    out, i = [], 0
    while len(out) < n and any(by.values()):
        queue = list(by.values())[i % len(by)]
        if queue:
            out.append(queue.pop(0))
        i += 1
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def table(reports: dict[str, Report]) -> str:
    """Render the side-by-side table (milliseconds for TTFC, seconds for wall time)."""
    rows = [
        ("TTFC mean (ms)", lambda r: _ms(r.ttfc.mean_s)),
        ("TTFC p50 (ms)", lambda r: _ms(r.ttfc.p50_s)),
        ("TTFC p95 (ms)", lambda r: _ms(r.ttfc.p95_s)),
        ("TTFC p99 (ms)", lambda r: _ms(r.ttfc.p99_s)),
        ("TTFC max (ms)", lambda r: _ms(r.ttfc.max_s)),
        ("sandboxes created", lambda r: str(r.sandboxes_created)),
        ("resets / quarantines", lambda r: f"{r.resets} / {r.quarantines}"),
        ("reset mean (ms)", lambda r: _ms(r.pool.reset_total_s / n) if (n := r.resets + r.quarantines)
         else "-"),
        ("reset max (ms)", lambda r: _ms(r.pool.reset_max_s) if r.resets + r.quarantines else "-"),
        ("completed/infra/task", lambda r: "/".join(str(v) for v in r.failures.values())),
        ("reward mean", lambda r: "-" if r.reward.mean is None else f"{r.reward.mean:.3f}"),
        ("wall time (s)", lambda r: f"{r.wall_time_s:.1f}"),
    ]
    names = list(reports)
    lines = [f"{'':<22}" + "".join(f"{n:>12}" for n in names)]
    lines += [f"{label:<22}" + "".join(f"{fn(reports[n]):>12}" for n in names) for label, fn in rows]
    return "\n".join(lines)


def verdicts(reports: dict[str, Report], concurrency: int) -> list[str]:
    """The issue's three targets, each with its measured figure and PASS/MISS."""
    warm, cold, reuse = reports["warm"], reports["cold"], reports["reuse"]
    ratio = (cold.ttfc.max_s or 0) / (reuse.ttfc.max_s or float("inf"))
    checks = [
        (f"warm TTFC p50 {_ms(warm.ttfc.p50_s)} ms <= 20 ms", (warm.ttfc.p50_s or 1) <= 0.020),
        (f"cold max / reuse max = {ratio:.1f}x >= 10x", ratio >= 10),
        (f"reuse created {reuse.sandboxes_created} <= concurrency {concurrency}",
         reuse.sandboxes_created <= concurrency),
    ]
    return [f"{'PASS' if ok else 'MISS'}  {text}" for text, ok in checks]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--images", choices=("current", "oci"), default="current",
                    help="oci: also run on OCI images and compare")
    ap.add_argument("--reset-rounds", type=int, default=0,
                    help="also time the reset against its git-level baseline, N rounds per image")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="comma-separated subset of cold,warm,reuse (the targets need all three)")
    args = ap.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    if not strategies or set(strategies) - set(STRATEGIES):
        ap.error(f"--strategies: pick from {','.join(STRATEGIES)}, got {args.strategies!r}")
    if args.images == "oci" and len(strategies) != len(STRATEGIES):
        ap.error("--images oci compares all three strategies; drop --strategies")
    tasks = _spread(load_tasks(await abuild_default_pack()), args.tasks)
    reports: dict[str, Report] = {}
    for name in strategies:
        reports[name] = await run_batch(tasks, [OraclePolicy(), NoopPolicy()], LocalBackend(),
                                        rollouts_per_task=args.rollouts, concurrency=args.concurrency,
                                        strategy=name)
        print(f"{name}: done in {reports[name].wall_time_s:.1f} s", flush=True)
    head = (f"local strategies: {len(tasks)} tasks x {args.rollouts} rollouts, "
            f"{len({t.image for t in tasks})} images, concurrency {args.concurrency}")
    checks = verdicts(reports, args.concurrency) if len(reports) == len(STRATEGIES) else []
    text = "\n".join([head, table(reports), "", *checks])
    if args.reset_rounds > 0:
        from _reset_ab import compare, render

        per_image = _spread(tasks, len({t.image for t in tasks}))
        text += (f"\n\nin-place reset vs its baseline: {args.reset_rounds} rounds x "
                 f"{len(per_image)} images\n" + render(await compare(per_image, args.reset_rounds)))
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "local_strategies.txt").write_text(text + "\n")
    (args.out / "local_strategies.json").write_text(json.dumps(
        {n: r.model_dump(mode="json") for n, r in reports.items()}, indent=2))
    ttfc_cdf(reports, args.out / "local_strategies_ttfc_cdf.png", "TTFC CDF, local backend")
    print(f"wrote {args.out}/local_strategies.{{txt,json}} and local_strategies_ttfc_cdf.png")
    if args.images == "oci":
        await _oci_run(args, tasks, reports)


async def _oci_run(args: argparse.Namespace, tasks: list, current: dict[str, Report]) -> None:
    from _oci_images import disk_per_image_current, oci_tasks, side_by_side

    from sandpool.core.images import ImageStore

    store = ImageStore()
    otasks = oci_tasks(len(tasks), store)
    oci: dict[str, Report] = {}
    for name in STRATEGIES:
        oci[name] = await run_batch(otasks, [OraclePolicy(), NoopPolicy()], LocalBackend(store=store),
                                    rollouts_per_task=args.rollouts, concurrency=args.concurrency,
                                    strategy=name)
        print(f"oci {name}: done in {oci[name].wall_time_s:.1f} s", flush=True)
    disk_cur = disk_per_image_current(LocalBackend().images_root, {t.image for t in tasks})
    text = "\n".join([
        f"OCI images: {len(otasks)} tasks x {args.rollouts} rollouts, {len(otasks)} images, "
        f"concurrency {args.concurrency}", table(oci), "", *verdicts(oci, args.concurrency), "",
        "current images vs OCI images (same workload shape):",
        *side_by_side(current, oci, disk_cur, store, len(otasks))])
    print(text)
    (args.out / "local_strategies_oci.txt").write_text(text + "\n")
    (args.out / "local_strategies_oci.json").write_text(json.dumps(
        {n: r.model_dump(mode="json") for n, r in oci.items()}, indent=2))
    ttfc_cdf(oci, args.out / "local_strategies_oci_ttfc_cdf.png", "TTFC CDF, local backend, OCI images")


if __name__ == "__main__":
    asyncio.run(main())
