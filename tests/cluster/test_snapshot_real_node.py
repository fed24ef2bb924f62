"""Snapshots and forks of real containers (a kubelet + containerd + runc node): the change set
taken by the agent in the container, restored into other containers, as a hostile policy
would use them (a planted hook, a setuid file, a sibling's files, the disk quota)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from sandpool.core import PoolLimits, SandboxPool, Task, errors
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.envs.grading import DiffGrader
from tests.waiting import until

pytestmark = [pytest.mark.cluster, pytest.mark.real_node]

LIMITS = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}}


def _pool(cluster, namespace, real_node, **kw) -> SandboxPool:
    kw.setdefault("mode", "pods")
    backend = KubernetesBackend(
        cluster.kubeconfig, namespace=namespace, run_id=uuid.uuid4().hex[:8],
        node_selector=real_node.node_selector, tolerations=list(real_node.tolerations),
        ready_timeout=180, agent_entrypoint=True, resources=LIMITS, **kw)
    return SandboxPool(backend, "reuse", PoolLimits(max_live=4))


async def test_forked_containers_hold_the_state_and_planted_code_stays_inert(
        cluster, namespace, real_node, real_images):
    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    hook = "#!/bin/sh\ntouch /tmp/HOOK-RAN \"$PWD/HOOK-RAN\"\n"
    async with _pool(cluster, namespace, real_node, disk_bytes=128 << 20) as pool:
        async with pool.claim(task) as parent:
            await parent.write_file(".git/hooks/post-checkout", hook.encode(), mode=0o755)
            res = await parent.exec("cp /bin/true ./suid-true && chmod 4755 suid-true"
                                    " && echo '# note' >> calcpkg/__init__.py && echo kept > /tmp/kept",
                                    timeout=60)
            assert res.ok, res
            a, b = await parent.fork(2)
            try:
                assert a.sandbox.pod != b.sandbox.pod != parent.sandbox.pod
                for kid in (a, b):
                    res = await kid.exec("stat -c %a suid-true .git/hooks/post-checkout; cat /tmp/kept;"
                                         " tail -1 calcpkg/__init__.py", timeout=60)
                    assert res.text == "4755\n755\nkept\n# note\n", res
                assert (await a.exec("echo TOKEN-A > secret.txt", timeout=60)).ok
                res = await b.exec("grep -rsl TOKEN-A . /tmp; ls secret.txt", timeout=60)
                assert res.text == "" and "No such file" in res.err_text
                # Grading a child captures its diff and resets it with hooks off: the hook
                # never runs, and the reset takes the child back to the image.
                patch = await DiffGrader().capture(a, task)
                assert b"suid-true" in patch and b"# note" in patch
                assert (await a.exec("ls /tmp/HOOK-RAN HOOK-RAN", timeout=60)).exit_code != 0
                await a.reset()
                res = await a.exec("ls .git/hooks/post-checkout suid-true; git status --porcelain",
                                   timeout=60)
                assert res.text == "" and "suid-true" in res.err_text
            finally:
                await a.release()
                await b.release()
        assert pool.counters.quarantines == 0


async def test_the_disk_quota_holds_in_each_forked_container(cluster, namespace, real_node, real_images):
    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    write = "head -c {n}M /dev/urandom > {name} && echo done"
    async with _pool(cluster, namespace, real_node, disk_bytes=64 << 20) as pool:
        async with pool.claim(task) as parent:
            assert (await parent.exec(write.format(n=24, name="base.bin"), timeout=120)).text == "done\n"
            (kid,) = await parent.fork(1)
            try:
                # On a pod, the change set is written into the child: its 24 MiB are on the
                # child's own quota, with room left for what it writes itself.
                assert (await kid.exec(write.format(n=24, name="more.bin"), timeout=120)).text == "done\n"
                full = await kid.exec(write.format(n=24, name="over.bin"), timeout=120)
                assert full.exit_code != 0 and "No space left" in full.err_text
                with pytest.raises(errors.DiskQuotaExceeded):
                    await kid.write_file("again.bin", b"x" * (8 << 20))
                assert (await parent.exec(write.format(n=24, name="p.bin"), timeout=120)).text == "done\n"
                # (The pod reset needs room in /tmp: a child left full would be quarantined.)
                assert (await kid.exec("rm -f more.bin over.bin again.bin", timeout=60)).ok
            finally:
                await kid.release()
        assert pool.counters.quarantines == 0


async def test_suspend_releases_the_container_and_resume_restores_a_new_one(
        cluster, namespace, real_node, real_images):
    """On a real node, suspend sets the claim's Sandbox Suspended: the controller deletes the
    pod (its container stopped by the kubelet), the Sandbox and claim stay; resume gives a new
    pod whose restored state has the snapshot's hash and whose processes are new. A snapshot
    altered on the host is refused at the next resume."""
    from kubernetes.client.rest import ApiException

    from test_snapshot_pods import SLEEPERS, _tamper

    task = Task.model_validate(json.loads(Path(real_images["task"]).read_text()))
    async with _pool(cluster, namespace, real_node, mode="agent-sandbox") as pool:
        async with pool.claim(task) as lease:
            res = await lease.exec("echo '# note' >> calcpkg/__init__.py && echo kept > /tmp/kept"
                                   " && (nohup sleep 4242 >/dev/null 2>&1 &) && cat /proc/1/stat",
                                   timeout=60)
            assert res.ok, res
            agent_start = res.text.split(")")[1].split()[19]  # the agent's start time (pid 1)
            assert (await lease.exec(SLEEPERS, timeout=60)).text == "sleep 4242\n"
            sb = lease.sandbox
            await lease.suspend()
            want = lease.parked.content_hash
            pods = cluster.core.list_namespaced_pod(namespace).items
            assert sb.pod_uid not in [p.metadata.uid for p in pods]
            ps = real_node.crictl("ps", "-q", "--label", f"io.kubernetes.pod.uid={sb.pod_uid}")
            assert ps.returncode == 0 and ps.stdout == "", ps  # its container is stopped
            obj = cluster.custom.get_namespaced_custom_object(
                "agents.x-k8s.io", "v1beta1", namespace, "sandboxes", sb.sandbox_name)
            assert obj["spec"]["operatingMode"] == "Suspended"
            cluster.custom.get_namespaced_custom_object(
                "extensions.agents.x-k8s.io", "v1beta1", namespace, "sandboxclaims", sb.claim)
            await lease.resume()
            new = lease.sandbox
            assert (new.claim, new.pod) == (sb.claim, sb.pod) and new.pod_uid != sb.pod_uid
            assert await new.state_hash() == want
            res = await lease.exec("tail -1 calcpkg/__init__.py; cat /tmp/kept /proc/1/stat", timeout=60)
            assert res.text.startswith("# note\nkept\n"), res
            assert res.text.split(")")[1].split()[19] != agent_start  # a new container's agent
            assert (await lease.exec(SLEEPERS, timeout=60)).text == ""
            assert (await lease.exec("echo more >> calcpkg/__init__.py", timeout=60)).ok
            await lease.suspend()
            _tamper(lease.parked, "calcpkg/__init__.py", b"planted = 1\n")
            with pytest.raises(errors.ResetError, match="not the snapshot's"):
                await lease.resume()
            assert lease.released
        assert pool.counters.quarantines == 3

        def claim_gone() -> bool:
            try:
                cluster.custom.get_namespaced_custom_object(
                    "extensions.agents.x-k8s.io", "v1beta1", namespace, "sandboxclaims", sb.claim)
            except ApiException as exc:
                return exc.status == 404
            return False

        await until(claim_gone, "the quarantined sandbox's claim deleted")
