"""Whose a real pod's exhaustion or death is, decided by evidence, on the real node.

The agent is its container's pid 1, so no command of the policy can signal it. A pod's agent
that is refused a thread, or dies, is the policy's failure (scored 0) only with evidence that
the pod's own processes caused it: the pid controller of its group refused the agent's thread
while its processes held the group's tasks (the agent reads that from inside), or the kubelet
reports its container OOMKilled. Anything else (a pid limit lowered from outside, a SIGKILL
from the node) is infra: unscored and retried. A fork bomb left running holds every pid the
pod has, yet the agent still empties the pod (``kill_strays`` needs no thread of its own) and
the in-place reset gives the sandbox back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from sandpool.core import Outcome, SandboxPool, Task, errors, run_rollout
from sandpool.core.agent.client import READ_MAX, AgentStarved
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.classify import Verdict, classify
from sandpool.envs.grading import grade
from tests.waiting import until

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

LIMITS = {"requests": {"cpu": "100m", "memory": "128Mi"},
          "limits": {"cpu": "500m", "memory": "384Mi"}}
#: Holds every pid of the pod (its limit is the kubelet's podPidsLimit, 1024) for 1000 s.
BOMB = "(for i in $(seq 1100); do sleep 1000 & done) >/dev/null 2>&1 & echo started"


def real_backend(cluster, namespace, real_node, **kw) -> KubernetesBackend:
    return KubernetesBackend(
        cluster.kubeconfig, namespace=namespace, mode="pods", run_id=uuid.uuid4().hex[:8],
        node_selector=real_node.node_selector, tolerations=list(real_node.tolerations),
        resources=LIMITS, ready_timeout=180, disk_bytes=64 << 20, agent_entrypoint=True, **kw)


def pod_group(cluster, real_node, namespace: str, pod: str, controller: str = "pids") -> Path:
    """The pod's cgroup (v1 ``controller``) on the node, as the host sees it."""
    uid = cluster.core.read_namespaced_pod(pod, namespace).metadata.uid
    found = list(Path("/sys/fs/cgroup", controller, real_node.state["real_nodes"][0]["cgroup"])
                 .rglob(f"pod{uid}"))
    assert len(found) == 1, found
    return found[0]


def refused_forks(group: Path) -> int:
    """Forks the pid controller refused in ``group`` or any group below it (v1 counts each in
    the forking task's own group)."""
    return sum(int(p.read_text().split()[1]) for p in group.rglob("pids.events"))


def agent_pid(real_node, namespace: str, pod: str) -> int:
    """Host pid of the pod's container's pid 1 (its agent), from the CRI."""
    out = real_node.crictl("ps", "--namespace", namespace, "--pod", "", "--name", "sandbox",
                           "-o", "json").stdout
    pods = json.loads(real_node.crictl("pods", "--namespace", namespace, "--name", pod,
                                       "-o", "json").stdout)["items"]
    assert len(pods) == 1, pods
    ours = [c for c in json.loads(out)["containers"] if c["podSandboxId"] == pods[0]["id"]]
    assert len(ours) == 1, ours
    return json.loads(real_node.crictl("inspect", ours[0]["id"]).stdout)["info"]["pid"]


