"""Episodes that survive an infra failure: a checkpoint after each step, recovery from it.

With ``checkpoint="step"`` (:class:`~sandpool.core.rollout.Rollout`,
:func:`~sandpool.core.rollout.run_rollout`, Gymnasium's ``checkpoint_every=1``) the rollout's
accountant takes a snapshot of the sandbox after every policy action that completed
(:meth:`Lease.snapshot <sandpool.core.pool.Lease.snapshot>`). When an action fails because the
sandbox failed (an infra error: it died, its channel broke), the lease gets a fresh sandbox
restored from the last checkpoint and verified (:meth:`Lease.replace
<sandpool.core.pool.Lease.replace>`; before the first checkpoint, a fresh sandbox at the
task's commit), and the action that was in flight runs again there. The episode goes on; the
rollout counts the recovery (``RolloutResult.recoveries``, ``PoolCounters.recoveries``).

Why the policy cannot use it to escape a bad reward: only an infra error is recovered (the
policy's own failures, its processes exhausting the sandbox's budget included, end the
rollout as before), and the checkpoint is the state after the last action that completed, so
nothing the policy did is undone; the action in flight, whose result the policy never saw,
runs again from the state it started in. Processes do not survive (a snapshot holds none).
A rollout that cannot recover (``recoveries`` used up, no sandbox could be restored, or the
checkpoint of the last completed action could not be taken) ends ``infra_failed``.

What a checkpoint costs is what changed since the one before (see the backend's snapshots);
each new checkpoint lets the previous one's data go.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sandpool.core import errors
from sandpool.core.classify import Verdict, classify
from sandpool.core.snapshot import Snapshot

if TYPE_CHECKING:
    from sandpool.core.pool import Lease
    from sandpool.core.rollout import Rollout

__all__ = ["CHECKPOINT_MODES", "Checkpoints", "StepLease"]

T = TypeVar("T")

#: Values of ``checkpoint=``: ``None`` (no checkpoints), ``"step"`` (after every action).
CHECKPOINT_MODES = (None, "step")


class Checkpoints:
    """The checkpoints and recoveries of one rollout (see the module docstring).

    Args:
        mode: ``None`` or ``"step"``.
        max_recoveries: Recoveries allowed in the rollout.

    Attributes:
        last: The last checkpoint (None: the state the lease was claimed in).
        recoveries: Recoveries made.
    """

    def __init__(self, mode: str | None, max_recoveries: int) -> None:
        if mode not in CHECKPOINT_MODES:
            raise errors.ConfigError(f"checkpoint={mode!r} is not known; use one of {list(CHECKPOINT_MODES)}")
        if max_recoveries < 0:
            raise errors.ConfigError(f"recoveries={max_recoveries}: must be >= 0")
        self.mode = mode
        self.max_recoveries = max_recoveries
        self.last: Snapshot | None = None
        self.recoveries = 0
        self._current = True  # the last checkpoint (or the claim) is the state now
        self._owned = True  # the last checkpoint is this rollout's own (its data may go)

    def __repr__(self) -> str:
        return f"<Checkpoints {self.mode} last={self.last.id if self.last else None} recoveries={self.recoveries}>"

    async def run(self, rollout: Rollout, act: Callable[[Lease], Awaitable[T]], *,
                  checkpoint: bool = True) -> T:
        """Run ``act`` on the rollout's lease; recover and run it again after an infra failure
        (up to the limit); take a checkpoint after it (``checkpoint``). An error that is not
        recovered is raised as ``act`` raised it."""
        while True:
            lease = rollout._active()
            try:
                result = await act(lease)
            except errors.SandboxFileError:  # a result the policy sees: the step happened
                if checkpoint:
                    await self.take(lease)
                raise
            except Exception as exc:
                if await self.recover(rollout, lease, exc):
                    continue
                raise
            if checkpoint:
                await self.take(lease)
            return result

    async def take(self, lease: Lease) -> None:
        """Checkpoint the lease's sandbox now (with ``mode="step"``); the previous checkpoint's
        data goes. A failure to take it (the sandbox failed, or the backend refused it) leaves
        no checkpoint of the state now: a later infra failure then ends the rollout rather than
        resume from an older state."""
        if self.mode is None:
            return
        try:
            snap = await lease.snapshot()
        except (errors.InfraError, errors.ConfigError):  # (ConfigError: e.g. a change set too big)
            self._current = False
            return
        old, owned = self.last, self._owned
        self.last, self._current, self._owned = snap, True, True
        if old is not None and owned:
            await lease.discard_snapshot(old, keep=snap)

    def start_from(self, snap: Snapshot | None) -> None:
        """The lease was claimed in ``snap``'s state (a fork's child): recover to it until the
        first checkpoint of this rollout. It is not this rollout's: its data stays."""
        self.last, self._current, self._owned = snap, True, snap is None

    async def recover(self, rollout: Rollout, lease: Lease, exc: Exception) -> bool:
        """After ``exc`` failed an action on ``lease``: when it is infra and a recovery is
        allowed, put a sandbox restored from the last checkpoint under the lease; whether
        it did."""
        if (self.mode is None or classify(exc) is not Verdict.INFRA or not self._current
                or self.recoveries >= self.max_recoveries):
            return False
        rollout._count_infra(exc)
        try:
            await lease.replace(self.last)
        except Exception as again:  # noqa: BLE001 - no sandbox: the rollout ends on the first error
            if classify(again) is Verdict.FATAL:
                raise
            return False
        self.recoveries += 1
        rollout.pool.counters.recoveries += 1
        rollout._sandbox_id = lease.id
        return True

    async def release(self, lease: Lease | None) -> None:
        """The rollout ended: its last checkpoint's data goes."""
        last, self.last = self.last, None
        if last is not None and lease is not None and self._owned:
            await lease.discard_snapshot(last)


class StepLease:
    """What a one-shot episode of a checkpointing rollout acts on: the rollout's lease, with
    every :meth:`exec`, :meth:`read_file` and :meth:`write_file` a step (recovered and
    checkpointed, see the module docstring). Everything else is the lease's."""

    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rollout._active(), name)

    def __repr__(self) -> str:
        return f"<StepLease {self._rollout.lease!r}>"

    async def exec(self, cmd: str | list[str], **kwargs: Any) -> Any:
        """A step: :meth:`Lease.exec <sandpool.core.pool.Lease.exec>`."""
        return await self._rollout.step(lambda lease: lease.exec(cmd, **kwargs))

    async def read_file(self, path: str) -> bytes:
        """A step that changes nothing (no checkpoint after it): :meth:`Lease.read_file
        <sandpool.core.pool.Lease.read_file>`."""
        return await self._rollout.step(lambda lease: lease.read_file(path), checkpoint=False)

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """A step: :meth:`Lease.write_file <sandpool.core.pool.Lease.write_file>`."""
        await self._rollout.step(lambda lease: lease.write_file(path, data, mode=mode))
