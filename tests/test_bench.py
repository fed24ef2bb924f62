"""``sandpool bench`` on the local backend, for real: bubblewrap sandboxes, OCI images, and the
Docker baselines in Debian's docker.io, with the host CPU meter. No figure is asserted (the
benchmark prints them beside their baselines); what is asserted is that every strategy ran the
whole workload, graded as the task's harness grades, and reported every field."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from sandpool.bench.cpu import CpuMeter
from sandpool.cli import app


def test_bench_runs_sandpool_and_docker_strategies_side_by_side(tmp_path, oci_images) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "--strategies", "reuse,warm,docker-run,docker-exec",
                                      "--limit", "2", "--rollouts", "2", "--concurrency", "2",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    for row in ("TTFC p50 (ms)", "TTFC p99 (ms)", "TTFC max (ms)", "claim part p50 (ms)",
                "first command p50 (ms)", "exec round trip p50 (ms)",
                "rollouts / min", "host CPU-s / rollout", "load avg 1m start/end"):
        assert row in result.output
    assert "reuse TTFC p50" in result.output and "x below docker-run's" in result.output
    report = json.loads((out / "bench_local.json").read_text())
    assert list(report["results"]) == ["reuse", "warm", "docker-run", "docker-exec"]
    for name, r in report["results"].items():
        # Two tasks x two rollouts: the oracle (rollout 0) resolves, the no-op (rollout 1) does not.
        assert r["outcomes"] == {"completed": 4}, (name, r["outcomes"])
        assert r["reward_mean"] == 0.5, name
        assert len(r["ttfc_samples"]) == 4 and r["round_trip"]["n"] == 4, name
        # TTFC's parts: the claim's (before the first command is sent) and the command's own.
        assert r["claim"]["n"] == r["first_command"]["n"] == 4, name
        for part in ("claim", "first_command"):  # each is at most the TTFC it is part of
            assert r[part]["p50_s"] <= r["ttfc"]["p50_s"] and r[part]["max_s"] <= r["ttfc"]["max_s"], name
        assert r["cpu_s"] > 0 and 0 < r["cpu_client_s"] <= r["cpu_s"], name
    assert report["results"]["docker-run"]["sandboxes_created"] == 4
    reuse = report["results"]["reuse"]
    assert reuse["sandboxes_created"] == 2 and reuse["resets"] >= 4 and reuse["quarantines"] == 0
    assert (out / "bench_local.txt").read_text().startswith("sandpool bench, local backend")
    assert (out / "bench_local_ttfc_cdf.png").stat().st_size > 0
    assert not list((tmp_path / "out").glob("*timeline*"))  # only Kubernetes has one


def test_bench_refuses_unknown_strategies_and_docker_on_images_it_cannot_run(tmp_path) -> None:
    bad = CliRunner().invoke(app, ["bench", "--strategies", "reuse,lukewarm", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "lukewarm" in bad.output and "docker-run" in bad.output
    rows = tmp_path / "tasks.jsonl"
    rows.write_text(json.dumps({"instance_id": "x__y-1", "repo": "x/y", "base_commit": "a" * 40,
                                "image": "sandpool.local/not-an-oci-image:1", "problem_statement": "p",
                                "FAIL_TO_PASS": ["t.py::test"]}) + "\n")
    docker = CliRunner().invoke(app, ["bench", "--strategies", "docker-run", "--tasks", str(rows),
                                      "--out", str(tmp_path)])
    text = " ".join(docker.output.split())
    assert docker.exit_code == 2 and "not an OCI image in the local store" in text, text
    assert "sandpool images pull" in text


def test_cpu_meter_removes_the_group_a_killed_run_left(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is gone: the group stands for a run killed before it removed its own
    left = Path(f"/sys/fs/cgroup/cpuacct/sandpool-bench-{dead.pid}")
    left.mkdir()
    with CpuMeter(f"sandpool-bench-test-{os.getpid()}"):
        assert not left.exists()


def test_cpu_meter_counts_what_its_children_use(tmp_path) -> None:
    with CpuMeter(f"sandpool-bench-test-{os.getpid()}") as meter:
        assert meter.available, meter.why_not
        before, children = meter.read(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
        spent = meter.read() - before
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    assert used > 0 and spent >= used * 0.95, (spent, used)
    assert not os.path.exists(f"/sys/fs/cgroup/cpuacct/sandpool-bench-test-{os.getpid()}")
