"""Snapshots, forks, suspend and resume of pods on the local cluster (kwok): the change set
against the pristine record, taken by the in-pod agent and restored into another pod."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes.client.rest import ApiException

from sandpool.core import PoolLimits, SandboxPool, errors
from sandpool.core.snapshot import Snapshot

from tests.waiting import until

from test_kubernetes_backend import backend, custom, make_task, pods_of, repo  # noqa: F401 - fixture

pytestmark = pytest.mark.cluster

IMAGE = "sandpool.test/calc:1"
STATE = ("echo 'x = 1' >> calc.py && rm .gitignore && mkdir -p pkg/sub && echo deep > pkg/sub/f"
         " && echo kept > notes.txt && chmod 600 notes.txt && echo scratch > /tmp/work.txt"
         " && git add -A && git -c user.name=p -c user.email=p@p commit -qm policy-step")
SHOW = ("cat calc.py pkg/sub/f notes.txt /tmp/work.txt; stat -c %a notes.txt; ls .gitignore;"
        " git log --format=%s -1")


def _pool(cluster, namespace, path: Path, **kw) -> SandboxPool:
    return SandboxPool(backend(cluster, namespace, path, **kw), "reuse", PoolLimits(max_live=4))


async def test_a_pod_snapshot_restores_into_another_pod(cluster, namespace, repo):
    path, _, second = repo
    task = make_task(IMAGE, second)
    async with _pool(cluster, namespace, path) as pool:
        async with pool.claim(task) as parent:
            assert (await parent.exec(STATE, timeout=60)).ok
            want = (await parent.exec(SHOW, timeout=60)).text
            snap = await parent.snapshot()
            assert (snap.backend, snap.image) == ("kubernetes", IMAGE) and snap.size_bytes > 0
            assert (snap.location / snap.parts[0]).is_file()  # on this host, in the run's store
            assert await parent.sandbox.state_hash() == snap.content_hash
            async with pool.claim(task, from_snapshot=snap) as child:
                assert child.sandbox.pod != parent.sandbox.pod
                assert (await child.exec(SHOW, timeout=60)).text == want
                assert await child.sandbox.state_hash() == snap.content_hash
                assert (await child.exec("echo more >> notes.txt", timeout=60)).ok
                assert await child.sandbox.state_hash() != snap.content_hash
            # A saved snapshot restores the same: the archive and its metadata travel together.
            loaded = Snapshot.load(snap.save(path.parent / "pod.snap"))
            async with pool.claim(task, from_snapshot=loaded) as again:
                assert (await again.exec(SHOW, timeout=60)).text == want
        assert pool.counters.quarantines == 0 and pool.counters.resets >= 3
        store = pool.backend.snapshots
    assert not store.exists()  # the run's store went with the backend


async def test_fork_siblings_of_pods_see_none_of_each_others_files(cluster, namespace, repo):
    path, _, second = repo
    task = make_task(IMAGE, second)
    async with _pool(cluster, namespace, path) as pool:
        async with pool.claim(task) as parent:
            assert (await parent.exec("echo shared > shared.txt", timeout=60)).ok
            a, b = await parent.fork(2)
            try:
                assert len({a.sandbox.pod, b.sandbox.pod, parent.sandbox.pod}) == 3
                assert (await a.exec("echo TOKEN-A > secret.txt; echo TOKEN-A > /tmp/secret;"
                                     " echo TOKEN-A >> shared.txt", timeout=60)).ok
                assert (await parent.exec("echo TOKEN-P > later.txt", timeout=60)).ok
                res = await b.exec("grep -rsl -e TOKEN-A -e TOKEN-P . /tmp; cat shared.txt", timeout=60)
                assert res.text == "shared\n", res
                assert (await a.exec("cat shared.txt", timeout=60)).text == "shared\nTOKEN-A\n"
            finally:
                await a.release()
                await b.release()


async def test_a_pod_snapshot_under_a_writer_is_whole_lines(cluster, namespace, repo):
    path, _, second = repo
    task = make_task(IMAGE, second)
    async with _pool(cluster, namespace, path) as pool:
        async with pool.claim(task) as parent:
            res = await parent.exec(
                "nohup python3 -c \"import os, time\nfd=os.open('log.txt',os.O_WRONLY|os.O_CREAT|os.O_APPEND)\n"
                "i=0\nwhile True:\n os.write(fd,b'%08d ' % i + b'x'*4000 + b'\\\\n')\n i+=1\n"
                " time.sleep(0.001)\" >/dev/null 2>&1 & echo started", timeout=60)
            assert res.ok
            await _until_lines(parent, 50)
            snap = await parent.snapshot()  # the writer is stopped while the pod is read
            async with pool.claim(task, from_snapshot=snap) as child:
                lines = (await child.read_file("log.txt")).split(b"\n")
                assert lines[-1] == b"" and len(lines) > 50
                assert [int(ln[:8]) for ln in lines[:-1]] == list(range(len(lines) - 1))
            await _until_lines(parent, len(lines) + 50)  # and goes on after


async def _until_lines(lease, n: int) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + 120
    while int((await lease.exec("wc -l < log.txt 2>/dev/null || echo 0", timeout=60)).text or 0) < n:
        assert time.monotonic() < deadline, f"the writer never reached {n} lines"
        await asyncio.sleep(0.05)


def _sandbox(cluster, namespace: str, name: str) -> dict | None:
    try:
        return cluster.custom.get_namespaced_custom_object(
            "agents.x-k8s.io", "v1beta1", namespace, "sandboxes", name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _cond(obj: dict | None, kind: str) -> tuple[str, str] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c["status"], c.get("reason", "")
    return None


def _live_pods(cluster, namespace: str, run_id: str) -> dict[str, str]:
    return {p.metadata.uid: p.metadata.name for p in pods_of(cluster, namespace, run_id)}


#: The pod's processes whose command line is ``sleep 4242`` (its /proc is the pod's own pid
#: namespace), one line each.
SLEEPERS = ("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done"
            " | grep -x 'sleep 4242 ' | sed 's/ $//'")


async def test_suspend_releases_the_pod_keeping_its_sandbox_and_claim(cluster, namespace, repo):
    """Suspend sets the agent-sandbox Sandbox's spec.operatingMode to Suspended: the
    controller deletes the pod, the Sandbox object and its claim stay. Resume sets it Running:
    the controller makes a new pod (same name, new UID, fresh processes) and the suspend's
    snapshot is restored into it, verified by its hash; the rollout goes on."""
    path, _, second = repo
    task = make_task(IMAGE, second)
    async with _pool(cluster, namespace, path) as pool:
        run = pool.backend.run_id
        async with pool.claim(task) as lease:
            assert (await lease.exec(STATE, timeout=60)).ok
            assert (await lease.exec("nohup sleep 4242 >/dev/null 2>&1 & echo started", timeout=60)).ok
            assert (await lease.exec(SLEEPERS, timeout=60)).text == "sleep 4242\n"
            want = (await lease.exec(SHOW, timeout=60)).text
            sb = lease.sandbox
            assert sb.sandbox_name is not None and sb.claim is not None
            await lease.suspend()
            assert lease.parked is not None  # the snapshot it resumes from
            want_hash = lease.parked.content_hash
            with pytest.raises(errors.ConfigError, match="is suspended"):
                await lease.exec("true")
            assert sb.pod_uid not in _live_pods(cluster, namespace, run)  # released: gone
            obj = _sandbox(cluster, namespace, sb.sandbox_name)
            assert obj is not None and obj["spec"]["operatingMode"] == "Suspended"
            await until(lambda: _cond(_sandbox(cluster, namespace, sb.sandbox_name), "Suspended")
                        == ("True", "PodTerminated"), "the Sandbox's Suspended condition")
            claims = custom(cluster, namespace, "sandboxclaims", run)
            assert [c["metadata"]["name"] for c in claims] == [sb.claim]  # the claim stays
            assert pool.sizes()[IMAGE]["leased"] == 1
            await lease.resume()
            new = lease.sandbox
            assert (new.id, new.claim, new.sandbox_name, new.pod) == (sb.id, sb.claim, sb.sandbox_name,
                                                                     sb.pod)
            assert new.pod_uid != sb.pod_uid and new.pod_uid in _live_pods(cluster, namespace, run)
            assert _sandbox(cluster, namespace, sb.sandbox_name)["spec"]["operatingMode"] == "Running"
            assert (await lease.exec(SHOW, timeout=60)).text == want
            assert await lease.sandbox.state_hash() == want_hash
            assert (await lease.exec(SLEEPERS, timeout=60)).text == ""  # its processes are new
            # The rollout goes on in the resumed pod, and its release resets it in place.
            assert (await lease.exec("echo after >> notes.txt && git status --short", timeout=60)).ok
        assert [c["metadata"]["name"] for c in custom(cluster, namespace, "sandboxclaims", run)] == [sb.claim]
        assert pool.counters.quarantines == 0 and pool.counters.resets >= 1
        # A suspended lease released gives its Sandbox (claim) up: nothing left to reset.
        async with pool.claim(task) as lease:
            claim = lease.sandbox.claim
            await lease.suspend()
        await until(lambda: claim not in [c["metadata"]["name"] for c in custom(
            cluster, namespace, "sandboxclaims", run)], "the suspended lease's claim deleted")
        assert pool.counters.quarantines == 0


def _tamper(snap, name: str, data: bytes) -> None:
    """Rewrite ``name``'s content in the snapshot's archive in the run's store."""
    import io
    import tarfile

    for part in snap.parts:
        src = io.BytesIO((snap.location / part).read_bytes())
        out = io.BytesIO()
        found = False
        with tarfile.open(fileobj=src) as tin, tarfile.open(fileobj=out, mode="w",
                                                           format=tarfile.PAX_FORMAT) as tout:
            for m in tin:
                blob = tin.extractfile(m).read() if m.isfile() else None
                if m.isfile() and m.name.endswith(name):
                    blob, m.size, found = data, len(data), True
                tout.addfile(m, io.BytesIO(blob) if blob is not None else None)
        if found:
            (snap.location / part).write_bytes(out.getvalue())
            return
    raise AssertionError(f"{name} is not in the snapshot")


