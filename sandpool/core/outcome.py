"""What a rollout's end is: the rollout accountant's outcome table.

:func:`~sandpool.core.classify.classify` says whose a failure is; this module turns that, or the
:class:`Score` a :class:`Grader` gives, into the rollout's outcome, its reward, its error kind
and whether its sandbox may be reused (an :class:`Ending`). The accountant
(:mod:`sandpool.core.rollout`) records it, so one event has one outcome on every adapter:

========================================================  ================  =======
what happened                                             outcome           reward
========================================================  ================  =======
the grader scored the submission                          ``completed``     score
its :attr:`Score.failure` (suspected tampering, a         ``task_failed``   0.0
refused patch, its code broke the test run)
the policy's error (``TaskError``: its own exception, its ``task_failed``   0.0
processes killed or starved the sandbox, a file errno it
left unhandled) while it acts or its change is captured
infra (``InfraError``, a host ``OSError``, an error       ``infra_failed``  None
sandpool does not know), after the accountant's retries
the input's (``InputError``: a bad row, an unknown        ``rejected``      None
image, a base commit not in it, a broken task, e.g. one
whose tests run neither on the pristine repo nor with
its gold patch)
========================================================  ================  =======

A file errno on the policy's path in one guarded action ends nothing (:func:`ends_rollout`):
it is a result the policy sees. ``FatalError`` (backend unusable, pool closed) is no ending:
the run stops. Never is an infra event a reward, and never is a policy failure dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sandpool.core import errors
from sandpool.core.classify import classify, error_kind
from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.telemetry import Telemetry

if TYPE_CHECKING:
    from sandpool.core.pool import Lease
    from sandpool.core.task import Task

__all__ = ["Ending", "Grader", "Score", "ending_of", "ends_rollout", "repeat_result", "scored",
           "unrun_result"]


@dataclass(frozen=True)
class Score:
    """What a grader says about one submission.

    Attributes:
        reward: 0.0 .. 1.0 (1.0 resolved).
        failure: Set when the submission broke the rules or its grading (suspected tampering,
            a refused patch, its code broke the test run): the rollout is ``task_failed``,
            reward 0, and this reason is kept.
        kind: The error kind reported for ``failure`` (``"tampering_suspected"``,
            ``"patch_policy"``, ``"grading"``).
        detail: The grader's full result, for callers that show it.
    """

    reward: float
    failure: str | None = None
    kind: str | None = None
    detail: object = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"Score.reward={self.reward}: must be within 0.0 .. 1.0")


class Grader(Protocol):
    """Grades a rollout's submission: the policy's change, scored on a pristine sandbox.

    ``capture(lease, task)`` returns the policy's change to the repo as a patch (bounded),
    raising ``TaskError`` when it cannot be taken as the policy left it (e.g. oversized).
    ``score(sandbox, task, patch)`` scores it on ``sandbox``, verified pristine at
    ``task.base_commit``, raising ``BrokenTaskError`` when the task cannot be graded as given.
    Either raises ``InfraError`` when the sandbox fails.
    """

    async def capture(self, lease: Lease, task: Task) -> bytes: ...

    async def score(self, sandbox: Lease, task: Task, patch: bytes) -> Score: ...


@dataclass(frozen=True)
class Ending:
    """How one rollout ends: a row of the module table.

    Attributes:
        outcome: The :class:`~sandpool.core.metrics.Outcome`.
        reward: 0.0 .. 1.0 when scored, else None.
        kind: The error kind (``failures by kind``), None when it completed.
        error: The reason, None when it completed.
        reusable: Whether its sandbox may go back to the pool (reset in place, verified).
    """

    outcome: Outcome
    reward: float | None
    kind: str | None = None
    error: str | None = None
    reusable: bool = True


def scored(score: Score) -> Ending:
    """The ending of a submission the grader scored: ``completed`` with its reward, or
    ``task_failed`` (0.0) with its :attr:`Score.failure`."""
    if score.failure is not None:
        return Ending(Outcome.TASK_FAILED, 0.0, score.kind or errors.TaskError.kind, score.failure)
    return Ending(Outcome.COMPLETED, float(score.reward))


def ending_of(exc: Exception) -> Ending | None:
    """The ending an error gives the rollout it ended, as :func:`classify` places it; None for
    a ``FatalError`` (the caller raises it: nothing is recorded)."""
    verdict = classify(exc)
    if verdict.outcome is None:
        return None
    return Ending(verdict.outcome, 0.0 if verdict.scored else None, error_kind(exc), str(exc),
                  reusable=isinstance(exc, errors.SandpoolError))


def ends_rollout(exc: BaseException) -> bool:
    """Whether ``exc``, raised by one policy action, ends the rollout.

    A file errno on the policy's path (:class:`~sandpool.core.errors.SandboxFileError`) is a
    result the policy sees, and the rollout goes on; anything else ends it.
    """
    return not isinstance(exc, errors.SandboxFileError)


def unrun_result(task_id: str, exc: Exception, *, rollout: int = 0, row: int | None = None,
                 telemetry: Telemetry | None = None) -> RolloutResult:
    """The record of a rollout that never claimed a sandbox: its row was bad, or its task's
    image could not be had (``rejected`` or ``infra_failed`` as :func:`classify` says).

    Raises:
        FatalError: ``exc`` itself, when it is fatal.
    """
    ending = ending_of(exc)
    if ending is None:
        raise exc
    assert ending.reward is None  # nothing ran: nothing to score
    if telemetry is not None:
        telemetry.rollout_done(ending.outcome.value)
    return RolloutResult(task_id=task_id, rollout=rollout, outcome=ending.outcome, attempts=0,
                         error_kind=ending.kind, error=ending.error, row=row)


def repeat_result(first: RolloutResult, rollout: int, *, telemetry: Telemetry | None = None) -> RolloutResult:
    """The record of another rollout of a task an earlier one found ``rejected``: the same
    outcome and reason, without running it."""
    if first.outcome is not Outcome.REJECTED:
        raise ValueError(f"only a rejected task's rollouts are repeated, not {first.outcome.value}")
    if telemetry is not None:
        telemetry.rollout_done(first.outcome.value)
    return first.model_copy(update={"rollout": rollout, "policy": None, "attempts": 0,
                                    "sandbox_id": None, "duration_s": 0.0, "ttfc_s": None})
