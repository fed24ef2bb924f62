"""Failure accounting for one rollout: it ends completed, infra_failed, task_failed or rejected.

Which of these an error gives is decided by :func:`sandpool.core.classify.classify`, never here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from sandpool.core import errors
from sandpool.core.classify import Verdict, classify, error_kind
from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.pool import Lease, SandboxPool
from sandpool.core.task import Task
from sandpool.core.telemetry import Telemetry

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
    reused. Every error is placed by :func:`~sandpool.core.classify.classify`:

    * the policy's (``TaskError``, a file errno on its path, a fork bomb): ``task_failed``,
      reward 0, not retried;
    * infra's (and any error sandpool does not know): retried on a fresh sandbox; after
      ``retries`` retries ``infra_failed`` with ``reward=None``, never scored as 0;
    * the input's (an unknown image, a base commit not in the image, a broken task):
      ``rejected`` with the reason and ``reward=None``; the caller goes on with other tasks.

    The rollout is one ``sandpool.rollout`` span (parent of its claims, commands and grading)
    and one count in ``sandpool_rollouts_total`` (see :mod:`sandpool.core.telemetry`).

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
        FatalError: The backend is unusable or the pool closed; no point continuing the batch.
    """
    with Telemetry.span("sandpool.rollout", task_id=task.instance_id, image=task.image,
                        rollout=rollout, policy=policy) as span:
        result = await _run_attempts(pool, task, episode, rollout=rollout, retries=retries, policy=policy)
        span.set_attribute("sandpool.outcome", result.outcome.value)
        span.set_attribute("sandpool.attempts", result.attempts)
    pool.telemetry.rollout_done(result.outcome.value)
    return result


async def _run_attempts(pool: SandboxPool, task: Task, episode: Episode, *, rollout: int,
                        retries: int, policy: str | None) -> RolloutResult:
    t0 = time.monotonic()
    last: Exception | None = None
    sandbox_id = None
    for attempt in range(1, retries + 2):
        lease: Lease | None = None
        try:
            async with pool.claim(task) as lease:
                sandbox_id = lease.id
                reward = await episode(lease)
            return RolloutResult(task_id=task.instance_id, rollout=rollout, outcome=Outcome.COMPLETED,
                                 reward=float(reward), attempts=attempt, ttfc_s=lease.ttfc_s,
                                 duration_s=time.monotonic() - t0, policy=policy, sandbox_id=sandbox_id)
        except Exception as exc:  # noqa: BLE001 - every error is placed by the one classifier
            verdict = classify(exc)
            if verdict is Verdict.FATAL:
                raise
            if verdict is Verdict.INFRA:
                if not isinstance(exc, errors.InfraError):  # the pool counts its own kinds
                    pool.counters.infra_error(error_kind(exc))
                    pool.telemetry.infra_error(error_kind(exc))
                last = exc
                continue
            outcome = verdict.outcome
            assert outcome is not None
            return RolloutResult(task_id=task.instance_id, rollout=rollout, outcome=outcome,
                                 reward=0.0 if verdict.scored else None, attempts=attempt,
                                 ttfc_s=lease.ttfc_s if lease else None,
                                 duration_s=time.monotonic() - t0, error_kind=error_kind(exc),
                                 error=str(exc), policy=policy, sandbox_id=sandbox_id)
    assert last is not None
    return RolloutResult(task_id=task.instance_id, rollout=rollout, outcome=Outcome.INFRA_FAILED,
                         reward=None, attempts=retries + 1, duration_s=time.monotonic() - t0,
                         error_kind=error_kind(last), error=str(last), policy=policy,
                         sandbox_id=sandbox_id)
