"""The model of :mod:`sandpool.bench.simulate` against the kwok runs, and its predictions.

``python -m sandpool.bench.predict --out DIR`` (``sandpool bench --simulate``) prints:

1. the model's error on every shape measured on the local cluster (``MEASURED``: one run
   each of ``bench/k8s_burst.py``, seed image model, 10 kwok nodes, 2 loaded cores), figure
   by figure, and whether it is within 20 %;
2. its predictions, marked as predicted: the seed's shape (4,578 images x 4 rollouts) in
   each mode on one cluster, and 30,000 sandboxes (7,500 images x 4) over 1, 3 and 10
   clusters, with and without the adaptive write rate on a tight API write budget;

and writes ``simulate.{txt,json}`` and a TTFC CDF plot to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sandpool.bench.simulate import SimParams, SimResult, error, simulate, summary

__all__ = ["MEASURED", "Measured", "compare", "predictions"]


@dataclass(frozen=True)
class Measured:
    """One figure measured on the kwok cluster: ``low..high`` when runs gave a range."""

    shape: str  # "<mode> <images>x<rollouts>[ c<concurrency>]"
    figure: str  # mean, p99, max (TTFC, s), pods, writes_per_rollout, pods_ratio
    low: float
    high: float
    source: str

    def error(self, predicted: float) -> float:
        """0 inside the range, else the relative distance to its nearest end."""
        if self.low <= predicted <= self.high:
            return 0.0
        return error(predicted, self.low if predicted < self.low else self.high)


_README = "README (bench/k8s_burst.py, one run each)"
_WARM = "warm claims at 40 images x 4, concurrency 40 (the claim-path study, several runs)"
_RUN100 = "bench/k8s_burst.py --images 100, one run at load average 15-284"

#: Every figure measured on the local cluster that the model is checked against.
MEASURED: tuple[Measured, ...] = (
    Measured("pods 200x4", "max", 150, 150, _README),
    Measured("pods 500x4", "max", 366, 366, _README),
    Measured("pods 1000x4", "max", 724, 724, _README),
    Measured("pods 200x4", "mean", 60, 60, _README),
    Measured("pods 500x4", "mean", 89, 89, _README),
    Measured("pods 1000x4", "mean", 176, 176, _README),
    Measured("reuse 200x4", "mean", 0.66, 0.66, _README),
    Measured("reuse 500x4", "mean", 0.56, 0.56, _README),
    Measured("reuse 1000x4", "mean", 0.48, 0.48, _README),
    Measured("reuse 200x4", "max", 2.4, 2.4, _README),
    Measured("reuse 500x4", "max", 2.8, 2.8, _README),
    Measured("reuse 1000x4", "max", 2.8, 2.8, _README),
    Measured("reuse 1000x4", "pods_ratio", 3.8, 3.8, _README),
    Measured("reuse 1000x4", "writes_per_rollout", 0.3, 0.3, _README),
    Measured("warm 40x4 c40", "mean", 7.8, 9.3, _WARM),
    Measured("warm 40x4 c40", "max", 12.6, 16.9, _WARM),
    Measured("warm 40x4 c40", "pods", 210, 210, _WARM),
    Measured("pods 100x4", "mean", 247.5, 247.5, _RUN100),
    Measured("pods 100x4", "p99", 404.6, 404.6, _RUN100),
    Measured("pods 100x4", "max", 404.8, 404.8, _RUN100),
    Measured("pods 100x4", "pods", 608, 608, _RUN100),
    Measured("pods 100x4", "writes_per_rollout", 3.07, 3.07, _RUN100),
    Measured("warm 100x4", "mean", 358.4, 358.4, _RUN100),
    Measured("warm 100x4", "p99", 673.8, 673.8, _RUN100),
    Measured("warm 100x4", "max", 681.0, 681.0, _RUN100),
    Measured("warm 100x4", "pods", 810, 810, _RUN100),
    Measured("reuse 100x4", "mean", 1.663, 1.663, _RUN100),
    Measured("reuse 100x4", "p99", 6.05, 6.05, _RUN100),
    Measured("reuse 100x4", "max", 6.139, 6.139, _RUN100),
    Measured("reuse 100x4", "pods", 110, 110, _RUN100),
    Measured("reuse 100x4", "writes_per_rollout", 0.347, 0.347, _RUN100),
)


def _run(shape: str, params: SimParams, cache: dict[str, SimResult]) -> SimResult:
    if shape not in cache:
        mode, rest = shape.split(" ", 1)
        dims, _, conc = rest.partition(" c")
        images, rollouts = (int(x) for x in dims.split("x"))
        cache[shape] = simulate(mode, images=images, rollouts=rollouts, params=params,
                                concurrency=int(conc) if conc else None)
    return cache[shape]


def _figure(shape: str, figure: str, params: SimParams, cache: dict[str, SimResult]) -> float:
    r = _run(shape, params, cache)
    if figure in ("mean", "p99", "max"):
        return float(getattr(r.ttfc, f"{figure}_s"))
    if figure == "pods":
        return float(r.pods_created)
    if figure == "writes_per_rollout":
        return r.sandpool_writes / max(1, len(r.ttfc_samples))
    if figure == "pods_ratio":  # pods of the pods baseline over reuse's, same shape
        base = _run("pods " + shape.split(" ", 1)[1], params, cache)
        return base.pods_created / max(1, r.pods_created)
    raise ValueError(f"figure {figure!r} is not known")


def compare(params: SimParams | None = None) -> list[dict]:
    """The model's prediction of every :data:`MEASURED` figure, and its error."""
    p = params or SimParams()
    cache: dict[str, SimResult] = {}
    rows = []
    for m in MEASURED:
        got = _figure(m.shape, m.figure, p, cache)
        rows.append({"shape": m.shape, "figure": m.figure, "measured": [m.low, m.high],
                     "predicted": got, "error": m.error(got), "source": m.source})
    return rows


