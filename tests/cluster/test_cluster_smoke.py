"""The local cluster runs agent-sandbox warm pools on kwok nodes, with exec into pods."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.cluster

GROUP = "extensions.agents.x-k8s.io"
CORE_GROUP = "agents.x-k8s.io"
VERSION = "v1beta1"
IMAGE = "registry.invalid/sandpool/smoke:1"  # never pulled: kwok only simulates the pull


def make_repo(path: Path) -> str:
    """A small git repository standing in for a task image; returns its HEAD commit."""
    path.mkdir()
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "README").write_text("hello\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    return subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def create_pool(cluster, namespace: str, replicas: int, workdir_source: Path | None = None) -> None:
    annotations = {"sandpool.io/workdir-source": str(workdir_source)} if workdir_source else {}
    template = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SandboxTemplate",
        "metadata": {
            "name": "smoke",
            "namespace": namespace,
            "labels": {"sandpool.io/run-id": cluster.run_id},
        },
        "spec": {
            "podTemplate": {
                "metadata": {
                    "annotations": annotations,
                    "labels": {"sandpool.io/run-id": cluster.run_id},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "sandbox",
                            "image": IMAGE,
                            "command": ["sleep", "infinity"],
                            "env": [{"name": "TASK_ID", "value": "smoke-1"}],
                            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
                        }
                    ],
                },
            },
        },
    }
    pool = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SandboxWarmPool",
        "metadata": {
            "name": "smoke",
            "namespace": namespace,
            "labels": {"sandpool.io/run-id": cluster.run_id},
        },
        "spec": {"replicas": replicas, "sandboxTemplateRef": {"name": "smoke"}},
    }
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "sandboxtemplates", template
    )
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "sandboxwarmpools", pool
    )


def ready_replicas(cluster, namespace: str) -> int:
    pool = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "sandboxwarmpools", "smoke"
    )
    return (pool.get("status") or {}).get("readyReplicas", 0)


def sandboxes(cluster, namespace: str) -> list[dict]:
    return cluster.custom.list_namespaced_custom_object(
        CORE_GROUP, VERSION, namespace, "sandboxes"
    )["items"]


def pod_name(sandbox: dict) -> str:
    return (sandbox["metadata"].get("annotations") or {}).get(
        "agents.x-k8s.io/pod-name"
    ) or sandbox["metadata"]["name"]


def create_claim(cluster, namespace: str, name: str) -> None:
    claim = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SandboxClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"sandpool.io/run-id": cluster.run_id},
        },
        "spec": {"warmPoolRef": {"name": "smoke"}},
    }
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, "sandboxclaims", claim
    )


def bound_sandbox(cluster, namespace: str, claim: str) -> str | None:
    """The claimed sandbox's name once the claim is Ready, else None."""
    obj = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, "sandboxclaims", claim
    )
    status = obj.get("status") or {}
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
    )
    return (status.get("sandbox") or {}).get("name") if ready else None


def test_warm_pool_of_five_becomes_ready_on_kwok_nodes(cluster, namespace, wait_for):
    create_pool(cluster, namespace, replicas=5)

    wait_for(lambda: ready_replicas(cluster, namespace) == 5, 60, "5 ready warm sandboxes")

    pods = cluster.core.list_namespaced_pod(namespace).items
    assert len(pods) == 5
    for pod in pods:
        assert pod.status.phase == "Running"
        assert pod.spec.node_name.startswith("kwok-node-")
        assert pod.metadata.annotations["sandpool.io/provisioned"] == "true"
        # Each pod got its exec target before it was started.
        cluster.custom.get_namespaced_custom_object(
            "kwok.x-k8s.io", "v1alpha1", namespace, "execs", pod.metadata.name
        )


def test_claim_binds_to_a_warm_sandbox(cluster, namespace, wait_for):
    create_pool(cluster, namespace, replicas=2)
    wait_for(lambda: ready_replicas(cluster, namespace) == 2, 60, "2 ready warm sandboxes")
    warm = {s["metadata"]["name"] for s in sandboxes(cluster, namespace)}

    create_claim(cluster, namespace, "c1")
    name = wait_for(lambda: bound_sandbox(cluster, namespace, "c1"), 30, "claim c1 Ready")

    assert name in warm  # adopted from the pool, not created for the claim


def test_exec_in_claimed_pod_returns_output_exit_code_and_per_pod_state(
    cluster, namespace, wait_for, exec_in_pod, tmp_path
):
    head = make_repo(tmp_path / "repo")
    create_pool(cluster, namespace, replicas=2, workdir_source=tmp_path / "repo")
    wait_for(lambda: ready_replicas(cluster, namespace) == 2, 60, "2 ready warm sandboxes")
    warm_pods = [pod_name(s) for s in sandboxes(cluster, namespace)]
    create_claim(cluster, namespace, "c1")
    sandbox = wait_for(lambda: bound_sandbox(cluster, namespace, "c1"), 30, "claim c1 Ready")
    pod = pod_name(
        cluster.custom.get_namespaced_custom_object(
            CORE_GROUP, VERSION, namespace, "sandboxes", sandbox
        )
    )

    res = exec_in_pod(namespace, pod, ["git", "rev-parse", "HEAD"])
    assert (res.exit_code, res.stdout.strip()) == (0, head)

    res = exec_in_pod(namespace, pod, ["sh", "-c", 'echo "out $TASK_ID"; echo err >&2; exit 3'])
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out smoke-1\n", "err\n")

    # State written in one pod is not seen by another pod of the same pool.
    assert exec_in_pod(namespace, pod, ["sh", "-c", "echo dirty > README"]).exit_code == 0
    other = next(p for p in warm_pods if p != pod)
    assert exec_in_pod(namespace, pod, ["git", "status", "--porcelain"]).stdout == " M README\n"
    assert exec_in_pod(namespace, other, ["git", "status", "--porcelain"]).stdout == ""


def test_deleting_the_claim_deletes_its_pod_and_workdir(cluster, namespace, wait_for):
    create_pool(cluster, namespace, replicas=1)
    wait_for(lambda: ready_replicas(cluster, namespace) == 1, 60, "1 ready warm sandbox")
    create_claim(cluster, namespace, "c1")
    sandbox = wait_for(lambda: bound_sandbox(cluster, namespace, "c1"), 30, "claim c1 Ready")
    pod = pod_name(
        cluster.custom.get_namespaced_custom_object(
            CORE_GROUP, VERSION, namespace, "sandboxes", sandbox
        )
    )
    workdir = Path(
        cluster.core.read_namespaced_pod(pod, namespace).metadata.annotations["sandpool.io/workdir"]
    )
    assert workdir.is_dir()

    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "sandboxclaims", "c1")

    def pod_gone() -> bool:
        try:
            cluster.core.read_namespaced_pod(pod, namespace)
            return False
        except ApiException as e:
            return e.status == 404

    wait_for(pod_gone, 30, f"pod {pod} deleted")
    wait_for(lambda: not workdir.exists(), 10, f"workdir {workdir} removed")
