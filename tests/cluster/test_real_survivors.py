"""No process of a rollout outlives a real pod's in-place reset, however it hides.

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
