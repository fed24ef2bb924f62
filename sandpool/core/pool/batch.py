"""A batch's claims announced up front: warm pools a backend holds, sized to them.

With ``SandboxPool.prepare(tasks, ..., rollouts_per_task=k, exact=True)`` the caller says
each task gets exactly ``k`` claims in this batch. Where the backend holds an image's warm
sandboxes itself (agent-sandbox's SandboxWarmPool: ``Backend.set_warm_target`` returns 0)
and a claim takes one for good (a strategy that does not reuse), :class:`Batch` sizes that
warm pool to the image's claims still to come and lowers it by one after each claim of the
image. So every claim of the batch finds a warm sandbox made (and, with presessions,
exec-ready) before the batch, and the backend's warm pool does not refill a sandbox no claim
of the batch will take. A warm pool lowered after the controller already started a refill
deletes that refill (agent-sandbox deletes the newest not-yet-Ready member first); a
controller started with a refill delay (``--sandbox-warm-pool-replenish-delay``) never
starts it. Claims past the announced ones start cold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from sandpool.core import errors
from sandpool.core.base import Backend

__all__ = ["Batch"]

log = logging.getLogger("sandpool.pool")


class Batch:
    """The announced claims of the images whose warm pool the backend holds.

    Args:
        backend: The pool's backend.
        spawn: Runs a coroutine as one of the pool's tasks (waited for on close).
    """

    def __init__(self, backend: Backend,
                 spawn: Callable[[Coroutine[Any, Any, None]], object]) -> None:
        self.backend = backend
        self.spawn = spawn
        self.left: dict[str, int] = {}  # image -> its announced claims still to come
        self._locks: dict[str, asyncio.Lock] = {}

    async def size(self, image: str, claims: int | None, warm: int, *, reuse: bool) -> int:
        """Apply the warm target of ``image``, the strategy's own being ``warm``, for a batch
        of ``claims`` claims (None: no batch, a standing warm pool refilled after every
        claim); return how many the pool keeps itself (as :meth:`Backend.set_warm_target`).

        A backend that holds the warm pool gets ``claims`` and the image is followed
        (:meth:`claimed`); one that leaves it to the pool gets ``warm`` as without a batch.
        """
        self.left.pop(image, None)
        if claims is None or reuse or not warm or claims <= warm:
            kept = await self.backend.set_warm_target(image, warm, reuse=reuse)
            if claims is not None and not kept and warm and not reuse:
                self.left[image] = claims
            return kept
        if await self.backend.set_warm_target(image, claims, reuse=False):
            return await self.backend.set_warm_target(image, warm, reuse=False)  # the pool's
        self.left[image] = claims
        return 0

    def claimed(self, image: str) -> None:
        """A claim of ``image`` was served: lower its warm pool to the claims still to come
        (in the background: never on the claim path)."""
        left = self.left.get(image)
        if left is None:
            return
        self.left[image] = max(0, left - 1)
        self.spawn(self._lower(image))

    async def _lower(self, image: str) -> None:
        async with self._locks.setdefault(image, asyncio.Lock()):  # the newest count goes last
            try:
                await self.backend.set_warm_target(image, self.left[image], reuse=False)
            except errors.SandpoolError as exc:  # only leaves spare warm sandboxes
                log.warning("lowering the warm pool of %s to %d failed: %s", image,
                            self.left[image], exc)
