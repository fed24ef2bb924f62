"""The patch capture as a policy that owns its OCI sandbox's root would answer it.

The capture runs git inside the policy's sandbox (it never runs on the host), so in an OCI
sandbox, whose root the policy may write, the ``git`` it runs can be the policy's: whatever it
prints is the policy's patch. That is fair (a patch is the policy's answer anyway) as long as
nothing it prints can end the rollout other than scored: the patch is checked on the host
before anything applies it, and a patch that cannot be read is refused, 0. A quoted path with
an octal escape past a byte (``\\444``) made the parser raise ``ValueError``, an error sandpool
does not know, so the rollout ended ``infra_failed``, unscored, and was retried.
"""

from __future__ import annotations

import pytest

from sandpool.core import Task
from sandpool.core.backends.local import LocalBackend
from sandpool.envs.grading.policy import check_patch
from sandpool.envs.policies import Policy
from sandpool.envs.runner import run_batch

#: Headers git never prints: octal escapes past a byte, and other malformed quoted paths.
_BAD = ['"a/q\\444.py" "b/q\\444.py"', '"a/q\\400" "b/q\\400"', '"a/q\\9" "b/q\\9"', '"a/q" "b/q\\477"']


def _patch(header: str) -> str:
    path = header.split('" "')[0].strip('"')[2:]
    return (f"diff --git {header}\n--- \"a/{path}\"\n+++ \"b/{path}\"\n"
            "@@ -1 +1 @@\n-a\n+b\n")


@pytest.mark.parametrize("header", _BAD)
def test_a_quoted_path_git_never_writes_is_refused_not_an_error(calc_task, header):
    verdict = check_patch(_patch(header), calc_task)
    assert verdict.refused and "cannot be read" in verdict.refused[0], verdict


class _FakeGit(Policy):
    """Puts a ``git`` at ``where`` (first on its sandbox's PATH, or over the image's) that
    prints ``patch`` for ``diff``."""

    name = "fake-git"

    def __init__(self, patch: str, where: str) -> None:
        self.patch, self.where = patch, where

    async def act(self, lease, task: Task) -> None:
        script = ("#!/bin/sh\ncase \" $* \" in *' diff '*) cat /root/.answer; exit 0;; esac\n"
                  "exec /root/.git-real \"$@\"\n")
        await lease.write_file("/root/.answer", self.patch.encode())
        assert (await lease.exec("cp -p /usr/bin/git /root/.git-real")).ok
        await lease.write_file(self.where, script.encode(), mode=0o755)
        res = await lease.exec("command -v git && git diff --cached HEAD | head -1")
        assert res.text.splitlines()[1:] == [self.patch.splitlines()[0]], res


@pytest.mark.parametrize("where", ["/usr/local/bin/git", "/usr/bin/git"], ids=["added", "replaced"])
async def test_a_policys_own_git_printing_an_unreadable_patch_scores_0_not_infra(
        test_images_root, oci_store, swe_task, where):
    report = await run_batch([swe_task], [_FakeGit(_patch(_BAD[0]), where)],
                             LocalBackend(test_images_root, store=oci_store),
                             rollouts_per_task=1, concurrency=1, strategy="reuse", retries=0)
    (r,) = report.rollouts
    assert (r.outcome.value, r.reward, r.error_kind) == ("task_failed", 0.0, "patch_policy"), \
        report.render_text()
    assert "cannot be read" in (r.error or ""), r
