"""Nothing a rollout leaves in a real pod's processes outlives its in-place reset.

The agent (pid 1) runs as the policy's uid: a command may set its scheduling policy, nice,
CPU affinity, I/O priority, OOM score adjustment and core dump filter, which the agent cannot
all set back and no file comparison sees; the reset compares them with the fresh pod's, and
a pod whose agent was marked is quarantined.

A process whose main thread exits while another thread runs (``SYS_exit`` on the leader, not
``exit_group``) shows as a zombie in ``/proc/<pid>/stat``, with an empty ``cmdline`` and
``environ``, yet its threads run on: a policy's way to keep a server alive across the reset
and hand the next rollout on the same pod what it learned (here over an abstract unix socket
in the pod's network namespace, so the repo and every writable mount stay pristine).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from sandpool.core import Outcome, SandboxPool, Task, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend
from tests.escapees import ASK, HIDE

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

LIMITS = {"requests": {"cpu": "100m", "memory": "128Mi"},
          "limits": {"cpu": "500m", "memory": "384Mi"}}


def real_backend(cluster, namespace, real_node) -> KubernetesBackend:
    return KubernetesBackend(
        cluster.kubeconfig, namespace=namespace, run_id=uuid.uuid4().hex[:8], mode="pods",
        node_selector=real_node.node_selector, tolerations=list(real_node.tolerations),
        resources=LIMITS, ready_timeout=180, agent_entrypoint=True)


async def test_a_process_hiding_behind_its_zombie_leader_does_not_outlive_the_reset(
    cluster, namespace, real_node, real_images
):
    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    backend = real_backend(cluster, namespace, real_node)
    heard: list[str] = []

    async def hide(lease) -> float:
        res = await lease.exec(HIDE, timeout=60)
        assert res.text == "hidden\n", res
        assert (await lease.exec(ASK, timeout=60)).text == "the fix\n"  # it runs on
        return 0.0

    async def ask(lease) -> float:
        heard.append((await lease.exec(ASK, timeout=60)).text)
        return 0.0

    async with SandboxPool(backend, "reuse") as pool:
        for episode in (hide, ask):
            result = await run_rollout(pool, task, episode)
            assert result.outcome is Outcome.COMPLETED, result
        assert pool.counters.created == 1, pool.counters
    assert heard == ["nobody: Connection refused\n"], heard


#: What a process of the agent's uid may set on the agent (pid 1), most of which the agent
#: cannot set back without CAP_SYS_NICE: bits that outlive every file the reset compares
#: (the last line: ``ioprio_set`` of the idle class).
MARK_THE_AGENT = r"""python3 - <<'PY'
import os
os.sched_setscheduler(1, os.SCHED_IDLE, os.sched_param(0))
os.setpriority(os.PRIO_PROCESS, 1, 17)
os.sched_setaffinity(1, {0})
open("/proc/1/oom_score_adj", "w").write("999")
open("/proc/1/coredump_filter", "w").write("0x1a5")
__import__("ctypes").CDLL(None).syscall({"aarch64": 30}.get(os.uname().machine, 251), 1, 1, 3 << 13)
print("marked")
PY"""
READ_THE_AGENT = ("cut -d' ' -f19 /proc/1/stat; grep Cpus_allowed_list /proc/1/status;"
                  " cat /proc/1/oom_score_adj /proc/1/coredump_filter; ionice -p 1")


@pytest.mark.parametrize("mark", MARK_THE_AGENT.split("\n")[2:8])
async def test_what_a_rollout_set_on_the_agent_never_reaches_the_next_rollout(
    cluster, namespace, real_node, real_images, mark
):
    """Each mark alone fails the reset: the pod is quarantined and the next rollout gets a
    fresh one, whose agent reads as the first rollout's did before it marked it."""
    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    backend = real_backend(cluster, namespace, real_node)
    read: list[str] = []
    script = "\n".join([*MARK_THE_AGENT.split("\n")[:2], mark, *MARK_THE_AGENT.split("\n")[8:]])

    async def marks(lease) -> float:
        read.append((await lease.exec(READ_THE_AGENT, timeout=60)).text)
        assert (await lease.exec(script, timeout=60)).text == "marked\n"
        assert (await lease.exec(READ_THE_AGENT, timeout=60)).text != read[0] or "IDLE" in mark
        return 0.0

    async def reads(lease) -> float:
        read.append((await lease.exec(READ_THE_AGENT + "; chrt -p 1", timeout=60)).text)
        return 0.0

    async with SandboxPool(backend, "reuse") as pool:
        for episode in (marks, reads):
            result = await run_rollout(pool, task, episode)
            assert result.outcome is Outcome.COMPLETED, result
        assert pool.counters.quarantines == 1, pool.counters
    assert read[1].startswith(read[0]) and "SCHED_OTHER" in read[1], read
