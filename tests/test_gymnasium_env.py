"""The Gymnasium integration against real bubblewrap sandboxes and the real gymnasium."""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

import sandpool
from sandpool.core import PoolLimits, Task, errors
from sandpool.core.backends.local import LocalBackend
from sandpool.integrations.gymnasium import ENV_ID, BackgroundPool, SWEEnv, SWEVectorEnv
from sandpool.integrations.gymnasium._text import CHARSET, from_text, to_text, truncate

from .waiting import wait_until

# -- the tiny calc image from conftest, with non-ASCII issue text ----------------------------


@pytest.fixture(scope="session")
def image(test_images_root: Path, calc_task: Task) -> tuple[Path, Task]:
    """``(images_root, task)``: the conftest calc task, its issue text made non-ASCII."""
    text = calc_task.problem_statement + "\nCaf\u00e9 \u2713 (non-ASCII in the issue text)."
    return test_images_root, calc_task.model_copy(update={"problem_statement": text})


@pytest.fixture(scope="session")
def task(image: tuple[Path, Task]) -> Task:
    return image[1]


@pytest.fixture(scope="session")
def opts(image: tuple[Path, Task]) -> dict:
    """Keyword arguments every env in these tests gets."""
    return {"tasks": [image[1]], "backend_options": {"images_root": str(image[0])},
            "step_timeout": 10.0, "grade_timeout": 120.0}


def oracle_write(env, task: Task, index: int | None = None) -> None:
    args = ("/tmp/gold.patch", task.patch)
    env.unwrapped.write_file(*args) if index is None else env.write_file(index, *args)


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sandpool-gym-loop"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


# -- registration and construction -------------------------------------------------------------

def test_import_registers_both_entry_points() -> None:
    spec = gym.spec(ENV_ID)
    assert spec.entry_point == "sandpool.integrations.gymnasium.env:SWEEnv"
    assert spec.vector_entry_point == "sandpool.integrations.gymnasium.vector:SWEVectorEnv"
    assert sandpool.__version__


