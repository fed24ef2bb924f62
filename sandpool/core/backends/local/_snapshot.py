"""Snapshots of local sandboxes: the repo's layers on the host, stacked to restore and to fork.

Every local sandbox's repo is an overlay of its own (an OCI sandbox's over its root's, see
``_oci``), mounted on a shared mount point of the host that the sandbox binds as a slave
(``_fresh``); its upper layer holds what a rollout changed in the repo. What it changed
elsewhere is its ``/tmp`` (an image directory's, a directory of its quota filesystem) or the
change set of its root outside the repo (an OCI sandbox's, ``_outside``). So:

* **snapshot**: the sandbox's cgroup is frozen (every process stops where it is: no write is
  half-seen), its repo's upper layer is copied into a new *layer* of the backend's store and
  the rest beside it (``/tmp`` with ``_layers.copy_tree``, or the root's change set with
  ``_outside.capture``; owners shifted to the image store's range; a file unchanged since an
  earlier snapshot is hard-linked from it, so the cost is what changed since), and the sandbox
  is thawed. The layer is never written again.
* **restore** (and so **fork**, a snapshot restored into n sandboxes): on a pristine sandbox of
  the same image, a new overlay is mounted over its repo: lower layers the snapshot's (top
  first, each through an idmapped mount in the sandbox's own id range) above the image's
  repo, upper a new directory on the sandbox's quota filesystem. Nothing of the image or of
  the layers is copied, and siblings share the layers read-only: what one writes lands in its
  own upper layer, which no other sandbox sees. The host's mount appears in the sandbox at
  once. ``/tmp`` is copied in, an OCI sandbox's change set outside the repo replayed.
* **reset** of a restored sandbox: the stacked overlay is unmounted (its removal propagates
  the same way), which brings back the sandbox's own layer, untouched since its last verified
  reset, and the in-place reset then swaps in a fresh upper layer over the image
  (``LocalSandbox.restore_repo``) and verifies it like any other. A restore of
  ``.git`` alone (grading) compares the merged view with the image for every path any layer
  holds (``_overlay.diff_merged``).

State hash (:func:`state_hash`; a snapshot's ``content_hash``): sha256 over the image's build,
the repo root's own attributes, the hash of each layer above the image (the live upper layer
when it holds anything, then the stacked layers, top first) and the hash of the rest (``/tmp``'s
tree, or the change set's records). A restored sandbox must show its snapshot's: its new upper
is empty, and each stacked layer is hashed again from the store (unchanged files by the memo,
see ``_layers``), so a layer altered since, an incomplete ``/tmp`` or replay, or a wrong stack
is caught and the sandbox quarantined.

What a snapshot does not hold: processes, ``/dev/shm`` and ``/dev/mqueue`` (memory, like
processes), a service's directory (a service is restored to its fresh state anyway).
"""

from __future__ import annotations

import asyncio
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
from sandpool.core.backends.local import _layers, _outside, _overlay
from sandpool.core.backends.local._layers import TreeHash
from sandpool.core.backends.local._memo import FileMemo
from sandpool.core.images import ID_BASE
from sandpool.core.mounts import MAX_OVERLAY_OPTS, mount_overlay, umount
from sandpool.core.snapshot import Snapshot

if TYPE_CHECKING:
    from sandpool.core.backends.local.sandbox import LocalSandbox

__all__ = ["MAX_LAYERS", "Stack", "Store", "capture", "load", "repo_upper", "stacked_changes",
           "state_hash", "unstack"]

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
    # The parts whose tree hash is recorded (a change set's hash is its records' through the
    # root it is replayed into: checked by the restored sandbox's state hash).
    d = snap.detail
    out = [(layer["part"], layer["hash"]) for layer in d["layers"]]
    if d.get("tmp"):
        out.append((d["tmp"]["part"], d["tmp"]["hash"]))
    return out


def image_id(sb: LocalSandbox) -> str:
    """The identity of the sandbox's image build: an OCI image's digest; an image directory's
    repo commit and directory identity."""
    if sb.oci is not None:
        return sb.oci.digest
    st = os.stat(sb.image_repo)
    return f"{sb.head}:{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}"


def _rest(sb: LocalSandbox) -> str:
    """What a snapshot of ``sb`` holds beside its repo's layers: ``tmp`` or ``outside``."""
    return "outside" if sb.oci is not None else "tmp"


