"""The next batch warmed ahead: NeMo Gym's side calls ``/prefetch`` with its rows and
``num_repeats``, and that batch's seeds claim warm sandboxes, within ``max_live``.

The server runs in this process (``serving``) with a cap of 4 over 3 images, so the test
can watch every sandbox the pool holds, those being deleted too; the calls go over HTTP
through NeMo Gym's own ``ServerClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import ClientResponseError

from nemo_gym.server_utils import (
    GlobalAIOHTTPAsyncClientConfig,
    is_global_aiohttp_client_setup,
    set_global_aiohttp_client,
)
from sandpool.core import errors
from sandpool.core.task import Task
from sandpool.integrations.nemo_gym.prefetch import prefetch
from tests.nemo_gym.conftest import MAIN, SimpleAgentEpisode, row_for, serving
from tests.waiting import until

MAX_LIVE = 4


@pytest.fixture(scope="module")
async def capped(pool_block: dict[str, Any], tmp_path_factory) -> AsyncIterator[tuple]:
    """A server whose pool holds at most :data:`MAX_LIVE` sandboxes (3 warm at startup)."""
    if not is_global_aiohttp_client_setup():
        set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    async with serving(pool_block | {"concurrency": 1, "max_live": MAX_LIVE},
                       tmp_path_factory.mktemp("prefetch")) as both:
        yield both


@contextlib.asynccontextmanager
async def peak_live(server) -> AsyncIterator[list[int]]:
    """Sample how many sandboxes the pool holds (being deleted too); yields ``[peak]``."""
    peak = [0]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], server.pool._entries.live)
            await asyncio.sleep(0.005)

    sampler = asyncio.get_running_loop().create_task(sample())
    try:
        yield peak
    finally:
        sampler.cancel()


async def run_group(client, task: Task, n: int) -> list[dict]:
    """``n`` sessions of ``task`` at once (a GRPO group): seed, look, verify (reward 0)."""
    eps = [SimpleAgentEpisode(client, MAIN, row_for(task)) for _ in range(n)]
    seeded = await asyncio.gather(*(ep.seed() for ep in eps))
    for ep in eps:
        status, body = await ep.tool("shell", command="git status --porcelain")
        assert status == 200 and body["stdout"] == "", body
    assert [r["reward"] for r in await asyncio.gather(*(ep.verify() for ep in eps))] == [0.0] * n
    return seeded


async def test_a_prefetched_group_is_seeded_warm(capped, pack_tasks: list[Task]) -> None:
    server, client = capped
    a = pack_tasks[0]
    await server.pool.wait_warm(120)
    async with peak_live(server) as peak:
        answer = await prefetch(client, MAIN, [row_for(a)], num_repeats=2)
        assert answer == {"warm_targets": {a.image: 2}, "rejected": {}}
        await until(lambda: server.pool.sizes()[a.image]["idle"] == 2, "the group's sandboxes warm",
                    timeout=120)
        hits = server.pool.counters.warm_hits
        seeded = await run_group(client, a, 2)
        assert server.pool.counters.warm_hits == hits + 2  # both seeds found a warm sandbox
        assert len({s["sandbox_id"] for s in seeded}) == 2
    assert peak[0] <= MAX_LIVE


async def test_the_next_batch_takes_the_last_ones_room_and_a_bad_id_stops_nothing(
        capped, pack_tasks: list[Task]) -> None:
    server, client = capped
    a, b = pack_tasks[0], pack_tasks[1]
    await run_group(client, a, 2)  # a holds 2 idle sandboxes, one past its startup target
    async with peak_live(server) as peak:
        answer = await prefetch(client, MAIN, ["no-such-task", row_for(b)], num_repeats=3)
        assert answer["warm_targets"] == {b.image: 3}
        assert "no-such-task" in answer["rejected"]["no-such-task"]
        # The cap leaves b one sandbox short of 3: a's second one is evicted for it (a's
        # startup target keeps its first, and the third image's), never beside it.
        await until(lambda: server.pool.sizes()[b.image]["idle"] == 2, "b warm", timeout=120)
        await until(lambda: server.pool.sizes()[a.image]["idle"] == 1, "a's extra evicted", timeout=60)
        res = await client.get(server_name=MAIN, url_path="/pool_status")
        status = await res.json()
        assert status["max_live"] == MAX_LIVE and status["sandboxes"][b.image]["idle"] == 2
        hits = server.pool.counters.warm_hits
        await run_group(client, b, 2)
        assert server.pool.counters.warm_hits == hits + 2
    assert peak[0] <= MAX_LIVE


async def test_a_malformed_prefetch_is_refused_naming_the_field(capped) -> None:
    _, client = capped
    res = await client.post(server_name=MAIN, url_path="/prefetch", json={"num_repeats": 0})
    assert res.status == 422
    text = await res.text()
    assert "instance_ids" in text and "num_repeats" in text
    with pytest.raises(errors.ConfigError, match=r"rows\[1\] has no instance_id"):
        await prefetch(client, MAIN, ["x", {"responses_create_params": {}}])


async def test_a_prefetch_on_a_stopped_server_is_unavailable(pool_block, tmp_path_factory,
                                                             pack_tasks: list[Task]) -> None:
    async with serving(pool_block | {"concurrency": 1, "prepare": False},
                       tmp_path_factory.mktemp("stopped")) as (server, client):
        await server.stop()
        with pytest.raises(ClientResponseError) as info:
            await prefetch(client, MAIN, [row_for(pack_tasks[0])])
        assert info.value.status == 503
