"""The SWE-bench harness comparison runs in ``nox -s swebench_harness`` (which ``make test`` calls),
not in the main suite: it starts a Docker daemon and builds task images, minutes when cold."""

from __future__ import annotations

import os

if os.environ.get("SANDPOOL_SWEBENCH_HARNESS") != "1":  # set by the nox session
    collect_ignore_glob = ["test_*.py"]
