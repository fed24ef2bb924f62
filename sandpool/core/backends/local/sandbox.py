"""A running local sandbox: its agent spoken to over the bubblewrap process's stdio."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import itertools
import json
import os
import stat
from pathlib import Path, PurePosixPath

from sandpool.core import errors
from sandpool.core.agent.client import TRANSPORT_GRACE_S, exec_result
from sandpool.core.backends._service import RunningService, proc_argv, running_problems, tree, tree_diff
from sandpool.core.backends.local import _oci, _overlay
from sandpool.core.backends.local._bwrap import IMAGE_IN_SANDBOX, SCRATCH, SERVICE_DIR
from sandpool.core.backends.local._cgroup import BudgetWatch
from sandpool.core.backends.local._idrange import IdRange
from sandpool.core.backends.local.image import LocalImage
from sandpool.core.base import ExecResult, Sandbox
from sandpool.core.images import OciImage

__all__ = ["LocalSandbox"]

#: Free bytes under which a sandbox's quota filesystem counts as full: a restore that failed
#: with ENOSPC there failed for what the rollout wrote.
_FULL_BYTES = 1 << 20
#: Paths a rollout left under what is restored past which a restore that ran out of time ran
#: out for them (no honest rollout leaves a hundred thousand paths in ``.git``).
_MANY_PATHS = 100_000


class LocalSandbox(Sandbox):
    """A running local sandbox: an agent process spoken to over JSON lines on stdio.

    Created by :meth:`LocalBackend.create`; not constructed directly.
    """

    # Everything it can write outside the repo (see the package docstring); its own ipc ns.
    scratch = SCRATCH
    private_ipc = True

    def __init__(self, sid: str, image: LocalImage | OciImage, proc: asyncio.subprocess.Process,
                 state_dir: Path, upper: Path | None = None) -> None:
        self.id = sid
        self.image = image.name
        #: The image's repo on the host (the lower side of :meth:`restore_repo`) and where the
        #: agent sees it read-only; for OCI images set by the backend (a read-only view).
        self._lower: str | None = None if isinstance(image, OciImage) else image.repo
        self._image_in_sandbox = IMAGE_IN_SANDBOX
        self._pins: dict[str, Path] = {}  # repo path -> host copy of its pinned pristine bytes
        self._seen: dict[str, tuple[int, int, int]] = {}  # see _overlay.diff
        self.workdir = image.repo_dir if isinstance(image, OciImage) else image.workdir
        self.head = image.head
        self.state_dir = state_dir
        #: Host path of the service's directory (:data:`SERVICE_DIR`), or None without a service.
        self.service_dir: Path | None = None
        #: The environment the service was started with (its secrets included).
        self.service_env: dict[str, str] = {}
        self._service: RunningService | None = None
        #: Host path of the overlay's upper layer (what the rollout changed), for reset checks.
        self.upper = upper
        #: The OCI image it runs, or None for an image directory.
        self.oci = image if isinstance(image, OciImage) else None
        #: The overlay's lower directories, top first (OCI sandboxes; set by the backend).
        self.lowers: list[Path] = []
        self._proc = proc
        self._pending: dict[int, asyncio.Future[dict]] = {}
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self._death: errors.SandpoolError | None = None
        self.host_killed = False  # set by the backend before it kills the process tree
        #: The kernel's count of what exhausted the sandbox's own budget: whose a death is.
        self.budget: BudgetWatch | None = None
        #: The sandbox's own range of host ids (``_idrange``), released when it is deleted.
        self.ids: IdRange | None = None
        self._scratch: dict[str, dict] = {}  # scratch dir -> its metadata when fresh
        self._ready: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._ready.add_done_callback(_retrieve)
        self._reader = asyncio.create_task(self._read_loop(), name=f"sandpool-reader-{sid}")

    def __repr__(self) -> str:
        state = f"dead: {self._dead}" if self._dead else "alive"
        return f"<LocalSandbox {self.id} image={self.image!r} {state} pending={len(self._pending)}>"

    @property
    def pid(self) -> int:
        """Host pid of the sandbox's bubblewrap process."""
        return self._proc.pid

    def alive(self) -> bool:
        """True until the agent's channel closed or the process exited."""
        return self._dead is None and self._proc.returncode is None

    async def _read_loop(self) -> None:
        assert self._proc.stdout is not None
        reason = "the sandbox process exited"
        try:
            while True:
                line = await self._proc.stdout.readline()
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    reason = f"garbled frame from the agent: {line[:80]!r}"
                    break
                rid = msg.get("id")
                if rid == 0 and not self._ready.done():
                    self._ready.set_result(msg)
                    continue
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (ValueError, OSError) as exc:  # line over the stream limit, or pipe error
            reason = f"agent channel failed: {exc}"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._proc.wait(), 2.0)
        rc = self._proc.returncode
        if rc is not None and rc > 128:  # bubblewrap outlived its agent: the signal that killed it
            reason = f"its agent was killed by signal {rc - 128}"
        # The policy cannot signal the agent (its pid 1), so the death is the policy's only
        # when the kernel counted its sandbox's own budget exhausted; else it came from
        # outside (the host's OOM killer, an operator, the node), and the host's own kills
        # (delete, kill) are never the policy's.
        evidence = [] if self.host_killed or self.budget is None else self.budget.evidence()
        err: errors.SandpoolError
        if evidence and self._ready.done():
            err = errors.SandboxExhausted(f"sandbox {self.id}: {reason}, and {'; '.join(evidence)}")
        else:
            err = errors.SandboxDied(f"sandbox {self.id}: {reason}"
                                     + ("" if self.host_killed else " (no OOM or pid-limit event in "
                                        "its cgroup: not its processes' doing)"))
        self._dead = reason
        self._death = err
        if not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    async def _wait_ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise errors.SandboxStartError(
                f"sandbox {self.id} did not become ready within {timeout:.0f} s"
            ) from None
        except errors.SandboxDied as exc:
            log = (self.state_dir / "stderr.log").read_text(errors="replace")[-2000:]
            raise errors.SandboxStartError(f"sandbox {self.id} failed to start: {log.strip() or exc}") from None

    async def _call(self, op: str, wait_s: float, **fields: object) -> dict:
        # The single boundary where OS and protocol errors become sandpool errors.
        if self._death is not None:
            raise self._death
        if self._dead is not None:
            raise errors.SandboxDied(f"sandbox {self.id}: {self._dead}")
        rid = next(self._ids)
        fut: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            assert self._proc.stdin is not None
            frame = json.dumps({"id": rid, "op": op, **fields}).encode() + b"\n"
            self._proc.stdin.write(frame)
            await self._proc.stdin.drain()
            msg = await asyncio.wait_for(fut, wait_s)
        except (BrokenPipeError, ConnectionResetError) as exc:
            await asyncio.shield(self._reader)  # it says whether the death came from inside
            if self._death is not None:
                raise self._death from exc
            raise errors.SandboxDied(f"sandbox {self.id}: channel closed ({exc})") from exc
        except TimeoutError:
            raise errors.ExecTransportError(
                f"sandbox {self.id}: no answer to {op!r} within {wait_s:.0f} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
            _retrieve(fut)  # the reader may have failed it while we were raising something else
        if msg.get("error") == "exhausted":  # the kernel refused the agent a thread
            evidence = self.budget.evidence() if self.budget is not None else []
            if evidence:
                raise errors.SandboxExhausted(f"sandbox {self.id}: its agent could not serve {op!r} "
                                              f"({msg['message']}): {'; '.join(evidence)}")
        if msg.get("error") in ("agent_exception", "exhausted"):
            raise errors.ExecTransportError(f"sandbox {self.id}: agent failed {op!r}: {msg['message']}")
        return msg

    def _abs(self, path: str) -> str:
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self.workdir) / p)

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output: int = 1 << 20,
    ) -> ExecResult:
        """Run ``cmd`` in the sandbox; see :meth:`Sandbox.exec`."""
        msg = await self._call(
            "exec",
            timeout + TRANSPORT_GRACE_S,
            cmd=cmd,
            timeout=timeout,
            cwd=self._abs(cwd or self.workdir),
            env=env or {},
            max_output=max_output,
        )
        return exec_result(msg)

    async def read_file(self, path: str) -> bytes:
        """Return the bytes of ``path``; see :meth:`Sandbox.read_file`."""
        msg = await self._call("read_file", 60.0, path=self._abs(path))
        self._raise_os_error(msg, path)
        return base64.b64decode(msg["data"])

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path``; see :meth:`Sandbox.write_file`."""
        msg = await self._call("write_file", 60.0, path=self._abs(path),
                               data=base64.b64encode(data).decode(), mode=mode)
        self._raise_os_error(msg, path)

    def _raise_os_error(self, msg: dict, path: str) -> None:
        if msg.get("error") == "os_error":
            raise errors.sandbox_file_error(int(msg["errno"]), path, f"in sandbox {self.id}")

    async def changes_outside_repo(self) -> list[tuple[str, str]] | None:
        """For an OCI sandbox, what its upper layer holds outside the repo and ``/tmp`` (read
        on the host, see ``_oci.changes_outside``); None for an image directory, whose only
        writable places are the repo and ``/tmp``."""
        if self.oci is None or self.upper is None:
            return None
        return await asyncio.to_thread(_oci.changes_outside, self.upper, self.lowers,
                                       (self.workdir, "/tmp"))

    async def processes(self) -> list[str]:
        """Command lines of every process in the sandbox except its agent and init."""
        return list((await self._call("ps", 30.0))["procs"])

    async def kill_strays(self) -> int:
        """SIGKILL every process but the agent; return how many were signalled."""
        return int((await self._call("kill_strays", 30.0))["killed"])

    async def restore_repo(self, under: str = "", *, timeout: float = 60.0) -> list[str] | None:
        """Make the repo at or below ``under`` identical to the image's; see :meth:`Sandbox.restore_repo`.

        The overlay's upper layer, read on the host, lists what the rollout changed
        (:func:`._overlay.diff`); the agent copies those paths back from the image's repo
        (bind-mounted read-only) through the merged view; then the upper layer is compared
        with the image again, on the host, out of the policy's reach. Cost: O(paths changed).
        """
        if self._lower is None or self.upper is None:
            return None  # no read-only view of the image's repo: the generic path instead
        upper = self._repo_upper()
        prefix = under.strip("/")
        pins = {r: str(p) for r, p in self._pins.items()
                if not prefix or r == prefix or r.startswith(prefix + "/")}
        changes = await asyncio.to_thread(_overlay.diff, self._lower, upper, under, pins, self._seen)
        # A pin holds only below a directory the rollout left in place; where it replaced one
        # (``rm -rf .git``), the image's own file is the reference again until re-pinned.
        dropped = {r for r in pins for c in changes
                   if c.kind == "replace" and r.startswith(f"{c.path}/" if c.path else "")}
        if dropped:
            for r in dropped:
                pins.pop(r)
                self._pins.pop(r, None)
            changes = await asyncio.to_thread(_overlay.diff, self._lower, upper, under, pins, self._seen)
        if not changes:
            return []
        pinned = {}
        for c in changes:
            if c.path in pins:
                st = os.stat(pins[c.path])
                pinned[c.path] = {"data": base64.b64encode(Path(pins[c.path]).read_bytes()).decode(),
                                  "mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns}
        # What the rollout left there, counted before the agent starts removing it (bounded): if
        # the restore runs out of time, this says whether for the rollout's paths.
        many = await asyncio.to_thread(_overlay.count_at_least, upper / prefix if prefix else upper,
                                       _MANY_PATHS)
        try:
            msg = await self._call("restore", timeout, root=self.workdir, image=self._image_in_sandbox,
                                   changes=[[c.path, c.kind] for c in changes], pinned=pinned)
        except errors.ExecTransportError as exc:
            if many:
                raise errors.SandboxExhausted(
                    f"sandbox {self.id}: restoring {under or 'the repo'} from the image did not finish "
                    f"in {timeout:.0f} s: the rollout left over {_MANY_PATHS} paths there") from exc
            raise
        full = self._disk_full() if {errno.ENOSPC, errno.EDQUOT} & set(msg.get("errnos", [])) else None
        if full:  # the restore could not write the image's files back: the rollout filled the disk
            raise errors.DiskQuotaExceeded(errno.ENOSPC, f"the restore from the image failed ({full}; "
                                           f"in sandbox {self.id})", under or ".")
        left = await asyncio.to_thread(_overlay.diff, self._lower, upper, under, pins, self._seen)
        return [f"{c.path or '.'} differs from the image ({c.kind})" for c in left] + [
            f"restore failed: {m}" for m in msg.get("failed", [])][:20]

    def _disk_full(self) -> str | None:
        """Why the sandbox's quota filesystem is full, read on the host (the evidence that an
        ENOSPC inside was the rollout's doing), or None: no quota (ENOSPC would be the host's
        disk), or room left."""
        disk = self.state_dir / "disk"
        if not os.path.ismount(disk):
            return None
        st = os.statvfs(disk)
        if st.f_favail == 0:
            return f"its disk quota has no inode left of {st.f_files}"
        if st.f_bavail * st.f_frsize < _FULL_BYTES:
            return f"its disk quota has {st.f_bavail * st.f_frsize} bytes left of {st.f_blocks * st.f_frsize}"
        return None

    async def restore_service(self, *, timeout: float = 60.0) -> list[str]:
        """Bring the sandbox's service back to its pristine state and verify it; see
        :meth:`Sandbox.restore_service`.

        Checks, in order: the service is the process started with the sandbox (same pid and
        start time), alive, not stopped, with the priority, resource limits and CPU affinity it
        started with (``_service.proc_state``); its :attr:`ServiceSpec.reset_argv` exits 0; its
        directory, read on the host, is what it was when recorded fresh (every path's type and
        mode, each file's bytes, each link's target). Run it with no process of the rollout
        left (:meth:`kill_strays`). Cost: one ``/proc`` read, ``reset_argv``, a walk of the
        service directory.

        Returns:
            What differs (empty: pristine); [] without a service.
        """
        svc = self._service
        if svc is None:
            return []
        problems = await self._service_running(svc, timeout)
        problems = problems or await self._service_reset(svc, timeout)
        if not problems:
            assert self.service_dir is not None
            problems = tree_diff(svc.pristine, await asyncio.to_thread(tree, self.service_dir))
        # Again at the end: a fatal signal sent just before the reset may take effect during it.
        return problems or await self._service_running(svc, timeout)

    async def record_scratch(self, *, timeout: float = 30.0) -> None:
        """Record the scratch directories' own metadata as pristine; the backend calls it once,
        as soon as the agent is ready (no command of any rollout has run).

        Raises:
            SandboxStartError: A scratch directory could not be read.
        """
        meta = (await self._call("scratch", timeout, paths=list(self.scratch)))["meta"]
        bad = {p: m["error"] for p, m in meta.items() if "error" in m}
        if bad:
            raise errors.SandboxStartError(f"sandbox {self.id}: cannot read its scratch directories: {bad}")
        self._scratch = meta

    async def restore_scratch(self, *, timeout: float = 60.0) -> list[str]:
        """Empty the scratch directories (any depth) and set their mode, times and extended
        attributes back to those recorded fresh (:meth:`record_scratch`), through the agent's
        ``scratch`` op, then compare what it reads back with the record (the owner too); see
        :meth:`Sandbox.restore_scratch`."""
        if not self._scratch:
            return [f"no pristine record of the scratch directories of sandbox {self.id}"]
        msg = await self._call("scratch", timeout, paths=list(self._scratch), restore=self._scratch)
        got, left = msg["meta"], msg.get("left", {})
        problems = [f"scratch space not empty: {p} holds {names}" for p, names in left.items() if names]
        for path, want in self._scratch.items():
            now = got.get(path) or {"error": "not read"}
            if "error" in now:
                problems.append(f"scratch directory {path} could not be restored: {now['error']}")
            elif diff := [f"{k} {now.get(k)!r} (fresh {v!r})" for k, v in want.items()
                          if now.get(k) not in (v, "refreshed", "unwritable")]:  # see the op
                problems.append(f"scratch directory {path} is not as fresh: {', '.join(diff)}")
        return problems

    async def service_problems(self, *, timeout: float = 30.0) -> list[str]:
        """Why the sandbox's service is not running as it started (gone, stopped, its limits
        changed), one sentence each; [] when it is, or without a service. Read through the
        agent: the same check the in-place reset makes first (:meth:`restore_service`)."""
        return [] if self._service is None else await self._service_running(self._service, timeout)

    async def _service_running(self, svc: RunningService, timeout: float) -> list[str]:
        res = await self.exec(proc_argv(svc.pid), timeout=timeout)
        return running_problems(svc, res.text if res.ok else None)

    async def _service_reset(self, svc: RunningService, timeout: float) -> list[str]:
        if svc.spec.reset_argv is None:
            return []
        res = await self.exec(list(svc.spec.reset_argv), timeout=timeout, cwd=SERVICE_DIR,
                              env={**self.service_env, "SANDPOOL_SERVICE_PID": str(svc.pid)})
        if res.ok:
            return []
        return [f"its service's reset failed (exit {res.exit_code}, timed out: {res.timed_out}): "
                f"{(res.err_text or res.text).strip()[-300:]}"]

    def _repo_upper(self) -> Path:
        assert self.upper is not None
        # An OCI sandbox's overlay is its whole root: the repo is one subtree of its upper.
        return self.upper / self.workdir.lstrip("/") if self.oci is not None else self.upper

    async def pin_repo_state(self, paths: list[str]) -> None:
        """Take the current bytes of repo files ``paths`` as their pristine state; see
        :meth:`Sandbox.pin_repo_state`. A copy goes to the sandbox's host-side state
        directory, out of the policy's reach; a path that is not a plain file is unpinned."""
        if self._lower is None or self.upper is None:
            return
        upper = self._repo_upper()
        pin_dir = self.state_dir / "pinned"
        pin_dir.mkdir(exist_ok=True)
        for rel in paths:
            dst = pin_dir / rel.replace("/", "%")
            try:
                fd = os.open(upper / rel, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                self._pins.pop(rel, None)
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    self._pins.pop(rel, None)
                    continue
                dst.write_bytes(f.read())
            os.chmod(dst, stat.S_IMODE(st.st_mode))
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            self._pins[rel] = dst


def _retrieve(fut: asyncio.Future) -> None:
    # Mark a failed future's exception as seen; the caller got (or will get) its own error.
    if fut.done() and not fut.cancelled():
        fut.exception()
