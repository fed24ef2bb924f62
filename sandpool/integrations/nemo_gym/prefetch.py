"""Lookahead for NeMo Gym: the next batch's sandboxes warm while the current batch runs.

NeMo Gym itself has no notion of a next batch; what drives it (a trainer's data loader, a
rollout-collection loop) knows the rows it will send next. It calls :func:`prefetch` with
them and ``num_repeats`` (a GRPO group's size), through NeMo Gym's own ``ServerClient``; the
resources server's ``POST /prefetch`` runs :func:`prefetch_tasks`, which hydrates their
images and raises their warm targets (:meth:`SandboxPool.prefetch
<sandpool.core.pool.SandboxPool.prefetch>`: within ``max_live``; the targets the last
prefetch raised go back) and returns without waiting for the sandboxes. Their
``/seed_session`` calls then claim warm sandboxes.

A row listed twice counts twice: NeMo Gym's expanded rows (each repeated ``num_repeats``
times) are sent with ``num_repeats=1``, its unexpanded ones with ``num_repeats``. An id that
is not in the task source, or whose image is missing, is reported under ``rejected``; the
rest of the batch is prefetched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandpool.core import errors
from sandpool.core.pool import SandboxPool
from sandpool.core.task import Task

__all__ = ["PrefetchOutcome", "prefetch", "prefetch_tasks"]


@dataclass
class PrefetchOutcome:
    """What a prefetch started.

    Attributes:
        warm_targets: The warm target of each image of the batch, in sandboxes.
        rejected: Instance id -> why it was left out (unknown id, missing image).
    """

    warm_targets: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


async def prefetch_tasks(pool: SandboxPool, lookup: Callable[[str], Task], instance_ids: Iterable[str],
                         *, num_repeats: int, concurrency: int) -> PrefetchOutcome:
    """Hydrate and warm the images of the tasks ``instance_ids`` name, for ``num_repeats``
    sessions of each at once.

    Args:
        pool: The server's open pool.
        lookup: Instance id -> its task; raises ``InputError`` for an unknown id.
        instance_ids: The next batch's ids (an id listed twice counts twice).
        num_repeats: Sessions each listed id will have at once.
        concurrency: Sessions running now (sizes a ``max_live`` the config left unset).

    Returns:
        The warm targets set, and the ids left out with why.

    Raises:
        SandpoolError: The pool cannot run sandboxes (closed, backend gone); nothing is
            rejected for that.
    """
    tasks: list[Task] = []
    out = PrefetchOutcome()
    for iid in instance_ids:
        if iid in out.rejected:
            continue
        try:
            task = lookup(iid)
            await pool.hydrate(task.image)
        except errors.InputError as exc:  # one bad row never stops the batch
            out.rejected[iid] = str(exc)
            continue
        tasks.append(task)
    out.warm_targets = await pool.prefetch(tasks, rollouts_per_task=num_repeats,
                                           concurrency=concurrency)
    return out


async def prefetch(client: Any, server_name: str, rows: Iterable[Mapping[str, Any] | str], *,
                   num_repeats: int = 1) -> dict[str, Any]:
    """Ask the ``sandpool_swe`` server ``server_name`` to warm the next batch (``POST /prefetch``).

    Usage::

        from nemo_gym.server_utils import ServerClient
        from sandpool.integrations.nemo_gym.prefetch import prefetch

        await prefetch(server_client, "sandpool_swe_resources_server", next_rows, num_repeats=4)

    Args:
        client: NeMo Gym's ``ServerClient`` (``nemo_gym.server_utils``).
        server_name: The resources server instance's name in the NeMo Gym config.
        rows: The next batch: dataset rows (each with ``instance_id``) or instance ids.
        num_repeats: Sessions each row will have at once (1 for rows already expanded).

    Returns:
        The server's answer: ``warm_targets`` (image -> sandboxes) and ``rejected``
        (instance id -> why it was left out).

    Raises:
        ConfigError: A row has no ``instance_id`` (names the row's index).
        aiohttp.ClientResponseError: The server answered an error (``503``: its pool cannot
            run sandboxes).
    """
    from nemo_gym.server_utils import raise_for_status

    ids = []
    for i, row in enumerate(rows):
        iid = row if isinstance(row, str) else row.get("instance_id")
        if not isinstance(iid, str) or not iid:
            raise errors.ConfigError(f"rows[{i}] has no instance_id; give dataset rows of the "
                                     "sandpool_swe server, or their instance ids")
        ids.append(iid)
    res = await client.post(server_name=server_name, url_path="/prefetch",
                            json={"instance_ids": ids, "num_repeats": num_repeats})
    await raise_for_status(res)
    return await res.json()
