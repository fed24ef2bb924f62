"""Capture: the policy's change to the repo, taken as a patch from the sandbox it left.

The patch is what ``git diff`` between ``base_commit`` and the work tree shows: tracked files
changed or deleted, and files added (untracked files that the tree's ``.gitignore`` does not
ignore), with their modes, binary content as binary patches, no rename detection. It is
taken without trusting anything the policy left:

* the policy's processes are killed first, so nothing changes the tree while it is read;
* git runs with a private git directory, index and object store under a fresh directory in
  ``/tmp``; the repo's ``.git`` is used only as a source of objects (its config, hooks,
  attributes, refs, replace refs and index are never read). No system or global config, no
  hooks, no fsmonitor, no external diff or textconv, no replace objects. An object the policy
  altered can only make its own patch wrong: the patch is applied to a pristine tree later;
* bytecode Python writes (``__pycache__/``, ``*.pyc``, ``*.pyo``) is left out: it is what
  running the code makes, not a change, and grading never reads bytecode;
* every read is bounded: files past the size cap are refused before git reads them, the
  patch's output is capped, and the command has a timeout.

A patch over the cap, a tree git cannot diff against ``base_commit`` (the policy broke the
object store), a capture the policy made time out, or a disk the policy filled is the
policy's failure: :class:`~sandpool.core.errors.PatchRefused` or
:class:`~sandpool.core.errors.DiskQuotaExceeded`, scored 0.
"""

from __future__ import annotations

import errno
import secrets
import shlex

from sandpool.core import errors
from sandpool.core.task import Task
from sandpool.envs.grading.policy import MAX_PATCH_BYTES

__all__ = ["GIT", "capture_patch"]

#: git with nothing from the environment, the user or the system: run it with
#: ``--git-dir``/``--work-tree`` of a private git directory.
GIT = ("env -u GIT_DIR -u GIT_WORK_TREE -u GIT_INDEX_FILE -u GIT_OBJECT_DIRECTORY "
       "-u GIT_ALTERNATE_OBJECT_DIRECTORIES -u GIT_CONFIG_PARAMETERS -u GIT_CONFIG_COUNT "
       "-u GIT_EXTERNAL_DIFF -u GIT_DIFF_OPTS -u GIT_ATTR_SOURCE "
       "HOME=/nonexistent XDG_CONFIG_HOME=/nonexistent GIT_CONFIG_GLOBAL=/dev/null "
       "GIT_CONFIG_NOSYSTEM=1 GIT_ATTR_NOSYSTEM=1 GIT_NO_REPLACE_OBJECTS=1 GIT_TERMINAL_PROMPT=0 "
       "GIT_OPTIONAL_LOCKS=0 GIT_NO_LAZY_FETCH=1 LC_ALL=C "
       "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.attributesFile=/dev/null "
       "-c core.excludesFile=/dev/null -c core.untrackedCache=false -c core.splitIndex=false "
       "-c core.autocrlf=false -c core.quotePath=true -c diff.noprefix=false "
       "-c diff.mnemonicPrefix=false -c diff.relative=false -c protocol.allow=never")
_BYTECODE = "':(exclude,glob)**/__pycache__/**' ':(exclude,glob)**/*.pyc' ':(exclude,glob)**/*.pyo'"
_SIZE_EXIT, _BASE_EXIT, _SETUP_EXIT = 92, 91, 90