def predictions(params: SimParams | None = None) -> list[SimResult]:
    """The seed's shape in every mode on one cluster; 30,000 sandboxes over 1, 3 and 10
    clusters (warm and reuse)."""
    p = params or SimParams()
    out = [simulate(mode, images=4578, rollouts=4, params=p) for mode in ("pods", "warm", "reuse")]
    for clusters in (1, 3, 10):
        for mode in ("warm", "reuse"):
            out.append(simulate(mode, images=7500, rollouts=4, params=p, clusters=clusters))
    return out


def budget_study(params: SimParams | None = None) -> list[SimResult]:
    """The seed's shape in the pods baseline on an API server of few write seats, with the
    fixed and the adaptive write rate."""
    p = replace(params or SimParams(), api_seats=4, api_write_s=0.1)
    return [simulate("pods", images=1000, rollouts=4, params=replace(p, adaptive_rate=a))
            for a in (False, True)]


def render(rows: list[dict]) -> str:
    """The comparison table: measured, predicted, error, within 20 % or not."""
    lines = [f"{'shape':<16}{'figure':<20}{'measured':>14}{'predicted':>12}{'error':>8}"]
    for r in rows:
        lo, hi = r["measured"]
        meas = f"{lo:g}" if lo == hi else f"{lo:g}..{hi:g}"
        lines.append(f"{r['shape']:<16}{r['figure']:<20}{meas:>14}{r['predicted']:>12.3g}"
                     f"{r['error']:>7.0%}{'' if r['error'] <= 0.2 else '  OVER 20%'}")
    inside = sum(r["error"] <= 0.2 for r in rows)
    lines.append(f"within 20 %: {inside} of {len(rows)} figures")
    return "\n".join(lines)


def plot(results: list[SimResult], path: Path) -> None:
    """A CDF of TTFC per predicted run, titled as predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = sorted(s * 1000 for s in r.ttfc_samples)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{r.mode}, {r.images}x{r.rollouts}, {r.clusters} cluster(s)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first command (ms, log scale)")
    ax.set_ylabel("fraction of rollouts")
    ax.set_title("TTFC CDF, PREDICTED by the discrete-event model (not a run)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    """Print and write the comparison and the predictions; return the text."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args(argv)
    params = SimParams()
    rows = compare(params)
    preds = predictions(params)
    study = budget_study(params)
    text = "\n\n".join([
        "model error on the shapes measured on the local (kwok) cluster", render(rows),
        summary(preds), "pods 1000x4 on an API server of 4 write seats: fixed vs adaptive rate",
        summary(study, ["pods 1000x4 fixed", "pods 1000x4 adaptive"])])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulate.txt").write_text(text + "\n")
    (args.out / "simulate.json").write_text(json.dumps(
        {"predicted": True, "params": asdict(params), "compare": rows,
         "predictions": [r.as_dict() for r in preds],
         "write_budget": [r.as_dict() | {"adaptive": a} for r, a in zip(study, (False, True),
                                                                          strict=True)]},
        indent=1))
    plot(preds, args.out / "simulate_ttfc_cdf.png")
    print(text)
    return text


if __name__ == "__main__":
    main()
