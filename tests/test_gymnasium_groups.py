"""GRPO groups and lookahead in the native vector env, on real bubblewrap sandboxes."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from sandpool.core import errors
from sandpool.integrations.gymnasium import ENV_ID

from .test_gymnasium_env import image, opts, task  # noqa: F401 - fixtures


def variants(task, n: int) -> list:
    """``n`` tasks of ``task``'s image under ids of their own."""
    return [task.model_copy(update={"instance_id": f"{task.instance_id}-v{i}"}) for i in range(n)]


def test_group_size_must_divide_the_sub_envs(opts):
    with pytest.raises(errors.ConfigError, match="group_size=3"):
        gym.make_vec(ENV_ID, num_envs=4, group_size=3, **opts)


def test_each_round_gives_a_group_one_task_and_the_next_round_is_claimed_warm(opts, task):
    tasks = variants(task, 6)
    envs = gym.make_vec(ENV_ID, num_envs=4, group_size=2, max_steps=1,
                        **{**opts, "tasks": tasks})
    try:
        _, info = envs.reset(seed=3)
        rounds = [list(info["task_id"])]
        for _ in range(3):  # every episode ends at its one step; the next step autoresets
            _, _, term, trunc, _ = envs.step(("true",) * 4)
            assert (term | trunc).all()
            _, _, _, _, info = envs.step(("",) * 4)
            rounds.append(list(info["task_id"]))
        for ids in rounds:
            assert ids[0] == ids[1] and ids[2] == ids[3]  # a group shares its round's task
        assert len({ids[0] for ids in rounds}) > 1 or len({ids[2] for ids in rounds}) > 1
        report = envs.report()
        assert info["reuse"][0] == pytest.approx(report.pool.claims / report.sandboxes_created)
        # The rounds after the first were warmed while the one before ran: warm claims.
        assert report.pool.warm_hits >= report.pool.claims - 4
        assert report.reuse is not None and report.reuse > 1
        assert "rollouts per sandbox" in report.render_text()
    finally:
        envs.close()


def test_without_lookahead_the_draws_are_those_of_the_sub_envs_generators(opts, task):
    tasks = variants(task, 5)
    a = gym.make_vec(ENV_ID, num_envs=2, lookahead=False, **{**opts, "tasks": tasks})
    b = gym.make_vec(ENV_ID, num_envs=2, **{**opts, "tasks": tasks})
    try:
        _, ia = a.reset(seed=7)
        _, ib = b.reset(seed=7)
        assert list(ia["task_id"]) == list(ib["task_id"])  # lookahead changes no draw
        assert isinstance(ia["reuse"], np.ndarray)
    finally:
        a.close()
        b.close()


def test_an_image_coming_round_again_finds_its_groups_sandboxes_idle(image, task, tmp_path):
    # 4 images x groups of 2: the default cap holds every image's group, so a sandbox reset in
    # place waits for its image's next round instead of being evicted for another image's.
    from sandpool.core.backends.local import image_dir

    root, tasks = tmp_path / "images", []
    root.mkdir()
    for i in range(4):
        name = f"{task.image}-alias{i}"
        image_dir(root, name).symlink_to(image_dir(image[0], task.image))
        tasks.append(task.model_copy(update={"instance_id": f"{task.instance_id}-{i}", "image": name}))
    envs = gym.make_vec(ENV_ID, num_envs=2, group_size=2, max_steps=1, tasks=tasks,
                        backend_options={"images_root": str(root)}, step_timeout=10.0,
                        grade_timeout=120.0)
    try:
        _, info = envs.reset(seed=1)
        seen = [info["task_id"][0]]
        while len(seen) < 12:
            envs.step(("true",) * 2)
            _, _, _, _, info = envs.step(("",) * 2)  # the autoreset: the next round
            seen.append(info["task_id"][0])
        assert len(set(seen)) < len(seen)  # some image came round again
        report = envs.report()
        assert report.pool.evicted == 0
        assert report.sandboxes_created <= 2 * len(tasks)  # one group's sandboxes per image
    finally:
        envs.close()
