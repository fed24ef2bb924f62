"""Faults of real containers during a burst on the real node (``bench/_real_faults.py``): every
rollout is accounted for once, nothing is lost, no pod is left behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _real_faults import REAL_FAULTS, run_real_fault  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", REAL_FAULTS)
async def test_a_fault_of_a_real_container_loses_no_rollout_and_leaves_no_pod(
    cluster, namespace, real_node, real_images, fault
):
    task = json.loads(Path(real_images["task"]).read_text())
    row = await run_real_fault(fault, cluster.run_dir, task, [real_images["swe"]],
                               namespace=namespace, rollouts=3)
    print(row)
    assert row["unaccounted"] == 0 and row["lost"] == 0 and row["dup"] == 0, row
    assert row["requested"] == sum(row[o] for o in ("completed", "infra_failed", "task_failed",
                                                     "rejected")), row
    assert row["orphans"] == {"pods": 0}, row
    if fault == "real_none":
        assert row["completed"] == row["requested"] and row["resolved"] == row["requested"], row
    if fault == "real_image_unpullable":  # failed on the pull's error, not by waiting it out
        assert row["infra_failed"] == 3, row
        assert row["infra_errors"].get("InfraTimeout", 0) == 0, row
