"""Grading: the reward the task's own harness gives the policy's change.

:class:`DiffGrader` is the rollout accountant's grader (:class:`sandpool.core.rollout.Grader`).
Modules, in the order a rollout meets them:

* :mod:`~sandpool.envs.grading.capture`: the policy's change, taken as a patch from its sandbox;
* :mod:`~sandpool.envs.grading.patch`, :mod:`~sandpool.envs.grading.policy`: the patch read as
  git reads it, and the patch policy it must pass before it is applied;
* :mod:`~sandpool.envs.grading.diff`: the patch applied in a pristine sandbox and the tests run
  there in an isolated process (``sandbox_side/runner.py``), with the image's interpreter
  (:mod:`~sandpool.envs.grading.interpreter`);
* :mod:`~sandpool.envs.grading.runnable`: whether the task's tests run at all, on pristine
  sandboxes, when a graded run ran none of them (else the task is rejected);
* :mod:`~sandpool.envs.grading.harness`: each dataset's harness as a test plan (what runs,
  which files are reset, how the log is parsed and scored);
* :mod:`~sandpool.envs.grading.pytest_log`: pytest's ``-rA`` log, read as SWE-bench reads it;
* :mod:`~sandpool.envs.grading.verdict`: the signed report (``sandbox_side/verdict_plugin.py``)
  and the cross-checks a verdict rests on;
* :mod:`~sandpool.envs.grading.grader`: the three steps as the accountant's grader;
* :mod:`~sandpool.envs.grading.validate`: gold and empty patch on every task, before rollouts;
* :mod:`~sandpool.envs.grading.inplace`: grading the sandbox the policy left, with a list of
  known tricks undone (``sandbox_side/prepare.py``): what diff grading replaces.
"""

from sandpool.envs.grading.grader import DiffGrader
from sandpool.envs.grading.inplace import grade
from sandpool.envs.grading.pytest_log import (
    TestStatus,
    files_of_tests,
    parse_test_log,
    parse_test_log_details,
    pytest_command,
    pytest_env,
)
from sandpool.envs.grading.verdict import GradeResult

__all__ = [
    "DiffGrader",
    "GradeResult",
    "TestStatus",
    "files_of_tests",
    "grade",
    "parse_test_log",
    "parse_test_log_details",
    "pytest_command",
    "pytest_env",
]
