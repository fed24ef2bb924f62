"""Local sandboxes: a bubblewrap process tree per sandbox, the embedded default backend.

Each sandbox is one long-lived agent process (``_agent.py``) under bubblewrap:

* no network (``--unshare-all``; ``ResourceLimits.network`` shares it back), its own pid,
  ipc, uts, user and cgroup namespaces, ``--die-with-parent``, ``--new-session``, and no
  nested user namespaces;
* root inside is no one outside: the user namespace maps into the unprivileged id range OCI
  sandboxes use (uid 1000 inside is host uid 101000; ``_idmap``), bubblewrap itself runs as
  that uid, and the repo's lower layer is a copy of the image's repo owned by it; so what a
  rollout writes, setuid bits included, belongs to no host user;
* a read-only view of the host's ``/usr`` (the toolchain), the image's interpreter and venv,
  and nothing of the host's home, work trees or environment (``--clearenv``);
* the image's repo at ``/testbed`` as an overlayfs whose upper layer is private to the
  sandbox (copy-on-write, not a copy), the image's repo itself read-only at
  ``/opt/sandpool/image`` (the in-place reset's restore source), a private ``/tmp`` and
  ``/dev/shm``, a private mqueue at ``/dev/mqueue``, and nothing else writable;
* CPU, memory and pid limits from its own cgroup, joined before bubblewrap starts; its
  commands run one level down (``_cgroup``), so a fork or memory bomb cannot starve the agent;
* a disk quota (``ResourceLimits.disk_bytes``): the overlay's upper layer and ``/tmp`` live on
  a per-sandbox loop-mounted filesystem of that size (``_quota``), so a rollout that writes too
  much gets ENOSPC inside its sandbox (``write_file`` raises :class:`DiskQuotaExceeded`) and
  the host disk is never filled; the sandbox stays usable and the in-place reset frees it;
* optionally one long-lived service process per sandbox (:class:`ServiceSpec`, e.g. an
  agent-server), started while the sandbox is created, with a writable directory of its own
  at :data:`SERVICE_DIR` (outside the repo and the scratch directories); ``ps`` and
  ``kill_strays``, and so in-place reset, leave it running (image directories only).

OCI images hydrated into the image store (``sandpool images pull``, :mod:`sandpool.core.images`)
are started the same way with their own root filesystem as ``/`` and root inside mapped to an
unprivileged host uid; see ``_oci``. A name is looked up as an image directory first, then in
the image store.

An image is a directory ``<images_root>/<safe-name>/`` holding ``image.json``, ``repo/`` and
``venv/`` (see :class:`LocalImage`); building one is hydration, done before rollouts ask.
Overlay mounts need root (``CAP_SYS_ADMIN``); :meth:`LocalBackend.preflight` says so plainly.

This module is ~990 lines, over the project's ~400 (not split yet, for want of time): it holds the backend and its sandbox class,
whose start path (mounts, quota, cgroups, bubblewrap argv) is one sequence that must undo itself
on failure. Known seams to split next: the OCI start path into ``_oci``, and the host side of the
agent protocol onto the Kubernetes backend's ``_agent_client``, which decodes the same frames.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ValidationError

from sandpool.core import errors
from sandpool.core.backends import _cgroup, _idmap, _oci, _overlay, _quota
from sandpool.core.backends._agent_client import exec_result
from sandpool.core.backends._service import RunningService, proc_argv, proc_state, running_problems, tree, tree_diff
from sandpool.core.base import Backend, ExecResult, ResourceLimits, Sandbox
from sandpool.core.images import ID_BASE, ImageStore, OciImage
from sandpool.core.mounts import mount_overlay
from sandpool.core.mounts import umount as _umount
from sandpool.core.paths import sandpool_home

__all__ = ["SERVICE_DIR", "LocalBackend", "LocalImage", "LocalSandbox", "ServiceSpec", "image_dir"]

#: The service's own writable directory inside the sandbox (a host directory per sandbox,
#: ``LocalSandbox.service_dir``); it is its working directory.
SERVICE_DIR = "/run/sandpool-service"

_AGENT = Path(__file__).with_name("_agent.py")
_AGENT_IN_SANDBOX = "/opt/sandpool/agent.py"
_WORK_CGROUP_IN_SANDBOX = "/opt/sandpool/work-cgroup"
_IMAGE_IN_SANDBOX = "/opt/sandpool/image"
_SANDBOX_UID = _idmap.SANDBOX_UID
_TRANSPORT_GRACE_S = 10.0
_STREAM_LIMIT = 256 << 20  # bytes; one response line carries a whole (base64) output


def image_dir(images_root: Path, name: str) -> Path:
    """Return the directory of local image ``name`` under ``images_root``.

    ``sandpool.local/toolz:1.0.0`` maps to ``<images_root>/sandpool.local_toolz_1.0.0``.
    """
    return Path(images_root) / re.sub(r"[^A-Za-z0-9._-]", "_", name)


class LocalImage(BaseModel):
    """``image.json``: what a local image directory holds.

    Attributes:
        name: The image name tasks refer to.
        python_prefix: ``sys.base_prefix`` of the interpreter the venv was made from; it is
            bind-mounted read-only at the same path.
        venv: Absolute path of the image's venv (bind-mounted read-only at the same path).
        repo: Absolute path of the git repo that becomes ``workdir`` (overlay lower layer).
        workdir: Where the repo appears inside the sandbox.
        head: The repo's HEAD commit, read when the image is loaded (not from the file).
    """

    name: str
    python_prefix: str
    venv: str
    repo: str
    workdir: str = "/testbed"
    head: str | None = None


@dataclass(frozen=True)
class ServiceSpec:
    """A long-lived process every sandbox of a backend runs beside the policy's commands.

    Usage: ``LocalBackend(service=ServiceSpec(argv=("/opt/srv/bin/python", "-m", "srv")))``.

    Attributes:
        argv: The command, run in :data:`SERVICE_DIR` with the sandbox's environment plus ``env``,
            in the policy's work cgroup (what it runs for the policy counts there); its output
            goes to the sandbox's ``stderr.log`` on the host (``LocalSandbox.state_dir``), out
            of the policy's reach: a log inside the sandbox would carry one rollout's words
            to the next.
        env: Extra environment variables.
        binds: ``(host path, sandbox path)`` pairs bind-mounted read-only (the service's code).
        ready_argv: A command run once after the start that exits 0 when the service is ready
            (it waits itself, e.g. for a socket to answer; ``$SANDPOOL_SERVICE_PID`` is the
            service's pid, so it can give up when the service dies); creation fails if it
            does not exit 0.
        ready_timeout: Seconds ``ready_argv`` may take.
        secret_env: Names of variables set to a fresh random secret for each sandbox's service
            (e.g. the key its clients must present); the values are in
            ``LocalSandbox.service_env``.
        reset_argv: A command the in-place reset runs (after the rollout's processes are
            killed, with ``env``, the secrets and ``$SANDPOOL_SERVICE_PID``) that makes the
            service drop what the rollout left in it (e.g. an agent-server's conversations,
            through its own API); it must exit 0. It also runs once when the service is
            ready, before the service directory's pristine state is recorded.

    The service directory is the service's state, and the policy (same uid) can write it, so
    the in-place reset holds it to its pristine state (see :meth:`LocalSandbox.restore_service`):
    the same service process, running, and after ``reset_argv`` a directory identical to the
    one recorded when the sandbox was fresh; anything else quarantines the sandbox. The
    service's own memory is its business: a service holding secrets or per-rollout state in
    memory should make itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so the policy's
    processes, which lack ``CAP_SYS_PTRACE``, cannot ptrace it or read its ``/proc`` files.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    binds: tuple[tuple[str, str], ...] = ()
    ready_argv: tuple[str, ...] | None = None
    ready_timeout: float = 60.0
    secret_env: tuple[str, ...] = ()
    reset_argv: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # A bind under a scratch directory would leave a mount point there, which the in-place
        # reset finds and quarantines for: every reused sandbox would be lost.
        for _, dest in self.binds:
            where = PurePosixPath(dest)
            if not where.is_absolute() or any(where.is_relative_to(d) for d in LocalSandbox.scratch):
                raise errors.ConfigError(
                    f"ServiceSpec.binds: sandbox path {dest!r} must be absolute and outside "
                    f"{', '.join(LocalSandbox.scratch)} (scratch the in-place reset empties); "
                    "bind it under /opt instead")


class LocalSandbox(Sandbox):
    """A running local sandbox: an agent process spoken to over JSON lines on stdio.

    Created by :meth:`LocalBackend.create`; not constructed directly.
    """

    # Everything it can write outside the repo (see the module docstring); its own ipc ns.
    scratch = ("/tmp", "/dev/shm", "/dev/mqueue")
    private_ipc = True

    def __init__(self, sid: str, image: LocalImage | OciImage, proc: asyncio.subprocess.Process,
                 state_dir: Path, upper: Path | None = None) -> None:
        self.id = sid
        self.image = image.name
        #: The image's repo on the host (the lower side of :meth:`restore_repo`) and where the
        #: agent sees it read-only; for OCI images set by the backend (a read-only view).
        self._lower: str | None = None if isinstance(image, OciImage) else image.repo
        self._image_in_sandbox = _IMAGE_IN_SANDBOX
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
        err: errors.SandpoolError
        if rc is not None and rc > 128 and not self.host_killed and self._ready.done():
            # bubblewrap outlived its agent and reports the signal that killed it: only a
            # process inside the sandbox (or the sandbox's own OOM) sends that. The host's
            # kills take bubblewrap first (a negative return code).
            reason = (f"its agent was killed by signal {rc - 128} from inside the sandbox (the "
                      "policy's processes killed it or exhausted its memory)")
            err = errors.SandboxExhausted(f"sandbox {self.id}: {reason}")
        else:
            err = errors.SandboxDied(f"sandbox {self.id}: {reason}")
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
        if msg.get("error") == "agent_exception":
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
            timeout + _TRANSPORT_GRACE_S,
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
        msg = await self._call("restore", timeout, root=self.workdir, image=self._image_in_sandbox,
                               changes=[[c.path, c.kind] for c in changes], pinned=pinned)
        left = await asyncio.to_thread(_overlay.diff, self._lower, upper, under, pins, self._seen)
        return [f"{c.path or '.'} differs from the image ({c.kind})" for c in left] + [
            f"restore failed: {m}" for m in msg.get("failed", [])][:20]

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


class LocalBackend(Backend):
    """Creates sandboxes as bubblewrap process trees on this machine.

    Usage::

        backend = LocalBackend()                       # images under ~/.cache/sandpool/images
        sandbox = await backend.create("sandpool.local/toolz:1.0.0")
        result = await sandbox.exec("git status", timeout=10)
        await backend.aclose()                         # deletes every sandbox it made

    Args:
        images_root: Directory of image directories (default ``sandpool_home()/images``).
        limits: Per-sandbox CPU, memory, pid and network settings.
        state_root: Where per-sandbox overlay layers live (default ``sandpool_home()/local``).
        start_timeout: Seconds a sandbox may take to accept commands.
        bwrap: The bubblewrap executable.
        require_limits: Refuse to run when no cgroup hierarchy is writable (default). Set
            False to run without CPU/memory/pid limits, e.g. unprivileged in a container.
        store: The OCI image store consulted for names that are not image directories
            (default ``ImageStore()``, under ``sandpool_home()/oci-v1``).
        service: A long-lived process each sandbox starts before it is handed out.
    """

    name = "local"

    def __init__(
        self,
        images_root: Path | str | None = None,
        *,
        limits: ResourceLimits = ResourceLimits(),
        state_root: Path | str | None = None,
        start_timeout: float = 30.0,
        bwrap: str = "bwrap",
        require_limits: bool = True,
        store: ImageStore | None = None,
        service: ServiceSpec | None = None,
    ) -> None:
        self.images_root = Path(images_root) if images_root else sandpool_home() / "images"
        self.limits = limits
        self.run_id = uuid.uuid4().hex[:8]
        self._state_base = Path(state_root) if state_root else sandpool_home() / "local"
        self._run_dir = self._state_base / self.run_id
        self.start_timeout = start_timeout
        self.bwrap = bwrap
        self.require_limits = require_limits
        self.store = store or ImageStore()
        self.service = service
        self._images: dict[str, LocalImage | OciImage] = {}
        self._live: dict[str, LocalSandbox] = {}
        self._seq = itertools.count(1)
        self._cgroups = _cgroup.detect(f"sandpool/{self.run_id}")
        self._preflight_ok = False

    def __repr__(self) -> str:
        return f"<LocalBackend run={self.run_id} live={len(self._live)} images={len(self._images)}>"

    async def preflight(self) -> None:
        """Check bubblewrap, overlay permission and cgroups; reap dead runs' leftovers.

        Raises:
            BackendUnavailable: With one sentence naming what is missing and the fix.
        """
        if self._preflight_ok:
            return
        if shutil.which(self.bwrap) is None:
            raise errors.BackendUnavailable(
                f"bubblewrap ({self.bwrap!r}) is not on PATH; install it: apt-get install bubblewrap"
            )
        if os.geteuid() != 0:
            raise errors.BackendUnavailable(
                "the local backend mounts an overlay per sandbox and needs root (CAP_SYS_ADMIN); "
                "run as root or use the kubernetes backend"
            )
        if self._cgroups is None and self.require_limits:
            raise errors.BackendUnavailable(
                "no writable cgroup hierarchy (v1 pids+memory+cpu or v2) for sandbox limits; "
                "fix the cgroup mount or pass require_limits=False to run without limits"
            )
        reap_stale(self._state_base)
        self._run_dir.mkdir(parents=True, exist_ok=True)
        (self._run_dir / "owner.pid").write_text(str(os.getpid()))
        self._preflight_ok = True

    def image(self, name: str) -> LocalImage | OciImage:
        """Load and cache image ``name``: an image directory's ``image.json``, else an OCI
        image from the store.

        Raises:
            ImageNotFound: No built or hydrated image of that name; the message says how to
                get one.
        """
        if name in self._images:
            return self._images[name]
        path = image_dir(self.images_root, name) / "image.json"
        if not path.exists():
            oci = self.store.resolve(name)
            if oci is not None:
                self._images[name] = oci
                return oci
            raise errors.ImageNotFound(
                f"image {name!r} is not built under {self.images_root} (no {path.name}) nor "
                f"hydrated in {self.store.root}; build the task pack (`sandpool build-pack`), "
                f"hydrate it (`sandpool images pull docker://{name}`, or a docker-archive:/oci: "
                "source with --name), or fix the task's `image` field"
            )
        try:
            img = LocalImage.model_validate_json(path.read_text())
        except ValidationError as exc:
            raise errors.ImageNotFound(f"image {name!r}: {path} is malformed: {exc}") from exc
        for field in ("venv", "repo", "python_prefix"):
            if Path(getattr(img, field)).is_relative_to("/tmp"):
                raise errors.ImageNotFound(
                    f"image {name!r}: {field} {getattr(img, field)} is under /tmp, which is private "
                    "to each sandbox; build images elsewhere (the default is under sandpool_home())"
                )
            if not Path(getattr(img, field)).is_dir():
                raise errors.ImageNotFound(
                    f"image {name!r}: {field} directory {getattr(img, field)} is missing; rebuild the image"
                )
        rev = subprocess.run(["git", "-C", img.repo, "rev-parse", "-q", "--verify", "HEAD"],
                             capture_output=True, text=True)
        img = img.model_copy(update={"head": rev.stdout.strip() or None})
        self._images[name] = img
        return img

    async def hydrate(self, image: str) -> None:
        """Verify that local image ``image`` is built (see :meth:`image`), and make its repo's
        copy owned by the sandbox's uid (``_idmap.shifted_repo``) so no create waits for it."""
        img = self.image(image)
        if isinstance(img, LocalImage):
            await _offload_ret(_idmap.shifted_repo, img.repo)

    def _bwrap_argv(self, img: LocalImage, merged: Path, tmp: Path | None,
                    work_procs: Sequence[str] = (), service_dir: Path | None = None) -> list[str]:
        venv_bin = f"{img.venv}/bin"
        argv = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            *(["--share-net"] if self.limits.network else []),
            "--die-with-parent",
            "--new-session",
            # The agent is the sandbox's pid 1: no process inside shares its pipes (see _agent).
            "--as-pid-1",
            "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID),
            # The host disabled nested user namespaces (_idmap.disable_nested_userns); check.
            "--assert-userns-disabled",
            "--hostname", "sandbox",
            "--clearenv",
            "--ro-bind", "/usr", "/usr",
        ]
        for top in ("bin", "sbin", "lib", "lib32", "lib64"):
            host = Path("/") / top
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.exists():
                argv += ["--ro-bind", str(host), f"/{top}"]
        etc = self._run_dir / "etc"
        for name in ("passwd", "group", "hosts"):
            argv += ["--ro-bind", str(etc / name), f"/etc/{name}"]
        for name in ("ld.so.cache", "ssl", "alternatives", "localtime", "mime.types"):
            argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        argv += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--tmpfs", "/dev/shm",
            "--mqueue", "/dev/mqueue",
            *(["--bind", str(tmp), "/tmp"] if tmp else ["--tmpfs", "/tmp"]),
            "--ro-bind", img.python_prefix, img.python_prefix,
            "--ro-bind", img.venv, img.venv,
            "--bind", str(merged), img.workdir,
            "--ro-bind", img.repo, _IMAGE_IN_SANDBOX,
            "--ro-bind", str(_AGENT), _AGENT_IN_SANDBOX,
        ]
        if self.service is not None and service_dir is not None:
            for host, dest in self.service.binds:
                argv += ["--ro-bind", host, dest]
            argv += ["--bind", str(service_dir), SERVICE_DIR]
        # The agent puts each command into the work cgroup (its pid and memory budget),
        # through these files only: the policy cannot see or change any limit.
        for i, procs in enumerate(work_procs):
            argv += ["--bind", procs, f"{_WORK_CGROUP_IN_SANDBOX}/{i}"]
        if work_procs:
            argv += ["--setenv", "SANDPOOL_WORK_CGROUP", _WORK_CGROUP_IN_SANDBOX]
        argv += [
            "--setenv", "PATH", f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
            "--setenv", "VIRTUAL_ENV", img.venv,
            "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "TMPDIR", "/tmp",
            "--setenv", "GIT_CONFIG_NOSYSTEM", "1",
            "--setenv", "GIT_AUTHOR_NAME", "sandbox", "--setenv", "GIT_AUTHOR_EMAIL", "sandbox@localhost",
            "--setenv", "GIT_COMMITTER_NAME", "sandbox", "--setenv", "GIT_COMMITTER_EMAIL", "sandbox@localhost",
            # The root is bubblewrap's scratch tmpfs: make it read-only once mounts are in place;
            # so is /dev's, so only the repo, /tmp, /dev/shm and /dev/mqueue are writable.
            "--remount-ro", "/dev",
            "--remount-ro", "/",
            "--chdir", img.workdir,
            f"{venv_bin}/python", "-I", "-u", _AGENT_IN_SANDBOX,
        ]
        return argv

    def _write_etc(self) -> None:
        etc = self._run_dir / "etc"
        if etc.exists():
            return
        etc.mkdir(parents=True)
        (etc / "passwd").write_text(f"sandbox:x:{_SANDBOX_UID}:{_SANDBOX_UID}::/tmp:/bin/bash\n")
        (etc / "group").write_text(f"sandbox:x:{_SANDBOX_UID}:\n")
        (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")

    async def create(self, image: str) -> LocalSandbox:
        """Start a sandbox from image ``image``; returns once its agent is ready.

        Raises:
            ImageNotFound: The image is not built or hydrated.
            SandboxStartError: Mount, quota, cgroup or bubblewrap failed, or the agent never
                answered.
            BackendUnavailable: Preflight failed.
        """
        await self.preflight()
        img = self.image(image)
        if self.service is not None and isinstance(img, OciImage):
            raise errors.ConfigError(f"image {image!r} is an OCI image; a ServiceSpec runs only in "
                                     "sandboxes of image directories")
        self._write_etc()
        sid = f"sb-{self.run_id}-{next(self._seq)}"
        state = self._run_dir / sid
        oci = isinstance(img, OciImage)
        if not oci:  # the lower layer is the repo's copy owned by the sandbox's uid (_idmap)
            img = img.model_copy(update={"repo": str(await _offload_ret(_idmap.shifted_repo, img.repo))})
        pass_fds: list[int] = []  # the child's ends, closed once it is spawned
        info_r = block_w = -1
        try:
            state.mkdir(parents=True)
            upper, work, tmp = state / "upper", state / "work", None
            if self.limits.disk_bytes:
                disk = state / "disk"
                disk.mkdir()
                tpl = await _offload_ret(_quota.template, self.limits.disk_bytes)
                await _quota.attach(tpl, state / "disk.img", disk, ID_BASE if oci else _idmap.HOST_UID)
                upper, work, tmp = disk / "upper", disk / "work", disk / "tmp"
            else:
                upper.mkdir()
                work.mkdir()
                if oci:
                    os.chown(upper, ID_BASE, ID_BASE)
            procs = self._cgroups.create(sid, self.limits) if self._cgroups else []
            work_procs = self._cgroups.work_procs(sid) if self._cgroups else []
            # The agent (host uid ID_BASE + its uid inside) moves its commands there.
            agent_id = (ID_BASE + img.uid, ID_BASE + img.gid) if oci else (_idmap.HOST_UID,) * 2
            for f in work_procs:
                os.chown(f, *agent_id)
            info_r, info_w = os.pipe()
            pass_fds.append(info_w)
            block_r, block_w = os.pipe()
            pass_fds.append(block_r)
            if oci:
                pub = _oci.prepare_host(self.run_id, _AGENT)
                root = pub / sid / "root"
                root.mkdir(parents=True)
                lowers = _oci.lowerdirs(self.store, img, _oci.skeleton(self._run_dir))
                mount_overlay(lowers, upper, work, root)
                view = _oci.image_view(pub, self.store, img)
                argv = _oci.bwrap_argv(self.bwrap, img, self.limits, root=root, pub=pub,
                                       block_fd=block_r, info_fd=info_w, work_procs=work_procs,
                                       view=view)
            else:
                merged = state / "merged"
                merged.mkdir()
                # The merged root takes the upper root's attributes: make them the image's, so
                # the fresh repo is identical to the image's down to its root directory.
                lst = os.stat(img.repo)
                os.chown(upper, lst.st_uid, lst.st_gid)
                os.chmod(upper, stat.S_IMODE(lst.st_mode))
                os.utime(upper, ns=(lst.st_atime_ns, lst.st_mtime_ns))
                mount_overlay([img.repo], upper, work, merged)
                # The service's directory shares the sandbox's disk quota when there is one.
                svc = (state / "disk" if self.limits.disk_bytes else state) / "service"
                if self.service is not None:
                    svc.mkdir()
                    os.chown(svc, _idmap.HOST_UID, _idmap.HOST_UID)
                argv = _idmap.publish_binds(self._bwrap_argv(img, merged, tmp, work_procs, svc)[1:],
                                            _oci.public_dir(self.run_id) / sid)
                argv = [*_idmap.as_host_id(_idmap.HOST_UID), self.bwrap, "--userns-block-fd", str(block_r),
                        "--info-fd", str(info_w), *argv]
            stderr = open(state / "stderr.log", "wb")  # noqa: SIM115 - handed to the child
            try:
                proc = await asyncio.create_subprocess_exec(
                    "/bin/sh", "-c",
                    # Join the cgroups first, so every process the sandbox forks is inside.
                    'for f in $SANDPOOL_CGROUP_PROCS; do echo $$ > "$f"; done; exec "$@"',
                    "sh", *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=stderr,
                    env={"SANDPOOL_CGROUP_PROCS": " ".join(procs), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    limit=_STREAM_LIMIT,
                    pass_fds=pass_fds,
                )
            finally:
                stderr.close()
        except (OSError, ValueError) as exc:  # ValueError: _idmap.publish_binds met a new option
            for fd in (info_r, block_w, *pass_fds):
                if fd >= 0:
                    os.close(fd)
            self._cleanup_state(sid, state)
            raise errors.SandboxStartError(f"sandbox {sid} for {image!r}: {exc}") from exc
        for fd in pass_fds:
            os.close(fd)
        sandbox = LocalSandbox(sid, img, proc, state, upper)
        if oci:
            sandbox.lowers = lowers
            if (view / img.repo_dir.lstrip("/") / ".git").is_dir():
                sandbox._lower = str(view / img.repo_dir.lstrip("/"))
                sandbox._image_in_sandbox = _oci.IMAGE_IN_SANDBOX
        self._live[sid] = sandbox
        try:
            try:
                await _oci.map_ids(info_r, block_w, self.start_timeout)
            finally:
                os.close(info_r)
                os.close(block_w)
            await sandbox._wait_ready(self.start_timeout)
            if self.service is not None:
                await self._start_service(sandbox, svc)
        except BaseException:
            await self.delete(sandbox)
            raise
        return sandbox

    async def _start_service(self, sandbox: LocalSandbox, host_dir: Path) -> None:
        spec = self.service
        assert spec is not None
        env = {**spec.env, **{name: secrets.token_urlsafe(24) for name in spec.secret_env}}
        # No log path: its output goes to the agent's stderr, the host's stderr.log.
        started = await sandbox._call("service", 30.0, argv=list(spec.argv), env=env, cwd=SERVICE_DIR)
        pid = int(started["pid"])
        sandbox.service_dir, sandbox.service_env = host_dir, env
        if spec.ready_argv is not None:
            res = await sandbox.exec(list(spec.ready_argv), timeout=spec.ready_timeout, cwd=SERVICE_DIR,
                                     env={"SANDPOOL_SERVICE_PID": str(pid)})
            if not res.ok:
                log = (sandbox.state_dir / "stderr.log").read_text(errors="replace")[-1500:]
                raise errors.SandboxStartError(
                    f"sandbox {sandbox.id}: its service did not become ready (exit {res.exit_code}, "
                    f"timed out: {res.timed_out}): {log.strip() or res.err_text[-500:]}")
        got = proc_state((await sandbox.exec(proc_argv(pid), timeout=30.0)).text)
        if got is None:
            raise errors.SandboxStartError(f"sandbox {sandbox.id}: its service (pid {pid}) exited at start")
        svc = RunningService(spec, pid, got[1], got[2], {})
        # The pristine state is the fresh service's after one reset: what every reset restores.
        problems = await sandbox._service_reset(svc, spec.ready_timeout)
        if problems:
            raise errors.SandboxStartError(f"sandbox {sandbox.id}: {problems[0]}")
        svc.pristine = await asyncio.to_thread(tree, host_dir)
        sandbox._service = svc

    async def delete(self, sandbox: Sandbox) -> None:
        """Kill the sandbox's whole process tree, unmount its overlay, remove its state."""
        assert isinstance(sandbox, LocalSandbox)
        self._live.pop(sandbox.id, None)
        sandbox.host_killed = True
        proc = sandbox._proc
        if proc.returncode is None:
            try:
                proc.kill()  # bubblewrap's init gets SIGKILL with it (--die-with-parent)
            except ProcessLookupError:
                pass
        if proc.stdin is not None:
            proc.stdin.close()
        await proc.wait()
        if self._cgroups is not None:
            deadline = time.monotonic() + 5.0
            while self._cgroups.kill(sandbox.id) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            self._cgroups.remove(sandbox.id)
        _unmount_sandbox(self.run_id, sandbox.id, sandbox.state_dir)
        await _offload(shutil.rmtree, sandbox.state_dir, True)
        await sandbox._reader

    def _cleanup_state(self, sid: str, state: Path) -> None:
        if self._cgroups is not None:
            self._cgroups.kill_and_remove(sid)
        _unmount_sandbox(self.run_id, sid, state)
        shutil.rmtree(state, ignore_errors=True)

    def kill(self, sandbox: LocalSandbox) -> None:
        """SIGKILL the sandbox's process tree without cleaning up, as an OOM kill or a crash
        would from outside; the pool then finds it dead (``SandboxDied``, infra). Used by
        fault tests and the fault matrix. bubblewrap goes first, so its exit status says the
        kill came from the host."""
        sandbox.host_killed = True
        try:
            os.kill(sandbox.pid, signal.SIGKILL)
        except OSError:
            pass
        if self._cgroups is not None:
            for pid in self._cgroups.pids(sandbox.id):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    async def freeze(self, sandbox: LocalSandbox, frozen: bool = True) -> None:
        """SIGSTOP (``frozen``) or SIGCONT every process of the sandbox: a pause that keeps its
        memory and state; commands sent while frozen wait until it is thawed. Freezing returns
        once every process is stopped (a few milliseconds; at most 5 s)."""
        sig = signal.SIGSTOP if frozen else signal.SIGCONT
        pids = {*(self._cgroups.pids(sandbox.id) if self._cgroups is not None else []), sandbox.pid}
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        while frozen and time.monotonic() < deadline and any(_running(p) for p in pids):
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        """Delete every live sandbox, this run's cgroups and state directory."""
        await asyncio.gather(*(self.delete(sb) for sb in list(self._live.values())))
        if self._cgroups is not None:
            self._cgroups.remove_parent()
        _oci.release_host(_oci.public_dir(self.run_id))
        await _offload(shutil.rmtree, self._run_dir, True)


def _unmount_sandbox(run_id: str, sid: str, state: Path) -> None:
    # The overlay first (it sits on the quota filesystem), then the quota filesystem.
    _umount(state / "merged")
    root = _oci.public_dir(run_id) / sid
    _umount(root / "root")
    if _idmap.unpublish(root):  # never recursively through a bind still mounted
        shutil.rmtree(root, ignore_errors=True)
    _quota.detach(state / "disk", state / "disk.img")


async def _offload_ret(fn, *args):  # type: ignore[no-untyped-def]
    return await asyncio.to_thread(fn, *args)


async def _offload(fn, *args) -> None:  # type: ignore[no-untyped-def]
    # Blocking file work goes to a thread, off the event loop; at interpreter exit no thread
    # can start, and it runs inline instead so cleanup still happens.
    try:
        await asyncio.to_thread(fn, *args)
    except RuntimeError:
        fn(*args)


def _running(pid: int) -> bool:
    # A stopped (T), zombie (Z) or vanished process is not running.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"T", b"t", b"Z", b"X")


def _retrieve(fut: asyncio.Future) -> None:
    # Mark a failed future's exception as seen; the caller got (or will get) its own error.
    if fut.done() and not fut.cancelled():
        fut.exception()


def reap_stale(state_base: Path) -> list[str]:
    """Remove what dead runs left behind: overlay mounts, cgroups and state directories.

    A run is dead when the pid in its ``owner.pid`` no longer exists (a kill -9 of the
    runner). Returns the run ids reaped.
    """
    reaped = []
    if not state_base.is_dir():
        return reaped
    for run in state_base.iterdir():
        try:
            owner = int((run / "owner.pid").read_text())
        except (OSError, ValueError):
            owner = -1
        if owner > 0 and Path(f"/proc/{owner}").exists():
            continue
        driver = _cgroup.detect(f"sandpool/{run.name}")
        for sb in run.glob("sb-*"):
            if driver is not None:
                driver.kill_and_remove(sb.name)
            _unmount_sandbox(run.name, sb.name, sb)
        if driver is not None:
            driver.remove_parent()
        _oci.release_host(_oci.public_dir(run.name))
        shutil.rmtree(run, ignore_errors=True)
        reaped.append(run.name)
    return reaped

