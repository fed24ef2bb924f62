"""A checkpointed episode on real sandboxes: killed from the host in the middle of a step, it
goes on in a sandbox restored from the step before, and that step runs again there."""

from __future__ import annotations

import asyncio

from sandpool.core import PoolLimits, SandboxPool, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.core.metrics import Outcome

from .waiting import until

# Step 3 says it started, then waits for the host's go (a file in its /tmp).
_STEP3 = "echo 3 >> steps.txt && touch /tmp/started && until [ -e /tmp/go ]; do sleep 0.01; done && echo step-3-done"


async def test_an_episode_killed_mid_step_goes_on_from_its_last_checkpoint(test_images_root, calc_task):
    backend = LocalBackend(test_images_root)
    async with SandboxPool(backend, "reuse", PoolLimits(max_live=4)) as pool:
        killed, seen = [], []

        async def host(lease) -> None:
            first = lease.sandbox
            await until(lambda: (first.tmp_host() / "started").exists(), "step 3 started")
            backend.kill(first)  # the node dies under the step in flight
            killed.append(first.id)
            await until(lambda: lease.sandbox is not first, "the episode's new sandbox")
            second = lease.sandbox
            await until(lambda: (second.tmp_host() / "started").exists(), "step 3 started again")
            (second.tmp_host() / "go").touch()

        async def episode(lease) -> float:
            assert (await lease.exec("echo 1 >> steps.txt && echo one > /tmp/kept")).ok
            assert (await lease.exec("echo 2 >> steps.txt && git rm -q test_calc.py")).ok
            watcher = asyncio.create_task(host(lease))
            res = await lease.exec(_STEP3, timeout=120)
            await watcher
            assert res.text == "step-3-done\n"
            state = await lease.exec("cat steps.txt /tmp/kept; git status --porcelain")
            seen.append(state.text)
            return 1.0

        result = await run_rollout(pool, calc_task, episode, checkpoint="step")
        assert (result.outcome, result.reward, result.recoveries) == (Outcome.COMPLETED, 1.0, 1)
        assert killed and result.sandbox_id != killed[0]
        # Steps 1 and 2 kept (repo and /tmp), step 3 once: its first run went with its sandbox.
        assert seen == ["1\n2\n3\none\nD  test_calc.py\n?? steps.txt\n"]
        assert pool.counters.recoveries == 1 and pool.counters.quarantines == 0
        assert pool.counters.infra_errors.get("sandbox_died") == 1
