"""Snapshots of local sandboxes: overlay layers on the host, stacked to restore and to fork.

A sandbox of an image directory writes its repo into its overlay's upper layer and its
``/tmp`` into a directory of its quota filesystem. So:

* **snapshot**: the sandbox's cgroup is frozen (every process stops where it is: no write is
  half-seen), its repo's upper layer is copied into a new *layer* of the backend's store and
  its ``/tmp`` beside it (``_layers.copy_tree``: owners shifted to the image store's range;
  a file unchanged since an earlier snapshot is hard-linked from it, so the cost is what
  changed since), and the sandbox is thawed. The layer is never written again.
* **restore** (and so **fork**, a snapshot restored into n sandboxes): on a pristine sandbox of
  the same image, a new overlay is mounted over its repo: lower layers the snapshot's (top
  first, each through an idmapped mount in the sandbox's own id range) above the image, upper
  a new directory on the sandbox's quota filesystem. Nothing of the image or of the layers is
  copied, and siblings share the layers read-only: what one writes lands in its own upper
  layer, which no other sandbox sees. The repo's mount is a shared mount on the host, bound
  into the sandbox as its slave, so the host's mount appears in the sandbox at once. ``/tmp``
  is copied in.
* **reset** of a restored sandbox: the stacked overlay is unmounted (its removal propagates
  the same way), which brings back the sandbox's own overlay, untouched since its last
  verified reset, and the in-place reset then swaps in a fresh upper layer over the image
  (``LocalSandbox.restore_repo``) and verifies it like any other. A restore of
  ``.git`` alone (grading) compares the merged view with the image for every path any layer
  holds (``_overlay.diff_merged``).

State hash (:func:`state_hash`; a snapshot's ``content_hash``): sha256 over the image's build,
the repo root's own attributes, the hash of each layer above the image (the live upper layer
when it holds anything, then the stacked layers, top first) and the hash of ``/tmp``. A
restored sandbox must show its snapshot's: its new upper is empty, and each stacked layer is
hashed again from the store (unchanged files by the memo, see ``_layers``), so a layer altered
since, an incomplete ``/tmp`` or a wrong stack is caught and the sandbox quarantined.

What a snapshot does not hold: processes, ``/dev/shm`` and ``/dev/mqueue`` (memory, like
processes), a service's directory (a service is restored to its fresh state anyway).
Sandboxes of OCI images, whose root is the overlay (which cannot be stacked under a running
sandbox), are snapshotted as a change set instead: ``_snapshot_oci``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.backends.local import _layers, _overlay
from sandpool.core.backends.local._layers import TreeHash
from sandpool.core.backends.local._memo import FileMemo
from sandpool.core.images import ID_BASE
from sandpool.core.mounts import MAX_OVERLAY_OPTS, mount_overlay, umount
from sandpool.core.snapshot import Snapshot

if TYPE_CHECKING:
    from sandpool.core.backends.local.sandbox import LocalSandbox

__all__ = ["MAX_LAYERS", "Stack", "Store", "capture", "load", "state_hash", "unstack"]

#: Layers a snapshot may stack above the image (a fork of a fork ... this deep).
MAX_LAYERS = 24
_BACKEND = "local"


@dataclass
class Stack:
    """A restored sandbox's stacked overlay over its repo.

    Attributes:
        snapshot: The snapshot it was restored from.
        layers: Host directories of the snapshot's layers, top first (in the store).
        hashes: Their hashes, top first.
        views: Their idmapped mounts in the sandbox's range, top first.
        upper: The stacked overlay's upper directory (on the sandbox's quota filesystem).
        work: Its work directory.
    """

    snapshot: Snapshot
    layers: list[Path]
    hashes: list[str]
    views: list[Path] = field(default_factory=list)
    upper: Path | None = None
    work: Path | None = None


class Store:
    """The backend's snapshot layers, under ``<run dir>/snapshots`` (removed with the run).

    Attributes:
        root: The store's directory (``layers/``, ``tmp/``, ``loaded/``).
        memo: Files seen unchanged, with their sha256 and immutable copy (see ``_layers``).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.memo = FileMemo()
        self._checked: dict[str, Snapshot] = {}  # snapshot id -> unpacked, its layers hashed

    def new_dir(self, kind: str) -> Path:
        (self.root / kind).mkdir(parents=True, exist_ok=True)
        return self.root / kind / uuid.uuid4().hex[:16]

    def ready(self, snap: Snapshot) -> Snapshot:
        """``snap`` with its data unpacked here when it is an archive, every layer's hash
        checked once (then by the memo). Blocking.

        Raises:
            ConfigError: A layer's data does not match its recorded hash, or is missing.
        """
        if snap.id in self._checked:
            return self._checked[snap.id]
        snap = snap.unpacked(self.root / "loaded")
        for part, want in _parts(snap):
            try:
                got = _layers.hash_tree(snap.location / part, base=ID_BASE, memo=self.memo,
                                        store=True).digest
            except OSError as exc:
                raise errors.ConfigError(f"snapshot {snap.id}: its layer {part} cannot be read "
                                         f"({exc}); it was removed with its backend") from None
            if got != want:
                raise errors.ConfigError(f"snapshot {snap.id}: its layer {part} is not the one it "
                                         "was taken with (its hash differs): the data was altered")
        self._checked[snap.id] = snap
        return snap


    def discard(self, snap: Snapshot, keep: Snapshot | None = None) -> None:
        """Remove the parts ``snap``'s capture made (not the layers it stacks on, which another
        snapshot holds) that ``keep`` does not hold, when they are in this store. Never
        raises."""
        if snap.location != self.root:
            return
        kept = set(keep.parts) if keep is not None and keep.location == self.root else set()
        for part in snap.detail.get("own", ()):  # never a layer it shares with its source
            if part not in kept:
                shutil.rmtree(self.root / part, ignore_errors=True)
        self._checked.pop(snap.id, None)