async def test_a_fork_bomb_left_running_is_scored_and_the_reset_gives_the_sandbox_back(
    cluster, namespace, real_node, real_images
):
    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    backend = real_backend(cluster, namespace, real_node)
    seen: list[BaseException] = []
    attempts = 0

    async def episode(lease) -> float:
        nonlocal attempts
        attempts += 1
        sb = lease.sandbox
        group = await asyncio.to_thread(pod_group, cluster, real_node, namespace, sb.pod)
        assert (await lease.exec(BOMB, timeout=60)).text == "started\n"
        await until(lambda: refused_forks(group) > 0, "the bomb to hold every pid of the pod",
                    timeout=300)
        try:
            await lease.exec("echo hi", timeout=60)
        except errors.SandpoolError as exc:
            seen.append(exc)
            raise
        return 1.0

    async with SandboxPool(backend, "reuse") as pool:
        result = await run_rollout(pool, task, episode)
        assert (result.outcome, result.reward, attempts) == (Outcome.TASK_FAILED, 0.0, 1), result
        assert result.error_kind == "sandbox_exhausted", result
        assert isinstance(seen[0], errors.SandboxExhausted) and classify(seen[0]) is Verdict.POLICY
        assert "pid limit was reached" in str(seen[0]), seen[0]
        # The release reset the sandbox in place: the bomb is gone, nothing was quarantined,
        # and the same pod serves the next rollout, which the gold patch resolves.
        assert (pool.counters.resets, pool.counters.quarantines) == (1, 0), pool.counters

        async def gold(lease) -> float:
            await lease.write_file("/tmp/gold.patch", task.patch.encode())
            assert (await lease.exec("git apply /tmp/gold.patch")).ok
            assert await lease.sandbox.processes() == []
            return (await grade(lease, task)).reward

        again = await run_rollout(pool, task, gold)
        assert (again.outcome, again.reward) == (Outcome.COMPLETED, 1.0), again
        assert pool.counters.created == 1, pool.counters


async def test_a_pid_limit_lowered_from_outside_is_infra_and_kill_strays_still_runs(
    cluster, namespace, real_node, real_images
):
    """The node (an operator) lowers the pod's pid limit below what it holds while no command
    of the policy runs: the agent is refused a thread, its group holds only the agent's own
    threads, so the refusal is not the policy's: an infra error. Ops that need no thread are
    still served meanwhile."""
    backend = real_backend(cluster, namespace, real_node)
    try:
        sb = await backend.create(real_images["swe"])
        assert (await sb.exec("echo hi", timeout=60)).ok
        limit = await asyncio.to_thread(pod_group, cluster, real_node, namespace, sb.pod)
        before = (limit / "pids.max").read_text()
        (limit / "pids.max").write_text("1")
        try:
            with pytest.raises(AgentStarved) as caught:
                await sb.exec("echo hi", timeout=60)
            assert caught.value.refused is True and classify(caught.value) is Verdict.INFRA, \
                (caught.value.refused, caught.value.tasks, caught.value.agent_tasks)
            assert await sb.kill_strays() == 0
            assert await sb.processes() == []
        finally:
            (limit / "pids.max").write_text(before)
        assert (await sb.exec("echo hi", timeout=60)).text == "hi\n"
    finally:
        await backend.aclose()


async def test_the_agent_killed_from_the_node_is_infra(cluster, namespace, real_node, real_images):
    backend = real_backend(cluster, namespace, real_node)
    try:
        sb = await backend.create(real_images["swe"])
        command = asyncio.create_task(sb.exec("sleep 300", timeout=120))
        for _ in range(600):  # the agent lists it once the command runs
            if any("sleep 300" in p for p in await sb.processes()):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the command did not start")
        os.kill(await asyncio.to_thread(agent_pid, real_node, namespace, sb.pod), signal.SIGKILL)
        with pytest.raises(errors.SandboxDied) as caught:
            await command
        assert classify(caught.value) is Verdict.INFRA and "no OOM kill" in str(caught.value), \
            caught.value
        assert not sb.alive()
    finally:
        await backend.aclose()


async def test_the_agent_oom_killed_by_the_pods_memory_limit_is_the_policys(
    cluster, namespace, real_node, real_images
):
    """The policy leaves a sparse file as large as a read may return; the episode reads it
    whole through the agent many times at once, whose memory then exceeds the pod's limit:
    the kubelet reports the container OOMKilled, and the death is the policy's (as on the
    local backend)."""
    backend = real_backend(cluster, namespace, real_node)
    try:
        sb = await backend.create(real_images["swe"])
        assert (await sb.exec(f"truncate -s {READ_MAX} /tmp/answer.txt", timeout=60)).ok
        with pytest.raises(errors.SandboxExhausted) as caught:
            await asyncio.gather(*(sb.read_file("/tmp/answer.txt") for _ in range(32)))
        assert classify(caught.value) is Verdict.POLICY and "OOMKilled" in str(caught.value), \
            caught.value
        assert not sb.alive()
    finally:
        await backend.aclose()
