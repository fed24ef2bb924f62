"""A running local sandbox: its agent reached over the bubblewrap process's stdio."""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import stat
from pathlib import Path

from sandpool.core import errors
from sandpool.core.agent import service
from sandpool.core.agent.channel import PipeChannel
from sandpool.core.agent.client import AgentClient
from sandpool.core.agent.sandbox import AgentSandbox
from sandpool.core.backends.local import _agent_state, _fresh, _idmap, _oci, _overlay, _snapshot
from sandpool.core.backends.local._bwrap import IMAGE_IN_SANDBOX, SCRATCH, SERVICE_DIR
from sandpool.core.backends.local._cgroup import FIRST_COMMAND_WEIGHT, BudgetWatch, CgroupDriver
from sandpool.core.backends.local._idrange import IdRange
from sandpool.core.backends.local._layout import Layout
from sandpool.core.images import OciImage
from sandpool.core.service import ServiceStream, SocketStream
from sandpool.core.snapshot import Snapshot

__all__ = ["LocalSandbox"]

#: Free bytes under which a sandbox's quota filesystem counts as full: a restore that failed
#: with ENOSPC there failed for what the rollout wrote.
_FULL_BYTES = 1 << 20
#: Paths a rollout left under what is restored past which a restore that ran out of time ran
#: out for them (no honest rollout leaves a hundred thousand paths in ``.git``).
_MANY_PATHS = 100_000

_SUN_PATH_MAX = 108  # bytes in sockaddr_un.sun_path (Linux), the terminating NUL included


