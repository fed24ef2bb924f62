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
    assert r["reuse"].pods_created == 20 and r["pods"].pods_created == 80
    assert r["warm"].pods_created >= 80  # a warm replica per claim, and refills
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
    result = CliRunner().invoke(app, ["bench", "--simulate", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "PREDICTED" in result.output and "within 20 %" in result.output
    # Each column names what it predicts: the shape, the clusters, the rate for the study.
    assert "reuse 8x2 1c" in result.output and "pods 1000x4 adaptive" in result.output
    assert (tmp_path / "simulate.json").exists() and (tmp_path / "simulate_ttfc_cdf.png").exists()
