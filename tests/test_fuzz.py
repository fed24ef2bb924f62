"""Hypothesis fuzzing of what a user or a policy hands sandpool: task rows, exec arguments and
file paths. Every input gets a clear error or a correct result; the agent never dies; nothing
gets out of the sandbox."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.task import Task
from sandpool.envs.tasks import load_tasks, parse_task

from .conftest import CALC_IMAGE

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# -- task rows -----------------------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                     max_leaves=8)
_FIELDS = ["instance_id", "repo", "base_commit", "image", "problem_statement", "patch", "test_patch",
           "FAIL_TO_PASS", "PASS_TO_PASS", "image_name", "commit_hash", "workdir"]
_GOOD = {"instance_id": "a-1", "repo": "o/r", "base_commit": "a" * 40, "image": "img",
         "problem_statement": "p"}


@FUZZ
@given(st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=8), _json, max_size=8),
       st.booleans())
def test_any_row_parses_or_names_its_field(row, start_good):
    row = {**_GOOD, **row} if start_good else row
    try:
        task = parse_task(row, line=7)
    except errors.TaskValidationError as exc:
        assert str(exc).startswith("row 7") and exc.row == 7
        assert exc.field is None or exc.field in str(exc)
    else:
        assert isinstance(task, Task) and len(task.base_commit) == 40


@FUZZ
@given(st.lists(st.binary(max_size=60) | st.builds(json.dumps, _json).map(str.encode)
                | st.just(json.dumps(_GOOD).encode()), max_size=8))
def test_a_tasks_file_of_any_bytes_keeps_every_row_accounted(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("rows") / "tasks.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ").replace(b"\r", b" ") for line in lines) + b"\n")
    rejected = []
    tasks = load_tasks(path, rejected=rejected)
    rows = [ln for ln in path.read_bytes().split(b"\n")
            if ln.decode("utf-8", "replace").strip()]
    assert len(tasks) + len(rejected) == len(rows)  # nothing lost, nothing doubled
    assert all(r.row is not None and r.reason.startswith(f"row {r.row}") for r in rejected)


# -- exec arguments and file paths on one real sandbox ------------------------------------------


@pytest.fixture(scope="module")
def sandbox(test_images_root, calc_commits):
    loop = asyncio.new_event_loop()
    backend = LocalBackend(test_images_root)
    sb = loop.run_until_complete(backend.create(CALC_IMAGE))
    setup = "ln -s / /tmp/root; ln -s ../../../.. up; ln -s /etc etc-link; mkdir -p d/e; echo f > d/f"
    assert loop.run_until_complete(sb.exec(setup)).ok
    yield loop, backend, sb
    loop.run_until_complete(backend.aclose())
    loop.close()


def _still_in_control(loop, sb):
    assert sb.alive(), "the agent died"
    assert loop.run_until_complete(sb.exec("echo ok", timeout=30)).text == "ok\n"


_arg = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40) | st.binary(max_size=40).map(
    lambda b: b.decode("utf-8", "surrogateescape"))  # non-UTF-8 bytes, as os.fsdecode gives them


@FUZZ
@given(st.lists(_arg, min_size=1, max_size=6))
def test_exec_argv_of_any_bytes_is_passed_exactly_or_refused_clearly(sandbox, args):
    loop, _, sb = sandbox
    res = loop.run_until_complete(sb.exec(["printf", "%s\\n", *args], timeout=30))
    if any("\0" in a for a in args):
        assert res.exit_code == 126 and b"NUL" in res.stderr, res
    else:
        assert res.ok, res
        assert res.stdout == b"".join(os.fsencode(a) + b"\n" for a in args)
    _still_in_control(loop, sb)


@FUZZ
@given(st.integers(min_value=0, max_value=4 << 20), st.booleans())
def test_huge_argv_and_shell_strings_run_or_say_too_long(sandbox, size, shell):
    loop, _, sb = sandbox
    cmd = f": {'x' * size}" if shell else ["true", "x" * size]
    res = loop.run_until_complete(sb.exec(cmd, timeout=60))
    assert res.ok or (res.exit_code == 127 and b"Argument list too long" in res.stderr), res
    _still_in_control(loop, sb)


_segment = st.sampled_from(["..", ".", "", "up", "etc-link", "d", "e", "f", "calc.py", "x" * 300,
                            "\0", "new", "é", "\udce9", "tmp", "root"])


@FUZZ
@given(st.lists(_segment, min_size=1, max_size=8), st.booleans())
def test_any_file_path_is_served_inside_the_sandbox_or_refused(sandbox, parts, absolute):
    loop, backend, sb = sandbox
    path = ("/" if absolute else "") + "/".join(parts)
    data = b"fuzz-" + os.urandom(8).hex().encode()
    try:
        loop.run_until_complete(sb.write_file(path, data))
    except errors.SandboxFileError as exc:
        assert exc.errno and errno.errorcode.get(exc.errno), exc
    else:
        assert loop.run_until_complete(sb.read_file(path)) == data
    try:
        got = loop.run_until_complete(sb.read_file(path.replace("new", "etc-link/passwd")))
        assert b"root:x:0:0" not in got, "read the host's /etc/passwd"
    except errors.SandboxFileError:
        pass
    _still_in_control(loop, sb)
    # Nothing landed in the image (the overlay's lower layer) or on the host.
    lower = backend.image(CALC_IMAGE).repo
    status = subprocess.run(["git", "-C", lower, "status", "--porcelain", "--ignored"],
                            capture_output=True, text=True, check=True).stdout
    assert status == "", status
    for host in ("/new", "/etc/new", "/usr/new", "/tmp/new", "/root/new"):
        assert not os.path.lexists(host), host
