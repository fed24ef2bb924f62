"""``sandpool validate``: prove each task gradable before rollouts are spent on it.

Every task gets two rollouts through the same runner and grader a real run uses: the gold
patch (oracle policy) and the empty patch (noop policy). A task passes when gold resolves it
and empty does not. It is broken when gold does not resolve it, when the empty patch does
(SWE-bench issue 586: tasks whose FAIL_TO_PASS already pass at base), or when grading
rejects it (a test patch that does not apply to base, no test command, ...). A task whose
gold or empty verdict fails is run once more: when the second run passes the task is still
broken, as ``flaky`` (its reward would be noise), with both runs in the reason. Rollouts that
ended on infrastructure say nothing about the task: it is reported as not validated and left
out of the passing list, never called broken.

Usage::

    result = await validate_tasks(tasks, LocalBackend)
    result.passing, result.broken, result.write(out_dir)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sandpool.core.base import Backend
from sandpool.core.metrics import Outcome, RejectedTask, RolloutResult
from sandpool.core.task import Task

__all__ = ["VALIDATION_VERSION", "TaskVerdict", "ValidationResult", "validate_tasks"]

#: Bump when grading changes what a verdict means; cached validations are keyed by it.
VALIDATION_VERSION = 1


@dataclass(frozen=True)
class TaskVerdict:
    """One task's validation.

    Attributes:
        task_id: The task's ``instance_id``.
        status: ``pass``, ``broken`` or ``not_validated`` (infra failed).
        gold: The gold rollout's reward (``None`` when it was not scored).
        empty: The empty rollout's reward (``None`` when it was not scored).
        reason: Why the task is broken or not validated ("" when it passes).
    """

    task_id: str
    status: str
    gold: float | None
    empty: float | None
    reason: str = ""


@dataclass
class ValidationResult:
    """Every task's verdict, and the rows that passed.

    Attributes:
        verdicts: One :class:`TaskVerdict` per task (and per rejected row), in task order.
        passing: The tasks that passed, in task order.
        rows: Rows rejected before any rollout (malformed), carried through.
    """

    verdicts: list[TaskVerdict] = field(default_factory=list)
    passing: list[Task] = field(default_factory=list)
    rows: list[RejectedTask] = field(default_factory=list)

    @property
    def broken(self) -> list[TaskVerdict]:
        """The verdicts of broken tasks."""
        return [v for v in self.verdicts if v.status == "broken"]

    def render_text(self) -> str:
        """A table of every task, then the counts."""
        lines = [f"{'task':<40} {'gold':>5} {'empty':>5}  verdict"]
        for v in self.verdicts:
            show = lambda r: "-" if r is None else f"{r:.0f}"  # noqa: E731
            lines.append(f"{v.task_id:<40} {show(v.gold):>5} {show(v.empty):>5}  {v.status}"
                         + (f": {v.reason}" if v.reason else ""))
        n = {s: sum(v.status == s for v in self.verdicts) for s in ("pass", "broken", "not_validated")}
        lines.append(f"{len(self.verdicts)} tasks: {n['pass']} pass, {n['broken']} broken, "
                     f"{n['not_validated']} not validated (infra)")
        return "\n".join(lines)

    def write(self, tasks_out: Path, report_out: Path) -> None:
        """Write the passing tasks (JSONL, for ``sandpool run --tasks``) and the verdicts (JSON)."""
        tasks_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = tasks_out.with_suffix(".tmp")
        tmp.write_text("".join(t.model_dump_json() + "\n" for t in self.passing))
        tmp.replace(tasks_out)
        report_out.write_text(json.dumps({
            "version": VALIDATION_VERSION,
            "verdicts": [v.__dict__ for v in self.verdicts],
            "rejected_rows": [r.model_dump() for r in self.rows],
        }, indent=2))


def _verdict(task_id: str, gold: RolloutResult | None, empty: RolloutResult | None) -> TaskVerdict:
    rs = [r for r in (gold, empty) if r is not None]
    g = gold.reward if gold is not None and gold.outcome is not Outcome.INFRA_FAILED else None
    e = empty.reward if empty is not None and empty.outcome is not Outcome.INFRA_FAILED else None
    rejected = next((r for r in rs if r.outcome is Outcome.REJECTED), None)
    if rejected is not None:
        return TaskVerdict(task_id, "broken", None, None, rejected.error or "rejected")
    infra = next((r for r in rs if r.outcome is Outcome.INFRA_FAILED), None)
    if infra is not None or gold is None or empty is None:
        why = infra.error if infra is not None else "a rollout did not run"
        return TaskVerdict(task_id, "not_validated", g, e, f"infra: {why}")
    reasons = []
    if e != 0.0:
        reasons.append("the empty patch resolves it (FAIL_TO_PASS already pass at base)")
    if g != 1.0:
        reasons.append("the gold patch does not resolve it" + (f" ({gold.error})" if gold.error else ""))
    return TaskVerdict(task_id, "broken" if reasons else "pass", g, e, "; ".join(reasons))


async def validate_tasks(tasks: Sequence[Task], backend: Callable[[], Backend], *, concurrency: int = 4,
                         grade_timeout: float = 300.0, retries: int = 2,
                         rejected: list[RejectedTask] | None = None,
                         on_result: Callable[[RolloutResult], None] | None = None) -> ValidationResult:
    """Run the gold and the empty patch on every task and sort the tasks (see the module docstring).

    Args:
        tasks: The tasks.
        backend: Makes the backend sandboxes run on (called once per round; each is closed
            at the end of its round), e.g. ``LocalBackend``.
        concurrency: Rollouts at once.
        grade_timeout: Seconds for each grading test run.
        retries: Infra retries per rollout.
        rejected: Rows rejected before validation (malformed), reported as broken.
        on_result: Called with each rollout's result as it lands (progress).

    Returns:
        The :class:`ValidationResult`.

    Raises:
        BackendUnavailable: The backend cannot run here.
    """
    from sandpool.envs.policies import NoopPolicy, OraclePolicy
    from sandpool.envs.runner import run_batch

    rows = list(rejected or [])
    first = await _round(tasks, backend(), run_batch, OraclePolicy, NoopPolicy, concurrency=concurrency,
                         retries=retries, grade_timeout=grade_timeout, on_result=on_result)
    again_ids = {t for t, v in first.items() if v.status == "broken" and v.gold is not None}
    again = [t for t in tasks if t.instance_id in again_ids]
    second = await _round(again, backend(), run_batch, OraclePolicy, NoopPolicy, concurrency=concurrency,
                          retries=retries, grade_timeout=grade_timeout) if again else {}
    out = ValidationResult(rows=rows)
    for r in rows:
        out.verdicts.append(TaskVerdict(r.task_id or f"<row {r.row}>", "broken", None, None, r.reason))
    for task in tasks:
        v = first[task.instance_id]
        w = second.get(task.instance_id)
        if w is not None and w.status == "pass":
            v = TaskVerdict(v.task_id, "broken", v.gold, v.empty,
                            f"flaky: run 1 {v.reason}; run 2 gold {w.gold:.0f}, empty {w.empty:.0f}")
        if v.status != "broken" or not any(x.task_id == v.task_id for x in out.verdicts):
            out.verdicts.append(v)
        if v.status == "pass":
            out.passing.append(task)
    return out


async def _round(tasks, backend, run_batch, oracle, noop, *, concurrency: int, retries: int,
                 grade_timeout: float, on_result=None) -> dict[str, TaskVerdict]:
    report = await run_batch(tasks, [oracle(), noop()], backend, rollouts_per_task=2,
                             concurrency=concurrency, strategy="reuse", retries=retries,
                             grade_timeout=grade_timeout, on_result=on_result)
    by: dict[tuple[str, int], RolloutResult] = {(r.task_id, r.rollout): r for r in report.rollouts}
    return {t.instance_id: _verdict(t.instance_id, by.get((t.instance_id, 0)), by.get((t.instance_id, 1)))
            for t in tasks}
