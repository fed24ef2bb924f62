"""``gym.make("sandpool/SWE-v0", backend="kubernetes")`` on the local cluster (real apiserver,
agent-sandbox controller, kwok nodes), with the calc test image mapped onto pods."""

from __future__ import annotations

import math
from pathlib import Path

import gymnasium as gym
import pytest

from sandpool.core import Task
from sandpool.integrations.gymnasium import ENV_ID
from tests.cluster.kwok_images import local_pack_image_map

pytestmark = pytest.mark.cluster


@pytest.fixture
def k8s_opts(cluster, namespace: str, test_images_root: Path, calc_task: Task) -> dict:
    return {"tasks": [calc_task], "backend": "kubernetes", "step_timeout": 30.0, "grade_timeout": 120.0,
            "backend_options": {"kubeconfig": str(cluster.kubeconfig), "namespace": namespace,
                                "image_map": local_pack_image_map(test_images_root)}}


def test_make_with_the_kubernetes_backend_grades_oracle_1_and_noop_0(k8s_opts: dict, calc_task: Task) -> None:
    env = gym.make(ENV_ID, **k8s_opts)
    try:
        assert env.unwrapped.pool.pool.backend.name == "kubernetes"
        obs, info = env.reset(seed=0)
        assert obs["workdir"] == calc_task.workdir and info["ttfc_s"] > 0
        env.unwrapped.write_file("/tmp/gold.patch", calc_task.patch)
        obs, reward, *_ = env.step("git apply /tmp/gold.patch && echo applied")
        assert obs["stdout"] == "applied\n" and reward == 0.0
        _, reward, term, _, info = env.step("submit")
        assert (reward, term, info["resolved"]) == (1.0, True, True)
        env.reset(seed=0)
        _, reward, term, _, info = env.step("submit")
        assert (reward, term, info["resolved"]) == (0.0, True, False)
        assert env.unwrapped.report().failures["completed"] == 2
    finally:
        env.close()


def test_deleted_pod_mid_episode_is_a_nan_reward_not_a_score(cluster, namespace: str, wait_for,
                                                             k8s_opts: dict) -> None:
    env = gym.make(ENV_ID, **k8s_opts)
    try:
        env.reset(seed=0)
        sandbox = env.unwrapped.sandbox
        cluster.core.delete_namespaced_pod(sandbox.pod, namespace, grace_period_seconds=0)
        wait_for(lambda: not sandbox.alive(), 60, "the pod watch to see the pod deleted")
        with pytest.warns(UserWarning, match="NaN"):  # Gymnasium's checker, on the first step
            _, reward, term, trunc, info = env.step("echo hi")
        assert math.isnan(reward) and trunc and not term and info["infra_failed"]
        report = env.unwrapped.report()
        assert report.failures["infra_failed"] == 1 and report.rollouts[0].reward is None
    finally:
        env.close()
