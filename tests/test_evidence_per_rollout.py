"""The kernel's counts of a sandbox's exhausted budget are evidence for the rollout that made
them, never for a later rollout of the same reused sandbox.

A reused sandbox keeps its cgroup, whose OOM and refused-fork counts only grow. A policy that
starved its agent once (scored 0, its sandbox reset and kept) must not turn the next rollout's
infra death (the host's OOM killer, an operator) into that rollout's "exhausted" 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from sandpool.core import Outcome, PoolLimits, ResourceLimits, SandboxPool, run_rollout
from sandpool.core.backends.local import LocalBackend, LocalSandbox
from sandpool.envs.grading import grade

from .waiting import until


def _kill_agent(sb: LocalSandbox) -> None:
    """SIGKILL the sandbox's agent (bubblewrap's only child) from the host, as its OOM killer would."""
    children = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
    assert len(children) == 1, children
    os.kill(int(children[0]), signal.SIGKILL)


async def test_a_starved_agent_of_one_rollout_is_no_evidence_against_the_next(test_images_root, calc_task):
    backend = LocalBackend(test_images_root, limits=ResourceLimits(pids=64))
    used: list[str] = []

    async def starve(lease) -> float:
        # The bomb holds every pid its commands may have; commands beside it push the
        # sandbox's total to its limit, and the agent is refused threads (the policy's 0).
        used.append(lease.sandbox.id)
        bomb = asyncio.create_task(lease.exec(
            "for i in 1 2 3 4; do (while :; do sleep 1000 & done 2>/dev/null) & done; sleep 1000",
            timeout=300))
        group = Path(f"/sys/fs/cgroup/pids/sandpool/{backend.run_id}/{lease.sandbox.id}/work")
        await until(lambda: int((group / "pids.events").read_text().split()[1]) > 0,
                    "the bomb to reach its pid limit")
        results = await asyncio.gather(*(lease.exec("sleep 2") for _ in range(60)), return_exceptions=True)
        bomb.cancel()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return 1.0

    attempts = 0

    async def honest(lease) -> float:
        nonlocal attempts
        attempts += 1
        used.append(lease.sandbox.id)
        if attempts == 1:  # the host kills its agent between two steps: infra, retried
            assert (await lease.exec("echo step 1")).ok
            _kill_agent(lease.sandbox)
            await until(lambda: not lease.sandbox.alive(), "the killed agent's channel to close")
            await lease.exec("echo step 2")
        await lease.write_file("/tmp/gold.patch", calc_task.patch.encode())
        assert (await lease.exec("git apply /tmp/gold.patch")).ok
        return (await grade(lease, calc_task)).reward

    async with SandboxPool(backend, "reuse", PoolLimits(max_live=1)) as pool:
        first = await run_rollout(pool, calc_task, starve)
        assert (first.outcome, first.error_kind) == (Outcome.TASK_FAILED, "sandbox_exhausted"), first
        second = await run_rollout(pool, calc_task, honest, rollout=1)
    assert used[1] == used[0], "the second rollout must reuse the starved sandbox"
    assert (second.outcome, second.reward, second.attempts) == (Outcome.COMPLETED, 1.0, 2), second
    assert pool.counters.infra_errors == {"sandbox_died": 1}, pool.counters.infra_errors
