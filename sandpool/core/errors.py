"""The one error tree of sandpool, split by what the caller should do next.

```
SandpoolError
├── InfraError                  retry: the rollout ends `infra_failed`, never reward 0
│   ├── SandboxStartError       a sandbox could not be created or did not become ready
│   ├── SandboxDied             the sandbox vanished mid-use (killed, evicted, deleted)
│   ├── ExecTransportError      the command channel broke (no answer, garbled frame)
│   ├── InfraTimeout            an infra operation (claim, reset, create) ran out of time
│   ├── ResetError              a sandbox's repo could not be made identical to its image
│   └── ApiError                the control plane kept failing (429/5xx) after retries
├── InputError                  fix the input: the message names the field and the fix
│   ├── TaskValidationError     a malformed task row
│   ├── ImageNotFound           a task names an image that was never built or pulled
│   ├── ConfigError             a bad option or config file key
│   └── BrokenTaskError         the task cannot be graded as given, proven on its pristine tree
│                               (test_patch does not apply to base, no test command, a test
│                               file absent at base): the task is `rejected`, never scored
├── TaskError                   the policy's own failure: the rollout ends `task_failed`
│   ├── TamperingSuspected      grading's verdict sources disagree (structured report, log,
│   │                           exit status, counts): scored not resolved, evidence kept
│   ├── PatchRefused            the policy's change cannot be graded as a patch (over the size
│   │                           cap, refused by the patch policy): scored 0, reason kept
│   ├── SandboxFileError        a file operation failed on the policy's path (errno: EACCES, EROFS, ...)
│   │   └── DiskQuotaExceeded   ENOSPC/EDQUOT: the policy filled its sandbox's disk quota
│   └── SandboxExhausted        the policy's processes exhausted the sandbox's own budget, shown by
│                               its cgroup's OOM or pid events (a death without them is SandboxDied)
└── FatalError                  give up: the environment cannot run sandboxes at all
    ├── BackendUnavailable      bubblewrap missing, CRDs missing, RBAC denied, ...
    └── PoolClosed              use of a pool (or lease) after close
```

Lower-layer errors (bubblewrap, OS, Kubernetes client, httpx) are translated into this tree
at one boundary per backend, so callers only ever catch these classes. Which outcome an error
means (scored, retried, rejected) is decided in one place: :func:`sandpool.core.classify.classify`.
"""

from __future__ import annotations

import errno as _errno
import os as _os

__all__ = [
    "ApiError",
    "BackendUnavailable",
    "BrokenTaskError",
    "ConfigError",
    "ContextWindowExceeded",
    "DiskQuotaExceeded",
    "ExecTransportError",
    "FatalError",
    "ImageNotFound",
    "PatchRefused",
    "InfraError",
    "InfraTimeout",
    "InputError",
    "PoolClosed",
    "ResetError",
    "SandboxDied",
    "SandboxExhausted",
    "SandboxFileError",
    "SandboxStartError",
    "SandpoolError",
    "ServiceKilled",
    "TamperingSuspected",
    "TaskError",
    "TaskValidationError",
    "sandbox_file_error",
]


class SandpoolError(Exception):
    """Base class of every error sandpool raises on purpose."""

    #: Short machine-readable kind used in reports (``failures by kind``).
    kind: str = "error"


class InfraError(SandpoolError):
    """Infrastructure failed under the rollout; retryable, and never scored as a reward."""

    kind = "infra"


class SandboxStartError(InfraError):
    """A sandbox could not be started or never became ready."""

    kind = "sandbox_start"


class SandboxDied(InfraError):
    """A sandbox died while leased (killed, OOM-killed, evicted, or its pod deleted) with no
    evidence that its own processes caused it: infra, whatever killed it (the host's OOM
    killer, an operator, the node). See :class:`SandboxExhausted` for the other case."""

    kind = "sandbox_died"


