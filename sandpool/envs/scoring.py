"""The grader every adapter hands the rollout accountant (:mod:`sandpool.core.rollout`).

:func:`default_grader` is the one place that picks it, so the runner, Gymnasium, NeMo Gym and
OpenHands all grade the same way. :class:`InPlaceGrader` grades the policy's own sandbox as
it stands, with :func:`sandpool.envs.grading.grade`, and says what that grade means for the
rollout (:func:`score_of`): a suspected tampering, or a policy that broke its own grading,
is the submission's failure (``task_failed``, reward 0, the reason kept).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from sandpool.core import errors
from sandpool.core.pool import Lease
from sandpool.core.rollout import Grader, Score
from sandpool.core.task import Task
from sandpool.envs.grading import GradeResult, grade

__all__ = ["InPlaceGrader", "default_grader", "score_of"]


def score_of(result: GradeResult) -> Score:
    """The :class:`~sandpool.core.rollout.Score` of a grade: its reward, or the submission's
    failure when grading found tampering (kind ``tampering_suspected``) or the policy's state
    broke grading (kind ``grading``). A test run that timed out is scored 0, not a failure.
    """
    if result.tampering:
        return Score(0.0, failure="suspected tampering: " + "; ".join(result.tampering),
                     kind=errors.TamperingSuspected.kind, detail=result)
    if result.error:
        return Score(0.0, failure=f"grading: {result.error}", kind="grading", detail=result)
    return Score(float(result.reward), detail=result)


class InPlaceGrader:
    """Grades the sandbox the policy acted in, as it stands.

    The grade is taken by :meth:`capture`, before the accountant's reset, on the policy's
    sandbox (so the patch it returns is only a key to that grade); :meth:`score` returns it.

    Args:
        timeout: Seconds the task's tests may run.
    """

    _KEPT = 4096  # grades waiting for their score() call; older ones are dropped

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._grades: OrderedDict[bytes, GradeResult] = OrderedDict()
        self._ids = itertools.count()

    async def capture(self, lease: Lease, task: Task) -> bytes:
        """Grade ``lease`` in place; return the key of that grade.

        Raises:
            BrokenTaskError: The task cannot be graded as given.
            InfraError: The sandbox failed while grading.
        """
        result = await grade(lease, task, timeout=self.timeout)
        key = f"in-place grade {next(self._ids)}".encode()
        self._grades[key] = result
        while len(self._grades) > self._KEPT:
            self._grades.popitem(last=False)
        return key

    async def score(self, sandbox: Lease, task: Task, patch: bytes) -> Score:
        """The score of the grade :meth:`capture` took under ``patch``."""
        result = self._grades.pop(patch, None)
        if result is None:
            raise errors.InfraError(f"no in-place grade of {task.instance_id} under {patch[:40]!r}")
        return score_of(result)


def default_grader(timeout: float = 300.0) -> Grader:
    """The grader every adapter uses unless given another.

    Args:
        timeout: Seconds the task's tests may run.
    """
    return InPlaceGrader(timeout)
