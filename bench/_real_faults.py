"""The real-node rows of ``bench/faults.py``: faults of real containers, injected during a burst
of rollouts on the local cluster's real node (``hack/cluster/realnode.py``).

Each row is a burst of ``images x rollouts`` rollouts (``reuse``, the agent as the container's
pid 1, a 64 MiB scratch) of the SWE-shaped OCI test image through ``run_rollout`` on a real
``SandboxPool``; each rollout runs two commands and scores 1.0. Once the first command of
some rollout has returned, its sandbox is the victim:

* ``real_pod_deleted``: its pod is deleted (grace 0) while the rollout holds it;
* ``real_container_killed``: its container is stopped through the CRI (``crictl stop``);
* ``real_kubelet_stopped``: the node's kubelet is killed; once the node is NotReady it is
  started again;
* ``real_containerd_restart``: the node's containerd is killed and started again;
* ``real_image_unpullable``: one more task names an image the registry does not have: its
  rollouts fail fast (``ErrImagePull``), as infra, within seconds of the pull's failure rather
  than the claim timeout;
* ``real_oom_killed``: the victim's command fills ``/tmp`` (memory-backed) past the pod's
  memory limit: the container is OOMKilled.

Afterwards: requested = completed + infra_failed + task_failed + rejected, and the run's pods
(label ``sandpool.io/run-id``) still present once the pool has closed are orphans.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
from cluster_faults import kill, restart, start  # noqa: E402  (the cluster's own fault injection)
from nodebuild import node_build_dir  # noqa: E402

from sandpool.core import PoolLimits, SandboxPool, Task, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.metrics import Outcome, Workload

REAL_FAULTS = ("real_none", "real_pod_deleted", "real_container_killed", "real_kubelet_stopped",
               "real_containerd_restart", "real_image_unpullable", "real_oom_killed")
SELECT = {"node_selector": {"sandpool.io/node": "real"},
          "tolerations": [{"key": "sandpool.io/real-node", "operator": "Exists",
                           "effect": "NoSchedule"}]}
MISSING = "sandpool.test/faults/not-in-the-registry:1"


def _crictl(state: dict, *args: str) -> str:
    ep = f"unix://{state['real_nodes'][0]['socket']}"
    return subprocess.run([str(node_build_dir() / "bin" / "crictl"), "--runtime-endpoint", ep,
                           "--image-endpoint", ep, *args], capture_output=True, text=True,
                          check=True).stdout


async def _node_ready(http, node: str) -> bool:
    obj = await http.request("GET", f"/api/v1/nodes/{node}")
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in obj.get("status", {}).get("conditions", []))


async def _orphans(http, namespace: str, run_id: str) -> int:
    for _ in range(120):  # deletes are asynchronous: wait for them to land
        body = await http.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector=sandpool.io/run-id%3D{run_id}")
        if not body.get("items"):
            return 0
        await asyncio.sleep(1.0)
    return len(body["items"])


async def run_real_fault(fault: str, run_dir: Path, task_row: dict, images: list[str], *,
                         namespace: str = "default", rollouts: int = 3, concurrency: int = 2) -> dict:
    """One burst on the real node with ``fault`` injected; returns the fault-matrix row."""
    state = json.loads((run_dir / "state.json").read_text())
    node = state["real_nodes"][0]["name"]
    run_id = uuid.uuid4().hex[:8]
    backend = KubernetesBackend(state["kubeconfig"], namespace=namespace, run_id=run_id,
                                agent_entrypoint=True, disk_bytes=64 << 20, ready_timeout=300,
                                resources={"requests": {"cpu": "100m", "memory": "32Mi"},
                                           "limits": {"memory": "48Mi" if fault == "real_oom_killed"
                                                      else "512Mi"}},
                                **SELECT)
    names = list(images) + ([MISSING] if fault == "real_image_unpullable" else [])
    tasks = [Task.model_validate({**task_row, "instance_id": f"img{i}-r{j}", "image": img})
             for i, img in enumerate(names) for j in range(rollouts)]
    started, injected = asyncio.Event(), asyncio.Event()
    victim: list = []
    unpullable_s: list[float] = []

    async def episode(lease) -> float:
        await lease.exec("git status --porcelain", timeout=60)
        if not victim and fault != "real_image_unpullable":
            victim.append(lease.sandbox)
            started.set()
            if fault == "real_oom_killed":  # memory-backed /tmp past the memory limit
                await lease.exec("head -c 60M /dev/zero > /tmp/fill; sleep 30", timeout=120)
            elif fault != "real_none":
                await injected.wait()  # hold the sandbox while the fault lands under it
        return float((await lease.exec("echo ok", timeout=60)).text == "ok\n")

    async def inject() -> None:
        if fault in ("real_none", "real_oom_killed", "real_image_unpullable"):
            return
        await started.wait()
        sb = victim[0]
        http = backend._http
        if fault == "real_pod_deleted":
            await http.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{sb.pod}",
                               body={"gracePeriodSeconds": 0})
        elif fault == "real_container_killed":
            ids = await asyncio.to_thread(_crictl, state, "ps", "-q", "--label",
                                          f"io.kubernetes.pod.name={sb.pod}")
            for cid in ids.split():
                await asyncio.to_thread(_crictl, state, "stop", "--timeout", "0", cid)
        elif fault == "real_kubelet_stopped":
            await asyncio.to_thread(kill, run_dir, f"kubelet-{node}")
            while await _node_ready(http, node):  # the node lease runs out: NotReady
                await asyncio.sleep(1.0)
            await asyncio.to_thread(start, run_dir, f"kubelet-{node}")
        elif fault == "real_containerd_restart":
            await asyncio.to_thread(restart, run_dir, f"containerd-{node}")
        injected.set()

    t0 = time.monotonic()
    results = []
    limits = PoolLimits(claim_timeout=300, create_timeout=300)
    async with SandboxPool(backend, "reuse", limits) as pool:
        injector = asyncio.create_task(inject())
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Task):
            async with gate:
                t = time.monotonic()
                results.append(await run_rollout(pool, task, episode, retries=2))
                if task.image == MISSING:
                    unpullable_s.append(time.monotonic() - t)

        await asyncio.gather(*(one(t) for t in tasks))
        await injector
        workload = Workload(tasks=len(tasks), images=len(names), rollouts=len(tasks),
                            concurrency=concurrency, backend="kubernetes", strategy="reuse")
        report = pool.report(workload, results, time.monotonic() - t0)
    admin = KubernetesBackend(state["kubeconfig"], namespace=namespace, run_id=run_id)
    try:
        left = await _orphans(await admin._client(), namespace, run_id)
    finally:
        await admin.aclose()
    got = [(r.task_id, r.rollout) for r in results]
    row = {"fault": fault, "backend": "kubernetes (real node)", "requested": len(tasks),
           **{o.value: report.failures[o.value] for o in Outcome},
           "unaccounted": report.unaccounted, "dup": len(got) - len(set(got)),
           "lost": len({t.instance_id for t in tasks} - {r.task_id for r in results}),
           "resolved": report.reward.resolved, "infra_errors": report.infra_errors_by_kind,
           "wall_s": round(time.monotonic() - t0, 1), "orphans": {"pods": left}}
    if unpullable_s:
        row["unpullable_rollout_s_max"] = round(max(unpullable_s), 1)
    return row
