"""Load tasks from SWE-bench-format JSONL, naming the row and field of any bad input.

R2E-Gym and SWE-smith rows map onto the SWE-bench columns through :data:`ALIASES`
(``image_name`` / ``docker_image`` -> ``image``, ``repo_name`` -> ``repo``,
``commit_hash`` -> ``base_commit``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from sandpool.core.errors import TaskValidationError
from sandpool.core.metrics import RejectedTask
from sandpool.core.task import Task

__all__ = ["ALIASES", "load_tasks", "parse_task"]

#: Column names used by R2E-Gym / SWE-smith rows, mapped to SWE-bench's.
ALIASES = {"image_name": "image", "docker_image": "image", "repo_name": "repo",
           "commit_hash": "base_commit"}

_FIXES = {
    "base_commit": "use the full 40-character lowercase hex commit id",
    "image": "name the image the task runs in (a built local image or an OCI reference)",
    "instance_id": "give every row a unique non-empty id",
    "FAIL_TO_PASS": "give a list of test ids, or the JSON-encoded list SWE-bench ships",
    "PASS_TO_PASS": "give a list of test ids, or the JSON-encoded list SWE-bench ships",
}


def parse_task(row: object, *, line: int | None = None) -> Task:
    """Validate one row (a dict) into a :class:`Task`.

    Args:
        row: The decoded JSON object.
        line: 1-based line number for the error message.

    Raises:
        TaskValidationError: Naming the line, the field and the fix.
    """
    where = f"row {line}" if line is not None else "task row"
    if not isinstance(row, dict):
        raise TaskValidationError(f"{where}: expected a JSON object, got {type(row).__name__}", row=line)
    data = dict(row)
    for alias, name in ALIASES.items():
        if alias in data and name not in data:
            data[name] = data.pop(alias)
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
               rows: dict[str, int] | None = None) -> list[Task]:
    """Read a JSONL file of tasks.

    Args:
        path: The ``.jsonl`` file, one task per line (blank lines ignored).
        rejected: If given, bad rows are appended to it as :class:`RejectedTask` (so a run
            keeps and reports them) instead of raising on the first one.
        rows: If given, receives the 1-based row number of every valid task's ``instance_id``.

    Returns:
        The valid tasks, in file order.

    Raises:
        TaskValidationError: A bad row or a repeated ``instance_id`` (when ``rejected`` is None).
        FileNotFoundError: No such file.
    """
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for i, text in enumerate(Path(path).read_text().splitlines(), start=1):
        if not text.strip():
            continue
        row: object = None
        try:
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TaskValidationError(f"row {i}: not valid JSON ({exc.msg} at column {exc.colno})",
                                          row=i) from None
            task = parse_task(row, line=i)
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
