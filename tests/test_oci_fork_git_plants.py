"""Git's own run surfaces, planted in an OCI sandbox and carried into its fork children.

Everything git can be told to run (hooks, ``core.hooksPath``, ``core.fsmonitor``, a pager,
an external diff, a textconv, clean/smudge/process filters through ``.git/config``,
``.git/info/attributes`` and a tracked ``.gitattributes``, an ``include.path`` to more of
them), planted by the parent and snapshotted, reaches each child. The child's episode ends
as every episode does: its patch captured (git in the sandbox, with a private git directory),
a reset, and its patch graded on the pristine repo. Nothing planted may run, in the child or
in its grading, and the child's fix is graded on its merit.
"""

from __future__ import annotations

from sandpool.core import PoolLimits, SandboxPool
from sandpool.core.backends.local import LocalBackend
from sandpool.envs.grading import DiffGrader

_RUN = "#!/bin/sh\necho \"$0 $*\" >> /tmp/planted-ran\ncat\n"
_PLANT = ("printf '%s' \"$RUN\" > /root/run.sh && chmod 755 /root/run.sh"
          " && for h in post-checkout pre-commit post-index-change reference-transaction pre-auto-gc"
          " fsmonitor-watchman; do cp /root/run.sh .git/hooks/$h; done"
          " && mkdir -p /root/hooks && cp /root/run.sh /root/hooks/post-checkout"
          " && git config core.hooksPath /root/hooks && git config core.fsmonitor /root/run.sh"
          " && git config core.pager /root/run.sh && git config diff.external /root/run.sh"
          " && git config filter.evil.clean /root/run.sh && git config filter.evil.smudge /root/run.sh"
          " && git config filter.evil.process /root/run.sh && git config diff.evil.textconv /root/run.sh"
          " && printf '[core]\\n\\tfsmonitor = /root/run.sh\\n' > /root/more.cfg"
          " && git config include.path /root/more.cfg"
          " && echo '* filter=evil diff=evil' > .git/info/attributes"
          " && echo '* filter=evil diff=evil' > .gitattributes"
          # Live: git run as a user would run it starts them.
          " && git status --short >/dev/null && git diff HEAD >/dev/null && test -s /tmp/planted-ran"
          " && rm /tmp/planted-ran && echo planted")


async def test_git_surfaces_planted_before_a_fork_never_run_in_a_childs_capture_or_grading(
        test_images_root, oci_store, swe_task):
    grader = DiffGrader(timeout=120)
    async with SandboxPool(LocalBackend(test_images_root, store=oci_store), "reuse",
                           PoolLimits(max_live=4)) as pool:
        async with pool.claim(swe_task) as parent:
            res = await parent.exec(f"RUN='{_RUN}'; {_PLANT}", timeout=60)
            assert res.text == "planted\n", res.err_text
            (child,) = await parent.fork(1)
        try:
            assert (await child.exec("git config core.fsmonitor && test -x .git/hooks/post-checkout")).ok
            await child.write_file("/tmp/gold.patch", swe_task.patch.encode())
            assert (await child.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch "
                                     "&& rm -f /tmp/planted-ran")).ok
            patch = await grader.capture(child, swe_task)
            assert (await child.exec("test ! -e /tmp/planted-ran")).ok, "a planted command ran at capture"
            assert b"return a + b" in patch and b".gitattributes" in patch
            await child.reset()
            assert (await child.exec("test ! -e /tmp/planted-ran && test ! -e /root/run.sh "
                                     "&& test -z \"$(git config core.fsmonitor)\"")).ok
            # Its patch: refused for its .gitattributes (git's own file), never run.
            score = await grader.score(child, swe_task, patch)
            assert score.reward == 0.0 and ".gitattributes is git's own configuration" in score.failure
            fixed = patch.split(b"diff --git a/calcpkg/")[1]
            score = await grader.score(child, swe_task, b"diff --git a/calcpkg/" + fixed)
            assert score.reward == 1.0, score
            assert (await child.exec("test ! -e /tmp/planted-ran")).ok, "a planted command ran at grading"
        finally:
            await child.release()
