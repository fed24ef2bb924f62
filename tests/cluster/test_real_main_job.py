"""The main job on real pods: `sandpool run --backend kubernetes` on the SWE-shaped OCI task,
validated, run and graded in containers on the real node, as on the local backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]


def test_sandpool_run_on_kubernetes_scores_the_oracle_1_and_noop_0_and_reports_the_api(
    cluster, namespace, real_node, real_images, tmp_path
):
    task = json.loads(Path(real_images["task"]).read_text())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(task) + "\n")
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "sandpool", "run", "--tasks", str(tasks), "--rollouts", "4",
         "--policy", "oracle,noop", "--concurrency", "2", "--backend", "kubernetes",
         "--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace,
         "--node-selector", "sandpool.io/node=real", "--tolerate", "sandpool.io/real-node",
         "--disk-mib", "256", "--out", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "SANDPOOL_HOME": str(tmp_path / "home")},  # validation uncached
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["workload"]["backend"] == "kubernetes"
    assert report["failures"] == {"completed": 4, "infra_failed": 0, "task_failed": 0,
                                  "rejected": 0}, report["failures"]
    by_policy = report["reward"]["by_policy"]
    assert (by_policy["oracle"]["mean"], by_policy["noop"]["mean"]) == (1.0, 0.0), by_policy
    assert report["api_writes"] > 0 and report["api_execs"] > 0
    text = (out / "report.txt").read_text()
    assert f"k8s writes   {report['api_writes']}, exec streams {report['api_execs']}" in text


def test_gymnasium_with_the_kubernetes_backend_runs_an_episode_in_a_real_container(
    cluster, namespace, real_node, real_images
):
    """``gym.make("sandpool/SWE-v0", backend="kubernetes")`` on the real node: the gold patch
    applied in the container is graded 1.0, an empty episode 0.0."""
    import gymnasium as gym

    from sandpool.core import Task
    from sandpool.integrations.gymnasium import ENV_ID

    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    env = gym.make(ENV_ID, tasks=[task], backend="kubernetes", step_timeout=60.0,
                   grade_timeout=180.0, backend_options={
                       "kubeconfig": str(cluster.kubeconfig), "namespace": namespace,
                       "node_selector": real_node.node_selector,
                       "tolerations": list(real_node.tolerations), "agent_entrypoint": True,
                       "disk_bytes": 256 << 20, "ready_timeout": 180})
    try:
        env.reset(seed=0)
        pod = cluster.core.read_namespaced_pod(env.unwrapped.sandbox.pod, namespace)
        assert pod.spec.node_name == real_node.name
        env.unwrapped.write_file("/tmp/gold.patch", task.patch)
        obs, reward, *_ = env.step("git apply /tmp/gold.patch && echo applied")
        assert obs["stdout"] == "applied\n" and reward == 0.0
        _, reward, term, _, info = env.step("submit")
        assert (reward, term, info["resolved"]) == (1.0, True, True)
        env.reset(seed=0)
        _, reward, term, _, info = env.step("submit")
        assert (reward, term, info["resolved"]) == (0.0, True, False)
    finally:
        env.close()