class ExecTransportError(InfraError):
    """The channel that carries commands into the sandbox failed."""

    kind = "exec_transport"


class InfraTimeout(InfraError):
    """An infra operation (claim, reset, create, readiness) exceeded its timeout."""

    kind = "infra_timeout"


class ResetError(InfraError):
    """A sandbox's repo (``.git`` included) could not be restored to its image's state.

    The sandbox must not be used again: the pool quarantines it, and grading that needs a
    pristine ``.git`` cannot proceed on it.
    """

    kind = "reset"


class ApiError(InfraError):
    """The control plane answered with errors (429/5xx) until the retry budget ran out.

    Args:
        message: What was attempted and what the server said.
        status: The last HTTP status code, or ``None`` for connection errors.
    """

    kind = "api"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class InputError(SandpoolError, ValueError):
    """The caller's input is wrong; retrying will not help. The message names the fix."""

    kind = "input"


class TaskValidationError(InputError):
    """A task row is malformed.

    Args:
        message: Which field is wrong and how to fix it.
        row: 1-based row number in the source file, when known.
        field: The offending field name, when known.
    """

    kind = "task_validation"

    def __init__(self, message: str, *, row: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.row = row
        self.field = field


class ImageNotFound(InputError):
    """A task names an image that is not present (not built locally, not pullable)."""

    kind = "image_not_found"


class ConfigError(InputError):
    """An option or configuration key has an invalid value."""

    kind = "config"


class BrokenTaskError(InputError):
    """The task cannot be graded as given; shown on its pristine tree, not the policy's.

    Raised by grading when the fault is the task's: its ``test_patch`` does not apply to
    ``base_commit``, a test file is neither at ``base_commit`` nor added by the test patch, the
    harness has no test command for its ``repo``/``version``, or ``sandpool validate`` found
    that the gold patch does not resolve it (or the empty patch does). The rollout is
    ``rejected``: never scored, always counted.

    Args:
        message: What is broken and how to fix the row.
        task_id: The task's ``instance_id``, when known.
    """

    kind = "broken_task"

    def __init__(self, message: str, *, task_id: str | None = None) -> None:
        super().__init__(message)
        self.task_id = task_id


class TaskError(SandpoolError):
    """The policy failed on its own (its error, or its command's timeout): ``task_failed``."""

    kind = "task"


class TamperingSuspected(TaskError):
    """Grading's independent verdict sources disagree: the policy's code forged a result.

    The rollout is scored not resolved (reward 0) and the evidence is kept.

    Args:
        message: One line saying which sources disagree.
        evidence: Each disagreement found, one sentence each.
    """

    kind = "tampering_suspected"

    def __init__(self, message: str, *, evidence: tuple[str, ...] = ()) -> None:
        super().__init__(message if not evidence else f"{message}: " + "; ".join(evidence))
        self.evidence = evidence


class PatchRefused(TaskError):
    """The policy's change to the repo cannot be graded as a patch: it is over the size cap,
    its tree cannot be diffed against the base commit, or the patch policy refuses it
    (:mod:`sandpool.envs.grading.policy`). The policy's failure: scored 0, reason kept."""

    kind = "patch_policy"


class SandboxFileError(TaskError, OSError):
    """A file operation in the sandbox failed because of the policy's path or the state the
    policy left (permission denied, read-only file system, a directory, no such file, disk
    full within its quota). A result for the policy to see, never an infra failure.

    It is an :class:`OSError` with ``errno``, ``strerror`` and ``filename`` set, and the
    errno's builtin subclass where there is one (``FileNotFoundError``, ``PermissionError``,
    ``IsADirectoryError``, ...), so ``except FileNotFoundError`` keeps working. Build it with
    :func:`sandbox_file_error`.
    """

    kind = "file_error"

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror} ({_errno.errorcode.get(self.errno or 0, self.errno)})"


class _FileNotFound(SandboxFileError, FileNotFoundError):
    pass


class _Permission(SandboxFileError, PermissionError):
    pass