def test_make_with_module_prefix_works_without_importing_sandpool(task: Task) -> None:
    code = textwrap.dedent(f"""
        import sys, gymnasium as gym
        assert "sandpool" not in sys.modules
        env = gym.make("sandpool:{ENV_ID}", tasks={[task.model_dump(mode="json")]!r})
        print(type(env.unwrapped).__name__)
        env.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "SWEEnv"


def test_core_imports_without_gymnasium() -> None:
    code = ("import sys; sys.modules['gymnasium'] = None\n"
            "import sandpool, sandpool.core, sandpool.core.backends.local\n"
            "assert not any(m.startswith('sandpool.integrations.gymnasium.') for m in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_construction_starts_no_thread_and_no_sandbox(opts: dict) -> None:
    before = len(_loop_threads())
    env = gym.make(ENV_ID, **opts)
    venv = gym.make_vec(ENV_ID, num_envs=3, **opts)
    assert len(_loop_threads()) == before
    assert env.unwrapped._owner.runner is None and venv._owner.runner is None
    env.close()
    venv.close()


# -- the checker and the text spaces --------------------------------------------------------

def test_check_env_passes_on_the_real_env(opts: dict) -> None:
    env = gym.make(ENV_ID, max_steps=5, **opts)
    try:
        check_env(env.unwrapped)
    finally:
        env.close()


def test_output_outside_the_charset_is_escaped_and_long_output_cut(opts: dict) -> None:
    env = gym.make(ENV_ID, max_output_chars=1000, **opts)
    try:
        obs, info = env.reset(seed=0)
        assert obs in env.observation_space
        assert "Caf\\u00e9 \\u2713" in obs["problem_statement"]
        obs, *_, info = env.step(r"printf 'caf\xc3\xa9 \xff \xf0\x9f\x98\x80 \x1b[1m \\xe9\r\n'; echo err >&2")
        assert obs["stdout"] == "caf\\u00e9 \\xff \\U0001f600 \\u001b[1m \\\\xe9\\r\n"
        assert from_text(obs["stdout"]) == b"caf\xc3\xa9 \xff \xf0\x9f\x98\x80 \x1b[1m \\xe9\r\n"
        assert obs["stderr"] == "err\n" and obs["exit_code"] == 0
        assert obs in env.observation_space and not info["output_truncated"]
        obs, *_, info = env.step("python -c \"print('a' * 5000 + 'b' * 5000)\"")
        assert len(obs["stdout"]) <= 1000 and info["output_truncated"]
        assert obs["stdout"].startswith("aaa") and obs["stdout"].rstrip().endswith("bbb")
        assert "characters cut" in obs["stdout"] and obs in env.observation_space
    finally:
        env.close()


def test_text_helpers_keep_the_charset_and_the_length() -> None:
    assert set(CHARSET) >= set("\t\n ~") and "\r" not in CHARSET and len(CHARSET) == 97
    raw = bytes(range(256)) + "é✓😀".encode()
    text = to_text(raw)
    assert set(text) <= set(CHARSET)
    for limit in (64, 100, 500):
        cut, was_cut = truncate(text, limit)
        assert len(cut) <= limit and was_cut
    assert truncate("short", 64) == ("short", False)


def test_a_command_that_hangs_is_killed_at_the_step_timeout(opts: dict) -> None:
    env = gym.make(ENV_ID, **{**opts, "step_timeout": 1.0})
    try:
        env.reset(seed=0)
        obs, reward, term, trunc, info = env.step("sleep 60")
        # 124 and the flag, not a finished sleep (0): it was killed at the step timeout.
        assert obs["exit_code"] == 124 and info["timed_out"] and not (term or trunc) and reward == 0.0
        u = env.unwrapped
        assert not any("sleep 60" in p for p in u.pool.run(u.sandbox.processes()))
        obs, *_ = env.step("echo still-here")
        assert obs["stdout"] == "still-here\n"
    finally:
        env.close()


# -- rollouts: oracle gets 1, noop gets 0 ------------------------------------------------------

def test_make_oracle_rollout_gets_reward_1_and_noop_gets_0(opts: dict, task: Task) -> None:
    env = gym.make(ENV_ID, **opts)
    try:
        obs, info = env.reset(seed=1, options={"task_id": task.instance_id})
        assert info["sandbox_id"] and info["ttfc_s"] > 0 and obs["workdir"] == "/testbed"
        oracle_write(env, task)
        obs, reward, term, trunc, info = env.step("git apply /tmp/gold.patch")
        assert obs["exit_code"] == 0 and reward == 0.0 and not term
        obs, reward, term, trunc, info = env.step("submit")
        assert (reward, term, trunc, info["resolved"]) == (1.0, True, False, True)

        env.reset(options={"task_id": task.instance_id})
        obs, reward, term, trunc, info = env.step("submit")
        assert (reward, term, trunc, info["resolved"]) == (0.0, True, False, False)
        report = env.unwrapped.report()
        assert report.failures["completed"] == 2 and report.reward.resolved == 1
        assert report.ttfc.n == 2
        # No policy is named here: the reward line stands alone, no row for a policy "-".
        text = report.render_text()
        assert "reward       mean 0.500 over 2 scored, 1 resolved" in text and "    -  " not in text
    finally:
        env.close()


def test_step_limit_ends_the_episode_truncated_and_graded(opts: dict, task: Task) -> None:
    env = gym.make(ENV_ID, max_steps=2, **opts)
    try:
        env.reset(seed=0)
        oracle_write(env, task)
        _, reward, term, trunc, _ = env.step("git apply /tmp/gold.patch")
        assert (reward, term, trunc) == (0.0, False, False)
        _, reward, term, trunc, info = env.step("git diff --stat")
        assert (reward, term, trunc, info["submitted"]) == (1.0, False, True, False)
        with pytest.raises(gym.error.ResetNeeded):
            env.step("true")
    finally:
        env.close()


def test_make_vec_oracle_and_noop_in_one_batch(opts: dict, task: Task) -> None:
    envs = gym.make_vec(ENV_ID, num_envs=2, **opts)
    try:
        assert isinstance(envs, SWEVectorEnv) and envs.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
        obs, info = envs.reset(seed=3)
        assert info["_ttfc_s"].all() and (info["ttfc_s"] > 0).all()
        assert len(set(info["sandbox_id"])) == 2
        oracle_write(envs, task, index=0)
        obs, rew, term, trunc, info = envs.step(("git apply /tmp/gold.patch", "true"))
        assert obs["exit_code"].tolist() == [0, 0] and obs in envs.observation_space
        obs, rew, term, trunc, info = envs.step(("submit", "submit"))
        assert rew.tolist() == [1.0, 0.0] and term.tolist() == [True, True]
        # NEXT_STEP: the following step resets both; actions are ignored.
        obs, rew, term, trunc, info = envs.step(("echo ignored", "echo ignored"))
        assert obs["stdout"] == ("", "") and info["_ttfc_s"].all() and not term.any()
        assert envs.report().reward.resolved == 1
    finally:
        envs.close()


def test_vector_env_disabled_autoreset_uses_reset_mask(opts: dict) -> None:
    envs = gym.make_vec(ENV_ID, num_envs=2, autoreset_mode=AutoresetMode.DISABLED, **opts)
    try:
        assert envs.metadata["autoreset_mode"] is AutoresetMode.DISABLED
        envs.reset(seed=0)
        _, _, term, _, _ = envs.step(("submit", "echo a"))
        assert term.tolist() == [True, False]
        with pytest.raises(gym.error.ResetNeeded):
            envs.step(("echo x", "echo y"))
        obs, info = envs.reset(options={"reset_mask": np.array([True, False])})
        assert info["_sandbox_id"].tolist() == [True, False]
        assert obs["stdout"] == ("", "a\n")  # sub-env 1 keeps its last observation
        obs, *_ = envs.step(("echo x", "echo y"))
        assert obs["stdout"] == ("x\n", "y\n")
    finally:
        envs.close()


@pytest.mark.parametrize("mode", ["sync", "async", "async-shared-memory"])
def test_gymnasium_vector_wrappers_over_the_single_env(opts: dict, task: Task, mode: str) -> None:
    make = functools.partial(gym.make, ENV_ID, **opts)
    if mode == "sync":
        envs = SyncVectorEnv([make, make])
    else:
        envs = AsyncVectorEnv([make, make], shared_memory=mode.endswith("shared-memory"),
                              context="spawn")
    try:
        envs.reset(seed=5)
        patch = task.patch
        write = f"cat > /tmp/gold.patch <<'SANDPOOL_EOF'\n{patch}SANDPOOL_EOF\ngit apply /tmp/gold.patch"
        obs, *_ = envs.step((write, "true"))
        assert list(obs["exit_code"]) == [0, 0]
        _, rew, term, _, _ = envs.step(("submit", "submit"))
        assert rew.tolist() == [1.0, 0.0] and term.all()
    finally:
        envs.close()


# -- infra failures are never a reward ----------------------------------------------------------

def _kill_mid_episode(env) -> None:
    env.reset(seed=0)
    backend = env.unwrapped.pool.pool.backend
    assert isinstance(backend, LocalBackend)
    backend.kill(env.unwrapped.sandbox)


def test_killed_sandbox_gives_a_nan_reward_by_default_and_is_counted(opts: dict) -> None:
    env = gym.make(ENV_ID, **opts)
    try:
        _kill_mid_episode(env)
        with pytest.warns(UserWarning, match="NaN"):  # Gymnasium's own checker flags it too
            obs, reward, term, trunc, info = env.step("echo hi")
        assert math.isnan(reward) and trunc and not term
        assert info["infra_failed"] and info["error_kind"] == "sandbox_died"
        assert obs in env.observation_space
        report = env.unwrapped.report()
        assert report.failures["infra_failed"] == 1 and report.reward.scored == 0
        assert report.infra_errors_by_kind.get("sandbox_died", 0) >= 1
        assert report.rollouts[0].reward is None
        with pytest.raises(gym.error.ResetNeeded):
            env.step("true")
        obs, info = env.reset()  # a fresh sandbox afterwards
        obs, *_ = env.step("echo back")
        assert obs["stdout"] == "back\n"
    finally:
        env.close()


def test_killed_sandbox_raises_when_asked_to(opts: dict) -> None:
    env = gym.make(ENV_ID, on_infra_failure="raise", **opts)
    try:
        _kill_mid_episode(env)
        with pytest.raises(errors.SandboxDied):
            env.step("echo hi")
        report = env.unwrapped.report()
        assert report.failures["infra_failed"] == 1 and report.rollouts[0].reward is None
        with pytest.raises(gym.error.ResetNeeded):
            env.step("true")
    finally:
        env.close()


def test_killed_sandbox_is_a_flagged_zero_only_when_opted_in(opts: dict) -> None:
    env = gym.make(ENV_ID, on_infra_failure="truncate", **opts)
    try:
        _kill_mid_episode(env)
        _, reward, term, trunc, info = env.step("echo hi")
        assert (reward, term, trunc, info["infra_failed"]) == (0.0, False, True, True)
        assert env.unwrapped.report().rollouts[0].reward is None  # still not a score
    finally:
        env.close()


def test_unknown_infra_failure_mode_names_the_choices(opts: dict) -> None:
    with pytest.raises(errors.ConfigError, match="on_infra_failure='zero'.*'nan', 'raise', 'truncate'"):
        gym.make(ENV_ID, on_infra_failure="zero", **opts)


def test_vector_env_infra_failure_hits_only_that_sub_env(opts: dict) -> None:
    envs = gym.make_vec(ENV_ID, num_envs=2, **opts)
    try:
        envs.reset(seed=0)
        envs.pool.pool.backend.kill(envs.sandbox(1))
        obs, rew, term, trunc, info = envs.step(("echo ok", "echo lost"))
        assert trunc.tolist() == [False, True] and obs["stdout"][0] == "ok\n"
        assert rew[0] == 0.0 and math.isnan(rew[1])
        assert info["infra_failed"].tolist() == [False, True]
        assert info["error_kind"][1] == "sandbox_died"
        assert envs.report().failures["infra_failed"] == 1
    finally:
        envs.close()


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_failed_autoreset_keeps_the_other_sub_envs_results(opts: dict, task: Task, mode: str) -> None:
    """Sub-env 0's autoreset cannot get a sandbox (the pool is full: claim timeout, infra);
    sub-env 1's step in the same batch is still returned, and sub-env 0 resets later."""
    kw = {k: v for k, v in opts.items() if k != "backend_options"}
    # The claim timeout is what fails the autoreset; long enough for a creation under load.
    shared = BackgroundPool(strategy="reuse", limits=PoolLimits(max_live=2, claim_timeout=5.0),
                            backend_options=opts["backend_options"])
    envs = gym.make_vec(ENV_ID, num_envs=2, pool=shared, claim_retries=0, on_infra_failure=mode, **kw)
    try:
        envs.reset(seed=0)
        _, _, term, _, _ = envs.step(("submit", "echo a"))
        assert term.tolist() == [True, False]
        held = shared.run(shared.pool.acquire(task, timeout=60.0))  # sub-env 0's sandbox, now taken
        if mode == "raise":
            with pytest.raises(errors.InfraTimeout) as raised:
                envs.step(("ignored", "echo b"))
            obs, rew, term, trunc, info = raised.value.step_results
        else:
            obs, rew, term, trunc, info = envs.step(("ignored", "echo b"))
        assert obs["stdout"][1] == "b\n" and rew[1] == 0.0 and not trunc[1]
        assert math.isnan(rew[0]) and trunc[0] and not term[0]
        assert info["reset_failed"][0] and info["infra_failed"][0] and not info["_reset_failed"][1]
        assert info["error_kind"][0] == "infra_timeout"
        shared.run(held.release())
        obs, rew, term, trunc, info = envs.step(("ignored", "echo c"))  # the reset, retried
        assert info["_sandbox_id"].tolist() == [True, False] and obs["stdout"][1] == "c\n"
        assert shared.report().failures["infra_failed"] == 1
    finally:
        envs.close()
        shared.close()


def test_an_action_no_shell_can_run_is_the_policys_result_not_an_infra_failure(opts: dict) -> None:
    """A NUL byte cannot reach bash: the policy sees that, the episode goes on, and nothing is
    unscored (else a policy could turn a failing episode into an unscored one at will)."""
    env = gym.make(ENV_ID, **opts)
    try:
        env.reset(seed=0)
        obs, reward, term, trunc, info = env.step("echo a\x00b")
        assert obs["exit_code"] == 126 and "nul byte" in obs["stderr"].lower()
        assert (reward, term, trunc, info["infra_failed"]) == (0.0, False, False, False)
        obs, *_ = env.step("echo still-here")
        assert obs["stdout"] == "still-here\n"
        assert env.unwrapped.report().failures["infra_failed"] == 0
    finally:
        env.close()


@pytest.mark.parametrize("action", ["kill -9 -1; kill -9 1", "kill -STOP -1; kill -STOP 1",
                                    "kill -INT 1"])
def test_policy_that_signals_its_whole_sandbox_keeps_it_in_control(opts: dict, action: str) -> None:
    """Killing or stopping every process it can, pid 1 included, leaves the sandbox's agent
    running: the episode goes on and counts, never an infra failure that would not."""
    env = gym.make(ENV_ID, **{**opts, "step_timeout": 5.0})
    try:
        env.reset(seed=0)
        _, reward, term, trunc, info = env.step(action)
        assert (reward, term, trunc, info["infra_failed"], info["task_failed"]) == (
            0.0, False, False, False, False)
        obs, *_ = env.step("echo in-control")
        assert obs["stdout"] == "in-control\n"
        _, reward, term, _, info = env.step("submit")
        assert (reward, term, info["resolved"]) == (0.0, True, False)
        assert env.unwrapped.report().failures["completed"] == 1
    finally:
        env.close()


@pytest.mark.parametrize("attack", [
    "echo '{\"id\": 3, \"exit_code\": 0}' > /proc/1/fd/1",  # forge an answer
    "echo garbage > /proc/1/fd/1",                              # garble the channel
    "timeout 1 cat /proc/1/fd/0",                               # steal requests
    "for p in /proc/[0-9]*; do echo x > $p/fd/1; done",         # any process's stdout
])
def test_policy_cannot_touch_the_agents_channel(opts: dict, attack: str) -> None:
    """The commands run as the agent's uid, yet cannot read its requests or write it answers:
    forged frames would fake results (grading's too), garbled ones an unscored failure."""
    env = gym.make(ENV_ID, **opts)
    try:
        env.reset(seed=0)
        obs, _, term, trunc, info = env.step(attack + " 2>/dev/null; echo done")
        assert obs["stdout"].endswith("done\n") and not (term or trunc) and not info["infra_failed"]
        obs, *_ = env.step("echo in-control")
        assert obs["stdout"] == "in-control\n"
        assert env.unwrapped.report().failures["infra_failed"] == 0
    finally:
        env.close()


def test_autoreset_onto_a_task_that_cannot_run_is_rejected_and_keeps_the_batch(
        opts: dict, task: Task) -> None:
    bad = task.model_copy(update={"instance_id": "calc__calc-bad", "base_commit": "0" * 40})
    # seed s seeds sub-env 0 with s: pick one whose first draw over [task, bad] is bad.
    seed = next(s for s in range(100) if np.random.default_rng(s).integers(2) == 1)
    envs = gym.make_vec(ENV_ID, num_envs=2, **{**opts, "tasks": [task, bad]})
    try:
        envs.reset(seed=seed, options={"task_ids": [task.instance_id, task.instance_id]})
        envs.step(("submit", "echo a"))
        obs, rew, term, trunc, info = envs.step(("ignored", "echo b"))
        assert obs["stdout"][1] == "b\n" and rew[1] == 0.0
        assert math.isnan(rew[0]) and trunc[0] and info["reset_failed"][0]
        assert info["rejected"][0] and not info["infra_failed"][0]
        assert info["task_id"][0] == bad.instance_id
        failures = envs.report().failures
        assert failures["rejected"] == 1 and failures["completed"] == 1
    finally:
        envs.close()


@pytest.mark.parametrize("mode", ["nan", "raise"])
def test_a_reset_onto_a_task_that_cannot_run_fails_only_that_sub_env(opts: dict, task: Task, mode: str) -> None:
    """The first reset of a batch with a task that cannot run: that sub-env alone is flagged
    rejected (``"raise"``: raised after the batch, which travels with the error), the other
    starts its episode, and the next step resets the failed one again."""
    bad = task.model_copy(update={"instance_id": "calc__calc-bad", "base_commit": "0" * 40})
    envs = gym.make_vec(ENV_ID, num_envs=2, on_infra_failure=mode, **{**opts, "tasks": [task, bad]})
    try:
        # seed s seeds sub-env 0 with s: pick one whose first draw over [task, bad] is task.
        seed = next(s for s in range(100) if np.random.default_rng(s).integers(2) == 0)
        reset = {"seed": seed, "options": {"task_ids": [bad.instance_id, task.instance_id]}}
        if mode == "raise":
            with pytest.raises(errors.InputError) as raised:
                envs.reset(**reset)
            obs, info = raised.value.reset_results
        else:
            obs, info = envs.reset(**reset)
        assert info["reset_failed"][0] and info["rejected"][0] and not info["_reset_failed"][1]
        assert info["task_id"].tolist() == [bad.instance_id, task.instance_id]
        assert info["_sandbox_id"].tolist() == [False, True] and obs["exit_code"].tolist() == [-1, -1]
        assert envs.report().failures["rejected"] == 1
        obs, rew, term, trunc, info = envs.step(("ignored", "echo b"))
        assert obs["stdout"][1] == "b\n" and rew[1] == 0.0 and not (term[1] or trunc[1])
        assert info["_sandbox_id"][0] and info["task_id"][0] == task.instance_id  # reset again
    finally:
        envs.close()


# -- cleanup -----------------------------------------------------------------------------------

def test_close_deletes_every_sandbox_and_stops_the_thread(opts: dict) -> None:
    envs = gym.make_vec(ENV_ID, num_envs=2, **opts)
    envs.reset(seed=0)
    backend = envs.pool.pool.backend
    pids = [envs.sandbox(i).pid for i in range(2)]
    run_dir = backend._run_dir
    envs.close()
    envs.close()
    assert not any(_alive(p) for p in pids) and not backend._live and not run_dir.exists()
    assert not _loop_threads()


def test_shared_pool_serves_several_envs_and_reports_them_all(opts: dict) -> None:
    shared = BackgroundPool(strategy="reuse", backend_options=opts["backend_options"])
    kw = {k: v for k, v in opts.items() if k != "backend_options"}
    envs = [gym.make(ENV_ID, pool=shared, **kw) for _ in range(2)]
    try:
        for e in envs:
            e.reset(seed=0)
            e.step("submit")
        for e in envs:
            e.close()
        assert shared.report().failures["completed"] == 2
        assert not shared.closed  # the envs did not own it
    finally:
        shared.close()
    assert shared.closed


def test_garbage_collected_env_leaves_no_sandbox(opts: dict) -> None:
    env = SWEEnv(**opts)
    env.reset(seed=0)
    pid = env.sandbox.pid
    run_dir = env.pool.pool.backend._run_dir
    del env
    gc.collect()
    wait_until(lambda: not _alive(pid) and not run_dir.exists(), "the finalizer to delete the sandbox")


def _descendant_with_argv(root: int, argv: list[str]) -> int | None:
    """The pid of a process running ``argv`` under ``root`` (by parent links), if any."""
    want = [a.encode() for a in argv]
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "cmdline").read_bytes().split(b"\0")[:-1] != want:
                continue
            pid = int(d.name)
            while pid > 1:
                if pid == root:
                    return int(d.name)
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # it exited while we looked
            continue
    return None


