"""CPU, memory and pid limits for local sandboxes through cgroups (v1 or v2).

A sandbox's process tree is placed in its own cgroup before bubblewrap starts, so every
process it ever forks is counted and can be killed at once. When no cgroup hierarchy is
writable (an unprivileged user, a locked-down container), :func:`detect` returns ``None`` and
the backend refuses to start unless limits were explicitly waived.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from sandpool.core.base import ResourceLimits

_ROOT = Path("/sys/fs/cgroup")
_V1_CONTROLLERS = ("pids", "memory", "cpu")
_CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class CgroupDriver:
    """Creates, limits, kills and removes per-sandbox cgroups.

    Attributes:
        version: 1 or 2.
        parent: Name of the parent group for this run, e.g. ``sandpool/run-ab12``.
    """

    version: int
    parent: str

    def _dirs(self, name: str) -> list[Path]:
        if self.version == 1:
            return [_ROOT / c / self.parent / name for c in _V1_CONTROLLERS]
        return [_ROOT / self.parent / name]

    def create(self, name: str, limits: ResourceLimits) -> list[str]:
        """Make the group ``name`` with ``limits``; return the ``cgroup.procs`` paths to join.

        Raises:
            OSError: The hierarchy refused the write.
        """
        dirs = self._dirs(name)
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        if self.version == 2:
            # v2 only delegates controllers that each ancestor lists in subtree_control.
            node = _ROOT
            for part in Path(self.parent).parts:
                (node / "cgroup.subtree_control").write_text("+pids +memory +cpu")
                node = node / part
            (node / "cgroup.subtree_control").write_text("+pids +memory +cpu")
        quota = max(1000, int(limits.cpus * _CFS_PERIOD_US))
        if self.version == 1:
            pids, mem, cpu = dirs
            (pids / "pids.max").write_text(str(limits.pids))
            (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            (cpu / "cpu.cfs_period_us").write_text(str(_CFS_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (dirs[0] / "pids.max").write_text(str(limits.pids))
            (dirs[0] / "memory.max").write_text(str(limits.memory_bytes))
            (dirs[0] / "cpu.max").write_text(f"{quota} {_CFS_PERIOD_US}")
        return [str(d / "cgroup.procs") for d in dirs]

    def pids(self, name: str) -> list[int]:
        """Return the pids currently in group ``name`` (empty if it is gone)."""
        d = self._dirs(name)[0]
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self, name: str) -> int:
        """SIGKILL every process in group ``name``; return how many were signalled."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return len(pids)

    def remove(self, name: str) -> None:
        """Remove group ``name`` (it must be empty); never raises."""
        for d in self._dirs(name):
            try:
                d.rmdir()
            except OSError:
                pass

    def kill_and_remove(self, name: str, timeout: float = 5.0) -> None:
        """Kill group ``name`` until empty, then remove it; blocking (for the reaper)."""
        deadline = time.monotonic() + timeout
        while self.kill(name) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.remove(name)

    def remove_parent(self) -> None:
        """Remove this run's parent group(s) once empty; never raises."""
        parents = (
            [_ROOT / c / self.parent for c in _V1_CONTROLLERS]
            if self.version == 1
            else [_ROOT / self.parent]
        )
        for p in parents:
            try:
                p.rmdir()
            except OSError:
                pass


def detect(parent: str) -> CgroupDriver | None:
    """Return a driver for the first writable hierarchy (v1 with pids+memory+cpu, or v2).

    Args:
        parent: The run's parent group name, e.g. ``sandpool/run-ab12``.
    """
    if all(os.access(_ROOT / c, os.W_OK) for c in _V1_CONTROLLERS):
        return CgroupDriver(1, parent)
    ctrl = _ROOT / "cgroup.subtree_control"
    if ctrl.exists() and os.access(_ROOT, os.W_OK):
        enabled = set(ctrl.read_text().split())
        if {"pids", "memory", "cpu"} <= enabled:
            return CgroupDriver(2, parent)
    return None
