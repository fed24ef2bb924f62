"""Image directories: what a local image holds and where it lives."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from pydantic import BaseModel, ValidationError

from sandpool.core import errors

__all__ = ["LocalImage", "image_dir", "load_image"]


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


def load_image(name: str, path: Path) -> LocalImage:
    """Read image ``name``'s ``image.json`` at ``path``, check its directories, and read its
    repo's HEAD.

    Raises:
        ImageNotFound: The file is malformed, or a directory it names is missing or under
            ``/tmp`` (private to each sandbox); the message says the fix.
    """
    try:
        img = LocalImage.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise errors.ImageNotFound(f"image {name!r}: {path} is malformed: {exc}") from exc
    for field in ("venv", "repo", "python_prefix"):
        if Path(getattr(img, field)).is_relative_to("/tmp"):
            raise errors.ImageNotFound(
                f"image {name!r}: {field} {getattr(img, field)} is under /tmp, which is private "
                "to each sandbox; build images elsewhere (the default is under sandpool_home())"
            )
        if not Path(getattr(img, field)).is_dir():
            raise errors.ImageNotFound(
                f"image {name!r}: {field} directory {getattr(img, field)} is missing; rebuild the image"
            )
    rev = subprocess.run(["git", "-C", img.repo, "rev-parse", "-q", "--verify", "HEAD"],
                         capture_output=True, text=True)
    return img.model_copy(update={"head": rev.stdout.strip() or None})
