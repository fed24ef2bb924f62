"""Validation: prove each task gradable before rollouts are spent on it.

Each task's gold patch and the empty patch are graded exactly as a rollout's patch is
(:func:`~sandpool.envs.grading.diff.grade_patch`: the patch policy, a pristine sandbox, the
isolated test run). A task passes when gold resolves it and empty does not. It is broken when
the patch policy refuses its gold patch (so no honest fix is ever refused), when gold does
not resolve it, when the empty patch does (SWE-bench issue 586: tasks whose FAIL_TO_PASS
already pass at base), or when grading finds the task itself broken (a test patch that does
not apply to base, an image without Python). When none of the task's tests ran either with
the gold patch or with the empty one (the test command could not start on the image, or
collected none of them), the reason says so, as the diff grader's check of a rollout does
(:func:`~sandpool.envs.grading.runnable.cannot_run`). Otherwise the reason names which
FAIL_TO_PASS / PASS_TO_PASS tests failed or were absent from the log, and why a test can be
absent. A task whose verdict is broken is graded once more: when that passes, the task is
still broken, as ``flaky``. Infra failures say nothing about the task: it is reported as not
validated, never called broken.

:class:`ValidationCache` keeps verdicts per (task, image digest, :data:`VALIDATION_VERSION`)
under ``sandpool_home()``, so ``sandpool run`` validates each task once (:func:`validated`).

Usage::

    result = await validate_tasks(tasks, LocalBackend)
    result.passing, result.broken, result.write(tasks_out, report_out)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandpool.core import errors
from sandpool.core.base import Backend
from sandpool.core.metrics import RejectedTask
from sandpool.core.paths import sandpool_home
from sandpool.core.pool import PoolLimits, SandboxPool
from sandpool.core.strategies import get_strategy
from sandpool.core.task import Task
from sandpool.envs.grading.diff import grade_patch
from sandpool.envs.grading.harness import plan_for
from sandpool.envs.grading.runnable import GOLD, PRISTINE, cannot_run
from sandpool.envs.grading.verdict import GradeResult

__all__ = ["VALIDATION_VERSION", "TaskVerdict", "ValidationCache", "ValidationResult", "explain",
           "validate_tasks", "validated"]

#: Bump when grading changes what a verdict means; cached validations are keyed by it.
VALIDATION_VERSION = 5
_SHOWN = 5  # test ids named per list in a reason


@dataclass(frozen=True)
class TaskVerdict:
    """One task's validation.

    Attributes:
        task_id: The task's ``instance_id``.
        status: ``pass``, ``broken`` or ``not_validated`` (infra failed).
        gold: The gold patch's reward (``None`` when it was not scored).
        empty: The empty patch's reward (``None`` when it was not scored).
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
        rows: Rows rejected before any grading (malformed), carried through.
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
            "verdicts": [asdict(v) for v in self.verdicts],
            "rejected_rows": [r.model_dump() for r in self.rows],
        }, indent=2))


def _ids(ids: Sequence[str]) -> str:
    more = f" (+{len(ids) - _SHOWN} more)" if len(ids) > _SHOWN else ""
    return ", ".join(ids[:_SHOWN]) + more


def explain(task: Task, result: GradeResult) -> str:
    """Why ``result`` does not resolve ``task``: which listed tests failed, which were absent
    from the log and why a test can be absent, or what stopped grading (one line)."""
    if result.refused:
        return "the patch policy refuses it: " + "; ".join(result.refused)
    if result.error:
        return result.error
    if result.not_run:
        return result.not_run
    if result.tampering:
        return "grading found a forged pass: " + "; ".join(result.tampering)
    if result.timed_out:
        return "the tests timed out"
    parts = []
    absent = set(result.absent)
    for kind, failed in (("FAIL_TO_PASS", result.failed_f2p), ("PASS_TO_PASS", result.failed_p2p)):
        ran = [t for t in failed if t not in absent]
        if ran:
            parts.append(f"{kind} failed: {_ids(ran)}")
    if absent:
        try:
            run = {p.lstrip("./") for p in shlex.split(plan_for(task).command)}
        except (ValueError, errors.BrokenTaskError):
            run = set()
        unrun = [t for t in result.absent if "::" in t and t.split("::", 1)[0] not in run]
        missing = [t for t in result.absent if t not in unrun]
        if unrun:
            parts.append(f"absent from the log, never run: {_ids(unrun)} (their files are not among the "
                         "harness's test directives, the files the test patch touches)")
        if missing:
            parts.append(f"absent from the log: {_ids(missing)} (not collected from the files that ran: "
                         "renamed, removed, or their module failed to import)")
        if len(absent) == len(task.FAIL_TO_PASS) + len(task.PASS_TO_PASS):
            tail = [ln.strip() for ln in result.log.strip().splitlines() if ln.strip()][-2:]
            parts.append(f"no listed test ran (exit {result.exit_code}): {' | '.join(tail)[-300:]}")
    reset = [n[len("reset "):] for n in result.neutralised if n.startswith("reset ")]
    if reset:
        parts.append(f"its changes to test files were reset as the harness resets them: {_ids(reset)}")
    return "; ".join(parts) or "not resolved"


