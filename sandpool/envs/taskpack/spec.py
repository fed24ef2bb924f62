"""What a task pack is made from: pinned source packages and where their code and tests are."""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DEFAULT_PACKAGES", "PYTEST_PIN", "PackageSpec"]

#: The pytest every image venv gets. Pinned so that its ``-rA`` output format is fixed.
PYTEST_PIN = "pytest==8.4.2"


class PackageSpec(BaseModel):
    """One open-source Python package to make tasks from, pinned to an exact release.

    Usage: ``PackageSpec(dist="toolz", version="1.0.0", repo="pytoolz/toolz",
    sources=("toolz/*.py",), tests=("toolz/tests",))``.

    Attributes:
        dist: The distribution name on the package index, e.g. ``python-slugify``.
        version: The exact release whose sdist (which must ship its tests) is used.
        repo: The upstream ``owner/name``; it becomes the task's ``repo`` and instance id
            prefix (``owner__name-<n>``).
        import_root: Directory (relative to the repo root) that must be on ``sys.path`` for
            the package to import: ``""`` for a flat layout, ``"src"`` for a src layout.
        sources: Glob patterns (relative to the repo root) of the modules to inject bugs in.
        tests: Test paths passed to pytest to run the whole suite.
        requirements: Runtime and test requirements installed into the image venv besides
            pytest, each pinned (``name==version``).
        per_function: How many tasks one function may yield (at different lines).
    """

    model_config = ConfigDict(frozen=True)

    dist: str = Field(min_length=1)
    version: str
    repo: str = Field(pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
    import_root: str = ""
    sources: tuple[str, ...] = Field(min_length=1)
    tests: tuple[str, ...] = Field(min_length=1)
    requirements: tuple[str, ...] = ()
    per_function: int = Field(default=1, ge=1)

    @field_validator("version")
    @classmethod
    def _exact_version(cls, value: str) -> str:
        try:
            Version(value)
        except InvalidVersion as exc:
            raise ValueError(
                f"version must be an exact release such as '1.0.0', got {value!r}") from exc
        return value

    @field_validator("requirements")
    @classmethod
    def _pinned(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for req in value:
            if not re.fullmatch(r"[A-Za-z0-9_.\[\]-]+==[A-Za-z0-9_.+!-]+", req):
                raise ValueError(f"requirement {req!r} must be pinned as 'name==version'")
        return value

    @property
    def image(self) -> str:
        """The local image name, e.g. ``sandpool.local/toolz:1.0.0``."""
        return f"sandpool.local/{canonicalize_name(self.dist)}:{self.version}"

    @property
    def instance_prefix(self) -> str:
        """Prefix of this package's instance ids, e.g. ``pytoolz__toolz``."""
        return self.repo.replace("/", "__")


#: The default pack's packages: pure-Python libraries whose shipped suites run in seconds.
DEFAULT_PACKAGES: tuple[PackageSpec, ...] = (
    PackageSpec(
        dist="toolz", version="1.0.0", repo="pytoolz/toolz",
        sources=("toolz/dicttoolz.py", "toolz/functoolz.py", "toolz/itertoolz.py",
                 "toolz/recipes.py"),
        tests=("toolz/tests",),
    ),
    PackageSpec(
        dist="cachetools", version="8.0.2", repo="tkem/cachetools", import_root="src",
        sources=("src/cachetools/*.py",),
        tests=("tests",),
    ),
    PackageSpec(
        dist="boltons", version="26.2.0", repo="mahmoud/boltons",
        sources=(
            "boltons/iterutils.py", "boltons/strutils.py", "boltons/dictutils.py",
            "boltons/setutils.py", "boltons/listutils.py", "boltons/cacheutils.py",
            "boltons/mathutils.py", "boltons/queueutils.py",
        ),
        tests=("tests",),
    ),
    PackageSpec(
        dist="python-slugify", version="9.2.0", repo="un33k/python-slugify",
        sources=("slugify/slugify.py", "slugify/_legacy.py"),
        tests=("tests",),
        requirements=("text-unidecode==1.3",),
        per_function=3,
    ),
)
