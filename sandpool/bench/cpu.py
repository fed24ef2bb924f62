"""Host CPU time of a benchmark: this process and everything it starts, from a cgroup of its own.

On cgroup v1 with a cpuacct hierarchy apart from cpu (as on these machines), the benchmark
moves itself into ``cpuacct/<name>``. Every process it forks stays there (the local backend
places its sandboxes in the pids, memory and cpu hierarchies only), and the Docker daemon it
starts runs itself and its containers under ``<name>/docker`` (see
:class:`~sandpool.bench.docker.DockerDaemon`), so ``cpuacct.usage`` of the group counts
all the CPU on both sides, and nothing of other users of the machine. Elsewhere the meter
says it cannot measure (:attr:`CpuMeter.available` is False) rather than report the whole
machine's time.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["CpuMeter"]

_ROOT = Path("/sys/fs/cgroup")


class CpuMeter:
    """CPU seconds used by this process, its descendants and its Docker daemon.

    Usage::

        with CpuMeter() as meter:
            t0 = meter.read()
            ...                                   # run a strategy
            cpu_s = meter.read() - t0
            docker_s = meter.read("docker")       # only the daemon and its containers

    Attributes:
        name: The group, e.g. ``sandpool-bench-1234``; the Docker daemon's cgroup parent is
            ``<name>/docker``.
        available: Whether the meter measures (cgroup v1 with a separate cpuacct hierarchy).
        why_not: When not available, the reason, for reports.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"sandpool-bench-{os.getpid()}"
        acct = _ROOT / "cpuacct"
        self._acct = acct if (acct / "cpuacct.usage").exists() and not acct.is_symlink() else None
        self.available = self._acct is not None and os.access(self._acct, os.W_OK)
        self.why_not = "" if self.available else (
            "host CPU not measured: no writable cgroup v1 cpuacct hierarchy apart from cpu")
        self._home: Path | None = None

    @property
    def docker_parent(self) -> str:
        """The cgroup parent for the Docker daemon and its containers."""
        return f"{self.name}/docker"

    def __enter__(self) -> CpuMeter:
        if not self.available:
            return self
        assert self._acct is not None
        self._reap()
        own = next((ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if "cpuacct" in ln.split(":")[1].split(",")), "/")
        self._home = self._acct / own.lstrip("/")
        group = self._acct / self.name
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))  # moves every thread of it
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.available or self._home is None:
            return
        with contextlib.suppress(OSError):
            (self._home / "cgroup.procs").write_text(str(os.getpid()))
        self._home = None
        _remove(self.name)

    @staticmethod
    def _reap() -> None:
        """Remove the groups of bench processes that are gone (a killed run's), once empty."""
        for group in (_ROOT / "cpuacct").glob("sandpool-bench-*"):
            pid = group.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _remove(group.name)

    def read(self, sub: str = "") -> float | None:
        """CPU seconds charged so far to the group (or its subgroup ``sub``); None when the
        meter is not available or the subgroup does not exist."""
        if not self.available or self._acct is None:
            return None
        try:
            return int((self._acct / self.name / sub / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None


def _remove(name: str) -> None:
    """Remove group ``name`` in every hierarchy (the Docker daemon's cgroup parent made it in
    all of them), deepest first; a group something still runs in stays."""
    for c in _ROOT.iterdir():
        group = c / name
        if not group.is_dir():
            continue
        for d in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            group.rmdir()
