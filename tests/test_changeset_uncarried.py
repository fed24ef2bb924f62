"""A pod's snapshot (its change set, taken by a stdlib script in the pod) of a state it cannot carry.

The script runs as the sandbox's user, in the sandbox. Its processes can make a path that user
cannot read (``chmod 000`` on a file of its own) or that no path can name (a tree deeper than
PATH_MAX, made one ``cd`` at a time). The script crashed on either, an InfraError: a checkpoint
taken after the policy's step marked its lease broken, and the episode ended ``infra_failed``,
its 0 never scored. Such a state is refused as a change set over its size is (``ConfigError``:
the sandbox is sound, the lease goes on), naming the path.

Run here with the real script in a real bubblewrap sandbox (a pod runs the same script through
its agent), over the generic pristine record pods use.
"""

from __future__ import annotations

import pytest

from sandpool.core import changeset, errors, pristine

_STATES = {
    "deeper-than-path-max": ("n=$(printf 'a%.0s' $(seq 200)); for i in $(seq 25); do mkdir $n && cd $n"
                             " || exit 1; done; echo fix > f.txt", "File name too long"),
    "unreadable-to-its-user": ("echo x > secret && chmod 000 secret && test ! -r secret", "Permission denied"),
}


@pytest.mark.parametrize("state", list(_STATES))
async def test_a_state_a_change_set_cannot_carry_is_refused_not_infra(local_backend, calc_task, tmp_path, state):
    cmd, why = _STATES[state]
    sb = await local_backend.create(calc_task.image)
    await pristine.record(sb, 120)
    assert (await sb.exec("echo kept > kept.txt")).ok
    snap = await changeset.capture(sb, "python3", tmp_path, "local", "test")
    assert snap.detail["entries"] == 1  # a change set it can carry: taken
    assert (await sb.exec(cmd)).ok
    with pytest.raises(errors.ConfigError, match=f"cannot be snapshotted: cannot carry .*{why}"):
        await changeset.capture(sb, "python3", tmp_path, "local", "test")
    assert (await sb.exec("true")).ok  # the sandbox goes on
