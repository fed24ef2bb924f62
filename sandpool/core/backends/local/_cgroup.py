"""CPU, memory and pid limits for local sandboxes through cgroups (v1 or v2).

A sandbox's process tree is placed in its own cgroup before bubblewrap starts, so every
process it ever forks is counted and can be killed at once. On cgroup v1 the commands it
runs go one level down, into ``<sandbox>/work``, which holds the sandbox's pid and memory
limits; the sandbox's own group allows a little more (:data:`AGENT_PIDS`,
:data:`AGENT_MEMORY`), so a fork bomb or a memory bomb exhausts the policy's budget and never
the agent's: the agent still answers, kills the bomb and resets the sandbox. CPU is split
the same way: the sandbox's group holds the CPU quota, and ``work`` weighs
:data:`WORK_CPU_SHARES` against the agent's threads, so however many processes the policy
keeps busy, the agent runs when it has an answer to give. (On v2 the commands share the
sandbox's group with the agent.) When no cgroup hierarchy is writable (an unprivileged user,
a locked-down container), :func:`detect` returns ``None`` and
the backend refuses to start unless limits were explicitly waived.

Suspending a sandbox freezes its group (:meth:`CgroupDriver.freeze`): the v1 ``freezer``
hierarchy, where the sandbox gets a group of its own too, or v2's ``cgroup.freeze``. Every
process of the sandbox, its agent included, stops where it is and keeps its memory; a frozen
group's processes are thawed before they are killed (a frozen process cannot die).

Whose a sandbox's death is, is read here too (:class:`BudgetWatch`): the agent cannot be
signalled from inside, so it dies of the policy's doing only when the budget it lives in ran
out, and the kernel counts exactly that in the sandbox's own group (on v1 the agent's group,
above ``work``): a memory-cgroup OOM of that group (an eventfd on ``memory.oom_control``; a
global OOM kill by the host does not signal it) or a fork refused there (``pids.events``; a
fork refused in ``work`` is counted in ``work``). Either is evidence; without one, the death
came from outside (the host's OOM killer, an operator, the node): infra.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from sandpool.core.base import ResourceLimits

_ROOT = Path("/sys/fs/cgroup")
_V1_CONTROLLERS = ("pids", "memory", "cpu")
_CFS_PERIOD_US = 100_000
_WORK = "work"
_FREEZER = _ROOT / "freezer"
_FREEZE_POLL_S = 0.002
#: CPU weight, in multiples of the default, of a sandbox serving the first command after its
#: claim (see :meth:`sandpool.core.base.Sandbox.favour_cpu`).
FIRST_COMMAND_WEIGHT = 8.0
#: Pids and bytes the sandbox's agent (and bubblewrap's init) may use beyond the policy's limits.
AGENT_PIDS = 64
AGENT_MEMORY = 256 * 2**20
#: ``cpu.shares`` of the commands' ``work`` group (v1), against 1024 per runnable thread of
#: the agent: while the agent works it gets about nine tenths of the sandbox's quota.
WORK_CPU_SHARES = 128


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
        extra = []
        if (freezer := self._freezer(name)) is not None and self.version == 1:
            freezer.mkdir(parents=True, exist_ok=True)
            extra.append(str(freezer / "cgroup.procs"))
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
            (pids / "pids.max").write_text(str(limits.pids + AGENT_PIDS))
            (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes + AGENT_MEMORY))
            (cpu / "cpu.cfs_period_us").write_text(str(_CFS_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(quota))
            for d in dirs:
                (d / _WORK).mkdir(exist_ok=True)
            (cpu / _WORK / "cpu.shares").write_text(str(WORK_CPU_SHARES))
            (pids / _WORK / "pids.max").write_text(str(limits.pids))
            (mem / _WORK / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        else:
            (dirs[0] / "pids.max").write_text(str(limits.pids))
            (dirs[0] / "memory.max").write_text(str(limits.memory_bytes))
            (dirs[0] / "cpu.max").write_text(f"{quota} {_CFS_PERIOD_US}")
        return [str(d / "cgroup.procs") for d in dirs] + extra

    def _freezer(self, name: str) -> Path | None:
        """The group whose state freezes sandbox ``name``, or None without a freezer."""
        if self.version == 2:
            return _ROOT / self.parent / name
        return _FREEZER / self.parent / name if os.access(_FREEZER, os.W_OK) else None

    def can_freeze(self) -> bool:
        """True when sandboxes' groups can be frozen (v2, or v1 with a writable freezer)."""
        return self.version == 2 or os.access(_FREEZER, os.W_OK)

    async def freeze(self, name: str, frozen: bool = True, timeout: float = 10.0) -> bool:
        """Freeze (``frozen``) or thaw every process of group ``name``; a freeze returns once
        the kernel reports the whole group frozen.

        Returns:
            False when this hierarchy has no freezer (nothing was done).

        Raises:
            TimeoutError: The group did not report frozen within ``timeout`` seconds (it is
                thawed again).
            OSError: The group is gone.
        """
        g = self._freezer(name)
        if g is None:
            return False
        if self.version == 1:
            (g / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
            done = lambda: (g / "freezer.state").read_text().strip() == "FROZEN"  # noqa: E731
        else:
            (g / "cgroup.freeze").write_text("1" if frozen else "0")
            done = lambda: "frozen 1" in (g / "cgroup.events").read_text()  # noqa: E731
        if not frozen:
            return True
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                await self.freeze(name, False)
                raise TimeoutError(f"cgroup {name} did not freeze within {timeout:.0f} s")
            await asyncio.sleep(_FREEZE_POLL_S)
        return True

    def _thaw(self, name: str) -> None:
        g = self._freezer(name)
        try:
            if g is not None and self.version == 1:
                (g / "freezer.state").write_text("THAWED")
            elif g is not None:
                (g / "cgroup.freeze").write_text("0")
        except OSError:
            pass

    def set_cpu_weight(self, name: str, factor: float) -> None:
        """Set group ``name``'s CPU weight to ``factor`` times the default (1.0: the default),
        against its sibling sandboxes; never raises (a group already removed has no weight)."""
        if self.version == 1:
            path, value = _ROOT / "cpu" / self.parent / name / "cpu.shares", int(1024 * factor)
        else:
            path, value = _ROOT / self.parent / name / "cpu.weight", min(10000, max(1, int(100 * factor)))
        try:
            path.write_text(str(value))
        except OSError:
            pass

    def work_procs(self, name: str) -> list[str]:
        """Return the ``cgroup.procs`` files of group ``name``'s ``work`` children (pids,
        memory, cpu), which the sandbox's commands join (v1; empty on v2, where commands stay
        in the sandbox's group)."""
        if self.version != 1:
            return []
        return [str(d / _WORK / "cgroup.procs") for d in self._dirs(name)]

    def pids(self, name: str) -> list[int]:
        """Return the pids currently in group ``name`` and its ``work`` child (empty if gone)."""
        d = self._dirs(name)[0]
        out: list[int] = []
        for procs in (d / "cgroup.procs", d / _WORK / "cgroup.procs"):
            try:
                out += [int(x) for x in procs.read_text().split()]
            except OSError:
                pass
        return out

    def kill(self, name: str) -> int:
        """SIGKILL every process in group ``name`` (thawed first: a frozen process cannot
        die); return how many were signalled."""
        self._thaw(name)
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return len(pids)

    def remove(self, name: str) -> None:
        """Remove group ``name`` and its ``work`` child (they must be empty); never raises."""
        for d in self._dirs(name):
            for g in (d / _WORK, d):
                try:
                    g.rmdir()
                except OSError:
                    pass
        if self.version == 1 and (f := self._freezer(name)) is not None:
            try:
                f.rmdir()
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
            [_ROOT / c / self.parent for c in _V1_CONTROLLERS] + [_FREEZER / self.parent]
            if self.version == 1
            else [_ROOT / self.parent]
        )
        for p in parents:
            try:
                p.rmdir()
            except OSError:
                pass


    def watch(self, name: str) -> BudgetWatch:
        """Start counting what exhausts group ``name`` itself (see :class:`BudgetWatch`).

        Raises:
            OSError: The eventfd could not be registered (v1).
        """
        return BudgetWatch.open(self, name)


