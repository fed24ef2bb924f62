"""A scriptable in-memory backend for unit tests of pool logic and of faults real backends
cannot produce on demand. Every behaviour tested here is also tested on the local backend."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import re
from pathlib import Path

from sandpool.core import errors
from sandpool.core.base import Backend, ExecResult, Sandbox
from sandpool.core.snapshot import Snapshot


class MemorySandbox(Sandbox):
    """Remembers the commit it was checked out at and answers reset/verify commands.

    ``restore_repo`` models a backend that restores the repo from the image; set
    ``restore_fails`` to make it report a path it could not restore. Its files
    (``write_file``) are its state for snapshots; ``snapshot_error`` fails the next one."""

    def __init__(self, sid: str, image: str, commits: set[str] | None = None) -> None:
        self.id, self.image, self.workdir = sid, image, "/testbed"
        self.commits = commits  # the commits its repo has; None: any
        self.at = "0" * 40  # the commit its workdir is at
        self.dead = False
        self.dirty = False
        self.restore_fails = False
        self.fail_next_exec: errors.SandpoolError | None = None
        self.commands: list[str] = []
        self.files: dict[str, bytes] = {}
        self.snapshot_error: errors.SandpoolError | None = None

    def alive(self) -> bool:
        return not self.dead

    async def exec(self, cmd, *, timeout=60.0, cwd=None, env=None, max_output=1 << 20) -> ExecResult:
        if self.dead:
            raise errors.SandboxDied(f"{self.id} is dead")
        if self.fail_next_exec is not None:
            exc, self.fail_next_exec = self.fail_next_exec, None
            raise exc
        self.commands.append(cmd)
        if (m := re.search(r"(?:checkout -q -f --detach|cat-file -e) '?([0-9a-f]{40})", cmd)) \
                and self.commits is not None and m.group(1) not in self.commits:
            return ExecResult(128, b"", f"fatal: bad object {m.group(1)}\n".encode())
        if m := re.search(r"checkout -q -f --detach '?([0-9a-f]{40})", cmd):
            self.at = m.group(1)
            self.dirty = False
        if "ls -A" in cmd and "@@sandpool-verify@@" in cmd:  # scratch check: all clean
            return ExecResult(0, b"@@sandpool-verify@@\n@@sandpool-verify@@\n")
        return ExecResult(0, b"ok\n")

    async def restore_repo(self, under: str = "", *, timeout: float = 60.0) -> list[str]:
        if self.restore_fails:
            return ["calc.py differs from the image (replace)"]
        self.dirty = False
        self.at = self.head or "0" * 40
        self.files = {}
        return []

    def _hash(self) -> str:
        body = json.dumps({k: base64.b64encode(v).decode() for k, v in self.files.items()}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()

    async def snapshot(self) -> Snapshot:
        if self.dead:
            raise errors.SandboxDied(f"{self.id} is dead")
        if self.snapshot_error is not None:
            exc, self.snapshot_error = self.snapshot_error, None
            raise exc
        files = {k: base64.b64encode(v).decode() for k, v in self.files.items()}
        return Snapshot(id=Snapshot.new_id(), image=self.image, image_id="memory", backend="memory",
                        content_hash=self._hash(), size_bytes=sum(map(len, self.files.values())),
                        parts=(), location=Path("/nonexistent"), detail={"files": files})

    async def load_snapshot(self, snap: Snapshot) -> None:
        snap.check_target(self.image, "memory", "memory")
        self.files = {k: base64.b64decode(v) for k, v in snap.detail["files"].items()}
        self.dirty = bool(self.files)

    async def state_hash(self) -> str:
        return self._hash()

    async def read_file(self, path: str) -> bytes:
        if self.dead:
            raise errors.SandboxDied(f"{self.id} is dead")
        return self.files.get(path, b"")

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        if self.dead:
            raise errors.SandboxDied(f"{self.id} is dead")
        self.files[path] = data
        self.dirty = True

    async def processes(self) -> list[str]:
        return []

    async def kill_strays(self) -> int:
        return 0


class MemoryBackend(Backend):
    """Creates :class:`MemorySandbox` objects after ``create_delay`` seconds.

    Attributes:
        fail_creates: Number of upcoming creations that raise ``SandboxStartError``.
        head: Commit new sandboxes report as their pristine ``head`` (None: unknown).
        commits: The only commits sandboxes' repos have (a checkout of another fails as
            git's does); ``None``: any commit checks out.
        created_at: Monotonic times of every creation, for rate-limit tests.
    """

    name = "memory"

    def __init__(self, images: set[str] | None = None, create_delay: float = 0.0,
                 head: str | None = None, commits: set[str] | None = None) -> None:
        self.images = images
        self.commits = commits
        self.head = head
        self.create_delay = create_delay
        self.fail_creates = 0
        self.create_error: BaseException | None = None  # raised by the next creation, once
        self.delete_gate: asyncio.Event | None = None  # deletes wait on it when set
        self.deleting = 0
        self.peak_held = 0  # most sandboxes created and not yet fully deleted at once
        self.created_at: list[float] = []
        self.live: dict[str, MemorySandbox] = {}
        self._ids = itertools.count(1)

    async def hydrate(self, image: str) -> None:
        if self.images is not None and image not in self.images:
            raise errors.ImageNotFound(f"image {image!r} is not known")

    async def create(self, image: str) -> MemorySandbox:
        await self.hydrate(image)
        self.created_at.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.create_delay)
        if self.create_error is not None:
            exc, self.create_error = self.create_error, None
            raise exc
        if self.fail_creates:
            self.fail_creates -= 1
            raise errors.SandboxStartError("scripted start failure")
        sb = MemorySandbox(f"mem-{next(self._ids)}", image, self.commits)
        if self.head is not None:
            sb.head = sb.at = self.head
        self.live[sb.id] = sb
        self.peak_held = max(self.peak_held, len(self.live) + self.deleting)
        return sb

    async def delete(self, sandbox: Sandbox) -> None:
        if self.live.pop(sandbox.id, None) is None:
            return
        self.deleting += 1
        try:
            if self.delete_gate is not None:
                await self.delete_gate.wait()
        finally:
            self.deleting -= 1
