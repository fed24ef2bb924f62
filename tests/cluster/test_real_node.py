"""A real node in the local cluster: kubelet, containerd, runc and CNI beside the kwok nodes.

The node is Ready with its runtime's version, labelled and tainted so that only pods that
ask for it land there, pulls images from the run's registry, runs them as real containers,
and ``down`` leaves no container, mount, cgroup or network namespace behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kubernetes import client, config

from tests.cluster.conftest import CLUSTER_PY, RealNode, _cache_base, pod_exec, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]


def real_pod(name: str, image: str, node: RealNode, **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "c", "image": image, "command": ["sleep", "infinity"]}],
            "nodeSelector": dict(node.node_selector),
            "tolerations": [dict(t) for t in node.tolerations],
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            **spec,
        },
    }


def running(core: client.CoreV1Api, namespace: str, name: str):
    pod = core.read_namespaced_pod(name, namespace)
    for cs in pod.status.container_statuses or []:
        if cs.state.waiting and cs.state.waiting.reason in ("ErrImagePull", "ImagePullBackOff",
                                                            "CreateContainerError"):
            raise AssertionError(f"{name}: {cs.state.waiting.reason}: {cs.state.waiting.message}")
    return pod if pod.status.phase == "Running" else None


def test_the_real_node_is_ready_labelled_tainted_and_shown_by_status(cluster, real_node):
    node = cluster.core.read_node(real_node.name)
    ready = {c.type: c.status for c in node.status.conditions}["Ready"]
    assert ready == "True"
    assert node.metadata.labels["sandpool.io/node"] == "real"
    assert [(t.key, t.effect) for t in node.spec.taints] == [("sandpool.io/real-node", "NoSchedule")]
    assert node.status.node_info.container_runtime_version == "containerd://2.2.3"
    assert node.status.node_info.kubelet_version == "v1.36.3"
    out = subprocess.run(
        [sys.executable, str(CLUSTER_PY), "status"], capture_output=True, text=True, check=True,
        env=dict(os.environ, SANDPOOL_CLUSTER_RUN_DIR=str(cluster.run_dir)),
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(real_node.name))
    assert "Ready" in line and "containerd://2.2.3" in line, out


def test_a_pod_pulls_from_the_registry_and_runs_on_the_real_node_only_when_it_asks(
    cluster, namespace, real_node, real_images
):
    task = json.loads(Path(real_images["task"]).read_text())
    core = cluster.core
    core.create_namespaced_pod(namespace, real_pod("real", real_images["swe"], real_node))
    core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kwok"},
        "spec": {"containers": [{"name": "c", "image": real_images["swe"]}]}})
    pod = wait_until(lambda: running(core, namespace, "real"), 120, "the real pod Running")
    assert pod.spec.node_name == real_node.name
    # the image came from the run's registry, by digest
    pushed = json.loads(subprocess.run(
        ["skopeo", "inspect", "--tls-verify=false", f"docker://{real_node.registry}/swe-calc:1"],
        capture_output=True, text=True, check=True).stdout)["Digest"]
    image_id = pod.status.container_statuses[0].image_id
    assert image_id.startswith("sandpool.test/") and image_id.endswith("@" + pushed), image_id
    other = wait_until(lambda: core.read_namespaced_pod("kwok", namespace).spec.node_name, 60,
                       "the other pod scheduled")
    assert other.startswith("kwok-node-")
    # a real container: its own pid 1 and root filesystem, the image's repo at its commit
    script = ("cat /proc/1/cmdline | tr '\\0' ' '; git -C /testbed rev-parse HEAD; "
              "echo $CALC_MODE")
    res = pod_exec(cluster, namespace, "real", ["sh", "-c", script])
    assert res.exit_code == 0, res
    assert res.stdout.split() == ["sleep", "infinity", task["base_commit"], "swe"]
    assert pod_exec(cluster, namespace, "real", ["sh", "-c", "exit 7"]).exit_code == 7


def test_a_runtime_class_mapped_to_runc_runs_the_pod(cluster, namespace, real_node, real_images):
    core = cluster.core
    core.create_namespaced_pod(namespace, real_pod("rc", real_images["base"], real_node,
                                                   runtimeClassName=real_node.runtime_class))
    wait_until(lambda: running(core, namespace, "rc"), 120, "the pod Running")
    ps = real_node.crictl("ps", "--name", "c", "-o", "json")
    handlers = {c["labels"]["io.kubernetes.pod.namespace"]: c for c in json.loads(ps.stdout)["containers"]}
    assert namespace in handlers
    pods = json.loads(real_node.crictl("pods", "--namespace", namespace, "-o", "json").stdout)
    assert [p["runtimeHandler"] for p in pods["items"]] == ["sandpool-runc"]


def _pid_facts(pid: int) -> dict:
    """What a running container process holds on the host: its network namespace, cgroups,
    and the mount of its root filesystem."""
    netns = os.readlink(f"/proc/{pid}/ns/net")
    cgroups = [line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()]
    root = os.readlink(f"/proc/{pid}/root")
    return {"pid": pid, "netns": netns, "cgroups": cgroups, "root": root}


def test_down_leaves_no_container_mount_cgroup_or_network_namespace(tmp_path):
    """A cluster of its own (so the session's keeps running): start a pod on its real node,
    note the container's process, network namespace, cgroups and mounts, `down`, and find
    none of them left."""
    run_dir = _cache_base() / "pytest" / f"down-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    (run_dir / "owner.pid").write_text(str(os.getpid()))
    env = dict(os.environ, SANDPOOL_CLUSTER_RUN_DIR=str(run_dir))
    env.pop("SANDPOOL_CLUSTER_KUBECONFIG", None)
    cmd = [sys.executable, str(CLUSTER_PY)]
    try:
        subprocess.run([*cmd, "up", "--nodes", "1", "--real-nodes", "1"], check=True, env=env)
        state = json.loads((run_dir / "state.json").read_text())
        node = RealNode(state["real_nodes"][0]["name"], state["registry"], run_dir, state)
        from sandpool.envs.taskpack.oci import build_test_images

        node.push(f"oci:{build_test_images() / 'layout'}:base", "sandpool.test/base:1")
        api = config.new_client_from_config(config_file=state["kubeconfig"])
        core = client.CoreV1Api(api)
        core.create_namespaced_pod("default", real_pod("p", "sandpool.test/base:1", node))
        wait_until(lambda: running(core, "default", "p"), 120, "the pod Running")
        api.close()
        ps = json.loads(node.crictl("ps", "-o", "json").stdout)["containers"]
        assert len(ps) == 1
        info = json.loads(node.crictl("inspect", ps[0]["id"]).stdout)["info"]
        facts = _pid_facts(info["pid"])
        sock = state["real_nodes"][0]["socket"]
        mounts_before = [m for m in Path("/proc/self/mountinfo").read_text().splitlines()
                         if str(run_dir) in m or os.path.dirname(sock) in m]
        assert any("overlay" in m for m in mounts_before), "the container's rootfs is not mounted"
        assert any("nsfs" in m or "netns" in m for m in mounts_before), "no netns mount seen"

        subprocess.run([*cmd, "down"], check=True, env=env)

        assert not Path(f"/proc/{facts['pid']}").exists(), "the container's process survived"
        holders = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
                   and _readlink(p / "ns" / "net") == facts["netns"]]
        assert holders == [], f"processes still in the pod's network namespace: {holders}"
        mounts_after = Path("/proc/self/mountinfo").read_text()
        assert str(run_dir) not in mounts_after and os.path.dirname(sock) not in mounts_after
        cg = state["real_nodes"][0]["cgroup"]
        assert not [d for d in Path("/sys/fs/cgroup").glob(f"*/{cg}")], "the node's cgroups remain"
        assert [c for c in facts["cgroups"] if cg in c], "the container was not in the node's cgroups"
        rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout
        assert state["real_nodes"][0]["comment"] not in rules
        addrs = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                               check=True).stdout
        assert "inet " + state["real_nodes"][0]["subnet"].rsplit(".", 1)[0] + "." not in addrs
    finally:
        subprocess.run([*cmd, "down"], check=False, env=env)
        shutil.rmtree(run_dir, ignore_errors=True)


def _readlink(p: Path) -> str | None:
    try:
        return os.readlink(p)
    except OSError:
        return None