async def _grade(pool: SandboxPool, task: Task, patch: str, *, timeout: float, retries: int) -> GradeResult:
    """``patch`` graded on a pristine sandbox of the pool, retrying infra failures."""
    last: errors.InfraError | None = None
    for _ in range(retries + 1):
        try:
            async with pool.claim(task) as lease:
                return await grade_patch(lease, task, patch, timeout=timeout)
        except errors.InfraError as exc:
            last = exc
    assert last is not None
    raise last


async def _verdict(pool: SandboxPool, task: Task, *, timeout: float, retries: int) -> TaskVerdict:
    tid = task.instance_id
    try:
        gold = await _grade(pool, task, task.patch, timeout=timeout, retries=retries)
        empty = await _grade(pool, task, "", timeout=timeout, retries=retries)
    except errors.InfraError as exc:
        return TaskVerdict(tid, "not_validated", None, None, f"infra: {exc}")
    except errors.InputError as exc:  # a broken task, a missing image, a base commit not in it
        return TaskVerdict(tid, "broken", None, None, str(exc))
    if gold.ran == 0 and empty.ran == 0:
        return TaskVerdict(tid, "broken", gold.reward, empty.reward,
                           cannot_run(task, [(PRISTINE, empty), (GOLD, gold)]))
    reasons = []
    if empty.reward != 0.0:
        reasons.append("the empty patch resolves it (FAIL_TO_PASS already pass at base)")
    if gold.reward != 1.0:
        reasons.append(f"the gold patch does not resolve it: {explain(task, gold)}")
    return TaskVerdict(tid, "broken" if reasons else "pass", gold.reward, empty.reward, "; ".join(reasons))


async def validate_tasks(tasks: Sequence[Task], backend: Callable[[], Backend], *, concurrency: int = 4,
                         grade_timeout: float = 300.0, retries: int = 2,
                         rejected: list[RejectedTask] | None = None,
                         on_result: Callable[[TaskVerdict], None] | None = None,
                         cache: ValidationCache | None = None) -> ValidationResult:
    """Grade the gold and the empty patch of every task and sort the tasks (module docstring).

    Args:
        tasks: The tasks.
        backend: Makes the backend the sandboxes run on (called once; closed at the end),
            e.g. ``LocalBackend``.
        concurrency: Tasks validated at once.
        grade_timeout: Seconds for each grading test run.
        retries: Infra retries per grading.
        rejected: Rows rejected before validation (malformed), reported as broken.
        on_result: Called with each task's verdict as it lands (progress).
        cache: Where every pass and broken verdict is stored (never read here).

    Returns:
        The :class:`ValidationResult`.

    Raises:
        BackendUnavailable: The backend cannot run here.
    """
    out = ValidationResult(rows=list(rejected or []))
    for r in out.rows:
        out.verdicts.append(TaskVerdict(r.task_id or f"<row {r.row}>", "broken", None, None, r.reason))
    if not tasks:
        return out
    gate = asyncio.Semaphore(concurrency)
    b = backend()
    async with SandboxPool(b, get_strategy("reuse"), PoolLimits()) as pool:
        async def one(task: Task) -> TaskVerdict:
            async with gate:
                v = await _verdict(pool, task, timeout=grade_timeout, retries=retries)
                if v.status == "broken" and v.gold is not None:  # once more: broken, or flaky?
                    w = await _verdict(pool, task, timeout=grade_timeout, retries=retries)
                    if w.status == "pass":
                        v = TaskVerdict(v.task_id, "broken", v.gold, v.empty,
                                        f"flaky: run 1 {v.reason}; run 2 gold {w.gold:.0f}, empty {w.empty:.0f}")
            if cache is not None and v.status != "not_validated":
                cache.put(task, _image_digest(b, task.image), v)
            if on_result is not None:
                on_result(v)
            return v

        verdicts = await asyncio.gather(*(one(t) for t in tasks))
    for task, v in zip(tasks, verdicts, strict=True):
        out.verdicts.append(v)
        if v.status == "pass":
            out.passing.append(task)
    return out


