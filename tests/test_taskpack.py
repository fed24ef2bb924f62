"""The task-pack builder: mutation operators, image directories, and the default pack, whose
every task is checked in real sandboxes (fails without the gold patch, resolved with it)."""

from __future__ import annotations

import ast
import asyncio
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from sandpool.core import errors
from sandpool.core.paths import sandpool_home
from sandpool.core.task import Task
from sandpool.envs.grading import GradeResult, grade
from sandpool.envs.taskpack import (
    DEFAULT_PACKAGES,
    PackageSpec,
    abuild_default_pack,
    build_pack,
    find_mutations,
)
from sandpool.envs.taskpack.image import image_path
from sandpool.envs.taskpack.mutate import select_mutations

SOURCE = b'''\
LIMIT = 3 + 4


def clamp(x, lo, hi):
    """Clamp x."""
    if x < lo and lo is not None:
        return lo
    total = x + 1
    total -= 2
    return min(total, hi)
'''


def _edits(kind: str) -> list[tuple[bytes, bytes]]:
    """(old line, new line) of every mutation of ``kind`` in SOURCE."""
    out = []
    for m in find_mutations("m.py", SOURCE):
        if m.kind == kind:
            old_lines, new_lines = SOURCE.splitlines(), m.apply(SOURCE).splitlines()
            changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=False) if a != b]
            out.append(changed[0] if changed else (b"", b""))
    return out


# -- mutation operators -------------------------------------------------------------------------


def test_mutations_are_minimal_edits_inside_functions_only():
    muts = find_mutations("m.py", SOURCE)
    assert muts and all(m.function == "clamp" for m in muts)  # `3 + 4` at module level is untouched
    assert {m.kind for m in muts} == {"flip_compare", "swap_boolop", "swap_arith", "off_by_one",
                                      "drop_statement", "negate_if"}
    for m in muts:
        ast.parse(m.apply(SOURCE))
        assert m.is_effective(SOURCE)


def test_each_operator_makes_the_expected_edit():
    assert (b"    if x < lo and lo is not None:", b"    if x <= lo and lo is not None:") in _edits("flip_compare")
    assert (b"    if x < lo and lo is not None:", b"    if x < lo and lo is None:") in _edits("flip_compare")
    assert _edits("swap_boolop") == [(b"    if x < lo and lo is not None:", b"    if x < lo or lo is not None:")]
    assert (b"    total = x + 1", b"    total = x - 1") in _edits("swap_arith")
    assert (b"    total -= 2", b"    total += 2") in _edits("swap_arith")
    assert (b"    total = x + 1", b"    total = x + 2") in _edits("off_by_one")
    assert _edits("negate_if") == [(b"    if x < lo and lo is not None:",
                                    b"    if not (x < lo and lo is not None):")]
    dropped = [m.apply(SOURCE) for m in find_mutations("m.py", SOURCE) if m.kind == "drop_statement"]
    assert SOURCE.replace(b"    total -= 2\n", b"") in dropped
    assert SOURCE.replace(b"    return min(total, hi)\n", b"") in dropped


def test_an_unparsable_file_yields_no_mutations():
    assert find_mutations("bad.py", b"def f(:\n") == []


def test_selection_is_seeded_and_caps_mutations_per_function():
    muts = find_mutations("m.py", SOURCE)
    a = select_mutations(muts, random.Random(7))
    assert a == select_mutations(muts, random.Random(7))
    assert len(a) == 1
    three = select_mutations(muts, random.Random(7), per_function=3)
    assert len(three) == 3 and len({m.lineno for m in three}) == 3


def test_package_spec_rejects_unpinned_input():
    with pytest.raises(ValueError, match="version"):
        PackageSpec(dist="toolz", version="latest", repo="pytoolz/toolz", sources=("toolz/*.py",),
                    tests=("toolz/tests",))
    with pytest.raises(ValueError, match="pinned"):
        PackageSpec(dist="toolz", version="1.0.0", repo="pytoolz/toolz", sources=("toolz/*.py",),
                    tests=("toolz/tests",), requirements=("attrs>=20",))


def test_build_pack_rejects_bad_arguments():
    with pytest.raises(errors.ConfigError, match="tasks_per_package"):
        build_pack(DEFAULT_PACKAGES, 0)
    with pytest.raises(errors.ConfigError, match="packages"):
        build_pack((), 3)


# -- the default pack -----------------------------------------------------------------------------


def test_default_pack_has_enough_tasks_from_enough_packages(default_pack_tasks: list[Task]):
    per_package = Counter(t.repo for t in default_pack_tasks)
    assert len(default_pack_tasks) >= 20
    assert len(per_package) >= 3 and all(n >= 3 for n in per_package.values())
    assert len({t.instance_id for t in default_pack_tasks}) == len(default_pack_tasks)


def test_default_pack_rows_are_swe_bench_rows(default_pack_path: Path, default_pack_tasks: list[Task]):
    for line in default_pack_path.read_text().splitlines():
        row = json.loads(line)
        for key in ("instance_id", "repo", "base_commit", "image", "problem_statement", "patch",
                    "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "version"):
            assert key in row, key
    for task in default_pack_tasks:
        assert task.test_patch == "" and task.FAIL_TO_PASS and task.PASS_TO_PASS
        assert not set(task.FAIL_TO_PASS) & set(task.PASS_TO_PASS)
        assert task.patch.startswith("diff --git ") and task.workdir == "/testbed"
        removed = [ln[1:].strip() for ln in task.patch.splitlines()
                   if ln.startswith("-") and not ln.startswith("---") and ln[1:].strip()]
        added = [ln[1:].strip() for ln in task.patch.splitlines()
                 if ln.startswith("+") and not ln.startswith("+++") and ln[1:].strip()]
        # The issue text names failing tests, never the edited code.
        assert not any(len(line) > 8 and line in task.problem_statement for line in removed + added), \
            task.instance_id
        assert task.FAIL_TO_PASS[0] in task.problem_statement


def _git(repo: Path, *args: str, raw: bool = False) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                         text=True).stdout
    return out if raw else out.strip()


