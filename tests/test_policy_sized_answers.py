"""An agent's answer the policy sizes (a file it made, then read) is its result, never infra.

A read carries the whole file through the agent's channel: past the host's frame cap, or the
agent's memory, it would end the channel, an infra failure that a checkpointed rollout
recovers from and re-runs until it ends ``infra_failed``, unscored, instead of 0.
"""

from __future__ import annotations

import errno

import pytest

from sandpool.core import Outcome, PoolLimits, SandboxPool, errors, run_rollout
from sandpool.core.agent.client import MAX_OUTPUT, READ_MAX
from sandpool.core.backends.local import LocalBackend

from .conftest import CALC_IMAGE


async def test_a_read_up_to_the_cap_returns_the_file_and_past_it_is_efbig(local_backend):
    sb = await local_backend.create(CALC_IMAGE)
    assert (await sb.exec(f"head -c {READ_MAX} /dev/zero > /tmp/at; head -c {READ_MAX + 1} /dev/zero > /tmp/past;"
                          " truncate -s 1T /tmp/sparse")).ok
    assert len(await sb.read_file("/tmp/at")) == READ_MAX
    for path in ("/tmp/past", "/tmp/sparse"):
        with pytest.raises(errors.SandboxFileError) as info:
            await sb.read_file(path)
        assert info.value.errno == errno.EFBIG and info.value.filename == path
    assert sb.alive() and (await sb.exec("echo ok")).text == "ok\n"


@pytest.mark.parametrize("checkpoint", [None, "step"])
async def test_a_policy_reading_a_file_it_made_huge_is_scored_not_recovered(test_images_root, calc_task,
                                                                             checkpoint):
    async def episode(lease) -> float:
        assert (await lease.exec("head -c 200M /dev/zero > /tmp/big")).ok
        await lease.read_file("/tmp/big")  # unhandled: the policy's own error
        return 1.0

    async with SandboxPool(LocalBackend(test_images_root), "reuse", PoolLimits(max_live=2)) as pool:
        result = await run_rollout(pool, calc_task, episode, checkpoint=checkpoint)
        assert (result.outcome, result.reward, result.attempts, result.recoveries) == (
            Outcome.TASK_FAILED, 0.0, 1, 0), result.error
        assert result.error_kind == "file_error" and "EFBIG" in (result.error or "")
        assert pool.counters.infra_errors == {} and pool.counters.recoveries == 0


async def test_output_past_any_cap_the_caller_asks_is_cut_not_a_broken_channel(local_backend):
    # The caller allows 300 MiB a stream; the policy prints 170 MiB on each (base64: past
    # what one answer could carry).
    sb = await local_backend.create(CALC_IMAGE)
    res = await sb.exec("head -c 170M /dev/zero; head -c 170M /dev/zero >&2", max_output=300 << 20,
                        timeout=120)
    assert res.exit_code == 0 and res.stdout_truncated and res.stderr_truncated
    assert len(res.stdout) == len(res.stderr) == MAX_OUTPUT
    assert sb.alive() and (await sb.exec("echo ok")).text == "ok\n"
