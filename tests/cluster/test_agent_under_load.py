"""The pod's agent on a loaded node: a command's answer carries all of its output however late
the agent's reader threads get the CPU.

A starved node is made deterministic by freezing the agent's two pipe-reader threads (cgroup v1
freezer, per thread) while the command runs and exits; on kwok the agent is a host process.
Under the 200-image burst the same starvation, for about 0.2 s, gave 5 of 800 in-place resets
an empty manifest ("missing every path of the fresh repo") and quarantined their sandboxes.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from sandpool.core import PoolLimits, SandboxPool
from tests.waiting import until

from test_kubernetes_backend import backend, make_task, repo  # noqa: F401 - fixture

pytestmark = pytest.mark.cluster

FREEZER = Path("/sys/fs/cgroup/freezer")


def _agent_pid(host_workdir: str) -> int | None:
    """The host pid of the pod's agent: the python process carrying the pod's workdir marker."""
    needle = f"SANDPOOL_WORKDIR={host_workdir}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env and b"-c" in argv and b"python" in Path(argv[0].decode()).name.encode():
            return int(entry.name)
    return None


def _threads(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def _command_running(host_workdir: str, argv0: bytes) -> bool:
    needle = f"SANDPOOL_WORKDIR={host_workdir}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "cmdline").read_bytes().split(b"\0")[0] == argv0 and \
                    needle in (entry / "environ").read_bytes().split(b"\0"):
                return True
        except OSError:
            continue
    return False


@pytest.mark.skipif(not (FREEZER / "tasks").exists(),
                    reason="freezing single threads needs the cgroup v1 freezer hierarchy")
async def test_exec_answer_holds_all_output_while_the_agents_readers_are_starved(
        cluster, namespace, repo):
    path, _, head = repo
    be = backend(cluster, namespace, path)
    task = make_task("sandpool.test/calc:1", head)
    frozen = FREEZER / f"sandpool-test-{uuid.uuid4().hex[:8]}"
    thread_ids: list[int] = []
    expect_out = "".join(f"{i}\n" for i in range(1, 5001))  # 23,893 bytes: fits a pipe
    expect_err = "".join(f"{i}\n" for i in range(1, 101))
    try:
        async with SandboxPool(be, "cold", PoolLimits(max_live=1)) as pool:
            async with pool.claim(task) as lease:
                assert lease.sandbox.channel == "agent"
                assert (await lease.exec("mkfifo /tmp/go")).ok
                pod = cluster.core.read_namespaced_pod(lease.sandbox.pod, namespace)
                host_wd = pod.metadata.annotations["sandpool.io/workdir"]
                pid = _agent_pid(host_wd)
                assert pid is not None, f"no agent process for {host_wd}"
                before = _threads(pid)
                running = asyncio.create_task(lease.exec(
                    "cat /tmp/go > /dev/null; seq 1 5000; seq 1 100 >&2", timeout=60))
                # The command waits on the FIFO; its exec has a thread of its own, then one
                # reader per pipe (the two newest threads).
                await until(lambda: _command_running(host_wd, b"cat")
                            and len(_threads(pid) - before) >= 3, "the command and its readers")
                thread_ids = sorted(_threads(pid) - before)[-2:]
                frozen.mkdir()
                for tid in thread_ids:
                    (frozen / "tasks").write_text(str(tid))
                (frozen / "freezer.state").write_text("FROZEN")
                await until(lambda: (frozen / "freezer.state").read_text().strip() == "FROZEN",
                            "the readers frozen")
                # Let the command go: it writes its output and exits while nobody reads.
                await asyncio.to_thread(lambda: open(f"{host_wd.rstrip('/')}.tmp/go", "w").close())
                res = await asyncio.wait_for(running, 120)
                assert res.ok, res.err_text
                assert res.text == expect_out, f"{len(res.stdout)} of {len(expect_out)} bytes"
                assert res.err_text == expect_err
    finally:
        if frozen.exists():
            (frozen / "freezer.state").write_text("THAWED")
            for tid in thread_ids:
                try:
                    (FREEZER / "tasks").write_text(str(tid))
                except OSError:  # the thread ended
                    pass
            frozen.rmdir()
        await be.aclose()
