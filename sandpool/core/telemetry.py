"""Prometheus metrics and OpenTelemetry spans for pools, claims, resets and rollouts.

Both are opt-in and cost next to nothing when off:

* **Metrics** (``prometheus-client``): pass ``metrics=`` to :class:`~sandpool.core.pool.SandboxPool`
  (``True`` for the default registry, a ``CollectorRegistry`` of your own, or a
  :class:`PoolMetrics`); ``sandpool run --metrics-port N`` serves them over HTTP. Without it
  the pool records nothing.
* **Spans** (``opentelemetry-api``): always emitted through the API's global tracer, which is a
  no-op until the application configures a ``TracerProvider``. ``sandpool.rollout`` parents
  ``sandpool.claim`` (attribute ``sandpool.warm``), ``sandpool.exec`` and ``sandpool.grade``;
  a creation a claim waits for (``sandpool.create``) and the in-place reset with its
  verification after release (``sandpool.reset``) run in tasks started inside the rollout, so
  they nest under it too. Warm fills started by ``prepare`` are root spans of their own.

Series (every label has a small, closed set of values; never a sandbox id). Counters and
histograms carry ``backend`` (``local``, ``kubernetes``, ...) and ``strategy`` (``cold``,
``warm``, ``reuse``):

=========================================  =========  ==================================================
series                                     type       labels (besides backend, strategy)
=========================================  =========  ==================================================
``sandpool_ttfc_seconds``                  histogram  (1 ms .. 10 min buckets)
``sandpool_claims_total``                  counter    ``warm`` (``true``: an idle sandbox was waiting)
``sandpool_sandbox_creations_total``       counter    ``result`` (``ok``, ``failed``)
``sandpool_resets_total``                  counter    ``result`` (``clean``, ``quarantined``)
``sandpool_reset_duration_seconds``        histogram  (reset and its verification)
``sandpool_quarantines_total``             counter    ``reason`` (``not_pristine``, ``reset_error``)
``sandpool_rollouts_total``                counter    ``outcome`` (completed, infra_failed, task_failed,
                                                      rejected)
``sandpool_failures_total``                counter    ``kind`` (``SandpoolError.kind`` of infra errors)
``sandpool_sandboxes``                     gauge      ``image``, ``state`` (idle, leased, creating,
                                                      resetting, quarantined)
``sandpool_kube_api_writes_total``         counter    ``verb``, ``resource`` (no backend/strategy)
``sandpool_kube_api_retries_total``        counter    ``status`` (``429``, ``5xx``, ``connection``)
``sandpool_kube_exec_fallbacks_total``     counter    ``reason`` (``agent_unavailable``, ``agent_off``):
                                                      sandboxes whose commands each open a pod exec
``sandpool_kube_write_rate``               gauge      ``cluster``: the cluster's write rate now, per s
                                                      (no backend/strategy; :mod:`sandpool.core.rate`)
``sandpool_kube_write_back_offs_total``    counter    ``cluster``, ``cause`` (``429``, ``5xx``,
                                                      ``connection``, ``slow``)
=========================================  =========  ==================================================

``quarantined`` in ``sandpool_sandboxes`` counts sandboxes removed after a failed reset whose
delete is still in flight. ``image`` is bounded by the task set, as the pool keeps one warm
pool per image, and ``cluster`` by the clusters a pool's backend was given. Scraped over a
run, ``sandpool_kube_write_rate`` is the rate over time.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from sandpool.core.pool import SandboxPool

__all__ = ["NO_METRICS", "PoolMetrics", "TTFC_BUCKETS", "Telemetry", "resolve_metrics", "traced"]

#: TTFC buckets, seconds: a warm claim is milliseconds, a cold start on a loaded cluster minutes.
TTFC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 120.0, 300.0, 600.0)
_RESET_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_POOL = ("backend", "strategy")
_STATES = ("idle", "leased", "creating", "resetting", "quarantined")

_tracer = trace.get_tracer("sandpool")


class PoolMetrics:
    """The sandpool series (module docstring) in one Prometheus registry.

    Usage::

        metrics = PoolMetrics()                          # the default registry
        metrics = PoolMetrics(CollectorRegistry())       # a registry of your own
        pool = SandboxPool(backend, metrics=metrics)     # any number of pools may share it
        metrics.serve(9100)                              # GET http://127.0.0.1:9100/metrics

    Prefer :func:`resolve_metrics` (or ``SandboxPool(metrics=registry)``), which returns the
    one instance per registry: a registry refuses two series of the same name.

    Args:
        registry: Where the series are registered; the default registry when ``None``.

    Raises:
        ValueError: The registry already holds sandpool series from another instance.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else REGISTRY
        r = self.registry
        self.ttfc = Histogram("sandpool_ttfc_seconds", "Time to first command: claim request to "
                              "the first command's result", _POOL, buckets=TTFC_BUCKETS, registry=r)
        self.claims = Counter("sandpool_claims", "Claims served; warm=true when an idle sandbox "
                              "was waiting", (*_POOL, "warm"), registry=r)
        self.creations = Counter("sandpool_sandbox_creations", "Sandbox creations, by result",
                                 (*_POOL, "result"), registry=r)
        self.resets = Counter("sandpool_resets", "In-place resets, by verification result",
                              (*_POOL, "result"), registry=r)
        self.reset_seconds = Histogram("sandpool_reset_duration_seconds", "In-place reset and its "
                                       "verification", _POOL, buckets=_RESET_BUCKETS, registry=r)
        self.quarantines = Counter("sandpool_quarantines", "Sandboxes removed after a failed "
                                   "reset, by reason", (*_POOL, "reason"), registry=r)
        self.rollouts = Counter("sandpool_rollouts", "Rollouts, by outcome", (*_POOL, "outcome"),
                                registry=r)
        self.failures = Counter("sandpool_failures", "Infra errors, by kind", (*_POOL, "kind"),
                                registry=r)
        self.api_writes = Counter("sandpool_kube_api_writes", "Kubernetes API write requests "
                                  "(every attempt), by verb and resource", ("verb", "resource"),
                                  registry=r)
        self.api_retries = Counter("sandpool_kube_api_retries", "Kubernetes API requests retried, "
                                   "by cause", ("status",), registry=r)
        self.exec_fallbacks = Counter("sandpool_kube_exec_fallbacks", "Kubernetes sandboxes "
                                      "whose commands fall back to one pod exec each, by reason",
                                      ("reason",), registry=r)
        self._pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()
        r.register(_PoolSizes(self._pools))
        r.register(_WriteRates(self._pools))
        self._server: Any = None

    def attach(self, pool: SandboxPool) -> None:
        """Report ``pool``'s sizes in ``sandpool_sandboxes`` while it lives."""
        self._pools.add(pool)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve this registry at ``http://addr:port/metrics`` from a daemon thread.

        Args:
            port: TCP port; ``0`` picks a free one.
            addr: Address to bind (loopback by default).

        Returns:
            The port bound.

        Raises:
            OSError: The port is taken.
        """
        self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def shutdown(self) -> None:
        """Stop the HTTP server :meth:`serve` started, if any."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _PoolSizes:
    """Collector of ``sandpool_sandboxes``: read from the live pools at scrape time."""

    def __init__(self, pools: weakref.WeakSet[SandboxPool]) -> None:
        self._pools = pools

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily("sandpool_sandboxes", "Sandboxes by image and state",
                                  labels=(*_POOL, "image", "state"))]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("sandpool_sandboxes", "Sandboxes by image and state",
                              labels=(*_POOL, "image", "state"))
        sums: dict[tuple[str, ...], int] = {}
        for pool in list(self._pools):
            for image, sizes in pool.sizes().items():
                for state in _STATES:
                    key = (pool.backend.name, pool.strategy.name, image, state)
                    sums[key] = sums.get(key, 0) + sizes.get(state, 0)
        for key, n in sorted(sums.items()):
            g.add_metric(key, n)
        yield g


