"""Build real SWE-style task packs offline from pinned open-source packages.

Usage::

    from sandpool.envs.taskpack import build_default_pack
    tasks_jsonl = build_default_pack()          # cold: a few minutes; warm: immediate

See :mod:`.builder` for how tasks are made, :mod:`.image` for the image directory layout.
"""

from sandpool.envs.taskpack.builder import (
    abuild_default_pack,
    abuild_pack,
    build_default_pack,
    build_pack,
)
from sandpool.envs.taskpack.image import build_image
from sandpool.envs.taskpack.mutate import Mutation, find_mutations
from sandpool.envs.taskpack.progress import BuildEvent, ProgressCallback, RichBuildProgress
from sandpool.envs.taskpack.spec import DEFAULT_PACKAGES, PackageSpec

__all__ = [
    "DEFAULT_PACKAGES",
    "BuildEvent",
    "Mutation",
    "PackageSpec",
    "ProgressCallback",
    "RichBuildProgress",
    "abuild_default_pack",
    "abuild_pack",
    "build_default_pack",
    "build_image",
    "build_pack",
    "find_mutations",
]
