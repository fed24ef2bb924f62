"""The discrete-event model of a Kubernetes burst (sandpool.bench.simulate) on small shapes."""

from __future__ import annotations

from dataclasses import replace

from typer.testing import CliRunner

from sandpool.bench.predict import MEASURED, compare
from sandpool.bench.simulate import SimParams, simulate
from sandpool.cli import app


def test_the_same_seed_gives_the_same_burst():
    a = simulate("pods", images=12, rollouts=2)
    b = simulate("pods", images=12, rollouts=2)
    assert a.ttfc_samples == b.ttfc_samples and a.sandpool_writes == b.sandpool_writes


def test_reuse_claims_faster_and_makes_fewer_pods_than_warm_and_pods():
    r = {m: simulate(m, images=20, rollouts=4) for m in ("pods", "warm", "reuse")}
    assert r["reuse"].ttfc.max_s < min(r["warm"].ttfc.max_s, r["pods"].ttfc.max_s)
    assert r["reuse"].pods_created - r["reuse"].prepulls == 20 and r["pods"].pods_created == 80
    assert r["warm"].pods_created - r["warm"].prepulls >= 80  # a warm sandbox per claim
    assert all(len(x.ttfc_samples) == 80 for x in r.values())  # every rollout ran


def test_a_corpus_larger_than_the_disks_runs_in_windows_and_pulls_ahead():
    small = replace(SimParams(), nodes=2, disk_gb=10)
    r = simulate("reuse", images=16, rollouts=1, params=small)
    assert r.windows > 1 and len(r.ttfc_samples) == 16


def test_more_clusters_shorten_the_pods_burst():
    one = simulate("pods", images=60, rollouts=2)
    three = simulate("pods", images=60, rollouts=2, clusters=3)
    assert three.ttfc.max_s < one.ttfc.max_s


def test_on_a_tight_write_budget_the_adaptive_rate_meets_fewer_429s():
    tight = replace(SimParams(), api_seats=2, api_write_s=0.1)
    fixed = simulate("pods", images=60, rollouts=2, params=replace(tight, adaptive_rate=False))
    adaptive = simulate("pods", images=60, rollouts=2, params=tight)
    assert fixed.retried_429 > 0 and adaptive.retried_429 < fixed.retried_429
    assert len(adaptive.ttfc_samples) == len(fixed.ttfc_samples) == 120  # none lost


def test_every_measured_figure_gets_a_prediction_and_an_error():
    rows = compare(replace(SimParams(), seed=3))
    assert len(rows) == len(MEASURED)
    assert all(r["predicted"] > 0 and r["error"] >= 0 for r in rows)


def test_bench_simulate_prints_predictions_marked_as_predicted(tmp_path, monkeypatch):
    import sandpool.bench.predict as predict

    small = [simulate("reuse", images=8, rollouts=2)]
    monkeypatch.setattr(predict, "predictions", lambda params=None: small)
    monkeypatch.setattr(predict, "budget_study", lambda params=None: small * 2)
    monkeypatch.setattr(predict, "pull_study", lambda params=None: small * 2)
    result = CliRunner().invoke(app, ["bench", "--simulate", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "PREDICTED" in result.output and "within 20 %" in result.output
    # Each column names what it predicts: the shape, the clusters, the rate for the study.
    assert "reuse 8x2 1c" in result.output and "pods 1000x4 adaptive" in result.output
    assert (tmp_path / "simulate.json").exists() and (tmp_path / "simulate_ttfc_cdf.png").exists()
    assert f"reports: {tmp_path / 'simulate.txt'}  {tmp_path / 'simulate.json'}" in result.output


def test_shared_capacity_is_split_among_the_jobs_in_flight():
    import simpy

    from sandpool.bench.simcluster import Shared

    env = simpy.Environment()
    cpus = Shared(env, 2.0, per_job=1.0)
    done: dict[str, float] = {}

    def job(name: str, units: float, start: float):
        yield env.timeout(start)
        yield cpus.run(units)
        done[name] = env.now

    for name, units, start in (("a", 1.0, 0.0), ("b", 1.0, 0.0), ("c", 1.0, 0.0), ("d", 0.5, 3.0)):
        env.process(job(name, units, start))
    env.run()
    # Three jobs on two CPUs each get 2/3 of one: 1.5 s; one alone gets a whole CPU, no more.
    assert done["a"] == done["b"] == done["c"] == 1.5
    assert done["d"] == 3.5


def test_lanes_follow_the_strategys_plan_and_a_claimed_warm_pod_is_refilled():
    # 10 images x 4 at concurrency 10, a standing warm pool: one lane (and one warm pod) per
    # image, its four rollouts one after another, each claim refilled by the controller.
    standing = replace(SimParams(), exact=False)
    r = simulate("warm", images=10, rollouts=4, concurrency=10, params=standing)
    assert len(r.ttfc_samples) == 40 and r.pods_created - r.prepulls == 10 + 40
    # Every rollout at once: four warm pods per image before the first claim.
    full = simulate("warm", images=10, rollouts=4, params=standing)
    assert full.pods_created - full.prepulls == 80
    # The burst announced up front: its claims' pods only, and a refill where the
    # controller refilled before the pool was lowered; none waits for a refill.
    exact = simulate("warm", images=10, rollouts=4, concurrency=10)
    never = simulate("warm", images=10, rollouts=4, concurrency=10,
                     params=replace(SimParams(), reconcile_s=1e9))
    assert never.pods_created - never.prepulls == 40
    assert 40 < exact.pods_created - exact.prepulls < 80
    # On a shared host, refills compete with the claims: 40 lanes wait for them, a burst
    # announced up front does not.
    assert (simulate("warm", images=40, rollouts=4, concurrency=40).ttfc.mean_s
            < simulate("warm", images=40, rollouts=4, concurrency=40, params=standing).ttfc.mean_s)


def test_a_shared_host_slows_a_burst_that_separate_nodes_do_not():
    shared = simulate("warm", images=30, rollouts=4, concurrency=30)
    separate = simulate("warm", images=30, rollouts=4, concurrency=30,
                        params=replace(SimParams(), host_cpus=0))
    assert separate.ttfc.mean_s < shared.ttfc.mean_s


def test_a_real_cluster_takes_the_real_nodes_figures_and_shares_no_host():
    from sandpool.bench.predict import REAL_NODE, real_cluster

    real = real_cluster()
    assert real.host_cpus == 0 and real.exec_s == REAL_NODE["exec_agent_s"]
    assert real.boot_s == REAL_NODE["pod_start_cached_s"] and real.reset_s == REAL_NODE["reset_s"]
    # The agent: the sandbox start beyond the pod's, and the pristine record.
    assert real.agent_s == (REAL_NODE["sandbox_start_s"] - REAL_NODE["pod_start_cached_s"]
                            + REAL_NODE["record_s"])
    # Its pods start faster than kwok's on this machine's shared cores.
    kwok = simulate("warm", images=40, rollouts=4, concurrency=40)
    assert simulate("warm", images=40, rollouts=4, concurrency=40,
                    params=real).ttfc.mean_s < kwok.ttfc.mean_s
