"""The Docker daemon the benchmarks compare with, and ``sandpool images pull docker-daemon:REF``.

Real parts: Debian's docker.io (dockerd 20.10, containerd 1.6, runc 1.1) started by
:class:`sandpool.bench.docker.DockerDaemon` in namespaces of its own, images copied into it
with skopeo, and hydration back out of it through skopeo's ``docker-daemon:`` transport.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandpool.bench.docker import DockerDaemon
from sandpool.cli import app
from sandpool.core.backends.local import LocalBackend
from sandpool.core.images import ImageStore, hydrate
from sandpool.core.task import Task
from sandpool.envs.taskpack.oci import SWE_IMAGE
from tests.conftest import BASE_IMAGE


@pytest.fixture(scope="module")
def daemon(oci_images: Path):
    """The bench's daemon (its cached data root), holding the SWE-shaped test image."""
    d = DockerDaemon()
    d.start()
    try:
        d.load(f"oci:{oci_images / 'layout'}:swe", SWE_IMAGE)
        yield d
    finally:
        d.stop()


def _layer_ids(layout: Path, tag: str) -> list[str]:
    index = json.loads((layout / "index.json").read_text())
    desc = next(m for m in index["manifests"]
                if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)

    def blob(digest: str) -> dict:
        return json.loads((layout / "blobs" / "sha256" / digest.split(":")[1]).read_bytes())

    return blob(blob(desc["digest"])["config"]["digest"])["rootfs"]["diff_ids"]


def test_images_pull_from_the_docker_daemon_named_by_docker_host(daemon, oci_images, tmp_path,
                                                                 monkeypatch) -> None:
    monkeypatch.setenv("SANDPOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DOCKER_HOST", daemon.host)  # not the default socket: skopeo must be told
    result = CliRunner().invoke(app, ["images", "pull", f"docker-daemon:{SWE_IMAGE}", "--name", "from-docker:1"])
    assert result.exit_code == 0, result.output
    img = ImageStore().resolve("from-docker:1")  # the store under SANDPOOL_HOME
    assert img is not None and img.source == f"docker-daemon:{SWE_IMAGE}"
    # The same layers as the OCI layout the daemon was loaded from, and the same config.
    assert [layer.diff_id for layer in img.layers] == _layer_ids(oci_images / "layout", "swe")
    task = Task.model_validate_json((oci_images / "swe-task.json").read_text())
    assert (img.head, img.repo_dir, img.workdir) == (task.base_commit, "/testbed", "/testbed")
    assert "CALC_MODE=swe" in img.env


async def test_a_sandbox_starts_from_an_image_pulled_out_of_the_docker_daemon(daemon, tmp_path,
                                                                              monkeypatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", daemon.host)
    store = ImageStore(tmp_path / "store")
    hydrate(f"docker-daemon:{SWE_IMAGE}", name="from-docker:1", store=store)
    backend = LocalBackend(tmp_path / "images", store=store)
    await backend.preflight()
    try:
        sb = await backend.create("from-docker:1")
        res = await sb.exec("echo $CALC_MODE; python -m pytest -q tests/test_calc.py::test_zero 2>&1 | tail -1")
        assert res.ok and res.text.splitlines()[0] == "swe" and "1 passed" in res.text, res.text
    finally:
        await backend.aclose()


def test_images_pull_from_a_missing_daemon_names_the_socket_and_the_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SANDPOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'none.sock'}")
    result = CliRunner().invoke(app, ["images", "pull", f"docker-daemon:{SWE_IMAGE}"])
    text = " ".join(result.output.split())  # rich wraps the message to the terminal's width
    assert result.exit_code == 2
    assert "none.sock does not exist" in text and "docker save -o x.tar REF" in text


def _traces(d: DockerDaemon, netns: int) -> list[str]:
    """What of the daemon is left: processes, namespaces, mounts, cgroups, its run directory."""
    left = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if str(d.run_dir).encode() in (p / "cmdline").read_bytes():
                left.append(f"process {p.name} names the run directory")
            if os.stat(p / "ns" / "net").st_ino == netns:
                left.append(f"process {p.name} is in the daemon's network namespace")
    mounts = Path("/proc/self/mountinfo").read_text()
    left += [f"mount {ln.split()[4]}" for ln in mounts.splitlines()
             if str(d.root) in ln or str(d.run_dir) in ln]
    left += [str(g) for g in Path("/sys/fs/cgroup").glob(f"*/{d.cgroup_parent.lstrip('/')}")]
    if d.run_dir.exists():
        left.append(f"{d.run_dir} exists")
    return left


_KILLED_RUN = """
import json, os, signal, sys
from pathlib import Path
from sandpool.bench.docker import DockerDaemon
d = DockerDaemon(Path(sys.argv[1]))
d.start()
d.load(sys.argv[2], sys.argv[3])
c = d.client()
box = c.containers.run(sys.argv[3], "sleep infinity", detach=True)
box.reload()
paused = c.containers.run(sys.argv[3], "sleep infinity", detach=True)
paused.pause()  # its processes frozen: a SIGKILL waits for a thaw
paused.reload()
print(json.dumps({"pids": [box.attrs["State"]["Pid"], paused.attrs["State"]["Pid"]],
                  "containerd": d._procs["containerd"].pid}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


# Runs the killed run as a child subreaper that never waits for an orphan: whatever of the
# killed run's tree dies after its parent stays in the process table (as under an init that
# reaps late, or never) until the test closes this process's stdin.
_UNDER_A_SUBREAPER = """
import ctypes, json, subprocess, sys
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
run = subprocess.run([sys.executable, "-c", *sys.argv[1:]], capture_output=True, text=True, timeout=600)
print(json.dumps({"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr[-2000:]}),
      flush=True)
sys.stdin.read()
"""


def test_a_killed_run_s_daemon_is_reaped_and_a_stopped_one_leaves_nothing(oci_images, tmp_path) -> None:
    import subprocess
    import sys

    reaper = subprocess.Popen([sys.executable, "-c", _UNDER_A_SUBREAPER, _KILLED_RUN, str(tmp_path / "docker"),
                               f"oci:{oci_images / 'layout'}:base", BASE_IMAGE],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        out = json.loads(reaper.stdout.readline())
        assert out["returncode"] == -signal.SIGKILL, out["stderr"]
        info = json.loads(out["stdout"])
        netns = os.stat(f"/proc/{info['containerd']}/ns/net").st_ino
        pids = info["pids"]  # a running container's and a paused one's
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)  # they outlived the killed run
        d = DockerDaemon(tmp_path / "docker")
        d.start()  # reaps what the killed run left, then serves with no container
        try:
            # Gone, not zombies of the subreaper: each container's shim, its parent, outlived it.
            assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
            client = d.client()
            try:
                assert client.containers.list(all=True) == []
                assert client.containers.run(BASE_IMAGE, "sleep infinity", detach=True).status
            finally:
                client.close()
        finally:
            d.stop()
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
        assert _traces(d, netns) == []
    finally:
        reaper.stdin.close()
        reaper.wait(timeout=60)
        reaper.stdout.close()
