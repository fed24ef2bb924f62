"""Start-up cost of the OpenHands agent-server in a sandbox, next to its baselines, one run.

Prints, for the calc test image on the local backend:

* sandbox creation without a service (the baseline) and with the agent-server (the server's
  start is paid here, while the pool warms);
* claim to first command: a plain lease's first ``exec`` (the baseline) and a
  ``SandpoolWorkspace``'s first ``execute_command`` through the relay (what a conversation pays
  at claim time).

    python bench/openhands_startup.py [--rounds 3]
    python bench/openhands_startup.py --kubeconfig ~/.cache/sandpool/cluster/run/kubeconfig

With ``--kubeconfig`` (the local kwok cluster of ``hack/cluster``, started with ``cluster.py
up``) it prints the same for pods of the Kubernetes backend instead:

* the agent-server's start in an already Ready pod (through its agent session, up to its
  ``/health`` answering), next to the pod sandbox's creation without it;
* claim to first command: a lease's first ``exec`` (agent session) and a workspace's first
  ``execute_command`` through the relay and ``pods/portforward``.

It needs the SDK 1.58 venv (``nox -s openhands`` builds one; for ``--kubeconfig`` with
kubernetes_asyncio on the path) and root (bubblewrap overlays).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandpool.core.backends.local import LocalBackend  # noqa: E402
from sandpool.core.paths import sandpool_home  # noqa: E402
from sandpool.core.pool import PoolLimits, SandboxPool  # noqa: E402
from sandpool.core.task import Task  # noqa: E402
from sandpool.integrations.openhands.server import agent_server_env, agent_server_service  # noqa: E402
from sandpool.integrations.openhands.workspace import SandpoolWorkspace  # noqa: E402
from tests.conftest import _build_calc_image  # noqa: E402


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:8.1f} ms  max {max(xs) * 1000:8.1f} ms  (n={len(xs)})"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kubeconfig", help="run on this cluster's pods (the local kwok cluster)")
    ap.add_argument("--namespace", default="default")
    args = ap.parse_args()
    root = sandpool_home() / "test-images"
    commits = _build_calc_image(root)
    task = Task(instance_id="calc__bench", repo="sandpool/calc", base_commit=commits["buggy"],
                image="sandpool.test/calc:2", problem_statement="bench", FAIL_TO_PASS=["test_calc.py::test_add"])
    env = agent_server_env()
    if args.kubeconfig:
        await kubernetes(args, root, task, env)
        return
    plain, served = LocalBackend(root), LocalBackend(root, service=agent_server_service(env))
    create = {"plain": [], "agent-server": []}
    for _ in range(args.rounds):
        for name, backend in (("plain", plain), ("agent-server", served)):
            t0 = time.monotonic()
            sb = await backend.create(task.image)
            create[name].append(time.monotonic() - t0)
            await backend.delete(sb)
    await plain.aclose()
    print("sandbox creation")
    for name, xs in create.items():
        print(f"  {name:14s} {_ms(xs)}")

    first = {"lease.exec": [], "workspace": []}
    async with SandboxPool(served, strategy="reuse", limits=PoolLimits(create_timeout=900)) as pool:
        await pool.prepare([task], concurrency=1)
        for _ in range(args.rounds):
            t0 = time.monotonic()
            async with pool.claim(task) as lease:
                await lease.exec("true")
                first["lease.exec"].append(time.monotonic() - t0)

            def via_workspace() -> float:
                t1 = time.monotonic()
                with SandpoolWorkspace(pool, task) as ws:
                    ws.execute_command("true")
                    return time.monotonic() - t1

            first["workspace"].append(await asyncio.to_thread(via_workspace))
    print("claim to first command (warm pool, in-place reset between claims)")
    for name, xs in first.items():
        print(f"  {name:14s} {_ms(xs)}")


async def kubernetes(args: argparse.Namespace, root: Path, task: Task, env: Path) -> None:
    from sandpool.core.backends.kubernetes import KubernetesBackend
    from sandpool.integrations.openhands.pod_server import agent_server_pod_service
    from tests.cluster.kwok_images import local_pack_image_map

    spec = agent_server_pod_service(env)
    opts = {"namespace": args.namespace, "image_map": local_pack_image_map(root),
            "ready_timeout": 300}
    plain = KubernetesBackend(args.kubeconfig, **opts)
    create, server = [], []
    try:
        for _ in range(args.rounds):
            t0 = time.monotonic()
            sb = await plain.create(task.image)
            create.append(time.monotonic() - t0)
            t0 = time.monotonic()
            await sb.start_service(spec)  # what a served backend adds to each creation
            server.append(time.monotonic() - t0)
            await plain.delete(sb)
    finally:
        await plain.aclose()
    print("pod sandbox (agent-sandbox claim on a warm pool, kwok)")
    print(f"  {'creation':22s} {_ms(create)}")
    print(f"  {'agent-server start':22s} {_ms(server)}  (in the Ready pod, paid while the pool warms)")

    first = {"lease.exec": [], "workspace (port-fwd)": []}
    served = KubernetesBackend(args.kubeconfig, service=spec, **opts)
    async with SandboxPool(served, strategy="reuse", limits=PoolLimits(create_timeout=900)) as pool:
        await pool.prepare([task], concurrency=1)
        for _ in range(args.rounds):
            t0 = time.monotonic()
            async with pool.claim(task) as lease:
                await lease.exec("true")
                first["lease.exec"].append(time.monotonic() - t0)

            def via_workspace() -> float:
                t1 = time.monotonic()
                with SandpoolWorkspace(pool, task) as ws:
                    ws.execute_command("true")
                    return time.monotonic() - t1

            first["workspace (port-fwd)"].append(await asyncio.to_thread(via_workspace))
    print("claim to first command (warm pool, in-place reset between claims)")
    for name, xs in first.items():
        print(f"  {name:22s} {_ms(xs)}")


if __name__ == "__main__":
    asyncio.run(main())
