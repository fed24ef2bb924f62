"""sandpool's grading beside the SWE-bench harness itself, on the same tasks, images and patches.

Two real tasks from sdists (:mod:`tests.swebench_harness.images`): marshmallow 3.19 (swebench's
``pytest -rA`` and ``parse_log_pytest``) and Django 5.2 (``tests/runtests.py`` and
``parse_log_django``, a parser other than pytest's). Each gets seven patches: the gold patch,
the empty patch, a wrong fix, three mutants of the gold patch, and case 002's cheat (code that
prints a passing line for every test id and exits 0). The harness is swebench 4.1.0's
``run_evaluation`` in Debian's Docker; sandpool's is ``grade_patch`` on the local backend.

Every honest patch gets the same verdict from both. The cheat fools the harness's log parser;
sandpool scores it 0 and says why. The table is printed and written to
``reports/swebench_harness/verdicts.txt``; the harness's own logs are kept beside it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from sandpool.bench.docker import DockerDaemon
from sandpool.core.images import ImageStore, hydrate
from sandpool.core.paths import sandpool_home
from sandpool.core.task import Task
from tests.swebench_harness import images
from tests.swebench_harness.compare import (
    HONEST,
    Verdict,
    load_into_daemon,
    run_harness,
    run_sandpool,
    swebench_id,
    table,
)

REPORT = Path(__file__).resolve().parents[2] / "reports" / "swebench_harness" / "verdicts.txt"


@pytest.fixture(scope="module")
def built() -> list[tuple[Path, dict, dict[str, str], images.Recipe]]:
    return [(*images.build(r), r) for r in images.RECIPES]


@pytest.fixture(scope="module")
def store(built) -> ImageStore:
    s = ImageStore(sandpool_home() / f"swebench-harness-store-v{images.VERSION}")
    for layout, task, _, recipe in built:
        if s.resolve(task["image"]) is None:
            hydrate(f"oci:{layout}:{recipe.name}", name=task["image"], store=s)
    return s


@pytest.mark.timeout(3600)  # 14 harness runs and 14 of sandpool's on a shared 2-core machine
def test_sandpool_and_the_swebench_harness_agree_on_honest_patches_and_only_sandpool_sees_the_cheat(
        built, store) -> None:
    rows, patches, cases = [], {}, []
    with DockerDaemon(init=True) as daemon:  # init: the harness's stop(timeout=15) returns at once
        for layout, task, by_case, recipe in built:
            load_into_daemon(daemon, layout, recipe.name, task, list(images.CASES))
            for case in images.CASES:
                sid = swebench_id(task["instance_id"], case)
                rows.append({**task, "instance_id": sid})
                patches[sid] = by_case[case]
                cases.append((Task.model_validate(task), case, by_case[case]))
        work = REPORT.parent / "swebench"  # its logs stay for reading after the run
        shutil.rmtree(work, ignore_errors=True)
        harness = run_harness(daemon, rows, patches, work)
    graded = asyncio.run(run_sandpool(store, cases))
    verdicts = [Verdict(task=t.instance_id, case=c, harness=harness[swebench_id(t.instance_id, c)],
                        sandpool=g) for (t, c, _), g in zip(cases, graded, strict=True)]
    text = table(verdicts)
    print("\n" + text)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(text + "\n")
    assert "error" not in {v.harness for v in verdicts}, text
    for v in verdicts:
        if v.case in HONEST:
            assert v.agree, f"{v.task} {v.case}: harness {v.harness}, sandpool {v.sandpool}\n{text}"
        if v.case == "gold":
            assert v.harness_resolved and v.sandpool.reward == 1.0, text
        if v.case in ("empty", "wrong"):
            assert not v.harness_resolved and v.sandpool.reward == 0.0, text
        if v.case == "cheat":
            assert v.harness_resolved, f"the cheat should fool the harness's log parser\n{text}"
            assert v.sandpool.reward == 0.0 and v.why(), text
