"""Waiting for an event in tests, never for a fixed time (CI machines run loaded).

A test that needs something to have happened waits for the observable sign of it (a counter,
a file, a process, a line) with a deadline far beyond any plausible delay: on an idle machine
it returns as soon as the event occurs, on a loaded one it still waits long enough, and a
condition that never comes true fails with ``what`` in the message instead of hanging.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["DEADLINE_S", "until", "wait_until"]

T = TypeVar("T")

#: Seconds before a wait gives up: far beyond any delay of a correct run, even under load.
DEADLINE_S = 60.0


def wait_until(check: Callable[[], T], what: str, timeout: float = DEADLINE_S,
               interval: float = 0.02) -> T:
    """Call ``check`` until it returns something truthy; return that value.

    Raises:
        AssertionError: ``timeout`` seconds passed first (the message names ``what``).
    """
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
    return value


async def until(check: Callable[[], T], what: str, timeout: float = DEADLINE_S,
                interval: float = 0.005) -> T:
    """Async :func:`wait_until`: yields to the event loop between checks, so the code under
    test (on the same loop) makes progress."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
    return value
