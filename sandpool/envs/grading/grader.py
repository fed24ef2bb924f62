"""The rollout accountant's grader: the policy's diff, graded by construction.

:class:`DiffGrader` implements :class:`sandpool.core.rollout.Grader`. The accountant calls
:meth:`DiffGrader.capture` on the policy's sandbox at the end of the episode, then
``lease.reset()`` (a verified in-place reset, or a fresh sandbox under the same lease), then
:meth:`DiffGrader.score` on that pristine sandbox. What happens in each step is in
:mod:`~sandpool.envs.grading.capture`, :mod:`~sandpool.envs.grading.policy` and
:mod:`~sandpool.envs.grading.diff`.

Usage::

    grader = DiffGrader(timeout=300)
    patch = await grader.capture(lease, task)
    await lease.reset()
    score = await grader.score(lease, task, patch)
"""

from __future__ import annotations

from sandpool.core import errors
from sandpool.core.outcome import Score
from sandpool.core.task import Task
from sandpool.envs.grading.capture import capture_patch
from sandpool.envs.grading.diff import grade_patch
from sandpool.envs.grading.policy import MAX_PATCH_BYTES
from sandpool.envs.grading.verdict import GradeResult

__all__ = ["DiffGrader", "score_of"]


def score_of(result: GradeResult) -> Score:
    """The :class:`~sandpool.core.outcome.Score` of a grade.

    A patch the policy refuses (kind ``patch_policy``), suspected tampering (kind
    ``tampering_suspected``) and a patch that broke its own grading (kind ``grading``: it does
    not apply, its code wrote a log or report over the cap) are the submission's failure:
    ``task_failed``, reward 0, the reason kept. A test run that timed out, or tests that
    fail, are a plain 0.
    """
    if result.refused:
        return Score(0.0, failure="patch refused: " + "; ".join(result.refused),
                     kind=errors.PatchRefused.kind, detail=result)
    if result.tampering:
        return Score(0.0, failure="suspected tampering: " + "; ".join(result.tampering),
                     kind=errors.TamperingSuspected.kind, detail=result)
    if result.error:
        return Score(0.0, failure=f"grading: {result.error}", kind="grading", detail=result)
    return Score(float(result.reward), detail=result)


class DiffGrader:
    """Grades the policy's change to the repo as a patch, in a pristine sandbox.

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

        Raises:
            BrokenTaskError: The task cannot be graded as given (rejected, never scored).
            InfraError: The sandbox failed (scored again on another one).
        """
        result = await grade_patch(sandbox, task, patch, timeout=self.timeout,
                                   max_patch_bytes=self.max_patch_bytes)
        return score_of(result)
