"""The generic reset path: a record of the fresh repo, kept in this process, and the restore
from it.

Where a backend cannot see from outside the sandbox what a rollout changed
(:meth:`Sandbox.restore_repo <sandpool.core.base.Sandbox.restore_repo>` answers None: a pod,
an OCI sandbox whose repo is no git checkout of its own), :func:`record` takes, while the
sandbox is fresh, a manifest of the repo (every path's type, mode, sha256 or link target,
and its owner, extended attributes and times where :meth:`Sandbox.repo_meta` reads them) and
a copy of ``.git`` without its object files. The record stays in this process, where the
policy cannot write, for as long as the sandbox object lives (:func:`pristine_record`).

:func:`restore` rebuilds ``.git`` from that copy, removes object files the rollout added,
restores the tree with git, and compares a new manifest with the recorded one; it returns
what differs, and :mod:`sandpool.core.reset` fails the reset on any of it. O(repo).

:data:`SAFE_GIT` is here because the restore runs git on the policy's tree too; every other
git command sandpool runs there uses it as well (it is :mod:`sandpool.core.reset`'s contract).
"""

from __future__ import annotations

import base64
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandpool.core.base import Sandbox
from sandpool.core.errors import ResetError

__all__ = ["SAFE_GIT", "Pristine", "adopt_record", "pristine_record", "record", "restore"]

#: A shell prefix that runs git without any configuration, hook, attribute file or fsmonitor
#: a policy could have planted outside ``.git`` (``$HOME`` is ``/tmp`` in a sandbox, so
#: ``~/.gitconfig`` and ``~/.config/git/attributes`` are the policy's). Use it for every git
#: command sandpool runs on a policy's tree, after
#: :func:`~sandpool.core.reset.restore_git_metadata`. Its committer (the reflog's) is named,
#: so git never looks the host's name up (``/etc/hosts``, DNS), and the repo is safe whoever
#: owns it (a rollout may chown it; the reset restores the owner).
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
class Pristine:
    """What :func:`record` keeps of a fresh repo on the generic path (in this process, out of
    the policy's reach). :mod:`sandpool.core.changeset` takes a snapshot's
    change set against it."""

    paths: tuple[str, ...]  # "<type> <mode> <path> -> <target>" per path of the fresh repo
    hashes: tuple[str, ...]  # "<sha256>  <path>" per regular file
    git_meta: bytes  # tar of .git without its object files
    stats: tuple[str, ...] = ()  # "<ctime> <size> <path>" per path (find's %C@ %s %p)
    meta: Mapping[str, Any] | None = None  # Sandbox.repo_meta of the fresh repo, or None


def pristine_record(sandbox: Sandbox) -> Pristine | None:
    """The record :func:`record` took of ``sandbox`` on the generic path, or None."""
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


def adopt_record(sandbox: Sandbox, source: Sandbox) -> bool:
    """Give ``sandbox`` the pristine record :func:`record` took through ``source``, another
    handle on the same sandbox made before any rollout touched it (a warm pod's, recorded
    before its claim); return False when there is none."""
    rec = _records.pop(source, None)
    if rec is None:
        return False
    _records[sandbox] = rec
    return True


async def record(sandbox: Sandbox, timeout: float) -> None:
    """Record the fresh repo of ``sandbox`` for :func:`restore` (see the module docstring).

    Raises:
        ResetError: The repo could not be read.
        InfraError: The sandbox could not be reached.
    """
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


async def restore(sandbox: Sandbox, under: str, timeout: float) -> list[str]:
    """Restore ``under`` (a path in the repo; "": all of it) from the record, then compare it
    with the record; return what differs, one sentence each (empty: identical).

    Raises:
        InfraError: The sandbox could not be reached.
    """
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
