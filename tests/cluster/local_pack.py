"""The local task pack's images as Kubernetes pod images on the local (kwok) cluster."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sandpool.core.backends.kubernetes import PodImage

__all__ = ["local_pack_image_map"]


def local_pack_image_map(images_root: Path | str | None = None) -> Callable[[str], PodImage]:
    """The image map that runs the local task pack's images on the local (kwok) cluster.

    Task image ``name`` becomes ``PodImage(image=name, workdir_source=<its repo dir>)``, with
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
        return PodImage(
            image=name,
            workdir=img.workdir,
            workdir_source=img.repo,
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
