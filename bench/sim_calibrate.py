"""The discrete-event model's parameters, measured one operation at a time on the local cluster.

``sandpool bench --simulate`` (:mod:`sandpool.bench.simulate`) needs what one operation
costs on the kwok cluster, in wall time on a machine with nothing else in flight and in CPU
seconds of this machine (kwok's pods, the control plane and sandpool share its cores, which
the model holds as ``host_cpus``). This measures them one at a time, each ``--repeat``
times, against the running cluster from ``hack/cluster`` (``up --image-model=seed``):

* ``api_write_s``: a ConfigMap create (sandpool's client, one at a time);
* ``pod``: a plain pod (pods mode, its image cached on the node) from the create request
  to Ready, and deleted: ``cached_pull_s + boot_s`` is the model's, the rest
  ``provision_s``; ``cpu_pod_s`` the CPU of the create and the delete;
* ``agent``: the same with sandpool's agent session and the pristine record (``agent_s +
  record_s``, ``cpu_agent_s``: the difference);
* ``exec``: a command's round trip over the agent (``exec_s``, ``cpu_exec_s``) and as one
  pod exec (``exec_pod_s``, ``cpu_exec_pod_s``);
* ``reset``: ``reset_in_place`` after a small change (``reset_s``, ``cpu_reset_s``);
* ``checkout``: the task's commit checked out in a sandbox, as a reuse sandbox's first claim
  does (``checkout_s``, ``cpu_checkout_s``);
* ``claim``: a SandboxClaim on a filled SandboxWarmPool whose pods' sessions are open, from
  the create request to the sandbox handed out (``controller_s``: the bind, less a write).

    python3 hack/cluster/cluster.py up --image-model=seed
    nice .venv/bin/python bench/sim_calibrate.py [--repeat 10] [--out DIR]

Prints each figure (median wall seconds, mean CPU seconds) with the machine's load, and
writes ``sim_calibrate.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k8s_burst import cluster_cpu_s, default_kubeconfig, make_repo  # noqa: E402

from sandpool.core.backends.kubernetes import KubernetesBackend  # noqa: E402
from sandpool.core.reset import checkout, record_pristine, reset_in_place  # noqa: E402
from tests.cluster.kwok_images import workdir_image  # noqa: E402


#: Every pod on one node: the image is pulled once, then cached.
ONE_NODE = {"kubernetes.io/hostname": "kwok-node-0"}


def cpu_now() -> float:
    """CPU seconds of the cluster's processes and of this one, so far."""
    return cluster_cpu_s() + time.process_time()


