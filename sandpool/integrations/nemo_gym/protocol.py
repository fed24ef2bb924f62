"""The wire side of the ``sandpool_swe`` server: request and response bodies, NeMo Gym 0.4/0.7
differences, and how a sandpool error becomes an HTTP answer.

Split from :mod:`.server` (which keeps the server class) so that each stays under ~400 lines.
What 0.7 adds is detected by feature, not by version: its typed session bodies
(``ResourcesSeedSessionRequest`` and friends) and ``BaseVerifyResponse.mask_sample``.
"""

from __future__ import annotations

from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym.base_resources_server import (
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
)
from sandpool.core import errors
from sandpool.core.classify import error_kind
from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.outcome import Score
from sandpool.envs.grading import GradeResult
from sandpool.integrations.nemo_gym.sessions import SessionClosed, UnknownSession

try:  # NeMo Gym >= 0.7: Environment Servers seed and close sessions with typed bodies
    from nemo_gym.base_resources_server import (
        ResourcesCloseSessionRequest,
        ResourcesCloseSessionResponse,
        ResourcesSeedSessionRequest,
        ResourcesSeedSessionResponse,
    )
except ImportError:  # NeMo Gym 0.4: cookie-keyed seeds only, no /close_session
    ResourcesCloseSessionRequest = ResourcesCloseSessionResponse = None  # type: ignore[assignment,misc]
    ResourcesSeedSessionRequest = ResourcesSeedSessionResponse = None  # type: ignore[assignment,misc]

#: NeMo Gym >= 0.7 reports a failed verification in a 200 answer with ``mask_sample``.
MASKS_FAILED_VERIFY = "mask_sample" in BaseVerifyResponse.model_fields

#: sandpool's infra kinds in the words of NeMo Gym 0.7's ``nemo_gym.failure_kinds``; any
#: other kind is sent namespaced, as ``sandpool:<kind>`` (0.7's rule for unregistered kinds).
NEMO_FAILURE_KINDS = {
    "sandbox_died": "session_lost",
    "session_expired": "session_expired",
    "sandbox_start": "provider_unavailable",
    "api_error": "provider_unavailable",
    "exec_transport": "transport_peer_drop",
    "infra_timeout": "transport_timeout",
}

__all__ = [
    "MASKS_FAILED_VERIFY",
    "NEMO_FAILURE_KINDS",
    "CloseSessionBody",
    "PrefetchRequest",
    "PrefetchResponse",
    "ReadFileRequest",
    "ReadFileResponse",
    "ResourcesCloseSessionRequest",
    "ResourcesCloseSessionResponse",
    "ResourcesSeedSessionRequest",
    "ResourcesSeedSessionResponse",
    "SandpoolSeedSessionRequest",
    "SandpoolSeedSessionResponse",
    "SandpoolVerifyRequest",
    "SandpoolVerifyResponse",
    "SeedSessionBody",
    "ShellRequest",
    "ShellResponse",
    "WriteFileRequest",
    "WriteFileResponse",
    "error_response",
    "nemo_failure_kind",
    "verify_response",
]


class SandpoolSeedSessionRequest(BaseSeedSessionRequest):
    """The dataset row, as NeMo Gym's agent posts it to ``/seed_session``.

    Attributes:
        instance_id: The task to run, looked up in the configured task source.
        task: Optional inline SWE-bench row, used when the id is not in the task source.
    """

    model_config = ConfigDict(extra="allow")

    instance_id: str = Field(min_length=1)
    task: dict[str, Any] | None = None


class SandpoolSeedSessionResponse(BaseSeedSessionResponse):
    """What ``/seed_session`` reports.

    Attributes:
        instance_id: The task.
        sandbox_id: The sandbox leased for the session.
        workdir: Path of the task repo in the sandbox (relative tool paths start there).
        ttfc_s: Time to first command: claim request to the answer of the first command, s.
    """

    instance_id: str
    sandbox_id: str
    workdir: str
    ttfc_s: float | None = None


class ShellRequest(BaseModel):
    """Run a shell command (``bash -c``) in the task repo.

    Attributes:
        command: The command line.
        timeout_s: Seconds before the command's process group is killed (exit code 124);
            default and cap come from the config.
    """

    command: str
    timeout_s: float | None = Field(default=None, gt=0)


