"""The one failure classifier: every error class of the tree, and errors it does not know."""

from __future__ import annotations

import asyncio
import errno
import inspect

import pytest

from sandpool.core import errors
from sandpool.core.classify import Verdict, classify, error_kind
from sandpool.core.metrics import Outcome


def _instances():
    for name in errors.__all__:
        cls = getattr(errors, name)
        if inspect.isclass(cls) and issubclass(cls, errors.SandpoolError):
            yield cls(*(("x", 1) if cls is errors.SandboxFileError else ("x",)))


@pytest.mark.parametrize("exc", list(_instances()), ids=lambda e: type(e).__name__)
def test_every_error_of_the_tree_has_one_verdict_by_its_branch(exc):
    verdict = classify(exc)
    if isinstance(exc, errors.TaskError):
        assert verdict is Verdict.POLICY and verdict.outcome is Outcome.TASK_FAILED and verdict.scored
    elif isinstance(exc, errors.InfraError):
        assert verdict is Verdict.INFRA and verdict.outcome is Outcome.INFRA_FAILED and verdict.retryable
    elif isinstance(exc, errors.InputError):
        assert verdict is Verdict.INPUT and verdict.outcome is Outcome.REJECTED and not verdict.scored
    elif isinstance(exc, errors.FatalError):
        assert verdict is Verdict.FATAL and verdict.outcome is None
    else:  # the bare base class says nothing of whose fault it is: never scored
        assert verdict is Verdict.INFRA
    assert error_kind(exc) == exc.kind


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.EISDIR, errno.ENOENT, errno.ENOSPC,
                                  errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EDQUOT])
def test_a_file_errno_on_the_policys_path_is_the_policys_result(code):
    exc = errors.sandbox_file_error(code, "/etc/foo", "in sandbox sb-1")
    assert isinstance(exc, OSError) and exc.errno == code and exc.filename == "/etc/foo"
    assert classify(exc) is Verdict.POLICY
    assert error_kind(exc) == ("disk_quota" if code in (errno.ENOSPC, errno.EDQUOT) else "file_error")
    assert errno.errorcode[code] in str(exc) and "/etc/foo" in str(exc)


def test_file_errors_keep_the_builtin_subclasses_callers_catch():
    assert isinstance(errors.sandbox_file_error(errno.ENOENT, "a"), FileNotFoundError)
    assert isinstance(errors.sandbox_file_error(errno.EACCES, "a"), PermissionError)
    assert isinstance(errors.sandbox_file_error(errno.EISDIR, "a"), IsADirectoryError)
    assert isinstance(errors.sandbox_file_error(errno.ENOTDIR, "a"), NotADirectoryError)


@pytest.mark.parametrize("exc", [KeyError("k"), RuntimeError("bug"), TimeoutError(),
                                 OSError(errno.ENOSPC, "host disk full"), ValueError("v")],
                         ids=lambda e: type(e).__name__)
def test_an_error_sandpool_does_not_know_is_infra_never_scored(exc):
    # A bug, or a host-side OSError, must never become reward 0 for the policy.
    assert classify(exc) is Verdict.INFRA and not classify(exc).scored
    assert error_kind(exc) in ("timeout", f"unexpected:{type(exc).__name__}")


@pytest.mark.parametrize("exc", [asyncio.CancelledError(), KeyboardInterrupt(), SystemExit(1)],
                         ids=lambda e: type(e).__name__)
def test_cancellation_is_not_a_rollout_failure(exc):
    with pytest.raises(TypeError, match="propagate"):
        classify(exc)
