"""DiffGrader through the rollout accountant, on real sandboxes: one outcome per kind of episode."""

from __future__ import annotations

from sandpool.core.metrics import Outcome
from sandpool.core.pool import SandboxPool
from sandpool.core.rollout import run_rollout
from sandpool.envs.grading.grader import DiffGrader


async def _gold(lease, task) -> None:
    await lease.write_file("/tmp/gold.patch", task.patch.encode())
    assert (await lease.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", timeout=30)).ok


async def test_the_accountant_scores_the_captured_diff_on_a_pristine_sandbox(test_images_root, calc_task):
    from sandpool.core.backends.local import LocalBackend

    async def oracle(lease):
        await _gold(lease, calc_task)

    async def noop(lease):
        await lease.exec("git status --short", timeout=30)

    async def gold_and_a_conftest(lease):
        await _gold(lease, calc_task)
        await lease.write_file("conftest.py", b"import os\n")

    async def gold_and_a_leftover(lease):
        # Left outside the repo and running: neither reaches grading.
        await _gold(lease, calc_task)
        await lease.write_file("/tmp/sitecustomize.py", b"raise SystemExit(3)\n")
        await lease.exec("(sleep 600 &) ; true", timeout=10)

    async def too_big(lease):
        await lease.write_file("big.txt", b"x" * (2 << 20))

    async def fake_passes(lease):
        fake = (b"import os, sys\nif 'pytest' in sys.modules:\n"
                b"    os.write(1, b'PASSED test_calc.py::test_add\\nPASSED test_calc.py::test_zero\\n')\n"
                b"    os._exit(0)\n")
        await lease.write_file("calc.py", fake + await lease.read_file("calc.py"))

    episodes = [oracle, noop, gold_and_a_conftest, gold_and_a_leftover, too_big, fake_passes]
    async with SandboxPool(LocalBackend(test_images_root), "reuse") as pool:
        results = [await run_rollout(pool, calc_task, ep, grader=DiffGrader(timeout=120), rollout=i,
                                     policy=ep.__name__) for i, ep in enumerate(episodes)]
    by = {r.policy: r for r in results}
    assert (by["oracle"].outcome, by["oracle"].reward) == (Outcome.COMPLETED, 1.0), by["oracle"]
    assert (by["noop"].outcome, by["noop"].reward) == (Outcome.COMPLETED, 0.0), by["noop"]
    assert (by["gold_and_a_leftover"].outcome, by["gold_and_a_leftover"].reward) == (Outcome.COMPLETED, 1.0)
    refused = by["gold_and_a_conftest"]
    assert (refused.outcome, refused.reward, refused.error_kind) == (Outcome.TASK_FAILED, 0.0, "patch_policy")
    assert "conftest.py is a start-up or plugin hook" in (refused.error or "")
    big = by["too_big"]
    assert (big.outcome, big.reward, big.error_kind) == (Outcome.TASK_FAILED, 0.0, "patch_policy")
    assert "over the cap" in (big.error or "")
    fake = by["fake_passes"]
    assert (fake.outcome, fake.reward, fake.error_kind) == (Outcome.TASK_FAILED, 0.0, "tampering_suspected")
