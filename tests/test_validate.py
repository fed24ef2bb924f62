"""``sandpool validate`` on real sandboxes: gold must resolve, empty must not, broken tasks named."""

from __future__ import annotations

import json

from sandpool.core.backends.local import LocalBackend
from sandpool.core.metrics import RejectedTask
from sandpool.envs.grading.validate import validate_tasks


async def test_validate_passes_good_tasks_and_names_each_kind_of_broken_one(test_images_root, calc_task,
                                                                             calc_commits, tmp_path):
    no_fix = calc_task.model_copy(update={
        "instance_id": "calc__gold-does-not-fix",
        "patch": "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,3 @@\n"
                 "+# a comment is not a fix\n def add(a, b):\n     return a - b\n"})
    already = calc_task.model_copy(update={"instance_id": "calc__empty-resolves",
                                           "base_commit": calc_commits["clean"], "patch": ""})
    bad_patch = calc_task.model_copy(update={
        "instance_id": "calc__test-patch-misfits",
        "test_patch": "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"})
    ghost_p2p = calc_task.model_copy(update={"instance_id": "calc__p2p-missing",
                                             "PASS_TO_PASS": ("test_calc.py::test_does_not_exist",)})
    malformed = RejectedTask(task_id=None, row=7, reason="row 7: field 'base_commit' ...")
    result = await validate_tasks([calc_task, no_fix, already, bad_patch, ghost_p2p],
                                  lambda: LocalBackend(test_images_root), concurrency=2,
                                  rejected=[malformed])
    by = {v.task_id: v for v in result.verdicts}
    assert by[calc_task.instance_id].status == "pass" and (by[calc_task.instance_id].gold,
                                                           by[calc_task.instance_id].empty) == (1.0, 0.0)
    assert by["calc__gold-does-not-fix"].status == "broken" and "gold patch does not resolve" in by[
        "calc__gold-does-not-fix"].reason
    assert by["calc__empty-resolves"].status == "broken" and "empty patch resolves" in by["calc__empty-resolves"].reason
    assert by["calc__test-patch-misfits"].status == "broken" and "does not apply to base" in by[
        "calc__test-patch-misfits"].reason
    assert by["calc__p2p-missing"].status == "broken"
    assert by["<row 7>"].status == "broken"
    assert [t.instance_id for t in result.passing] == [calc_task.instance_id]
    result.write(tmp_path / "validated.jsonl", tmp_path / "validation.json")
    assert [json.loads(x)["instance_id"] for x in (tmp_path / "validated.jsonl").read_text().splitlines()] == [
        calc_task.instance_id]
    report = json.loads((tmp_path / "validation.json").read_text())
    assert len(report["verdicts"]) == 6
    assert "1 pass, 5 broken" in result.render_text()
