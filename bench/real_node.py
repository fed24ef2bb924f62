"""Calibration on a real node: image pull, pod start cold and cached, the exec round trip, the
reset, and a small burst, printed next to the kwok image model's parameters.

The node is the local cluster's real node (``hack/cluster/realnode.py``: kubelet, containerd,
runc, CNI, the run's registry); the image is the SWE-bench-shaped OCI test image
(``sandpool.envs.taskpack.oci``), pushed under ``--images`` names that share its layers, as
SWE-bench images share their base layers.

    python3 hack/cluster/cluster.py up --real-nodes 1
    .venv/bin/python bench/real_node.py [--repeat 5] [--images 8] [--rollouts 4] [--out DIR]

(or ``--start``: a cluster of its own, stopped at the end). Rows:

* ``pull``: ``crictl rmi --prune`` (every image no container uses: the layers are shared) then
  ``crictl pull`` through the CRI (the kubelet's path), the
  image's compressed size over that time;
* ``pod start cold`` / ``cached``: a plain pod's create request to its Ready condition (polled
  every 20 ms), with the image removed from the node first / already there;
* ``sandbox start``: ``KubernetesBackend.create`` (pods mode) to a sandbox whose agent (pid 1,
  over attach) answered, image cached; ``record``: then its pristine state recorded (as a
  warm fill does, git's index refreshed);
* ``exec round trip``: ``exec("true")`` over the agent channel, and over per-command pod exec;
* ``reset``: ``reset_in_place`` after a small rollout mess;
* the burst: ``--images`` x ``--rollouts`` oracle/noop rollouts under cold, warm and reuse
  (``run_batch``), TTFC and wall time side by side.

Writes ``real_node.txt`` and ``real_node.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack" / "cluster"))

from nodebuild import node_build_dir

from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.reset import record_pristine, reset_in_place
from sandpool.core.task import Task
from sandpool.envs.policies import NoopPolicy, OraclePolicy
from sandpool.envs.runner import run_batch
from sandpool.envs.taskpack.oci import build_test_images

CLUSTER = [sys.executable, str(REPO / "hack" / "cluster" / "cluster.py")]
SELECT = {"node_selector": {"sandpool.io/node": "real"},
          "tolerations": [{"key": "sandpool.io/real-node", "operator": "Exists",
                           "effect": "NoSchedule"}]}
#: The seed image model's pull bandwidth default (``up --image-model seed``), when the cluster
#: runs the flat model.
SEED_BANDWIDTH_MBPS = 400.0


def kwok_model(run_dir: Path) -> dict[str, float]:
    """The kwok image model the cluster runs with (its provisioner's configuration)."""
    cfg = json.loads((run_dir / "provisioner.json").read_text())
    seed = cfg.get("image_model") or {}
    return {k: float(cfg[k]) for k in ("pull_ms", "cached_pull_ms", "boot_ms")} | {
        "bandwidth_mbps": float(seed.get("bandwidth_mbps", SEED_BANDWIDTH_MBPS))}


def crictl(state: dict, *args: str) -> subprocess.CompletedProcess:
    ep = f"unix://{state['real_nodes'][0]['socket']}"
    return subprocess.run([str(node_build_dir() / "bin" / "crictl"), "--runtime-endpoint", ep,
                           "--image-endpoint", ep, *args], capture_output=True, text=True,
                          check=False)


def uncache(state: dict) -> None:
    """Remove every image no container uses from the node, so the next pull is cold: an image
    of other names sharing its layers would keep them in containerd's content store."""
    deadline = time.monotonic() + 60
    while True:  # a deleted pod's containers go a moment after the pod object
        res = crictl(state, "rmi", "--prune")
        if res.returncode:
            raise SystemExit(f"crictl rmi --prune failed: {res.stderr}")
        left = [i for i in json.loads(crictl(state, "images", "-o", "json").stdout)["images"]
                if not i.get("pinned")]
        if not left:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"images still on the node after 60 s: {left}")
        time.sleep(0.2)


