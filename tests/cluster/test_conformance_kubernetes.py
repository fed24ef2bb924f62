"""The backend conformance suite over every channel to a sandbox, the Kubernetes backend's
(agent-sandbox on kwok) included."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid

import pytest

from sandpool.core import ResourceLimits
from sandpool.core.backends.kubernetes import KubernetesBackend
from sandpool.core.backends.local import LocalBackend
from sandpool.core.base import Backend
from sandpool.core.conformance import CHECKS, check_backend
from tests.cluster.kwok_images import workdir_image
from tests.conftest import CALC_IMAGE

pytestmark = pytest.mark.cluster

_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t"}


# kwok runs a pod's exec as a root process on the node host, in a mount namespace that only
# rebinds the workdir and /tmp: the host's /usr is writable from a "pod" and there is no disk
# quota to give. Those two are this machine's limits, not the channel's; every other check must
# pass, and this fails the day either changes.
_KWOK_LIMITS = {
    "file_errnos": "fail: write to /usr: errno None, want EPERM/EACCES/EROFS",
    "disk_quota": "skip: no disk quota configured (ResourceLimits.disk_bytes) to test",
}


def _pod_backend(cluster, namespace: str, tmp_path, agent: bool) -> tuple[KubernetesBackend, str, dict]:
    """A Kubernetes backend whose one image is a fresh one-commit repo; its head, and the
    conformance suite's options (a kill that deletes the pod, as an eviction would)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo)]
    env = {**os.environ, **_GIT_ENV}
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True, env=env)
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / ".gitignore").write_text("__pycache__/\n")
    subprocess.run([*git, "add", "-A"], check=True, env=env)
    subprocess.run([*git, "commit", "-qm", "one"], check=True, env=env)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    backend = KubernetesBackend(cluster.kubeconfig, namespace=namespace, run_id=uuid.uuid4().hex[:8],
                                image_map=lambda name: workdir_image(name, repo),
                                agent=agent)

    def delete_pod(sb) -> None:
        cluster.core.delete_namespaced_pod(sb.pod, namespace, grace_period_seconds=0)

    return backend, "sandpool.test/conformance:1", {
        "commit": head, "kill": lambda sb: asyncio.to_thread(delete_pod, sb)}


@pytest.mark.parametrize("channel", ["pipe", "agent", "exec"])
async def test_the_conformance_suite_means_the_same_over_every_channel(
    cluster, namespace, tmp_path, channel, request
):
    """The same checks over each way the host reaches a sandbox: the local agent's stdio pipe,
    the agent's pod-exec stream, and the degraded per-command pod exec. Exit codes,
    process-group timeouts and escapees, output caps, binary I/O, file errnos, process
    listing, death and reset mean the same on all three; what differs is kwok's limits
    (:data:`_KWOK_LIMITS`), not the channel's."""
    backend: Backend
    if channel == "pipe":
        request.getfixturevalue("calc_commits")
        backend = LocalBackend(request.getfixturevalue("test_images_root"),
                               limits=ResourceLimits(disk_bytes=64 * 2**20))
        image, opts, limits = CALC_IMAGE, {"kill": backend.kill}, {}
    else:
        backend, image, opts = _pod_backend(cluster, namespace, tmp_path, agent=channel == "agent")
        limits = _KWOK_LIMITS
    try:
        report = await check_backend(backend, image, **opts)
    finally:
        await backend.aclose()
    print(report.render_text())
    assert [r.name for r in report.results] == [name for name, _ in CHECKS]
    assert report.failed == limits, report.failed
    if channel != "pipe":
        # one sandbox per check (some make more), all on the channel under test
        assert (backend.api_stats["fallback_sandboxes"] == 0) == (channel == "agent")
        assert not os.path.exists("/usr/sandpool-conformance")