def test_default_pack_images_and_commits(default_pack_path: Path, default_pack_tasks: list[Task]):
    images = sandpool_home() / "images"
    pack = default_pack_path.parent.name
    for spec in DEFAULT_PACKAGES:
        d = image_path(images, spec.image)
        meta = json.loads((d / "image.json").read_text())
        assert meta == {"name": spec.image, "python_prefix": sys.base_prefix,
                        "venv": str((d / "venv").resolve()), "repo": str((d / "repo").resolve()),
                        "workdir": "/testbed"}
        assert (d / ".complete").is_file()
        log = _git(d / "repo", "log", "--format=%H %ad", "--date=iso", "main").splitlines()
        assert len(log) == 1 and log[0].endswith("2000-01-01 00:00:00 +0000")
        clean = log[0].split()[0]
        for task in (t for t in default_pack_tasks if t.repo == spec.repo):
            # The task's own image: one parentless commit holding the mutant's tree, and the
            # package's venv.
            t = image_path(images, task.image)
            tmeta = json.loads((t / "image.json").read_text())
            assert tmeta["venv"] == meta["venv"] and tmeta["repo"] == str((t / "repo").resolve())
            assert _git(t / "repo", "rev-list", "--all").split() == [task.base_commit]
            mutant = f"refs/sandpool/{pack}/{task.instance_id}"
            assert _git(t / "repo", "rev-parse", "HEAD^{tree}") == _git(d / "repo", "rev-parse", f"{mutant}^{{tree}}")
            assert _git(d / "repo", "diff", mutant, clean, raw=True) == task.patch, task.instance_id


async def test_the_fix_is_unreachable_from_a_task_sandbox(pack_backend, default_pack_tasks: list[Task]):
    task = default_pack_tasks[0]
    sb = await pack_backend.create(task.image)
    try:
        res = await sb.exec("git rev-list --all; git fsck --unreachable --no-reflogs --no-progress; "
                            "git log --all --oneline | wc -l; git count-objects -v | grep -c '^packs: 0'")
        assert res.ok, res.err_text
        assert res.text.split() == [task.base_commit, "1", "1"]
    finally:
        await pack_backend.delete(sb)


async def test_image_imports_resolve_to_the_sandbox_checkout(pack_backend):
    for spec in DEFAULT_PACKAGES:
        module = {"python-slugify": "slugify"}.get(spec.dist, spec.dist)
        sb = await pack_backend.create(spec.image)
        try:
            res = await sb.exec(f"python -c 'import {module}; print({module}.__file__)'", timeout=60)
            assert res.ok, res.err_text
            expected = f"/testbed/{spec.import_root}/".replace("//", "/")
            assert res.text.strip().startswith(expected + module), (spec.dist, res.text)
        finally:
            await pack_backend.delete(sb)


async def test_a_warm_build_returns_the_cached_pack(default_pack_path: Path):
    before = default_pack_path.stat().st_mtime_ns
    assert await abuild_default_pack() == default_pack_path
    assert default_pack_path.stat().st_mtime_ns == before


@pytest.fixture(scope="session")
async def pack_grades(pack_backend, default_pack_tasks: list[Task]) -> dict[str, tuple[GradeResult, GradeResult]]:
    """Grade every default-pack task at its base commit (its FAIL_TO_PASS tests only), then
    again, fully, after `git apply` of its gold patch; two sandboxes at a time.
    Maps instance_id -> (before, after)."""
    gate = asyncio.Semaphore(2)

    async def check(task: Task) -> tuple[GradeResult, GradeResult]:
        async with gate:
            sb = await pack_backend.create(task.image)
            try:
                res = await sb.exec(f"git checkout -q {task.base_commit}", timeout=60)
                assert res.ok, res.err_text
                before = await grade(sb, task.model_copy(update={"PASS_TO_PASS": ()}), timeout=600)
                await sb.write_file("/tmp/gold.patch", task.patch.encode())
                res = await sb.exec("git apply /tmp/gold.patch", timeout=60)
                assert res.ok, f"{task.instance_id}: gold patch does not apply: {res.err_text}"
                after = await grade(sb, task, timeout=600)
                return before, after
            finally:
                await pack_backend.delete(sb)

    results = await asyncio.gather(*(check(t) for t in default_pack_tasks))
    return {t.instance_id: r for t, r in zip(default_pack_tasks, results, strict=True)}


def test_every_task_fails_without_its_gold_patch(pack_grades, default_pack_tasks: list[Task]):
    bad = {}
    for task in default_pack_tasks:
        before, _ = pack_grades[task.instance_id]
        if before.reward != 0.0 or before.f2p_passed or before.f2p_failed != len(task.FAIL_TO_PASS):
            bad[task.instance_id] = (before.reward, before.f2p_passed, before.error)
    assert not bad, bad


def test_every_task_is_resolved_by_its_gold_patch(pack_grades, default_pack_tasks: list[Task]):
    bad = {}
    for task in default_pack_tasks:
        _, after = pack_grades[task.instance_id]
        if after.reward != 1.0 or after.f2p_passed != len(task.FAIL_TO_PASS):
            bad[task.instance_id] = (after.reward, after.failed_f2p, after.failed_p2p, after.error)
    assert not bad, bad
