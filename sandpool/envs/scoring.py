"""The grader every adapter hands the rollout accountant (:mod:`sandpool.core.rollout`).

:func:`default_grader` is the one place that picks it, so the runner, Gymnasium, NeMo Gym and
OpenHands all grade the same way: :class:`~sandpool.envs.grading.DiffGrader`, the policy's
change to the repo as a patch, checked against the patch policy and graded on a pristine
sandbox with an isolated test run.
"""

from __future__ import annotations

from sandpool.core.rollout import Grader
from sandpool.envs.grading import DiffGrader

__all__ = ["default_grader"]


def default_grader(timeout: float = 300.0) -> Grader:
    """The grader every adapter uses unless given another.

    Args:
        timeout: Seconds the task's tests may run (on expiry: reward 0).
    """
    return DiffGrader(timeout)
