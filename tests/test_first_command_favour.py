"""A lease's first command runs with its sandbox's CPU weight raised, and only that command.

The first command after a claim (TTFC) is what a synchronous batch waits on; on a busy host it
must not queue behind other sandboxes' grading. The pool raises the sandbox's weight for it
(:meth:`Sandbox.favour_cpu`) and restores it when the result is back, or after
:data:`~sandpool.core.pool.lease.FAVOUR_S` at most. On the local backend the weight is the
sandbox's cgroup's ``cpu.shares`` (v1) or ``cpu.weight`` (v2), read here from the host.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sandpool.core.pool import SandboxPool
from sandpool.core.pool import lease as lease_module
from sandpool.core.task import Task
from tests.memory_backend import MemoryBackend
from tests.waiting import until


def _task(i: int = 0) -> Task:
    return Task(instance_id=f"t-{i}", repo="r", base_commit="0" * 40, image="img-a", problem_statement="p")


async def test_only_the_first_command_of_each_lease_is_favoured() -> None:
    async with SandboxPool(MemoryBackend(), "reuse") as pool:
        await pool.prepare([_task()], concurrency=1)
        for i in range(2):
            calls: list[tuple[bool, int]] = []
            async with pool.claim(_task(i)) as lease:
                sb = lease.sandbox
                sb.favour_cpu = lambda on, sb=sb: calls.append((on, len(sb.commands)))  # type: ignore[method-assign]
                await lease.exec("echo first")
                await lease.exec("echo second")
            # Raised before the first command ran, restored once it had, untouched after.
            assert calls == [(True, calls[0][1]), (False, calls[0][1] + 1)], calls


def _weight(backend, sid: str) -> int:
    d = backend._cgroups
    path = (Path("/sys/fs/cgroup/cpu") / d.parent / sid / "cpu.shares" if d.version == 1
            else Path("/sys/fs/cgroup") / d.parent / sid / "cpu.weight")
    return int(path.read_text())


async def test_a_local_sandbox_s_cpu_weight_is_raised_while_its_first_command_runs(
        local_backend, calc_task, monkeypatch) -> None:
    monkeypatch.setattr(lease_module, "FAVOUR_S", 600.0)  # the cap is the next test's
    async with SandboxPool(local_backend, "reuse") as pool:
        await pool.prepare([calc_task], concurrency=1)
        async with pool.claim(calc_task) as lease:
            sid = lease.sandbox.id
            normal = _weight(local_backend, sid)
            first = asyncio.create_task(lease.exec("while [ ! -e /tmp/go ]; do sleep 0.01; done"))
            await until(lambda: _weight(local_backend, sid) != normal, "the weight raised for the first command")
            assert _weight(local_backend, sid) == 8 * normal
            await lease.sandbox.write_file("/tmp/go", b"")
            assert (await first).ok
            assert _weight(local_backend, sid) == normal


async def test_a_first_command_that_runs_long_loses_its_favour(local_backend, calc_task, monkeypatch) -> None:
    monkeypatch.setattr(lease_module, "FAVOUR_S", 0.05)
    async with SandboxPool(local_backend, "reuse") as pool:
        await pool.prepare([calc_task], concurrency=1)
        async with pool.claim(calc_task) as lease:
            sid = lease.sandbox.id
            normal = _weight(local_backend, sid)
            first = asyncio.create_task(lease.exec("echo > /tmp/running; while [ ! -e /tmp/go ]; do sleep 0.01; done"))
            while True:  # the command runs (so its favour began)
                try:
                    await lease.sandbox.read_file("/tmp/running")
                    break
                except FileNotFoundError:
                    await asyncio.sleep(0.01)
            # Back to normal while the command still runs (it waits for /tmp/go).
            await until(lambda: first.done() or _weight(local_backend, sid) == normal, "the favour's end")
            assert not first.done()
            await lease.sandbox.write_file("/tmp/go", b"")
            assert (await first).ok and _weight(local_backend, sid) == normal
