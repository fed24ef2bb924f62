"""What a pool may ask of its backend (:class:`PoolLimits`) and the pool's lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["PoolLimits", "PoolState"]


@dataclass(frozen=True)
class PoolLimits:
    """Limits on what a pool asks of its backend.

    Usage: ``PoolLimits(max_live=16, create_rate=5.0, create_burst=10)``.

    Attributes:
        max_live: Cap on sandboxes alive at once (creating, idle, leased, resetting, and
            being deleted: a sandbox holds its resources until its delete returns).
            ``None`` takes the strategy's default for the prepared concurrency.
        create_rate: Sandbox creations per second, sustained (token bucket refill).
        create_burst: Creations allowed back to back (token bucket size).
        claim_timeout: Seconds a claim may wait for a sandbox before ``InfraTimeout``.
        reset_timeout: Seconds an in-place reset (and its verification) may take.
        create_timeout: Seconds one creation may take before ``SandboxStartError``.
    """

    max_live: int | None = None
    create_rate: float = 20.0
    create_burst: int = 20
    claim_timeout: float = 300.0
    reset_timeout: float = 60.0
    create_timeout: float = 120.0


class PoolState(enum.Enum):
    """Lifecycle of a pool."""

    UNOPENED = "unopened"
    OPEN = "open"
    CLOSED = "closed"