async def test_a_tampered_snapshot_is_refused_at_resume(cluster, namespace, repo):
    from sandpool.core.pool.snapshots import RESTORE_ATTEMPTS

    path, _, second = repo
    task = make_task(IMAGE, second)
    async with _pool(cluster, namespace, path) as pool:
        run = pool.backend.run_id
        lease = await pool.acquire(task)
        assert (await lease.exec(STATE, timeout=60)).ok
        await lease.suspend()
        _tamper(lease.parked, "notes.txt", b"planted\n")
        with pytest.raises(errors.ResetError, match="not the snapshot's"):
            await lease.resume()
        assert lease.released
        # Each sandbox the restore tried (the resumed one, then fresh claims) showed another
        # hash: quarantined, its claim deleted.
        assert pool.counters.quarantines == RESTORE_ATTEMPTS
        await until(lambda: not custom(cluster, namespace, "sandboxclaims", run),
                    "the quarantined sandboxes' claims deleted")


async def test_resume_claims_another_pod_when_the_suspended_sandbox_is_gone(cluster, namespace, repo):
    path, _, second = repo
    task = make_task(IMAGE, second)
    async with _pool(cluster, namespace, path) as pool:
        async with pool.claim(task) as lease:
            assert (await lease.exec(STATE, timeout=60)).ok
            want = (await lease.exec(SHOW, timeout=60)).text
            claim, name = lease.sandbox.claim, lease.sandbox.sandbox_name
            await lease.suspend()
            cluster.custom.delete_namespaced_custom_object(
                "extensions.agents.x-k8s.io", "v1beta1", namespace, "sandboxclaims", claim)
            await until(lambda: _sandbox(cluster, namespace, name) is None,
                        "the claim's Sandbox deleted with it")
            await lease.resume()  # its Sandbox is gone: another claim, restored and verified
            assert lease.sandbox.claim != claim
            assert (await lease.exec(SHOW, timeout=60)).text == want
            assert await lease.sandbox.state_hash() == lease.restored_from.content_hash
        assert pool.counters.quarantines == 0 and pool.counters.resets >= 1