def compressed_mb(state: dict, image: str) -> float:
    path = image.split("/", 1)[1]
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                          f"docker://{state['registry']}/{path}"],
                         capture_output=True, text=True, check=True).stdout
    return sum(layer["size"] for layer in json.loads(raw)["layers"]) / 1e6


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure_pull(state: dict, image: str, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        uncache(state)
        t0 = time.monotonic()
        res = crictl(state, "pull", image)
        if res.returncode:
            raise SystemExit(f"crictl pull {image} failed: {res.stderr}")
        out.append(time.monotonic() - t0)
    return out


def pod_start(core, namespace: str, image: str, name: str) -> float:
    """Seconds from the create request to the pod's Ready condition (polled every 20 ms)."""
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": image, "command": ["sleep", "infinity"]}],
                     "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": False,
                     "nodeSelector": SELECT["node_selector"], "tolerations": SELECT["tolerations"]}}
    t0 = time.monotonic()
    core.create_namespaced_pod(namespace, body)
    while True:
        pod = core.read_namespaced_pod(name, namespace)
        if any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
            took = time.monotonic() - t0
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            while core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}").items:
                time.sleep(0.05)  # gone, so its image is no longer in use
            return took
        if time.monotonic() - t0 > 300:
            raise SystemExit(f"pod {name} not Ready in 300 s: {pod.status}")
        time.sleep(0.02)


async def channel_rows(kubeconfig: str, namespace: str, image: str, task: dict,
                       repeat: int) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {"sandbox start": [], "record": [], "exec rtt agent": [],
                                    "exec rtt pod exec": [], "reset": []}
    for agent in (True, False):
        be = KubernetesBackend(kubeconfig, namespace=namespace, mode="pods", agent=agent,
                               agent_entrypoint=True, disk_bytes=256 << 20, ready_timeout=300,
                               **SELECT)
        try:
            t0 = time.monotonic()
            sb = await be.create(image)
            if agent:
                rows["sandbox start"].append(time.monotonic() - t0)
            key = "exec rtt agent" if agent else "exec rtt pod exec"
            for _ in range(50 if agent else 10):
                t0 = time.monotonic()
                await sb.exec("true", timeout=30)
                rows[key].append(time.monotonic() - t0)
            if agent:
                await record_pristine(sb)
                for _ in range(repeat):
                    await sb.exec("echo x >> calcpkg/__init__.py; echo y > new.py; echo t > /tmp/t; "
                                  "(setsid sleep 600 &)", timeout=30)
                    t0 = time.monotonic()
                    outcome = await reset_in_place(sb, task["base_commit"])
                    rows["reset"].append(time.monotonic() - t0)
                    if not outcome.ok:
                        raise SystemExit(f"reset failed: {outcome.problems}")
                for _ in range(repeat - 1):
                    t0 = time.monotonic()
                    fresh = await be.create(image)
                    rows["sandbox start"].append(time.monotonic() - t0)
                    t0 = time.monotonic()
                    await record_pristine(fresh, refresh_index=True)  # as a warm fill does
                    rows["record"].append(time.monotonic() - t0)
                    await be.delete(fresh)
        finally:
            await be.aclose()
    return rows


async def burst(kubeconfig: str, namespace: str, images: list[str], task: dict,
                rollouts: int) -> dict:
    tasks = [Task.model_validate({**task, "instance_id": f"sandpool__calc-{i}", "image": img})
             for i, img in enumerate(images)]
    reports = {}
    for strategy in ("cold", "warm", "reuse"):
        be = KubernetesBackend(kubeconfig, namespace=namespace, agent_entrypoint=True,
                               disk_bytes=256 << 20, ready_timeout=300,
                               mode="pods" if strategy == "cold" else "agent-sandbox", **SELECT)
        reports[strategy] = await run_batch(tasks, [OraclePolicy(), NoopPolicy()], be,
                                            rollouts_per_task=rollouts, concurrency=len(images),
                                            strategy=strategy)
        print(f"burst {strategy}: {reports[strategy].wall_time_s:.1f} s", flush=True)
    return reports


