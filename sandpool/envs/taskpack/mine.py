"""Mining a package for tasks: which of its candidate mutants break tests, and which tests.

:func:`mine` runs the package's whole suite twice at the clean commit in real sandboxes (a test
that passes in both is a candidate ``PASS_TO_PASS``), then tries seeded-random mutants
(:mod:`.mutate`) one by one, each in a sandbox of the package image, restored to the clean
tree after. A mutant is kept (a :class:`Mutant`) when the suite exits 1, some tests that passed
at the clean commit fail, and fail again when rerun (a flaky test is not a task), and no more
than ``max_fail_fraction`` of the passing tests broke. What a kept mutant becomes (a commit, an
image, a task row) is :mod:`.builder`'s.
"""

from __future__ import annotations

import asyncio
import glob
import random
from dataclasses import dataclass, field
from pathlib import Path

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.base import Sandbox
from sandpool.envs.grading import TestStatus, parse_test_log_details, pytest_command, pytest_env
from sandpool.envs.taskpack.mutate import Mutation, find_mutations, select_mutations
from sandpool.envs.taskpack.progress import BuildEvent, ProgressCallback
from sandpool.envs.taskpack.spec import PackageSpec

__all__ = ["Mutant", "mine"]

_MAX_LOG = 64 << 20


@dataclass
class Mutant:
    """A mutation that makes a valid task: the tests it breaks (``fail_to_pass``), the passing
    tests it leaves passing (``pass_to_pass``) and pytest's message for each broken test."""

    mutation: Mutation
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    messages: dict[str, str] = field(default_factory=dict)


_Log = dict[str, tuple[TestStatus, str]]


async def _run_suite(sb: Sandbox, spec: PackageSpec,
                     timeout: float) -> tuple[int, _Log, float, bool]:
    """Run the package's whole suite; return (exit code, parsed log, seconds, timed out)."""
    res = await sb.exec(pytest_command(spec.tests), timeout=timeout, env=pytest_env(),
                        max_output=_MAX_LOG)
    if res.stdout_truncated:
        raise errors.ExecTransportError(f"{spec.dist}: test log over {_MAX_LOG} bytes was cut")
    return res.exit_code, parse_test_log_details(res.text), res.duration_s, res.timed_out


async def _restore(sb: Sandbox) -> None:
    res = await sb.exec("git reset -q --hard && git clean -qfdx", timeout=120)
    if not res.ok:
        raise errors.SandboxStartError(
            f"sandbox {sb.id}: could not restore the clean tree: {res.err_text}")


def _candidates(spec: PackageSpec, repo: Path,
                rng: random.Random) -> tuple[list[Mutation], dict[str, bytes]]:
    sources: dict[str, bytes] = {}
    for pattern in spec.sources:
        matches = sorted(glob.glob(pattern, root_dir=repo))
        if not matches:
            raise errors.ConfigError(
                f"{spec.dist}: sources pattern {pattern!r} matches no file in the sdist; "
                "fix PackageSpec.sources (paths are relative to the sdist root)"
            )
        for rel in matches:
            if rel.endswith(".py"):
                sources[rel] = (repo / rel).read_bytes()
    found = [m for rel, src in sources.items() for m in find_mutations(rel, src, validate=False)]
    return select_mutations(found, rng, per_function=spec.per_function), sources


async def mine(
    spec: PackageSpec, repo: Path, backend: LocalBackend, wanted: int, rng: random.Random, *,
    workers: int, max_fail_fraction: float, max_candidates: int, emit: ProgressCallback,
) -> list[Mutant]:
    """Find up to ``wanted`` valid mutants of ``spec``, trying candidates in seeded order."""
    candidates, sources = _candidates(spec, repo, rng)
    candidates = candidates[:max_candidates]
    sandboxes = list(await asyncio.gather(*(backend.create(spec.image) for _ in range(workers))))
    try:
        emit(BuildEvent(spec.dist, "baseline", 0, wanted, "running the clean suite"))
        baselines = await asyncio.gather(*(_run_suite(sb, spec, 900.0) for sb in sandboxes[:2]))
        passing = [t for t, (s, _) in baselines[0][1].items()  # passed in both runs: not flaky
                   if s.passed and all(t in b[1] and b[1][t][0].passed for b in baselines)]
        if not passing:
            raise errors.ConfigError(
                f"{spec.dist}: no test passes at the clean commit (exit {baselines[0][0]}); "
                "fix PackageSpec.tests or PackageSpec.requirements"
            )
        # A mutant may loop forever; it is cut off at a few times the clean suite's duration.
        run_timeout = max(30.0, 4 * max(b[2] for b in baselines))
        results: dict[int, Mutant | None] = {}
        cursor = 0

        def enough() -> bool:
            valid = 0
            for i in range(len(candidates)):
                if i not in results:
                    return False
                valid += results[i] is not None
                if valid >= wanted:
                    return True
            return True

        async def attempt(sb: Sandbox, m: Mutation) -> Mutant | None:
            if not m.is_effective(sources[m.path]):
                return None
            await sb.write_file(m.path, m.apply(sources[m.path]))
            try:
                code, log, _, timed_out = await _run_suite(sb, spec, run_timeout)
                if timed_out or code != 1:
                    return None  # 0: no test noticed; 2-5: collection/usage errors; timeouts
                broken = [t for t in passing if not (t in log and log[t][0].passed)]
                if not broken or len(broken) > max_fail_fraction * len(passing):
                    return None
                # A flaky test can fail once by chance: keep only tests that fail again.
                again = await sb.exec(pytest_command(broken), timeout=run_timeout, env=pytest_env(),
                                      max_output=_MAX_LOG)
                relog = parse_test_log_details(again.text)
                broken = [t for t in broken if not (t in relog and relog[t][0].passed)]
                if not broken or again.timed_out:
                    return None
            finally:
                await _restore(sb)
            gone = set(broken)
            return Mutant(m, broken, [t for t in passing if t not in gone],
                           {t: log[t][1] for t in broken if t in log})

        async def worker(sb: Sandbox) -> None:
            nonlocal cursor
            while cursor < len(candidates) and not enough():
                i, cursor = cursor, cursor + 1
                results[i] = await attempt(sb, candidates[i])
                found = sum(r is not None for r in results.values())
                emit(BuildEvent(spec.dist, "mutants", min(found, wanted), wanted,
                                f"tried {len(results)}/{len(candidates)} candidates"))

        await asyncio.gather(*(worker(sb) for sb in sandboxes))
    finally:
        await asyncio.gather(*(backend.delete(sb) for sb in sandboxes))
    return [r for _, r in sorted(results.items()) if r is not None][:wanted]
