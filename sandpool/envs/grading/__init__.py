"""Grading: the reward the task's own harness gives the policy's change.

Modules:

* :mod:`~sandpool.envs.grading.harness`: each dataset's harness as a test plan (what runs,
  which files are reset, how the log is parsed and scored);
* :mod:`~sandpool.envs.grading.pytest_log`: pytest's ``-rA`` log, read as SWE-bench reads it;
* :mod:`~sandpool.envs.grading.verdict`: the signed report and the cross-checks a verdict rests on;
* :mod:`~sandpool.envs.grading.inplace`: grading the sandbox the policy left;
* :mod:`~sandpool.envs.grading.validate`: gold and empty patch on every task, before rollouts;
* ``sandbox_side/``: the files grading runs inside a sandbox.
"""

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
    "GradeResult",
    "TestStatus",
    "files_of_tests",
    "grade",
    "parse_test_log",
    "parse_test_log_details",
    "pytest_command",
    "pytest_env",
]