@dataclass
class BudgetWatch:
    """Evidence that a sandbox's own processes exhausted the budget its agent lives in.

    Made by :meth:`CgroupDriver.watch` when the sandbox's group is created, read when its
    agent dies or reports a resource it could not get (:meth:`evidence`), closed with the
    sandbox (:meth:`close`). The kernel's counts only grow while a reused sandbox lives on,
    so :meth:`mark` (each time no process of a rollout is left) makes what was counted until
    then no evidence: a death is a rollout's only for what its own processes made counted.
    On cgroup v1 the group is the agent's: the policy's commands run in ``work`` below it
    with a smaller budget, so their own OOM kills and refused forks (counted in ``work``) are
    never evidence; only the group's limit, reached by everything in it together, is. On v2
    commands share the group, and any OOM or refused fork in it counts.

    Attributes:
        driver: The driver the group belongs to.
        name: The sandbox's group.
        oom_fd: v1: an eventfd the kernel signals at each memory-cgroup OOM of the group itself
            (``cgroup.event_control`` on ``memory.oom_control``), -1 once closed or on v2.
    """

    driver: CgroupDriver
    name: str
    oom_fd: int = -1
    _ooms: int = field(default=0, repr=False)
    _base: tuple[int, int] = field(default=(0, 0), repr=False)  # (OOMs, refused forks) at the mark

    @classmethod
    def open(cls, driver: CgroupDriver, name: str) -> BudgetWatch:
        watch = cls(driver, name)
        if driver.version != 1:
            return watch
        mem = _ROOT / "memory" / driver.parent / name
        watch.oom_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            ctl = os.open(mem / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                (mem / "cgroup.event_control").write_text(f"{watch.oom_fd} {ctl}")
            finally:
                os.close(ctl)  # the registration holds its own reference
        except OSError:
            watch.close()
            raise
        return watch

    def _counts(self) -> tuple[int, int]:
        """(OOMs, refused forks) the kernel counted in the group since it was made."""
        if self.driver.version == 1:
            if self.oom_fd >= 0:
                try:
                    self._ooms += os.eventfd_read(self.oom_fd)
                except (BlockingIOError, OSError):
                    pass
            return self._ooms, _count(_ROOT / "pids" / self.driver.parent / self.name / "pids.events", "max")
        group = _ROOT / self.driver.parent / self.name
        return _count(group / "memory.events", "oom"), _count(group / "pids.events", "max")

    def mark(self) -> None:
        """No process of a rollout is left in the sandbox: what was counted until now is no
        evidence against a later death. Never raises."""
        self._base = self._counts()

    def evidence(self) -> list[str]:
        """What the kernel counted against the group's own limits since the last :meth:`mark`,
        one sentence each (empty: nothing; then a death came from outside the sandbox). Never
        raises: a group already removed reads as nothing counted."""
        found = []
        ooms, refused = self._counts()
        ooms, refused = max(0, ooms - self._base[0]), max(0, refused - self._base[1])
        if ooms and self.driver.version == 1:
            found.append(f"its memory limit was reached and the kernel's OOM killer ran in the "
                         f"group of its agent ({ooms} time(s))")
        elif ooms:
            found.append(f"its memory limit was reached and the kernel's OOM killer ran ({ooms} "
                         "time(s))")
        if refused:
            found.append(f"its pid limit was reached: {refused} fork(s) refused in the group of its "
                         "agent")
        return found

    def close(self) -> None:
        """Release the eventfd; idempotent."""
        if self.oom_fd >= 0:
            os.close(self.oom_fd)
            self.oom_fd = -1


def _count(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


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
