"""Sandboxes from OCI images: the image's rootfs as ``/``, root inside mapped to no one outside.

How one OCI sandbox is laid out (the local backend calls these helpers):

* ``/`` is an overlayfs: the image's layers from the store (read-only, shared by every sandbox
  and image that has them) under a per-sandbox upper directory on the sandbox's quota
  filesystem (see ``_quota``), so the upper layer records exactly what a rollout changed. The
  host's ``/usr`` is not the toolchain: the image's own is.
* The task's repo (``OciImage.repo_dir``, e.g. ``/testbed``), when it is a git checkout, is an
  overlay of its own over the root's, as an image directory's repo is: its lower layer the
  image's repo as the root's lowers show it (:func:`repo_view`), its upper on the quota
  filesystem, mounted on a shared mount point of the host that the sandbox binds as a slave,
  so the in-place reset swaps in a fresh upper layer (``_fresh``) and a snapshot's layers are
  stacked under it (``_snapshot``). ``/dev/shm`` is such a mount point too.
* A tiny skeleton layer on top supplies the mount points ``/.sandpool/{usr,python,agent.py}``
  without writing them into the upper layer.
* User namespace: bubblewrap creates it and waits (``--userns-block-fd``) while the backend,
  as host root, writes ``0 BASE ID_COUNT`` to its uid and gid maps, ``BASE`` the first id of
  the sandbox's own range (``_idrange``): uid 0 inside is host uid ``BASE``, which owns
  nothing outside its sandbox. The layers were unpacked once with ``ID_BASE``'s shift and are
  seen through idmapped mounts shifted to the sandbox's range (:func:`views`), so root inside
  owns the image's root files.
  Commands hold no capabilities. Nested user namespaces are disabled by the host before it
  releases bubblewrap (``_idmap.disable_nested_userns``: bubblewrap cannot combine
  ``--disable-userns`` with ``--userns-block-fd``), and bubblewrap asserts it.
* The agent is the one ``_agent.py`` every local sandbox runs, executed by the *host's*
  Python, mounted read-only and started through the host's dynamic loader with an explicit
  library path (``ld.so --library-path ... python -I agent.py``). The agent therefore needs
  nothing from the image (it may have no Python, or an old one), and the image's commands see
  none of the host's libraries (the loader path is not inherited). A static helper would be a
  second implementation of the agent protocol; this keeps one.
* ``Env`` and ``WorkingDir`` of the image config become the environment and default cwd of
  every command; ``User`` becomes the uid/gid the agent and so every command run as (the
  host's ``setpriv`` switches to it, the only moment the sandbox holds CAP_SETUID/SETGID). ``Entrypoint``/``Cmd`` are not
  run: a sandbox's long-lived process is the agent, and the task harness runs the tests; they
  are kept in the image record for callers that want them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import struct
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

from sandpool.core import errors
from sandpool.core.backends.local._idmap import disable_nested_userns, unpublish
from sandpool.core.backends.local._idrange import IdRange
from sandpool.core.backends.local._views import MASKED
from sandpool.core.backends.local._views import unmount as unmount_host_views
from sandpool.core.base import ResourceLimits
from sandpool.core.images import ID_BASE, ID_COUNT, ImageStore, OciImage
from sandpool.core.mounts import bind_ro, mount_overlay, umount

__all__ = ["IMAGE_IN_SANDBOX", "PUBLIC_ROOT", "bwrap_argv", "changes_outside", "host_python",
           "host_sources", "map_ids", "prepare_host", "public_dir", "release_host", "repo_view",
           "skeleton", "unmount_views", "views"]

_SP = "/.sandpool"
#: Where an OCI sandbox sees its image's pristine repo, read-only (the source of in-place
#: restores, as for image directories).
IMAGE_IN_SANDBOX = f"{_SP}/image"
PUBLIC_ROOT = Path("/run/sandpool")
_AGENT_IN = f"{_SP}/agent.py"


def _pt_interp(exe: str) -> str:
    """The ELF interpreter (dynamic loader) named in ``exe``'s PT_INTERP header."""
    with open(exe, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            raise errors.BackendUnavailable(f"{exe} is not a 64-bit ELF executable")
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, _, p_offset, _, _, p_filesz = struct.unpack("<IIQQQQ", f.read(40))
            if p_type == 3:  # PT_INTERP
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    raise errors.BackendUnavailable(f"{exe} has no dynamic loader (PT_INTERP)")


def host_python() -> tuple[Path, list[str]]:
    """Return ``(prefix, argv prefix)`` to run the host's Python inside an OCI sandbox.

    ``prefix`` (``sys.base_prefix``) is mounted at ``/.sandpool/python`` and the host's ``/usr``
    at ``/.sandpool/usr``; the argv runs the interpreter through the host's loader there.

    Raises:
        BackendUnavailable: The loader is outside ``/usr`` (a non merged-/usr host).
    """
    prefix = Path(sys.base_prefix)
    exe = prefix / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    loader = os.path.realpath(_pt_interp(str(exe)))
    if not loader.startswith("/usr/"):
        raise errors.BackendUnavailable(f"the host's dynamic loader {loader} is outside /usr; "
                                        "OCI sandboxes need a merged-/usr host")
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    libs = [f"{_SP}/python/lib"] + [f"{_SP}{d}" for d in (f"/usr/lib/{multiarch}", "/usr/lib") if d]
    return prefix, [f"{_SP}{loader}", "--library-path", ":".join(libs),
                    f"{_SP}/python/bin/{exe.name}", "-I", "-u", _AGENT_IN]


def skeleton(run_dir: Path) -> Path:
    """Make (once per run) and return the top lower layer holding the sandbox's mount points."""
    skel = run_dir / "oci-skel"
    ready = run_dir / "oci-skel.ready"  # outside the layer, so it never shows inside
    if ready.exists():
        return skel
    sp = skel / ".sandpool"
    for d in (sp / "usr", sp / "python", sp / "image"):
        d.mkdir(parents=True, exist_ok=True)
    marks = [sp / "agent.py"]
    for f in marks:
        f.touch()
    # Mount points bubblewrap needs, so it never creates them in the upper layer (which
    # would read as a change the rollout made) when an image lacks them.
    tops = [skel / d for d in ("proc", "dev", "tmp")]
    for d in tops:
        d.mkdir(exist_ok=True)
    for p in (skel, sp, sp / "usr", sp / "python", sp / "image", *marks, *tops):
        os.chown(p, ID_BASE, ID_BASE)
    os.chmod(skel, 0o755)
    os.chmod(skel / "tmp", 0o1777)
    ready.touch()
    return skel


def host_sources(pub: Path) -> list[str]:
    """Every host path :func:`bwrap_argv` binds read-only into an OCI sandbox of the run whose
    public directory is ``pub`` (to be seen through views of the sandbox's own: ``_views``)."""
    return ["/usr", str(host_python()[0]), str(pub / "host" / "agent.py")]


def views(store: ImageStore, img: OciImage, skel: Path, where: Path, ids: IdRange) -> tuple[list[Path], Path]:
    """Mount the sandbox's views of ``img`` under ``where`` (its public directory) and return
    ``(lower directories top first, image view)``.

    The layers and the skeleton are stored with ``ID_BASE``'s shift; the sandbox sees them
    through idmapped mounts in its own id range (``where/l``, ``where/skel``;
    ``_idrange``). The image view (``where/view``, read-only) is the image as a sandbox first
    sees it: the host compares a sandbox's upper layer with it (``_overlay.diff``), and the
    agent copies pristine files from it on an in-place reset. :func:`unmount_views` undoes it.
    """
    for d in ("skel", "l", "view"):
        (where / d).mkdir(exist_ok=True)
    ids.view([(skel, where / "skel"), (store.layers_dir, where / "l")])
    layers = [where / "l" / store.layer_path(layer.diff_id).name for layer in reversed(img.layers)]
    empty = where.parent / "empty"  # overlay wants two lower layers when it has no upper one
    empty.mkdir(exist_ok=True)
    mount_overlay([*layers, empty], None, None, where / "view", readonly=True)
    return [where / "skel", *layers], where / "view"


def repo_view(img: OciImage, view: Path) -> Path | None:
    """The image's repo in its read-only view ``view`` (:func:`views`) when it is a git
    checkout below ``/`` (it gets an overlay of its own), else None (the repo is only part of
    the root, restored by the generic path)."""
    repo = view / img.repo_dir.strip("/")
    return repo if img.repo_dir.strip("/") and (repo / ".git").is_dir() else None


def unmount_views(where: Path) -> None:
    """Unmount a sandbox's root and views under ``where`` (the overlays before the idmapped
    binds under them); never raises."""
    for d in ("root", "view", "l", "skel"):
        umount(where / d)


def public_dir(run_id: str) -> Path:
    """Where one run's OCI sandboxes are mounted: under ``/run/sandpool``, world-searchable.

    bubblewrap runs as an unprivileged host uid and resolves its bind sources by path, so they must
    not sit below a directory only root may search (``/root/.cache``, ``/root/.pyenv``).
    """
    return PUBLIC_ROOT / run_id


def prepare_host(run_id: str, agent: Path) -> Path:
    """Make the run's public directory and bind the host Python and the agent into it, read-only.

    Returns:
        The public directory (``host/python``, ``host/agent.py``, and one dir per sandbox).
    """
    pub = public_dir(run_id)
    host = pub / "host"
    if (host / "python" / "bin").is_dir():
        return pub
    host.mkdir(parents=True, exist_ok=True)
    for p in (PUBLIC_ROOT, pub, host):
        os.chmod(p, 0o755)
    prefix, _ = host_python()
    (host / "python").mkdir(exist_ok=True)
    bind_ro(prefix, host / "python")
    # A copy, not a bind: a bind pins the file's inode, and replacing the source file (a
    # checkout, an upgrade) would break every later sandbox start of this run.
    shutil.copyfile(agent, host / "agent.py")
    os.chmod(host / "agent.py", 0o444)
    return pub


def release_host(pub: Path) -> None:
    """Unmount whatever is mounted under ``pub`` and remove it; never raises."""
    if not pub.is_dir():
        return
    left = False
    for child in pub.iterdir():
        if child.name == "host":
            umount(child / "python")
        elif child.is_dir() and child.name != "empty":
            unmount_views(child)
            unmount_host_views(child)
            left |= not unpublish(child)
    if not left:  # never recursively through a bind still mounted
        shutil.rmtree(pub, ignore_errors=True)


def bwrap_argv(img: OciImage, limits: ResourceLimits, *, root: Path, pub: Path, shm: Path,
               repo: tuple[Path, Path] | None = None, work_fds: Sequence[int] = (),
               views: Mapping[str, str] | None = None, devices: Sequence[str] = ()) -> list[str]:
    """bubblewrap's options and command for one OCI sandbox (see the module docstring) whose
    root overlay is ``root``; the backend adds the executable and its descriptors.

    ``shm`` (bound at ``/dev/shm``) and ``repo[1]`` (bound over the repo's directory) are the
    host's shared mount points (``_layout``); ``repo[0]``, the image's repo in its view, is
    bound at :data:`IMAGE_IN_SANDBOX`. ``views`` maps each of :func:`host_sources` to what to
    bind instead and an ``"empty"`` file bound over ``_views.MASKED`` (``_views.mount``);
    ``devices`` binds the sandbox's own device nodes (``_views.devices``).
    """
    views = views or {}
    prefix, py_argv = host_python()
    env = dict(e.split("=", 1) for e in img.env if "=" in e)
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("HOME", "/root" if img.uid == 0 else "/tmp")
    env.setdefault("LANG", "C.UTF-8")
    env.setdefault("GIT_CONFIG_NOSYSTEM", "1")
    argv = [
        "--unshare-all", "--unshare-user",
        *(["--share-net"] if limits.network else []),
        "--die-with-parent", "--new-session",
        "--assert-userns-disabled",  # the host disabled them (_idmap.disable_nested_userns)
        "--as-pid-1",  # the agent is the sandbox's pid 1: no process inside shares its pipes
        # bubblewrap is uid 0 inside (the map); a non-root ``User`` is reached below, by setpriv.
        "--uid", "0", "--gid", "0",
        *(["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if img.uid or img.gid else []),
        "--hostname", "sandbox",
        "--clearenv",
        "--bind", str(root), "/",
        "--proc", "/proc",
        *(a for path in MASKED if "empty" in views for a in ("--ro-bind", views["empty"], path)),
        "--dev", "/dev",
        *devices,
        "--bind", str(shm), "/dev/shm",
        "--mqueue", "/dev/mqueue",
        "--ro-bind", views.get("/usr", "/usr"), f"{_SP}/usr",
        "--ro-bind", views.get(str(prefix), str(pub / "host" / "python")), f"{_SP}/python",
        "--ro-bind", views.get(str(pub / "host" / "agent.py"), str(pub / "host" / "agent.py")),
        _AGENT_IN,
    ]
    if repo is not None:
        argv += ["--ro-bind", str(repo[0]), IMAGE_IN_SANDBOX, "--bind", str(repo[1]), img.repo_dir]
    # The agent puts each command into the work cgroup through these descriptors only (see
    # _bwrap: no cgroup file is visible inside).
    if work_fds:
        env["SANDPOOL_WORK_CGROUP_FDS"] = " ".join(map(str, work_fds))
    for key, value in env.items():
        argv += ["--setenv", key, value]
    if img.uid or img.gid:
        # The host's setpriv (through the host's loader, like the agent) drops to the image's
        # User before the agent starts; changing to a non-zero uid clears every capability.
        loader, libs = py_argv[0], py_argv[2]
        py_argv = [loader, "--library-path", libs, f"{_SP}/usr/bin/setpriv", f"--reuid={img.uid}",
                   f"--regid={img.gid}", "--clear-groups", "--inh-caps=-all", "--", *py_argv]
    argv += ["--chdir", img.workdir or img.repo_dir or "/", *py_argv]
    return argv


async def map_ids(info_r: int, block_w: int, base: int, timeout: float) -> int:
    """Wait for bubblewrap's child pid on ``info_r``, write its id maps, then release it.

    Every local sandbox's user namespace is mapped here: uid/gid ``n`` inside is host
    ``base + n`` (its own range, ``_idrange``), for ``n`` below ``ID_COUNT``; then nested user
    namespaces are disabled (``_idmap.disable_nested_userns``) before bubblewrap goes on.

    Returns:
        The child's host pid.

    Raises:
        SandboxStartError: bubblewrap exited or said nothing within ``timeout`` seconds, or
            the maps could not be written.
    """
    loop = asyncio.get_running_loop()
    buf = b""
    reader: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        nonlocal buf
        chunk = os.read(info_r, 4096)
        buf += chunk
        if not chunk or b"}" in buf:
            loop.remove_reader(info_r)
            if not reader.done():
                reader.set_result(None)

    loop.add_reader(info_r, readable)
    try:
        await asyncio.wait_for(reader, timeout)
    except TimeoutError:
        raise errors.SandboxStartError(f"bubblewrap sent no child pid within {timeout:.0f} s") from None
    finally:
        loop.remove_reader(info_r)
    try:
        pid = int(json.loads(buf.split(b"}")[0] + b"}")["child-pid"])
        for kind in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{kind}", "w") as f:
                f.write(f"0 {base} {ID_COUNT}\n")
    except (ValueError, KeyError, OSError) as exc:
        raise errors.SandboxStartError(f"bubblewrap's user namespace could not be mapped: {exc} "
                                       f"(info: {buf[:200]!r})") from None
    await asyncio.to_thread(disable_nested_userns, pid)
    try:
        os.write(block_w, b"1")
    except (ValueError, KeyError, OSError) as exc:
        raise errors.SandboxStartError(f"bubblewrap's user namespace could not be mapped: {exc} "
                                       f"(info: {buf[:200]!r})") from None
    return pid


def changes_outside(upper: Path, lowers: list[Path], keep: Sequence[str]) -> list[tuple[str, str]]:
    """What a rollout changed in an OCI sandbox's root outside ``keep``, read on the host.

    The upper layer holds exactly what changed; each entry is judged against the lower layers
    (top first). Only reads: a mounted overlay's upper layer must not be written from outside.

    Args:
        upper: The sandbox's upper directory.
        lowers: Its lower directories, top first.
        keep: Absolute paths whose subtrees are not judged here (the repo, ``/tmp``).

    Returns:
        ``(path, kind)`` pairs, ``/``-rooted: ``added`` (no lower layer has the path: removing
        it inside undoes it), ``modified`` (a file, link or directory metadata that differs
        from the image's), ``deleted`` (a whiteout), ``replaced`` (an opaque directory).
    """
    skip = {k.rstrip("/") or "/" for k in keep}
    out: list[tuple[str, str]] = []

    def lower_stat(rel: str) -> os.stat_result | None:
        for layer in lowers:
            try:
                st = os.lstat(layer / rel)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return None  # whited out in that layer
            return st
        return None

    # Iterative; it descends only into directories a lower layer has too (an added directory
    # is one entry, however deep), so the image bounds the depth.
    todo = [""]
    while todo:
        rel = todo.pop()
        try:
            entries = list(os.scandir(upper / rel if rel else upper))
        except OSError:
            continue
        for e in entries:
            r = f"{rel}/{e.name}" if rel else e.name
            if "/" + r in skip:
                continue
            st = e.stat(follow_symlinks=False)
            low = lower_stat(r)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                out.append(("/" + r, "deleted"))
            elif low is None:
                out.append(("/" + r, "added"))
            elif stat.S_ISDIR(st.st_mode):
                try:
                    opaque = os.getxattr(e.path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
                except OSError:
                    opaque = False
                if opaque:
                    out.append(("/" + r, "replaced"))
                elif not stat.S_ISDIR(low.st_mode) or (st.st_mode, st.st_uid, st.st_gid) != (
                        low.st_mode, low.st_uid, low.st_gid):
                    out.append(("/" + r, "modified"))
                else:  # a directory copied up because something below it changed
                    todo.append(r)
            else:
                out.append(("/" + r, "modified"))

    return sorted(out)
