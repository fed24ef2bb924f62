"""Benchmark: rollouts per sandbox and TTFC of the native vector env, with and without groups.

Runs ``--episodes`` episodes of the default task pack (28 images) through
``gym.make_vec("sandpool/SWE-v0", num_envs=N, group_size=G)`` with the scripted policy of
``examples/gymnasium_rollouts.py`` (gold patch on even sub-envs, none on odd ones), once
per ``--groups`` value, and prints each run's sandboxes created beside the issue's bound (one
per image, plus replacements: sandboxes quarantined or lost) and beside the floor of a group
running at once (G sandboxes for each image the rounds drew), with rollouts per sandbox, warm
hits, evictions and TTFC, and the machine's load average.

    .venv/bin/python bench/gym_groups.py --episodes 100 --num-envs 4 --groups 1,4
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import sandpool  # noqa: E402,F401 - registers sandpool/SWE-v0
from gymnasium_rollouts import policy  # noqa: E402
from sandpool.envs.taskpack import build_default_pack  # noqa: E402
from sandpool.envs.tasks import load_tasks  # noqa: E402


def run(tasks, episodes: int, num_envs: int, group_size: int, lookahead: bool):
    by_id = {t.instance_id: t for t in tasks}
    envs = gym.make_vec("sandpool/SWE-v0", num_envs=num_envs, tasks=tasks, max_steps=5,
                        group_size=group_size, lookahead=lookahead)
    try:
        _, info = envs.reset(seed=0)
        task = [by_id[t] for t in info["task_id"]]
        drawn = {t.image for t in task}
        step = [0] * num_envs
        ended = np.zeros(num_envs, dtype=bool)
        done = 0
        while done < episodes:
            acts = tuple("" if ended[i] else policy(i, step[i], task[i]) for i in range(num_envs))
            _, _, term, trunc, info = envs.step(acts)
            for i in range(num_envs):
                if ended[i]:
                    task[i], step[i] = by_id[info["task_id"][i]], 0
                    drawn.add(task[i].image)
                    continue
                step[i] += 1
                done += bool(term[i] or trunc[i])
            ended = term | trunc
        return envs.report(), len(drawn)
    finally:
        envs.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--num-envs", type=int, default=4)
    ap.add_argument("--groups", default="1,4")
    ap.add_argument("--no-lookahead", action="store_true")
    args = ap.parse_args()
    tasks = load_tasks(build_default_pack())
    rows = []
    for g in (int(x) for x in args.groups.split(",")):
        load0 = os.getloadavg()[0]
        r, drawn = run(tasks, args.episodes, args.num_envs, g, not args.no_lookahead)
        rows.append((g, r, drawn, load0, os.getloadavg()[0]))
        print(f"G={g}: {r.render_text()}", flush=True)
    print(f"\n{args.episodes} episodes, {len(tasks)} tasks ({len({t.image for t in tasks})} images), "
          f"{args.num_envs} sub-envs, lookahead {not args.no_lookahead}")
    images = len({t.image for t in tasks})
    print(f"{'G':>3} {'claims':>7} {'created':>8} {'images+repl':>12} {'G x drawn':>10} "
          f"{'per sandbox':>12} {'warm':>6} {'evicted':>8} {'TTFC p50 ms':>12} {'max ms':>8} {'load':>10}")
    for g, r, drawn, l0, l1 in rows:
        repl = r.pool.quarantines + r.pool.lost
        print(f"{g:>3} {r.pool.claims:>7} {r.sandboxes_created:>8} {images + repl:>12} {g * drawn:>10} "
              f"{r.reuse or 0:>12.2f} {r.pool.warm_hits:>6} {r.pool.evicted:>8} "
              f"{r.ttfc.p50_s * 1000:>12.1f} {r.ttfc.max_s * 1000:>8.0f} {l0:>4.0f}->{l1:.0f}")


if __name__ == "__main__":
    main()
