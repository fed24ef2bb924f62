"""Nothing outside the repo and /tmp survives a real pod's in-place reset, without a disk cap.

With the agent as its container's pid 1 (``agent_entrypoint=True``) a pod's root file system
is read-only by default, its repo, ``/tmp`` and service directory on a volume of the pod's
own (here on the node's disk: no ``disk_bytes``). What the container runtime still mounts
writable (``/dev``, ``/dev/shm``, the mqueue, ``/etc/hosts``, ``/sys/fs/cgroup``'s tmpfs, the
termination log) is recorded fresh and compared by the reset: what a rollout added there is
removed, times it moved are set back, anything else it changed quarantines the pod.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from sandpool.core import Outcome, SandboxPool, Task, run_rollout
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.reset import record_pristine, reset_in_place
from tests.waiting import until

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

LIMITS = {"requests": {"cpu": "100m", "memory": "128Mi"},
          "limits": {"cpu": "500m", "memory": "384Mi"}}
#: The times a rollout can move outside the repo and /tmp without changing a byte.
TIMES = "stat -c '%X %Y %n' /etc/hosts /dev/null /dev/pts /dev/pts/ptmx /dev /run/sandpool"
#: A stash in every place a pod's runtime leaves writable outside the repo and /tmp.
STASH = ("touch -d @1000000001 /etc/hosts /dev/null /dev/pts /dev/pts/ptmx /run/sandpool;"
         " touch -a -d @1000000002 /dev;"
         " echo gold > /dev/stash; mkdir /sys/fs/cgroup/stash; echo gold > /run/sandpool/stash;"
         " echo gold > /dev/shm/stash; echo gold > /dev/mqueue/stash 2>/dev/null;"
         " python3 -c 'import os; os.setxattr(\"/dev/shm\", \"user.stash\", b\"gold\")';"
         " ipcmk -M 4096 >/dev/null; echo stashed")
FIND = ("cat /dev/stash /run/sandpool/stash /dev/shm/stash 2>/dev/null;"
        " test -e /sys/fs/cgroup/stash && echo cgroup-stash; ls -A /dev/mqueue;"
        " python3 -c 'import os; print(os.listxattr(\"/dev/shm\"))';"
        " grep -c gold /etc/hosts /dev/termination-log; tail -n +2 /proc/sysvipc/shm")


def real_backend(cluster, namespace, real_node, **kw) -> KubernetesBackend:
    kw.setdefault("mode", "pods")
    return KubernetesBackend(
        cluster.kubeconfig, namespace=namespace, run_id=uuid.uuid4().hex[:8],
        node_selector=real_node.node_selector, tolerations=list(real_node.tolerations),
        resources=LIMITS, ready_timeout=180, agent_entrypoint=True, **kw)


async def test_without_a_disk_cap_the_root_is_read_only_and_the_scratch_on_the_nodes_disk(
    cluster, namespace, real_node, real_images
):
    backend = real_backend(cluster, namespace, real_node)
    try:
        sb = await backend.create(real_images["swe"])
        spec = cluster.core.read_namespaced_pod(sb.pod, namespace).spec
        assert spec.containers[0].security_context.read_only_root_filesystem
        assert [v.empty_dir.medium for v in spec.volumes if v.empty_dir] == [None]
        res = await sb.exec("echo x > /etc/outside; echo x >> /usr/lib/os-release", timeout=60)
        assert res.err_text.count("Read-only file system") == 2, res
        assert (await sb.exec("echo ok > kept && cat kept && echo t > /tmp/t && cat /tmp/t",
                              timeout=60)).text == "ok\nt\n"
    finally:
        await backend.aclose()


async def test_what_a_rollout_adds_outside_the_repo_is_gone_after_the_reset(
    cluster, namespace, real_node, real_images
):
    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    backend = real_backend(cluster, namespace, real_node)
    found: list[str] = []
    times: list[str] = []

    async def stash(lease) -> float:
        times.append((await lease.exec(TIMES, timeout=60)).text)
        assert (await lease.exec(STASH, timeout=60)).text.endswith("stashed\n")
        assert (await lease.exec(TIMES, timeout=60)).text != times[0]
        return 0.0

    async def look(lease) -> float:
        times.append((await lease.exec(TIMES, timeout=60)).text)
        found.append((await lease.exec(FIND, timeout=60)).text)
        return 0.0

    async with SandboxPool(backend, "reuse") as pool:
        for episode in (stash, look):
            result = await run_rollout(pool, task, episode)
            assert result.outcome is Outcome.COMPLETED, result
        assert (pool.counters.created, pool.counters.resets, pool.counters.quarantines) == (1, 2, 0)
    assert found == ["[]\n/etc/hosts:0\n/dev/termination-log:0\n"], found
    assert times[1] == times[0], times


@pytest.mark.parametrize("change", [
    "echo gold >> /etc/hosts",
    "echo gold > /dev/termination-log",
    "chmod 700 /dev/shm && chmod 600 /dev/null",
    "chmod 600 /dev/pts/ptmx",
    "python3 -c 'import os; os.setxattr(\"/sys/fs/cgroup\", \"user.stash\", b\"gold\")'",
])
async def test_a_change_outside_the_repo_the_reset_cannot_undo_fails_it(
    cluster, namespace, real_node, real_images, change
):
    task = json.loads(Path(real_images["task"]).read_text())
    backend = real_backend(cluster, namespace, real_node)
    try:
        sb = await backend.create(real_images["swe"])
        await record_pristine(sb)
        res = await sb.exec(change + " && echo changed", timeout=60)
        assert res.text == "changed\n", res
        outcome = await reset_in_place(sb, task["base_commit"])
        if change.startswith("chmod 700"):  # /dev/shm's mode is restored; /dev/null's is not
            assert not outcome.ok and "/dev/null" in str(outcome.problems), outcome
            assert "/dev/shm" not in str(outcome.problems), outcome
        else:
            assert not outcome.ok and "changed outside the repo" in str(outcome.problems), outcome
    finally:
        await backend.aclose()


async def test_a_warm_pods_pre_opened_session_records_what_its_reset_compares(
    cluster, namespace, real_node, real_images
):
    """A warm claim adopts the record taken through its pod's pre-opened session (its repo
    and what it can write outside it), and the lease's reset holds the pod to it."""
    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    backend = real_backend(cluster, namespace, real_node, mode="agent-sandbox", presessions=1)
    try:
        async with SandboxPool(backend, "warm") as pool:
            await pool.prepare([task], concurrency=1)
            pre = backend._presessions
            await until(lambda: len(pre) == 1 and all(t.done() for t in pre.pending.values()),
                        "a session opened and recorded on the warm pod")
            opened = next(iter(pre.pending.values())).result()
            assert opened is not None and opened.recorded is not None
            async with pool.claim(task) as lease:
                sb = lease.sandbox
                assert sb._session is opened.session and backend.presessions_adopted == 1
                assert sb._outside is opened.recorded._outside  # not listed again at the claim
                fresh = (await lease.exec(TIMES, timeout=60)).text
                assert (await lease.exec(STASH, timeout=60)).text.endswith("stashed\n")
                await lease.reset()
                assert lease.sandbox is sb, "the reset failed: the pod was replaced"
                assert (await lease.exec(TIMES, timeout=60)).text == fresh  # FIND reads some
                assert (await lease.exec(FIND, timeout=60)).text == (
                    "[]\n/etc/hosts:0\n/dev/termination-log:0\n")
            assert pool.counters.quarantines == 0
    finally:
        await backend.aclose()