class _WriteRates:
    """Collector of each cluster's write rate and back-offs, read from the live pools'
    backends at scrape time."""

    def __init__(self, pools: weakref.WeakSet[SandboxPool]) -> None:
        self._pools = pools

    def describe(self) -> list[Any]:
        return [GaugeMetricFamily("sandpool_kube_write_rate", _RATE_HELP, labels=("cluster",)),
                CounterMetricFamily("sandpool_kube_write_back_offs", _BACK_OFF_HELP,
                                    labels=("cluster", "cause"))]

    def collect(self) -> Iterator[Any]:
        rate = GaugeMetricFamily("sandpool_kube_write_rate", _RATE_HELP, labels=("cluster",))
        back = CounterMetricFamily("sandpool_kube_write_back_offs", _BACK_OFF_HELP,
                                   labels=("cluster", "cause"))
        seen: dict[str, Any] = {}
        for pool in list(self._pools):
            seen.update(pool.backend.write_rates)
        for name, r in sorted(seen.items()):
            rate.add_metric((name,), r.rate)
            for cause, n in sorted(r.back_offs.items()):
                back.add_metric((name, cause), n)
        yield rate
        yield back


_RATE_HELP = "A cluster's adaptive write rate now, writes per second"
_BACK_OFF_HELP = "Back-offs of a cluster's write rate, by cause"

_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, PoolMetrics] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def resolve_metrics(metrics: PoolMetrics | CollectorRegistry | bool | None) -> PoolMetrics | None:
    """Turn ``SandboxPool(metrics=...)`` into the registry's one :class:`PoolMetrics`.

    Args:
        metrics: ``None``/``False`` (off), ``True`` (the default registry), a
            ``CollectorRegistry``, or a :class:`PoolMetrics`.

    Returns:
        The instance, or ``None`` when metrics are off.

    Raises:
        TypeError: ``metrics`` is none of these.
    """
    if metrics is None or metrics is False:
        return None
    if isinstance(metrics, PoolMetrics):
        return metrics
    if metrics is True:
        metrics = REGISTRY
    if not isinstance(metrics, CollectorRegistry):
        raise TypeError(f"metrics: expected a PoolMetrics, a prometheus_client CollectorRegistry, "
                        f"True or None, got {type(metrics).__name__}")
    with _LOCK:
        found = _BY_REGISTRY.get(metrics)
        if found is None:
            found = _BY_REGISTRY[metrics] = PoolMetrics(metrics)
        return found


