"""The Kubernetes backend against the local cluster (real apiserver, agent-sandbox, kwok)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from prometheus_client import CollectorRegistry

from sandpool.core import Outcome, PoolLimits, SandboxPool, Task, errors, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend, gc
from sandpool.core.backends.kubernetes import _manifests as manifests
from sandpool.core.telemetry import PoolMetrics
from tests.cluster.kwok_images import workdir_image

pytestmark = pytest.mark.cluster

GROUP, VERSION = "extensions.agents.x-k8s.io", "v1beta1"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **_GIT_ENV},
    ).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, str, str]:
    """A two-commit repository standing in for a task image: (path, first, second commit)."""
    path = tmp_path_factory.mktemp("k8s-image") / "repo"
    path.mkdir()
    _git(path, "init", "-q", "-b", "main")
    (path / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (path / ".gitignore").write_text("*.log\n")
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", "one")
    first = _git(path, "rev-parse", "HEAD")
    (path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    _git(path, "commit", "-qam", "two")
    return path, first, _git(path, "rev-parse", "HEAD")


def image_map(repo_path: Path):
    return lambda name: workdir_image(name, repo_path)


def make_task(image: str, commit: str, i: int = 0) -> Task:
    return Task(
        instance_id=f"{image.rsplit('/', 1)[-1]}-{i}",
        repo="t/calc",
        base_commit=commit,
        image=image,
        problem_statement="p",
    )


def backend(cluster, namespace: str, repo_path: Path, **kw) -> KubernetesBackend:
    return KubernetesBackend(
        cluster.kubeconfig,
        namespace=namespace,
        run_id=kw.pop("run_id", None) or uuid.uuid4().hex[:8],
        image_map=image_map(repo_path),
        **kw,
    )


def custom(cluster, namespace: str, plural: str, run_id: str) -> list[dict]:
    return cluster.custom.list_namespaced_custom_object(
        GROUP, VERSION, namespace, plural, label_selector=f"sandpool.io/run-id={run_id}"
    )["items"]


def pods_of(cluster, namespace: str, run_id: str) -> list:
    return cluster.core.list_namespaced_pod(
        namespace, label_selector=f"sandpool.io/run-id={run_id}"
    ).items


async def eventually(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.2)
    return value


async def test_warm_pool_fills_to_the_strategy_target(cluster, namespace, repo):
    path, first, _ = repo
    be = backend(cluster, namespace, path)
    async with SandboxPool(be, "warm") as pool:
        slots = await pool.prepare(
            [make_task("sandpool.test/calc:1", first)], concurrency=3, rollouts_per_task=3
        )
        assert slots == {"sandpool.test/calc:1": 3}
        (wp,) = custom(cluster, namespace, "sandboxwarmpools", be.run_id)
        assert wp["spec"]["replicas"] == 3 and wp["status"]["readyReplicas"] == 3
        assert len(custom(cluster, namespace, "sandboxtemplates", be.run_id)) == 1
        assert custom(cluster, namespace, "sandboxclaims", be.run_id) == []  # warm, not claimed
        assert len(pods_of(cluster, namespace, be.run_id)) == 3


CHANNELS = pytest.mark.parametrize("channel", ["agent", "exec"])


@CHANNELS
async def test_claim_binds_a_warm_sandbox_and_exec_reports_exit_codes(
    cluster, namespace, repo, channel
):
    path, first, _ = repo
    be = backend(cluster, namespace, path, agent=channel == "agent")
    task = make_task("sandpool.test/calc:1", first)
    async with SandboxPool(be, "warm") as pool:
        await pool.prepare([task], concurrency=2)
        warm = {p.metadata.name for p in pods_of(cluster, namespace, be.run_id)}
        async with pool.claim(task) as lease:
            sb = lease.sandbox
            assert sb.claim is not None and sb.pod in warm  # adopted from the warm pool
            assert sb.channel == channel
            res = await lease.exec("echo out; echo err >&2; exit 3")
            assert (res.exit_code, res.stdout, res.stderr) == (3, b"out\n", b"err\n")
            assert sb.protocol == "v5.channel.k8s.io"
            res = await lease.exec("git rev-parse HEAD; pwd; echo $X", env={"X": "y"})
            assert res.text.split() == [first, "/testbed", "y"]
            res = await lease.exec(["sh", "-c", "kill -9 $$"])
            assert res.exit_code == 137 and not res.timed_out


@CHANNELS
async def test_exec_timeout_output_cap_and_binary_files(cluster, namespace, repo, channel):
    path, first, _ = repo
    be = backend(cluster, namespace, path, mode="pods", agent=channel == "agent")
    async with SandboxPool(be, "cold") as pool:
        async with pool.claim(make_task("sandpool.test/calc:1", first)) as lease:
            res = await lease.exec("setsid sleep 300 & sleep 300", timeout=1.0)
            assert res.timed_out and res.exit_code == 124  # the server-side timeout fired
            assert await lease.sandbox.processes() == []  # the group and the setsid escapee died
            res = await lease.exec("head -c 5000000 /dev/zero; echo done >&2", max_output=1 << 20)
            assert len(res.stdout) == 1 << 20 and res.stdout_truncated and res.stderr == b"done\n"
            blob = bytes(range(256)) * 700  # 179 KB, several chunks, every byte value
            await lease.write_file("/tmp/blob.bin", blob, mode=0o600)
            assert await lease.read_file("/tmp/blob.bin") == blob
            assert (await lease.exec("stat -c %a /tmp/blob.bin")).text.strip() == "600"
            await lease.write_file("sub/empty", b"")
            assert await lease.read_file("/testbed/sub/empty") == b""
            with pytest.raises(FileNotFoundError):
                await lease.read_file("/tmp/absent")
            assert lease.sandbox.channel == channel


async def test_agent_session_carries_every_command_of_a_sandbox_over_one_exec_stream(
    cluster, namespace, repo
):
    path, first, _ = repo
    be = backend(cluster, namespace, path, mode="pods")
    async with SandboxPool(be, "cold") as pool:
        async with pool.claim(make_task("sandpool.test/calc:1", first)) as lease:
            streams = be.api_stats["execs"]
            results = await asyncio.gather(*(lease.exec(f"echo {i}") for i in range(50)))
            assert [r.text for r in results] == [f"{i}\n" for i in range(50)]
            await lease.write_file("f.txt", b"x")
            assert await lease.read_file("f.txt") == b"x"
            await lease.exec("exec sleep 300 &")
            procs = await lease.sandbox.processes()
            while procs != ["sleep 300"]:  # the forked child has not exec'd sleep yet
                assert len(procs) == 1, procs  # the pod's one process, never the host's
                procs = await lease.sandbox.processes()
            assert await lease.sandbox.kill_strays() == 1
            assert be.api_stats["execs"] == streams == 1  # the session's one stream, nothing else


async def test_image_without_the_agents_interpreter_falls_back_to_one_exec_per_command(
    cluster, namespace, repo, caplog
):
    path, first, _ = repo
    be = backend(cluster, namespace, path, mode="pods", agent_python="no-such-python3")
    metrics = PoolMetrics(CollectorRegistry())
    async with SandboxPool(be, "cold", metrics=metrics) as pool:
        for _ in range(2):
            async with pool.claim(make_task("sandpool.test/calc:1", first)) as lease:
                assert lease.sandbox.channel == "exec"
                res = await lease.exec("echo out; exit 4")
                assert (res.exit_code, res.stdout) == (4, b"out\n")
    assert be.api_stats["agent_fallbacks"] == 1  # tried once per image, then not again
    assert be.api_stats["fallback_sandboxes"] == 2  # every sandbox on the fallback is counted
    assert metrics.registry.get_sample_value(
        "sandpool_kube_exec_fallbacks_total", {"reason": "agent_unavailable"}) == 2
    (warning,) = [r for r in caplog.records if "fall back to one pod exec" in r.getMessage()]
    assert "sandpool.test/calc:1" in warning.getMessage()


async def test_reuse_resets_in_the_pod_and_keeps_the_claim(cluster, namespace, repo, tmp_path):
    path, first, second = repo
    host_sentinel = Path("/tmp") / f"sandpool-host-sentinel-{uuid.uuid4().hex}"
    host_sentinel.write_text("host /tmp must survive a pod's reset")
    be = backend(cluster, namespace, path)
    task = make_task("sandpool.test/calc:1", first)
    try:
        async with SandboxPool(be, "reuse") as pool:
            await pool.prepare([task], concurrency=1, rollouts_per_task=2)
            async with pool.claim(task) as lease:
                sid, claim = lease.sandbox.id, lease.sandbox.claim
                await lease.exec(
                    "echo dirty >> calc.py; touch new.txt x.log; mkdir -p d/e; "
                    "touch /tmp/left-over; (sleep 1000 &); git checkout -q " + second
                )
                assert await lease.sandbox.processes() != []
            await eventually(lambda: pool.counters.resets == 1, 60, "the in-pod reset")
            async with pool.claim(task) as lease:
                assert (lease.sandbox.id, lease.sandbox.claim) == (sid, claim)  # same claim, reused
                res = await lease.exec(
                    "git status --porcelain --ignored; git rev-parse HEAD; ls -A /tmp"
                )
                assert res.text.split() == [first]
                assert await lease.sandbox.processes() == []
            assert pool.counters.quarantines == 0
            assert len(custom(cluster, namespace, "sandboxclaims", be.run_id)) == 1
        assert host_sentinel.exists()
    finally:
        host_sentinel.unlink(missing_ok=True)


async def test_pod_deleted_mid_rollout_is_infra_failed_and_retried(cluster, namespace, repo):
    path, first, _ = repo
    be = backend(cluster, namespace, path)
    task = make_task("sandpool.test/calc:1", first)
    killed: list[str] = []

    async def episode(lease) -> float:
        await lease.exec("true")
        if not killed:  # first attempt: the pod is deleted under the rollout
            killed.append(lease.sandbox.pod)
            cluster.core.delete_namespaced_pod(lease.sandbox.pod, namespace, grace_period_seconds=0)
            await eventually(lambda: not lease.sandbox.alive(), 30, "the watch to see the deletion")
        await lease.exec("git status")
        return 1.0

    async with SandboxPool(be, "warm") as pool:
        await pool.prepare([task], concurrency=1)
        retried = await run_rollout(pool, task, episode, retries=1)
        assert (retried.outcome, retried.attempts, retried.reward) == (Outcome.COMPLETED, 2, 1.0)
        assert pool.counters.infra_errors.get("sandbox_died") == 1
        killed.clear()
        failed = await run_rollout(pool, task, episode, retries=0)
        assert (failed.outcome, failed.reward, failed.error_kind) == (
            Outcome.INFRA_FAILED,
            None,
            "sandbox_died",
        )
        assert pool.counters.infra_errors.get("sandbox_died") == 2


async def test_gc_removes_only_its_own_runs_objects(cluster, namespace, repo):
    path, first, _ = repo
    mine, other = backend(cluster, namespace, path), backend(cluster, namespace, path)
    for be in (mine, other):
        await be.preflight()
        await be.hydrate("sandpool.test/calc:1")
        await be.set_warm_target("sandpool.test/calc:1", 1, reuse=False)
        await be.create("sandpool.test/calc:1")
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sandpool",
                "gc",
                "--run-id",
                mine.run_id,
                "--kubeconfig",
                str(cluster.kubeconfig),
                "--namespace",
                namespace,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "1 sandboxclaims" in proc.stdout
        for plural in ("sandboxclaims", "sandboxwarmpools", "sandboxtemplates"):
            assert custom(cluster, namespace, plural, mine.run_id) == []
            assert len(custom(cluster, namespace, plural, other.run_id)) == 1
        await eventually(
            lambda: not pods_of(cluster, namespace, mine.run_id), 60, "my pods deleted"
        )
        assert (
            len(pods_of(cluster, namespace, other.run_id)) == 2
        )  # its warm one and its claimed one
        assert await gc(mine.run_id, kubeconfig=cluster.kubeconfig, namespace=namespace) == {
            "sandboxclaims": 0,
            "sandboxes": 0,
            "sandboxwarmpools": 0,
            "sandboxtemplates": 0,
            "pods": 0,
        }
    finally:
        await mine.aclose()
        await other.aclose()  # a normal exit removes what the run made
    assert custom(cluster, namespace, "sandboxwarmpools", other.run_id) == []
    await eventually(
        lambda: not pods_of(cluster, namespace, other.run_id), 60, "other's pods deleted"
    )


async def test_pods_mode_makes_and_deletes_a_pod_per_rollout(cluster, namespace, repo):
    path, first, _ = repo
    be = backend(cluster, namespace, path, mode="pods")
    task = make_task("sandpool.test/calc:1", first)
    names: list[str] = []

    async def episode(lease) -> float:
        names.append(lease.sandbox.pod)
        assert lease.sandbox.claim is None
        return float((await lease.exec("git rev-parse HEAD")).text.strip() == first)

    async with SandboxPool(be, "cold") as pool:
        await pool.prepare([task], concurrency=1)
        results = [await run_rollout(pool, task, episode, rollout=i) for i in range(3)]
        assert [r.reward for r in results] == [1.0, 1.0, 1.0]
        assert len(set(names)) == 3 and pool.counters.created == 3
        await eventually(lambda: not pods_of(cluster, namespace, be.run_id), 60, "pods deleted")
        assert be.api_writes >= 6  # a create and a delete per rollout


async def test_burst_of_200_rollouts_over_50_images_accounts_for_every_rollout(
    cluster, namespace, repo
):
    path, first, _ = repo
    be = backend(cluster, namespace, path, qps=100, burst=200)
    tasks = [make_task(f"sandpool.test/burst-{i}:1", first, i) for i in range(50)]

    async def episode(lease) -> float:
        await lease.exec("git status --porcelain")
        res = await lease.exec("echo x > scratch.txt && cat scratch.txt")
        return float(res.text == "x\n")

    async with SandboxPool(be, "reuse", PoolLimits(claim_timeout=600)) as pool:
        t0 = time.monotonic()
        slots = await pool.prepare(tasks, concurrency=50, rollouts_per_task=4)
        assert sum(slots.values()) == 50

        async def lane(task: Task) -> list:
            return [await run_rollout(pool, task, episode, rollout=i) for i in range(4)]

        results = [r for rs in await asyncio.gather(*(lane(t) for t in tasks)) for r in rs]
        wall = time.monotonic() - t0
    assert len(results) == 200
    by = {o: sum(r.outcome is o for r in results) for o in Outcome}
    assert sum(by.values()) == 200 and by[Outcome.COMPLETED] == 200, by
    assert all(r.reward == 1.0 for r in results)
    assert pool.counters.created == 50 and pool.counters.resets >= 150
    print(f"burst 200/50 reuse: wall {wall:.1f} s, api writes {be.api_writes}, {be.api_stats}")


async def test_start_failures_surface_early(cluster, namespace, repo, tmp_path):
    path, first, _ = repo
    src = tmp_path / "gone"
    subprocess.run(["cp", "-a", str(path), str(src)], check=True)
    be = KubernetesBackend(
        cluster.kubeconfig,
        namespace=namespace,
        mode="pods",
        ready_timeout=20,
        image_map=lambda n: workdir_image(n, src),
    )
    try:
        await be.preflight()
        await be.hydrate("sandpool.test/calc:1")
        subprocess.run(["rm", "-rf", str(src)], check=True)  # the image vanishes after hydration
        # The cluster's provisioner records the failure on the pod; its write is best effort
        # (a lost write leaves the pod Pending), so either way the rollout sees an infra error.
        with pytest.raises((errors.SandboxStartError, errors.InfraTimeout)) as info:
            await be.create("sandpool.test/calc:1")
        if isinstance(info.value, errors.SandboxStartError):
            assert "CreateContainerError" in str(info.value) and "workdir-source" in str(info.value)
    finally:
        await be.aclose()
    be = backend(
        cluster, namespace, path, mode="pods", node_selector={"sandpool.io/no-such-node": "x"}
    )
    try:
        # The scheduler's reason, read from the watch: a ready_timeout expiry would raise
        # InfraTimeout without it. No node matches, however many the cluster has (a real node
        # may have joined the kwok ones, refused for its taint).
        with pytest.raises(errors.SandboxStartError, match=r"unschedulable: 0/\d+ nodes are available: "
                           r".*node\(s\) didn't match Pod's node affinity/selector"):
            await be.create("sandpool.test/calc:1")
    finally:
        await be.aclose()


def _token_kubeconfig(cluster, namespace: str, dest: Path) -> Path:
    """A kubeconfig for a fresh ServiceAccount that RBAC grants nothing."""
    core = cluster.core
    core.create_namespaced_service_account(
        namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="nobody"))
    )
    tok = core.create_namespaced_service_account_token(
        "nobody",
        namespace,
        k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(audiences=[])),
    )
    cfg = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    ctx = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])["context"]
    cfg["users"] = [{"name": "nobody", "user": {"token": tok.status.token}}]
    ctx["user"] = "nobody"
    dest.write_text(yaml.safe_dump(cfg))
    return dest


async def test_preflight_fails_with_one_clear_sentence(
    cluster, namespace, repo, tmp_path, monkeypatch
):
    path, _, _ = repo
    cases = []
    kc = _token_kubeconfig(cluster, namespace, tmp_path / "nobody.kubeconfig")
    cases.append((KubernetesBackend(kc, namespace=namespace), "RBAC denies .*create sandboxclaims.*patch sandboxes"))
    cases.append(
        (
            backend(cluster, namespace, path, runtime_class="gvisor-absent"),
            "runtimeClass 'gvisor-absent' does not exist",
        )
    )
    cases.append((backend(cluster, f"{namespace}-absent", path), "namespace .* does not exist"))
    cases.append(
        (
            KubernetesBackend(tmp_path / "no-kubeconfig", namespace=namespace),
            "kubeconfig .* does not exist",
        )
    )
    for be, pattern in cases:
        try:
            with pytest.raises(errors.BackendUnavailable, match=pattern) as info:
                await be.preflight()
            assert "\n" not in str(info.value)
        finally:
            await be.aclose()
    # An API group that is not served is what a cluster without the CRDs answers.
    monkeypatch.setattr(manifests, "EXT_GROUP", "extensions.agents.x-k8s.io.absent")
    be = backend(cluster, namespace, path)
    try:
        with pytest.raises(errors.BackendUnavailable, match="agent-sandbox CRDs are not installed"):
            await be.preflight()
    finally:
        await be.aclose()


async def test_invalid_image_is_rejected_before_anything_is_created(cluster, namespace, repo):
    path, _, _ = repo
    be = KubernetesBackend(
        cluster.kubeconfig,
        namespace=namespace,
        image_map={"bad": workdir_image("Not A Valid/Image::ref", path)},
    )
    try:
        with pytest.raises(errors.ImageNotFound, match="not a valid container image reference"):
            await be.hydrate("bad")
        with pytest.raises(errors.ImageNotFound, match="not in the backend's image_map"):
            await be.hydrate("unknown")
        assert be.api_writes == 0
    finally:
        await be.aclose()


async def test_preflight_warns_when_the_controller_has_the_warm_pool_over_creation_bug(
    cluster, namespace, repo, caplog
):
    path, _, _ = repo
    # A Deployment of the buggy controller release (0 replicas: only its image tag is read).
    apps = k8s.AppsV1Api(cluster.core.api_client)
    apps.create_namespaced_deployment(namespace, {
        "metadata": {"name": "agent-sandbox-controller"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "asc"}},
            "template": {
                "metadata": {"labels": {"app": "asc"}},
                "spec": {"containers": [{
                    "name": "c",
                    "image": "registry.k8s.io/agent-sandbox/agent-sandbox-controller:v0.5.3",
                }]},
            },
        },
    })
    be = backend(cluster, namespace, path)
    try:
        await be.preflight()
    finally:
        await be.aclose()
    (warning,) = [r.getMessage() for r in caplog.records if "issue 1215" in r.getMessage()]
    assert "v0.5.3" in warning and f"deployment {namespace}/agent-sandbox-controller" in warning
    caplog.clear()
    be = backend(cluster, namespace, path, controller_version="v1.0.3")  # the local cluster's
    try:
        await be.preflight()
    finally:
        await be.aclose()
    assert not [r for r in caplog.records if "issue 1215" in r.getMessage()]


async def test_placement_prepulls_each_image_onto_its_planned_node_and_steers_its_sandboxes_there(
    cluster, namespace, repo
):
    path, first, _ = repo
    be = backend(cluster, namespace, path, sandbox_objects=True, delete_batch_s=0.2)
    images = [f"sandpool.test/placed-{i}:{be.run_id}" for i in range(4)]
    sizes = {img: 2e9 for img in images}
    try:
        plan = await be.place(images, sizes, node_disk_bytes=5e9)  # 2 images per node at most
        assert sorted(plan.node_of) == sorted(images)
        assert "window 0" in plan.describe()
        stats = await be.prepull(plan.windows[0], name="w0")
        assert stats["images"] == len(plan.windows[0])
        assert pods_of(cluster, namespace, be.run_id) == []  # prepull pods deleted at once
        tasks = [make_task(img, first, i) for i, img in enumerate(plan.windows[0])]
        async with SandboxPool(be, "reuse") as pool:
            await pool.prepare(tasks, concurrency=len(tasks))
            for task in tasks:
                async with pool.claim(task) as lease:
                    pod = cluster.core.read_namespaced_pod(lease.sandbox.pod, namespace)
                    assert pod.spec.node_name == plan.node_of[task.image]
                    # prepulled: the sandbox's pod found its image on the node
                    assert pod.metadata.annotations["sandpool.io/image-cache"] == "hit"
                    assert lease.sandbox.owner[0] == "sandboxes"
            assert custom(cluster, namespace, "sandboxclaims", be.run_id) == []
            assert custom(cluster, namespace, "sandboxtemplates", be.run_id) == []
        writes = be.api_stats["writes_by"]
        assert writes["POST sandboxes"] == len(tasks)  # one write per held sandbox
        assert "DELETE sandboxes/x" not in writes  # deletes went out batched by label
    finally:
        await be.aclose()
    await eventually(lambda: not pods_of(cluster, namespace, be.run_id), 30, "pods deleted")
