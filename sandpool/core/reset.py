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
* otherwise (pods): a manifest of the fresh repo (every path's type, mode, sha256 or link
  target) and a copy of ``.git`` without its object store are recorded by :func:`record_pristine`
  when the sandbox is fresh and kept in this process, where the policy cannot write; the reset
  rebuilds ``.git`` from that copy, removes added objects, restores the tree with git, and
  compares a new manifest with the recorded one; then, where the sandbox can (its agent:
  :meth:`Sandbox.repo_meta`), every path's owner, extended attributes, access and
  modification times are set back to the recorded ones and checked. O(repo).

After the check passes, sandpool's own git commands (hooks off, the now-pristine config) check
out the commit the next claim asks for and refresh git's index (its stat cache), the same steps
a fresh sandbox's claim takes. Where the backend supports it, that refreshed index is pinned
as the pristine one (:meth:`Sandbox.pin_repo_state`): identical to the image's but for the
stat cache, it keeps the next refresh O(paths changed) instead of re-reading every file.
"""

from __future__ import annotations

import base64
import shlex
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandpool.core.base import Sandbox
from sandpool.core.errors import InfraError, InfraTimeout, InputError, ResetError

__all__ = ["SAFE_GIT", "Pristine", "ResetOutcome", "checkout", "pristine_record", "record_pristine",
           "reset_in_place", "restore_git_metadata"]

#: A shell prefix that runs git without any configuration, hook, attribute file or fsmonitor
#: a policy could have planted outside ``.git`` (``$HOME`` is ``/tmp`` in a sandbox, so
#: ``~/.gitconfig`` and ``~/.config/git/attributes`` are the policy's). Use it for every git
#: command sandpool runs on a policy's tree, after :func:`restore_git_metadata`. Its committer
#: (the reflog's) is named, so git never looks the host's name up (``/etc/hosts``, DNS), and
#: the repo is safe whoever owns it (a rollout may chown it; the reset restores the owner).
SAFE_GIT = ("env -u GIT_DIR -u GIT_WORK_TREE -u GIT_INDEX_FILE -u GIT_OBJECT_DIRECTORY "
            "-u GIT_ALTERNATE_OBJECT_DIRECTORIES -u GIT_CONFIG_PARAMETERS "
            "GIT_COMMITTER_NAME=sandpool GIT_COMMITTER_EMAIL=sandpool@localhost "
            "HOME=/nonexistent XDG_CONFIG_HOME=/nonexistent GIT_CONFIG_GLOBAL=/dev/null "
            "GIT_CONFIG_NOSYSTEM=1 GIT_ATTR_NOSYSTEM=1 GIT_TERMINAL_PROMPT=0 "
            "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.attributesFile=/dev/null "
            "-c advice.detachedHead=false -c safe.directory='*'")
_SEP = "@@sandpool-verify@@"
# sandpool's own, not the image's: the Kubernetes exec wrapper's output files.
_OWN_GIT_PATHS = (".git/sandpool-exec",)


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
        problems = await _generic_restore(sandbox, under, timeout)
    return problems


# -- the generic path: a pristine record kept in this process ---------------------------------

@dataclass(frozen=True)
class Pristine:
    """What :func:`record_pristine` keeps of a fresh repo on the generic path (in this
    process, out of the policy's reach). :mod:`sandpool.core.changeset` takes a snapshot's
    change set against it."""

    paths: tuple[str, ...]  # "<type> <mode> <path> -> <target>" per path of the fresh repo
    hashes: tuple[str, ...]  # "<sha256>  <path>" per regular file
    git_meta: bytes  # tar of .git without its object files
    stats: tuple[str, ...] = ()  # "<ctime> <size> <path>" per path (find's %C@ %s %p)
    meta: Mapping[str, Any] | None = None  # Sandbox.repo_meta of the fresh repo, or None


def pristine_record(sandbox: Sandbox) -> Pristine | None:
    """The record :func:`record_pristine` took of ``sandbox`` on the generic path, or None."""
    return _records.get(sandbox)


_records: weakref.WeakKeyDictionary[Sandbox, Pristine] = weakref.WeakKeyDictionary()
_OWN = " -o ".join(f"-path ./{p}" for p in _OWN_GIT_PATHS)
_OWN_META = tuple(f"./{p}" for p in _OWN_GIT_PATHS)
#: What Sandbox.repo_meta says of a path's times it could not set back (its own answer).
_UNSET = ("refreshed", "unwritable")
_LIST = f"find {{root}} \\( {_OWN} \\) -prune -o -printf '%y %m %p -> %l\\n' | LC_ALL=C sort"
_HASH = (f"find {{root}} \\( {_OWN} \\) -prune -o -type f -print0 | LC_ALL=C sort -z"
         " | xargs -0 -r sha256sum --")


def _manifest(root: str) -> str:
    # Two sections: every path with type, mode and link target; the sha256 of every file.
    return f"{_LIST.format(root=root)}; echo {_SEP}; {_HASH.format(root=root)}"


def _split(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    listed, _, hashed = text.partition(_SEP + "\n")
    return tuple(listed.splitlines()), tuple(hashed.splitlines())


def _path_of(line: str) -> str:
    if "  " in line and " -> " not in line:
        return line.split("  ", 1)[1]
    return line.split(" ", 2)[2].rsplit(" -> ", 1)[0]


def _under(lines: tuple[str, ...], under: str) -> list[str]:
    if not under:
        return list(lines)
    prefix = f"./{under}"
    return [ln for ln in lines if (p := _path_of(ln)) == prefix or p.startswith(prefix + "/")]


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
        await _record(sandbox, timeout)
    if refresh_index:
        await sandbox.exec(f"{SAFE_GIT} update-index -q --refresh", timeout=timeout)
        await sandbox.pin_repo_state([".git/index"])


def adopt_record(sandbox: Sandbox, source: Sandbox) -> bool:
    """Give ``sandbox`` the pristine record :func:`record_pristine` took through ``source``,
    another handle on the same sandbox made before any rollout touched it (a warm pod's,
    recorded before its claim); return False when there is none."""
    rec = _records.pop(source, None)
    if rec is None:
        return False
    _records[sandbox] = rec
    return True


async def _record(sandbox: Sandbox, timeout: float) -> None:
    res = await sandbox.exec(
        f"{_manifest('.')}; echo {_SEP}; find . \\( {_OWN} \\) -prune -o -printf '%C@ %s %p\\n';"
        f" echo {_SEP}; find .git/objects -type f ! -path '.git/objects/info/*'"
        " > /tmp/.sandpool-objects && tar -cf - --exclude-from=/tmp/.sandpool-objects"
        f" {' '.join(f'--exclude={p}' for p in _OWN_GIT_PATHS)} .git | base64 -w0;"
        " rc=$?; rm -f /tmp/.sandpool-objects; exit $rc",
        timeout=timeout, max_output=1 << 30)
    parts = res.text.split(_SEP + "\n")
    if not res.ok or len(parts) != 4:
        raise ResetError(f"sandbox {sandbox.id}: cannot record its fresh repo: {res.err_text.strip()[:300]}")
    paths, hashes = _split(parts[0] + _SEP + "\n" + parts[1])
    meta = await sandbox.repo_meta(skip=_OWN_META, timeout=timeout)  # after the reads
    _records[sandbox] = Pristine(paths, hashes, base64.b64decode(parts[3]),
                                 tuple(parts[2].splitlines()), meta)


async def _generic_restore(sandbox: Sandbox, under: str, timeout: float) -> list[str]:
    rec = _records.get(sandbox)
    if rec is None:
        return [f"no pristine record of sandbox {sandbox.id} (record_pristine was not called when fresh)"]
    objects = sorted(_path_of(h) for h in rec.hashes if _path_of(h).startswith("./.git/objects/"))
    # The restore's inputs go to a directory named at random now: the policy cannot have
    # planted anything (a symlink named like an input) there in advance.
    tmp = f"/tmp/.sandpool-restore-{uuid.uuid4().hex}"
    await sandbox.write_file(f"{tmp}/git.tar", rec.git_meta)
    await sandbox.write_file(f"{tmp}/objects", "".join(f"{p}\n" for p in objects).encode())
    own = " ".join(f"! -path ./{p}" for p in _OWN_GIT_PATHS)
    script = (
        # .git: everything but the object store goes and comes back from the record; object
        # files the rollout added go too (the image's stay, and are hashed below).
        f"find ./.git -mindepth 1 -maxdepth 1 ! -name objects {own} -exec rm -rf {{}} + ;"
        " rm -rf ./.git/objects/info;"
        f" find ./.git/objects -type f | LC_ALL=C sort | LC_ALL=C comm -23 - {tmp}/objects"
        " | xargs -d '\\n' -r rm -f --;"
        " find ./.git/objects -mindepth 1 -type d -empty -delete;"
        f" tar -xf {tmp}/git.tar || exit 1;"
    )
    if not under:
        listed = sorted(_path_of(p) for p in rec.paths)
        await sandbox.write_file(f"{tmp}/paths", "".join(f"{p}\n" for p in listed).encode())
        script += (
            # The tree: paths the image has not go, git rewrites the tracked files from the
            # (restored) index, whose bytes are then put back.
            f" find . \\( {_OWN} \\) -prune -o -print | LC_ALL=C sort | LC_ALL=C comm -23 -"
            f" {tmp}/paths | xargs -d '\\n' -r rm -rf --;"
            f" cp .git/index {tmp}/index && {SAFE_GIT} checkout-index -a -f -q"
            f" && mv {tmp}/index .git/index || exit 1;"
        )
    script += f" rm -rf {tmp}; {_manifest('./' + under if under else '.')}"
    res = await sandbox.exec(script, timeout=timeout, max_output=1 << 28)
    if not res.ok:
        return [f"restore failed (exit {res.exit_code}): {res.err_text.strip()[:300]}"]
    paths, hashes = _split(res.text)
    problems = []
    for now, want, what in ((paths, rec.paths, "paths"), (hashes, rec.hashes, "contents")):
        now_u, want_u = set(_under(now, under)), set(_under(want, under))
        if now_u != want_u:
            problems.append(f"{what} differ from the fresh repo: unexpected {sorted(now_u - want_u)[:3]},"
                            f" missing {sorted(want_u - now_u)[:3]}")
    if rec.meta is not None and not problems:  # last: the restore and the hashing move times
        prefix = f"./{under}"
        want = {p: m for p, m in rec.meta.items() if isinstance(m, dict)
                and (not under or p == prefix or p.startswith(prefix + "/"))}
        got = await sandbox.repo_meta(want, skip=_OWN_META, timeout=timeout) or {}
        if bad := sorted(p for p, m in want.items() if not _same_meta(got.get(p), m)):
            problems.append(f"owner, xattrs or times could not be set back to the fresh repo's:"
                            f" {[(p, got.get(p)) for p in bad[:3]]}")
    return problems


def _same_meta(got: Any, want: dict) -> bool:
    return (isinstance(got, dict) and got["o"] == want["o"] and got["x"] == want["x"]
            and got["t"] in (want["t"], *_UNSET))


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
