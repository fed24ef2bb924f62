"""The TTFC CDF plot every strategy-comparing benchmark draws."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sandpool.core.metrics import Report  # noqa: E402


def ttfc_cdf(reports: dict[str, Report], path: Path, title: str) -> None:
    """Draw the CDF of per-rollout TTFC (log-scale milliseconds), one line per report, to ``path``."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rep in reports.items():
        xs = sorted(r.ttfc_s * 1000 for r in rep.rollouts if r.ttfc_s is not None)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (max {xs[-1]:.0f} ms)" if xs else name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first command (ms, log scale)")
    ax.set_ylabel("fraction of rollouts")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
