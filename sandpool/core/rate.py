"""A cluster's write rate that adapts to its answers: a token bucket and a window of writes
in flight, both under AIMD control.

A fixed token bucket keeps sending at the same rate to a cluster that answers 429 or slows
down, so every request beyond its budget is rejected and retried. :class:`AdaptiveRate` is
the bucket of one cluster (one API server), and its rate moves as TCP's congestion window
does (additive increase, multiplicative decrease):

* a 429, a 5xx, a refused connection or an answer slower than ``slow_s`` multiplies the rate
  by ``decrease``, down to ``min_rate``, and empties the bucket, whose size shrinks with the
  rate: no burst follows a back-off. It also caps the writes in flight at ``decrease`` times
  those in flight then (at least one): API Priority and Fairness rejects by seats (requests
  executing at once), not by rate, and a rate alone lets a slow patch of answers pile up
  more writes in flight than the server seats. Only answers to requests sent after the last
  back-off count (as TCP reacts once per window): the rejections of one burst are one
  event, and a rejection of a request sent at the lowered rate lowers it again at once;
* a ``Retry-After`` also holds the whole bucket until it has passed (the server said when it
  will have room; new requests sent before then would be rejected too);
* every answer faster than ``slow_s`` (to a request sent after the last back-off) adds
  ``increase`` per second since the last change, up to the configured ``rate``, and one
  write in flight per window of answers (TCP's congestion avoidance), the cap lifted at
  ``burst``: a cluster that answers quickly gets its full rate back.

The decisions are plain methods that take the time (``now``, seconds), so the discrete-event
model of a burst (:mod:`sandpool.bench.simulate`) runs this same controller on its own clock.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from pydantic import BaseModel

from sandpool.core import errors

__all__ = ["AdaptiveRate", "RateControl", "RateTrace"]


@dataclass(frozen=True)
class RateControl:
    """How a cluster's write rate adapts (see the module docstring).

    Usage: ``RateControl(rate=50, burst=100)``; ``RateControl(50, 100, adaptive=False)`` is a
    fixed token bucket.

    Attributes:
        rate: Writes per second at the start, and the most the rate climbs back to.
        burst: Writes allowed back to back at ``rate`` (the bucket's size; it shrinks in
            proportion to the rate).
        adaptive: False keeps ``rate`` whatever the cluster answers.
        min_rate: The lowest rate a back-off goes to, writes per second.
        decrease: Factor applied to the rate on a back-off (0 < decrease < 1).
        increase: Writes per second added per second of fast answers (None: ``rate / 50``
            but at least 1, so a halved rate is whole again after about 25 s).
        slow_s: An answer taking longer than this many seconds is a slow one (a back-off).
    """

    rate: float = 50.0
    burst: int = 100
    adaptive: bool = True
    min_rate: float = 0.5
    decrease: float = 0.5
    increase: float | None = None
    slow_s: float = 1.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise errors.ConfigError(f"rate={self.rate}, burst={self.burst}: the write rate "
                                     "must be positive and the burst at least 1")
        if not 0 < self.min_rate <= self.rate:
            raise errors.ConfigError(f"min_rate={self.min_rate} must be in (0, rate={self.rate}]")
        if not 0 < self.decrease < 1:
            raise errors.ConfigError(f"decrease={self.decrease} must be in (0, 1)")
        if self.slow_s <= 0 or (self.increase or 1) <= 0:
            raise errors.ConfigError(f"slow_s={self.slow_s}, increase={self.increase}: both "
                                     "must be positive")


class RateTrace(BaseModel):
    """A cluster's write rate over a run, for the report.

    Attributes:
        cluster: The cluster's name.
        adaptive: Whether the rate adapted (False: a fixed bucket).
        points: ``(seconds since the bucket was made, writes per second)`` at each change
            (increases at most one point a second).
        back_offs: Back-offs by cause (``429``, ``5xx``, ``connection``, ``slow``).
        min_rate: The lowest rate reached.
        final_rate: The rate at the end.
        min_window: The lowest cap on writes in flight (None: never capped).
    """

    cluster: str
    adaptive: bool
    points: list[tuple[float, float]]
    back_offs: dict[str, int]
    min_rate: float
    final_rate: float
    min_window: int | None = None

    def describe(self) -> str:
        """One line: the range of the rate and its back-offs."""
        causes = ", ".join(f"{k} x{v}" for k, v in sorted(self.back_offs.items()))
        start = self.points[0][1] if self.points else self.final_rate
        window = "" if self.min_window is None else f" ({self.min_window} in flight)"
        return (f"{self.cluster}: {start:.3g}/s, lowest {self.min_rate:.3g}/s{window}, now "
                f"{self.final_rate:.3g}/s" + (f"; back-offs {causes}" if causes else "")
                + ("" if self.adaptive else " (fixed)"))


class AdaptiveRate:
    """The write bucket of one cluster, its rate under AIMD control.

    Usage::

        rate = AdaptiveRate(RateControl(50, 100), cluster="east")
        await rate.acquire()                      # one write token and a place in flight
        ...                                       # send the write
        rate.answered(loop.time(), status, seconds, retry_after=...)  # what the cluster said
        rate.release()                            # the write is no longer in flight

    Args:
        control: The rate and how it adapts.
        cluster: The cluster's name (reports and metrics).
        now: The clock's time at creation (default: the running loop's, else 0).
    """

    def __init__(self, control: RateControl, *, cluster: str = "", now: float | None = None
                 ) -> None:
        self.control = control
        self.cluster = cluster
        self.rate = control.rate
        self._increase = control.increase or max(1.0, control.rate / 50)
        self._t0 = self._t = _now() if now is None else now
        self.tokens = float(control.burst)
        self.hold_until = self._t0  #: no token is handed out before this time (Retry-After)
        self.window = math.inf  #: cap on writes in flight (none until a back-off)
        self.inflight = 0  #: writes acquired and not released
        self.lowest_window = math.inf
        self._last_back_off = self._last_change = -float("inf")
        self._last_point = self._t0
        self.lowest = self.rate
        self.points: list[tuple[float, float]] = [(0.0, self.rate)]
        self.back_offs: dict[str, int] = {}
        self._fifo = asyncio.Lock()
        self._room = asyncio.Event()

    def __repr__(self) -> str:
        return (f"<AdaptiveRate {self.cluster or '-'} {self.rate:.3g}/s tokens={self.tokens:.1f}"
                f" inflight={self.inflight}/{self.window:.3g}"
                f" back-offs={sum(self.back_offs.values())}>")

    @property
    def capacity(self) -> float:
        """The bucket's size now: ``burst`` at the configured rate, in proportion below it."""
        c = self.control
        return max(1.0, c.burst * self.rate / c.rate)

    # -- the bucket ------------------------------------------------------------------------

    def take(self, now: float) -> float:
        """Take one token and a place in flight at ``now`` if both are free (returns 0.0;
        :meth:`release` the place once answered); else take nothing and return the seconds
        until a token is due, or ``math.inf`` while the window is full (until a release)."""
        if self.window < math.inf and self.inflight >= max(1, int(self.window)):
            return math.inf
        if now < self.hold_until:
            return self.hold_until - now + 1.0 / self.rate
        self._refill(now)
        if self.tokens >= 1.0 - 1e-9:  # rounding must not leave a waiter a token short forever
            self.tokens = max(0.0, self.tokens - 1.0)
            self.inflight += 1
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def release(self) -> None:
        """A write taken with :meth:`take` or :meth:`acquire` is no longer in flight."""
        self.inflight -= 1
        self._room.set()

    def _refill(self, now: float) -> None:
        since = max(self._t, self.hold_until)
        if now > since:
            self.tokens = min(self.capacity, self.tokens + (now - since) * self.rate)
        self._t = max(self._t, now)

    async def acquire(self) -> None:
        """Wait for one token and a place in flight, first come first served; the wait
        follows changes made while it lasts (a back-off slows the writes already waiting
        too). :meth:`release` the place once the write is answered."""
        async with self._fifo:
            while (wait := self.take(_now())) > 0:
                if wait == math.inf:
                    self._room.clear()
                    await self._room.wait()
                else:
                    await asyncio.sleep(wait)

    # -- the controller --------------------------------------------------------------------

    def answered(self, now: float, status: int | None, seconds: float, *,
                 retry_after: float | None = None) -> None:
        """Take one answer of the cluster into account.

        Args:
            now: The time of the answer.
            status: The HTTP status, or None for a connection error (refused, reset).
            seconds: How long the request took (it was sent at ``now - seconds``).
            retry_after: The answer's ``Retry-After``, in seconds, if any.
        """
        if not self.control.adaptive:
            return
        if retry_after is not None and retry_after > 0:
            self._refill(now)
            self.hold_until = max(self.hold_until, now + retry_after)
        if now - seconds < self._last_back_off:
            return  # sent before the last back-off: it says nothing of the rate since
        if status is None:
            self.back_off(now, "connection")
        elif status == 429:
            self.back_off(now, "429")
        elif status >= 500:
            self.back_off(now, "5xx")
        elif seconds > self.control.slow_s:
            self.back_off(now, "slow")
        else:
            self._recover(now)

    def back_off(self, now: float, cause: str) -> None:
        """Multiply the rate by ``decrease`` (not below ``min_rate``) for ``cause``, counted,
        and empty the bucket."""
        c = self.control
        if not c.adaptive:
            return
        self._refill(now)
        self._last_back_off = now
        self.back_offs[cause] = self.back_offs.get(cause, 0) + 1
        self._set(now, max(c.min_rate, self.rate * c.decrease), point=True)
        self.tokens = 0.0  # the cluster just said no: no burst follows
        self.window = max(1.0, min(self.window, self.inflight) * c.decrease)
        self.lowest_window = min(self.lowest_window, self.window)

    def _recover(self, now: float) -> None:
        c = self.control
        if self.window < math.inf:
            self.window += 1.0 / self.window
            if self.window >= c.burst:
                self.window = math.inf
        if self.rate >= c.rate:
            return
        self._refill(now)
        rate = min(c.rate, self.rate + self._increase * max(0.0, now - self._last_change))
        self._set(now, rate, point=now - self._last_point >= 1.0 or rate >= c.rate)

    def _set(self, now: float, rate: float, *, point: bool) -> None:
        self.rate = rate
        self._last_change = now
        self.lowest = min(self.lowest, rate)
        if point:
            self.points.append((now - self._t0, rate))
            self._last_point = now

    def trace(self) -> RateTrace:
        """The rate over time so far (for the report)."""
        return RateTrace(cluster=self.cluster, adaptive=self.control.adaptive,
                         points=list(self.points), back_offs=dict(self.back_offs),
                         min_rate=self.lowest, final_rate=self.rate,
                         min_window=(None if self.lowest_window == math.inf
                                     else math.floor(self.lowest_window)))


def _now() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return 0.0