def render(rows: dict[str, list[float]], mb: float, reports: dict, n_images: int,
           rollouts: int, kwok: dict[str, float]) -> str:
    ms = lambda x: f"{x * 1000:8.0f}"
    pull = med(rows["pull"])
    def row(label: str, key: str, model: str = "") -> str:
        return f"{label:24}{ms(med(rows[key]))}{len(rows[key]):6}   {model}".rstrip()

    seed_ms = mb / kwok["bandwidth_mbps"] * 1000
    lines = [
        f"real node calibration ({time.strftime('%Y-%m-%d %H:%M')}; medians of each row's runs)",
        f"{'':24}{'measured ms':>12}{'runs':>6}   kwok model",
        row(f"pull ({mb:.0f} MB)", "pull",
            f"flat pull_ms {kwok['pull_ms']:.0f}; seed {seed_ms:.0f} ms at "
            f"{kwok['bandwidth_mbps']:.0f} MB/s (measured {mb / pull:.0f} MB/s)"),
        row("pod start cold", "pod start cold",
            f"pull_ms + boot_ms = {kwok['pull_ms'] + kwok['boot_ms']:.0f}"),
        row("pod start cached", "pod start cached",
            f"cached_pull_ms + boot_ms = {kwok['cached_pull_ms'] + kwok['boot_ms']:.0f}"),
    ]
    for key in ("sandbox start", "record", "exec rtt agent", "exec rtt pod exec", "reset"):
        lines.append(row(key, key))
    if reports:
        lines += ["", (f"burst: {n_images} images x {rollouts} rollouts (oracle/noop), "
                       f"concurrency {n_images}"),
                  f"{'':24}" + "".join(f"{s:>10}" for s in reports)]
        for label, fn in (
            ("TTFC p50 (ms)", lambda r: ms(r.ttfc.p50_s or 0)),
            ("TTFC max (ms)", lambda r: ms(r.ttfc.max_s or 0)),
            ("sandboxes created", lambda r: f"{r.sandboxes_created:8}"),
            ("API writes", lambda r: f"{r.api_writes:8}"),
            ("completed/infra/task", lambda r: "/".join(str(v) for v in r.failures.values())),
            ("reward mean", lambda r: f"{r.reward.mean:8.2f}" if r.reward.mean is not None else "-"),
            ("wall (s)", lambda r: f"{r.wall_time_s:8.1f}"),
        ):
            lines.append(f"{label:24}" + "".join(f"{fn(r):>10}" for r in reports.values()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, help="a running cluster's run directory "
                    "(default: $SANDPOOL_CLUSTER_RUN_DIR or the cluster's default)")
    ap.add_argument("--start", action="store_true", help="start a cluster of its own")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--no-burst", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args()
    env = dict(os.environ)
    if args.start:
        args.run_dir = Path.home() / ".cache" / "sandpool" / "cluster" / f"bench-{uuid.uuid4().hex[:6]}"
    if args.run_dir:
        env["SANDPOOL_CLUSTER_RUN_DIR"] = str(args.run_dir)
    if args.start:
        subprocess.run([*CLUSTER, "up", "--nodes", "1", "--real-nodes", "1"], check=True, env=env)
    try:
        run_dir = Path(env.get("SANDPOOL_CLUSTER_RUN_DIR")
                       or Path.home() / ".cache" / "sandpool" / "cluster" / "run")
        state = json.loads((run_dir / "state.json").read_text())
        if not state.get("real_nodes"):
            raise SystemExit(f"the cluster in {run_dir} has no real node (up --real-nodes 1)")
        root = build_test_images()
        task = json.loads((root / "swe-task.json").read_text())
        images = [f"sandpool.test/calib/swe-calc-{i}:1" for i in range(max(1, args.images))]
        for img in images:
            subprocess.run([*CLUSTER, "push", f"oci:{root / 'layout'}:swe", img], check=True, env=env)
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=state["kubeconfig"])
        core = client.CoreV1Api(api)
        namespace = f"bench-real-{uuid.uuid4().hex[:6]}"
        core.create_namespace({"metadata": {"name": namespace}})
        while not core.list_namespaced_service_account(namespace).items:
            time.sleep(0.1)  # pods are admitted once the controller made "default"
        rows: dict[str, list[float]] = {"pull": measure_pull(state, images[0], args.repeat),
                                        "pod start cold": [], "pod start cached": []}
        for i in range(args.repeat):
            uncache(state)
            rows["pod start cold"].append(pod_start(core, namespace, images[0], f"cold-{i}"))
            rows["pod start cached"].append(pod_start(core, namespace, images[0], f"cached-{i}"))
        rows |= asyncio.run(channel_rows(state["kubeconfig"], namespace, images[0], task,
                                         args.repeat))
        reports = {} if args.no_burst else asyncio.run(burst(state["kubeconfig"], namespace,
                                                             images, task, args.rollouts))
        kwok = kwok_model(run_dir)
        text = render(rows, compressed_mb(state, images[0]), reports, len(images), args.rollouts,
                      kwok)
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "real_node.txt").write_text(text + "\n")
        (args.out / "real_node.json").write_text(json.dumps({
            "rows_s": rows, "image_mb": compressed_mb(state, images[0]), "kwok_model": kwok,
            "burst": {k: r.model_dump(mode="json") for k, r in reports.items()}}, indent=2))
        core.delete_namespace(namespace)
        api.close()
    finally:
        if args.start:
            subprocess.run([*CLUSTER, "down"], check=False, env=env)


if __name__ == "__main__":
    main()
