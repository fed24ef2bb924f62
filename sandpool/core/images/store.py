"""The local OCI image store: layers unpacked once, content-addressed, shared by images.

Layout of ``<sandpool_home>/oci-v1/`` (the ``v1`` is bumped when the layout changes, so old and
new code keep their own stores)::

    layers/<diff-id hex>/   one unpacked layer in overlayfs's lower-layer format: OCI whiteouts
                            became 0/0 character devices, opaque directories carry
                            ``trusted.overlay.opaque=y``; uids/gids shifted by ``ID_BASE``
    layers/<hex>.json       that layer's unpacked size in bytes
    images/<manifest hex>/  image.json (an :class:`OciImage`) then ``.complete``, written last
    refs/<safe name>        JSON: the manifest digest a name points at, and its source
    tmp/                    work of hydrations in progress; anything here that no live
                            hydration holds is a leftover of a killed one and is removed

A layer directory and an image directory appear only by ``rename`` of a finished temporary
directory, and a name only points at a complete image, so a hydration killed (or out of disk)
at any point leaves nothing that looks usable.

A sandbox stacks an image's layers as overlay lower directories (the layers are never
written), so two images sharing a base layer store it once on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from sandpool.core import errors
from sandpool.core.paths import sandpool_home

__all__ = ["ID_BASE", "ID_COUNT", "ImageStore", "LayerRef", "OciImage", "StoreUsage"]

#: Host uid/gid that a sandbox's uid/gid 0 maps to; ids 0..ID_COUNT-1 inside map to
#: ID_BASE..ID_BASE+ID_COUNT-1 outside. Layers are unpacked with this shift, so files owned by
#: root in the image are owned by an unprivileged host id on disk.
ID_BASE = 100_000
ID_COUNT = 65_536
STORE_VERSION = "oci-v1"
_MARKER = ".complete"


class LayerRef(BaseModel):
    """One layer of an image.

    Attributes:
        diff_id: ``sha256:<hex>`` of the uncompressed layer tar (the content address).
        digest: ``sha256:<hex>`` of the blob as the source shipped it (maybe compressed).
        size: Bytes of that blob.
        unpacked: Bytes the unpacked layer takes on disk.
    """

    diff_id: str
    digest: str
    size: int
    unpacked: int = 0


class OciImage(BaseModel):
    """``image.json`` of one hydrated OCI image.

    Attributes:
        name: The name it was hydrated under (e.g. ``swebench/sweb.eval.x86_64.x:latest``).
        digest: ``sha256:<hex>`` of the stored OCI manifest; the pin.
        source: What it was hydrated from (``docker://...@sha256:...``, ``oci:...``, ...).
        source_digest: The manifest digest at the source when it has one (a registry's).
        layers: Bottom first.
        env: The config's ``Env`` (``KEY=value`` strings).
        workdir: The config's ``WorkingDir`` ("" when unset).
        user: The config's ``User`` ("" when unset).
        uid: The uid ``User`` resolves to in the image's ``/etc/passwd`` (0 when unset).
        gid: Its gid.
        entrypoint: The config's ``Entrypoint``.
        cmd: The config's ``Cmd``.
        head: HEAD commit of the git repo at the sandbox workdir, read at hydration, or None.
        repo_dir: Where the task repo is inside the image (the sandbox workdir).
        hydrated_at: Unix time of hydration.
    """

    name: str
    digest: str
    source: str
    source_digest: str | None = None
    layers: list[LayerRef]
    env: list[str] = []
    workdir: str = ""
    user: str = ""
    uid: int = 0
    gid: int = 0
    entrypoint: list[str] = []
    cmd: list[str] = []
    head: str | None = None
    repo_dir: str = "/testbed"
    hydrated_at: float = 0.0

    @property
    def size(self) -> int:
        """Bytes of the image's blobs as shipped (the figure a registry reports)."""
        return sum(layer.size for layer in self.layers)

    @property
    def unpacked(self) -> int:
        """Bytes the image would take unpacked on its own (no sharing)."""
        return sum(layer.unpacked for layer in self.layers)


class StoreUsage(BaseModel):
    """What the store holds and what it costs on disk (bytes).

    Attributes:
        images: Hydrated images.
        layers: Unpacked layers on disk.
        sum_image_sizes: Sum over images of their unpacked size, as if nothing were shared.
        sum_blob_sizes: Sum over images of their shipped (compressed) size.
        on_disk: Bytes the unique unpacked layers take.
    """

    images: int
    layers: int
    sum_image_sizes: int
    sum_blob_sizes: int
    on_disk: int


def safe_name(name: str) -> str:
    """Return ``name`` with every character outside ``[A-Za-z0-9._-]`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexpart):
        raise errors.InputError(f"digest {digest!r} is not sha256:<64 hex>")
    return hexpart


class ImageStore:
    """Reads and maintains the store under ``root`` (default ``sandpool_home()/oci-v1``).

    Args:
        root: The store directory.
    """

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root else sandpool_home() / STORE_VERSION
        self.layers_dir = self.root / "layers"
        self.images_dir = self.root / "images"
        self.refs_dir = self.root / "refs"
        self.tmp_dir = self.root / "tmp"

    def __repr__(self) -> str:
        return f"<ImageStore {self.root}>"

    # -- locking ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's exclusive lock (blocking): hydrations and prunes take turns."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def clear_tmp(self) -> int:
        """Remove leftovers of killed hydrations; call with :meth:`locked` held. Returns count."""
        n = 0
        if self.tmp_dir.is_dir():
            for p in self.tmp_dir.iterdir():
                shutil.rmtree(p, ignore_errors=True)
                n += 1
        return n

    # -- reading ---------------------------------------------------------------------------

    def layer_path(self, diff_id: str) -> Path:
        """Directory of the unpacked layer ``diff_id`` (present or not)."""
        return self.layers_dir / _hex(diff_id)

    def has_layer(self, diff_id: str) -> bool:
        """True when layer ``diff_id`` is fully unpacked in the store."""
        return self.layer_path(diff_id).is_dir() and self.layer_path(diff_id).with_suffix(".json").is_file()

    def image_path(self, digest: str) -> Path:
        """Directory of the image whose manifest digest is ``digest``."""
        return self.images_dir / _hex(digest)

    def resolve(self, name: str) -> OciImage | None:
        """Return the complete image ``name`` points at (a name or ``sha256:...``), else None.

        An image whose directory or any layer is missing is treated as absent.
        """
        ref: dict = {}
        if name.startswith("sha256:"):
            digest = name
        else:
            try:
                ref = json.loads((self.refs_dir / safe_name(name)).read_text())
            except (OSError, ValueError):
                return None
            digest = ref["digest"]
        d = self.image_path(digest)
        if not (d / _MARKER).is_file():
            return None
        img = OciImage.model_validate_json((d / "image.json").read_text())
        if not all(self.has_layer(layer.diff_id) for layer in img.layers):
            return None
        # One image (digest) may be known under several names, each from its own source.
        return img.model_copy(update={"name": ref.get("name", img.name), **{
            k: ref[k] for k in ("source", "source_digest") if k in ref}})

    def images(self) -> list[OciImage]:
        """Every usable image under each of its names, sorted by name."""
        out = []
        for ref in self.names():
            ref_name = json.loads((self.refs_dir / ref).read_text()).get("name", ref)
            img = self.resolve(ref_name)
            if img is not None:
                out.append(img)
        return sorted(out, key=lambda i: i.name)

    def names(self) -> dict[str, str]:
        """Map of every name (ref) to the manifest digest it points at."""
        out = {}
        if self.refs_dir.is_dir():
            for ref in self.refs_dir.iterdir():
                if not ref.name.startswith("."):
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        out[ref.name] = json.loads(ref.read_text())["digest"]
        return out

    def usage(self) -> StoreUsage:
        """Sizes: the images as if unshared against what the unique layers take on disk."""
        imgs = self.images()  # per name: two names of one digest are two images to a user
        layers = [p for p in self.layers_dir.glob("*.json")] if self.layers_dir.is_dir() else []
        on_disk = 0
        for meta in layers:
            on_disk += int(meta.read_text() or 0)
        return StoreUsage(images=len(imgs), layers=len(layers),
                          sum_image_sizes=sum(i.unpacked for i in imgs),
                          sum_blob_sizes=sum(i.size for i in imgs), on_disk=on_disk)

    # -- writing (callers hold :meth:`locked`) ----------------------------------------------

    def new_tmp(self, what: str) -> Path:
        """Make and return a fresh temporary directory under ``tmp/``."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        d = self.tmp_dir / f"{what}-{os.getpid()}-{time.monotonic_ns()}"
        d.mkdir()
        return d

    def commit_layer(self, diff_id: str, unpacked_dir: Path, nbytes: int) -> None:
        """Move a finished unpacked layer into place (a rename), then record its size."""
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        dest = self.layer_path(diff_id)
        if dest.exists():  # an earlier hydration got it but died before the size file
            shutil.rmtree(dest)
        unpacked_dir.rename(dest)
        _atomic_write(dest.with_suffix(".json"), str(nbytes))

    def commit_image(self, img: OciImage, names: list[str]) -> None:
        """Write ``img`` (image.json, then the marker), then point every name in ``names`` at it."""
        self.images_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.new_tmp("image")
        (tmp / "image.json").write_text(img.model_dump_json(indent=2) + "\n")
        (tmp / _MARKER).write_text(STORE_VERSION)
        dest = self.image_path(img.digest)
        if (dest / _MARKER).is_file():  # the same image under another name: keep the record
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        self.refs_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            _atomic_write(self.refs_dir / safe_name(name), json.dumps(
                {"name": name, "digest": img.digest, "source": img.source,
                 "source_digest": img.source_digest}) + "\n")

    def remove(self, name: str) -> bool:
        """Drop the name ``name`` (its image and layers go at the next :meth:`prune`)."""
        ref = self.refs_dir / safe_name(name)
        if ref.exists():
            ref.unlink()
            return True
        return False

    def prune(self) -> dict[str, int]:
        """Remove images no name points at, layers no image uses, and killed hydrations' work.

        Returns:
            ``{"images": n, "layers": n, "tmp": n, "bytes": n}``: what was removed.
        """
        with self.locked():
            tmp = self.clear_tmp()
            wanted = set(self.names().values())
            n_img = 0
            used: set[str] = set()
            if self.images_dir.is_dir():
                for d in list(self.images_dir.iterdir()):
                    complete = (d / _MARKER).is_file()
                    if complete and f"sha256:{d.name}" in wanted:
                        img = OciImage.model_validate_json((d / "image.json").read_text())
                        used |= {_hex(layer.diff_id) for layer in img.layers}
                        continue
                    shutil.rmtree(d, ignore_errors=True)
                    n_img += 1
            n_layers = freed = 0
            if self.layers_dir.is_dir():
                for d in list(self.layers_dir.iterdir()):
                    key = d.name.removesuffix(".json")
                    if key in used:
                        continue
                    if d.suffix == ".json":
                        with contextlib.suppress(OSError, ValueError):
                            freed += int(d.read_text() or 0)
                        d.unlink()
                        n_layers += 1
                    else:
                        shutil.rmtree(d, ignore_errors=True)
            for name, digest in self.names().items():  # names whose image vanished
                if not (self.image_path(digest) / _MARKER).is_file():
                    (self.refs_dir / name).unlink(missing_ok=True)
        return {"images": n_img, "layers": n_layers, "tmp": tmp, "bytes": freed}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
