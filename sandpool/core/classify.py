"""The one failure classifier: whose fault an error is, and so what becomes of the rollout.

Every caller that ends a rollout (``run_rollout``, the batch runner, the Gymnasium session,
the NeMo Gym server, the OpenHands integration) asks :func:`classify` instead of deciding for
itself, the way httpx maps every transport exception at one boundary. The rules:

=================================================  ==========  ===========================
error                                              verdict     the rollout / task
=================================================  ==========  ===========================
``TaskError`` (the policy's error, its command's   ``POLICY``  ``task_failed``, scored
timeout, ``SandboxFileError``: EACCES, EROFS,
EISDIR, ENOENT, ENOSPC on the policy's path;
``SandboxExhausted``: the sandbox's budget spent,
shown by its cgroup's OOM or pid events)
``InfraError`` (start failure, death, transport,   ``INFRA``   retried, then
checkout/reset/claim timeout, API errors),                     ``infra_failed``, never scored
``TimeoutError``, and any error sandpool does not
know (a bug is never scored as reward 0)
``InputError`` (a bad row, an unknown image, a     ``INPUT``   ``rejected`` with its reason;
base commit not in the image, a broken task)                   the batch goes on
``FatalError`` (backend unusable, pool closed)     ``FATAL``   stop the run
=================================================  ==========  ===========================

Usage::

    try:
        reward = await episode(lease)
    except Exception as exc:
        verdict = classify(exc)
        if verdict is Verdict.INFRA: ...retry...
        outcome = verdict.outcome       # Outcome.TASK_FAILED / INFRA_FAILED / REJECTED
        kind = error_kind(exc)          # "file_error", "sandbox_died", "unexpected:KeyError"

``asyncio.CancelledError`` and ``KeyboardInterrupt`` are not failures of a rollout: callers let
them propagate, and :func:`classify` refuses them.
"""

from __future__ import annotations

import enum

from sandpool.core import errors
from sandpool.core.metrics import Outcome

__all__ = ["Verdict", "classify", "error_kind"]


class Verdict(str, enum.Enum):
    """Whose fault an error is."""

    POLICY = "policy"  #: the policy's own doing: scored (task_failed, reward 0)
    INFRA = "infra"  #: the infrastructure's: retried, never scored
    INPUT = "input"  #: the task's input: the task is rejected with its reason
    FATAL = "fatal"  #: nothing can run: stop

    @property
    def outcome(self) -> Outcome | None:
        """The rollout outcome this verdict gives (``None`` for ``FATAL``: the run stops)."""
        return _OUTCOME[self]

    @property
    def scored(self) -> bool:
        """True when a rollout ending this way counts toward the reward (``POLICY`` only)."""
        return self is Verdict.POLICY

    @property
    def retryable(self) -> bool:
        """True when a fresh sandbox may succeed (``INFRA`` only)."""
        return self is Verdict.INFRA


_OUTCOME = {Verdict.POLICY: Outcome.TASK_FAILED, Verdict.INFRA: Outcome.INFRA_FAILED,
            Verdict.INPUT: Outcome.REJECTED, Verdict.FATAL: None}


def classify(exc: BaseException) -> Verdict:
    """Say whose fault ``exc`` is.

    Args:
        exc: An exception raised while claiming, acting in, grading or releasing a sandbox.

    Returns:
        The :class:`Verdict` (see the module table).

    Raises:
        TypeError: ``exc`` is a cancellation or interrupt (``asyncio.CancelledError``,
            ``KeyboardInterrupt``, ``SystemExit``), which is not a rollout's failure.
    """
    if not isinstance(exc, Exception):
        raise TypeError(f"{type(exc).__name__} is not a rollout failure; let it propagate")
    # The order matters: SandboxFileError is also an OSError, InputError also a ValueError.
    if isinstance(exc, errors.TaskError):
        return Verdict.POLICY
    if isinstance(exc, errors.InfraError):
        return Verdict.INFRA
    if isinstance(exc, errors.InputError):
        return Verdict.INPUT
    if isinstance(exc, errors.FatalError):
        return Verdict.FATAL
    # TimeoutError from an infra wait, OSError of the host, a bug: not the policy's doing, so
    # never scored; counted as infra under its own kind.
    return Verdict.INFRA


def error_kind(exc: BaseException) -> str:
    """The short kind reported under ``failures by kind``.

    Returns:
        ``exc.kind`` for sandpool errors; ``"timeout"`` for a bare ``TimeoutError``;
        ``"unexpected:<TypeName>"`` for anything else.
    """
    if isinstance(exc, errors.SandpoolError):
        return exc.kind
    if isinstance(exc, TimeoutError):
        return "timeout"
    return f"unexpected:{type(exc).__name__}"
