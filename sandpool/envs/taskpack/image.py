"""Local image directories: a package's sdist as a git repo, plus a venv with its test deps.

Layout of ``<images_root>/<safe-name>/`` (``safe-name`` is the image name with every
character outside ``[A-Za-z0-9._-]`` replaced by ``_``)::

    repo/        the unpacked sdist as a git repo: one commit on ``main`` with a fixed
                 author and date, so its hash is the same on every machine
    venv/        ``python -m venv`` of the builder's interpreter, with pytest and the
                 package's requirements; a ``.pth`` file puts ``/testbed/<import_root>`` on
                 ``sys.path``, so imports resolve to the sandbox's checkout
    image.json   what the local backend reads (name, python_prefix, venv, repo, workdir)
    .complete    written last; an image directory without it is half-built and is rebuilt
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

from sandpool.core import errors
from sandpool.envs.taskpack.progress import BuildEvent, ProgressCallback
from sandpool.envs.taskpack.spec import PYTEST_PIN, PackageSpec

__all__ = ["WORKDIR", "build_image", "build_task_image", "file_lock", "git", "image_complete",
           "image_path"]

#: Where the repo appears inside a sandbox.
WORKDIR = "/testbed"
#: Bump when the image layout changes; older image directories are rebuilt.
IMAGE_FORMAT = "1"
_MARKER = ".complete"
#: Fixed identity and clock for every commit the builder makes, so hashes are reproducible.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "sandpool",
    "GIT_AUTHOR_EMAIL": "sandpool@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "sandpool",
    "GIT_COMMITTER_EMAIL": "sandpool@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
}


def image_path(images_root: Path, name: str) -> Path:
    """Return the image directory of image ``name`` under ``images_root``."""
    return Path(images_root) / re.sub(r"[^A-Za-z0-9._-]", "_", name)


async def _run(*argv: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
               input: bytes | None = None, what: str) -> bytes:
    """Run a host command; return its stdout. Raises SandboxStartError naming ``what``."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PYTHONPATH", None)
    proc = await asyncio.create_subprocess_exec(
        *map(str, argv), cwd=cwd, env=full_env,
        stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(input)
    if proc.returncode != 0:
        tail = (err or out).decode(errors="replace").strip()[-1500:]
        raise errors.SandboxStartError(f"{what} failed (exit {proc.returncode}): {tail}")
    return out


async def git(repo: Path, *args: str, input: bytes | None = None,
              env: dict[str, str] | None = None) -> str:
    """Run ``git -C repo <args>`` with the builder's fixed identity; return stdout as text.

    Raises:
        SandboxStartError: git exited non-zero (the message has its stderr).
    """
    out = await _run("git", "-C", repo, *args, input=input, env={**GIT_ENV, **(env or {})},
                     what=f"git {' '.join(args[:2])} in {repo}")
    return out.decode("utf-8", "replace")


@contextlib.asynccontextmanager
async def file_lock(path: Path) -> AsyncIterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing), polling without blocking
    the event loop; serializes builds across processes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.2)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _unpack(archive: Path, dest: Path) -> None:
    """Unpack an sdist into ``dest``, dropping its single top-level directory."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(tmp, filter="data")
        tops = list(Path(tmp).iterdir())
        root = tops[0] if len(tops) == 1 and tops[0].is_dir() else Path(tmp)
        if root == Path(tmp):
            shutil.copytree(root, dest, symlinks=True)
        else:
            root.rename(dest)


async def build_image(spec: PackageSpec, images_root: Path, *,
                      progress: ProgressCallback | None = None) -> Path:
    """Build the image directory of ``spec`` unless a complete one exists; return its path.

    Idempotent and safe to call from several processes at once (a file lock serializes
    builds of one image). A directory without the completion marker is removed and rebuilt.
    Needs the package index (pip) on a cold build, nothing on a warm one.

    Args:
        spec: The package to build.
        images_root: Directory holding image directories (``sandpool_home()/images``).
        progress: Optional callback receiving :class:`BuildEvent` s (stage ``image``).

    Returns:
        The image directory (holding ``image.json``).

    Raises:
        SandboxStartError: A step (venv, pip download/install, git) failed; the message
            names the step and carries its output.
    """
    images_root = Path(images_root)
    target = image_path(images_root, spec.image)
    marker = target / _MARKER
    if marker.is_file() and marker.read_text() == IMAGE_FORMAT:
        return target
    emit = progress or (lambda event: None)
    async with file_lock(images_root / f".{target.name}.lock"):
        if marker.is_file() and marker.read_text() == IMAGE_FORMAT:
            return target
        if target.exists():
            await asyncio.to_thread(shutil.rmtree, target)
        target.mkdir(parents=True)
        venv, repo = target / "venv", target / "repo"

        emit(BuildEvent(spec.dist, "image", 0, 4, "creating venv"))
        # The builder's own pip drives the new venv (``--python``) when it has one, which
        # saves bootstrapping pip into every image; otherwise the venv gets its own pip.
        host_pip = importlib.util.find_spec("pip") is not None
        await _run(sys.executable, "-m", "venv", *(["--without-pip"] if host_pip else []), venv,
                   what=f"python -m venv {venv}")
        py = venv / "bin" / "python"
        pip_cmd = (sys.executable, "-m", "pip", "--python", py) if host_pip else (py, "-m", "pip")
        pip = (*pip_cmd, "--disable-pip-version-check", "--no-input", "-q")

        emit(BuildEvent(spec.dist, "image", 1, 4, f"downloading {spec.dist}=={spec.version} sdist"))
        sdist_dir = target / "sdist"
        await _run(*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", sdist_dir,
                   f"{spec.dist}=={spec.version}", what=f"pip download of the {spec.dist} sdist")
        archives = sorted(sdist_dir.iterdir())
        if len(archives) != 1:
            raise errors.SandboxStartError(f"expected one sdist for {spec.dist}, got {archives}")
        await asyncio.to_thread(_unpack, archives[0], repo)
        await asyncio.to_thread(shutil.rmtree, sdist_dir)

        emit(BuildEvent(spec.dist, "image", 2, 4, "making the git repo"))
        await git(repo, "init", "-q", "-b", "main")
        for key, value in (("user.name", "sandpool"), ("user.email", "sandpool@localhost"),
                           ("gc.auto", "0"), ("core.autocrlf", "false")):
            await git(repo, "config", key, value)
        await git(repo, "add", "-A", "-f")
        await git(repo, "commit", "-q", "--no-verify", "-m", f"{spec.dist} {spec.version}")

        emit(BuildEvent(spec.dist, "image", 3, 4, "installing pytest and requirements"))
        await _run(*pip, "install", PYTEST_PIN, *spec.requirements,
                   what=f"pip install into {venv}")
        purelib = (await _run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                              what="reading the venv's site-packages")).decode().strip()
        root = f"{WORKDIR}/{spec.import_root}".rstrip("/")
        Path(purelib, "sandpool_testbed.pth").write_text(root + "\n")
        prefix = (await _run(py, "-c", "import sys; print(sys.base_prefix)",
                             what="reading the venv's base prefix")).decode().strip()

        meta = {"name": spec.image, "python_prefix": prefix, "venv": str(venv.resolve()),
                "repo": str(repo.resolve()), "workdir": WORKDIR}
        (target / "image.json").write_text(json.dumps(meta, indent=2) + "\n")
        marker.write_text(IMAGE_FORMAT)
        emit(BuildEvent(spec.dist, "image", 4, 4, "image ready"))
        return target


async def build_task_image(package_image: Path, commit: str, images_root: Path, name: str) -> str:
    """Make the per-task image ``name``: one parentless commit holding ``commit``'s tree.

    A task's sandbox must not be able to reach the fix: a shared package repo holds the clean
    commit and every other task's mutant (whose trees carry the clean version of this task's
    file), so ``git diff HEAD~1`` or ``git log --all`` would reveal the gold patch. Like
    SWE-bench's per-instance images, the task image's repo has exactly one commit and no other
    object. It shares the package image's venv (bind-mounted read-only).

    Args:
        package_image: The package's image directory (its ``repo`` holds ``commit``).
        commit: The mutant commit in the package repo.
        images_root: Where image directories live.
        name: The task image's name, e.g. ``sandpool.local/pytoolz__toolz-1:1.0.0``.

    Returns:
        The task's ``base_commit`` (reproducible: fixed author, date and message).

    Raises:
        SandboxStartError: A git step failed.
    """
    target = image_path(images_root, name)
    shutil.rmtree(target, ignore_errors=True)
    repo = target / "repo"
    repo.mkdir(parents=True)
    src = package_image / "repo"
    with tempfile.TemporaryDirectory() as tmp:
        # checkout-index, not `git archive`, so export-ignore attributes cannot drop files.
        env = {**GIT_ENV, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        tree = ("--git-dir", str(src / ".git"), "--work-tree", str(repo))
        await _run("git", *tree, "read-tree", commit, env=env, what=f"reading {commit[:12]}")
        await _run("git", *tree, "checkout-index", "-a", "-f", env=env, what="writing the task tree")
    await git(repo, "init", "-q", "-b", "main")
    await git(repo, "add", "-A", "-f")
    await git(repo, "commit", "-q", "-m", "base")
    base = (await git(repo, "rev-parse", "HEAD")).strip()
    meta = json.loads((package_image / "image.json").read_text())
    meta.update(name=name, repo=str(repo.resolve()))
    (target / "image.json").write_text(json.dumps(meta, indent=2) + "\n")
    (target / _MARKER).write_text(IMAGE_FORMAT)
    return base


def image_complete(images_root: Path, name: str) -> bool:
    """Tell whether the image directory of ``name`` exists and was built to completion."""
    marker = image_path(images_root, name) / _MARKER
    return marker.is_file() and marker.read_text() == IMAGE_FORMAT