async def test_times_owners_and_xattrs_a_rollout_sets_in_the_repo_are_set_back_by_the_reset(
    cluster, namespace, real_node, real_images
):
    """A path's times, owner and extended attributes are state the policy (root in its pod)
    can set without changing a byte: bits each, which reading never moves (a time set in the
    future). The reset sets every repo path's back to the fresh pod's, before sandpool's own
    git reads or rewrites some (its checkout: times of now, which no rollout chose)."""
    task = json.loads(Path(real_images["task"]).read_text())
    listing = ("find . -path ./.git/sandpool-exec -prune -o -printf '%A@ %T@ %U:%G %p\\n'"
               " | sort -k4; find . -print0 | python3 -c 'import os, sys; print(sum(len("
               "os.listxattr(p, follow_symlinks=False)) for p in sys.stdin.read().split(\"\\0\") if p))'")
    stamp = ("for p in $(find .git/objects -type f | head -3) calcpkg/__init__.py calcpkg .git/HEAD"
             " .git/objects .; do touch -m -d @2000000001 $p && touch -a -d @2000000002 $p"
             " && chown 4321:4322 $p && python3 -c 'import os, sys; os.setxattr(sys.argv[1],"
             " \"user.stash\", b\"gold\")' $p || exit 1; done")
    backend = real_backend(cluster, namespace, real_node)
    try:
        sb = await backend.create(real_images["swe"])
        await record_pristine(sb)
        before = (await sb.exec(listing, timeout=60)).text.splitlines()
        assert (await sb.exec(stamp + " && echo stamped", timeout=60)).text == "stamped\n"
        assert (await sb.exec(listing, timeout=60)).text.splitlines()[-1] == "8"
        outcome = await reset_in_place(sb, task["base_commit"])
        assert outcome.ok, outcome.problems
        after = (await sb.exec(listing, timeout=60)).text.splitlines()
    finally:
        await backend.aclose()
    assert before[-1] == after[-1] == "0", (before[-1], after[-1])  # no xattr in the repo
    assert not [ln for ln in after if "200000000" in ln or "4321" in ln], after
    # Object files git does not rewrite: their mtimes are the fresh pod's again.
    objects = [{ln.split(" ", 3)[3]: ln.split(" ")[1] for ln in lines[:-1]
                if ln.split(" ", 3)[3].startswith("./.git/objects/")} for lines in (before, after)]
    assert objects[1] == objects[0] and len(objects[0]) > 3, objects
