"""Load tasks from published datasets, naming the row and field of any bad input.

SWE-bench (full, Lite, Verified), R2E-Gym and SWE-smith rows, and sandpool's own, from JSONL,
JSON or Parquet files or a hub name; :mod:`sandpool.envs.datasets` maps each format onto the
task fields (and derives the image where a row names none, as its harness does).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from pydantic import ValidationError

from sandpool.core.errors import TaskValidationError
from sandpool.core.metrics import RejectedTask
from sandpool.core.task import Task
from sandpool.envs.datasets import ResolveBase, read_rows, row_to_task_fields

__all__ = ["load_tasks", "local_base_resolver", "parse_task"]

_FIXES = {
    "base_commit": "use the full 40-character lowercase hex commit id",
    "image": "name the image the task runs in (a built local image or an OCI reference)",
    "instance_id": "give every row a unique non-empty id",
    "FAIL_TO_PASS": "give a list of test ids, or the JSON-encoded list SWE-bench ships",
    "PASS_TO_PASS": "give a list of test ids, or the JSON-encoded list SWE-bench ships",
}


def parse_task(row: object, *, line: int | None = None, resolve_base: ResolveBase | None = None) -> Task:
    """Validate one published row (a dict) into a :class:`Task`.

    The row may be in any format :mod:`sandpool.envs.datasets` reads (SWE-bench, R2E-Gym,
    SWE-smith, sandpool); it is mapped onto the task fields first.

    Args:
        row: The decoded row.
        line: 1-based row number for the error message.
        resolve_base: See :func:`load_tasks`.

    Raises:
        TaskValidationError: Naming the line, the field and the fix.
    """
    where = f"row {line}" if line is not None else "task row"
    if not isinstance(row, dict):
        raise TaskValidationError(f"{where}: expected a JSON object, got {type(row).__name__}", row=line)
    data = row_to_task_fields(row, line=line, resolve_base=resolve_base)
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else None
        tid = data.get("instance_id", "?")
        fix = _FIXES.get(field or "", "see the SWE-bench row format in sandpool.core.task.Task")
        got = data.get(field) if field else None
        shown = "missing" if field not in data else f"got {got!r}"[:120]
        raise TaskValidationError(
            f"{where} ({tid}): field {field!r} {err['msg'].lower()} ({shown}); fix: {fix}",
            row=line, field=field,
        ) from None


def load_tasks(path: str | Path, *, rejected: list[RejectedTask] | None = None,
               rows: dict[str, int] | None = None, resolve_base: ResolveBase | None = None,
               split: str | None = None) -> list[Task]:
    """Read tasks from a dataset file or hub name (see :func:`sandpool.envs.datasets.read_rows`).

    Args:
        path: A ``.jsonl``, ``.json`` or ``.parquet`` file of SWE-bench, R2E-Gym, SWE-smith or
            sandpool rows, or a hub dataset name (``owner/name[:split]``).
        rejected: If given, bad rows are appended to it as :class:`RejectedTask` (so a run
            keeps and reports them) instead of raising on the first one.
        rows: If given, receives the 1-based row number of every valid task's ``instance_id``.
        resolve_base: Maps ``(image, ref)`` to a commit for rows whose base only the image
            knows (R2E-Gym, SWE-smith without ``base_commit``).
        split: The hub split, when ``path`` is a hub name without one.

    Returns:
        The valid tasks, in file order.

    Raises:
        TaskValidationError: A bad row or a repeated ``instance_id`` (when ``rejected`` is None).
        FileNotFoundError: No such file.
        InputError: The hub dataset could not be loaded.
    """
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for i, row in read_rows(path, split=split):
        try:
            if isinstance(row, TaskValidationError):
                raise row
            task = parse_task(row, line=i, resolve_base=resolve_base)
            if task.instance_id in seen:
                raise TaskValidationError(
                    f"row {i}: instance_id {task.instance_id!r} repeats row {seen[task.instance_id]}; "
                    "ids must be unique", row=i, field="instance_id")
        except TaskValidationError as exc:
            if rejected is None:
                raise
            tid = row.get("instance_id") if isinstance(row, dict) else None
            rejected.append(RejectedTask(task_id=tid if isinstance(tid, str) and tid else None,
                                         row=i, reason=str(exc)))
            continue
        seen[task.instance_id] = i
        if rows is not None:
            rows[task.instance_id] = i
        tasks.append(task)
    return tasks


def local_base_resolver(images_root: str | Path | None = None) -> ResolveBase:
    """A ``resolve_base`` for local images: ``git rev-parse <ref>`` in the image's repo.

    Args:
        images_root: The local backend's images directory (default ``sandpool_home()/images``).

    Returns:
        A function ``(image, ref) -> commit or None`` (None: no such image or ref).
    """
    from sandpool.core.backends.local import image_dir
    from sandpool.core.paths import sandpool_home

    root = Path(images_root) if images_root else sandpool_home() / "images"

    def resolve(image: str, ref: str) -> str | None:
        meta = image_dir(root, image) / "image.json"
        if not meta.exists():
            return None
        repo = json.loads(meta.read_text()).get("repo")
        res = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-C", str(repo), "rev-parse",
                              "-q", "--verify", f"{ref}^{{commit}}"], capture_output=True, text=True,
                             env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
                                  "HOME": "/nonexistent"})
        return res.stdout.strip() or None

    return resolve
