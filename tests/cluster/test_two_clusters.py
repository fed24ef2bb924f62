"""One pool over two real control planes (hack/cluster, each in its own run directory), and
one of them going away mid-run: its rollouts are retried on the other and counted."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from sandpool.core import Outcome, PoolLimits, SandboxPool, Workload, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.backends.multi import MultiClusterBackend
from tests.cluster.conftest import CLUSTER_PY, ClusterInfo, wait_until
from tests.cluster.kwok_images import workdir_image
from tests.cluster.test_kubernetes_backend import make_task, repo  # noqa: F401

pytestmark = pytest.mark.cluster

IMAGE = "sandpool.test/calc:1"


def _cluster_cmd(run_dir: Path, *args: str) -> None:
    env = dict(os.environ, SANDPOOL_CLUSTER_RUN_DIR=str(run_dir))
    env.pop("SANDPOOL_CLUSTER_KUBECONFIG", None)
    subprocess.run([sys.executable, str(CLUSTER_PY), *args], check=True, env=env)


@pytest.fixture(scope="module")
def second_cluster(cluster: ClusterInfo) -> Iterator[ClusterInfo]:
    """A second control plane with two kwok nodes, in a run directory beside the first's."""
    run_dir = cluster.run_dir.parent / f"{cluster.run_dir.name}-second-{uuid.uuid4().hex[:6]}"
    run_dir.mkdir(parents=True)
    (run_dir / "owner.pid").write_text(str(os.getpid()))  # reaped with the session's own
    try:
        _cluster_cmd(run_dir, "up", "--nodes", "2")
        state = json.loads((run_dir / "state.json").read_text())
        api = config.new_client_from_config(config_file=state["kubeconfig"])
        try:
            yield ClusterInfo(kubeconfig=Path(state["kubeconfig"]), api_client=api,
                              run_dir=run_dir, run_id=cluster.run_id)
        finally:
            api.close()
    finally:
        _cluster_cmd(run_dir, "down")
        shutil.rmtree(run_dir, ignore_errors=True)


def _namespace_on(info: ClusterInfo, name: str) -> None:
    core = client.CoreV1Api(info.api_client)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_until(lambda: core.list_namespaced_service_account(name).items, 60, "default SA")


async def test_a_cluster_that_goes_away_mid_run_drains_to_the_other_and_its_rollouts_are_retried(
    cluster, second_cluster, namespace, repo
):
    path, first, _ = repo
    _namespace_on(second_cluster, namespace)

    def member(info: ClusterInfo, name: str) -> KubernetesBackend:
        return KubernetesBackend(info.kubeconfig, namespace=namespace, cluster=name,
                                 ready_timeout=60, api_retries=3,
                                 image_map=lambda n: workdir_image(n, path))

    multi = MultiClusterBackend({"one": member(cluster, "one"), "two": member(second_cluster, "two")},
                                placement="round-robin", down_timeout=20)
    on_two = asyncio.Event()  # a rollout is running on "two"
    gone = asyncio.Event()  # "two" is down
    completed_on: Counter[str] = Counter()

    async def episode(lease) -> float:
        assert (await lease.exec("git status --porcelain")).ok
        home = multi.cluster_of(lease.sandbox)
        if home == "two" and not gone.is_set():
            on_two.set()
            await gone.wait()
        reward = float((await lease.exec("echo ok")).text == "ok\n")
        completed_on[home] += 1
        return reward

    async def take_two_down() -> None:
        await on_two.wait()
        await asyncio.to_thread(_cluster_cmd, second_cluster.run_dir, "down")
        gone.set()

    tasks = [make_task(IMAGE, first, i) for i in range(12)]
    async with SandboxPool(multi, "warm", PoolLimits(claim_timeout=300)) as pool:
        await pool.prepare(tasks[:4], concurrency=4)
        results, _ = await asyncio.gather(
            asyncio.gather(*(run_rollout(pool, t, episode, retries=3) for t in tasks)),
            take_two_down())
        report = pool.report(Workload(tasks=12, images=1, rollouts=12, concurrency=12,
                                      backend=multi.name, strategy="warm"), list(results), 0.0)
    print(report.render_text())
    assert report.unaccounted == 0
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 12, [r.error for r in results]
    one, two = report.clusters
    assert two.down is not None and one.down is None
    assert two.lost >= 1  # the rollouts waiting on it lost their sandboxes...
    retried = [r for r in results if r.attempts > 1]
    assert len(retried) >= two.lost  # ...and were retried, and counted
    assert completed_on == {"one": 12}  # every one ended on the cluster still up
