"""The one rollout accountant: claim -> episode -> grade -> outcome, reward, record, reuse.

A :class:`Rollout` claims a sandbox for a task, guards the policy's actions, has a
:class:`Grader` score the policy's change, and records the rollout's end as
:mod:`sandpool.core.outcome` says (its outcome table): its outcome, its reward, its
:class:`~sandpool.core.metrics.RolloutResult`, its count in the pool's telemetry and what
becomes of its sandbox. The runner, Gymnasium, NeMo Gym and OpenHands are adapters over it,
so one event has one outcome everywhere.

* Retries, all on infra only: the claim and its first command, up to ``claim_retries``; a
  one-shot episode, run again on a fresh claim, up to ``retries`` (a step-driven one cannot
  be re-run: it ends); the scoring, of the same patch on another pristine sandbox, up to
  ``grade_retries`` (the policy is never re-run for it).
* A file errno on the policy's path in one guarded action (:meth:`Rollout.action`) ends
  nothing: it is a result the policy sees.
* ``FatalError`` (backend unusable, pool closed) and interrupts are raised, not recorded.

A sandbox that ended on an infra error of its own, died, or saw an error sandpool does not
know is deleted; any other goes back to the pool, whose in-place reset verifies it.

Grading, once for every adapter: :meth:`Grader.capture` takes the policy's change as a patch
(a value), :meth:`Lease.reset <sandpool.core.pool.Lease.reset>` makes the sandbox pristine
(reset in place and verified, or swapped for a fresh one), :meth:`Grader.score` scores the
patch there. A sandbox that failed under the policy (``Lease.broken``) is never graded.

:func:`run_rollout` runs a one-shot episode; a step-driven caller (reset/step, seed/verify)
holds a :class:`Rollout`: :meth:`~Rollout.claim`, :meth:`~Rollout.action` around each policy
action, then :meth:`~Rollout.finish` or :meth:`~Rollout.fail`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from sandpool.core import errors
from sandpool.core.checkpoint import Checkpoints, StepLease
from sandpool.core.classify import Verdict, classify, error_kind
from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.outcome import Ending, Grader, Score, ending_of, ends_rollout, scored
from sandpool.core.pool import Lease, SandboxPool
from sandpool.core.task import Task
from sandpool.core.telemetry import Telemetry

__all__ = ["Episode", "Grader", "Rollout", "run_rollout"]

#: A one-shot episode: the policy acts in the leased sandbox (raising ``TaskError`` for its own
#: failure). With a grader, the grader scores what it did; without one, it returns the reward.
Episode = Callable[[Lease], Awaitable[float | None]]

T = TypeVar("T")

_PROBE = "git rev-parse HEAD"  # the first command: ends TTFC, proves the repo is at base
_PROBE_TIMEOUT_S = 30.0


class Rollout:
    """The accountant of one rollout of ``task`` on ``pool`` (see the module docstring).

    Usage::

        r = Rollout(pool, task, grader=grader, on_result=results.append)
        lease = await r.claim()              # if no sandbox: recorded, then raised
        async with r.action() as lease:      # each policy action
            res = await lease.exec(command, timeout=30)
        result = await r.finish()            # capture, reset, score, record, release

    Args:
        pool: An open pool.
        task: The task.
        grader: Scores the submission (:meth:`finish`); ``None`` only for one-shot
            episodes that return their reward.
        rollout: Index of this rollout among the task's rollouts.
        policy: Policy name, for the record.
        claim_retries: Extra claims after an infra failure before the policy acts.
        grade_retries: Extra scorings of the same patch after an infra failure.
        on_result: Called with the record when the rollout ends.
        checkpoint: ``"step"``: a snapshot after every action of :meth:`step`, and an infra
            failure of an action recovered from it (see :mod:`sandpool.core.checkpoint`);
            ``None`` (default): none.
        recoveries: Recoveries allowed with ``checkpoint``.

    Attributes:
        lease: The claimed sandbox while the rollout runs.
        result: The record, once the rollout ended.
        score: The grader's :class:`Score`, once scored.
        error: The error that ended the rollout, if one did.
    """

    def __init__(self, pool: SandboxPool, task: Task, *, grader: Grader | None = None, rollout: int = 0,
                 policy: str | None = None, claim_retries: int = 2, grade_retries: int = 2,
                 on_result: Callable[[RolloutResult], None] | None = None,
                 checkpoint: str | None = None, recoveries: int = 2) -> None:
        self.checkpoints = Checkpoints(checkpoint, recoveries)
        self.pool, self.task, self.grader = pool, task, grader
        self.rollout, self.policy = rollout, policy
        self.claim_retries, self.grade_retries = claim_retries, grade_retries
        self.on_result = on_result
        self.lease: Lease | None = None
        self.result: RolloutResult | None = None
        self.score: Score | None = None
        self.error: Exception | None = None
        self.attempts = 0
        self._t0 = time.monotonic()
        self._acted: Lease | None = None  # the lease the policy acted in (its TTFC)
        self._sandbox_id: str | None = None  # the sandbox it acted in (a reset may swap it)
        self._abandoned = False

    def __repr__(self) -> str:
        state = self.result.outcome.value if self.result else ("abandoned" if self._abandoned else "running")
        return f"<Rollout {self.task.instance_id}#{self.rollout} {state} lease={self.lease}>"

    @property
    def recoveries(self) -> int:
        """Sandboxes that failed under the episode and were replaced from a checkpoint."""
        return self.checkpoints.recoveries

    @property
    def ended(self) -> bool:
        """True once the rollout is recorded (or abandoned)."""
        return self.result is not None or self._abandoned

    async def claim(self, *, probe: bool = True) -> Lease:
        """Claim a sandbox; with ``probe``, run the first command (TTFC), which must find the
        repo at ``task.base_commit``. Infra failures are retried up to ``claim_retries`` times.

        Raises:
            InfraError: Every claim failed (recorded ``infra_failed``).
            InputError: The task cannot run (recorded ``rejected``).
            FatalError: The pool or backend cannot run sandboxes.
        """
        if self.ended:
            raise errors.PoolClosed(f"{self!r} has ended; start a new Rollout")
        while True:
            self.attempts += 1
            try:
                self.lease = self._acted = await self.pool.acquire(self.task)
                self._sandbox_id = self.lease.id
                if probe:
                    res = await self.lease.exec(_PROBE, timeout=_PROBE_TIMEOUT_S)
                    if not res.ok or res.text.strip() != self.task.base_commit:
                        raise errors.SandboxStartError(
                            f"sandbox {self.lease.id} is not at {self.task.base_commit[:12]} after its "
                            f"claim (git says {(res.text or res.err_text).strip()[:80]!r})")
                return self.lease
            except Exception as exc:
                if classify(exc) is Verdict.INFRA and self.attempts <= self.claim_retries:
                    await self._drop_attempt(exc)
                    continue
                await self.fail(exc)
                raise
            except BaseException:
                await self.abandon(reusable=False)
                raise

    def adopt(self, lease: Lease) -> Lease:
        """Take ``lease``, already claimed (a fork's child: see :meth:`Lease.fork
        <sandpool.core.pool.Lease.fork>`), as this rollout's sandbox instead of claiming one;
        its checkpoints start from the snapshot it was restored from. Returns it.

        Raises:
            PoolClosed: The rollout has ended or already holds a lease.
        """
        if self.ended or self.lease is not None:
            raise errors.PoolClosed(f"{self!r} has ended or holds a lease; adopt into a new Rollout")
        self.attempts = max(self.attempts, 1)
        self.lease = self._acted = lease
        self._sandbox_id = lease.id
        self.checkpoints.start_from(lease.restored_from)
        return lease

    @contextlib.asynccontextmanager
    async def action(self) -> AsyncIterator[Lease]:
        """Guard one policy action on the lease.

        An error that :func:`ends_rollout` ends the rollout as :meth:`fail` does and is
        re-raised; a file errno on the policy's path is re-raised and the rollout goes on.
        An interrupt abandons the rollout and deletes its sandbox (it may still run the
        command).

        Raises:
            PoolClosed: The rollout ended or was never claimed.
        """
        lease = self._active()
        try:
            yield lease
        except Exception as exc:
            if ends_rollout(exc):
                await self.fail(exc)
            raise
        except BaseException:
            await self.abandon(reusable=False)
            raise

    async def step(self, act: Callable[[Lease], Awaitable[T]], *, checkpoint: bool = True) -> T:
        """Run one policy action ``act(lease)``, guarded as :meth:`action` guards it; with
        ``checkpoint="step"`` an infra failure is recovered from the last checkpoint and
        ``act`` runs again, and a checkpoint is taken after it (unless ``checkpoint`` is
        False: an action that changes nothing).

        Raises:
            Whatever ``act`` raised and was not recovered (the rollout ended unless it was a
            file errno on the policy's path).
            PoolClosed: The rollout ended or was never claimed.
        """
        async with self.action():
            return await self.checkpoints.run(self, act, checkpoint=checkpoint)

    async def finish(self) -> RolloutResult:
        """End the episode: capture the policy's change, reset the sandbox (verified, or swapped
        for a pristine one), score the change there, record, release.

        Returns:
            The record (also in :attr:`result`; the grader's score in :attr:`score`).

        Raises:
            FatalError: The pool or backend cannot run sandboxes (not recorded).
            PoolClosed: The rollout ended or was never claimed.
        """
        lease = self._active()
        if self.grader is None:
            raise errors.ConfigError("Rollout.finish needs a grader: pass Rollout(..., grader=...)")
        if lease.broken is not None and not await self.checkpoints.recover(self, lease, lease.broken):
            return await self.fail(lease.broken)  # a sandbox that failed under the policy is never graded
        grader = self.grader
        try:
            patch = await self.checkpoints.run(self, lambda held: grader.capture(held, self.task),
                                               checkpoint=False)
        except Exception as exc:
            return await self.fail(exc)
        except BaseException:
            await self.abandon(reusable=False)
            raise
        return await self._score(patch)

    async def fail(self, exc: Exception) -> RolloutResult:
        """End the rollout on ``exc`` as :func:`~sandpool.core.outcome.ending_of` says (the
        outcome table).

        Returns:
            The record.

        Raises:
            FatalError: ``exc`` itself, when it is fatal (the sandbox is released, nothing
                recorded).
        """
        if self.result is not None:  # one rollout, one record
            return self.result
        ending = ending_of(exc)
        if ending is None:
            await self.abandon(reusable=False)
            raise exc
        if ending.outcome is Outcome.INFRA_FAILED:
            self._count_infra(exc)
        self.error = exc
        return await self._end(ending)

    async def abandon(self, *, reusable: bool = True) -> None:
        """Give the sandbox back without a record (an episode its caller gave up). Idempotent."""
        if self.result is None:
            self._abandoned = True
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.release(reusable=reusable)
            await self.checkpoints.release(lease)

    def _active(self) -> Lease:
        if self.ended or self.lease is None:
            raise errors.PoolClosed(f"{self!r} has ended or never claimed; start a new Rollout")
        return self.lease

    def _count_infra(self, exc: Exception) -> None:
        if not isinstance(exc, errors.InfraError):  # the pool and the lease count their own kinds
            self.pool.counters.infra_error(error_kind(exc))
            self.pool.telemetry.infra_error(error_kind(exc))

    async def _drop_attempt(self, exc: Exception) -> None:
        self._count_infra(exc)
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.release(reusable=False)

    async def _score(self, patch: bytes) -> RolloutResult:
        assert self.grader is not None
        for attempt in range(self.grade_retries + 1):
            try:
                if self.lease is None:  # the last reset found no replacement: claim one
                    self.lease = await self.pool.acquire(self.task)
                else:
                    await self.lease.reset()
                score = await self.grader.score(self.lease, self.task, patch)
            except Exception as exc:
                if classify(exc) is not Verdict.INFRA or attempt == self.grade_retries:
                    return await self.fail(exc)
                self._count_infra(exc)
                if self.lease is not None and self.lease.released:
                    self.lease = None
                elif self.lease is not None and self.lease.broken is None:
                    # Whatever failed, this sandbox is not graded on again: swapped by reset().
                    self.lease.broken = (exc if isinstance(exc, errors.InfraError)
                                         else errors.InfraError(f"{type(exc).__name__}: {exc}"))
                continue
            except BaseException:
                await self.abandon(reusable=False)
                raise
            self.score = score
            return await self._end(scored(score))
        raise AssertionError("unreachable: the last attempt returns")

    async def _end(self, ending: Ending) -> RolloutResult:
        if self.result is not None:  # one rollout, one record
            return self.result
        self.result = RolloutResult(
            task_id=self.task.instance_id, rollout=self.rollout, outcome=ending.outcome,
            reward=ending.reward, attempts=max(self.attempts, 1),
            ttfc_s=self._acted.ttfc_s if self._acted else None, duration_s=time.monotonic() - self._t0,
            error_kind=ending.kind, error=ending.error, policy=self.policy, sandbox_id=self._sandbox_id,
            recoveries=self.recoveries)
        self.pool.telemetry.rollout_done(ending.outcome.value)
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.release(reusable=ending.reusable)
            await self.checkpoints.release(lease)  # after: its sandbox may stack on them
        if self.on_result is not None:
            self.on_result(self.result)
        return self.result

    async def _run(self, episode: Episode) -> RolloutResult:
        while True:
            try:
                lease = await self.claim(probe=False)
            except Exception:
                if self.result is None:  # fatal: not recorded
                    raise
                return self.result
            try:
                value = await episode(StepLease(self) if self.checkpoints.mode else lease)
                if self.lease is not None:
                    lease = self.lease  # a recovery swapped the sandbox under the same lease
                if lease.broken is not None:  # it failed under the policy: never graded
                    raise lease.broken
                if self.grader is None:
                    if value is None:
                        raise TypeError("the episode returned no reward and run_rollout got no grader")
                    return await self._end(Ending(Outcome.COMPLETED, float(value)))
                patch = await self.grader.capture(lease, self.task)
            except Exception as exc:
                if (classify(exc) is Verdict.INFRA and self.attempts <= self.claim_retries
                        and not self.checkpoints.mode):  # checkpointed: its steps recovered
                    await self._drop_attempt(exc)  # the episode again, on a fresh claim
                    continue
                return await self.fail(exc)
            except BaseException:
                await self.abandon(reusable=False)
                raise
            return await self._score(patch)


async def run_rollout(
    pool: SandboxPool,
    task: Task,
    episode: Episode,
    *,
    grader: Grader | None = None,
    rollout: int = 0,
    retries: int = 2,
    grade_retries: int = 2,
    policy: str | None = None,
    checkpoint: str | None = None,
    recoveries: int = 2,
) -> RolloutResult:
    """Run the one-shot ``episode`` on a sandbox claimed for ``task``, then grade it.

    Each attempt claims a fresh sandbox; an infra failure while the policy acts (or its change
    is captured) runs the episode again on a new claim, up to ``retries`` times. Then
    ``grader`` scores the change on a pristine sandbox (see :mod:`sandpool.core.outcome` for
    every outcome). The rollout is one ``sandpool.rollout`` span and one count in
    ``sandpool_rollouts_total`` (see :mod:`sandpool.core.telemetry`).

    Args:
        pool: An open pool.
        task: The task.
        episode: The policy's episode (see :data:`Episode`).
        grader: Scores the episode's change; ``None``: the episode returns its reward.
        rollout: Index of this rollout among the task's rollouts.
        retries: Infra retries of the episode after the first attempt.
        grade_retries: Infra retries of the scoring (same patch, another pristine sandbox).
        policy: Policy name, for the report.
        checkpoint: ``"step"``: every ``exec``, ``read_file`` and ``write_file`` of the
            episode is a step, checkpointed after it; when the sandbox fails under one, the
            episode goes on in a sandbox restored from the last checkpoint and that call runs
            again (up to ``recoveries``; see :mod:`sandpool.core.checkpoint`), instead of
            the episode running again from the start.
        recoveries: Recoveries allowed with ``checkpoint``.

    Returns:
        The :class:`RolloutResult`.

    Raises:
        FatalError: The backend is unusable or the pool closed; no point continuing the batch.
    """
    acct = Rollout(pool, task, grader=grader, rollout=rollout, policy=policy, claim_retries=retries,
                   grade_retries=grade_retries, checkpoint=checkpoint, recoveries=recoveries)
    with Telemetry.span("sandpool.rollout", task_id=task.instance_id, image=task.image,
                        rollout=rollout, policy=policy) as span:
        result = await acct._run(episode)
        span.set_attribute("sandpool.outcome", result.outcome.value)
        span.set_attribute("sandpool.attempts", result.attempts)
    return result