async def test_a_pod_snapshot_of_one_image_is_refused_by_another(cluster, namespace, repo):
    path, _, second = repo
    async with _pool(cluster, namespace, path) as pool:
        async with pool.claim(make_task(IMAGE, second)) as lease:
            snap = await lease.snapshot()
        with pytest.raises(errors.ConfigError, match=f"is of image '{IMAGE}' and cannot be restored "
                                                     "onto image 'sandpool.test/other:1'"):
            await pool.acquire(make_task("sandpool.test/other:1", second), from_snapshot=snap)
        assert pool.counters.quarantines == 0


async def test_a_checkpointed_episode_survives_its_pod_deleted_mid_step(cluster, namespace, repo):
    import asyncio

    from sandpool.core import run_rollout
    from sandpool.core.metrics import Outcome

    path, _, second = repo
    task = make_task(IMAGE, second)
    step3 = "echo 3 >> steps.txt && touch /tmp/started && until [ -e /tmp/go ]; do sleep 0.01; done && echo done"

    async def started(sb) -> None:
        while not (await sb.exec("test -e /tmp/started", timeout=60)).ok:
            await asyncio.sleep(0.05)

    async def host(lease) -> None:
        first = lease.sandbox
        await started(first)
        cluster.core.delete_namespaced_pod(first.pod, namespace, grace_period_seconds=0)
        while lease.sandbox is first:
            await asyncio.sleep(0.05)
        await started(lease.sandbox)
        assert (await lease.sandbox.exec("touch /tmp/go", timeout=60)).ok

    seen = []

    async def episode(lease) -> float:
        assert (await lease.exec("echo 1 >> steps.txt && echo one > /tmp/kept", timeout=60)).ok
        assert (await lease.exec("echo 2 >> steps.txt && git rm -q calc.py", timeout=60)).ok
        watcher = asyncio.create_task(host(lease))
        res = await lease.exec(step3, timeout=300)
        await watcher
        seen.append((res.text, (await lease.exec("cat steps.txt /tmp/kept; git status --porcelain",
                                                   timeout=60)).text))
        return 1.0

    async with _pool(cluster, namespace, path) as pool:
        result = await run_rollout(pool, task, episode, checkpoint="step")
        assert (result.outcome, result.reward, result.recoveries) == (Outcome.COMPLETED, 1.0, 1)
        assert seen == [("done\n", "1\n2\n3\none\nD  calc.py\n?? steps.txt\n")]
        assert pool.counters.recoveries == 1 and pool.counters.quarantines == 0


