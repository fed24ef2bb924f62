"""What a local sandbox of an image directory sees where: the bubblewrap argv and its paths."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sandpool.core.agent.client import AGENT_PATH
from sandpool.core.backends.local import _idmap
from sandpool.core.backends.local._views import MASKED
from sandpool.core.base import ResourceLimits

if TYPE_CHECKING:
    from sandpool.core.backends.local.image import LocalImage
    from sandpool.core.service import ServiceSpec

__all__ = ["AGENT", "AGENT_IN_SANDBOX", "IMAGE_IN_SANDBOX", "SCRATCH", "SERVICE_DIR",
           "bwrap_argv", "host_sources", "write_etc"]

#: The service's own writable directory inside the sandbox (a host directory per sandbox,
#: ``LocalSandbox.service_dir``); it is its working directory.
SERVICE_DIR = "/run/sandpool-service"
#: Everything a sandbox can write outside the repo: emptied by the in-place reset.
SCRATCH = ("/tmp", "/dev/shm", "/dev/mqueue")
AGENT = AGENT_PATH
AGENT_IN_SANDBOX = "/opt/sandpool/agent.py"
IMAGE_IN_SANDBOX = "/opt/sandpool/image"
SANDBOX_UID = _idmap.SANDBOX_UID


_ETC_FROM_HOST = ("ld.so.cache", "ssl", "alternatives", "localtime", "mime.types")
_TOPS = ("bin", "sbin", "lib", "lib32", "lib64")


def host_sources(img: LocalImage, etc: Path, service: ServiceSpec | None = None) -> list[str]:
    """Every host path :func:`bwrap_argv` binds read-only into a sandbox of ``img`` (to be
    seen through views of the sandbox's own: ``_views``)."""
    tops = [Path("/") / t for t in _TOPS]
    out = ["/usr", *(str(t) for t in tops if t.is_dir() and not t.is_symlink())]
    out += [str(etc / n) for n in ("passwd", "group", "hosts")]
    out += [f"/etc/{n}" for n in _ETC_FROM_HOST]
    out += [img.python_prefix, img.venv, img.repo, str(AGENT)]
    out += [host for host, _ in (service.binds if service is not None else ())]
    return out


def bwrap_argv(limits: ResourceLimits, img: LocalImage, etc: Path, merged: Path, tmp: Path | None,
               shm: Path, work_fds: Sequence[int] = (), service: ServiceSpec | None = None,
               service_dir: Path | None = None, views: Mapping[str, str] | None = None,
               devices: Sequence[str] = ()) -> list[str]:
    """bubblewrap's options and command for a sandbox of image directory ``img`` (see the
    package docstring); the backend adds the executable and its descriptors.

    Args:
        limits: The sandbox's limits (``network`` shares the host's network back).
        img: The image; its repo (the shifted copy) is bound read-only at :data:`IMAGE_IN_SANDBOX`.
        etc: The run's directory of ``passwd``, ``group`` and ``hosts`` (:func:`write_etc`).
        merged: The host's shared mount point of the repo (``_fresh``), bound at ``img.workdir``.
        tmp: The host directory that becomes ``/tmp`` (on the quota filesystem), else a tmpfs.
        shm: The host's shared mount point bound at ``/dev/shm``, on which the backend mounts
            a fresh tmpfs for each lease (``_fresh``).
        work_fds: Descriptors of the work cgroup's ``cgroup.procs`` files, opened by the host
            and inherited by the agent, which moves its commands there through them only.
        service: The backend's service, whose binds are added with ``service_dir`` at
            :data:`SERVICE_DIR`.
        service_dir: The host directory of the sandbox's service.
        views: What to bind instead of each of :func:`host_sources` (``_views.mount``: its
            own inodes), and an ``"empty"`` file bound over ``_views.MASKED``.
        devices: Options binding the sandbox's own device nodes (``_views.devices``).
    """
    views = views or {}

    def ro(source: str | Path) -> str:
        return views.get(str(source), str(source))

    venv_bin = f"{img.venv}/bin"
    argv = [
        "--unshare-all",
        "--unshare-user",
        *(["--share-net"] if limits.network else []),
        "--die-with-parent",
        "--new-session",
        # The agent is the sandbox's pid 1: no process inside shares its pipes (see _agent).
        "--as-pid-1",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        # The host disabled nested user namespaces (_idmap.disable_nested_userns); check.
        "--assert-userns-disabled",
        "--hostname", "sandbox",
        "--clearenv",
        "--ro-bind", ro("/usr"), "/usr",
    ]
    for top in _TOPS:
        host = Path("/") / top
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.exists():
            argv += ["--ro-bind", ro(host), f"/{top}"]
    for name in ("passwd", "group", "hosts"):
        argv += ["--ro-bind", ro(etc / name), f"/etc/{name}"]
    for name in _ETC_FROM_HOST:
        argv += ["--ro-bind-try", ro(f"/etc/{name}"), f"/etc/{name}"]
    argv += [
        "--proc", "/proc",
        *(a for path in MASKED if "empty" in views for a in ("--ro-bind", views["empty"], path)),
        "--dev", "/dev",
        *devices,
        "--bind", str(shm), "/dev/shm",
        "--mqueue", "/dev/mqueue",
        *(["--bind", str(tmp), "/tmp"] if tmp else ["--tmpfs", "/tmp"]),
        "--ro-bind", ro(img.python_prefix), img.python_prefix,
        "--ro-bind", ro(img.venv), img.venv,
        "--bind", str(merged), img.workdir,
        "--ro-bind", ro(img.repo), IMAGE_IN_SANDBOX,
        "--ro-bind", ro(AGENT), AGENT_IN_SANDBOX,
    ]
    if service is not None and service_dir is not None:
        for host, dest in service.binds:
            argv += ["--ro-bind", ro(host), dest]
        argv += ["--bind", str(service_dir), SERVICE_DIR]
    # The agent puts each command into the work cgroup (its pid, memory and CPU budget) through
    # descriptors the host opened: no cgroup file is visible inside, so the policy can neither
    # see a limit nor move a process (the agent's included) from one group to another.
    if work_fds:
        argv += ["--setenv", "SANDPOOL_WORK_CGROUP_FDS", " ".join(map(str, work_fds))]
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
        f"{venv_bin}/python", "-I", "-u", AGENT_IN_SANDBOX,
    ]
    return argv


def write_etc(run_dir: Path) -> Path:
    """Write the ``/etc`` files every sandbox of a run shares, once; return their directory."""
    etc = run_dir / "etc"
    if etc.exists():
        return etc
    etc.mkdir(parents=True)
    (etc / "passwd").write_text(f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::/tmp:/bin/bash\n")
    (etc / "group").write_text(f"sandbox:x:{SANDBOX_UID}:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    return etc
