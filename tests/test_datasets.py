"""Published dataset rows load from JSONL, JSON and Parquet; images are derived as each harness does.

The rows use the column sets the datasets publish (SWE-bench Verified, R2E-Gym, SWE-smith dataset
cards) with this repo's calc image as their environment, so the loaded tasks also run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sandpool.core import errors
from sandpool.core.metrics import RejectedTask
from sandpool.envs.datasets import detect_format, swebench_image
from sandpool.envs.grading import grade
from sandpool.envs.grading.harness import harness_of, reverse_patch
from sandpool.envs.tasks import load_tasks, local_base_resolver

SWEBENCH_COLUMNS = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement",
                    "hints_text", "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS",
                    "environment_setup_commit", "difficulty")


def _swebench_row(calc_task) -> dict:
    return {"repo": "sandpool/calc", "instance_id": "sandpool__calc-1", "base_commit": calc_task.base_commit,
            "patch": calc_task.patch, "test_patch": "", "problem_statement": calc_task.problem_statement,
            "hints_text": "", "created_at": "2026-01-01T00:00:00Z", "version": "1.0",
            "FAIL_TO_PASS": json.dumps(list(calc_task.FAIL_TO_PASS)),
            "PASS_TO_PASS": json.dumps(list(calc_task.PASS_TO_PASS)),
            "environment_setup_commit": calc_task.base_commit, "difficulty": "<15 min fix"}


def _smith_row(calc_task) -> dict:
    return {"instance_id": "sandpool__calc.0123abcd.func_pm_op_swap__k1", "patch": reverse_patch(calc_task.patch),
            "FAIL_TO_PASS": list(calc_task.FAIL_TO_PASS), "PASS_TO_PASS": list(calc_task.PASS_TO_PASS),
            "image_name": calc_task.image, "repo": "swesmith/sandpool__calc.0123abcd",
            "problem_statement": calc_task.problem_statement}


def _r2e_row(calc_task) -> dict:
    lines = [{"content": "def add(a, b):", "type": "context"}, {"content": "    return a - b", "type": "deleted"},
             {"content": "    return a + b", "type": "added"}]
    diff = {"old_file_content": "", "new_file_content": "",
            "header": {"file": {"path": "calc.py"}, "misc_line": None},
            "index_line": None, "is_binary_file": False, "binary_line": None,
            "minus_file": {"path": "a/calc.py"}, "plus_file": {"path": "b/calc.py"},
            "hunks": [{"descriptor": {"old_range": {"start": 1, "length": 2}, "new_range": {"start": 1, "length": 2},
                                      "section": ""}, "line_group": {"all_lines": lines}}]}
    test_diff = dict(diff, header={"file": {"path": "tests/test_calc_new.py"}, "misc_line": None})
    parsed = {"file_diffs": [diff, test_diff], "old_commit_hash": calc_task.base_commit,
              "new_commit_hash": "f" * 40, "commit_message": "fix add", "commit_date": "2026-01-01T00:00:00",
              "metadata": {}}
    return {"repo_name": "calc", "docker_image": calc_task.image, "commit_hash": "f" * 40,
            "parsed_commit_content": json.dumps(parsed), "execution_result_content": "{}",
            "modified_files": ["calc.py"], "modified_entity_summaries": [], "relevant_files": [],
            "num_non_test_files": 1, "num_non_test_func_methods": 1, "num_non_test_lines": 2,
            "prompt": "", "problem_statement": calc_task.problem_statement,
            "expected_output_json": json.dumps({"test_add": "PASSED", "test_zero": "PASSED"})}


def _write(rows: list[dict], path, kind: str) -> None:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("fmt", ["swebench", "swe-smith", "r2e-gym"])
def test_one_published_row_of_each_format_loads_from_each_file_type(tmp_path, calc_task, calc_commits, kind, fmt):
    row = {"swebench": _swebench_row, "swe-smith": _smith_row, "r2e-gym": _r2e_row}[fmt](calc_task)
    path = tmp_path / f"tasks.{kind}"
    _write([row], path, kind)
    smith_ref = {_smith_row(calc_task)["instance_id"]: calc_commits["buggy"]}
    [task] = load_tasks(path, resolve_base=lambda image, ref: smith_ref.get(ref))
    assert detect_format(row) == fmt and harness_of(task) == fmt
    image = swebench_image(task.instance_id) if fmt == "swebench" else calc_task.image
    assert task.image == image and task.base_commit == calc_task.base_commit
    assert task.patch.strip() == calc_task.patch.strip()  # SWE-smith reversed, R2E-Gym non-test part
    if fmt != "r2e-gym":
        assert task.FAIL_TO_PASS == calc_task.FAIL_TO_PASS and task.PASS_TO_PASS == calc_task.PASS_TO_PASS


def test_a_swebench_row_without_image_gets_the_harness_instance_image():
    assert swebench_image("django__django-11099") == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    row = {"repo": "django/django", "instance_id": "django__django-11099", "base_commit": "a" * 40,
           "problem_statement": "p", "version": "3.0", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]"}
    from sandpool.envs.tasks import parse_task

    task = parse_task(row)
    assert task.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert harness_of(task) == "swebench" and task.workdir == "/testbed"


def test_a_swe_smith_row_without_a_resolvable_base_is_rejected_naming_the_field(tmp_path, calc_task):
    path = tmp_path / "smith.jsonl"
    _write([_smith_row(calc_task)], path, "jsonl")
    rejected = []
    assert load_tasks(path, rejected=rejected) == []
    assert rejected[0].row == 1 and "'base_commit'" in rejected[0].reason and "git rev-parse" in rejected[0].reason


def test_the_local_resolver_reads_refs_from_the_image_repo(test_images_root, calc_commits, calc_task):
    resolve = local_base_resolver(test_images_root)
    assert resolve(calc_task.image, "main") == calc_commits["buggy"]
    assert resolve(calc_task.image, "no-such-branch") is None
    assert resolve("sandpool.local/ghost:0", "main") is None


def test_bad_rows_in_a_parquet_file_name_the_row_and_field(tmp_path, calc_task):
    good, bad = _swebench_row(calc_task), dict(_swebench_row(calc_task), instance_id="x-2", base_commit="nothex")
    path = tmp_path / "t.parquet"
    _write([good, bad], path, "parquet")
    rejected = []
    tasks = load_tasks(path, rejected=rejected)
    assert [t.instance_id for t in tasks] == ["sandpool__calc-1"]
    assert rejected[0].row == 2 and "'base_commit'" in rejected[0].reason


def test_a_hub_name_that_cannot_be_reached_gives_a_clear_error():
    code = ("from sandpool.envs.datasets import read_rows\n"
            "try:\n    list(read_rows('SWE-bench/SWE-bench_Verified'))\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}).stdout
    assert out.startswith("InputError") and "SWE-bench/SWE-bench_Verified" in out
    assert "Parquet or JSONL file" in out


async def test_a_swe_smith_task_grades_with_its_harness_gold_one_empty_zero(local_backend, tmp_path, calc_task,
                                                                            calc_commits):
    path = tmp_path / "smith.jsonl"
    _write([_smith_row(calc_task)], path, "jsonl")
    [task] = load_tasks(path, resolve_base=lambda image, ref: calc_commits["buggy"])
    sb = await local_backend.create(task.image)
    assert (await sb.exec(f"git checkout -q {task.base_commit}", timeout=30)).ok
    empty = await grade(sb, task, timeout=120)
    assert (empty.harness, empty.reward, empty.tampering) == ("swe-smith", 0.0, ())
    await sb.write_file("/tmp/g.patch", task.patch.encode())
    assert (await sb.exec("git apply /tmp/g.patch && rm /tmp/g.patch", timeout=30)).ok
    gold = await grade(sb, task, timeout=120)
    assert (gold.reward, gold.tampering) == (1.0, ()), gold.log[-1500:]
    assert "--verbose" in gold.log or "PASSED" in gold.log
    # Diff grading runs the harness's console-script pytest isolated: the same verdicts.
    from sandpool.envs.grading.diff import grade_patch

    for patch, reward in ((task.patch, 1.0), ("", 0.0)):
        pristine = await local_backend.create(task.image)
        assert (await pristine.exec(f"git checkout -q {task.base_commit}", timeout=30)).ok
        result = await grade_patch(pristine, task, patch, timeout=120)
        assert (result.harness, result.reward, result.tampering) == ("swe-smith", reward, ()), result.log[-1500:]


def test_a_swebench_row_for_a_repo_swebench_does_not_know_is_a_broken_task(calc_task):
    from sandpool.envs.grading.harness import plan_for
    from sandpool.envs.tasks import parse_task

    task = parse_task(dict(_swebench_row(calc_task), repo="nobody/nothing"))
    with pytest.raises(errors.BrokenTaskError, match="no test command"):
        plan_for(task)


def test_each_rejected_row_names_its_row_and_task_once_and_the_fix(tmp_path, calc_task):
    good = calc_task.model_dump(mode="json")
    bad = {**good, "instance_id": "calc-bad", "FAIL_TO_PASS": 42}
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join([json.dumps(good), json.dumps(bad), "{torn", ""]))
    rejected = []
    assert [t.instance_id for t in load_tasks(path, rejected=rejected)] == [calc_task.instance_id]
    field, torn = (r.describe() for r in rejected)
    assert field.startswith("row 2 (calc-bad): field 'FAIL_TO_PASS'") and field.count("row 2") == 1
    assert torn.startswith("row 3: not valid JSON") and torn.endswith("fix: one whole JSON object per line")
    later = RejectedTask(task_id="calc-ghost", row=4, reason="validation: image 'x' is not built")
    assert later.describe() == "row 4 (calc-ghost): validation: image 'x' is not built"
