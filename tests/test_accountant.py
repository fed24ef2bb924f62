"""One event, one outcome: the runner and the Gymnasium env, adapters of the rollout accountant,
driven through the same events on real bubblewrap sandboxes give the same outcome table
(``tests/accountant_cases.py``; NeMo Gym and OpenHands are driven in their own venvs).
"""

from __future__ import annotations

import asyncio
import contextlib

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


def _ended(i: int, rew, info: dict) -> tuple[str, float | None, str | None]:  # type: ignore[no-untyped-def]
    """The end sub-env ``i`` reports (its step's reward and flags, or its reset's flags)."""
    kind = info["error_kind"][i] if "error_kind" in info and info["_error_kind"][i] else None
    for outcome in ("task_failed", "infra_failed", "rejected"):
        if outcome in info and info[f"_{outcome}"][i] and info[outcome][i]:
            if outcome == "task_failed":
                return outcome, float(rew[i]), kind
            assert rew is None or rew[i] != rew[i]  # NaN: never a score
            return outcome, None, kind
    return "completed", float(rew[i]), kind


def _vector_episodes(all_cases: list[Case], images_root) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """Every case at once, one sub-env each, stepped in one batch until each has ended; returns
    (what each sub-env's steps reported, the accountant's record of its episode)."""
    tasks = list({c.task.instance_id: c.task for c in all_cases}.values())
    envs = gym.make_vec(ENV_ID, num_envs=len(all_cases), tasks=tasks, lookahead=False,
                        backend_options={"images_root": str(images_root)}, step_timeout=60.0,
                        grade_timeout=120.0)
    seen: dict[str, tuple[str, float | None, str | None]] = {}
    try:
        _, info = envs.reset(seed=0, options={"task_ids": [c.task.instance_id for c in all_cases]})
        sandboxes = [info["sandbox_id"][i] if info["_sandbox_id"][i] else None for i in range(len(all_cases))]
        for i, case in enumerate(all_cases):
            if "reset_failed" in info and info["_reset_failed"][i]:
                seen[case.name] = _ended(i, None, info)
        k = 0
        while len(seen) < len(all_cases):
            actions = ["true" if c.name in seen else c.commands[k] if k < len(c.commands) else "submit"
                       for c in all_cases]
            obs, rew, term, trunc, info = envs.step(actions)
            for i, case in enumerate(all_cases):
                if case.name in seen:
                    continue
                if term[i] or trunc[i]:
                    seen[case.name] = _ended(i, rew, info)
                elif KILL_MARK in obs["stdout"][i]:
                    sandbox = envs.sandbox(i)
                    envs.pool.pool.backend.kill(sandbox)
                    wait_until(lambda: not sandbox.alive(), "the killed sandbox's channel to close")
            k += 1
        records = envs.report().rollouts
    finally:
        envs.close()
    recorded = {}
    for case, sid in zip(all_cases, sandboxes):
        # The sub-env's own episode: its first record of its task in its sandbox (an autoreset
        # after it may run more episodes).
        r = next(r for r in records if r.task_id == case.task.instance_id and r.sandbox_id == sid)
        recorded[case.name] = (r.outcome.value, r.reward, r.error_kind)
    return seen, recorded


async def test_the_gymnasium_vector_env_gives_the_one_outcome_table(test_images_root, calc_task):
    """Every event in one batch, each in its own sub-env: each sub-env reports, and the
    accountant records, the one table, whatever the others in the batch do (a rejected row
    included: its reset fails alone, flagged, and the batch steps on)."""
    all_cases = cases(calc_task)
    seen, recorded = await asyncio.to_thread(_vector_episodes, all_cases, test_images_root)
    show("Gymnasium vector env (make_vec sandpool/SWE-v0), as stepped", seen)
    assert seen == expected(all_cases)
    assert recorded == expected(all_cases)


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


# -- the accountant's own rules, on the memory backend and on bubblewrap --------------------------