class _IsADirectory(SandboxFileError, IsADirectoryError):
    pass


class _NotADirectory(SandboxFileError, NotADirectoryError):
    pass


class _FileExists(SandboxFileError, FileExistsError):
    pass


class DiskQuotaExceeded(SandboxFileError):
    """``ENOSPC`` (or ``EDQUOT``) inside a sandbox: the policy wrote more than the sandbox's
    disk quota (``ResourceLimits.disk_bytes``). The policy's result; the sandbox stays usable
    and its in-place reset frees what was written."""

    kind = "disk_quota"


_BY_ERRNO: dict[int, type[SandboxFileError]] = {
    _errno.ENOENT: _FileNotFound, _errno.EACCES: _Permission, _errno.EPERM: _Permission,
    _errno.EISDIR: _IsADirectory, _errno.ENOTDIR: _NotADirectory, _errno.EEXIST: _FileExists,
    _errno.ENOSPC: DiskQuotaExceeded, _errno.EDQUOT: DiskQuotaExceeded,
}


def sandbox_file_error(code: int, path: str, detail: str | None = None) -> SandboxFileError:
    """Return the :class:`SandboxFileError` for errno ``code`` on ``path`` inside a sandbox.

    Args:
        code: The errno (``errno.EACCES``, ``errno.EROFS``, ...).
        path: The path as the policy gave it.
        detail: Extra text (the sandbox id); the strerror of ``code`` is always included.

    Returns:
        An instance of the errno's subclass (``FileNotFoundError`` for ``ENOENT``, ...).
    """
    text = _os.strerror(code) + (f" ({detail})" if detail else "")
    return _BY_ERRNO.get(code, SandboxFileError)(code, text, path)


class SandboxExhausted(TaskError):
    """The sandbox's agent died or was refused a thread, and the kernel counted the budget it
    lives in exhausted by the sandbox's own processes (a memory-cgroup OOM or a refused fork in
    its group): the policy's failure, scored. Decided by that evidence, never by how the agent
    died: the policy cannot signal it, so a death without the evidence is
    :class:`SandboxDied`, and a refusal without it an infra ``ExecTransportError``. Locally the
    host reads the sandbox's cgroup; on Kubernetes the agent reads its own group's pid
    controller from inside its container, and a death counts only when the kubelet reports
    the container ``OOMKilled``. Also raised when restoring the repo from the image ran out of
    time with the rollout's own paths over a bound there (counted on the host). A sandbox
    still alive afterwards is reset in place as any other (the reset kills what held its
    budget); a dead one is deleted."""

    kind = "sandbox_exhausted"


class ServiceKilled(TaskError):
    """The sandbox lives but its service (e.g. the OpenHands agent-server) was killed or
    stopped, or its limits changed: only a process inside, running as the service's uid, can
    send the SIGKILL or SIGSTOP it cannot catch (or ``prlimit`` it), so it is the policy's
    failure, scored (as :class:`SandboxExhausted`). The reset quarantines the sandbox."""

    kind = "service_killed"


class ContextWindowExceeded(TaskError):
    """The policy's model ran out of context window: its own prompt (its messages and the
    outputs it asked for) grew past what the model takes. The policy's failure, scored, like
    running out of steps; as infra, a failing policy could turn its reward 0 into an
    unscored, retried rollout by reading huge outputs. Raised by integrations whose agent
    loop sees its LLM's context error (OpenHands' ``LLMContextWindowExceedError``)."""

    kind = "context_window_exceeded"


class FatalError(SandpoolError):
    """The environment cannot provide sandboxes at all; stop and fix the setup."""

    kind = "fatal"


class BackendUnavailable(FatalError):
    """A backend's preflight failed (missing binary, missing CRDs, denied permission)."""

    kind = "backend_unavailable"


class PoolClosed(FatalError):
    """A pool or lease was used after it was closed."""

    kind = "pool_closed"