class LocalSandbox(AgentSandbox):
    """A running local sandbox: its agent is the bubblewrap process's pid 1, spoken to over
    that process's stdio (:class:`~sandpool.core.agent.channel.PipeChannel`). The process is the
    sandbox: its channel's end is the sandbox's death.

    Created by :meth:`LocalBackend.create`; not constructed directly.
    """

    # Everything it can write outside the repo (see the package docstring); its own ipc ns.
    scratch = SCRATCH
    private_ipc = True
    _service_cwd = SERVICE_DIR

    def __init__(self, sid: str, proc: asyncio.subprocess.Process, lay: Layout) -> None:
        image = lay.image
        self.id = sid
        self.image = image.name
        self.workdir = image.repo_dir if isinstance(image, OciImage) else image.workdir
        self.head = image.head
        self.state_dir = lay.state
        #: Its host paths (``_layout.Layout``): where its writes go (``disk``), its ``/tmp``
        #: (``tmp_dir``, None: a tmpfs), the shared mount points of its repo (``merged``) and
        #: ``/dev/shm`` (``shm``, None: bubblewrap's), and an OCI sandbox's root overlay
        #: (``root``, ``root_upper``, ``lowers``) and its image's read-only view (``view``).
        self.disk, self.tmp_dir, self.merged, self.shm = lay.disk, lay.tmp, lay.merged, lay.shm
        self.root, self.root_upper, self.lowers, self.view = (lay.root, lay.root_upper, lay.lowers,
                                                              lay.view)
        #: The image's repo as the sandbox's range sees it (the lower side of
        #: :meth:`restore_repo`), and where the agent sees it read-only; None: no overlay.
        self._lower: str | None = str(lay.lower) if lay.lower is not None else None
        self._image_in_sandbox = (_oci.IMAGE_IN_SANDBOX if isinstance(image, OciImage)
                                  else IMAGE_IN_SANDBOX)
        self._pins: dict[str, Path] = {}  # repo path -> host copy of its pinned pristine bytes
        self._seen: dict[str, tuple[int, int, int]] = {}  # see _overlay.diff
        #: Host path of the service's directory (:data:`SERVICE_DIR`), or None without a service.
        self.service_dir: Path | None = None
        self.service_env: dict[str, str] = {}
        #: Host path of the repo's upper layer (what the rollout changed), for reset checks;
        #: None until the first fresh layer (``_fresh``) is mounted.
        self.upper: Path | None = None
        #: Whether a whole-repo restore swaps in a fresh upper layer (``_fresh``), or restores
        #: the paths the rollout changed in place (what a restore of a part always does).
        self.fresh_layers = True
        self._work: Path | None = None  # the fresh upper's work dir
        #: The OCI image it runs, or None for an image directory.
        self.oci = image if isinstance(image, OciImage) else None
        self._proc = proc
        #: The kernel's count of what exhausted the sandbox's own budget: whose a death is.
        self.budget: BudgetWatch | None = None
        #: The sandbox's own range of host ids (``_idrange``), released when it is deleted.
        self.ids: IdRange | None = None
        #: The image's repo directory on the host, as built (an image directory's identity).
        self.image_repo = ""
        #: Host pid of its pid 1 (the agent).
        self.init_pid = 0
        #: The agent's own scheduling, affinity, I/O priority, OOM score and core dump filter
        #: when fresh (:meth:`record_scratch`), set back by :meth:`restore_scratch`.
        self._agent_fresh: _agent_state.AgentState | None = None
        #: The stacked overlay of a snapshot it was restored from, or None.
        self.stack: _snapshot.Stack | None = None
        #: The backend's snapshot store and freezer (set by the backend).
        self.snapshots: _snapshot.Store | None = None
        self.freezer = _no_freezer
        #: Its CPU cgroup (set by the backend; None without cgroups), for :meth:`favour_cpu`.
        self.cgroup: CgroupDriver | None = None
        self._channel = PipeChannel(proc, f"sandbox {sid}", evidence=self._evidence)
        self._agent = AgentClient(self._channel, sid)

    def __repr__(self) -> str:
        state = f"dead: {self._agent.error}" if self._agent.error else "alive"
        return f"<LocalSandbox {self.id} image={self.image!r} {state}>"

    def _ops(self) -> AgentClient:
        return self._agent

    def favour_cpu(self, on: bool) -> None:
        """Raise (``on``: :data:`FIRST_COMMAND_WEIGHT` times the default) or restore its CPU
        weight against the run's other sandboxes (see :meth:`Sandbox.favour_cpu`)."""
        if self.cgroup is not None:
            self.cgroup.set_cpu_weight(self.id, FIRST_COMMAND_WEIGHT if on else 1.0)

    @property
    def pid(self) -> int:
        """Host pid of the sandbox's bubblewrap process."""
        return self._proc.pid

    @property
    def host_killed(self) -> bool:
        """Set by the backend before it kills the process tree: the death is the host's."""
        return self._channel.host_killed

    @host_killed.setter
    def host_killed(self, value: bool) -> None:
        self._channel.host_killed = value

    def _evidence(self) -> list[str]:
        # The policy cannot signal the agent (its pid 1), so a death or a refused thread is the
        # policy's only when the kernel counted its sandbox's own budget exhausted; the host's
        # own kills (delete, kill) never are.
        return [] if self.host_killed or self.budget is None else self.budget.evidence()

    async def kill_strays(self) -> int:
        """SIGKILL every process but the agent (see :meth:`Sandbox.kill_strays`); none of a
        rollout is left then, so what its cgroup counted until now is no evidence against a
        later death (:meth:`BudgetWatch.mark <sandpool.core.backends.local._cgroup.BudgetWatch.mark>`):
        a reused sandbox's next rollout answers only for its own."""
        killed = await super().kill_strays()
        if self.budget is not None:
            self.budget.mark()
        return killed

    async def _wait_ready(self, timeout: float) -> None:
        try:
            await self._agent.ready(timeout)
        except TimeoutError:
            raise errors.SandboxStartError(
                f"sandbox {self.id} did not become ready within {timeout:.0f} s") from None
        except errors.SandpoolError as exc:
            log = (self.state_dir / "stderr.log").read_text(errors="replace")[-2000:]
            raise errors.SandboxStartError(f"sandbox {self.id} failed to start: {log.strip() or exc}") from None

    async def changes_outside_repo(self) -> list[tuple[str, str]] | None:
        """For an OCI sandbox, what its root's upper layer holds outside the repo and ``/tmp``
        (read on the host, see ``_oci.changes_outside``); None for an image directory, whose
        only writable places are the repo and ``/tmp``."""
        if self.oci is None or self.root_upper is None:
            return None
        return await asyncio.to_thread(_oci.changes_outside, self.root_upper, self.lowers,
                                       (self.workdir, "/tmp"))

    async def restore_repo(self, under: str = "", *, timeout: float = 60.0) -> list[str] | None:
        """Make the repo at or below ``under`` identical to the image's; see :meth:`Sandbox.restore_repo`.

        The whole repo (:attr:`fresh_layers`): a fresh upper layer is swapped in (``_fresh``),
        so nothing physical of the rollout's writes (an inode, its number, a directory's
        listing order, a used block) is left. A part (e.g. ``.git`` for grading): the
        overlay's upper layer, read on the host, lists what the rollout changed
        (:func:`._overlay.diff`); the agent copies those paths back from the image's repo
        (bind-mounted read-only) through the merged view; then the upper layer is compared
        with the image again, on the host, out of the policy's reach (a restored sandbox's:
        every path any of its layers holds, through the merged view). Cost: O(paths changed).
        None for an OCI sandbox whose repo is no git checkout of its own (``_oci.repo_view``).
        """
        if self._lower is None:
            return None  # no read-only view of the image's repo: the generic path instead
        prefix = under.strip("/")
        if not prefix:
            await _snapshot.unstack(self)  # a restored sandbox's own layer comes back
            if self.fresh_layers or self.upper is None:
                return await asyncio.to_thread(self._fresh_upper)
        stacked, upper, lower = self.stack is not None, _snapshot.repo_upper(self), self._lower
        pins = {} if stacked else {r: str(p) for r, p in self._pins.items()
                                   if not prefix or r == prefix or r.startswith(prefix + "/")}

        def diff() -> list[_overlay.Change]:
            if stacked:
                return _snapshot.stacked_changes(self, under)
            return _overlay.diff(lower, upper, under, pins, self._seen)

        changes = await asyncio.to_thread(diff)
        # A pin holds only below a directory the rollout left in place; where it replaced one
        # (``rm -rf .git``), the image's own file is the reference again until re-pinned.
        dropped = {r for r in pins for c in changes
                   if c.kind == "replace" and r.startswith(f"{c.path}/" if c.path else "")}
        if dropped:
            for r in dropped:
                pins.pop(r)
                self._pins.pop(r, None)
            changes = await asyncio.to_thread(diff)
        if not changes:
            return []
        pinned = {}
        for c in changes:
            if c.path in pins:
                fd = os.open(pins[c.path], os.O_RDONLY | os.O_NOATIME)  # its atime is the reference
                with os.fdopen(fd, "rb") as f:
                    st = os.fstat(fd)
                    pinned[c.path] = {"data": base64.b64encode(f.read()).decode(),
                                      "mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns,
                                      "atime_ns": st.st_atime_ns}
        # What the rollout left there, counted before the agent starts removing it (bounded): if
        # the restore runs out of time, this says whether for the rollout's paths.
        many = await asyncio.to_thread(_overlay.count_at_least, upper / prefix if prefix else upper,
                                       _MANY_PATHS)
        try:
            msg = await self._restore_paths(self._image_in_sandbox, [[c.path, c.kind] for c in changes],
                                            pinned, timeout)
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
        left = await asyncio.to_thread(diff)
        return [f"{c.path or '.'} differs from the image ({c.kind})" for c in left] + [
            f"restore failed: {m}" for m in msg.get("failed", [])][:20]

    def _fresh_upper(self) -> list[str]:
        """Swap in a fresh upper layer over the repo (``_fresh``); return what differs from
        the image after it, or why the swap failed (empty: pristine). Blocking."""
        assert self._lower is not None
        old = (self.upper, self._work) if self.upper is not None and self._work is not None else None
        try:
            self.upper, self._work = _fresh.swap(Path(self._lower), old, self.disk, self._pins,
                                                 self.merged)
        except OSError as exc:
            return [f"swapping in a fresh repo layer failed: {exc}"]
        self._seen.clear()
        problems = [f"{c.path or '.'} differs from the image ({c.kind})" for c in _overlay.diff(
            self._lower, self.upper, "", {r: str(p) for r, p in self._pins.items()}, {})]
        if not self._sees(self.merged, self.workdir):  # the mount reached the sandbox
            problems.append(f"the sandbox does not see its fresh repo layer at {self.workdir}")
        return problems[:20]

    def fresh_shm(self) -> list[str]:
        """Mount a fresh tmpfs at ``/dev/shm`` (its inode numbers count every file it held);
        return what failed (empty: done). Blocking; no process of a rollout may be left."""
        if self.shm is None or self.ids is None:
            return []
        # As bubblewrap would make it: the sandbox user's; an OCI sandbox's is uid 0's and
        # world-writable and sticky, as on any Linux host (a non-root User can use POSIX shm).
        uid, mode = ((self.ids.base, "1777") if self.oci is not None else
                     (self.ids.host(_idmap.SANDBOX_UID), "755"))
        try:
            _fresh.tmpfs(self.shm, f"mode={mode},uid={uid},gid={uid}")
        except OSError as exc:
            return [f"mounting a fresh /dev/shm failed: {exc}"]
        return [] if self._sees(self.shm, "/dev/shm") else ["the sandbox does not see its fresh /dev/shm"]

    def _sees(self, host: Path, inside: str) -> bool:
        """Whether the sandbox's ``inside`` is the filesystem mounted at host path ``host``."""
        try:
            return os.stat(f"/proc/{self.init_pid}/root/{inside.lstrip('/')}").st_dev == os.stat(host).st_dev
        except OSError:
            return False

    async def record_scratch(self, *, timeout: float = 30.0) -> None:
        """:meth:`AgentSandbox.record_scratch`, and the agent's own process state, read on the
        host (``_agent_state``): what a command of its uid may set on it and it cannot set back.

        Raises:
            SandboxStartError: A scratch directory or the agent's state could not be read.
        """
        await super().record_scratch(timeout=timeout)
        try:
            self._agent_fresh = await asyncio.to_thread(_agent_state.read, self.init_pid)
        except OSError as exc:
            raise errors.SandboxStartError(f"sandbox {self.id}: cannot read its agent's "
                                           f"scheduling state: {exc}") from exc

    async def restore_scratch(self, *, timeout: float = 60.0) -> list[str] | None:
        """A fresh ``/dev/shm`` (:meth:`fresh_shm`), the agent's scheduling, affinity, I/O
        priority, OOM score and core dump filter set back from the host to those recorded
        fresh and compared (``_agent_state.restore``), then :meth:`AgentSandbox.restore_scratch`."""
        fresh = await asyncio.to_thread(self.fresh_shm)
        if self._agent_fresh is not None:
            fresh += await asyncio.to_thread(_agent_state.restore, self.init_pid, self._agent_fresh)
        rest = await super().restore_scratch(timeout=timeout)
        return None if rest is None else fresh + rest

    # -- snapshots (see _snapshot) ------------------------------------------------------------

    @property
    def repo_lower(self) -> Path | None:
        """Host path of the image's repo as this sandbox sees it (its overlay's lower layer)."""
        return Path(self._lower) if self._lower is not None else None

    def tmp_host(self) -> Path:
        """Host path of the sandbox's ``/tmp``: its quota filesystem's directory, or the tmpfs
        through its pid 1's root."""
        return self.tmp_dir if self.tmp_dir is not None else Path(f"/proc/{self.init_pid}/root/tmp")

    def _store(self) -> _snapshot.Store:
        if self.snapshots is None:
            raise errors.ConfigError(f"sandbox {self.id} was not made by a LocalBackend: no snapshot store")
        return self.snapshots

    async def snapshot(self) -> Snapshot:
        """Take a snapshot of the repo's layers and ``/tmp`` (an OCI sandbox: its root's change
        set outside the repo); see :meth:`Sandbox.snapshot` and ``_snapshot`` (its processes
        are frozen meanwhile)."""
        if not self.alive():
            raise errors.SandboxDied(f"sandbox {self.id} is gone: {self._agent.error}")
        return await _snapshot.capture(self, self._store())

    async def load_snapshot(self, snap: Snapshot) -> None:
        """Restore ``snap`` into this pristine sandbox: stack its layers under the repo, copy
        in ``/tmp`` (an OCI sandbox: replay its change set outside the repo); see
        :meth:`Sandbox.load_snapshot`."""
        await _snapshot.load(self, snap, self._store(), self.state_dir / "snap-views")

    async def state_hash(self) -> str:
        """The hash of the sandbox's state as a snapshot records it; see
        :meth:`Sandbox.state_hash`."""
        return await asyncio.to_thread(_snapshot.state_hash, self, self._store())

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

    # -- the service: its directory is on the host, its output in stderr.log ----------------

    def _service_log(self) -> str:
        return (self.state_dir / "stderr.log").read_text(errors="replace")[-1500:].strip()

    async def _service_tree(self) -> dict[str, tuple[str, ...]]:
        assert self.service_dir is not None
        return await service.host_tree(self.service_dir)

    async def connect_service(self) -> ServiceStream:
        """Connect to the service's unix socket (:attr:`ServiceSpec.socket`), from the host.

        Raises:
            ConfigError: No service, or its spec names no socket.
            SandboxDied: The sandbox is gone.
            OSError: Nothing listens on the socket.
        """
        svc = self._service
        if svc is None or svc.spec.socket is None or self.service_dir is None:
            return await super().connect_service()
        if not self.alive():
            raise errors.SandboxDied(f"sandbox {self.id} is gone: {self._agent.error}")
        return await _open_unix(self.service_dir / svc.spec.socket)

    async def pin_repo_state(self, paths: list[str]) -> None:
        """Take the current bytes of repo files ``paths`` as their pristine state; see
        :meth:`Sandbox.pin_repo_state`. A copy goes to the sandbox's host-side state
        directory, out of the policy's reach; a path that is not a plain file is unpinned."""
        if self._lower is None or self.upper is None or self.stack is not None:
            return
        upper = self.upper
        pin_dir = self.state_dir / "pinned"
        pin_dir.mkdir(exist_ok=True)
        for rel in paths:
            dst = pin_dir / rel.replace("/", "%")
            try:
                fd = os.open(upper / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOATIME)
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


async def _no_freezer(frozen: bool) -> None:
    raise errors.ConfigError("this sandbox has no freezer (it was not made by a LocalBackend)")


async def _open_unix(path: Path) -> ServiceStream:
    # A path longer than a socket address holds is reached through its directory's fd.
    if len(str(path).encode()) < _SUN_PATH_MAX:
        return SocketStream(*await asyncio.open_unix_connection(str(path)))
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        return SocketStream(*await asyncio.open_unix_connection(f"/proc/self/fd/{fd}/{path.name}"))
    finally:
        os.close(fd)