@pytest.mark.parametrize("exc, row", [
    (errors.SandboxExhausted("its fork bomb"), ("task_failed", 0.0, "sandbox_exhausted", True)),
    (errors.SandboxDied("killed"), ("infra_failed", None, "sandbox_died", True)),
    (OSError("host disk"), ("infra_failed", None, "unexpected:OSError", False)),
    (KeyError("a bug"), ("infra_failed", None, "unexpected:KeyError", False)),
    (errors.BrokenTaskError("gold does not resolve"), ("rejected", None, "broken_task", True)),
    (errors.TaskValidationError("bad row"), ("rejected", None, "task_validation", True)),
    (errors.PoolClosed("closed"), None),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
def test_each_error_has_one_row_of_the_outcome_table(exc, row):
    from sandpool.core.outcome import ending_of

    ending = ending_of(exc)
    got = None if ending is None else (ending.outcome.value, ending.reward, ending.kind, ending.reusable)
    assert got == row


def test_a_score_is_completed_with_its_reward_or_task_failed_with_its_reason():
    from sandpool.core.outcome import Score, scored

    assert scored(Score(0.5)) == scored(Score(0.5, detail="log"))
    assert (scored(Score(0.5)).outcome.value, scored(Score(0.5)).reward) == ("completed", 0.5)
    refused = scored(Score(1.0, failure="conftest.py is a test hook", kind="patch_policy"))
    assert (refused.outcome.value, refused.reward, refused.kind, refused.error) == (
        "task_failed", 0.0, "patch_policy", "conftest.py is a test hook")
    with pytest.raises(ValueError, match="Score.reward=1.5"):
        Score(1.5)



class _CountingGrader:
    """A grader whose first ``fail_scores`` scorings find their sandbox dead (as an OOM kill or
    an eviction of the grading sandbox would); it records every sandbox and patch it saw."""

    def __init__(self, fail_scores: int = 0, reward: float = 1.0) -> None:
        self.fail_scores, self.reward = fail_scores, reward
        self.captured: list[str] = []
        self.scored: list[tuple[str, bytes]] = []

    async def capture(self, lease, task):  # type: ignore[no-untyped-def]
        self.captured.append(lease.id)
        return f"patch of {lease.id}".encode()

    async def score(self, sandbox, task, patch):  # type: ignore[no-untyped-def]
        from sandpool.core.outcome import Score

        self.scored.append((sandbox.id, patch))
        if len(self.scored) <= self.fail_scores:
            sandbox.sandbox.dead = True
            await sandbox.exec("true")  # raises SandboxDied
        return Score(self.reward)


def _mem_task(i: int = 1) -> Task:
    return Task(instance_id=f"t-{i}", repo="r", base_commit=f"{i:040x}", image="img-a", problem_statement="p")


async def _act(lease) -> None:  # type: ignore[no-untyped-def]
    await lease.exec("edit")


async def test_an_infra_death_while_scoring_scores_the_same_patch_on_another_sandbox():
    from sandpool.core import SandboxPool
    from sandpool.core.rollout import run_rollout

    from .memory_backend import MemoryBackend

    grader = _CountingGrader(fail_scores=1)
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        r = await run_rollout(pool, _mem_task(), _act, grader=grader, retries=0, grade_retries=1)
    assert (r.outcome.value, r.reward, r.attempts) == ("completed", 1.0, 1)
    [acted] = grader.captured  # the policy ran once
    (first, p1), (second, p2) = grader.scored
    assert p1 == p2 == f"patch of {acted}".encode() and first != second
    assert r.sandbox_id == acted  # the record names the sandbox the policy acted in


async def test_infra_past_the_grade_retries_is_infra_failed_never_a_reward():
    from sandpool.core import SandboxPool
    from sandpool.core.rollout import run_rollout

    from .memory_backend import MemoryBackend

    grader = _CountingGrader(fail_scores=3)
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        r = await run_rollout(pool, _mem_task(), _act, grader=grader, retries=2, grade_retries=2)
        assert pool.counters.infra_errors["sandbox_died"] == 3
    assert (r.outcome.value, r.reward, r.error_kind) == ("infra_failed", None, "sandbox_died")
    assert len(grader.captured) == 1 and len(grader.scored) == 3  # never re-ran the policy


async def test_a_file_errno_in_an_action_is_a_result_and_anything_else_ends_the_rollout():
    import errno

    from sandpool.core import SandboxPool
    from sandpool.core.rollout import Rollout

    from .memory_backend import MemoryBackend

    results = []
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        r = Rollout(pool, _mem_task(), grader=_CountingGrader(), on_result=results.append)
        lease = await r.claim(probe=False)
        lease.sandbox.fail_next_exec = errors.sandbox_file_error(errno.EACCES, "/etc/x")
        with pytest.raises(PermissionError):
            async with r.action() as lease:
                await lease.exec("touch /etc/x")
        assert not r.ended and results == []
        lease.sandbox.fail_next_exec = errors.SandboxExhausted("its processes exhausted the sandbox")
        with pytest.raises(errors.SandboxExhausted):
            async with r.action() as lease:
                await lease.exec("fork bomb")
        assert r.ended and [(x.outcome.value, x.reward, x.error_kind) for x in results] == [
            ("task_failed", 0.0, "sandbox_exhausted")]
        with pytest.raises(errors.PoolClosed):
            await r.finish()
        assert await r.fail(errors.SandboxDied("later")) is results[0]  # one rollout, one record


async def test_a_sandbox_that_failed_under_the_policy_is_never_graded():
    from sandpool.core import SandboxPool
    from sandpool.core.rollout import run_rollout

    from .memory_backend import MemoryBackend

    async def swallows_infra(lease) -> None:  # type: ignore[no-untyped-def]
        lease.sandbox.fail_next_exec = errors.ExecTransportError("channel broke")
        with contextlib.suppress(errors.ExecTransportError):
            await lease.exec("true")

    grader = _CountingGrader()
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        r = await run_rollout(pool, _mem_task(), swallows_infra, grader=grader, retries=0)
    assert (r.outcome.value, r.reward, r.error_kind) == ("infra_failed", None, "exec_transport")
    assert grader.captured == [] and grader.scored == []


class _KillsItsFirstGradingSandbox:
    """A real diff grader in miniature: the policy's ``git diff``, applied on the pristine
    sandbox and graded by the task's tests; its first scoring sandbox is killed from the host."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend, self.scored = backend, []

    async def capture(self, lease, task):  # type: ignore[no-untyped-def]
        return (await lease.exec("git diff", timeout=60)).stdout

    async def score(self, sandbox, task, patch):  # type: ignore[no-untyped-def]
        from sandpool.core.outcome import Score

        self.scored.append(sandbox.id)
        assert (await sandbox.exec("git status --porcelain; ls -A /tmp", timeout=60)).text == ""
        if len(self.scored) == 1:
            self.backend.kill(sandbox.sandbox)
            await until(lambda: not sandbox.sandbox.alive(), "the killed sandbox's channel to close")
        await sandbox.write_file("/tmp/p.diff", patch)
        res = await sandbox.exec("git apply /tmp/p.diff && python -m pytest -q test_calc.py", timeout=120)
        return Score(1.0 if res.ok else 0.0)


async def test_a_real_grading_sandbox_killed_from_the_host_is_scored_again_on_a_pristine_one(
        test_images_root, calc_task):
    from sandpool.core import SandboxPool
    from sandpool.core.rollout import run_rollout

    backend = LocalBackend(test_images_root)
    grader = _KillsItsFirstGradingSandbox(backend)

    async def oracle(lease) -> None:  # type: ignore[no-untyped-def]
        await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch && echo x > /tmp/left", timeout=60)).ok

    async with SandboxPool(backend, "reuse") as pool:
        r = await run_rollout(pool, calc_task, oracle, grader=grader, retries=0, grade_retries=1)
        assert pool.counters.infra_errors.get("sandbox_died") == 1
    assert (r.outcome.value, r.reward, r.attempts) == ("completed", 1.0, 1)
    assert len(grader.scored) == 2 and grader.scored[0] != grader.scored[1]
