"""Snapshots: a sandbox's filesystem state as a value, saved to a file and loaded elsewhere.

A :class:`Snapshot` is what :meth:`Lease.snapshot <sandpool.core.pool.Lease.snapshot>` returns:
the repo and everything else the sandbox changed since its image, not its processes. It is
made by the sandbox's backend (:meth:`Sandbox.snapshot <sandpool.core.base.Sandbox.snapshot>`),
which also restores it (:meth:`Sandbox.load_snapshot
<sandpool.core.base.Sandbox.load_snapshot>`) and says which state it holds
(:meth:`Sandbox.state_hash <sandpool.core.base.Sandbox.state_hash>`): a restore is verified
by that hash, as a reset is verified against the image.

Where the data lives: on the host that runs sandpool, in the backend's run directory (the
local backend's snapshot layers; the Kubernetes backend's change sets), removed when the
backend closes. :meth:`Snapshot.save` writes one file (a tar archive) that outlives it, and
:meth:`Snapshot.load` reads it back, in any process; the backend that restores a loaded
snapshot unpacks it into its own run directory once and checks every part's hash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sandpool.core import errors

__all__ = ["Snapshot"]

_META = "snapshot.json"
_FORMAT = 1


@dataclass(frozen=True)
class Snapshot:
    """A sandbox's filesystem state: the repo and every change outside it since the image.

    Usage::

        snap = await lease.snapshot()
        snap.save("/data/step7.snap")                 # one file, outlives the pool
        snap = Snapshot.load("/data/step7.snap")      # in any process
        async with pool.claim(task, from_snapshot=snap) as lease: ...

    Attributes:
        id: Unique name of this snapshot.
        image: The image it was taken from; it restores only onto sandboxes of that image.
        image_id: The identity of that image's build (an OCI image's digest, an image
            directory's repo commit and tree), checked at restore: a rebuilt image is another.
        backend: The backend kind that made it (``"local"``, ``"kubernetes"``), which alone
            can restore it.
        content_hash: sha256 hex of the state, as the backend defines it (see its
            ``state_hash``); a restored sandbox must show the same.
        size_bytes: Bytes of file content the snapshot holds (what it costs to keep or save).
        parts: The backend's data, as paths relative to :attr:`location`.
        location: A directory holding :attr:`parts`, or an archive written by :meth:`save`.
        detail: The backend's description of its parts (hashes, sizes), JSON-serializable.
    """

    id: str
    image: str
    image_id: str
    backend: str
    content_hash: str
    size_bytes: int
    parts: tuple[str, ...]
    location: Path
    detail: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False)

    @staticmethod
    def new_id() -> str:
        """A fresh snapshot id."""
        return f"snap-{uuid.uuid4().hex[:16]}"

    @property
    def archived(self) -> bool:
        """True when the data is in an archive (:meth:`load`), not yet unpacked."""
        return self.location.is_file()

    def _meta(self) -> dict[str, Any]:
        return {"format": _FORMAT, "id": self.id, "image": self.image, "image_id": self.image_id,
                "backend": self.backend, "content_hash": self.content_hash,
                "size_bytes": self.size_bytes, "parts": list(self.parts), "detail": dict(self.detail)}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the snapshot (its metadata and data) to one archive file at ``path``.

        Blocking; the cost is the snapshot's size. The archive keeps owners (numerically),
        modes, mtimes and extended attributes (GNU tar, as root).

        Returns:
            The path written.

        Raises:
            ConfigError: The snapshot's data is gone (its backend was closed before the save).
            OSError: The file could not be written.
        """
        out = Path(path)
        if self.archived:
            if self.location.resolve() != out.resolve():
                shutil.copyfile(self.location, out)
            return out
        missing = [p for p in self.parts if not (self.location / p).exists()]
        if missing or not self.location.is_dir():
            raise errors.ConfigError(
                f"snapshot {self.id}: its data ({(missing or [''])[0]} under {self.location}) is gone: a "
                "snapshot lives with the backend that took it; save() it before the pool closes")
        with tempfile.TemporaryDirectory(prefix=".sandpool-snap-", dir=out.parent) as tmp:
            (Path(tmp) / _META).write_text(json.dumps(self._meta()))
            part = out.with_name(f".{out.name}.part-{uuid.uuid4().hex[:8]}")
            res = subprocess.run(
                ["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner", "--sparse", "-cf",
                 str(part), "-C", tmp, _META, "-C", str(self.location), "--", *self.parts],
                capture_output=True, text=True)
            if res.returncode != 0:
                part.unlink(missing_ok=True)
                raise OSError(f"saving snapshot {self.id} to {out}: tar failed: {res.stderr.strip()[-300:]}")
            os.replace(part, out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Snapshot:
        """Read a snapshot saved by :meth:`save`. Its data stays in the archive until a
        backend restores it (and checks its hashes then).

        Raises:
            ConfigError: ``path`` is not a snapshot archive (the message says what is wrong).
            FileNotFoundError: No such file.
        """
        p = Path(path)
        try:
            with tarfile.open(p, "r:") as tar:
                member = tar.next()
                if member is None or member.name != _META:
                    raise errors.ConfigError(f"{p} is not a sandpool snapshot: its first member is "
                                             f"{member.name if member else 'missing'}, not {_META}")
                raw = tar.extractfile(member)
                assert raw is not None
                meta = json.loads(raw.read())
        except (tarfile.TarError, ValueError) as exc:
            raise errors.ConfigError(f"{p} is not a sandpool snapshot archive: {exc}") from None
        if meta.get("format") != _FORMAT:
            raise errors.ConfigError(f"{p}: snapshot format {meta.get('format')!r} is not known "
                                     f"(this sandpool reads format {_FORMAT})")
        try:
            return cls(id=meta["id"], image=meta["image"], image_id=meta["image_id"],
                       backend=meta["backend"], content_hash=meta["content_hash"],
                       size_bytes=int(meta["size_bytes"]), parts=tuple(meta["parts"]),
                       location=p, detail=MappingProxyType(dict(meta.get("detail") or {})))
        except (KeyError, TypeError) as exc:
            raise errors.ConfigError(f"{p}: snapshot metadata lacks {exc}") from None

    def unpacked(self, into: Path) -> Snapshot:
        """This snapshot with its data as a directory: itself when it is one, else its
        archive unpacked into ``into/<id>`` (once; reused after). Blocking.

        Raises:
            ConfigError: The archive is missing or does not hold the parts it lists.
        """
        if self.location.is_dir():
            return self
        dest = into / self.id
        if not dest.is_dir():
            if not self.location.is_file():
                raise errors.ConfigError(f"snapshot {self.id}: its data at {self.location} is gone (a "
                                         "snapshot lives with the backend that took it; save() it)")
            into.mkdir(parents=True, exist_ok=True)
            tmp = into / f".{self.id}.part-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            res = subprocess.run(["tar", "--xattrs", "--xattrs-include=*", "--numeric-owner",
                                  "--same-permissions", "-xf", str(self.location), "-C", str(tmp),
                                  "--exclude", _META], capture_output=True, text=True)
            if res.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                raise errors.ConfigError(f"snapshot {self.id}: unpacking {self.location} failed: "
                                         f"{res.stderr.strip()[-300:]}")
            missing = [p for p in self.parts if not (tmp / p).exists()]
            if missing:
                shutil.rmtree(tmp, ignore_errors=True)
                raise errors.ConfigError(f"snapshot {self.id}: {self.location} lacks {missing[0]}")
            try:
                os.rename(tmp, dest)
            except OSError:  # unpacked meanwhile by another restore
                shutil.rmtree(tmp, ignore_errors=True)
        return replace(self, location=dest)

    def check_target(self, image: str, image_id: str | None, backend: str) -> None:
        """Refuse to restore onto a sandbox of another image, build or backend.

        Raises:
            ConfigError: Naming the snapshot's image and the target's, and the fix.
        """
        if backend != self.backend:
            raise errors.ConfigError(
                f"snapshot {self.id} was taken on the {self.backend} backend and cannot be restored "
                f"on the {backend} backend; restore it with a {self.backend} pool")
        if image != self.image:
            raise errors.ConfigError(
                f"snapshot {self.id} is of image {self.image!r} and cannot be restored onto image "
                f"{image!r}: claim it for a task whose image is {self.image!r}")
        if image_id is not None and image_id != self.image_id:
            raise errors.ConfigError(
                f"snapshot {self.id} is of image {self.image!r} as built then ({self.image_id}); "
                f"that image is now {image_id}: a snapshot restores only onto the build it was "
                "taken from")
