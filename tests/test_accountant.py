"""One event, one outcome: the runner, an adapter of the rollout accountant, driven through the
events of ``tests/accountant_cases.py`` on real bubblewrap sandboxes gives the one outcome table.
"""

from __future__ import annotations

from sandpool.core.backends.local import LocalBackend
from sandpool.core.pool import Lease
from sandpool.core.task import Task
from sandpool.envs.policies import Policy
from sandpool.envs.runner import run_batch

from .accountant_cases import KILL_MARK, Case, cases, expected, show
from .waiting import until


class _Script(Policy):
    """Runs a case's commands; kills its own sandbox from the host where the case says so."""

    name = "script"

    def __init__(self, case: Case, backend: LocalBackend) -> None:
        self.case, self.backend = case, backend

    async def act(self, lease: Lease, task: Task) -> None:
        for command in self.case.commands:
            res = await lease.exec(command, timeout=60)
            if KILL_MARK in res.text:
                self.backend.kill(lease.sandbox)
                await until(lambda: not lease.sandbox.alive(), "the killed sandbox's channel to close")


async def test_the_runner_gives_the_one_outcome_table(test_images_root, calc_task):
    all_cases = cases(calc_task)
    got = {}
    for case in all_cases:
        backend = LocalBackend(test_images_root)
        report = await run_batch([case.task], [_Script(case, backend)], backend, rollouts_per_task=1,
                                 concurrency=1, retries=0, grade_timeout=120)
        [r] = report.rollouts
        got[case.name] = (r.outcome.value, r.reward, r.error_kind)
        assert report.unaccounted == 0
    show("runner (sandpool run)", got)
    assert got == expected(all_cases)
