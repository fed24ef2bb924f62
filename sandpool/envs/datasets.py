"""Published SWE datasets as tasks: SWE-bench (full, Lite, Verified), R2E-Gym, SWE-smith.

Rows are read exactly as published, from a JSONL, JSON or Parquet file, or from the Hugging
Face hub through the ``datasets`` library (:func:`read_rows`), and each row is mapped onto a
:class:`~sandpool.core.task.Task` by its format (:func:`detect_format`, :func:`row_to_task`):

* ``swebench``: the SWE-bench columns as they are. A row without ``image`` gets the image its
  harness runs: ``TestSpec.instance_image_key`` of swebench 4.1.0 with namespace
  ``swebench`` (``swebench/sweb.eval.x86_64.<id with __ as _1776_>:latest``).
* ``r2e-gym``: ``repo_name``, ``docker_image``, ``parsed_commit_content``,
  ``expected_output_json``, ``problem_statement``. The id is ``<repo_name>__<commit_hash[:12]>``;
  the gold patch is the commit's non-test file diffs (``parsed_commit_content``); the base is
  the image's checked-out commit, which only the image knows (``resolve_base``).
* ``swe-smith``: ``instance_id``, ``repo``, ``patch`` (the bug), ``FAIL_TO_PASS``,
  ``PASS_TO_PASS``, ``image_name``. The gold patch is ``patch`` reversed (SWE-smith's harness
  applies it with ``--reverse``); the image is ``jyangballin/<image_name, __ as _1776_>:latest``
  when the row names no registry (as R2E-Gym runs SWE-smith rows); the base is the row's
  ``base_commit``, else the instance branch ``instance_id`` resolved in the image.
* ``sandpool``: sandpool's own rows (the task pack), SWE-bench columns plus ``image``.

``resolve_base(image, ref)`` maps a ref to a 40-hex commit inside an image (the local backend
reads it from the image's repo); without it, rows whose base only the image knows are
rejected with a message naming the field and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from sandpool.core.errors import InputError, TaskValidationError

__all__ = ["FORMATS", "ResolveBase", "detect_format", "r2e_gold_patch", "read_rows", "row_to_task_fields",
           "swebench_image"]

FORMATS = ("swebench", "r2e-gym", "swe-smith", "sandpool")
ResolveBase = Callable[[str, str], "str | None"]
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def read_rows(source: str | Path, *, split: str | None = None) -> Iterator[tuple[int, object]]:
    """Yield ``(row number, row)`` from a dataset file or a hub dataset name.

    A JSONL line that does not parse is yielded as its :class:`TaskValidationError` (the
    caller rejects that row and goes on).

    Args:
        source: A ``.jsonl``/``.json``/``.parquet`` path, or a hub name such as
            ``SWE-bench/SWE-bench_Verified`` (``name:split`` picks the split).
        split: The hub split when ``source`` names none (default ``test``).

    Raises:
        FileNotFoundError: A path that does not exist (and is not a hub name).
        TaskValidationError: The JSON document does not parse.
        InputError: The hub could not be reached or has no such dataset.
    """
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        # Lines end at b"\n" only (JSON Lines): str.splitlines() would also split at \x1c,
        # \x85 or U+2028 inside a row. A line that is not UTF-8 rejects that row alone.
        for i, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, TaskValidationError(
                    f"row {i}: not valid UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                    "save the file as UTF-8", row=i)
                continue
            if not text.strip():
                continue
            try:
                yield i, json.loads(text)
            except json.JSONDecodeError as exc:  # one bad line never stops the batch
                yield i, TaskValidationError(f"row {i}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                             "fix: one whole JSON object per line", row=i)
    elif suffix == ".json":
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise TaskValidationError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if isinstance(doc, dict):  # {"<instance_id>": row} or {"data"/"rows": [...]}
            doc = doc.get("data", doc.get("rows", list(doc.values())))
        if not isinstance(doc, list):
            raise TaskValidationError(f"{path}: expected a JSON list of rows, got {type(doc).__name__}")
        yield from enumerate(doc, start=1)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
    elif path.exists() or suffix:
        if not path.exists():
            raise FileNotFoundError(f"no such task file: {path}")
        if path.is_dir():
            raise InputError(f"{path}: a directory, not a task file; give a .jsonl, .json or .parquet file")
        raise InputError(f"{path}: unknown task file type {suffix!r}; use .jsonl, .json or .parquet")
    else:
        yield from _hub_rows(str(source), split)


def _hub_rows(name: str, split: str | None) -> Iterator[tuple[int, object]]:
    repo, _, named = name.partition(":")
    if not re.match(r"^[\w.-]+/[\w.-]+$", repo):
        raise FileNotFoundError(f"no such task file, and {name!r} is not a hub dataset name (owner/name)")
    import datasets

    try:
        ds = datasets.load_dataset(repo, split=named or split or "test")
    except Exception as exc:  # noqa: BLE001 - the hub client raises many kinds; one clear message
        raise InputError(
            f"could not load {repo!r} (split {named or split or 'test'!r}) through the `datasets` "
            f"library: {type(exc).__name__}: {str(exc)[:300]}. If the hub is not reachable from this "
            "machine, download the dataset's Parquet or JSONL file and pass its path instead") from None
    for i, row in enumerate(ds, start=1):
        yield i, row


_TEXT_COLUMNS = ("instance_id", "image", "image_name", "docker_image", "repo", "repo_name",
                 "base_commit", "commit_hash", "patch", "test_patch", "problem_statement")


def detect_format(row: dict) -> str:
    """Return which published format ``row`` is in (one of :data:`FORMATS`)."""
    if "parsed_commit_content" in row or ("repo_name" in row and "docker_image" in row):
        return "r2e-gym"
    if "image_name" in row:  # SWE-smith's image column
        return "swe-smith"
    if "image" in row:
        return "sandpool"
    return "swebench"


def row_to_task_fields(row: dict, *, line: int | None = None,
                       resolve_base: ResolveBase | None = None) -> dict:
    """Map one published row onto :class:`~sandpool.core.task.Task` fields.

    The row's other columns are kept as extra fields; ``harness`` and ``dataset_format`` are
    added so grading applies the right harness.

    Raises:
        TaskValidationError: The row lacks what its format needs, naming row, field and fix.
    """
    fmt = detect_format(row)
    data = dict(row)
    where = f"row {line}" if line is not None else "task row"
    for name in _TEXT_COLUMNS:  # read as text below: a number or a list here is the row's error
        if data.get(name) is not None and not isinstance(data[name], str):
            raise TaskValidationError(
                f"{where} ({data.get('instance_id', '?')!s:.60}): field {name!r} must be a string, "
                f"got {type(data[name]).__name__}", row=line, field=name)
    if fmt == "swebench":
        data.setdefault("harness", "swebench")
        if not data.get("image") and data.get("instance_id"):
            data["image"] = swebench_image(str(data["instance_id"]))
    elif fmt == "swe-smith":
        data.setdefault("harness", "swe-smith")
        image = str(data.pop("image_name", "") or "")
        data["image"] = image if "/" in image or not image else f"jyangballin/{image.replace('__', '_1776_')}:latest"
        if data.get("patch"):
            from sandpool.envs.grading.harness import reverse_patch

            try:
                data["bug_patch"], data["patch"] = data["patch"], reverse_patch(data["patch"])
            except ValueError as exc:
                raise TaskValidationError(f"{where} ({data.get('instance_id')}): field 'patch' {exc}",
                                          row=line, field="patch") from None
        if not data.get("base_commit"):
            data["base_commit"] = _resolve(data, str(data.get("instance_id", "")), where, line, resolve_base)
    elif fmt == "r2e-gym":
        data.setdefault("harness", "r2e-gym")
        data["image"] = data.pop("docker_image", None) or data.get("image")
        data["repo"] = data.pop("repo_name", None) or data.get("repo")
        commit = str(data.get("commit_hash", ""))
        data.setdefault("instance_id", f"{data.get('repo')}__{commit[:12]}" if commit else None)
        parsed = data.get("parsed_commit_content")
        if parsed and not data.get("patch"):
            data["patch"] = r2e_gold_patch(parsed, where=where, line=line)
        old = str(_parsed(parsed).get("old_commit_hash", "")) if parsed else ""
        if not data.get("base_commit"):
            # The image holds the repo at the commit's parent, the parsed commit's old hash.
            data["base_commit"] = old if _HEX40.match(old) else _resolve(data, "HEAD", where, line, resolve_base)
    data["dataset_format"] = fmt
    return {k: v for k, v in data.items() if v is not None}


def swebench_image(instance_id: str) -> str:
    """The image the SWE-bench harness runs ``instance_id`` in (swebench 4.1.0 ``TestSpec.
    instance_image_key``, namespace ``swebench``, arch ``x86_64``, tag ``latest``)."""
    from swebench.harness.test_spec.test_spec import TestSpec

    spec = TestSpec(instance_id=instance_id, repo="", version="", repo_script_list=[],
                    eval_script_list=[], env_script_list=[], arch="x86_64", FAIL_TO_PASS=[],
                    PASS_TO_PASS=[], language="py", docker_specs={}, namespace="swebench")
    return spec.instance_image_key


def _resolve(data: dict, ref: str, where: str, line: int | None, resolve_base: ResolveBase | None) -> str:
    image = data.get("image")
    commit = resolve_base(str(image), ref) if resolve_base and image else None
    if commit and _HEX40.match(commit):
        return commit
    raise TaskValidationError(
        f"{where} ({data.get('instance_id', '?')}): field 'base_commit' missing and {ref!r} could not be "
        f"resolved in image {image!r}; fix: build or pull the image first, or add base_commit "
        f"(`git rev-parse {ref}` in the image's repo)", row=line, field="base_commit")


def _parsed(parsed: object) -> dict:
    try:
        return json.loads(parsed) if isinstance(parsed, str) else dict(parsed)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return {}


_TEST_PATH = re.compile(r"(^|/)(tests?|testing|__tests__)/|(^|/)test_[^/]*$|_test\.py$|(^|/)conftest\.py$")


def r2e_gold_patch(parsed: object, *, where: str = "task row", line: int | None = None) -> str:
    """The non-test part of an R2E-Gym ``parsed_commit_content`` as a unified diff.

    Serialises each file diff the way R2E-Gym's ``FileDiff.get_patch`` does (``diff --git``
    header, its misc line, index line, ``---``/``+++``, hunks), skipping test files (a path in
    a ``test``/``tests``/``testing`` directory, ``test_*`` or ``*_test.py``, ``conftest.py``).

    Raises:
        TaskValidationError: The column is not the JSON R2E-Gym publishes.
    """
    try:
        commit = json.loads(parsed) if isinstance(parsed, str) else dict(parsed)  # type: ignore[arg-type]
        out = []
        for fd in commit["file_diffs"]:
            path = fd["header"]["file"]["path"]
            if _TEST_PATH.search(path):
                continue
            text = f"diff --git a/{path} b/{path}\n"
            if fd["header"].get("misc_line"):
                text += fd["header"]["misc_line"] + "\n"
            if fd.get("index_line"):
                il = fd["index_line"]
                text += f"index {il['old_commit_hash']}..{il['new_commit_hash']}{' ' if il.get('mode') else ''}{il.get('mode') or ''}\n"
            if fd.get("is_binary_file"):
                raise ValueError(f"{path} is a binary diff")
            if fd.get("minus_file") and fd.get("plus_file"):
                text += f"--- {fd['minus_file']['path']}\n+++ {fd['plus_file']['path']}\n"
            for hunk in fd.get("hunks", []):
                d = hunk["descriptor"]
                rng = lambda r: f"{r['start']}" if r.get("length") is None else f"{r['start']},{r['length']}"  # noqa: E731
                text += f"@@ -{rng(d['old_range'])} +{rng(d['new_range'])} @@" + (f" {d['section']}" if d.get("section") else "") + "\n"
                for ln in hunk["line_group"]["all_lines"]:
                    text += {"context": " ", "added": "+", "deleted": "-", "note": "\\ "}[ln["type"]] + ln["content"] + "\n"
            out.append(text)
        return "".join(out)
    except (KeyError, TypeError, ValueError) as exc:
        raise TaskValidationError(f"{where}: field 'parsed_commit_content' is not R2E-Gym's parsed commit "
                                  f"({type(exc).__name__}: {exc}); fix the row", row=line,
                                  field="parsed_commit_content") from None
