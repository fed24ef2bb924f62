"""Benchmark: commands per second and exec streams per sandbox, agent session vs per-command exec.

On the running local cluster (``hack/cluster``), ``--sandboxes`` pods are created once per
channel; then every sandbox runs ``--lanes`` concurrent loops of a small command
(``git status --porcelain``) for ``--seconds``:

* ``exec``  - today's path: every command opens its own pod-exec stream through the API
  server (apiserver -> kwok -> a host process);
* ``agent`` - one agent session per sandbox: one exec stream for the sandbox's lifetime,
  every command a JSON line on it (the local backend's agent).

Exec streams are counted by the backend (``api_stats["execs"]``) and by the API server
(``apiserver_request_total{verb="CONNECT"}``, every client), from one run.

    python hack/cluster/cluster.py up
    nice .venv/bin/python bench/k8s_exec_channel.py [--sandboxes 10] [--lanes 4] [--seconds 20]

Writes ``k8s_exec_channel.txt`` and ``.json`` to ``--out``. Target: at most one exec stream
per sandbox lifetime with the agent session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

from k8s_burst import default_kubeconfig, make_repo, scrape

from sandpool.core.backends.kubernetes import KubernetesBackend
from tests.cluster.kwok_images import workdir_image


async def run_channel(channel: str, args, kubeconfig: Path, source: Path, admin) -> dict:
    namespace = f"bench-exec-{channel}-{uuid.uuid4().hex[:6]}"
    http = await admin._client()
    await http.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    await asyncio.sleep(1.0)  # the service-account controller makes "default" (pods need it)
    be = KubernetesBackend(
        kubeconfig,
        namespace=namespace,
        mode="pods",
        image_map=lambda n: workdir_image(n, source),
        agent=channel == "agent",
    )
    try:
        verbs0, _ = await scrape(admin)
        sandboxes = await asyncio.gather(
            *(be.create(f"sandpool.bench/exec-{i}:{channel}") for i in range(args.sandboxes))
        )
        assert all(sb.channel == channel for sb in sandboxes), [sb.channel for sb in sandboxes]
        streams_at_claim = be.api_stats["execs"]
        done = failed = 0
        latencies: list[float] = []
        stop = time.monotonic() + args.seconds

        async def lane(sb) -> None:
            nonlocal done, failed
            while time.monotonic() < stop:
                t = time.monotonic()
                res = await sb.exec("git status --porcelain", timeout=30)
                latencies.append(time.monotonic() - t)
                done += res.ok
                failed += not res.ok

        t0 = time.monotonic()
        await asyncio.gather(*(lane(sb) for sb in sandboxes for _ in range(args.lanes)))
        wall = time.monotonic() - t0
        stats = be.api_stats
    finally:
        await be.aclose()
    # After close: the API server counts a long-running CONNECT when its stream ends.
    verbs1, _ = await scrape(admin)
    await http.request("DELETE", f"/api/v1/namespaces/{namespace}", ok_missing=True)
    latencies.sort()
    return {
        "channel": channel,
        "commands": done,
        "failed": failed,
        "wall_s": wall,
        "commands_per_s": done / wall,
        "latency_p50_ms": latencies[len(latencies) // 2] * 1000 if latencies else None,
        "latency_p99_ms": latencies[int(len(latencies) * 0.99)] * 1000 if latencies else None,
        "exec_streams_sandpool": stats["execs"],
        "exec_streams_at_claim": streams_at_claim,
        "exec_streams_apiserver": verbs1["CONNECT"] - verbs0["CONNECT"],
        "streams_per_sandbox": stats["execs"] / args.sandboxes,
        "agent_fallbacks": stats["agent_fallbacks"],
        "fallback_sandboxes": stats["fallback_sandboxes"],
        "api_retries": stats["retried"],
    }


def table(runs: dict[str, dict]) -> str:
    rows = [
        ("commands/s (sustained)", lambda r: f"{r['commands_per_s']:.0f}"),
        ("commands ok / failed", lambda r: f"{r['commands']}/{r['failed']}"),
        ("latency p50 (ms)", lambda r: f"{r['latency_p50_ms']:.1f}"),
        ("latency p99 (ms)", lambda r: f"{r['latency_p99_ms']:.1f}"),
        ("exec streams (sandpool)", lambda r: str(r["exec_streams_sandpool"])),
        ("exec streams (apiserver)", lambda r: str(r["exec_streams_apiserver"])),
        ("streams per sandbox", lambda r: f"{r['streams_per_sandbox']:.1f}"),
        ("agent fallbacks (images)", lambda r: str(r["agent_fallbacks"])),
        ("per-command-exec sandboxes", lambda r: str(r["fallback_sandboxes"])),
        ("API retries", lambda r: str(r["api_retries"])),
    ]
    names = list(runs)
    lines = [f"{'':<26}" + "".join(f"{n:>12}" for n in names)]
    lines += [f"{label:<26}" + "".join(f"{fn(runs[n]):>12}" for n in names) for label, fn in rows]
    return "\n".join(lines)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=10)
    ap.add_argument("--lanes", type=int, default=4, help="concurrent command loops per sandbox")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--channels", default="exec,agent")
    ap.add_argument("--kubeconfig", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args()
    kubeconfig = args.kubeconfig or default_kubeconfig()
    args.out.mkdir(parents=True, exist_ok=True)
    source = (args.out / "k8s_burst_repo").resolve()
    make_repo(source)
    admin = KubernetesBackend(kubeconfig)
    runs: dict[str, dict] = {}
    try:
        for channel in args.channels.split(","):
            runs[channel] = await run_channel(channel, args, kubeconfig, source, admin)
    finally:
        await admin.aclose()
    head = (
        f"k8s exec channel: {args.sandboxes} sandboxes x {args.lanes} lanes, "
        f"{args.seconds:g} s of `git status --porcelain` per channel"
    )
    verdict = []
    if "agent" in runs:
        a = runs["agent"]
        ok = a["streams_per_sandbox"] <= 1.0
        verdict.append(f"{'PASS' if ok else 'MISS'}  agent: {a['streams_per_sandbox']:.1f} "
                       "exec streams per sandbox lifetime <= 1")
    if "agent" in runs and "exec" in runs:
        verdict.append(f"      agent/exec commands/s = "
                       f"{runs['agent']['commands_per_s'] / runs['exec']['commands_per_s']:.1f}x")
    text = "\n".join([head, table(runs), "", *verdict])
    print(text)
    (args.out / "k8s_exec_channel.txt").write_text(text + "\n")
    (args.out / "k8s_exec_channel.json").write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
