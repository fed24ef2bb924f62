"""In-place reset: bring a used sandbox back to a task's pristine state, then prove it.

Reset = kill stray processes, ``git reset --hard``, ``git clean -ffdx``, check out the base
commit, clear ``/tmp``. Verification = ``git status --porcelain --ignored`` is empty, ``HEAD``
is the base commit, and no process but the sandbox's agent is left. The same steps run in a
bubblewrap sandbox and in a pod: they only use :class:`~sandpool.core.base.Sandbox` methods.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from sandpool.core.base import Sandbox
from sandpool.core.errors import InfraError, InfraTimeout, InputError

__all__ = ["ResetOutcome", "checkout", "reset_in_place", "verify"]

_GIT = "git -c advice.detachedHead=false -c core.hooksPath=/dev/null"
_SEP = "@@sandpool-verify@@"


@dataclass(frozen=True)
class ResetOutcome:
    """Result of a reset attempt.

    Attributes:
        ok: True when every check passed; the sandbox may be handed out again.
        problems: What failed, one sentence each (empty when ``ok``).
        killed: Stray processes killed.
    """

    ok: bool
    problems: tuple[str, ...] = ()
    killed: int = 0


async def verify(sandbox: Sandbox, commit: str, *, timeout: float = 30.0) -> list[str]:
    """Check that ``sandbox`` is pristine at ``commit``; return the problems found (empty = ok).

    Raises:
        InfraError: The sandbox could not be reached.
    """
    res = await sandbox.exec(
        f"{_GIT} rev-parse HEAD && echo {_SEP} && "
        f"{_GIT} status --porcelain --ignored --untracked-files=all && echo {_SEP} && ls -A /tmp",
        timeout=timeout,
    )
    if not res.ok:
        return [f"git status failed (exit {res.exit_code}): {res.err_text.strip()[:200]}"]
    head, status, tmp = (part.split() if i != 1 else part.splitlines()
                         for i, part in enumerate(res.text.split(_SEP + "\n")))
    problems: list[str] = []
    if head != [commit]:
        problems.append(f"HEAD is {' '.join(head) or '?'}, expected {commit}")
    if status:
        problems.append(f"working tree not clean: {status[:5]}")
    if tmp:
        problems.append(f"/tmp not empty: {tmp[:5]}")
    procs = await sandbox.processes()
    if procs:
        problems.append(f"processes left: {procs[:5]}")
    return problems


async def checkout(sandbox: Sandbox, commit: str, *, timeout: float = 60.0) -> None:
    """Check out ``commit`` (detached, forced) in the sandbox's workdir and confirm HEAD.

    Raises:
        InputError: The commit does not exist in the image's repo (the task's
            ``base_commit`` does not belong to its ``image``): the task is rejected.
        InfraTimeout: The checkout ran out of time (infra, retried).
        InfraError: The sandbox could not be reached, or the commit exists and the
            checkout still failed.
    """
    c = shlex.quote(commit)
    res = await sandbox.exec(
        f"{_GIT} checkout -q -f --detach {c} && test \"$({_GIT} rev-parse HEAD)\" = {c}",
        timeout=timeout,
    )
    if res.ok:
        return
    if res.timed_out:  # a slow sandbox, not a bad task
        raise InfraTimeout(f"checking out {commit} in sandbox {sandbox.id} took over {timeout:.0f} s")
    probe = await sandbox.exec(f"{_GIT} cat-file -e {c}^{{commit}}", timeout=timeout)
    if probe.timed_out:
        raise InfraTimeout(f"looking up {commit} in sandbox {sandbox.id} took over {timeout:.0f} s")
    if probe.ok:  # the commit is there and still would not check out: the sandbox is at fault
        raise InfraError(f"checkout of {commit} failed in sandbox {sandbox.id} "
                         f"(exit {res.exit_code}): {res.err_text.strip()[:300]}")
    raise InputError(
        f"base_commit {commit} is not a commit of image {sandbox.image!r}; "
        "fix the task's base_commit or image"
    )


async def reset_in_place(sandbox: Sandbox, commit: str, *, timeout: float = 60.0) -> ResetOutcome:
    """Reset ``sandbox`` to ``commit`` in place, then verify it.

    Args:
        sandbox: A sandbox whose workdir is a git repository.
        commit: The 40-hex commit to restore.
        timeout: Seconds for the reset command.

    Returns:
        A :class:`ResetOutcome`; ``ok=False`` means the caller must quarantine the sandbox.

    Raises:
        InfraError: The sandbox could not be reached.
    """
    killed = await sandbox.kill_strays()
    c = shlex.quote(commit)
    res = await sandbox.exec(
        f"{_GIT} reset -q --hard && {_GIT} clean -q -ffdx && {_GIT} checkout -q -f --detach {c}"
        " && find /tmp -mindepth 1 -delete",
        timeout=timeout,
    )
    if not res.ok:
        return ResetOutcome(False, (f"reset command failed (exit {res.exit_code}): "
                                    f"{res.err_text.strip()[:300]}",), killed)
    problems = await verify(sandbox, commit, timeout=timeout)
    return ResetOutcome(not problems, tuple(problems), killed)
