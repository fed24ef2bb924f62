"""Client-side bounds on one cluster's API traffic, and the wait before a retry.

:class:`Throttle` holds the write bucket (an :class:`~sandpool.core.rate.AdaptiveRate`, whose
rate follows the cluster's answers) and the in-flight cap that every REST request of
:class:`~._http.KubeHttp` passes; :func:`backoff_delay` and :func:`parse_retry_after` say how
long to wait before retrying a request the cluster turned away or lost. Nothing here sends a
request: :mod:`._http` does, and tells the bucket how each was answered.
"""

from __future__ import annotations

import asyncio
import random

from sandpool.core import errors
from sandpool.core.rate import AdaptiveRate, RateControl

__all__ = ["Throttle", "backoff_delay", "parse_retry_after"]


def parse_retry_after(value: str | None, *, cap: float = 30.0) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds form), capped; else None."""
    if not value:
        return None
    try:
        return min(cap, max(0.0, float(value.strip())))
    except ValueError:
        return None  # the HTTP-date form is not sent by kube-apiserver


def backoff_delay(
    attempt: int, *, base: float = 0.1, cap: float = 5.0, retry_after: float | None = None
) -> float:
    """Delay in seconds before retry ``attempt`` (1-based): ``Retry-After`` if given, plus up
    to half of it again as jitter (APF gives every request it rejects in a moment the same
    ``Retry-After``: waiting exactly that long brings them all back at once, to be rejected
    again), else ``base * 2**(attempt-1)`` capped at ``cap``, with up to 50 % full jitter."""
    if retry_after is not None:
        return retry_after * (1 + random.random() / 2)
    d = min(cap, base * (2 ** (attempt - 1)))
    return d * (0.5 + random.random() / 2)


class Throttle:
    """Client-side bounds on one cluster's API traffic: a write bucket and an in-flight cap.

    Usage: ``async with throttle.slot(write=True): ...`` around one request.

    Args:
        qps: Writes per second at the start, and the most the adaptive rate climbs back to.
        burst: Writes allowed back to back at ``qps`` (bucket size).
        max_inflight: Requests in flight at once (reads and writes).
        adaptive: Let the write rate follow the cluster's answers (:mod:`sandpool.core.rate`);
            False keeps ``qps`` fixed.
        cluster: The cluster's name in reports and metrics ("": the API server's host, set
            when the client opens).
    """

    def __init__(self, qps: float, burst: int, max_inflight: int, *, adaptive: bool = True,
                 cluster: str = "") -> None:
        if qps <= 0 or burst < 1 or max_inflight < 1:
            raise errors.ConfigError(
                f"qps={qps}, burst={burst}, max_inflight={max_inflight}: all must be positive"
            )
        self.qps, self.burst, self.max_inflight = qps, burst, max_inflight
        self.rate = AdaptiveRate(RateControl(qps, burst, adaptive=adaptive,
                                             min_rate=min(0.5, qps)), cluster=cluster)
        self._inflight = asyncio.Semaphore(max_inflight)
        self.inflight_peak = 0
        self._inflight_now = 0

    def slot(self, *, write: bool) -> _Slot:
        """A context manager holding one in-flight slot (and one write token if ``write``)."""
        return _Slot(self, write)


class _Slot:
    def __init__(self, throttle: Throttle, write: bool) -> None:
        self._t, self._write = throttle, write

    async def __aenter__(self) -> None:
        if self._write:
            await self._t.rate.acquire()
        try:
            await self._t._inflight.acquire()
        except BaseException:  # cancelled: the write never went out
            if self._write:
                self._t.rate.release()
            raise
        self._t._inflight_now += 1
        self._t.inflight_peak = max(self._t.inflight_peak, self._t._inflight_now)

    async def __aexit__(self, *exc: object) -> None:
        self._t._inflight_now -= 1
        self._t._inflight.release()
        if self._write:
            self._t.rate.release()
