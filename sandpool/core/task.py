"""The task: one problem instance in SWE-bench row format."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["Task"]


class Task(BaseModel):
    """One problem instance, in SWE-bench row format (mirrors the SWE-bench dataset columns).

    ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` accept either a list of test ids or the JSON-encoded
    string SWE-bench ships. Extra columns (``version``, ``created_at``, ...) are kept in
    ``extra``-allowed fields and ignored by sandpool.

    Attributes:
        instance_id: Unique id, e.g. ``toolz__toolz-3``.
        repo: Repository name, e.g. ``pytoolz/toolz``.
        base_commit: 40-hex commit the sandbox's repo is reset to before a rollout.
        image: The image the task runs in (an OCI reference, or a local image name).
        problem_statement: The issue text shown to the policy.
        patch: The gold patch (unified diff); applying it resolves the task.
        test_patch: Diff applied before grading (may be empty).
        FAIL_TO_PASS: Test ids that must go from failing to passing.
        PASS_TO_PASS: Test ids that must keep passing.
        workdir: Path of the repo inside the sandbox (SWE-bench images use ``/testbed``).
    """

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    base_commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    image: str = Field(min_length=1)
    problem_statement: str
    patch: str = ""
    test_patch: str = ""
    FAIL_TO_PASS: tuple[str, ...] = ()
    PASS_TO_PASS: tuple[str, ...] = ()
    workdir: str = "/testbed"

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _decode_test_list(cls, value: Any) -> Any:
        # SWE-bench stores these columns as JSON-encoded strings.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    "must be a list of test ids or a JSON-encoded list, e.g. '[\"tests/test_a.py::test_b\"]'"
                ) from exc
        return value

    def __hash__(self) -> int:
        return hash(self.instance_id)
