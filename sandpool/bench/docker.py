"""A Docker daemon of the benchmark's own: Debian's ``docker.io`` (dockerd 20.10, containerd 1.6,
runc 1.1), started and stopped by whoever compares sandpool with Docker.

Usage::

    with DockerDaemon() as daemon:
        daemon.load("oci:/path/layout:swe", "sandpool.test/swe-calc:1")
        client = daemon.client()          # docker SDK client on the daemon's socket

Nothing of it is shared with another container runtime on the machine:

* its own containerd (``/usr/bin/containerd`` with a config written here: its own root,
  state, gRPC and ttrpc sockets, no CRI plugin), handed to dockerd with ``--containerd``, so
  dockerd never adopts a containerd it finds at ``/run/containerd/containerd.sock``;
* its own ``--data-root`` (under ``sandpool_home()``, kept between runs: loaded images are a
  cache keyed by :data:`VERSION`), ``--exec-root``, pid file and socket (under ``/run``), and a
  config file of its own (``/etc/docker/daemon.json`` is not read);
* network and mount namespaces of its own (``unshare``): its bridge, iptables rules and
  ``ip_forward`` never touch the host's, and every mount it makes (overlays, netns bind
  mounts) lives and dies in its mount namespace;
* containers under one cgroup parent, so what a killed run left is found and killed.

:meth:`DockerDaemon.stop` removes every container, stops dockerd and containerd, kills any
process left under the daemon's cgroup parent or naming its run directory (each container's
processes before the shim that reaps them), and removes the run directory and the cgroups: no
container, mount, namespace or process outlives it.
:meth:`DockerDaemon.start` first does the same for a daemon a killed run left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandpool.core import errors
from sandpool.core.paths import sandpool_home

__all__ = ["VERSION", "DockerDaemon"]

#: Bump when what the data root holds changes; an older one is left alone.
VERSION = "1"
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_CGROUP = Path("/sys/fs/cgroup")
#: Seconds a SIGKILLed process of the daemon may take to exit (a loaded machine is slow to).
_KILL_TIMEOUT = 60.0


def _cpuacct_v1() -> Path | None:
    """The cgroup v1 cpuacct hierarchy when it is mounted apart from cpu, else None."""
    p = _CGROUP / "cpuacct"
    return p if (p / "cpuacct.usage").exists() and not p.is_symlink() else None


def _process(pid: int) -> tuple[str, str] | None:
    """Process ``pid``'s (state letter, start time in clock ticks since boot), or None when
    there is no such process (exited and reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def _kill(find: Callable[[], set[int]], *, reaped: bool) -> None:
    """SIGKILL the processes ``find`` returns until it returns none and each has exited, and
    with ``reaped`` until each is gone from the process table too (its parent waited for it).

    A process is known by its pid and start time, so a reused pid is never waited for. After
    :data:`_KILL_TIMEOUT` seconds a zombie is left to its parent, which alone can reap it.

    Raises:
        BackendUnavailable: A process still ran :data:`_KILL_TIMEOUT` seconds after its SIGKILL.
    """
    deadline = time.monotonic() + _KILL_TIMEOUT
    killed: dict[int, str] = {}
    while True:
        found = find()
        for pid in found:
            if (proc := _process(pid)) is not None:
                killed.setdefault(pid, proc[1])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        states = {pid: p[0] for pid, start in killed.items()
                  if (p := _process(pid)) is not None and p[1] == start}
        running = sorted(pid for pid, state in states.items() if state not in "ZX")
        if not found and not running and not (reaped and states):
            return
        if time.monotonic() > deadline:
            if not running:
                return
            raise errors.BackendUnavailable(
                f"processes {running} of the Docker daemon still run {_KILL_TIMEOUT:.0f} s "
                "after SIGKILL (stuck in the kernel); they keep its cgroups and run directory")
        time.sleep(0.02)  # a kill or a reap by another process has no event to wait on


class DockerDaemon:
    """dockerd and its own containerd, isolated from every other runtime (see the module docstring).

    Args:
        root: Data directory (images, containers); default
            ``sandpool_home()/docker-v<VERSION>``. One daemon at a time may use it (a file lock).
        cgroup_parent: The cgroup containers run under (every controller); default
            ``/sandpool-docker-<id>``. On cgroup v1 with a separate cpuacct hierarchy the
            daemon's own processes join it there too, so its ``cpuacct.usage`` counts all the
            CPU the daemon and its containers use.
        init: Give containers docker-init (tini) as pid 1 (``--init``): a container whose
            command ignores SIGTERM then stops at once instead of after its grace period.
        start_timeout: Seconds to wait for each daemon's socket.
    """

    def __init__(self, root: Path | None = None, *, cgroup_parent: str | None = None,
                 init: bool = False, start_timeout: float = 120.0) -> None:
        self.root = Path(root) if root else sandpool_home() / f"docker-v{VERSION}"
        key = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:10]
        #: Sockets, pid files and dockerd's exec root; short, since a socket path is capped.
        self.run_dir = Path("/run") / f"sandpool-docker-{key}"
        self.cgroup_parent = "/" + (cgroup_parent or f"sandpool-docker-{key}").strip("/")
        self.init = init
        self.start_timeout = start_timeout
        self._lock: int | None = None
        self._procs: dict[str, subprocess.Popen] = {}

    def __repr__(self) -> str:
        state = "running" if self._procs else "stopped"
        return f"<DockerDaemon {state} root={self.root} host={self.host}>"

    @property
    def host(self) -> str:
        """The daemon's address, for ``DOCKER_HOST`` or a client's ``base_url``."""
        return f"unix://{self.run_dir}/docker.sock"

    @property
    def env(self) -> dict[str, str]:
        """Environment additions that point the docker CLI, the SDK and swebench at this daemon."""
        return {"DOCKER_HOST": self.host}

    def __enter__(self) -> DockerDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start containerd and dockerd; return once dockerd answers. Blocking.

        Raises:
            BackendUnavailable: docker.io is not installed, a daemon did not come up (the
                message carries the end of its log), or a process a killed run left would not
                die.
        """
        for binary in ("dockerd", "containerd", "runc", "unshare", "nsenter"):
            if shutil.which(binary, path=_PATH) is None:
                raise errors.BackendUnavailable(
                    f"{binary} is not installed; install Debian's docker.io: apt-get install docker.io")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(self._lock, fcntl.LOCK_EX)  # another run's daemon: wait for its stop
        try:
            self._reap()
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._start_containerd()
            self._start_dockerd()
            with contextlib.closing(self.client()) as client:
                for c in client.containers.list(all=True):  # a killed run's, now dead
                    c.remove(force=True)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Remove every container, stop both daemons, and leave nothing behind. Idempotent.

        Raises:
            BackendUnavailable: A process of the daemon would not die (see :meth:`_reap`).
        """
        try:
            if "dockerd" in self._procs and self._procs["dockerd"].poll() is None:
                with contextlib.suppress(Exception), contextlib.closing(self.client(timeout=30)) as client:
                    for c in client.containers.list(all=True):
                        c.remove(force=True)
            for name in ("dockerd", "containerd"):
                proc = self._procs.pop(name, None)
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            self._reap()
        finally:
            if self._lock is not None:
                os.close(self._lock)
                self._lock = None

    def _group_dirs(self) -> list[Path]:
        return [c / self.cgroup_parent.lstrip("/") for c in sorted(_CGROUP.iterdir())
                if (c / self.cgroup_parent.lstrip("/")).is_dir()]

    def _pids(self, part: str) -> set[int]:
        """This daemon's processes of one ``part``: ``"containers"`` (in its containers'
        cgroups), ``"shims"`` (containerd's shims, the containers' parents), or ``"daemons"``
        (dockerd, containerd, runc: the others naming its run directory or in the cgroup
        parent itself, where the daemons count their CPU)."""
        in_containers: set[int] = set()
        in_parent: set[int] = set()
        for group in self._group_dirs():
            for procs in group.rglob("cgroup.procs"):
                with contextlib.suppress(OSError, ValueError):
                    ids = {int(x) for x in procs.read_text().split()}
                    (in_parent if procs.parent == group else in_containers).update(ids)
        if part == "containers":
            return in_containers - {os.getpid()}
        named: set[int] = set()
        shims: set[int] = set()
        mark = str(self.run_dir).encode()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError):
                    cmd = (d / "cmdline").read_bytes()
                    if mark in cmd:
                        shim = os.path.basename(cmd.split(b"\0")[0]).startswith(b"containerd-shim")
                        (shims if shim else named).add(int(d.name))
        found = shims if part == "shims" else (named | in_parent) - shims
        return found - in_containers - {os.getpid()}

    def _reap(self) -> None:
        """Kill what is left of a daemon on this run directory and remove its traces.

        The parts die in an order in which no container process outlives its shim: the
        daemons first (nothing starts a container after them), then the containers'
        processes, each waited for until its shim, its parent, has reaped it, and the shims
        last. A process whose parent dies before it goes to pid 1, and an init that reaps
        orphans on a timer would keep it in the process table after :meth:`stop` returned.

        Raises:
            BackendUnavailable: A process still ran :data:`_KILL_TIMEOUT` seconds after its
                SIGKILL (stuck in the kernel).
        """
        # A frozen process cannot die, and a paused container stays frozen after its daemon.
        freezer = _CGROUP / "freezer" / self.cgroup_parent.lstrip("/")
        for state in freezer.rglob("freezer.state"):
            with contextlib.suppress(OSError):
                state.write_text("THAWED")
        _kill(lambda: self._pids("daemons"), reaped=False)
        _kill(lambda: self._pids("containers"), reaped=True)
        _kill(lambda: self._pids("shims"), reaped=False)
        for group in self._group_dirs():  # deepest first: a cgroup must be empty to go
            for d in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                group.rmdir()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        # The daemon joins the cpuacct group before it execs, so all it forks is counted there.
        acct = _cpuacct_v1()
        join = ""
        if acct is not None:
            group = acct / self.cgroup_parent.lstrip("/")
            group.mkdir(parents=True, exist_ok=True)
            join = f'echo $$ > "{group}/cgroup.procs" && '
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", join + 'exec "$@"', "sh", *argv],
                                    env={"PATH": _PATH, "HOME": "/root"}, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self._procs[name] = proc
        return proc

    def _wait_socket(self, name: str, sock: Path) -> None:
        deadline = time.monotonic() + self.start_timeout
        proc = self._procs[name]
        while not sock.is_socket():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.run_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise errors.BackendUnavailable(f"{name} did not start (exit {proc.poll()}): {tail}")
            time.sleep(0.05)  # the daemon creates its socket when it is ready; nothing to wait on

    def _start_containerd(self) -> None:
        cfg = self.run_dir / "containerd.toml"
        data = self.root / "containerd"
        cfg.write_text("\n".join([
            "version = 2",
            f'root = "{data}"',
            f'state = "{self.run_dir}/containerd"',
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
            "[grpc]", f'  address = "{self.run_dir}/containerd.sock"',
            "[ttrpc]", f'  address = "{self.run_dir}/containerd.sock.ttrpc"',
            '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{data}/opt"',
            ""]))
        self._spawn("containerd", ["unshare", "--net", "--mount", "--propagation", "private",
                                   "containerd", "--config", str(cfg)])
        self._wait_socket("containerd", self.run_dir / "containerd.sock")

    def _start_dockerd(self) -> None:
        cfg = self.run_dir / "daemon.json"
        cfg.write_text(json.dumps({"init": self.init}))
        ns = str(self._procs["containerd"].pid)
        self._spawn("dockerd", [
            "nsenter", "--target", ns, "--net", "--mount",
            "dockerd", "--config-file", str(cfg), "--data-root", str(self.root / "docker"),
            "--exec-root", str(self.run_dir / "exec"), "--pidfile", str(self.run_dir / "docker.pid"),
            "--host", self.host, "--containerd", str(self.run_dir / "containerd.sock"),
            "--cgroup-parent", self.cgroup_parent, "--storage-driver", "overlay2"])
        self._wait_socket("dockerd", self.run_dir / "docker.sock")
        deadline = time.monotonic() + self.start_timeout
        while True:  # the socket is bound a moment before the API answers
            try:
                with contextlib.closing(self.client(timeout=10)) as client:
                    client.ping()
                return
            except Exception as exc:  # noqa: BLE001 - docker's errors vary by stage; the log says why
                if self._procs["dockerd"].poll() is not None or time.monotonic() > deadline:
                    tail = (self.run_dir / "dockerd.log").read_text(errors="replace")[-2000:]
                    raise errors.BackendUnavailable(f"dockerd did not answer ({exc}): {tail}") from None
                time.sleep(0.1)

    # -- use -----------------------------------------------------------------------------------

    def client(self, timeout: float = 600.0) -> Any:
        """A docker SDK client on this daemon; close it after use."""
        import docker

        return docker.DockerClient(base_url=self.host, timeout=int(timeout))

    def image_id(self, name: str) -> str | None:
        """The id (config digest) of the daemon's image ``name``, or None when it has none."""
        import docker

        with contextlib.closing(self.client()) as client:
            try:
                return client.images.get(name).id
            except docker.errors.ImageNotFound:
                return None

    def load(self, source: str, name: str) -> None:
        """Copy the image ``source`` (a skopeo source: ``oci:PATH:TAG``, ``docker://...``) into
        the daemon as ``name``, unless ``name`` is that very image already (same config digest).

        Raises:
            ImageNotFound: skopeo could not read or copy it (its message is kept).
        """
        config = subprocess.run(["skopeo", "inspect", "--config", "--raw", source], capture_output=True)
        if config.returncode == 0 and self.image_id(name) == "sha256:" + hashlib.sha256(config.stdout).hexdigest():
            return
        res = subprocess.run(["skopeo", "copy", "--quiet", "--dest-daemon-host", self.host, source,
                              f"docker-daemon:{name}"], capture_output=True, text=True)
        if res.returncode != 0:
            raise errors.ImageNotFound(f"skopeo copy {source} into the Docker daemon as {name} failed: "
                                       f"{(res.stderr or res.stdout).strip()[-1000:]}")

    def tag(self, name: str, *also: str) -> None:
        """Give the daemon's image ``name`` the names ``also`` (moving a name that named another)."""
        with contextlib.closing(self.client()) as client:
            img = client.images.get(name)
            for other in also:
                repo, _, tag = other.rpartition(":")
                img.tag(repo, tag)
