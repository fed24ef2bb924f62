"""The events every adapter of the rollout accountant is driven through, and the one outcome
table they must all give (``tests/test_accountant.py`` for the runner and Gymnasium,
``tests/nemo_gym/test_accountant_nemo.py``, ``tests/openhands/test_accountant_openhands.py``).

Each case is a task and the shell commands a policy runs on it, in the repo, then submits. A
command that prints :data:`KILL_MARK` asks the driver to kill the sandbox from the host (as
the host's OOM killer or an eviction would) before the next command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sandpool.core.task import Task

#: A command whose answer tells the driver to SIGKILL the sandbox from the host.
KILL_MARK = "KILL-THIS-SANDBOX"

# The policy's code prints PASSED lines for the task's tests and exits 0 when pytest imports
# it: a log-trusting grader would score it 1.
_FORGE = """import os, sys
if "pytest" in sys.modules:
    for fd in range(1, 64):
        try:
            os.write(fd, b"PASSED test_calc.py::test_add\\nPASSED test_calc.py::test_zero\\n")
        except OSError:
            pass
    os._exit(0)
"""


def _write(path: str, text: str) -> str:
    """A shell command that writes ``text`` to ``path`` (a heredoc: no quoting to get wrong)."""
    return f"cat > {path} <<'SANDPOOL_EOF'\n{text}SANDPOOL_EOF"


@dataclass(frozen=True)
class Case:
    """One event: the task, the policy's commands, and the end every adapter must record."""

    name: str
    task: Task
    commands: tuple[str, ...]
    outcome: str
    reward: float | None
    kind: str | None


def cases(calc_task: Task) -> list[Case]:
    """The events, on the conftest calc task (its bug: ``add`` subtracts)."""
    no_base = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"
    broken = calc_task.model_copy(update={"instance_id": "calc__broken-1", "test_patch": no_base})
    bad_row = calc_task.model_copy(update={"instance_id": "calc__no-such-commit-1", "base_commit": "ab" * 20})
    return [
        Case("oracle", calc_task, (_write("/tmp/gold.patch", calc_task.patch), "git apply /tmp/gold.patch"),
             "completed", 1.0, None),
        Case("tampering", calc_task,
             (_write("/tmp/forge.py", _FORGE), "cat /tmp/forge.py calc.py > /tmp/c && cp /tmp/c calc.py"),
             "task_failed", 0.0, "tampering_suspected"),
        # The fix, and a pytest hook the patch policy refuses: the submission breaks the rules.
        Case("policy_error", calc_task, (_write("/tmp/gold.patch", calc_task.patch), "git apply /tmp/gold.patch",
                                         _write("conftest.py", "import os\n")),
             "task_failed", 0.0, "patch_policy"),
        Case("infra_death", calc_task, (f"echo {KILL_MARK}", "echo after"), "infra_failed", None, "sandbox_died"),
        Case("broken_task", broken, ("git status --short",), "rejected", None, "broken_task"),
        Case("rejected_row", bad_row, ("git status --short",), "rejected", None, "input"),
    ]


def expected(all_cases: list[Case]) -> dict[str, tuple[str, float | None, str | None]]:
    """The one outcome table: case name -> (outcome, reward, error kind)."""
    return {c.name: (c.outcome, c.reward, c.kind) for c in all_cases}


def show(adapter: str, table: dict[str, tuple[str, float | None, str | None]]) -> str:
    """Print ``table`` as the accountant's outcome table of ``adapter`` (for the report) and
    return the text."""
    lines = [f"outcome table: {adapter}"] + [
        f"  {name:<13} {outcome:<13} reward={reward!s:<5} kind={kind}"
        for name, (outcome, reward, kind) in table.items()]
    text = "\n".join(lines)
    print(text)
    return text


def inline_row(task: Task) -> dict:
    """A NeMo Gym dataset row that carries ``task`` inline."""
    return {"instance_id": task.instance_id, "responses_create_params": {"input": task.problem_statement},
            "task": json.loads(task.model_dump_json())}
