"""One event, one outcome: the runner and the Gymnasium env, adapters of the rollout accountant,
driven through the same events on real bubblewrap sandboxes give the same outcome table
(``tests/accountant_cases.py``; NeMo Gym and OpenHands are driven in their own venvs).
"""

from __future__ import annotations

import asyncio

import gymnasium as gym
import pytest

from sandpool.core import Outcome, errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.pool import Lease
from sandpool.core.task import Task
from sandpool.envs.policies import Policy
from sandpool.envs.runner import run_batch
from sandpool.integrations.gymnasium import ENV_ID

from .accountant_cases import KILL_MARK, Case, cases, expected, show
from .waiting import until, wait_until


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


def _gym_episode(case: Case, images_root) -> tuple[str, float | None, str | None]:
    env = gym.make(ENV_ID, tasks=[case.task], backend_options={"images_root": str(images_root)},
                   step_timeout=60.0, grade_timeout=120.0)
    try:
        try:
            env.reset(seed=0)
        except errors.InputError:
            pass  # recorded rejected: the report has it
        else:
            ended = False
            for command in case.commands:
                obs, _, term, trunc, _ = env.step(command)
                ended = term or trunc
                if KILL_MARK in obs["stdout"]:
                    sandbox = env.unwrapped.sandbox
                    env.unwrapped.pool.pool.backend.kill(sandbox)
                    wait_until(lambda: not sandbox.alive(), "the killed sandbox's channel to close")
            if not ended:
                env.step("submit")
        [r] = env.unwrapped.report().rollouts
        return r.outcome.value, r.reward, r.error_kind
    finally:
        env.close()


async def test_the_gymnasium_env_gives_the_one_outcome_table(test_images_root, calc_task):
    all_cases = cases(calc_task)
    got = {}
    for case in all_cases:
        got[case.name] = await asyncio.to_thread(_gym_episode, case, test_images_root)
    show("Gymnasium (sandpool/SWE-v0)", got)
    assert got == expected(all_cases)


def test_a_gymnasium_step_reports_what_the_accountant_recorded(test_images_root, calc_task):
    """The step's reward and flags come from the record: tampering is a terminal score of 0
    with its evidence, an infra death a NaN that is flagged, never a score."""
    by = {c.name: c for c in cases(calc_task)}
    env = gym.make(ENV_ID, tasks=[calc_task], backend_options={"images_root": str(test_images_root)},
                   step_timeout=60.0, grade_timeout=120.0)
    try:
        env.reset(seed=0)
        for command in by["tampering"].commands:
            env.step(command)
        _, reward, term, trunc, info = env.step("submit")
        assert (reward, term, trunc, info["task_failed"], info["resolved"]) == (0.0, True, False, True, False)
        assert info["error_kind"] == "tampering_suspected" and info["tampering"], info
        env.reset(seed=0)
        env.step(f"echo {KILL_MARK}")
        sandbox = env.unwrapped.sandbox
        env.unwrapped.pool.pool.backend.kill(sandbox)
        wait_until(lambda: not sandbox.alive(), "the killed sandbox's channel to close")
        _, reward, term, trunc, info = env.step("echo after")
        assert reward != reward and (term, trunc, info["infra_failed"]) == (False, True, True)  # NaN
        with pytest.raises(gym.error.ResetNeeded):
            env.step("submit")
        assert [r.outcome for r in env.unwrapped.report().rollouts] == [Outcome.TASK_FAILED, Outcome.INFRA_FAILED]
    finally:
        env.close()
