"""Failure accounting for one rollout: every rollout ends completed, infra_failed or task_failed."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from sandpool.core import errors
from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.pool import Lease, SandboxPool
from sandpool.core.task import Task

__all__ = ["Episode", "run_rollout"]

#: An episode: given a leased sandbox, act in it and return the reward (1.0 resolved, 0.0 not).
#: Raise :class:`~sandpool.core.errors.TaskError` for the policy's own failure.
Episode = Callable[[Lease], Awaitable[float]]


async def run_rollout(
    pool: SandboxPool,
    task: Task,
    episode: Episode,
    *,
    rollout: int = 0,
    retries: int = 2,
    policy: str | None = None,
) -> RolloutResult:
    """Run ``episode`` on a sandbox claimed for ``task``, retrying infra failures.

    Each attempt claims a fresh sandbox; a sandbox that raised an infra error is deleted, not
    reused. After ``retries`` retries the rollout ends ``infra_failed`` with ``reward=None``:
    an infra failure is never scored as 0, and is always counted.

    Args:
        pool: An open pool.
        task: The task.
        episode: The policy's episode (see :data:`Episode`).
        rollout: Index of this rollout among the task's rollouts.
        retries: Infra retries allowed after the first attempt.
        policy: Policy name, for the report.

    Returns:
        The :class:`RolloutResult`.

    Raises:
        InputError: The task cannot run as given (unknown image, bad base_commit).
        FatalError: The backend is unusable; no point continuing the batch.
    """
    t0 = time.monotonic()
    last: errors.InfraError | None = None
    sandbox_id = None
    for attempt in range(1, retries + 2):
        lease = None
        try:
            async with pool.claim(task) as lease:
                sandbox_id = lease.id
                reward = await episode(lease)
            return RolloutResult(task_id=task.instance_id, rollout=rollout, outcome=Outcome.COMPLETED,
                                 reward=float(reward), attempts=attempt, ttfc_s=lease.ttfc_s,
                                 duration_s=time.monotonic() - t0, policy=policy, sandbox_id=sandbox_id)
        except errors.TaskError as exc:
            return RolloutResult(task_id=task.instance_id, rollout=rollout, outcome=Outcome.TASK_FAILED,
                                 reward=0.0, attempts=attempt, ttfc_s=lease.ttfc_s if lease else None,
                                 duration_s=time.monotonic() - t0, error_kind=exc.kind, error=str(exc),
                                 policy=policy, sandbox_id=sandbox_id)
        except errors.InfraError as exc:  # already counted by the pool where it happened
            last = exc
    assert last is not None
    return RolloutResult(task_id=task.instance_id, rollout=rollout, outcome=Outcome.INFRA_FAILED,
                         reward=None, attempts=retries + 1, duration_s=time.monotonic() - t0,
                         error_kind=last.kind, error=str(last), policy=policy, sandbox_id=sandbox_id)
