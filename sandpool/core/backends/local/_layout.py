"""One local sandbox on the host before bubblewrap starts: its directories, mounts and options.

Both kinds of image share the frame:

* everything the sandbox writes lives on its *disk*: its quota filesystem (``_quota``), else
  its state directory;
* its repo and ``/dev/shm`` are shared mount points of the host, bound into the sandbox before
  anything is mounted on them, so the sandbox's binds are their slaves: the fresh upper layers,
  snapshot stacks and tmpfs the host mounts on them later show inside (``_fresh``,
  ``_snapshot``);
* what it sees of the host it sees through inodes of its own (``_views``), and every bind
  source below a directory its uid cannot search is published under its public directory in
  ``/run/sandpool`` (``_idmap.publish_binds``, by the backend).

An image directory's repo overlay has the image's repo, as the sandbox's id range owns it, as
its lower layer (``_idmap``), and its root is bubblewrap's; an OCI image's root is an overlay of
its layers, and its repo, when it is a git checkout, an overlay of its own over the root's
(``_oci``).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sandpool.core.backends.local import _bwrap, _oci, _quota, _views
from sandpool.core.backends.local._idrange import IdRange
from sandpool.core.backends.local.image import LocalImage
from sandpool.core.images import OciImage
from sandpool.core.mounts import make_shared, mount_overlay

if TYPE_CHECKING:
    from sandpool.core.backends.local.backend import LocalBackend

__all__ = ["Layout", "lay_out"]


@dataclass
class Layout:
    """What :func:`lay_out` made for one sandbox (host paths).

    Attributes:
        image: Its image; an image directory's with ``repo`` the view in the sandbox's range.
        state: Its state directory.
        disk: Where its writes go: its quota filesystem, else its state directory.
        pub: Its public directory (under ``/run/sandpool``).
        options: bubblewrap's options and command, bind sources not yet published.
        merged: The shared mount point of its repo.
        shm: The shared mount point bound at ``/dev/shm``.
        lower: The image's repo as the sandbox's range sees it (its repo overlay's lower
            layer), or None: an OCI image's repo that is no git checkout (no overlay).
        tmp: Its ``/tmp`` on the quota filesystem (image directories), else None.
        service_dir: The service's directory (image directories).
        root: An OCI sandbox's root overlay; ``root_upper`` its upper directory, ``lowers``
            its lower directories (top first), ``view`` the image's read-only view.
    """

    image: LocalImage | OciImage
    state: Path
    disk: Path
    pub: Path
    options: list[str]
    merged: Path
    shm: Path
    lower: Path | None
    tmp: Path | None = None
    service_dir: Path | None = None
    root: Path | None = None
    root_upper: Path | None = None
    lowers: list[Path] = field(default_factory=list)
    view: Path | None = None


async def lay_out(backend: LocalBackend, img: LocalImage | OciImage, state: Path, ids: IdRange,
                  runner: int, work_fds: list[int]) -> Layout:
    """Make sandbox ``state.name``'s directories and mounts under its state directory
    ``state`` and its public directory, and its bubblewrap options (see the module).

    Args:
        backend: Its backend (limits, service, image store, run).
        img: Its image (an image directory's with ``repo`` its shifted copy, ``_idmap``).
        state: Its state directory (exists, empty).
        ids: Its id range.
        runner: The host uid bubblewrap runs as (it owns ``/tmp`` and the service directory).
        work_fds: Descriptors of its work cgroup's ``cgroup.procs`` files (passed to the agent).

    Raises:
        OSError: A directory, quota filesystem or mount could not be made (what was mounted
            stays for ``_cleanup.unmount_sandbox``).
    """
    sid, limits = state.name, backend.limits
    disk, tmp = state, None
    if limits.disk_bytes:
        disk = state / "disk"
        disk.mkdir()
        tpl = await asyncio.to_thread(_quota.template, limits.disk_bytes)
        await _quota.attach(tpl, state / "disk.img", disk)
        if isinstance(img, LocalImage):  # an OCI sandbox's /tmp is its root's
            tmp = _own_dir(disk / "tmp", runner, 0o1777)
    merged, shm = _shared(state / "merged"), _shared(state / "shm")
    if isinstance(img, OciImage):
        pub = _oci.prepare_host(backend.run_id, _bwrap.AGENT) / sid
        root = pub / "root"
        root.mkdir(parents=True)
        skel = _oci.skeleton(state.parent)
        lowers, view = await asyncio.to_thread(_oci.views, backend.store, img, skel, pub, ids)
        root_upper, root_work = _own_dir(disk / "root-upper", ids.base), disk / "root-work"
        root_work.mkdir()
        mount_overlay(lowers, root_upper, root_work, root)
        lower = _oci.repo_view(img, view)
        views = await asyncio.to_thread(_views.mount, pub, _oci.host_sources(pub.parent))
        devices = await asyncio.to_thread(_views.devices, pub)
        opts = _oci.bwrap_argv(img, limits, root=root, pub=pub.parent, shm=shm,
                               repo=(lower, merged) if lower is not None else None,
                               work_fds=work_fds, views=views, devices=devices)
        return Layout(img, state, disk, pub, opts, merged, shm, lower, root=root,
                      root_upper=root_upper, lowers=lowers, view=view)
    # The image's repo as the sandbox's range owns it: its repo overlay's lower layer and the
    # in-place reset's restore source.
    lower = state / "lower"
    lower.mkdir()
    await asyncio.to_thread(ids.view, [(Path(img.repo), lower)])
    img = img.model_copy(update={"repo": str(lower)})
    svc = disk / "service"  # on the sandbox's disk quota when there is one
    if backend.service is not None:
        _own_dir(svc, runner)
    etc = _bwrap.write_etc(state.parent)
    pub = _oci.public_dir(backend.run_id) / sid
    views = await asyncio.to_thread(_views.mount, pub, _bwrap.host_sources(img, etc, backend.service))
    devices = await asyncio.to_thread(_views.devices, pub)
    opts = _bwrap.bwrap_argv(limits, img, etc, merged, tmp, shm, work_fds, backend.service, svc,
                             views, devices)
    return Layout(img, state, disk, pub, opts, merged, shm, lower, tmp=tmp, service_dir=svc)


def _own_dir(path: Path, owner: int, mode: int = 0o755) -> Path:
    """Make directory ``path`` with ``mode``, owned by host uid/gid ``owner``; return it."""
    path.mkdir()
    os.chown(path, owner, owner)
    os.chmod(path, mode)
    return path


def _shared(path: Path) -> Path:
    """Make directory ``path`` a shared mount point (``mounts.make_shared``); return it."""
    path.mkdir()
    make_shared(path)
    return path