class Telemetry:
    """What one pool records: its labelled series (if metrics are on) and its spans.

    The pool calls it where it already counts things; every method is cheap, and a no-op for
    metrics when ``metrics`` is ``None``.

    Args:
        metrics: The series, or ``None``.
        backend: The backend's name (the ``backend`` label).
        strategy: The strategy's name (the ``strategy`` label).
    """

    def __init__(self, metrics: PoolMetrics | None, *, backend: str, strategy: str) -> None:
        self.metrics = metrics
        self._labels = (backend, strategy)
        if metrics is not None:
            self._ttfc = metrics.ttfc.labels(backend, strategy)
            self._reset_s = metrics.reset_seconds.labels(backend, strategy)
            self._claims = {w: metrics.claims.labels(backend, strategy, w) for w in ("true", "false")}

    # -- metrics ---------------------------------------------------------------------------

    def claimed(self, *, warm: bool) -> None:
        """A claim was served (``warm``: an idle sandbox was waiting for it)."""
        if self.metrics is not None:
            self._claims["true" if warm else "false"].inc()

    def first_command(self, ttfc_s: float) -> None:
        """A lease's first command returned, ``ttfc_s`` seconds after its claim request."""
        if self.metrics is not None:
            self._ttfc.observe(ttfc_s)

    def created(self, *, ok: bool) -> None:
        """A sandbox creation ended."""
        if self.metrics is not None:
            self.metrics.creations.labels(*self._labels, "ok" if ok else "failed").inc()

    def reset_done(self, seconds: float, *, quarantine: str | None) -> None:
        """An in-place reset ended after ``seconds``; ``quarantine`` is the reason it failed."""
        if self.metrics is None:
            return
        self._reset_s.observe(seconds)
        self.metrics.resets.labels(*self._labels, "quarantined" if quarantine else "clean").inc()
        if quarantine:
            self.metrics.quarantines.labels(*self._labels, quarantine).inc()

    def infra_error(self, kind: str) -> None:
        """An infra error of ``kind`` (``SandpoolError.kind``) was counted."""
        if self.metrics is not None:
            self.metrics.failures.labels(*self._labels, kind).inc()

    def rollout_done(self, outcome: str, n: int = 1) -> None:
        """``n`` rollouts ended as ``outcome`` (an ``Outcome`` value, or ``rejected``)."""
        if self.metrics is not None and n:
            self.metrics.rollouts.labels(*self._labels, outcome).inc(n)

    def api_write(self, verb: str, resource: str) -> None:
        """A Kubernetes API write request was sent (every attempt counts)."""
        if self.metrics is not None:
            self.metrics.api_writes.labels(verb, resource).inc()

    def api_retry(self, status: int | None) -> None:
        """A Kubernetes API request is retried after ``status`` (``None``: a connection error)."""
        if self.metrics is not None:
            cause = "connection" if status is None else ("429" if status == 429 else "5xx")
            self.metrics.api_retries.labels(cause).inc()

    def exec_fallback(self, reason: str) -> None:
        """A Kubernetes sandbox runs its commands as one pod exec each (``reason``:
        ``agent_unavailable``, the agent cannot run in its image; ``agent_off``, disabled)."""
        if self.metrics is not None:
            self.metrics.exec_fallbacks.labels(reason).inc()

    # -- spans -----------------------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
        """A span named ``name`` under the current one (no-op without a ``TracerProvider``).

        Attribute names get a ``sandpool.`` prefix; ``None`` values are left out.
        """
        attrs = {f"sandpool.{k}": v for k, v in attributes.items() if v is not None}
        with _tracer.start_as_current_span(name, attributes=attrs) as span:
            yield span


_P = ParamSpec("_P")
_R = TypeVar("_R")


def traced(name: str, attributes: Callable[..., dict[str, Any]] | None = None
           ) -> Callable[[Callable[_P, Awaitable[_R]]], Callable[_P, Awaitable[_R]]]:
    """Decorate an async function so that each call is one span named ``name``.

    Args:
        name: The span name (``sandpool.grade``).
        attributes: Called with the function's arguments; returns the span's attributes
            (prefixed ``sandpool.`` as in :meth:`Telemetry.span`).
    """
    def wrap(fn: Callable[_P, Awaitable[_R]]) -> Callable[_P, Awaitable[_R]]:
        @functools.wraps(fn)
        async def inner(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with Telemetry.span(name, **(attributes(*args, **kwargs) if attributes else {})):
                return await fn(*args, **kwargs)
        return inner
    return wrap


#: For code paths that run without a pool (spans only).
NO_METRICS = Telemetry(None, backend="", strategy="")
