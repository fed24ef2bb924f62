"""The rollout accountant's grader: the policy's diff, graded by construction.

:class:`DiffGrader` implements :class:`sandpool.core.rollout.Grader`. The accountant calls
:meth:`DiffGrader.capture` on the policy's sandbox at the end of the episode, then
``lease.reset()`` (a verified in-place reset, or a fresh sandbox under the same lease), then
:meth:`DiffGrader.score` on that pristine sandbox. What happens in each step is in
:mod:`~sandpool.envs.grading.capture`, :mod:`~sandpool.envs.grading.policy` and
:mod:`~sandpool.envs.grading.diff`. A run in which none of the task's tests ran is checked
against pristine runs of the task (:mod:`~sandpool.envs.grading.runnable`, once per task):
the task is rejected when they run none either, and the run scored 0 when they do.

Usage::

    grader = DiffGrader(timeout=300)
    patch = await grader.capture(lease, task)
    await lease.reset()
    score = await grader.score(lease, task, patch)
"""

from __future__ import annotations

from sandpool.core import errors
from sandpool.core.outcome import Score
from sandpool.core.pool import Lease
from sandpool.core.task import Task
from sandpool.envs.grading.capture import capture_patch
from sandpool.envs.grading.diff import grade_patch
from sandpool.envs.grading.policy import MAX_PATCH_BYTES
from sandpool.envs.grading.runnable import RunnableCheck
from sandpool.envs.grading.verdict import GradeResult

__all__ = ["DiffGrader", "score_of"]


def score_of(result: GradeResult) -> Score:
    """The :class:`~sandpool.core.outcome.Score` of a grade.

    A patch the policy refuses (kind ``patch_policy``), suspected tampering (kind
    ``tampering_suspected``) and a patch that broke its own grading (kind ``grading``: it does
    not apply, its code wrote a log or report over the cap, pytest could not start with it
    on a sound image) are the submission's failure: ``task_failed``, reward 0, the reason
    kept. A test run that timed out, tests that fail, or none of the task's tests collected
    (on a sound task), are a plain 0.
    """
    if result.refused:
        return Score(0.0, failure="patch refused: " + "; ".join(result.refused),
                     kind=errors.PatchRefused.kind, detail=result)
    if result.tampering:
        return Score(0.0, failure="suspected tampering: " + "; ".join(result.tampering),
                     kind=errors.TamperingSuspected.kind, detail=result)
    if result.error:
        return Score(0.0, failure=f"grading: {result.error}", kind="grading", detail=result)
    if result.not_run:
        return Score(0.0, failure=f"grading: the tests could not start with the patch applied: "
                                  f"{result.not_run}", kind="grading", detail=result)
    return Score(float(result.reward), detail=result)


class DiffGrader:
    """Grades the policy's change to the repo as a patch, in a pristine sandbox.

    Attributes:
        runnable: Which tasks' tests run at all, checked once per task on pristine sandboxes.

    Args:
        timeout: Seconds the task's tests may run (expiry scores 0).
        max_patch_bytes: Cap on the patch and on the files it is made from (over it: the
            policy's failure, scored 0).
        capture_timeout: Seconds the capture may take (expiry: the policy's failure, its
            tree too large to diff).
    """

    def __init__(self, timeout: float = 300.0, *, max_patch_bytes: int = MAX_PATCH_BYTES,
                 capture_timeout: float = 300.0) -> None:
        self.timeout = timeout
        self.max_patch_bytes = max_patch_bytes
        self.capture_timeout = capture_timeout
        self.runnable = RunnableCheck(timeout)

    async def capture(self, lease, task: Task) -> bytes:
        """The policy's change to the repo as a patch; see :func:`capture_patch`.

        Raises:
            PatchRefused: Over the cap, undiffable, or too slow to take (scored 0).
            DiskQuotaExceeded: The policy filled its disk (scored 0).
            InfraError: The sandbox failed.
        """
        return await capture_patch(lease, task, max_bytes=self.max_patch_bytes, timeout=self.capture_timeout)

    async def score(self, sandbox, task: Task, patch: bytes) -> Score:
        """Score ``patch`` on ``sandbox``, pristine at ``task.base_commit``; see :func:`grade_patch`.

        When none of the task's tests ran, ``sandbox`` (a pool lease: its ``reset()`` makes it
        pristine again) is used to check, once per task, that they run with no patch or with
        the gold patch (:class:`~sandpool.envs.grading.runnable.RunnableCheck`); a sandbox
        that cannot be reset is not used for that, and such a run is scored 0.

        Raises:
            BrokenTaskError: The task cannot be graded as given (rejected, never scored),
                e.g. its tests run neither on the pristine repo nor with the gold patch.
            InfraError: The sandbox failed (scored again on another one).
        """
        result = await grade_patch(sandbox, task, patch, timeout=self.timeout,
                                   max_patch_bytes=self.max_patch_bytes)
        if result.ran == 0 and isinstance(sandbox, Lease):
            await self.runnable.ensure(sandbox, task, pristine=None if patch else result)
        return score_of(result)
