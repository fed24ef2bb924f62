"""In-place reset: bring a used sandbox back to its image's pristine state, and prove it.

The property (not a list of cleanup steps) that a reset establishes and then verifies:

* the repo directory, ``.git`` included (refs, stash, reflog, config, hooks, info files,
  objects, index), is identical to the image's, so nothing an earlier rollout made is
  reachable (``git log --all``, ``stash list``, ``reflog``, ``fsck --lost-found``);
* nothing else the sandbox can write is left changed: its scratch directories
  (:attr:`Sandbox.scratch`: ``/tmp``, and locally ``/dev/shm`` and ``/dev/mqueue``) are empty,
  and where the backend records them (:meth:`Sandbox.restore_scratch`) their own mode, owner,
  times and extended attributes (POSIX ACLs included) are as fresh, so not even a directory's
  timestamp carries a bit to the next rollout; its System V IPC namespace is empty where it
  has its own (:attr:`Sandbox.private_ipc`); kernel keyrings are out of every local
  sandbox's reach (its seccomp filter), so none can hold anything;
  where the backend sees the whole filesystem's changes (:meth:`Sandbox.changes_outside_repo`:
  an OCI sandbox's root overlay; a pod's writable mounts, listed by its agent), a path the
  rollout *added* outside the repo and ``/tmp`` (a ``pip install``, a file under ``/root`` or
  ``/dev``) is removed, and anything else it changed there (an edit in ``/etc``, a deleted or
  replaced image file) fails the check;
* no process of the rollout is left, and where the backend can set them from outside (the
  local backend's host, in :meth:`Sandbox.restore_scratch`), the agent's own scheduling,
  CPU affinity, I/O priority, OOM score and core dump filter are back to its fresh ones;
* a long-lived service the sandbox runs beside the policy (the local backend's agent-server)
  is the process started with the sandbox, running, and its state is back to its fresh
  state (:meth:`Sandbox.restore_service`).

A sandbox that fails the check is quarantined by the pool, never handed out.

How "identical" is established depends on what the backend can see from outside the sandbox:

* :meth:`Sandbox.restore_repo` (the local backend): the overlay's upper layer, read on the
  host, lists exactly what changed; those paths are copied back from the image and compared
  with it on the host (type, mode, mtime, xattrs, bytes or link target). O(paths changed).
  For the whole repo the local backend swaps in a fresh upper layer instead, so no inode the
  rollout wrote survives, and compares that.
* otherwise (pods; :mod:`sandpool.core.pristine`): a manifest of the fresh repo (every path's
  type, mode, sha256 or link target) and a copy of ``.git`` without its object store are
  recorded by :func:`record_pristine` when the sandbox is fresh and kept in this process,
  where the policy cannot write; the reset rebuilds ``.git`` from that copy, removes added
  objects, restores the tree with git, and compares a new manifest with the recorded one;
  then, where the sandbox can (its agent: :meth:`Sandbox.repo_meta`), every path's owner,
  extended attributes, access and modification times are set back to the recorded ones and
  checked. O(repo).

After the check passes, sandpool's own git commands (hooks off, the now-pristine config) check
out the commit the next claim asks for and refresh git's index (its stat cache), the same steps
a fresh sandbox's claim takes. Where the backend supports it, that refreshed index is pinned
as the pristine one (:meth:`Sandbox.pin_repo_state`): identical to the image's but for the
stat cache, it keeps the next refresh O(paths changed) instead of re-reading every file.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from sandpool.core import pristine
from sandpool.core.base import Sandbox
from sandpool.core.errors import InfraError, InfraTimeout, InputError, ResetError
from sandpool.core.pristine import SAFE_GIT, Pristine, pristine_record

__all__ = ["SAFE_GIT", "Pristine", "ResetOutcome", "checkout", "pristine_record", "record_pristine",
           "reset_in_place", "restore_git_metadata"]

_SEP = "@@sandpool-verify@@"


@dataclass(frozen=True)
class ResetOutcome:
    """Result of a reset attempt.

    Attributes:
        ok: True when every check passed; the sandbox may be handed out again.
        problems: What failed, one sentence each (empty when ``ok``).
        killed: Stray processes killed.
        head: The commit the repo is at after the reset (the requested one, or the image's
            own when checking that out failed), None when not ``ok``.
    """

    ok: bool
    problems: tuple[str, ...] = ()
    killed: int = 0
    head: str | None = None


async def checkout(sandbox: Sandbox, commit: str, *, timeout: float = 60.0) -> None:
    """Check out ``commit`` (detached, forced) in the sandbox's workdir and confirm HEAD.

    Runs git as :data:`SAFE_GIT` (no hook, filter or config outside the repo's own).

    Raises:
        InputError: The commit does not exist in the image's repo (the task's
            ``base_commit`` does not belong to its ``image``): the task is rejected.
        InfraTimeout: The checkout ran out of time (infra, retried).
        InfraError: The sandbox could not be reached, or the commit exists and the
            checkout still failed.
    """
    c = shlex.quote(commit)
    res = await sandbox.exec(
        f"{SAFE_GIT} checkout -q -f --detach {c} && test \"$({SAFE_GIT} rev-parse HEAD)\" = {c}",
        timeout=timeout,
    )
    if res.ok:
        return
    if res.timed_out:  # a slow sandbox, not a bad task
        raise InfraTimeout(f"checking out {commit} in sandbox {sandbox.id} took over {timeout:.0f} s")
    probe = await sandbox.exec(f"{SAFE_GIT} cat-file -e {c}^{{commit}}", timeout=timeout)
    if probe.timed_out:
        raise InfraTimeout(f"looking up {commit} in sandbox {sandbox.id} took over {timeout:.0f} s")
    if probe.ok:  # the commit is there and still would not check out: the sandbox is at fault
        raise InfraError(f"checkout of {commit} failed in sandbox {sandbox.id} "
                         f"(exit {res.exit_code}): {res.err_text.strip()[:300]}")
    raise InputError(
        f"base_commit {commit} is not a commit of image {sandbox.image!r}; "
        "fix the task's base_commit or image"
    )


async def restore_git_metadata(sandbox: Sandbox, *, timeout: float = 60.0) -> None:
    """Make the sandbox repo's ``.git`` identical to the image's; leave the working tree as is.

    Call it before running git on a tree a policy touched (grading's ``git checkout <base> --
    <test files>`` and ``git apply``). When it returns:

    * every process the rollout left is killed (none can re-plant anything afterwards);
    * ``.git`` is byte-identical to the image's (verified, see the module docstring; the
      index's stat cache may be sandpool's own refresh of it, see
      :meth:`Sandbox.pin_repo_state`): its
      config (no ``filter.*``, ``core.hooksPath``, ``include``, ``core.worktree``...), hooks,
      ``info/`` (attributes, exclude, sparse-checkout, grafts), ``objects/info/alternates``,
      ``shallow``, HEAD, refs (``refs/replace`` too), packed-refs, reflogs, stash, index
      (skip-worktree and assume-unchanged bits) and objects. HEAD and the index are the
      image's, so name ``task.base_commit`` explicitly rather than relying on HEAD;
    * the working tree is untouched: the policy's final state is what a ``git diff
      <base_commit>`` shows.

    Together with :data:`SAFE_GIT` for the git commands themselves (which ignores
    ``~/.gitconfig`` and ``~/.config/git/attributes`` under the policy's ``$HOME``), no hook,
    filter or config the policy planted can run.

    Args:
        sandbox: A sandbox from a pool (or one passed to :func:`record_pristine` when fresh).
        timeout: Seconds the restore may take.

    Raises:
        DiskQuotaExceeded: The image's files could not be written back because the rollout
            filled the sandbox's disk quota (shown by the quota filesystem, read on the host):
            the policy's failure, scored 0.
        SandboxExhausted: The restore ran out of time with the rollout's own paths in
            ``.git`` over a bound (counted on the host): the policy's failure, scored 0.
        ResetError: ``.git`` could not be made identical to the image's for any other
            reason; do not grade on this sandbox (infra's failure, never a reward of 0).
        InfraError: The sandbox could not be reached.
    """
    await sandbox.kill_strays()
    problems = await _restore(sandbox, ".git", timeout)
    if problems:
        raise ResetError(f"sandbox {sandbox.id}: .git could not be restored to image "
                         f"{sandbox.image!r}: {'; '.join(problems[:5])}")


async def reset_in_place(sandbox: Sandbox, commit: str, *, timeout: float = 60.0) -> ResetOutcome:
    """Reset ``sandbox`` in place to its image's state, verify it, then check out ``commit``.

    Args:
        sandbox: A sandbox whose workdir is a git repository.
        commit: The 40-hex commit the next claim wants (checked out after verification).
        timeout: Seconds for each step.

    Returns:
        A :class:`ResetOutcome`; ``ok=False`` means the caller must quarantine the sandbox.

    Raises:
        InfraError: The sandbox could not be reached.
    """
    killed = await sandbox.kill_strays()
    problems = await sandbox.restore_service(timeout=timeout)
    # The scratch space is emptied first, so what the rollout wrote there frees its room before
    # the repo's files are written back: a disk it filled must not fail the restore. Only the
    # sandbox's own IPC namespace may be emptied: a kwok pod's exec shares the host's.
    dirs = " ".join(sandbox.scratch)
    scratch = await sandbox.restore_scratch(timeout=timeout)  # None: the generic way below
    clear = ("" if scratch is not None else f"for d in {dirs}; do [ ! -d $d ] ||"
             f" find $d -mindepth 1 -delete; done;")
    ipc_clear = " ipcrm --all 2>/dev/null;" if sandbox.private_ipc else ""
    if clear or ipc_clear:
        await sandbox.exec(f"{clear}{ipc_clear} true", timeout=timeout)
    problems += scratch or []
    problems += await _restore(sandbox, "", timeout)
    problems += await _outside_repo(sandbox, timeout)
    if problems:
        return ResetOutcome(False, tuple(problems), killed)
    # The repo is the image's now, config and hooks included: sandpool's own git may run on
    # it. One command checks out the claimed commit, refreshes the index's stat cache, and
    # lists what is left outside the repo (it must be nothing).
    head = commit if commit != sandbox.head else sandbox.head
    git = (f"{SAFE_GIT} checkout -q -f --detach {shlex.quote(commit)} || echo checkout-failed;"
           if commit != sandbox.head else "")
    ipc_list = (" cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg 2>/dev/null"
                " | grep -v '^ *key';" if sandbox.private_ipc else "")
    # Listing a directory moves its atime: only where the backend did not restore them.
    listing = f" for d in {dirs}; do [ ! -d $d ] || ls -A $d; done;" if scratch is None else ""
    res = await sandbox.exec(
        f"{git} {SAFE_GIT} update-index -q --refresh; echo {_SEP};{listing} echo {_SEP};{ipc_list} true",
        timeout=timeout)
    out, left, ipc = (res.text.split(_SEP + "\n") + ["", ""])[:3]
    if not res.ok or res.text.count(_SEP) != 2:
        problems.append(f"checking {dirs} failed (exit {res.exit_code}): {res.err_text.strip()[:200]}")
    if "checkout-failed" in out:
        problems.append(f"checkout of {commit} failed: {res.err_text.strip()[:200]}")
    if left.split():
        problems.append(f"scratch space not empty: {left.split()[:5]}")
    if ipc.strip():
        problems.append(f"System V IPC objects left: {ipc.strip().splitlines()[:3]}")
    procs = await sandbox.processes()
    if procs:
        problems.append(f"processes left: {procs[:5]}")
    if problems:
        return ResetOutcome(False, tuple(problems), killed)
    if commit == sandbox.head:  # the tree is the image's: its refreshed index is the pristine one
        await sandbox.pin_repo_state([".git/index"])
    return ResetOutcome(True, (), killed, head)


async def _restore(sandbox: Sandbox, under: str, timeout: float) -> list[str]:
    problems = await sandbox.restore_repo(under, timeout=timeout)
    if problems is None:  # the backend cannot see changes from outside: the generic path
        problems = await pristine.restore(sandbox, under, timeout)
    return problems


async def record_pristine(sandbox: Sandbox, *, refresh_index: bool = False,
                          timeout: float = 120.0) -> None:
    """Record a fresh sandbox's repo for the reset, and optionally warm git's index.

    Call it before any rollout touches the sandbox; the pool does, for every sandbox it
    creates. Where the backend implements :meth:`Sandbox.restore_repo` nothing needs
    recording; otherwise (the generic path) the record (a manifest of every path and a copy
    of ``.git`` without its object files) stays in this process, out of the policy's reach,
    for as long as the sandbox object lives.

    Args:
        sandbox: A fresh sandbox.
        refresh_index: Then refresh git's stat cache (``git update-index --refresh``, with
            :data:`SAFE_GIT`): a fresh repo's index has stat data from elsewhere, and the
            first git command would re-read every file, on the claim path. The refreshed
            index is pinned (:meth:`Sandbox.pin_repo_state`) as the pristine one.
        timeout: Seconds for each command.

    Raises:
        ResetError: The repo could not be read.
        InfraError: The sandbox could not be reached.
    """
    # restore_repo answers None where the backend cannot see changes from outside (a pod, an
    # OCI sandbox whose repo is no git checkout of its own); on a fresh sandbox it is cheap.
    if await sandbox.restore_repo("", timeout=timeout) is None:
        await pristine.record(sandbox, timeout)
    if refresh_index:
        await sandbox.exec(f"{SAFE_GIT} update-index -q --refresh", timeout=timeout)
        await sandbox.pin_repo_state([".git/index"])


async def _outside_repo(sandbox: Sandbox, timeout: float) -> list[str]:
    """Undo what the rollout added outside the repo and /tmp; report what cannot be undone."""
    changes = await sandbox.changes_outside_repo()
    if not changes:
        return []
    added = [path for path, kind in changes if kind == "added"]
    if added:  # removing a path no image layer has leaves no trace in the overlay
        res = await sandbox.exec(["rm", "-rf", "--", *added], timeout=timeout, cwd="/")
        if not res.ok:
            return [f"removing files added outside the repo failed: {res.err_text.strip()[:200]}"]
        changes = await sandbox.changes_outside_repo() or []
    if not changes:
        return []
    return [f"changed outside the repo and /tmp (not undoable in place): "
            f"{[f'{kind} {path}' for path, kind in changes[:8]]}"]