def _parts(snap: Snapshot) -> list[tuple[str, str]]:
    d = snap.detail
    out = [(layer["part"], layer["hash"]) for layer in d["layers"]]
    if d.get("tmp"):
        out.append((d["tmp"]["part"], d["tmp"]["hash"]))
    return out


def image_id(sb: LocalSandbox) -> str:
    """The identity of the sandbox's image build: its repo's commit and directory identity."""
    st = os.stat(sb.image_repo)
    return f"{sb.head}:{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}"


def _content_hash(img: str, root: str, layers: list[str], tmp: str) -> str:
    body = json.dumps({"image_id": img, "root": root, "layers": layers, "tmp": tmp}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def _has_entries(d: Path) -> bool:
    with os.scandir(d) as it:
        return any(True for _ in it)


def _repo_upper(sb: LocalSandbox) -> Path:
    return sb.stack.upper if sb.stack is not None and sb.stack.upper is not None else sb.upper


def _check_dir(sb: LocalSandbox) -> None:
    if sb.oci is not None:  # its root is the overlay: a change set, see _snapshot_oci
        raise errors.ConfigError(f"sandbox {sb.id} runs OCI image {sb.image!r}: its snapshots are "
                                 "change sets (_snapshot_oci), not stacked layers")


async def capture(sb: LocalSandbox, store: Store) -> Snapshot:
    """Take a snapshot of ``sb`` (see the module docstring); blocking work runs in a thread.

    Raises:
        ConfigError: The sandbox runs an OCI image, or its snapshot would stack more than
            :data:`MAX_LAYERS` layers.
        InfraTimeout: Its processes could not be frozen.
        InfraError: A copy failed on the host.
    """
    _check_dir(sb)
    below = sb.stack
    await sb.freezer(True)
    try:
        made = await asyncio.to_thread(_copy_state, sb, store)
    finally:
        await sb.freezer(False)
    layer, tmp_dir, tmp, root = made
    layers = ([{"part": str(layer[0].relative_to(store.root)), "hash": layer[1].digest,
                "size": layer[1].size_bytes}] if layer is not None else [])
    below_layers = list(below.snapshot.detail["layers"]) if below is not None else []
    layers += below_layers
    if len(layers) > MAX_LAYERS:
        raise errors.ConfigError(f"sandbox {sb.id}: a snapshot of it would stack {len(layers)} layers"
                                 f" (at most {MAX_LAYERS}): it was restored from snapshots this deep; "
                                 "fork from a shallower state")
    tmp_rel = str(tmp_dir.relative_to(store.root))
    own = [layers[0]["part"]] if layer is not None else []
    detail = {"root": root, "layers": layers, "tmp": {"part": tmp_rel, "hash": tmp.digest,
                                                      "size": tmp.size_bytes}, "own": own + [tmp_rel]}
    digest = _content_hash(image_id(sb), root, [x["hash"] for x in layers], tmp.digest)
    parts = tuple(x["part"] for x in layers) + (tmp_rel,)
    return Snapshot(id=Snapshot.new_id(), image=sb.image, image_id=image_id(sb), backend=_BACKEND,
                    content_hash=digest, size_bytes=sum(x["size"] for x in layers) + tmp.size_bytes,
                    parts=parts, location=store.root, detail=MappingProxyType(detail))


def _copy_state(sb: LocalSandbox, store: Store) -> tuple[tuple[Path, TreeHash] | None, Path, TreeHash, str]:
    assert sb.ids is not None
    base = sb.ids.base
    upper = _repo_upper(sb)
    layer = None
    dst = None
    try:
        if _has_entries(upper):
            dst = store.new_dir("layers")
            layer = (dst, _layers.copy_tree(upper, dst, src_base=base, dst_base=ID_BASE, memo=store.memo))
        tmp_dst = store.new_dir("tmp")
        tmp = _layers.copy_tree(sb.tmp_host(), tmp_dst, src_base=base, dst_base=ID_BASE, memo=store.memo)
    except OSError as exc:
        if dst is not None:
            shutil.rmtree(dst, ignore_errors=True)
        raise errors.InfraError(f"sandbox {sb.id}: copying its state for a snapshot failed: {exc}") from exc
    return layer, tmp_dst, tmp, _layers.root_record(upper, base)


async def load(sb: LocalSandbox, snap: Snapshot, store: Store, views: Path) -> None:
    """Restore ``snap`` into the pristine sandbox ``sb`` (see the module docstring). Verify
    with :func:`state_hash` after.

    Args:
        sb: A pristine sandbox of the snapshot's image (no process of a rollout, unstacked).
        snap: The snapshot.
        store: The backend's store.
        views: A directory for the layers' idmapped mounts (in the sandbox's state directory).

    Raises:
        ConfigError: The snapshot is of another image, build or backend, or its data is gone
            or altered; or ``sb`` runs an OCI image.
        InfraError: A mount or copy failed on the host.
    """
    _check_dir(sb)
    snap.check_target(sb.image, image_id(sb), _BACKEND)
    snap = await asyncio.to_thread(store.ready, snap)
    if sb.stack is not None:
        await unstack(sb)
    try:
        await asyncio.to_thread(_stack, sb, snap, views)
    except OSError as exc:
        await unstack(sb)
        raise errors.InfraError(f"sandbox {sb.id}: restoring snapshot {snap.id} failed: {exc}") from exc


def _stack(sb: LocalSandbox, snap: Snapshot, views: Path) -> None:
    assert sb.ids is not None and sb.repo_lower is not None
    layers = [snap.location / x["part"] for x in snap.detail["layers"]]
    stack = Stack(snap, layers, [x["hash"] for x in snap.detail["layers"]])
    sb.stack = stack
    if layers:
        views.mkdir(exist_ok=True)
        targets = []
        for src in layers:
            t = views / uuid.uuid4().hex[:8]
            t.mkdir()
            targets.append(t)
        sb.ids.view(list(zip(layers, targets)))
        stack.views = targets
        disk = sb.upper.parent
        n = uuid.uuid4().hex[:8]
        stack.upper, stack.work = disk / f"upper-{n}", disk / f"work-{n}"
        for d in (stack.upper, stack.work):
            d.mkdir()
        # The merged root takes the upper root's attributes: make them the snapshot's.
        _set_root(stack.upper, snap.detail["root"], sb.ids.base)
        lowers = [*targets, sb.repo_lower]
        if len(",".join(str(p) for p in lowers)) > MAX_OVERLAY_OPTS - 200:
            raise OSError(7, f"{len(layers)} layers do not fit in one overlay mount")
        mount_overlay(lowers, stack.upper, stack.work, sb.merged)
    else:
        _set_root(sb.upper, snap.detail["root"], sb.ids.base)
    tmp = snap.location / snap.detail["tmp"]["part"]
    _layers.copy_tree(tmp, sb.tmp_host(), src_base=ID_BASE, dst_base=sb.ids.base, into=True)


def _set_root(path: Path, record: str, base: int) -> None:
    """Give directory ``path`` the attributes ``record`` (:func:`_layers.root_record`) names."""
    _, _, mode, uid, gid, mtime, xattrs, _ = record.rstrip("\n").split("\0")
    os.chown(path, int(uid) + base, int(gid) + base)
    for item in filter(None, xattrs.split(",")):
        name, _, value = item.partition("=")
        os.setxattr(path, name, base64.b64decode(value))
    os.chmod(path, int(mode, 8))
    os.utime(path, ns=(int(mtime), int(mtime)))


async def unstack(sb: LocalSandbox) -> None:
    """Unmount a restored sandbox's stacked overlay and layers; free its upper layer. Its own
    overlay, untouched since its last verified reset, is its repo again. Call it with no
    process of a rollout left. Idempotent."""
    stack, sb.stack = sb.stack, None
    if stack is None:
        return

    def undo() -> None:
        if stack.upper is not None:
            umount(sb.merged)  # the stacked overlay only: the sandbox's own is below it
        for v in stack.views:
            umount(v)
            with contextlib.suppress(OSError):
                v.rmdir()
        for d in (stack.upper, stack.work):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)

    await asyncio.to_thread(undo)