def _image_digest(backend: Backend, image: str) -> str:
    """What identifies the image's content: an OCI image's manifest digest, an image
    directory's ``image.json`` and repo HEAD; the name alone when the backend cannot say."""
    load = getattr(backend, "image", None)
    try:
        img = load(image) if load is not None else None
    except errors.SandpoolError:
        return image
    if img is None:
        return image
    digest = getattr(img, "digest", None)
    return digest or hashlib.sha256(img.model_dump_json().encode()).hexdigest()


class ValidationCache:
    """Validation verdicts on disk, one file per (task row, image digest, version).

    Args:
        root: The directory (default ``sandpool_home()/validation``).
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else sandpool_home() / "validation"

    def _path(self, task: Task, digest: str) -> Path:
        row = task.model_dump(mode="json", warnings=False)
        key = hashlib.sha256(json.dumps([VALIDATION_VERSION, digest, row], sort_keys=True).encode()).hexdigest()
        return self.root / f"v{VALIDATION_VERSION}" / f"{key}.json"

    def get(self, task: Task, digest: str) -> TaskVerdict | None:
        """The stored verdict of ``task`` on the image with ``digest``, if any."""
        try:
            return TaskVerdict(**json.loads(self._path(task, digest).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def put(self, task: Task, digest: str, verdict: TaskVerdict) -> None:
        """Store ``verdict`` (atomically)."""
        path = self._path(task, digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(verdict)))
        tmp.replace(path)


async def validated(tasks: Sequence[Task], backend: Callable[[], Backend], *,
                    cache: ValidationCache | None = None, concurrency: int = 4,
                    grade_timeout: float = 300.0,
                    on_start: Callable[[int], None] | None = None,
                    on_result: Callable[[TaskVerdict], None] | None = None,
                    ) -> tuple[list[Task], list[RejectedTask], list[TaskVerdict]]:
    """Validate the tasks not validated before on their image (cached), for ``sandpool run``.

    Args:
        tasks: The tasks about to run.
        backend: Makes a backend (called once for the image digests, once more to validate
            the tasks not in the cache).
        cache: The verdict cache (default: under ``sandpool_home()``).
        concurrency: Tasks validated at once.
        grade_timeout: Seconds for each grading test run.
        on_start: Called with how many tasks are to be validated now (progress).
        on_result: Called with each new verdict (progress).

    Returns:
        ``(runnable, rejected, new)``: the tasks to run (passing, or not validated because
        infra failed: their own grading still finds a broken task), a rejected row for each
        broken task with the reason, and the verdicts validated now (not from the cache).
    """
    cache = cache or ValidationCache()
    probe = backend()
    try:
        digests = {t.image: _image_digest(probe, t.image) for t in tasks}
    finally:
        await probe.aclose()
    known = {t.instance_id: cache.get(t, digests[t.image]) for t in tasks}
    todo = [t for t in tasks if known[t.instance_id] is None]
    if on_start is not None:
        on_start(len(todo))
    new: list[TaskVerdict] = []
    if todo:
        result = await validate_tasks(todo, backend, concurrency=concurrency, grade_timeout=grade_timeout,
                                      on_result=on_result, cache=cache)
        new = result.verdicts
        known.update({v.task_id: v for v in new})
    runnable, rejected = [], []
    for t in tasks:
        v = known[t.instance_id]
        if v is not None and v.status == "broken":
            rejected.append(RejectedTask(task_id=t.instance_id, reason=f"validation: {v.reason}"))
        else:
            runnable.append(t)
    return runnable, rejected, new
