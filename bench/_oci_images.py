"""The ``--images oci`` half of bench/local_strategies.py: the pack's image directories vs OCI images.

The OCI images are ``sandpool bench --tasks oci``'s (:func:`sandpool.bench.workload.oci_tasks`).
Disk per image is measured on disk (blocks, hard links once): image directories for the
current images; the unique unpacked layers for OCI images.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from sandpool.core.images import ImageStore

__all__ = ["disk_per_image_current", "side_by_side"]


def _du(paths: list[str]) -> int:
    out = subprocess.run(["du", "-s", "-B1", "-c", "--", *paths], capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def disk_per_image_current(images_root: Path, names: set[str]) -> float:
    """Bytes on disk per image directory (its repo, plus the venv it shares), averaged."""
    from sandpool.core.backends.local import image_dir

    dirs: set[str] = set()
    for name in names:
        meta = json.loads((image_dir(images_root, name) / "image.json").read_text())
        dirs |= {meta["repo"], meta["venv"]}
    return _du(sorted(dirs)) / max(1, len(names))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def side_by_side(cur: dict, oci: dict, disk_cur: float, store: ImageStore, n_oci: int) -> list[str]:
    """Rows: cold start, warm/reuse TTFC, reset time, disk per image; current | OCI | ratio.

    ``cur`` and ``oci`` map strategy names to :class:`sandpool.bench.StrategyResult`.
    """
    def reset_mean(r):  # noqa: ANN001, ANN202
        pool = r.report.pool
        return pool.reset_total_s / pool.resets if pool.resets else None

    rows = [
        ("cold start p50 (ms)", cur["cold"].ttfc.p50_s, oci["cold"].ttfc.p50_s),
        ("cold start max (ms)", cur["cold"].ttfc.max_s, oci["cold"].ttfc.max_s),
        ("warm TTFC p50 (ms)", cur["warm"].ttfc.p50_s, oci["warm"].ttfc.p50_s),
        ("warm TTFC max (ms)", cur["warm"].ttfc.max_s, oci["warm"].ttfc.max_s),
        ("reuse TTFC p50 (ms)", cur["reuse"].ttfc.p50_s, oci["reuse"].ttfc.p50_s),
        ("reuse TTFC max (ms)", cur["reuse"].ttfc.max_s, oci["reuse"].ttfc.max_s),
        ("reset mean (ms)", reset_mean(cur["reuse"]), reset_mean(oci["reuse"])),
        ("reset max (ms)", cur["reuse"].report.pool.reset_max_s, oci["reuse"].report.pool.reset_max_s),
    ]
    lines = [f"{'':<24}{'current':>12}{'oci':>12}{'oci/current':>13}"]
    for label, a, b in rows:
        ratio = f"{b / a:.2f}x" if a and b else "-"
        lines.append(f"{label:<24}{_ms(a):>12}{_ms(b):>12}{ratio:>13}")
    u = store.usage()
    per_oci = u.on_disk / max(1, u.images)
    lines.append(f"{'disk per image (MiB)':<24}{disk_cur / 2**20:>12.1f}{per_oci / 2**20:>12.1f}"
                 f"{per_oci / disk_cur if disk_cur else 0:>12.2f}x")
    lines.append(f"OCI store: {u.images} images, {u.layers} layers, {u.on_disk / 2**20:.1f} MiB on disk "
                 f"for {u.sum_image_sizes / 2**20:.1f} MiB of images unpacked "
                 f"({u.sum_blob_sizes / 2**20:.1f} MiB shipped)")
    cold_ratio = (oci["cold"].ttfc.p50_s or 0) / (cur["cold"].ttfc.p50_s or float("inf"))
    reuse_ratio = (oci["reuse"].ttfc.p50_s or 0) / (cur["reuse"].ttfc.p50_s or float("inf"))
    lines += [f"{'PASS' if cold_ratio <= 1.5 else 'MISS'}  OCI cold start p50 = {cold_ratio:.2f}x current <= 1.5x",
              f"{'PASS' if reuse_ratio <= 1.25 else 'MISS'}  OCI reuse TTFC p50 = {reuse_ratio:.2f}x current "
              "(unchanged: <= 1.25x, noise on a loaded 2-core machine)"]
    return lines