class Rows:
    """Wall-time samples and CPU seconds per operation, by row name."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, float] = {}
        self.client: dict[str, float] = {}  # of it, this process's (sandpool's side)

    async def time(self, name: str, n: int, op) -> list:
        """Run ``op()`` ``n`` times, one at a time; record each wall time and the CPU
        per run; return the results."""
        out, c0, p0 = [], cpu_now(), time.process_time()
        for _ in range(n):
            t0 = time.monotonic()
            out.append(await op())
            self.wall.setdefault(name, []).append(time.monotonic() - t0)
        self.cpu[name] = (cpu_now() - c0) / n
        self.client[name] = (time.process_time() - p0) / n
        return out

    def med(self, name: str) -> float:
        return statistics.median(self.wall[name])


async def measure(kubeconfig: Path, source: Path, commit: str, repeat: int) -> Rows:
    rows = Rows()
    image = f"sandpool.bench/calib:{uuid.uuid4().hex[:6]}"
    imap = lambda n: workdir_image(n, source)  # noqa: E731
    admin = KubernetesBackend(kubeconfig)
    http = await admin._client()
    ns = f"bench-calib-{uuid.uuid4().hex[:6]}"
    await http.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    await asyncio.sleep(2)  # the service-account controller makes "default"
    try:
        await rows.time("api write", repeat, lambda: http.request(
            "POST", f"/api/v1/namespaces/{ns}/configmaps",
            body={"metadata": {"name": f"c-{uuid.uuid4().hex[:8]}"}}))
        for agent in (False, True):
            be = KubernetesBackend(kubeconfig, namespace=ns, mode="pods", agent=agent,
                                   image_map=imap, ready_timeout=600, node_selector=ONE_NODE)
            try:
                await be.delete(await be.create(image))  # the image pulled onto the node

                async def cycle():
                    sb = await be.create(image)
                    if agent:
                        await record_pristine(sb, refresh_index=True)
                    t = time.monotonic()
                    await be.delete(sb)
                    return time.monotonic() - t

                deletes = await rows.time("pod+agent" if agent else "pod", repeat, cycle)
                rows.wall["pod+agent" if agent else "pod"] = [
                    w - d for w, d in zip(rows.wall["pod+agent" if agent else "pod"], deletes,
                                          strict=True)]
                sb = await be.create(image)
                if agent:
                    await record_pristine(sb)
                await rows.time("exec agent" if agent else "exec pod", repeat * 5,
                                lambda sb=sb: sb.exec("true"))
                if agent:
                    async def reset(sb=sb):
                        await sb.exec("echo x >> main.py; echo y > new.py")
                        t = time.monotonic()
                        outcome = await reset_in_place(sb, commit)
                        assert outcome.ok, outcome.problems
                        return time.monotonic() - t

                    took = await rows.time("reset", repeat, reset)
                    rows.wall["reset"] = took
                    await rows.time("checkout", repeat, lambda sb=sb: checkout(sb, commit))
                await be.delete(sb)
            finally:
                await be.aclose()
        be = KubernetesBackend(kubeconfig, namespace=ns, mode="agent-sandbox", image_map=imap,
                               ready_timeout=600, presessions=repeat, node_selector=ONE_NODE)
        try:
            await be.hydrate(image)
            await be.set_warm_target(image, repeat, reuse=False)
            await be.wait_warm()
            sbs = await rows.time("claim", repeat, lambda: be.create(image))
            for sb in sbs:
                await be.delete(sb)
        finally:
            await be.aclose()
    finally:
        await http.request("DELETE", f"/api/v1/namespaces/{ns}", ok_missing=True)
        await admin.aclose()
    return rows


def params(rows: Rows, boot_s: float, cached_pull_s: float) -> dict[str, float]:
    """The model's parameters (:class:`~sandpool.bench.simcluster.SimParams` fields)."""
    return {
        "api_write_s": rows.med("api write"),
        "provision_s": max(0.0, rows.med("pod") - boot_s - cached_pull_s),
        "cpu_pod_s": rows.cpu["pod"],
        "agent_s": rows.med("pod+agent") - rows.med("pod"),
        "cpu_agent_s": max(0.0, rows.cpu["pod+agent"] - rows.cpu["pod"]),
        "exec_s": rows.med("exec agent"), "cpu_exec_s": rows.cpu["exec agent"],
        "exec_pod_s": rows.med("exec pod"), "cpu_exec_pod_s": rows.cpu["exec pod"],
        "reset_s": rows.med("reset"), "cpu_reset_s": rows.cpu["reset"],
        "checkout_s": rows.med("checkout"), "cpu_checkout_s": rows.cpu["checkout"],
        "controller_s": max(0.0, rows.med("claim") - rows.med("api write")),
        # a claim's window holds the refill it set off (a pod, its session): not the claim's
        "cpu_claim_s": max(rows.client["claim"], rows.cpu["claim"] - rows.cpu["pod+agent"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--kubeconfig", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    source = (args.out / "k8s_burst_repo").resolve()
    commit = make_repo(source)
    from k8s_burst import run_dir

    prov = json.loads((run_dir() / "provisioner.json").read_text())
    boot_s, cached_s = prov["boot_ms"] / 1000, prov["cached_pull_ms"] / 1000
    load0 = os.getloadavg()
    rows = asyncio.run(measure(args.kubeconfig or default_kubeconfig(), source, commit,
                               args.repeat))
    load1 = os.getloadavg()
    fitted = params(rows, boot_s, cached_s)
    lines = [f"sim calibration on the kwok cluster ({time.strftime('%Y-%m-%d %H:%M')}, load "
             f"{load0[0]:.1f} -> {load1[0]:.1f}, {os.cpu_count()} CPUs)",
             f"{'operation':<14}{'wall p50 (ms)':>14}{'CPU (ms)':>10}{'of it sandpool':>16}"
             f"{'runs':>6}"]
    lines += [f"{k:<14}{rows.med(k) * 1000:>14.0f}{rows.cpu[k] * 1000:>10.0f}"
              f"{rows.client[k] * 1000:>16.0f}{len(v):>6}" for k, v in rows.wall.items()]
    lines += ["", "SimParams: " + ", ".join(f"{k}={v:.3g}" for k, v in fitted.items())]
    text = "\n".join(lines)
    print(text)
    (args.out / "sim_calibrate.json").write_text(json.dumps(
        {"wall_s": rows.wall, "cpu_s": rows.cpu, "cpu_sandpool_s": rows.client, "params": fitted, "load": [load0, load1],
         "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