def state_hash(sb: LocalSandbox, store: Store) -> str:
    """The hash of the sandbox's state, as a snapshot of it now would have it (see the module
    docstring). Blocking; reads every layer (unchanged files by the memo).

    Raises:
        ConfigError: The sandbox runs an OCI image.
        OSError: A layer cannot be read.
    """
    _check_dir(sb)
    assert sb.ids is not None
    base = sb.ids.base
    upper = _repo_upper(sb)
    hashes = []
    if _has_entries(upper):
        hashes.append(_layers.hash_tree(upper, base=base, memo=store.memo).digest)
    if sb.stack is not None:
        hashes += [_layers.hash_tree(p, base=ID_BASE, memo=store.memo, store=True).digest
                   for p in sb.stack.layers]
    tmp = _layers.hash_tree(sb.tmp_host(), base=base, memo=store.memo).digest
    return _content_hash(image_id(sb), _layers.root_record(upper, base), hashes, tmp)


def stacked_changes(sb: LocalSandbox, under: str) -> list[_overlay.Change]:
    """What differs from the image at or below ``under`` in a restored sandbox's repo: every
    path its upper layer or a stacked layer holds, compared through the merged view."""
    assert sb.stack is not None and sb.repo_lower is not None
    layers = [_repo_upper(sb), *sb.stack.layers]
    return _overlay.diff_merged(sb.repo_lower, layers, sb.merged, under)
