"""``sandpool bench --backend kubernetes`` on the local cluster: pods, warm and reuse run the same
burst against the real control plane and agent-sandbox controller (kwok nodes), and the report
carries every mode's figures and its timeline. No figure is asserted; the bench prints them."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from sandpool.bench import BenchConfig
from sandpool.bench.kubernetes import ClusterHooks, KubeOptions, run_kubernetes
from sandpool.core.task import Task
from tests.cluster.kwok_images import workdir_image

pytestmark = pytest.mark.cluster


def _repo(path) -> str:
    env = {"GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b", "PATH": "/usr/bin:/bin"}
    path.mkdir()
    (path / "main.py").write_text("print('hello')\n")
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", "-C", str(path), *argv], check=True, env=env)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()


async def test_bench_burst_runs_pods_warm_and_reuse_with_a_timeline(cluster, tmp_path) -> None:
    repo = tmp_path / "repo"
    commit = _repo(repo)

    def tasks(mode: str) -> list[Task]:
        tag = f"{mode}-{uuid.uuid4().hex[:6]}"
        return [Task(instance_id=f"img{i}", repo="bench/repo", base_commit=commit,
                     image=f"sandpool.bench/img-{i}:{tag}", problem_statement="burst") for i in range(2)]

    cfg = BenchConfig(backend="kubernetes", strategies=("pods", "warm", "reuse"), limit=2, rollouts=2,
                      concurrency=4, kubeconfig=cluster.kubeconfig)
    report = await run_kubernetes(cfg, tasks=tasks, opts=KubeOptions(ready_timeout=300),
                                  hooks=ClusterHooks(image_map=lambda n: workdir_image(n, repo)),
                                  say=lambda line: None)
    assert report.notes == [] or not any("FAILED" in n for n in report.notes), report.notes
    assert list(report.results) == ["pods", "warm", "reuse"]
    for name, r in report.results.items():
        assert r.outcomes == {"completed": 4} and r.reward_mean == 1.0, (name, r.outcomes)
        assert len(r.ttfc_samples) == 4 and r.round_trip.n == 4, name
        assert r.extra["pods created"] >= 1 and r.extra["API writes, sandpool"] >= 1, name
        assert any(s for _, s in r.extra["timeline"]), name  # pods seen by phase while it ran
    reuse = report.results["reuse"]
    assert (reuse.sandboxes_created, reuse.resets) == (2, 4)  # a sandbox per image, reset after each rollout
    assert report.results["pods"].extra["pods created"] == 4
    paths = report.write(tmp_path / "out", "bench_kubernetes")
    assert [p.name for p in paths] == ["bench_kubernetes.txt", "bench_kubernetes.json",
                                       "bench_kubernetes_ttfc_cdf.png", "bench_kubernetes_timeline.png"]
    assert "pods created" in paths[0].read_text()