class ShellResponse(BaseModel):
    """A command's result; output is UTF-8 text, each stream capped by the config."""

    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    duration_s: float


class ReadFileRequest(BaseModel):
    """Read a file; a relative ``path`` is relative to the task repo."""

    path: str = Field(min_length=1)


class ReadFileResponse(BaseModel):
    """A file's content as UTF-8 text (invalid bytes become U+FFFD), capped by the config."""

    path: str
    content: str
    size_bytes: int
    truncated: bool


class WriteFileRequest(BaseModel):
    """Write a UTF-8 text file, creating parent directories; relative to the task repo."""

    path: str = Field(min_length=1)
    content: str


class WriteFileResponse(BaseModel):
    """Confirms a write."""

    path: str
    bytes_written: int


class PrefetchRequest(BaseModel):
    """The next batch, to warm while the current one runs (``POST /prefetch``).

    Attributes:
        instance_ids: The next batch's tasks; an id listed twice counts twice. Empty: the
            warm targets the last prefetch raised go back.
        num_repeats: Sessions each listed id will have at once (default: the config's
            ``num_repeats``).
    """

    instance_ids: list[str]
    num_repeats: int | None = Field(default=None, ge=1)


class PrefetchResponse(BaseModel):
    """What ``/prefetch`` started (without waiting for the sandboxes).

    Attributes:
        warm_targets: Image -> the warm target set for it, in sandboxes.
        rejected: Instance id -> why it was left out (unknown id, missing image).
    """

    warm_targets: dict[str, int]
    rejected: dict[str, str]


class SandpoolVerifyRequest(BaseVerifyRequest):
    """NeMo Gym's verify body; the row's extra fields are kept."""

    model_config = ConfigDict(extra="allow")


class SandpoolVerifyResponse(BaseVerifyResponse):
    """The graded outcome; ``reward`` is 1.0 only if every FAIL_TO_PASS/PASS_TO_PASS test passed.

    Attributes:
        instance_id: The task.
        sandbox_id: The sandbox that was graded.
        resolved: Every listed test passed.
        f2p_passed: FAIL_TO_PASS tests that passed.
        f2p_failed: FAIL_TO_PASS tests that did not.
        p2p_passed: PASS_TO_PASS tests that passed.
        p2p_failed: PASS_TO_PASS tests that did not.
        tests_timed_out: The test run hit ``grade_timeout_s`` (scored 0: the policy's code hung).
        grade_error: Why the tests could not be set up (scored 0), else ``None``.
        grade_duration_s: Wall time of the test command, in seconds.
        ttfc_s: The session's time to first command, in seconds.
    """

    model_config = ConfigDict(extra="allow")

    instance_id: str
    sandbox_id: str
    resolved: bool
    f2p_passed: int
    f2p_failed: int
    p2p_passed: int
    p2p_failed: int
    tests_timed_out: bool = False
    grade_error: str | None = None
    grade_duration_s: float = 0.0
    ttfc_s: float | None = None

def nemo_failure_kind(kind: str) -> str:
    """Return NeMo Gym 0.7's ``failure_kind`` for a sandpool error kind (``sandpool:<kind>``
    when 0.7's vocabulary has no such name)."""
    return NEMO_FAILURE_KINDS.get(kind, f"sandpool:{kind}")


def error_response(exc: Exception, result: RolloutResult | None = None) -> JSONResponse:
    """The HTTP answer NeMo Gym's agents act on, for a request that raised ``exc``.

    ``result`` is the record of the rollout ``exc`` ended, as the rollout accountant
    (:mod:`sandpool.core.rollout`) made it: ``infra_failed`` is ``503`` (NeMo Gym raises: a
    failed, retryable rollout, never a reward), ``task_failed`` (the policy's own failure,
    e.g. its processes killed its sandbox) ``400`` with the reason, ``rejected`` (a task that
    cannot run) ``422``. Without a record: a file errno on the policy's path is ``400``, a
    tool result the model sees (the rollout goes on); an unknown or closed session ``409``;
    anything else (the pool cannot run sandboxes) ``503``.
    """
    content: dict[str, Any] = {"kind": error_kind(exc), "message": str(exc)}
    if isinstance(exc, (UnknownSession, SessionClosed)):
        return JSONResponse(status_code=409, content={"outcome": "no_session"} | content)
    if result is not None:
        content = {"kind": result.error_kind or content["kind"], "message": result.error or content["message"]}
        status = {Outcome.INFRA_FAILED: 503, Outcome.TASK_FAILED: 400, Outcome.REJECTED: 422}[result.outcome]
        outcome = {Outcome.INFRA_FAILED: "infra_failed", Outcome.TASK_FAILED: "task_failed",
                   Outcome.REJECTED: "bad_input"}[result.outcome]
        if result.outcome is Outcome.INFRA_FAILED:
            content["failure_kind"] = nemo_failure_kind(content["kind"])
    elif isinstance(exc, errors.SandboxFileError):
        status, outcome = 400, "policy_error"
        if exc.errno is not None:
            content["errno"] = exc.errno
    else:
        status, outcome = 503, "unavailable"
    return JSONResponse(status_code=status, content={"outcome": outcome} | content)


