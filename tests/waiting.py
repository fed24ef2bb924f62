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
from typing import Any, TypeVar

__all__ = ["DEADLINE_S", "exec_past_marker", "until", "wait_until"]

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


async def exec_past_marker(sandbox: Any, cmd: str, marker: str, first: float = 1.0,
                           limit: float = DEADLINE_S) -> Any:
    """Run ``cmd`` (it prints ``marker``, then runs past any timeout) under a server-side
    timeout, until one attempt's output holds ``marker``: the timeout then came after the
    command reached it. It starts at ``first`` seconds and doubles while the timeout came
    first (a loaded machine); each attempt's timeout kills what it started. Returns that
    attempt's ``ExecResult``.

    Raises:
        AssertionError: Timeouts up to ``limit`` seconds never saw ``marker``.
    """
    timeout = first
    while marker not in (res := await sandbox.exec(cmd, timeout=timeout)).text:
        if timeout >= limit:
            raise AssertionError(f"{cmd!r} never printed {marker!r} before a {timeout:.0f} s timeout")
        timeout *= 2
    return res
