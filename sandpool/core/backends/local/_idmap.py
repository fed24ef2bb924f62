"""Image-directory sandboxes in an unprivileged id range: root inside is no one outside.

A sandbox of an image directory (the task pack's images) runs its commands as uid/gid
:data:`SANDBOX_UID` inside. It gets the same user namespace as an OCI sandbox (``_oci``): the
host writes ``0 BASE ID_COUNT`` to its uid and gid maps (``_oci.map_ids``), ``BASE`` the first
id of the sandbox's own range (``_idrange``), so uid 1000 inside is host uid ``BASE + 1000``
and nothing inside maps to a host id of the host's users or of another sandbox. What it writes
(the overlay's upper layer, ``/tmp``, ``/dev/shm``, a service's directory) is owned by that id
on the host, and a setuid bit it sets makes a setuid binary of an unprivileged id, never of
host root.

Three pieces make that work, each done the way the OCI path does it (the third for both):

* The image's repo, the overlay's lower layer, must be owned by the sandbox user as it was
  when uid 1000 inside was host root (else the policy could not edit its checkout):
  :func:`shifted_repo` makes, once per image, a copy whose files are owned by
  :data:`HOST_UID` (``ID_BASE + 1000``, the image store's shift), identical otherwise (modes,
  setuid bits, mtimes, xattrs, hard links), the way OCI layers are unpacked with their ids
  shifted; each sandbox sees it through an idmapped mount in its own range
  (``_idrange.IdRange.view``). The image directory itself is never changed: the copy sits
  beside it, named by :data:`VERSION` and the repo's identity, so older code and other images
  keep working on the same cache.
* bubblewrap runs as the sandbox's uid (:func:`as_host_id`), not as root, so every mount it
  makes is an unprivileged one. That uid cannot search ``/root``, where the images, the
  host's Python and the sandbox's state live, so the host binds each such source under the
  sandbox's directory in ``/run/sandpool`` first (:func:`publish_binds`), as the OCI path
  mounts its root there. (bubblewrap's ``--bind-fd`` does not help: it resolves the fd's path
  again, as the unprivileged uid.)
* Nested user namespaces: bubblewrap cannot combine ``--disable-userns`` with an id map
  written from outside, so the host sets the sandbox namespace's ``max_user_namespaces`` to 0
  before it releases bubblewrap (:func:`disable_nested_userns`); bubblewrap's
  ``--assert-userns-disabled`` then checks it took.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

from sandpool.core import errors
from sandpool.core.images import ID_BASE
from sandpool.core.mounts import bind_ro, bind_rw, umount

__all__ = ["HOST_UID", "SANDBOX_UID", "VERSION", "as_host_id", "disable_nested_userns",
           "publish_binds", "reachable", "shifted_repo", "unpublish"]

#: The uid/gid commands of an image-directory sandbox run as, inside.
SANDBOX_UID = 1000
#: The owner of the shifted repo copies: :data:`SANDBOX_UID` in the image store's shift. Each
#: sandbox sees it as :data:`SANDBOX_UID` of its own range (``_idrange``).
HOST_UID = ID_BASE + SANDBOX_UID
#: Names the shifted copies of image repos; bump when their layout changes.
VERSION = "ids-v1"

# bubblewrap options and how many arguments each takes: publish_binds parses argv with it, so an
# option's argument is never mistaken for an option.
_ARITY = {"--bind": 2, "--ro-bind": 2, "--ro-bind-try": 2, "--bind-try": 2, "--symlink": 2,
          "--setenv": 2, "--unsetenv": 1, "--uid": 1, "--gid": 1, "--hostname": 1, "--proc": 1,
          "--dev": 1, "--tmpfs": 1, "--mqueue": 1, "--remount-ro": 1, "--chdir": 1, "--dir": 1,
          "--userns-block-fd": 1, "--info-fd": 1, "--cap-add": 1, "--cap-drop": 1, "--perms": 1,
          "--chmod": 2, "--file": 2, "--bind-data": 2, "--ro-bind-data": 2, "--dev-bind": 2,
          "--dev-bind-try": 2, "--seccomp": 1, "--add-seccomp-fd": 1, "--sync-fd": 1,
          "--block-fd": 1, "--json-status-fd": 1, "--size": 1, "--lock-file": 1, "--argv0": 1,
          "--exec-label": 1, "--file-label": 1}
_FLAGS = {"--unshare-all", "--unshare-user", "--share-net", "--die-with-parent", "--new-session",
          "--as-pid-1", "--clearenv", "--disable-userns", "--assert-userns-disabled",
          "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
          "--unshare-cgroup-try", "--unshare-user-try"}
_BINDS = ("--bind", "--ro-bind", "--bind-try", "--ro-bind-try")


def as_host_id(host_id: int) -> list[str]:
    """The argv prefix that runs a command as host uid and gid ``host_id``, no extra groups.

    Used for bubblewrap, which must be able to name its own uid in the namespace it creates
    (the map makes ``host_id`` uid ``host_id - ID_BASE`` inside).
    """
    return ["setpriv", f"--reuid={host_id}", f"--regid={host_id}", "--clear-groups", "--"]


def reachable(path: Path | str, host_id: int) -> bool:
    """True when host uid/gid ``host_id`` may search every directory above ``path``."""
    p = Path(os.path.realpath(path))
    for d in p.parents:
        st = os.stat(d)
        if st.st_uid == host_id:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == host_id:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return False
    return True


def publish_binds(argv: Sequence[str], where: Path, host_id: int) -> list[str]:
    """Make every ``--[ro-]bind[-try] SRC DEST`` of a bubblewrap argv reachable by host uid
    ``host_id``: a source below a directory it cannot search (``/root``) is bind-mounted
    by the host at ``where/b<N>`` (read-only, ``nosuid``, ``nodev`` for ``--ro-bind*``;
    ``nosuid``, ``nodev`` for ``--bind*``) and named by that path instead. ``where`` is a per-sandbox
    directory under the world-searchable ``/run/sandpool`` (``_oci.public_dir``), as the OCI
    path does for its root; :func:`unpublish` undoes it.

    Args:
        argv: bubblewrap's options (not the program name) followed by the command to run.
        where: The sandbox's public directory (made here, mode 0755).

    Returns:
        The new argv.

    Raises:
        OSError: A bind mount failed (what was mounted stays for :func:`unpublish`).
        ValueError: ``argv`` holds an option this parser does not know (so it cannot tell
            its arguments from options): add it to ``_ARITY`` or ``_FLAGS``.
    """
    out: list[str] = []
    i, n_binds = 0, 0
    while i < len(argv):
        opt = argv[i]
        if not opt.startswith("--"):
            out += argv[i:]  # the command
            break
        if opt in _ARITY:
            n = _ARITY[opt]
        elif opt in _FLAGS:
            n = 0
        else:
            raise ValueError(f"publish_binds: unknown bubblewrap option {opt!r}; add it to _ARITY or _FLAGS")
        args = list(argv[i + 1:i + 1 + n])
        # A missing source of a -try bind stays as it is: bubblewrap skips it.
        if opt in _BINDS and os.path.exists(args[0]) and not reachable(args[0], host_id):
            if n_binds == 0:
                for d in (where.parent.parent, where.parent, where):
                    d.mkdir(exist_ok=True)
                    os.chmod(d, 0o755)
            target = where / f"b{n_binds}"
            n_binds += 1
            if os.path.isdir(args[0]):
                target.mkdir()
            else:
                target.touch()
            if opt.startswith("--ro-"):
                bind_ro(args[0], target)
            else:
                bind_rw(args[0], target)
            args[0] = str(target)
        out += [opt, *args]
        i += 1 + n
    return out


def unpublish(where: Path) -> bool:
    """Detach every bind :func:`publish_binds` made under ``where`` and remove its mount
    points (never recursively: a bind still mounted is left alone). Never raises.

    Returns:
        True when none is left (``where`` may then be removed recursively).
    """
    left = False
    with contextlib.suppress(OSError):
        for child in where.iterdir():
            if not child.name.startswith("b"):
                continue
            umount(child)
            try:  # rmdir/unlink of a mount point still in place fails (EBUSY): never through it
                if child.is_dir():
                    child.rmdir()
                else:
                    child.unlink()
            except OSError:
                left = True
    return not left


def disable_nested_userns(pid: int) -> None:
    """Forbid new user namespaces inside the sandbox whose init (host pid ``pid``) waits for
    its id maps: set its namespace's ``user.max_user_namespaces`` to 0, from inside it
    (``nsenter`` by host root, which may enter every namespace). What bubblewrap's
    ``--disable-userns`` does, which it cannot do with a map written from outside.

    Raises:
        SandboxStartError: nsenter failed (the message carries its output).
    """
    # nsenter becomes uid 0 of that namespace (host ID_BASE), which keeps its capabilities there
    # across the exec of sh: what the sysctl asks (CAP_SYS_RESOURCE in the namespace).
    res = subprocess.run(["nsenter", f"--user=/proc/{pid}/ns/user", "--",
                          "sh", "-c", "echo 0 > /proc/sys/user/max_user_namespaces"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise errors.SandboxStartError(f"could not disable nested user namespaces in the sandbox "
                                       f"(pid {pid}): {res.stderr.strip()[-300:]}")


def _identity(repo: Path) -> str:
    st = os.stat(repo)
    return hashlib.sha256(f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}".encode()).hexdigest()[:12]


def shifted_repo(repo: Path | str) -> Path:
    """Return the copy of image repo ``repo`` owned by :data:`HOST_UID`; make it if missing.

    The copy is ``<repo>.<VERSION>-<identity>`` beside ``repo`` (identity: the repo
    directory's inode and ctime, so a rebuilt repo gets a new copy). Made under a temporary
    name and renamed into place, so concurrent callers (other processes) never see half a
    copy; the loser of a race discards its own.

    Raises:
        SandboxStartError: The copy failed (the message carries ``cp``'s output).
    """
    src = Path(repo)
    dest = src.with_name(f"{src.name}.{VERSION}-{_identity(src)}")
    if dest.is_dir():
        return dest
    tmp = src.with_name(f".{dest.name}.tmp-{secrets.token_hex(4)}")
    # cp -a keeps modes, mtimes, xattrs and hard links; only ownership changes, below.
    res = subprocess.run(["cp", "-a", "--reflink=auto", "--", str(src), str(tmp)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise errors.SandboxStartError(f"copying image repo {src} for the sandbox uid failed: "
                                       f"{res.stderr.strip()[-300:]}")
    try:
        for dirpath, dirnames, filenames in os.walk(tmp):
            for name in [*dirnames, *filenames, None]:
                p = os.path.join(dirpath, name) if name else dirpath
                _chown_keep_mode(p)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process made it first
            if not dest.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise errors.SandboxStartError(f"shifting the ownership of {tmp} failed: {exc}") from exc
    return dest


def _chown_keep_mode(path: str) -> None:
    st = os.lstat(path)
    if (st.st_uid, st.st_gid) == (HOST_UID, HOST_UID):
        return
    os.chown(path, HOST_UID, HOST_UID, follow_symlinks=False)
    # chown clears setuid/setgid bits; the copy must have the image's modes exactly.
    if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & (stat.S_ISUID | stat.S_ISGID):
        os.chmod(path, stat.S_IMODE(st.st_mode))
