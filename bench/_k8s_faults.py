"""The Kubernetes rows of ``bench/faults.py``: faults of the control plane and of pods, injected
during a real burst of rollouts on the local cluster (``hack/cluster``, agent-sandbox on kwok).

Each row is a burst of ``images x rollouts`` rollouts (``reuse``, concurrency 4) through
``run_rollout`` on a real ``SandboxPool`` over ``KubernetesBackend``; each rollout runs two
commands in its pod and scores 1.0. The fault is injected once the burst is under way (the
first command of some rollout has returned):

* ``pod_deleted``: a leased pod is deleted (grace 0) while its rollout holds it;
* ``node_deleted``: the kwok Node of a leased pod is deleted;
* ``apiserver_restart``: kube-apiserver is SIGKILLed and started again with the same flags;
* ``apf_429``: kube-apiserver is restarted with ``--max-requests-inflight=1
  --max-mutating-requests-inflight=1`` for the rest of the burst (an APF 429 storm), then
  restored;
* ``controller_restart``: the agent-sandbox controller is SIGKILLed and started again.

Restarts rewrite the cluster's ``state.json`` so ``cluster.py down`` stops the new process.
Orphans afterwards: the run's Pods, SandboxClaims, SandboxWarmPools and SandboxTemplates
(label ``sandpool.io/run-id``) still present once the pool has closed.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path

from k8s_burst import make_repo  # the burst bench's stand-in task repo, one recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack" / "cluster"))
from cluster_faults import restart  # noqa: E402  (the cluster's own fault injection)

from sandpool.core import PoolLimits, SandboxPool, Task, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.metrics import Outcome, Workload
from tests.cluster.kwok_images import workdir_image

K8S_FAULTS = ("k8s_none", "pod_deleted", "node_deleted", "apiserver_restart", "apf_429", "controller_restart")
_GROUP = "extensions.agents.x-k8s.io"
_COMPONENT = {"apiserver_restart": "kube-apiserver", "apf_429": "kube-apiserver",
              "controller_restart": "agent-sandbox-controller"}


async def _orphans(backend: KubernetesBackend, namespace: str, run_id: str) -> dict[str, int]:
    http = await backend._client()
    sel = f"labelSelector=sandpool.io/run-id%3D{run_id}"
    out = {}
    for key, path in (("pods", f"/api/v1/namespaces/{namespace}/pods"),
                      ("claims", f"/apis/{_GROUP}/v1beta1/namespaces/{namespace}/sandboxclaims"),
                      ("warm_pools", f"/apis/{_GROUP}/v1beta1/namespaces/{namespace}/sandboxwarmpools"),
                      ("templates", f"/apis/{_GROUP}/v1beta1/namespaces/{namespace}/sandboxtemplates")):
        for _ in range(60):  # deletes are asynchronous in the API server: wait for them to land
            body = await http.request("GET", f"{path}?{sel}")
            items = body.get("items", [])  # one still terminating counts until it is gone
            if not items:
                break
            await asyncio.sleep(1.0)
        out[key] = len(items)
    return out


async def run_k8s_fault(fault: str, kubeconfig: Path, run_dir: Path, work: Path, *, images: int = 2,
                        rollouts: int = 4, concurrency: int = 4) -> dict:
    """One burst with ``fault`` injected; returns the fault-matrix row."""
    head = make_repo(work / "repo")
    run_id = uuid.uuid4().hex[:8]
    namespace = "default"
    backend = KubernetesBackend(kubeconfig, namespace=namespace, run_id=run_id,
                                image_map=lambda n: workdir_image(n, work / "repo"))
    tasks = [Task(instance_id=f"img{i}-r{j}", repo="bench/repo", base_commit=head,
                  image=f"sandpool.bench/faults-{i}:{run_id}", problem_statement="p")
             for i in range(images) for j in range(rollouts)]
    started = asyncio.Event()
    injected = asyncio.Event()
    victim: list = []

    async def episode(lease) -> float:
        await lease.exec("git status --porcelain", timeout=60)
        if not victim:
            victim.append(lease.sandbox)
            started.set()
            if fault in ("pod_deleted", "node_deleted"):
                await injected.wait()  # hold the pod while it is deleted under us
        return float((await lease.exec("echo ok", timeout=60)).text == "ok\n")

    async def inject() -> None:
        await started.wait()
        sb = victim[0]
        http = await backend._client()
        if fault == "pod_deleted":
            await http.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{sb.pod}",
                               body={"gracePeriodSeconds": 0})
        elif fault == "node_deleted":
            pod = await http.request("GET", f"/api/v1/namespaces/{namespace}/pods/{sb.pod}")
            await http.request("DELETE", f"/api/v1/nodes/{pod['spec']['nodeName']}")
        elif fault == "apiserver_restart":
            await asyncio.to_thread(restart, run_dir, "apiserver")
        elif fault == "apf_429":
            await asyncio.to_thread(restart, run_dir, "apiserver",
                                    ("--max-requests-inflight=1", "--max-mutating-requests-inflight=1"))
        elif fault == "controller_restart":
            await asyncio.to_thread(restart, run_dir, "agent-sandbox")
        injected.set()

    t0 = time.monotonic()
    results = []
    limits = PoolLimits(claim_timeout=240, create_timeout=180)
    async with SandboxPool(backend, "reuse", limits) as pool:
        await pool.prepare(tasks, concurrency)
        injector = asyncio.create_task(inject())
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Task):
            async with gate:
                results.append(await run_rollout(pool, task, episode, retries=2))

        await asyncio.gather(*(one(t) for t in tasks))
        await injector
        workload = Workload(tasks=len(tasks), images=images, rollouts=len(tasks), concurrency=concurrency,
                            backend="kubernetes", strategy="reuse")
        report = pool.report(workload, results, time.monotonic() - t0)
    if fault == "apf_429":  # the storm is over: the apiserver gets its own limits back
        await asyncio.to_thread(restart, run_dir, "apiserver", (), ("--max-requests-inflight",
                                                                    "--max-mutating-requests-inflight"))
        await asyncio.sleep(5)
    admin = KubernetesBackend(kubeconfig, namespace=namespace, run_id=run_id)
    try:
        left = await _orphans(admin, namespace, run_id)
    finally:
        await admin.aclose()
    got = [(r.task_id, r.rollout) for r in results]
    return {"fault": fault, "backend": "kubernetes", "requested": len(tasks),
            **{o.value: report.failures[o.value] for o in Outcome},
            "unaccounted": report.unaccounted, "lost": len({(t.instance_id, 0) for t in tasks} - set(got)),
            "dup": len(got) - len(set(got)), "resolved": report.reward.resolved,
            "infra_errors": report.infra_errors_by_kind, "wall_s": round(time.monotonic() - t0, 1),
            "orphans": left}
