"""Strategies: how many warm sandboxes each image gets, and whether sandboxes are reused.

``cold``  creates a sandbox per rollout and deletes it after (the plain Kubernetes baseline);
``warm``  keeps a warm pool per image and gives every rollout a fresh sandbox;
``reuse`` keeps a warm pool and resets sandboxes in place between rollouts.

A strategy is pure arithmetic over counts; the pool does the I/O. Third-party strategies
subclass :class:`Strategy` and pass an instance to ``SandboxPool``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping

from sandpool.core.errors import ConfigError

__all__ = ["Cold", "Reuse", "Strategy", "Warm", "get_strategy"]


class Strategy(abc.ABC):
    """Decides warm-pool targets and reuse.

    Attributes:
        name: Name used in reports.
        reuse: Whether a released sandbox is reset in place and kept.
    """

    name: str = "strategy"
    reuse: bool = False

    def plan(self, demand: Mapping[str, int], concurrency: int) -> dict[str, int]:
        """Split ``concurrency`` slots across images in proportion to their rollouts.

        Args:
            demand: Rollouts per image.
            concurrency: Rollouts that run at once.

        Returns:
            Slots per image; every image with demand gets at least one (largest-remainder
            rounding), so the total exceeds ``concurrency`` only when there are more images.
        """
        images = {k: v for k, v in demand.items() if v > 0}
        if not images:
            return {}
        total = sum(images.values())
        budget = max(concurrency, len(images))
        exact = {k: budget * v / total for k, v in images.items()}
        slots = {k: max(1, math.floor(x)) for k, x in exact.items()}
        order = sorted(images, key=lambda k: exact[k] - math.floor(exact[k]), reverse=True)
        i = 0
        while sum(slots.values()) < budget and order:
            slots[order[i % len(order)]] += 1
            i += 1
        while sum(slots.values()) > budget:
            k = max(slots, key=lambda k: slots[k] - exact[k])
            if slots[k] == 1:
                break
            slots[k] -= 1
        return {k: min(slots[k], images[k]) for k in slots}

    def max_live(self, concurrency: int) -> int:
        """Default cap on live sandboxes for ``concurrency`` rollouts at once."""
        return concurrency

    @abc.abstractmethod
    def deficit(self, *, target: int, idle: int, creating: int, leased: int, resetting: int) -> int:
        """How many sandboxes of one image to start now to keep its warm pool at ``target``.

        Creations for waiting claims are decided by the pool, not here.
        """


class Cold(Strategy):
    """No warm pool, no reuse: create per rollout, delete after."""

    name = "cold"

    def deficit(self, *, target: int, idle: int, creating: int, leased: int, resetting: int) -> int:
        return 0


class Warm(Strategy):
    """A warm pool of ``target`` idle sandboxes per image; a fresh sandbox per rollout."""

    name = "warm"

    def max_live(self, concurrency: int) -> int:
        # Leased sandboxes plus a full idle pool behind them.
        return 2 * concurrency

    def deficit(self, *, target: int, idle: int, creating: int, leased: int, resetting: int) -> int:
        return max(0, target - idle - creating)


class Reuse(Strategy):
    """A warm pool of ``target`` sandboxes per image, reset in place and reused."""

    name = "reuse"
    reuse = True

    def max_live(self, concurrency: int) -> int:
        # Headroom beyond one sandbox per lane: a quarantined sandbox holds its room until
        # its delete returns, and its replacement starts at once (a warm fill, while the
        # rest of the batch runs) instead of when the image's next claim asks.
        return concurrency + max(2, math.ceil(concurrency * 0.05))

    def deficit(self, *, target: int, idle: int, creating: int, leased: int, resetting: int) -> int:
        return max(0, target - idle - creating - leased - resetting)


_BY_NAME: dict[str, type[Strategy]] = {"cold": Cold, "warm": Warm, "reuse": Reuse}


def get_strategy(strategy: str | Strategy) -> Strategy:
    """Return a strategy instance for a name (``cold``, ``warm``, ``reuse``) or instance.

    Raises:
        ConfigError: Unknown name.
    """
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return _BY_NAME[strategy]()
    except KeyError:
        raise ConfigError(
            f"strategy={strategy!r} is not known; use one of {sorted(_BY_NAME)} or a Strategy instance"
        ) from None