def _content_hash(img: str, root: str, layers: list[str], rest: str, rest_hash: str) -> str:
    body = json.dumps({"image_id": img, "root": root, "layers": layers, rest: rest_hash}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def _has_entries(d: Path) -> bool:
    with os.scandir(d) as it:
        return any(True for _ in it)


def repo_upper(sb: LocalSandbox) -> Path:
    """Host path of the upper layer the sandbox's repo writes go to now: a restored sandbox's
    stacked overlay's, else its fresh layer's."""
    upper = sb.stack.upper if sb.stack is not None and sb.stack.upper is not None else sb.upper
    assert upper is not None
    return upper


async def capture(sb: LocalSandbox, store: Store) -> Snapshot:
    """Take a snapshot of ``sb`` (see the module docstring); blocking work runs in a thread.

    Raises:
        ConfigError: Its snapshot would stack more than :data:`MAX_LAYERS` layers.
        InfraTimeout: Its processes could not be frozen.
        InfraError: A copy failed on the host.
    """
    below = sb.stack
    await sb.freezer(True)
    try:
        layer, root, rest = await asyncio.to_thread(_copy_state, sb, store)
    finally:
        await sb.freezer(False)
    layers = ([{"part": str(layer[0].relative_to(store.root)), "hash": layer[1].digest,
                "size": layer[1].size_bytes}] if layer is not None else [])
    own = [x["part"] for x in layers] + [rest["part"]]
    layers += list(below.snapshot.detail["layers"]) if below is not None else []
    if len(layers) > MAX_LAYERS:
        for part in own:
            shutil.rmtree(store.root / part, ignore_errors=True)
        raise errors.ConfigError(f"sandbox {sb.id}: a snapshot of it would stack {len(layers)} layers"
                                 f" (at most {MAX_LAYERS}): it was restored from snapshots this deep; "
                                 "fork from a shallower state")
    kind = _rest(sb)
    detail = {"root": root, "layers": layers, kind: rest, "own": own}
    digest = _content_hash(image_id(sb), root, [x["hash"] for x in layers], kind, rest["hash"])
    parts = tuple(x["part"] for x in layers) + (rest["part"],)
    return Snapshot(id=Snapshot.new_id(), image=sb.image, image_id=image_id(sb), backend=_BACKEND,
                    content_hash=digest, size_bytes=sum(x["size"] for x in layers) + rest["size"],
                    parts=parts, location=store.root, detail=MappingProxyType(detail))


def _copy_state(sb: LocalSandbox, store: Store) -> tuple[tuple[Path, TreeHash] | None, str, dict]:
    """The repo's upper layer copied to a new layer of ``store`` (None when it holds nothing),
    the repo root's record, and the rest (``/tmp`` or the change set outside the repo)."""
    assert sb.ids is not None
    base = sb.ids.base
    layer, root = None, ""
    made: list[Path] = []
    try:
        if sb.repo_lower is not None:
            upper = repo_upper(sb)
            root = _layers.root_record(upper, base)
            if _has_entries(upper):
                made.append(store.new_dir("layers"))
                layer = (made[-1], _layers.copy_tree(upper, made[-1], src_base=base, dst_base=ID_BASE,
                                                     memo=store.memo))
        if sb.oci is not None:
            made.append(store.new_dir("outside"))
            rest = _outside.capture(sb, made[-1], store.memo)
        else:
            made.append(store.new_dir("tmp"))
            tmp = _layers.copy_tree(sb.tmp_host(), made[-1], src_base=base, dst_base=ID_BASE,
                                    memo=store.memo)
            rest = {"hash": tmp.digest, "size": tmp.size_bytes}
    except OSError as exc:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
        raise errors.InfraError(f"sandbox {sb.id}: copying its state for a snapshot failed: {exc}") from exc
    return layer, root, {"part": str(made[-1].relative_to(store.root)), **rest}


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
            or altered.
        InfraError: A mount, copy or replay failed on the host.
    """
    snap.check_target(sb.image, image_id(sb), _BACKEND)
    if _rest(sb) not in snap.detail:
        raise errors.ConfigError(f"snapshot {snap.id} was taken by another version of sandpool's "
                                 f"local backend (it holds no {_rest(sb)!r} part); take it again")
    snap = await asyncio.to_thread(store.ready, snap)
    if sb.stack is not None:
        await unstack(sb)
    try:
        await asyncio.to_thread(_stack, sb, snap, views)
    except OSError as exc:
        await unstack(sb)
        raise errors.InfraError(f"sandbox {sb.id}: restoring snapshot {snap.id} failed: {exc}") from exc


def _stack(sb: LocalSandbox, snap: Snapshot, views: Path) -> None:
    assert sb.ids is not None
    d = snap.detail
    if sb.repo_lower is not None:
        _stack_repo(sb, snap, views)
    if sb.oci is not None:
        _outside.replay(sb, snap.location / d["outside"]["part"], d["outside"])
    else:
        _layers.copy_tree(snap.location / d["tmp"]["part"], sb.tmp_host(), src_base=ID_BASE,
                          dst_base=sb.ids.base, into=True)


def _stack_repo(sb: LocalSandbox, snap: Snapshot, views: Path) -> None:
    assert sb.ids is not None and sb.repo_lower is not None and sb.upper is not None
    layers = [snap.location / x["part"] for x in snap.detail["layers"]]
    stack = Stack(snap, layers, [x["hash"] for x in snap.detail["layers"]])
    sb.stack = stack
    if not layers and not _has_entries(sb.upper):
        _layers.set_root(sb.upper, snap.detail["root"], sb.ids.base)
        return
    # Layers to stack, or none over an own layer that is not empty (a reset leaves its
    # refreshed index there): a new empty upper over the image is the snapshot's state.
    views.mkdir(exist_ok=True)
    targets = []
    for _ in layers:
        t = views / uuid.uuid4().hex[:8]
        t.mkdir()
        targets.append(t)
    sb.ids.view(list(zip(layers, targets)))
    stack.views = targets
    n = uuid.uuid4().hex[:8]
    stack.upper, stack.work = sb.disk / f"upper-{n}", sb.disk / f"work-{n}"
    for d in (stack.upper, stack.work):
        d.mkdir()
    # The merged root takes the upper root's attributes: make them the snapshot's.
    _layers.set_root(stack.upper, snap.detail["root"], sb.ids.base)
    lowers = [*targets, sb.repo_lower]
    if len(",".join(str(p) for p in lowers)) > MAX_OVERLAY_OPTS - 200:
        raise OSError(7, f"{len(layers)} layers do not fit in one overlay mount")
    mount_overlay(lowers, stack.upper, stack.work, sb.merged)


async def unstack(sb: LocalSandbox) -> None:
    """Unmount a restored sandbox's stacked overlay and layers; free its upper layer. Its own
    layer, untouched since its last verified reset, is its repo again. Call it with no
    process of a rollout left. Idempotent."""
    stack, sb.stack = sb.stack, None
    if stack is None:
        return

    def undo() -> None:
        if stack.upper is not None:
            umount(sb.merged)  # the stacked overlay only: the sandbox's own layer is below it
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
        OSError: A layer cannot be read.
    """
    assert sb.ids is not None
    base = sb.ids.base
    hashes, root = [], ""
    if sb.repo_lower is not None:
        upper = repo_upper(sb)
        if _has_entries(upper):
            hashes.append(_layers.hash_tree(upper, base=base, memo=store.memo).digest)
        root = _layers.root_record(upper, base)
    if sb.stack is not None:
        hashes += [_layers.hash_tree(p, base=ID_BASE, memo=store.memo, store=True).digest
                   for p in sb.stack.layers]
    if sb.oci is not None:
        rest = _outside.digest(sb, store.memo)
    else:
        rest = _layers.hash_tree(sb.tmp_host(), base=base, memo=store.memo).digest
    return _content_hash(image_id(sb), root, hashes, _rest(sb), rest)


def stacked_changes(sb: LocalSandbox, under: str) -> list[_overlay.Change]:
    """What differs from the image at or below ``under`` in a restored sandbox's repo: every
    path its upper layer or a stacked layer holds, compared through the merged view."""
    assert sb.stack is not None and sb.repo_lower is not None
    layers = [repo_upper(sb), *sb.stack.layers]
    return _overlay.diff_merged(sb.repo_lower, layers, sb.merged, under)
