"""The in-place reset next to its baseline, on the same sandboxes in one run.

Baseline: the git-level reset sandpool had before the repo was verified against the image
(``git reset --hard``, ``git clean -ffdx``, ``git checkout``, empty ``/tmp``; check ``git
status``, ``HEAD``, ``/tmp`` and processes). It is fast and does not make ``.git`` pristine
(a stash, branches, hooks and config survive it); it is here only to price the verified
reset. Rounds alternate the two on one sandbox per image after the same rollout (the task's
gold patch, then its test files under pytest), so machine load hits both alike.
"""

from __future__ import annotations

import shlex
import time

from sandpool.core.backends.local import LocalBackend
from sandpool.core.reset import SAFE_GIT, record_pristine, reset_in_place

_SEP = "@@baseline@@"


async def git_level_reset(sandbox, commit: str) -> list[str]:
    """The baseline reset; returns the problems its own check found."""
    await sandbox.kill_strays()
    c = shlex.quote(commit)
    res = await sandbox.exec(f"{SAFE_GIT} reset -q --hard && {SAFE_GIT} clean -q -ffdx && "
                             f"{SAFE_GIT} checkout -q -f --detach {c} && find /tmp -mindepth 1 -delete",
                             timeout=60)
    if not res.ok:
        return [f"reset failed: {res.err_text[:200]}"]
    res = await sandbox.exec(f"{SAFE_GIT} rev-parse HEAD; echo {_SEP}; {SAFE_GIT} status --porcelain "
                             f"--ignored --untracked-files=all; echo {_SEP}; ls -A /tmp", timeout=60)
    head, status, tmp = (res.text.split(_SEP + "\n") + ["", ""])[:3]
    problems = [] if head.split() == [commit] else [f"HEAD {head.split()}"]
    problems += [f"status {status.split()[:3]}"] if status.strip() else []
    problems += [f"/tmp {tmp.split()[:3]}"] if tmp.strip() else []
    problems += [f"processes {p}" for p in await sandbox.processes()]
    return problems


async def _rollout(sandbox, task) -> None:
    if task.patch:
        await sandbox.write_file("/tmp/gold.diff", task.patch.encode())
        await sandbox.exec(f"{SAFE_GIT} apply /tmp/gold.diff", timeout=60)
    files = " ".join(shlex.quote(t.split("::")[0]) for t in task.FAIL_TO_PASS + task.PASS_TO_PASS)
    await sandbox.exec(f"python -m pytest -q -x -p no:randomly {files} >/dev/null 2>&1; true",
                       timeout=300)


async def compare(tasks, rounds: int) -> dict[str, list[float]]:
    """Time ``rounds`` x len(tasks) resets of each kind; returns seconds per kind."""
    times: dict[str, list[float]] = {"git-level (baseline)": [], "verified (sandpool)": []}
    backend = LocalBackend()
    try:
        for task in tasks:
            sb = await backend.create(task.image)
            await record_pristine(sb, refresh_index=True)
            for _ in range(rounds):
                for kind in times:
                    await _rollout(sb, task)
                    t0 = time.perf_counter()
                    if kind.startswith("git"):
                        problems = await git_level_reset(sb, task.base_commit)
                    else:
                        problems = list((await reset_in_place(sb, task.base_commit)).problems)
                    times[kind].append(time.perf_counter() - t0)
                    if problems:
                        raise RuntimeError(f"{kind} reset of {task.image} failed: {problems}")
                    # Leave the sandbox pristine for the next kind, outside the timing.
                    assert not (await reset_in_place(sb, task.base_commit)).problems
            await backend.delete(sb)
    finally:
        await backend.aclose()
    return times


def render(times: dict[str, list[float]]) -> str:
    """Mean and max per kind, in milliseconds, and the ratio of the means."""
    lines = [f"{'in-place reset':<22}{'mean (ms)':>12}{'max (ms)':>12}{'n':>6}"]
    means = {}
    for kind, xs in times.items():
        means[kind] = sum(xs) / len(xs)
        lines.append(f"{kind:<22}{means[kind] * 1000:>12.1f}{max(xs) * 1000:>12.1f}{len(xs):>6}")
    base, ours = means.values()
    lines.append(f"verified / baseline mean: {ours / base:.2f}x")
    return "\n".join(lines)
