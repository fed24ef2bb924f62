"""Whether a task's tests run at all: decided on pristine sandboxes, once per task.

A graded run in which none of the task's tests ran (``GradeResult.ran == 0``: the test
command could not start, the runner could not import pytest, pytest collected none of them)
does not say, by itself, whose fault that is. A policy's patch can break collection, or its
code exit before any test, on purpose; the base's own bug can stop collection on the pristine
tree (a conftest that imports the broken module) while the gold patch lets them run; and the
image itself may be unable to run them at all (no ``python`` command, no pytest, a runner
script it lacks). So the evidence is taken where the policy has no hand: the task graded
with no patch on a pristine sandbox, then with its gold patch on another.

* Either run ran at least one of the task's tests: the task is sound, and the policy's run
  stands as graded (0: never a reward, and never a rejection the policy could earn).
* Neither did: the task, or its image, is broken. :class:`~sandpool.core.errors.BrokenTaskError`
  with :func:`cannot_run`'s reason: every rollout of the task is ``rejected``, never scored.
* A pristine run that did not finish (timed out, its log over the cap) is no evidence of a
  broken task: the policy's run stands.

:class:`RunnableCheck` keeps each task's answer for the life of its grader (a task is checked
once however many rollouts reach it), keyed by the task's row, so a changed row is checked
again. Validation (:mod:`~sandpool.envs.grading.validate`) reads the same evidence from its
gold and empty runs and gives the same reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence

from sandpool.core import errors
from sandpool.core.task import Task
from sandpool.envs.grading.diff import grade_patch
from sandpool.envs.grading.verdict import GradeResult

__all__ = ["GOLD", "PRISTINE", "RunnableCheck", "cannot_run"]


def _why(result: GradeResult) -> str:
    if result.not_run:
        return result.not_run
    tail = [ln.strip() for ln in result.log.splitlines() if ln.strip(" =-_\t")][-2:]  # no rules
    return f"exit {result.exit_code}: {' | '.join(tail)[-300:] or 'no output'}"


#: How a reason names the two pristine runs: no patch, and the gold patch.
PRISTINE, GOLD = "on the pristine repo", "with the gold patch"


def cannot_run(task: Task, runs: Sequence[tuple[str, GradeResult]]) -> str:
    """The reason a task is broken when none of its tests ran in any of ``runs``: each run's
    label (:data:`PRISTINE`, :data:`GOLD`) with why it ran none."""
    labels = [label for label, _ in runs]
    whys = [_why(r) for _, r in runs]
    if len(set(whys)) == 1:
        what = f"{' and '.join(labels)}: {whys[0]}"
    else:
        what = "; ".join(f"{label}: {why}" for label, why in zip(labels, whys, strict=True))
    return (f"task {task.instance_id}: none of its tests ran {' or '.join(labels)}, so no patch can "
            f"be graded: the task or its image {task.image} cannot run its tests ({what})")


class RunnableCheck:
    """Each task's tests, checked once on pristine sandboxes (see the module docstring).

    Args:
        timeout: Seconds each pristine test run may take.
    """

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._known: dict[str, str | None] = {}  # task key -> why it is broken, None: sound
        self._locks: dict[tuple[int, str], asyncio.Lock] = {}

    def __repr__(self) -> str:
        broken = sum(v is not None for v in self._known.values())
        return f"<RunnableCheck {len(self._known)} tasks checked, {broken} broken>"

    async def ensure(self, lease, task: Task, *, pristine: GradeResult | None = None) -> None:
        """Return when ``task``'s tests run on its image; raise when they cannot.

        Args:
            lease: A pool lease of the task's image (its ``reset()`` gives a verified pristine
                sandbox); what it holds now is not looked at.
            task: The task.
            pristine: The task graded already with no patch on a pristine sandbox, if it
                was: it stands for the pristine run.

        Raises:
            BrokenTaskError: Neither the pristine repo nor the gold patch runs any of the
                task's tests (or the image has no Python).
            InfraError: A sandbox failed (nothing is kept: the next call checks again).
        """
        row = json.dumps(task.model_dump(mode="json", warnings=False), sort_keys=True)
        key = hashlib.sha256(row.encode()).hexdigest()
        lock = self._locks.setdefault((id(asyncio.get_running_loop()), key), asyncio.Lock())
        async with lock:
            if key not in self._known:
                self._known[key] = await self._check(lease, task, pristine)
        if self._known[key] is not None:
            raise errors.BrokenTaskError(self._known[key], task_id=task.instance_id)

    async def _check(self, lease, task: Task, pristine: GradeResult | None) -> str | None:
        runs: list[tuple[str, GradeResult]] = []
        for label, patch in ((PRISTINE, ""), (GOLD, task.patch)):
            if label == GOLD and not task.patch.strip():
                continue
            if label == PRISTINE and pristine is not None:
                result = pristine
            else:
                await lease.reset()
                try:
                    result = await grade_patch(lease, task, patch, timeout=self.timeout)
                except errors.BrokenTaskError as exc:  # found before any patch: the image's own
                    return str(exc)
            if result.ran != 0:  # some ran, or the run did not finish: no evidence of a broken task
                return None
            runs.append((label, result))
        return cannot_run(task, runs)