def _script(priv: str, workdir: str, base: str, cap: int) -> str:
    g = f"{GIT} --git-dir={priv}/git --work-tree=."
    return "\n".join([
        "set -u",
        f"trap 'rm -rf {priv}' EXIT",
        f"cd {shlex.quote(workdir)} || exit {_BASE_EXIT}",
        # A bare private repository whose only objects are the work tree's own .git/objects.
        f"mkdir -m 700 {priv} {priv}/git {priv}/git/objects {priv}/git/objects/info {priv}/git/refs"
        f" || exit {_SETUP_EXIT}",
        f"printf 'ref: refs/heads/none\\n' > {priv}/git/HEAD || exit {_SETUP_EXIT}",
        f"printf '[core]\\n\\trepositoryformatversion = 0\\n\\tbare = false\\n' > {priv}/git/config"
        f" || exit {_SETUP_EXIT}",
        f"printf '%s/.git/objects\\n' \"$PWD\" > {priv}/git/objects/info/alternates || exit {_SETUP_EXIT}",
        f"{g} read-tree {shlex.quote(base)} || exit {_BASE_EXIT}",
        f"{g} update-index -q --refresh >/dev/null",
        # What git would read: changed tracked files and untracked ones, by size, before it does.
        f"total=$({{ {g} diff-files --name-only -z -- . {_BYTECODE};"
        f" {g} ls-files -z --others --exclude-standard -- . {_BYTECODE}; }}"
        " | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')",
        f"if [ \"$total\" -gt {cap} ]; then echo \"$total\"; exit {_SIZE_EXIT}; fi",
        f"{g} add -A -- . {_BYTECODE} || exit {_SETUP_EXIT}",
        f"{g} diff --cached --binary --full-index --no-renames --no-ext-diff --no-textconv"
        f" --no-color --src-prefix=a/ --dst-prefix=b/ {shlex.quote(base)}",
    ]) + "\n"


async def capture_patch(sandbox, task: Task, *, max_bytes: int = MAX_PATCH_BYTES,
                        timeout: float = 300.0) -> bytes:
    """Take the policy's change to the repo as a patch (see the module docstring).

    Args:
        sandbox: The policy's sandbox: a :class:`~sandpool.core.base.Sandbox` or a pool
            lease (its ``sandbox`` is used to kill the policy's processes).
        task: The task; the patch is against ``task.base_commit`` in ``task.workdir``.
        max_bytes: Cap on the patch, and on the bytes of the files it is made from.
        timeout: Seconds the capture may take.

    Returns:
        The patch (a git diff; empty when the policy changed nothing).

    Raises:
        PatchRefused: The change is over ``max_bytes``, the policy's tree cannot be diffed
            against ``base_commit``, or the capture took over ``timeout`` (scored 0).
        DiskQuotaExceeded: The policy filled the sandbox's disk, so git could not write its
            private index (scored 0).
        InfraError: The sandbox died or could not be reached.
    """
    target = getattr(sandbox, "sandbox", sandbox)
    kill = getattr(target, "kill_strays", None)
    if kill is not None:
        await kill()
    priv = f"/tmp/.sandpool-capture-{secrets.token_hex(8)}"
    res = await sandbox.exec(_script(priv, task.workdir, task.base_commit, max_bytes), timeout=timeout,
                             cwd="/", max_output=max_bytes)
    err = res.err_text.strip()[-300:]
    if res.timed_out:
        raise errors.PatchRefused(f"capturing the patch took over {timeout:.0f} s: the tree the "
                                  "policy left is too large to diff")
    if res.exit_code == _SIZE_EXIT:
        raise errors.PatchRefused(f"the change is {res.text.strip()} bytes of files, over the cap "
                                  f"of {max_bytes}")
    if res.stdout_truncated:
        raise errors.PatchRefused(f"the patch is over the cap of {max_bytes} bytes")
    if "No space left on device" in res.err_text or "Disk quota exceeded" in res.err_text:
        raise errors.sandbox_file_error(errno.ENOSPC, priv, f"capturing the patch: {err}")
    if res.exit_code == _BASE_EXIT:
        raise errors.PatchRefused(f"the tree cannot be diffed against base_commit "
                                  f"{task.base_commit[:12]} (the repo or its objects were broken): {err}")
    if res.exit_code != 0:
        raise errors.PatchRefused(f"capturing the patch failed (exit {res.exit_code}): {err}")
    return res.stdout
