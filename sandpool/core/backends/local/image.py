"""Image directories: what a local image holds and where it lives."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

__all__ = ["LocalImage", "image_dir"]


def image_dir(images_root: Path, name: str) -> Path:
    """Return the directory of local image ``name`` under ``images_root``.

    ``sandpool.local/toolz:1.0.0`` maps to ``<images_root>/sandpool.local_toolz_1.0.0``.
    """
    return Path(images_root) / re.sub(r"[^A-Za-z0-9._-]", "_", name)


class LocalImage(BaseModel):
    """``image.json``: what a local image directory holds.

    Attributes:
        name: The image name tasks refer to.
        python_prefix: ``sys.base_prefix`` of the interpreter the venv was made from; it is
            bind-mounted read-only at the same path.
        venv: Absolute path of the image's venv (bind-mounted read-only at the same path).
        repo: Absolute path of the git repo that becomes ``workdir`` (overlay lower layer).
        workdir: Where the repo appears inside the sandbox.
        head: The repo's HEAD commit, read when the image is loaded (not from the file).
    """

    name: str
    python_prefix: str
    venv: str
    repo: str
    workdir: str = "/testbed"
    head: str | None = None
