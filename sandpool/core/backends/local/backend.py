"""The local backend: image directories and OCI images started as bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from sandpool.core import errors
from sandpool.core.agent import seccomp as _seccomp
from sandpool.core.backends.local import _cgroup, _idmap, _idrange, _layout, _oci, _snapshot
from sandpool.core.backends.local._cleanup import make_run_dir, reap_stale, unmount_sandbox
from sandpool.core.backends.local.image import LocalImage, image_dir, load_image
from sandpool.core.backends.local.sandbox import LocalSandbox
from sandpool.core.base import Backend, ResourceLimits, Sandbox
from sandpool.core.images import ImageStore, OciImage
from sandpool.core.paths import sandpool_home
from sandpool.core.service import ServiceSpec
from sandpool.core.snapshot import Snapshot

__all__ = ["LocalBackend"]

_STREAM_LIMIT = 256 << 20  # bytes; one response line carries a whole (base64) output


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
        service: A long-lived process each sandbox starts before it is handed out, in its
            service directory :data:`SERVICE_DIR` (a host directory per sandbox, on its disk
            quota), reached with :meth:`LocalSandbox.connect_service` through its
            :attr:`ServiceSpec.socket`. Image directories only.
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
        #: Snapshot layers of this run's sandboxes, removed with the run (see ``_snapshot``).
        self.snapshots = _snapshot.Store(self._run_dir / "snapshots")

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
        _seccomp.program()  # an architecture without a filter table is refused here
        reap_stale(self._state_base)
        make_run_dir(self._run_dir)
        await _offload(_idrange.check, self._run_dir)  # after owner.pid: a dead run's is reaped
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
        img = load_image(name, path)
        self._images[name] = img
        return img

    async def hydrate(self, image: str) -> None:
        """Verify that local image ``image`` is built (see :meth:`image`), and make its repo's
        copy owned by the sandbox's uid (``_idmap.shifted_repo``) so no create waits for it."""
        img = self.image(image)
        if isinstance(img, LocalImage):
            await _offload_ret(_idmap.shifted_repo, img.repo)

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
        sid = f"sb-{self.run_id}-{next(self._seq)}"
        state = self._run_dir / sid
        oci = isinstance(img, OciImage)
        image_repo = "" if oci else img.repo
        if not oci:  # the lower layer is the repo's copy owned by the sandbox's uid (_idmap)
            img = img.model_copy(update={"repo": str(await _offload_ret(_idmap.shifted_repo, img.repo))})
        pass_fds: list[int] = []  # the child's ends, closed once it is spawned
        info_r = block_w = -1
        budget = None
        # The sandbox's own host ids: no per-user kernel object shared with another (_idrange).
        ids = _idrange.allocate()
        # Who runs bubblewrap, on the host: uid 0 inside for an OCI image (setpriv drops to its
        # User), the sandbox user for an image directory.
        runner = ids.base if oci else ids.host(_idmap.SANDBOX_UID)
        try:
            state.mkdir(parents=True)
            procs = self._cgroups.create(sid, self.limits) if self._cgroups else []
            budget = self._cgroups.watch(sid) if self._cgroups else None  # whose a death is
            # The agent moves its commands into the work group through these descriptors,
            # opened here: the files stay root's, out of reach of every process inside.
            work_fds = []
            for f in self._cgroups.work_procs(sid) if self._cgroups else []:
                work_fds.append(os.open(f, os.O_WRONLY))
                pass_fds.append(work_fds[-1])
            info_r, info_w = os.pipe()
            pass_fds.append(info_w)
            block_r, block_w = os.pipe()
            pass_fds.append(block_r)
            seccomp_r = _seccomp.program_fd()  # no keyrings, no limits set on other processes
            pass_fds.append(seccomp_r)
            lay = await _layout.lay_out(self, img, state, ids, runner, work_fds)
            argv = [*_idmap.as_host_id(runner), self.bwrap, "--userns-block-fd", str(block_r),
                    "--info-fd", str(info_w), "--seccomp", str(seccomp_r),
                    *_idmap.publish_binds(lay.options, lay.pub, runner)]
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
            if budget is not None:
                budget.close()
            self._cleanup_state(sid, state)
            ids.release()
            raise errors.SandboxStartError(f"sandbox {sid} for {image!r}: {exc}") from exc
        for fd in pass_fds:
            os.close(fd)
        sandbox = LocalSandbox(sid, proc, lay)
        sandbox.budget, sandbox.ids, sandbox.cgroup = budget, ids, self._cgroups
        sandbox.image_repo, sandbox.snapshots = image_repo, self.snapshots
        sandbox.freezer = functools.partial(self.freeze, sandbox)
        self._live[sid] = sandbox
        try:
            try:
                sandbox.init_pid = await _oci.map_ids(info_r, block_w, ids.base, self.start_timeout)
            finally:
                os.close(info_r)
                os.close(block_w)
            await sandbox._wait_ready(self.start_timeout)
            # Rollouts write to fresh layers over the repo: the first goes in now, as a fresh
            # tmpfs on /dev/shm.
            problems = await sandbox.restore_repo("", timeout=self.start_timeout) or []
            problems += await asyncio.to_thread(sandbox.fresh_shm)
            if problems:
                raise errors.SandboxStartError(f"sandbox {sid}: its repo layer or /dev/shm: {problems}")
            await sandbox.record_scratch(timeout=self.start_timeout)
            if self.service is not None:
                sandbox.service_dir = lay.service_dir
                await sandbox.start_service(self.service)
        except BaseException:
            await self.delete(sandbox)
            raise
        return sandbox

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
        unmount_sandbox(self.run_id, sandbox.id, sandbox.state_dir)
        await _offload(shutil.rmtree, sandbox.state_dir, True)
        await sandbox._agent.aclose("deleted by sandpool")
        if sandbox.budget is not None:
            sandbox.budget.close()
        if sandbox.ids is not None:
            sandbox.ids.release()  # nothing of it runs or is mounted any more

    def _cleanup_state(self, sid: str, state: Path) -> None:
        if self._cgroups is not None:
            self._cgroups.kill_and_remove(sid)
        unmount_sandbox(self.run_id, sid, state)
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
        """Freeze (``frozen``) or thaw every process of the sandbox, its agent included: a pause
        that keeps its memory and state; commands sent while frozen wait until it is thawed.
        Through its cgroup's freezer (``_cgroup``), else SIGSTOP / SIGCONT where no freezer
        is writable. Freezing returns once every process is stopped."""
        if self._cgroups is not None and self._cgroups.can_freeze():
            try:
                await self._cgroups.freeze(sandbox.id, frozen)
                return
            except OSError:  # its group is gone: the sandbox is dead, nothing to freeze
                return
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

    async def suspend(self, sandbox: Sandbox) -> bool:
        """Freeze every process of ``sandbox`` (:meth:`freeze`); True."""
        assert isinstance(sandbox, LocalSandbox)
        await self.freeze(sandbox, True)
        return True

    async def resume(self, sandbox: Sandbox) -> None:
        """Thaw ``sandbox`` (:meth:`freeze`)."""
        assert isinstance(sandbox, LocalSandbox)
        await self.freeze(sandbox, False)

    async def discard_snapshot(self, snap: Snapshot, *, keep: Snapshot | None = None) -> None:
        """Remove the layers only ``snap`` holds from this run's store (see
        :meth:`Backend.discard_snapshot`)."""
        await _offload(self.snapshots.discard, snap, keep)

    async def aclose(self) -> None:
        """Delete every live sandbox, this run's cgroups and state directory (its snapshot
        store with it: a snapshot to keep is ``save()``-d first)."""
        await asyncio.gather(*(self.delete(sb) for sb in list(self._live.values())))
        if self._cgroups is not None:
            self._cgroups.remove_parent()
        _oci.release_host(_oci.public_dir(self.run_id))
        await _offload(shutil.rmtree, self._run_dir, True)


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