async def test_suspend_through_several_clusters_parks_the_sandbox_on_its_own(cluster, namespace, repo):
    """A pool over MultiClusterBackend parks as its member does: the pod released, the
    Sandbox Suspended on the cluster it runs on, and resume brings the state back there."""
    from sandpool.core.backends.multi import MultiClusterBackend

    path, _, second = repo
    task = make_task(IMAGE, second)
    inner = backend(cluster, namespace, path)
    multi = MultiClusterBackend({"one": inner})
    async with SandboxPool(multi, "reuse", PoolLimits(max_live=4)) as pool:
        async with pool.claim(task) as lease:
            assert (await lease.exec(STATE, timeout=60)).ok
            want = (await lease.exec(SHOW, timeout=60)).text
            sb = lease.sandbox
            await lease.suspend()
            assert sb.pod_uid not in _live_pods(cluster, namespace, inner.run_id)
            assert _sandbox(cluster, namespace, sb.sandbox_name)["spec"]["operatingMode"] == "Suspended"
            await lease.resume()
            new = lease.sandbox
            assert new.sandbox_name == sb.sandbox_name and new.pod_uid != sb.pod_uid
            assert multi.cluster_of(new) == "one" and multi.cluster_of(sb) is None
            assert (await lease.exec(SHOW, timeout=60)).text == want
        assert pool.counters.quarantines == 0
