"""Where sandpool keeps its caches on the host."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["sandpool_home"]


def sandpool_home() -> Path:
    """Return the cache root: ``$SANDPOOL_HOME``, else ``~/.cache/sandpool``.

    Images (``images/``), task packs (``packs/``) and cluster binaries (``cluster/``) live
    under it. The directory is created if missing.
    """
    root = Path(os.environ.get("SANDPOOL_HOME") or Path.home() / ".cache" / "sandpool")
    root.mkdir(parents=True, exist_ok=True)
    return root
