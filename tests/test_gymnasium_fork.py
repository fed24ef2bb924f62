"""Gymnasium: ``env.unwrapped.fork(n)`` branches an episode, and ``checkpoint_every=1`` lets an
episode survive its sandbox's death, on real bubblewrap sandboxes and the real gymnasium."""

from __future__ import annotations

import threading
from pathlib import Path

import gymnasium as gym
import pytest

from sandpool.core import PoolLimits, Task, errors
from sandpool.integrations.gymnasium import ENV_ID

from .waiting import wait_until


@pytest.fixture(scope="session")
def opts(test_images_root: Path, calc_task: Task) -> dict:
    # Forks are claims: room for a parent, its branches and their grading.
    return {"tasks": [calc_task], "backend_options": {"images_root": str(test_images_root)},
            "step_timeout": 60.0, "grade_timeout": 120.0, "limits": PoolLimits(max_live=6)}


def test_fork_branches_an_episode_each_graded_on_its_own(opts: dict, calc_task: Task) -> None:
    env = gym.make(ENV_ID, **opts)
    kids = []
    try:
        env.reset(options={"task_id": calc_task.instance_id})
        env.unwrapped.write_file("/tmp/gold.patch", calc_task.patch)
        obs, *_ = env.step("echo 'branch point' > notes.txt && echo ok")
        assert obs["stdout"] == "ok\n"
        kids = env.unwrapped.fork(3)
        ids = {k.sandbox.id for k in kids} | {env.unwrapped.sandbox.id}
        assert len(ids) == 4
        # Each branch goes on from the same state with its own commands.
        actions = ["git apply /tmp/gold.patch", "echo 'return 0' >> calc.py", "cat notes.txt"]
        outs = [k.step(a) for k, a in zip(kids, actions, strict=True)]
        assert [o[0]["exit_code"] for o in outs] == [0, 0, 0]
        assert outs[2][0]["stdout"] == "branch point\n" and outs[2][4]["step"] == 2
        rewards = [k.step("submit")[1] for k in kids]
        assert rewards == [1.0, 0.0, 0.0]
        # The parent went on untouched by its branches: no patch applied there.
        obs, reward, term, *_ = env.step("git diff --stat -- calc.py | wc -l")
        assert obs["stdout"].strip() == "0"
        assert env.step("submit")[1] == 0.0
        report = env.unwrapped.report()
        assert report.failures["completed"] == 4 and report.reward.resolved == 1
    finally:
        for k in kids:
            k.close()
        env.close()


def test_fork_before_reset_needs_a_reset(opts: dict) -> None:
    env = gym.make(ENV_ID, **opts)
    try:
        with pytest.raises(gym.error.ResetNeeded):
            env.unwrapped.fork(2)
    finally:
        env.close()


def test_a_checkpointed_episode_survives_its_sandbox_dying_mid_step(opts: dict, calc_task: Task) -> None:
    env = gym.make(ENV_ID, checkpoint_every=1, **opts)
    try:
        env.reset(options={"task_id": calc_task.instance_id})
        env.unwrapped.write_file("/tmp/gold.patch", calc_task.patch)
        obs, *_ = env.step("git apply /tmp/gold.patch && echo applied")
        assert obs["stdout"] == "applied\n"
        backend = env.unwrapped.pool.pool.backend
        first = env.unwrapped.sandbox

        def host() -> None:  # kills the sandbox under the step, then lets the re-run finish
            wait_until(lambda: (first.tmp_host() / "started").exists(), "the step started")
            backend.kill(first)
            second = wait_until(lambda: (sb := env.unwrapped.sandbox) is not first and sb,
                                "the episode's new sandbox")
            wait_until(lambda: (second.tmp_host() / "started").exists(), "the step started again")
            (second.tmp_host() / "go").touch()

        watcher = threading.Thread(target=host)
        watcher.start()
        obs, reward, term, trunc, info = env.step(
            "touch /tmp/started && until [ -e /tmp/go ]; do sleep 0.01; done && git diff --stat | wc -l")
        watcher.join()
        assert (obs["exit_code"], obs["stdout"].strip(), info["recoveries"]) == (0, "2", 1)
        assert not (term or trunc or info["infra_failed"])
        obs, reward, term, trunc, info = env.step("submit")
        assert (reward, info["resolved"], info["recoveries"]) == (1.0, True, 1)
        report = env.unwrapped.report()
        assert report.failures["completed"] == 1 and report.pool.recoveries == 1
        assert report.rollouts[0].recoveries == 1
    finally:
        env.close()


def test_checkpoint_every_other_than_0_or_1_is_refused(opts: dict) -> None:
    with pytest.raises(errors.ConfigError, match="checkpoint_every=2"):
        gym.make(ENV_ID, checkpoint_every=2, **opts)