_STEP = ["sleep", "50"]  # what the interrupted step runs in the sandbox


@pytest.mark.parametrize("how", ["sigint-mid-step", "sigint-as-step-starts", "exit-without-close"])
def test_interrupted_or_unclosed_process_leaves_no_sandbox(opts: dict, how: str) -> None:
    """SIGINT at any point of a step ends the process with KeyboardInterrupt and no sandbox.

    ``sigint-mid-step`` waits for the step's command to be running in the sandbox (its process
    appears under the sandbox's process tree) before the signal; ``sigint-as-step-starts``
    sends it as soon as the env says it is about to step, wherever the process then is.
    """
    code = textwrap.dedent(f"""
        import json, signal, sys, gymnasium as gym, sandpool
        from sandpool.core import Task
        # As at a terminal's Ctrl-C, even when the test runs as a background job (SIGINT ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = gym.make("{ENV_ID}", tasks=[Task.model_validate_json(sys.argv[1])],
                       backend_options={{"images_root": sys.argv[2]}}, step_timeout=60.0)
        env.reset(seed=0)
        u = env.unwrapped
        print(json.dumps({{"pid": u.sandbox.pid, "run_dir": str(u.pool.pool.backend._run_dir)}}), flush=True)
        sys.stdin.readline()  # go on once the test has seen the sandbox alive
        if sys.argv[3].startswith("sigint"):
            env.step({" ".join(_STEP)!r})   # SIGINT arrives here
            print("not interrupted", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, opts["tasks"][0].model_dump_json(),
                             opts["backend_options"]["images_root"], how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    step_pid = None
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        state = json.loads(line)
        assert _alive(state["pid"])
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if how == "sigint-mid-step":
            step_pid = wait_until(
                lambda: proc.poll() is not None or _descendant_with_argv(state["pid"], _STEP),
                "the step's command to run in the sandbox")
            assert proc.poll() is None, proc.communicate()
        if how.startswith("sigint"):
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if how.startswith("sigint"):
        assert "KeyboardInterrupt" in err and proc.returncode != 0, (out, err)
        assert "not interrupted" not in out
    else:
        assert proc.returncode == 0, err
    assert not _alive(state["pid"])
    assert step_pid is None or not _alive(step_pid)
    assert not Path(state["run_dir"]).exists()


# -- backends by name ------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["backend_options", "KUBECONFIG"])
def test_kubernetes_backend_by_name_reports_a_missing_kubeconfig_with_its_path(
        opts: dict, given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = {k: v for k, v in opts.items() if k != "backend_options"}
    missing = "/nonexistent/sandpool-test/kubeconfig"
    if given == "KUBECONFIG":
        monkeypatch.setenv("KUBECONFIG", missing)
        env = gym.make(ENV_ID, backend="kubernetes", **kw)
    else:
        env = gym.make(ENV_ID, backend="kubernetes", backend_options={"kubeconfig": missing}, **kw)
    try:
        with pytest.raises(errors.BackendUnavailable, match=f"{missing} does not exist"):
            env.reset(seed=0)
        assert not _loop_threads()  # the pool that failed to open did not stay open
    finally:
        env.close()


def test_unknown_backend_option_is_named_at_make(opts: dict) -> None:
    kw = {k: v for k, v in opts.items() if k != "backend_options"}
    with pytest.raises(errors.ConfigError, match="kubeconfg.*KubernetesBackend"):
        gym.make(ENV_ID, backend="kubernetes", backend_options={"kubeconfg": "x"}, **kw)
    with pytest.raises(errors.ConfigError, match="'docker' is not known.*'local', 'kubernetes'"):
        gym.make(ENV_ID, backend="docker", **kw)