def verify_response(body: BaseVerifyRequest, result: RolloutResult, score: Score | None,
                    sandbox_id: str | None) -> JSONResponse | SandpoolVerifyResponse:
    """The ``/verify`` answer for a rollout the accountant ended as ``result``.

    ``completed``: the graded :class:`SandpoolVerifyResponse`. ``task_failed`` (the policy's
    own failure, e.g. suspected tampering): reward 0, scored, with the reason (not masked on
    0.7: it is a valid measurement of the policy). ``infra_failed`` and ``rejected``: never a
    reward: 0.4's error answer (``503``, ``422``), or 0.7's masked ``200`` the way its own
    ``judge_failsafe`` reports a failed verification; a task that cannot be graded is stamped
    ``_ng_failure_terminal``, so 0.7's resume does not retry it, while an infra failure is
    retried.
    """
    detail = score.detail if score is not None and isinstance(score.detail, GradeResult) else None
    if result.outcome is Outcome.COMPLETED:
        assert detail is not None and result.reward is not None
        return SandpoolVerifyResponse(**(body.model_dump() | dict(
            reward=result.reward, instance_id=result.task_id, sandbox_id=sandbox_id or "",
            resolved=detail.resolved, f2p_passed=detail.f2p_passed, f2p_failed=detail.f2p_failed,
            p2p_passed=detail.p2p_passed, p2p_failed=detail.p2p_failed,
            tests_timed_out=detail.timed_out, grade_error=detail.error,
            grade_duration_s=detail.duration_s, ttfc_s=result.ttfc_s)))
    kind, reason = result.error_kind or "error", (result.error or "")[:2000]
    if result.outcome is Outcome.TASK_FAILED:
        data = body.model_dump(mode="json") | {"reward": 0.0, "outcome": "task_failed", "kind": kind,
                                               "message": reason}
        if MASKS_FAILED_VERIFY:
            data |= {"failure_kind": f"sandpool:{kind}", "failure_reason": reason}
        return JSONResponse(content=jsonable_encoder(data))
    terminal = result.outcome is Outcome.REJECTED
    if not MASKS_FAILED_VERIFY:
        return error_response(errors.SandpoolError(reason), result)
    failure = "verifier_error" if terminal else nemo_failure_kind(kind)
    data = body.model_dump(mode="json")
    instance_config = data.get("instance_config")
    data |= {
        "reward": 0.0, "mask_sample": True, "failure_kind": failure, "failure_reason": reason,
        # Older NeMo RL consumers read the mask from instance_config (as 0.7's judge_failsafe sets it).
        "instance_config": (instance_config if isinstance(instance_config, dict) else {}) | {"mask_sample": True},
        "_ng_failure_class": failure, "outcome": result.outcome.value, "kind": kind,
    }
    if terminal:
        data["_ng_failure_terminal"] = True
    BaseVerifyResponse.model_validate(data)  # the shape 0.7 parses (warns on an unknown kind)
    return JSONResponse(content=jsonable_encoder(data))

#: The ``/seed_session`` body: a dataset row, or (NeMo Gym >= 0.7) an Environment Server's seed.
SeedSessionBody = (SandpoolSeedSessionRequest if ResourcesSeedSessionRequest is None
                   else ResourcesSeedSessionRequest | SandpoolSeedSessionRequest)
CloseSessionBody = ResourcesCloseSessionRequest
