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


async def test_validate_says_which_listed_tests_were_absent_and_why_and_what_the_policy_refused(
        test_images_root, calc_task):
    other_file = calc_task.model_copy(update={
        "instance_id": "calc__p2p-in-a-missing-file",
        "PASS_TO_PASS": ("test_calc.py::test_zero", "test_other.py::test_x")})
    refused = calc_task.model_copy(update={
        "instance_id": "calc__gold-adds-a-conftest",
        "patch": calc_task.patch + ("diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n"
                                    "index 0000000..1111111\n--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1 @@\n"
                                    "+import os\n")})
    result = await validate_tasks([other_file, refused], lambda: LocalBackend(test_images_root), concurrency=2)
    by = {v.task_id: v for v in result.verdicts}
    missing = by["calc__p2p-in-a-missing-file"]
    assert missing.status == "broken" and (missing.gold, missing.empty) == (0.0, 0.0)
    assert "none of its tests ran on the pristine repo or with the gold patch" in missing.reason
    assert "exit 4" in missing.reason
    assert "file or directory not found: test_other.py" in missing.reason
    gold_refused = by["calc__gold-adds-a-conftest"]
    assert gold_refused.status == "broken"
    assert "the patch policy refuses it: conftest.py is a start-up or plugin hook" in gold_refused.reason


def test_run_validates_rows_never_validated_once_and_rejects_a_broken_task_before_scoring(
        test_images_root, calc_task, tmp_path):
    import uuid

    from typer.testing import CliRunner

    from sandpool.cli import app
    from sandpool.core.backends.local import image_dir
    from sandpool.core.paths import sandpool_home

    # The command line's backend reads sandpool_home()/images: the calc image, under that root.
    name = "sandpool.test/calc-cli:2"
    d = image_dir(sandpool_home() / "images", name)
    d.mkdir(parents=True, exist_ok=True)
    calc = json.loads((image_dir(test_images_root, calc_task.image) / "image.json").read_text())
    (d / "image.json").write_text(json.dumps({**calc, "name": name}))
    run = uuid.uuid4().hex[:8]  # rows never validated before
    good = calc_task.model_copy(update={"instance_id": f"calc__good-{run}", "image": name})
    broken = good.model_copy(update={"instance_id": f"calc__broken-{run}",
                                     "FAIL_TO_PASS": ("test_gone.py::test_add",)})
    rows = tmp_path / "rows.jsonl"
    rows.write_text(good.model_dump_json() + "\n" + broken.model_dump_json() + "\n")

    def sandpool_run(*extra: str):
        res = CliRunner().invoke(app, ["run", "--tasks", str(rows), "--rollouts", "2", "--policy", "oracle,noop",
                                       "--concurrency", "2", "--out", str(tmp_path / "out"), *extra])
        assert res.exit_code == 0, res.output
        lines = (tmp_path / "out" / "rollouts.jsonl").read_text().splitlines()
        return " ".join(res.output.split()), [json.loads(x) for x in lines]

    text, results = sandpool_run()
    assert "gold and empty patch on 2 task(s) not validated" in text
    outcomes = sorted((r["task_id"].split("-")[0], r["outcome"], r["reward"]) for r in results)
    assert outcomes == [("calc__broken", "rejected", None), ("calc__broken", "rejected", None),
                        ("calc__good", "completed", 0.0), ("calc__good", "completed", 1.0)]
    assert all(r["error"].startswith("validation: ") and "none of its tests ran" in r["error"]
               for r in results if r["outcome"] == "rejected")
    text, _ = sandpool_run()  # validated once per task and image: the second run asks nothing
    assert "not validated" not in text
