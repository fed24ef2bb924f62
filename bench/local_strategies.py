"""Studies on top of ``sandpool bench`` (the benchmark itself is the command; this only adds two).

    .venv/bin/sandpool bench                                  # the benchmark: cold, warm, reuse,
                                                              # docker-run, docker-exec on OCI images
    .venv/bin/python bench/local_strategies.py --images oci   # the pack's image directories vs OCI
    .venv/bin/python bench/local_strategies.py --reset-rounds 3

``--images oci``: cold, warm and reuse on the default task pack (image directories) and on the
SWE-bench-shaped OCI images (``sandpool bench --tasks oci``), then side by side: cold start,
warm and reuse TTFC, reset time, disk per image. Target: OCI cold start within 1.5x of the
image directories', reuse TTFC unchanged.

``--reset-rounds N``: the in-place reset next to its baseline (the git-level reset it
replaced) on one sandbox per image, alternating after the same rollout (``bench/_reset_ab.py``).

Writes ``local_strategies*.{txt,json}`` and the TTFC CDFs to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from sandpool.bench import BenchConfig, run_bench

STRATEGIES = ("cold", "warm", "reuse")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8, help="tasks, spread over the pack's images")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--images", choices=("current", "oci"), default="current",
                    help="oci: also run on OCI images and compare")
    ap.add_argument("--reset-rounds", type=int, default=0,
                    help="also time the reset against its git-level baseline, N rounds per image")
    args = ap.parse_args()
    cfg = BenchConfig(strategies=STRATEGIES, tasks="default", limit=args.tasks, rollouts=args.rollouts,
                      concurrency=args.concurrency, out=args.out)
    current = await run_bench(cfg)
    text = current.render_text()
    current.write(args.out, "local_strategies")
    if args.images == "oci":
        from _oci_images import disk_per_image_current, side_by_side

        from sandpool.core.backends.local import LocalBackend
        from sandpool.core.images import ImageStore

        oci = await run_bench(cfg.model_copy(update={"tasks": "oci"}))
        oci.write(args.out, "local_strategies_oci")
        images = {t.image for t in await _tasks(cfg)}
        disk = disk_per_image_current(LocalBackend().images_root, images)
        text += "\n\n" + oci.render_text() + "\n\ncurrent images vs OCI images (same workload shape):\n"
        text += "\n".join(side_by_side(current.results, oci.results, disk, ImageStore(), cfg.limit))
    if args.reset_rounds > 0:
        from _reset_ab import compare, render

        per_image = list({t.image: t for t in reversed(await _tasks(cfg))}.values())
        text += (f"\n\nin-place reset vs its baseline: {args.reset_rounds} rounds x "
                 f"{len(per_image)} images\n" + render(await compare(per_image, args.reset_rounds)))
    print(text)
    (args.out / "local_strategies_study.txt").write_text(text + "\n")


async def _tasks(cfg: BenchConfig) -> list:
    from sandpool.bench.workload import load_bench_tasks

    return (await load_bench_tasks(cfg.tasks, cfg.limit)).tasks


if __name__ == "__main__":
    asyncio.run(main())
