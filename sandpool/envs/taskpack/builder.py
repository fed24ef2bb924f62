"""Task-pack builder: real SWE-style tasks from real packages, by procedural bug injection.

For each package: build its image directory (:func:`build_image`), run its whole suite at the
clean commit in real sandboxes, then try seeded-random mutants (:mod:`.mutate`) one by one,
each in a sandbox (:mod:`.mine`). A mutant becomes a task when some tests that passed on the clean commit now
fail (``FAIL_TO_PASS``), and the rest still pass (``PASS_TO_PASS``). Its buggy tree is
committed on top of the clean commit in the package repo, and the gold ``patch`` is
``git diff <mutant> <clean>``. The task then gets an image of its own
(:func:`build_task_image`): one parentless commit of the buggy tree, which is the task's
``base_commit``, so nothing in the sandbox leads to the fix.

The pack is ``<home>/packs/<name>-<digest>/tasks.jsonl`` (SWE-bench JSONL) plus
``manifest.json``; ``digest`` covers the packages, seed, task count and builder version, so a
changed recipe builds a new pack while an unchanged one returns at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.paths import sandpool_home
from sandpool.core.task import Task
from sandpool.envs.taskpack.image import (
    build_image,
    build_task_image,
    file_lock,
    git,
    image_complete,
    image_path,
)
from sandpool.envs.taskpack.mine import Mutant, mine
from sandpool.envs.taskpack.progress import BuildEvent, ProgressCallback
from sandpool.envs.taskpack.spec import DEFAULT_PACKAGES, PYTEST_PIN, PackageSpec

__all__ = ["abuild_default_pack", "abuild_pack", "build_default_pack", "build_pack"]

#: Bump when the way tasks are made changes; it is part of every pack's digest.
PACK_FORMAT = "4"


def _digest(packages: Sequence[PackageSpec], tasks_per_package: int, seed: int,
            max_fail_fraction: float, max_candidates: int) -> str:
    recipe = {
        "format": PACK_FORMAT, "pytest": PYTEST_PIN, "seed": seed, "tasks": tasks_per_package,
        "max_fail_fraction": max_fail_fraction, "max_candidates": max_candidates,
        "packages": [p.model_dump(mode="json") for p in packages],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


async def _pack_is_complete(pack_dir: Path, digest: str, images_root: Path) -> bool:
    """Tell whether the pack's files exist for ``digest`` and every task's commit is kept."""
    manifest, tasks = pack_dir / "manifest.json", pack_dir / "tasks.jsonl"
    if not (manifest.is_file() and tasks.is_file()):
        return False
    try:
        if json.loads(manifest.read_text()).get("digest") != digest:
            return False
        rows = [json.loads(line) for line in tasks.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return False
    for row in rows:
        if not image_complete(images_root, row["image"]):
            return False
        repo = image_path(images_root, row["image"]) / "repo"
        if (await git(repo, "rev-parse", "HEAD")).strip() != row["base_commit"]:
            return False
    return True


_CLOSINGS = (
    ("The tests are right; the library code is wrong. Please fix it so these tests pass "
     "again without breaking the rest of the suite."),
    ("Expected: these tests pass, like the rest of the suite. The tests themselves should "
     "not need changes."),
    "Please fix the implementation (not the tests) so that the whole suite passes again.",
)


def _subject(test_id: str) -> str:
    name = test_id.split("::")[-1].split("[", 1)[0]
    return name.removeprefix("test_") or name


def _problem_statement(spec: PackageSpec, mutant: Mutant, rng: random.Random) -> str:
    f2p = mutant.fail_to_pass
    subjects = list(dict.fromkeys(_subject(t) for t in f2p))
    subject = f"`{subjects[0]}`" if len(subjects) == 1 else f"`{subjects[0]}` and related behaviour"
    title = rng.choice([
        f"{subject} gives wrong results",
        f"Regression: {subject} no longer behaves as the tests expect",
        f"Bug in {spec.dist}: {subject} is broken",
        f"{subject} misbehaves",
    ])
    shown = f2p[:6]
    intro = (f"Running the {spec.dist} {spec.version} test suite in this checkout, "
             f"{len(f2p)} test{'s' if len(f2p) != 1 else ''} that used to pass now fail:")
    lines = [title, "", intro, "", *(f"- `{t}`" for t in shown)]
    if len(f2p) > len(shown):
        lines.append(f"- ... and {len(f2p) - len(shown)} more")
    excerpts = [(t, mutant.messages.get(t, "")) for t in shown if mutant.messages.get(t)]
    if excerpts:
        lines += ["", "What pytest reports:", "", "```"]
        for t, msg in excerpts[:3]:
            lines += [f"{t}", f"    {msg[:300]}"]
        lines.append("```")
    lines += [
        "",
        rng.choice(_CLOSINGS),
        "",
        f"Reproduce with: `python -m pytest {' '.join(sorted({t.split('::')[0] for t in shown}))}`",
    ]
    return "\n".join(lines) + "\n"


async def _commit_task(spec: PackageSpec, repo: Path, clean: str, mutant: Mutant, ref: str,
                       sources: dict[str, bytes] | None = None) -> tuple[str, str]:
    """Commit the mutant tree on top of ``clean``; return (commit, gold patch)."""
    m = mutant.mutation
    original = (repo / m.path).read_bytes() if sources is None else sources[m.path]
    blob = (await git(repo, "hash-object", "-w", "--stdin", input=m.apply(original))).strip()
    mode = (await git(repo, "ls-tree", clean, "--", m.path)).split()[0]
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        await git(repo, "read-tree", clean, env=env)
        await git(repo, "update-index", "--cacheinfo", f"{mode},{blob},{m.path}", env=env)
        tree = (await git(repo, "write-tree", env=env)).strip()
    message = f"{spec.dist} {spec.version}"
    commit = (await git(repo, "commit-tree", tree, "-p", clean, "-m", message)).strip()
    await git(repo, "update-ref", ref, commit)
    patch = await git(repo, "diff", "--no-color", "--no-ext-diff", "--no-renames", commit, clean)
    return commit, patch


async def abuild_pack(
    packages: Sequence[PackageSpec],
    tasks_per_package: int,
    *,
    seed: int = 0,
    name: str = "pack",
    home: Path | str | None = None,
    progress: ProgressCallback | None = None,
    workers: int = 2,
    max_fail_fraction: float = 0.5,
    max_candidates: int = 80,
) -> Path:
    """Build (or reuse) a task pack; return the path of its ``tasks.jsonl``.

    Needs root and bubblewrap (tests run in :class:`LocalBackend` sandboxes) and, on a cold
    build, the package index. Deterministic: the same arguments give the same tasks, commit
    hashes included. A complete pack for the same recipe returns at once.

    Args:
        packages: The packages to make tasks from (see :data:`DEFAULT_PACKAGES`).
        tasks_per_package: How many tasks to make per package; a package whose candidates
            run out yields fewer.
        seed: Seed of the candidate order.
        name: Prefix of the pack directory ``<home>/packs/<name>-<digest12>``.
        home: Cache root (default :func:`sandpool_home`); images go to ``<home>/images``.
        progress: Optional callback receiving :class:`BuildEvent` s.
        workers: Sandboxes per package that try mutants concurrently (2 suits 2 cores).
        max_fail_fraction: A mutant that breaks more than this fraction of the passing
            tests is rejected as too blunt (e.g. it breaks imports).
        max_candidates: Most candidate mutants tried per package.

    Returns:
        Path of ``tasks.jsonl``: one SWE-bench row (a :class:`Task`) per line, with a
        ``version`` column.

    Raises:
        ConfigError: An argument is out of range, a package's ``sources`` match no file,
            no test passes at a package's clean commit, or no task at all was found.
        SandboxStartError: An image step (pip, venv, git) or a sandbox failed.
        BackendUnavailable: The local backend cannot run here (no bubblewrap, not root).
    """
    if tasks_per_package < 1:
        raise errors.ConfigError(f"tasks_per_package must be >= 1, got {tasks_per_package}")
    if workers < 1:
        raise errors.ConfigError(f"workers must be >= 1, got {workers}")
    if not packages:
        raise errors.ConfigError(
            "packages is empty; pass at least one PackageSpec (e.g. DEFAULT_PACKAGES)")
    if not 0 < max_fail_fraction <= 1:
        raise errors.ConfigError(f"max_fail_fraction must be in (0, 1], got {max_fail_fraction}")
    root = Path(home) if home is not None else sandpool_home()
    images_root = root / "images"
    digest = _digest(packages, tasks_per_package, seed, max_fail_fraction, max_candidates)
    pack_dir = root / "packs" / f"{name}-{digest[:12]}"
    tasks_path = pack_dir / "tasks.jsonl"
    if await _pack_is_complete(pack_dir, digest, images_root):
        return tasks_path
    emit = progress or (lambda event: None)
    async with file_lock(root / "packs" / f".{pack_dir.name}.lock"):
        if await _pack_is_complete(pack_dir, digest, images_root):
            return tasks_path
        started = time.monotonic()
        limit = asyncio.Semaphore(2)

        async def image(spec: PackageSpec) -> Path:
            async with limit:
                return await build_image(spec, images_root, progress=emit)

        image_dirs = await asyncio.gather(*(image(spec) for spec in packages))
        backend = LocalBackend(images_root=images_root, state_root=root / "local")
        rows: list[Task] = []
        try:
            for spec, img in zip(packages, image_dirs, strict=True):
                repo = img / "repo"
                rng = random.Random(f"{seed}:{spec.dist}:{spec.version}")
                mutants = await mine(spec, repo, backend, tasks_per_package, rng, workers=workers,
                                      max_fail_fraction=max_fail_fraction,
                                      max_candidates=max_candidates, emit=emit)
                clean = (await git(repo, "rev-parse", "refs/heads/main")).strip()
                for n, mutant in enumerate(mutants, start=1):
                    instance_id = f"{spec.instance_prefix}-{n}"
                    ref = f"refs/sandpool/{pack_dir.name}/{instance_id}"
                    commit, patch = await _commit_task(spec, repo, clean, mutant, ref)
                    task_image = f"sandpool.local/{instance_id.lower()}:{spec.version}"
                    base = await build_task_image(img, commit, images_root, task_image)
                    rows.append(Task(
                        instance_id=instance_id, repo=spec.repo, base_commit=base,
                        image=task_image, problem_statement=_problem_statement(spec, mutant, rng),
                        patch=patch, test_patch="", FAIL_TO_PASS=tuple(mutant.fail_to_pass),
                        PASS_TO_PASS=tuple(mutant.pass_to_pass), version=spec.version,
                    ))
                emit(BuildEvent(spec.dist, "mutants", len(mutants), tasks_per_package,
                                f"{len(mutants)} tasks"))
        finally:
            await backend.aclose()
        if not rows:
            raise errors.ConfigError("no mutant broke any test in any package; pick other packages")
        emit(BuildEvent("", "write", 0, 1, f"writing {len(rows)} tasks"))
        pack_dir.mkdir(parents=True, exist_ok=True)
        tmp = tasks_path.with_suffix(".tmp")
        tmp.write_text("".join(row.model_dump_json() + "\n" for row in rows))
        os.replace(tmp, tasks_path)
        manifest = {
            "digest": digest, "format": PACK_FORMAT, "seed": seed,
            "tasks_per_package": tasks_per_package, "tasks": len(rows),
            "packages": [{"dist": p.dist, "version": p.version, "image": p.image}
                         for p in packages],
            "build_seconds": round(time.monotonic() - started, 1),
        }
        (pack_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        emit(BuildEvent("", "done", 1, 1, f"{len(rows)} tasks in {tasks_path}"))
        return tasks_path


def _sync(coro):  # type: ignore[no-untyped-def]
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise errors.ConfigError(
        "build_pack/build_default_pack were called inside a running event loop; "
        "await abuild_pack/abuild_default_pack instead")


async def abuild_default_pack(*, home: Path | str | None = None,
                              progress: ProgressCallback | None = None, workers: int = 2) -> Path:
    """Build (or reuse) the default pack: :data:`DEFAULT_PACKAGES`, 7 tasks each, seed 0.

    Returns the path of ``<home>/packs/default-<digest12>/tasks.jsonl``. See
    :func:`abuild_pack` for what it needs and raises.
    """
    return await abuild_pack(DEFAULT_PACKAGES, 7, seed=0, name="default", home=home,
                             progress=progress, workers=workers)


def build_pack(
    packages: Sequence[PackageSpec],
    tasks_per_package: int,
    *,
    seed: int = 0,
    name: str = "pack",
    home: Path | str | None = None,
    progress: ProgressCallback | None = None,
    workers: int = 2,
    max_fail_fraction: float = 0.5,
    max_candidates: int = 80,
) -> Path:
    """Blocking form of :func:`abuild_pack`, with the same arguments and errors.

    Returns the ``tasks.jsonl`` path. Raises ConfigError when called inside a running
    event loop (await :func:`abuild_pack` there).
    """
    return _sync(abuild_pack(
        packages, tasks_per_package, seed=seed, name=name, home=home, progress=progress,
        workers=workers, max_fail_fraction=max_fail_fraction, max_candidates=max_candidates,
    ))


def build_default_pack(*, home: Path | str | None = None, progress: ProgressCallback | None = None,
                       workers: int = 2) -> Path:
    """Blocking form of :func:`abuild_default_pack`; returns the ``tasks.jsonl`` path.

    Raises ConfigError when called inside a running event loop.
    """
    return _sync(abuild_default_pack(home=home, progress=progress, workers=workers))
