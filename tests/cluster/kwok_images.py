"""Pod images on the local (kwok) cluster, where an image is only a label: a host directory
copied into each pod as its workdir stands in for the image's contents."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import PodImage

__all__ = ["WORKDIR_SOURCE", "local_pack_image_map", "workdir_image"]

#: The annotation whose host directory the cluster's provisioner copies into a pod's workdir.
WORKDIR_SOURCE = "sandpool.io/workdir-source"


def workdir_image(image: str, source: Path | str, **kw: Any) -> PodImage:
    """``PodImage(image, **kw)`` whose pods start with a copy of host directory ``source``.

    Raises:
        ImageNotFound: ``source`` is not a directory.
    """
    if not Path(source).is_dir():
        raise errors.ImageNotFound(
            f"image {image!r}: {source} is not a directory; build the image first "
            "(sandpool build-pack) or fix the image_map"
        )
    return PodImage(image, annotations={WORKDIR_SOURCE: str(source)}, **kw)


def local_pack_image_map(images_root: Path | str | None = None) -> Callable[[str], PodImage]:
    """The image map that runs the local task pack's images on the local (kwok) cluster.

    Task image ``name`` becomes :func:`workdir_image` of its repo directory, with
    the image's venv on ``PATH``: ``<images_root>/<safe name>/image.json`` (the local
    backend's image directory, :func:`sandpool.core.backends.local.image_dir`) gives the
    repo the cluster copies into each pod's workdir, so the same tasks run on both backends.
    The image name itself is only a label on kwok (nothing is pulled).

    Raises (when called):
        ImageNotFound: The image directory is missing or malformed.
    """
    from sandpool.core.backends.local import LocalBackend

    local = LocalBackend(images_root)

    def resolve(name: str) -> PodImage:
        img = local.image(name)
        return workdir_image(
            name,
            img.repo,
            workdir=img.workdir,
            head=img.head,
            env={
                "VIRTUAL_ENV": img.venv,
                "PATH": f"{img.venv}/bin:/usr/local/bin:/usr/bin:/bin",
                "HOME": "/tmp",
                "LANG": "C.UTF-8",
                "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_AUTHOR_NAME": "sandbox",
                "GIT_AUTHOR_EMAIL": "sandbox@localhost",
                "GIT_COMMITTER_NAME": "sandbox",
                "GIT_COMMITTER_EMAIL": "sandbox@localhost",
            },
        )

    return resolve
