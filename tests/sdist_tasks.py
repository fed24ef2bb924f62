"""Make a SWE-style task from a real package's sdist image: one bug commit plus a test patch.

Shared by the harness tests (Django, sympy, marshmallow). The result is cached next to the
image as JSON, so each image's repo is changed once per machine.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
            "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z", "PATH": "/usr/bin:/bin"}


def git(repo: Path, *args: str) -> str:
    """Run git in ``repo`` with a fixed identity and date; return its stdout."""
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=_GIT_ENV).stdout


def bug_task(image: Path, meta_name: str, *, source: str, bug: tuple[str, str], test_file: str,
             edit_test: Callable[[str], str], setup: Callable[[Path], None] | None = None) -> dict:
    """Commit a bug on branch ``sandpool-bug`` of ``image/repo`` and return the task's parts.

    Args:
        image: The image directory (holding ``repo/``).
        meta_name: File name of the cached result beside the repo.
        source: Path in the repo of the file the bug goes into.
        bug: ``(old, new)``: the first ``old`` in ``source`` becomes ``new``.
        test_file: Path of the test file the test patch changes.
        edit_test: Gives the test file's new text from its old text.
        setup: Changes committed before the clean commit (e.g. a test runner stand-in).

    Returns:
        ``{"base": buggy commit, "patch": gold diff, "test_patch": diff of test_file}``;
        the repo is left on ``main``.
    """
    meta = image / meta_name
    if not meta.exists():
        repo = image / "repo"
        git(repo, "checkout", "-q", "-b", "sandpool-bug")
        if setup is not None:
            setup(repo)
        clean = git(repo, "rev-parse", "HEAD").strip()
        path = repo / source
        path.write_text(path.read_text().replace(*bug, 1))
        git(repo, "commit", "-qam", "bug")
        buggy = git(repo, "rev-parse", "HEAD").strip()
        gold = git(repo, "diff", buggy, clean)
        tests = repo / test_file
        tests.write_text(edit_test(tests.read_text()))
        test_patch = git(repo, "diff", "--", test_file)
        git(repo, "checkout", "-q", "--", test_file)
        git(repo, "checkout", "-q", "main")
        meta.write_text(json.dumps({"base": buggy, "patch": gold, "test_patch": test_patch}))
    return json.loads(meta.read_text())
