"""Benchmark: what Prometheus metrics and OpenTelemetry spans add to claim latency.

Times ``pool.acquire(task)`` (a warm hit: the claim path, without the first command) under
three settings, interleaved round by round so that machine load hits them alike, and prints
median / p95 claim latency side by side with the baseline from the same run:

* ``off``: no metrics, no tracer provider (the OpenTelemetry API's no-op tracer);
* ``metrics``: ``SandboxPool(metrics=CollectorRegistry())``;
* ``metrics+spans``: as ``metrics``, with the OpenTelemetry SDK's ``TracerProvider`` and an
  in-memory exporter configured (spans recorded and exported).

Two backends: ``memory`` (the in-memory test backend: the pool's own logic only, so the
absolute overhead in microseconds shows) and ``local`` (bubblewrap sandboxes of the default
task pack: what a rollout pays).

    .venv/bin/python bench/telemetry_overhead.py [--claims 300] [--backends memory,local]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandpool.core.pool import SandboxPool  # noqa: E402
from sandpool.core.task import Task  # noqa: E402

SETTINGS = ("off", "metrics", "metrics+spans")


async def _backend(kind: str):
    if kind == "memory":
        from tests.memory_backend import MemoryBackend

        task = Task(instance_id="bench-1", repo="r", base_commit="0" * 40, image="img",
                    problem_statement="p")
        return MemoryBackend(), task
    from sandpool.core.backends.local import LocalBackend
    from sandpool.envs.taskpack import abuild_default_pack
    from sandpool.envs.tasks import load_tasks

    return LocalBackend(), load_tasks(await abuild_default_pack())[0]


async def _claims(kind: str, metrics: bool, n: int, exporter: InMemorySpanExporter) -> list[float]:
    """Claim ``n`` times from a warm pool of one image; return each claim's latency, seconds."""
    backend, task = await _backend(kind)
    samples = []
    async with SandboxPool(backend, "reuse", metrics=CollectorRegistry() if metrics else None) as pool:
        await pool.prepare([task], concurrency=1)
        for _ in range(n):
            t0 = time.perf_counter()
            lease = await pool.acquire(task)
            samples.append(time.perf_counter() - t0)
            await lease.exec("true", timeout=30)
            await pool.release(lease)  # reset in place before the next claim (not timed)
            exporter.clear()
    return samples


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", type=int, default=300, help="claims per setting and backend")
    ap.add_argument("--rounds", type=int, default=5, help="rounds the claims are split over")
    ap.add_argument("--backends", default="memory,local")
    args = ap.parse_args()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    kinds = args.backends.split(",")
    got = {k: {s: [] for s in SETTINGS} for k in kinds}
    per = max(1, args.claims // args.rounds)
    for kind in kinds:
        for _ in range(args.rounds):
            for setting in ("off", "metrics"):
                got[kind][setting] += await _claims(kind, setting != "off", per, exporter)
    # A tracer provider cannot be unset, so the spans setting runs last, for every backend.
    trace.set_tracer_provider(provider)
    for kind in kinds:
        for _ in range(args.rounds):
            got[kind]["metrics+spans"] += await _claims(kind, True, per, exporter)
    for kind in kinds:
        base = statistics.median(got[kind]["off"])
        print(f"\nclaim latency, {kind} backend, {len(got[kind]['off'])} warm claims per setting")
        print(f"{'':>16} {'p50':>10} {'p95':>10} {'p50 - off':>11} {'p50 / off':>10}")
        for s in SETTINGS:
            xs = sorted(got[kind][s])
            p50, p95 = statistics.median(xs), xs[int(0.95 * (len(xs) - 1))]
            print(f"{s:>16} {p50 * 1e6:>8.1f}us {p95 * 1e6:>8.1f}us {(p50 - base) * 1e6:>+9.1f}us "
                  f"{p50 / base:>9.2f}x")

if __name__ == "__main__":
    asyncio.run(main())
