"""A TCP port for a test's server: hack/cluster's ``free_port`` (outside the ephemeral range)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hack" / "cluster"))

from procs import free_port

__all__ = ["free_port"]
