"""Episodes that survive infra: a checkpoint after each step, the step in flight run again.

The accountant's logic on the in-memory backend (whose sandboxes' files are their state):
recovery, what is not recovered (the policy's own failures, a used-up limit, a checkpoint
that could not be taken), and the report's counts. The same on real sandboxes killed from
the host is in ``test_checkpoint_local.py``.
"""

from __future__ import annotations

import pytest

from sandpool.core import SandboxPool, Task, errors, run_rollout
from sandpool.core.metrics import Outcome
from sandpool.core.rollout import Rollout

from .memory_backend import MemoryBackend


def _task() -> Task:
    return Task(instance_id="t-1", repo="r", base_commit="0" * 40, image="img-a", problem_statement="p")


async def test_a_step_whose_sandbox_dies_runs_again_on_one_restored_from_the_checkpoint():
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        seen = []

        async def episode(lease) -> float:
            await lease.write_file("a", b"1")
            await lease.write_file("b", b"2")
            first = lease.sandbox
            first.fail_next_exec = errors.SandboxDied("killed by the node")
            res = await lease.exec("make step-3")  # dies in flight, runs again elsewhere
            await lease.write_file("c", b"3")
            seen.append((first, lease.sandbox, res.ok, dict(lease.sandbox.files)))
            return 1.0

        result = await run_rollout(pool, _task(), episode, checkpoint="step")
        assert (result.outcome, result.reward, result.recoveries) == (Outcome.COMPLETED, 1.0, 1)
        (first, second, ok, files), = seen
        assert second is not first and ok
        assert second.commands.count("make step-3") == 1  # the step in flight, once more
        assert files == {"a": b"1", "b": b"2", "c": b"3"}  # nothing the policy did is lost
        assert pool.counters.recoveries == 1 and result.sandbox_id == second.id
        assert pool.counters.infra_errors == {"sandbox_died": 1}
        report = pool.report(_workload(), [result], 1.0)
        assert "recoveries   1" in report.render_text()


async def test_without_checkpoints_the_episode_runs_again_from_the_start():
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        runs = []

        async def episode(lease) -> float:
            runs.append(lease.sandbox)
            await lease.write_file("a", b"1")
            if len(runs) == 1:
                lease.sandbox.fail_next_exec = errors.SandboxDied("killed")
            await lease.exec("step")
            return 1.0

        result = await run_rollout(pool, _task(), episode)
        assert (result.outcome, result.recoveries, result.attempts, len(runs)) == (Outcome.COMPLETED, 0, 2, 2)


async def test_the_policys_own_failure_is_never_recovered():
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        async def episode(lease) -> float:
            await lease.write_file("a", b"1")
            lease.sandbox.fail_next_exec = errors.SandboxExhausted("its fork bomb spent the pid budget")
            await lease.exec("bomb")
            return 1.0

        result = await run_rollout(pool, _task(), episode, checkpoint="step")
        assert (result.outcome, result.reward, result.recoveries) == (Outcome.TASK_FAILED, 0.0, 0)
        assert pool.counters.recoveries == 0


class _DyingBackend(MemoryBackend):
    """Every sandbox's first command fails: the node under it keeps dying."""

    async def create(self, image):
        sb = await super().create(image)
        sb.fail_next_exec = errors.SandboxDied("the node keeps dying")
        return sb


async def test_recoveries_are_bounded_then_the_rollout_is_infra_failed():
    async with SandboxPool(_DyingBackend(head="0" * 40), "reuse") as pool:
        async def episode(lease) -> float:
            await lease.write_file("a", b"1")
            await lease.exec("step")
            return 1.0

        result = await run_rollout(pool, _task(), episode, checkpoint="step", recoveries=2)
        assert (result.outcome, result.reward, result.recoveries) == (Outcome.INFRA_FAILED, None, 2)
        assert pool.counters.recoveries == 2 and pool.counters.created == 3


async def test_no_recovery_from_a_state_older_than_the_last_completed_step():
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        r = Rollout(pool, _task(), checkpoint="step")
        lease = await r.claim(probe=False)
        await r.step(lambda held: held.write_file("a", b"1"))
        lease.sandbox.snapshot_error = errors.ExecTransportError("the snapshot's channel broke")
        await r.step(lambda held: held.write_file("b", b"2"))  # done, but not checkpointed
        lease.sandbox.fail_next_exec = errors.SandboxDied("killed")
        with pytest.raises(errors.SandboxDied):
            await r.step(lambda held: held.exec("step"))
        assert r.result is not None and r.result.outcome is Outcome.INFRA_FAILED
        assert r.recoveries == 0


async def test_a_reading_step_takes_no_checkpoint_and_a_file_errno_is_still_a_step():
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        r = Rollout(pool, _task(), checkpoint="step")
        await r.claim(probe=False)
        await r.step(lambda held: held.write_file("a", b"1"))
        first = r.checkpoints.last
        assert await r.step(lambda held: held.read_file("a"), checkpoint=False) == b"1"
        assert r.checkpoints.last is first

        async def denied(held):
            await held.write_file("b", b"2")
            raise errors.sandbox_file_error(13, "b", "in the test")

        with pytest.raises(errors.SandboxFileError):
            await r.step(denied)
        assert not r.ended and r.checkpoints.last is not first  # the state moved: checkpointed
        assert r.checkpoints.last.detail["files"].keys() == {"a", "b"}
        await r.abandon()


def test_an_unknown_checkpoint_mode_names_the_choices():
    with pytest.raises(errors.ConfigError, match="'step'"):
        Rollout(None, _task(), checkpoint="always")  # type: ignore[arg-type]


def _workload():
    from sandpool.core.metrics import Workload

    return Workload(tasks=1, images=1, rollouts=1, concurrency=1, backend="memory", strategy="reuse")
