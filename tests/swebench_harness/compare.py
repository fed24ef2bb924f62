"""Grade the same patches with the SWE-bench harness itself and with sandpool; tabulate both verdicts.

The harness: ``swebench.harness.run_evaluation`` run as its command line (swebench 4.1.0: its
eval script, log parser and grading) on a dataset file made from the task rows, one row per
(task, case) with the image in the Docker daemon under the name swebench expects
(``swebench/sweb.eval.x86_64.<id>:latest``), against a predictions file of the cases' patches.
One thing is cut: making a test spec also writes the setup script of the environment image
(unused with prebuilt images), and for repos whose spec installs ``requirements.txt`` (Django)
that fetches the file from GitHub, which this machine cannot reach; that fetch returns an empty
file. Nothing the evaluation runs or reads comes from it.

sandpool: :func:`sandpool.envs.grading.diff.grade_patch` of the same patch, on a fresh sandbox
of the same OCI image (pristine at ``base_commit``), on the local backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sandpool.core.task import Task
from sandpool.envs.grading.verdict import GradeResult

HONEST = ("gold", "empty", "wrong", "mutant-1", "mutant-2", "mutant-3")
_RUN_EVALUATION = """
import runpy
import swebench.harness.test_spec.python as spec
spec.get_requirements_by_commit = lambda repo, commit: ""  # the env image's script only
runpy.run_module("swebench.harness.run_evaluation", run_name="__main__", alter_sys=True)
"""


@dataclass
class Verdict:
    """Both graders' verdicts on one (task, case)."""

    task: str
    case: str
    harness: str  # resolved, unresolved, empty patch (not run), error
    sandpool: GradeResult

    @property
    def harness_resolved(self) -> bool:
        return self.harness == "resolved"

    @property
    def agree(self) -> bool:
        return self.harness_resolved == self.sandpool.resolved

    def why(self) -> str:
        """sandpool's reason for a 0, in one line."""
        s = self.sandpool
        parts = [*s.tampering, *s.refused] or ([s.error] if s.error else [])
        if not parts and not s.resolved:
            failed = [*s.failed_f2p, *s.failed_p2p]
            parts = [f"failed: {', '.join(failed[:2])}{' ...' if len(failed) > 2 else ''}"] if failed else []
        return "; ".join(parts)[:150]


def swebench_id(instance_id: str, case: str) -> str:
    return f"{instance_id}-{case}"


def swebench_image(instance_id: str) -> str:
    """The image name swebench 4.1.0 runs an instance in (namespace ``swebench``, tag ``latest``)."""
    return f"swebench/sweb.eval.x86_64.{instance_id.lower()}:latest".replace("__", "_1776_")


def load_into_daemon(daemon, layout: Path, tag: str, task: dict, cases: list[str]) -> None:
    """The image in the daemon once, named as swebench asks for each (task, case)."""
    names = [swebench_image(swebench_id(task["instance_id"], case)) for case in cases]
    daemon.load(f"oci:{layout}:{tag}", names[0])
    daemon.tag(names[0], *names[1:])


def run_harness(daemon, rows: list[dict], patches: dict[str, str], work: Path, *,
                workers: int = 2, timeout: int = 900) -> dict[str, str]:
    """Run swebench's run_evaluation on ``rows`` with ``patches`` (instance id -> patch).

    Returns:
        instance id -> ``resolved``, ``unresolved``, ``empty patch (not run)`` or ``error``.
    """
    work.mkdir(parents=True, exist_ok=True)
    (work / "dataset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preds = [{"instance_id": i, "model_name_or_path": "cmp", "model_patch": p} for i, p in patches.items()]
    (work / "preds.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    run_id = f"cmp{os.getpid()}"
    res = subprocess.run(
        [sys.executable, "-c", _RUN_EVALUATION, "--dataset_name", "dataset.jsonl",
         "--predictions_path", "preds.jsonl", "--max_workers", str(workers), "--run_id", run_id,
         "--namespace", "swebench", "--cache_level", "instance", "--timeout", str(timeout)],
        cwd=work, env={**os.environ, **daemon.env}, capture_output=True, text=True)
    (work / "run_evaluation.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"run_evaluation exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}")
    report = json.loads((work / f"cmp.{run_id}.json").read_text())
    out = {i: "error" for i in patches}
    for key, verdict in (("resolved_ids", "resolved"), ("unresolved_ids", "unresolved"),
                         ("empty_patch_ids", "empty patch (not run)"), ("error_ids", "error")):
        for i in report.get(key, []):
            out[i] = verdict
    return out


async def run_sandpool(store, cases: list[tuple[Task, str, str]], *, concurrency: int = 2,
                       timeout: float = 900.0) -> list[GradeResult]:
    """``grade_patch`` each ``(task, case, patch)`` on a fresh sandbox of the task's image."""
    from sandpool.core.backends.local import LocalBackend
    from sandpool.envs.grading.diff import grade_patch

    backend = LocalBackend(store=store)
    await backend.preflight()
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task, patch: str) -> GradeResult:
        async with gate:
            sb = await backend.create(task.image)
            try:
                return await grade_patch(sb, task, patch, timeout=timeout)
            finally:
                await backend.delete(sb)

    try:
        return list(await asyncio.gather(*(one(t, p) for t, _, p in cases)))
    finally:
        await backend.aclose()


def table(verdicts: list[Verdict]) -> str:
    """The verdict table: task, case, the harness's verdict, sandpool's, agreement, and why."""
    head = f"{'task':<36} {'patch':<9} {'swebench harness':<22} {'sandpool':<16} {'agree':<6} sandpool says"
    lines = [head, "-" * len(head)]
    for v in verdicts:
        sp = "resolved (1.0)" if v.sandpool.resolved else "unresolved (0)"
        lines.append(f"{v.task:<36} {v.case:<9} {v.harness:<22} {sp:<16} {'yes' if v.agree else 'NO':<6} {v.why()}")
    if any(not v.agree and v.case not in HONEST and v.harness_resolved for v in verdicts):
        lines.append("NO on a cheat: the harness's log parser took the printed lines as passes; sandpool "
                     "scored 0, for the reason given")
    return "\n".join(lines)
