"""OCI images as local sandboxes, on real images built here from Debian packages.

The images (``sandpool.envs.taskpack.oci``) are built once per machine with mmdebstrap and
umoci and cached under ``sandpool_home()``; hydration, sandboxes, quota and reset run for real
(skopeo, umoci, overlayfs, bubblewrap, a loop-mounted quota filesystem, Debian's registry).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.base import ResourceLimits
from sandpool.core.images import ID_COUNT, ImageStore, hydrate
from sandpool.core.reset import record_pristine, reset_in_place
from sandpool.core.task import Task
from sandpool.envs.taskpack.oci import SWE_IMAGE
from tests.conftest import BASE_IMAGE, WH_IMAGE
from tests.ports import free_port as _free_port
from tests.waiting import wait_until


@pytest.fixture
async def oci_backend(test_images_root: Path, calc_commits: dict[str, str], oci_store: ImageStore):
    backend = LocalBackend(test_images_root, store=oci_store,
                           limits=ResourceLimits(disk_bytes=64 << 20))
    await backend.preflight()
    yield backend
    await backend.aclose()


async def test_image_config_env_and_workdir_are_honoured(oci_backend: LocalBackend) -> None:
    sb = await oci_backend.create(SWE_IMAGE)
    res = await sb.exec("pwd; echo $CALC_MODE; command -v python; python -c 'import calcpkg; print(calcpkg.__file__)'",
                        cwd=None)
    assert res.ok, res.err_text
    assert res.text.split() == ["/testbed", "swe", "/opt/testbed-env/bin/python", "/testbed/calcpkg/__init__.py"]
    assert sb.workdir == "/testbed" and sb.head == oci_backend.image(SWE_IMAGE).head


async def test_root_inside_is_an_unprivileged_uid_outside(oci_backend: LocalBackend) -> None:
    sb = await oci_backend.create(SWE_IMAGE)
    res = await sb.exec("id -u; touch /root/made-by-root; touch /.sandpool/usr/x; "
                        "unshare -U true && echo NESTED", cwd="/")
    assert res.text.split() == ["0"]
    assert "unshare failed: No space left on device" in res.err_text  # no nested user namespace
    assert "Read-only file system" in res.err_text  # the host's /usr is mounted read-only
    assert os.stat(sb.root_upper / "root" / "made-by-root").st_uid == sb.ids.base  # its own range
    host_uids = set()
    for pid in oci_backend._cgroups.pids(sb.id):
        status = Path(f"/proc/{pid}/status").read_text()
        host_uids |= {int(x) for x in next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]}
    assert host_uids and all(sb.ids.base <= u < sb.ids.base + ID_COUNT for u in host_uids), host_uids


async def test_whiteouts_opaque_dirs_hard_links_and_device_nodes(oci_backend: LocalBackend) -> None:
    base = await oci_backend.create(BASE_IMAGE)
    res = await base.exec("test -e /etc/motd && test -e /etc/issue.net && ls -A /etc/skel", cwd="/")
    assert res.ok and ".bashrc" in res.text.split()
    wh = await oci_backend.create(WH_IMAGE)
    res = await wh.exec("test ! -e /etc/motd && ls -A /etc/skel && stat -c %i /opt/linked-a /opt/linked-b"
                        " && test ! -e /opt/evil-null", cwd="/")
    assert res.ok, res.err_text
    skel, ino_a, ino_b = res.text.split()
    assert skel == "only-this" and ino_a == ino_b
    swe = await oci_backend.create(SWE_IMAGE)
    assert (await swe.exec("test ! -e /etc/issue.net", cwd="/")).ok  # deleted by umoci repack


def test_images_sharing_a_layer_store_it_once(oci_store: ImageStore) -> None:
    base, swe, wh = (oci_store.resolve(n) for n in (BASE_IMAGE, SWE_IMAGE, WH_IMAGE))
    assert swe.layers[0].diff_id == wh.layers[0].diff_id == base.layers[0].diff_id
    unique = {layer.diff_id for img in (base, swe, wh) for layer in img.layers}
    assert len(unique) == 3
    # Other tests hydrate more images into this session-wide store: count these three only.
    stored = [oci_store.layer_path(d) for d in unique]
    assert all(p.is_dir() for p in stored)
    on_disk = sum(int(p.with_suffix(".json").read_text()) for p in stored)
    assert on_disk < sum(img.unpacked for img in (base, swe, wh)) - 2 * base.layers[0].unpacked + 1
    assert swe.digest.startswith("sha256:") and swe.size > 0 and swe.source.startswith("oci:")


@pytest.mark.parametrize("image", ["pack", "oci"])
async def test_disk_quota_stops_a_large_write_and_the_sandbox_stays_usable(
        oci_backend: LocalBackend, image: str, calc_commits: dict[str, str], swe_task: Task) -> None:
    name, commit = ("sandpool.test/calc:2", calc_commits["buggy"]) if image == "pack" else (SWE_IMAGE, swe_task.base_commit)
    sb = await oci_backend.create(name)
    await record_pristine(sb)  # as the pool does for every sandbox it creates
    if image == "pack":
        assert (await sb.exec(f"git checkout -q {commit}")).ok
    res = await sb.exec("dd if=/dev/zero of=/tmp/big bs=1M count=100")
    assert res.exit_code != 0 and "No space left on device" in res.err_text
    with pytest.raises(errors.DiskQuotaExceeded) as info:
        await sb.write_file("more.bin", b"x" * (16 << 20))
    assert info.value.errno == errno.ENOSPC and "No space left on device" in str(info.value)
    assert (await sb.exec("echo still-here")).text == "still-here\n"
    outcome = await reset_in_place(sb, commit)
    assert outcome.ok, outcome.problems
    assert (await sb.exec("dd if=/dev/zero of=/tmp/again bs=1M count=20")).ok  # space is back


async def test_pip_install_during_a_rollout_is_gone_after_reset(oci_backend: LocalBackend, swe_task: Task) -> None:
    sb = await oci_backend.create(SWE_IMAGE)
    await record_pristine(sb)
    await sb.write_file("/tmp/pkgx/setup.py", b"from setuptools import setup\nsetup(name='pkgx', py_modules=['pkgx'])\n")
    await sb.write_file("/tmp/pkgx/pkgx.py", b"VALUE = 42\n")
    res = await sb.exec("pip install -q --no-index --no-build-isolation /tmp/pkgx && python -c 'import pkgx' "
                        "&& echo note > /root/note && echo '[core]\n\thooksPath = /tmp/h' >> .git/config"
                        " && echo x >> calcpkg/__init__.py && git stash -q", timeout=120)
    assert res.ok, res.err_text
    assert any(path.startswith("/opt/testbed-env/") for path, _ in await sb.changes_outside_repo())
    outcome = await reset_in_place(sb, swe_task.base_commit)
    assert outcome.ok, outcome.problems
    assert await sb.changes_outside_repo() == []
    res = await sb.exec("python -c 'import pkgx'; test -e /root/note")
    assert "No module named 'pkgx'" in res.err_text and res.exit_code != 0
    # The repo, .git included, came back through the host-side upper/lower comparison.
    git = await sb.exec("git status --porcelain --ignored; git stash list; git config --get core.hooksPath")
    assert git.text == "" and sb.head == swe_task.base_commit


async def test_an_edit_outside_the_repo_quarantines_with_what_was_found(oci_backend: LocalBackend,
                                                                       swe_task: Task) -> None:
    sb = await oci_backend.create(SWE_IMAGE)
    await record_pristine(sb)
    assert await sb.changes_outside_repo() == []  # starting a sandbox changes nothing
    assert (await sb.exec("echo evil >> /etc/hostname; rm /etc/motd", cwd="/")).ok
    outcome = await reset_in_place(sb, swe_task.base_commit)
    assert not outcome.ok
    text = " ".join(outcome.problems)
    assert "modified /etc/hostname" in text and "deleted /etc/motd" in text


def test_kill_9_during_hydration_leaves_no_usable_image(oci_images: Path, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    code = (f"from sandpool.core.images import ImageStore, hydrate; "
            f"hydrate('oci:{oci_images / 'layout'}:swe', name='x/swe:1', store=ImageStore({str(store.root)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_until(lambda: list(store.tmp_dir.glob("hydrate-*/layer-*/usr")), "umoci to be unpacking a layer")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert store.resolve("x/swe:1") is None and store.images() == []
    assert not [p for p in store.layers_dir.glob("*") if p.is_dir()] if store.layers_dir.exists() else True
    with pytest.raises(errors.ImageNotFound):
        LocalBackend(store=store).image("x/swe:1")
    assert store.prune()["tmp"] >= 1
    assert hydrate(f"oci:{oci_images / 'layout'}:swe", name="x/swe:1", store=store).name == "x/swe:1"
    assert store.resolve("x/swe:1") is not None


def test_hydrates_a_docker_save_archive_reusing_stored_layers(oci_images: Path, oci_store: ImageStore,
                                                              tmp_path: Path) -> None:
    archive = tmp_path / "wh.tar"
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{oci_images / 'layout'}:wh",
                    f"docker-archive:{archive}:sandpool.test/wh:archive"], check=True)
    before = oci_store.usage().layers
    img = hydrate(str(archive), store=oci_store)
    assert img.name == "sandpool.test/wh:archive" and img.source.startswith("docker-archive:")
    assert [x.diff_id for x in img.layers] == [x.diff_id for x in oci_store.resolve(WH_IMAGE).layers]
    assert oci_store.usage().layers == before


def test_hydrates_from_a_registry_pinned_by_digest(oci_images: Path, oci_store: ImageStore,
                                                   tmp_path: Path) -> None:
    port = _free_port()
    cfg = tmp_path / "registry.yml"
    cfg.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
                   f"http:\n  addr: 127.0.0.1:{port}\n")
    reg = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_until(listening, "the registry to listen")
        ref = f"127.0.0.1:{port}/sandpool/swe:1"
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                        f"oci:{oci_images / 'layout'}:swe", f"docker://{ref}"], check=True)
        raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
                             check=True, capture_output=True).stdout
        img = hydrate(f"docker://{ref}", store=oci_store, tls_verify=False)
    finally:
        reg.kill()
        reg.wait()
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    assert img.name == ref and img.source_digest == digest and img.source.endswith(f"@{digest}")
    assert [x.diff_id for x in img.layers] == [x.diff_id for x in oci_store.resolve(SWE_IMAGE).layers]


async def test_swe_shaped_task_runs_end_to_end(oci_backend: LocalBackend, swe_task: Task) -> None:
    from sandpool.envs.policies import NoopPolicy, OraclePolicy
    from sandpool.envs.runner import run_batch

    report = await run_batch([swe_task], [OraclePolicy(), NoopPolicy()], oci_backend,
                             rollouts_per_task=4, concurrency=1, strategy="reuse")
    assert report.failures["completed"] == 4, report.render_text()
    assert report.reward.resolved == 2 and report.quarantines == 0
    assert report.sandboxes_created == 1 and report.resets >= 3
    json.dumps(report.model_dump(mode="json"))


def test_images_cli_pulls_lists_removes_and_prunes(oci_images: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from sandpool.cli import app

    monkeypatch.setenv("SANDPOOL_HOME", str(tmp_path))
    cli = CliRunner()
    res = cli.invoke(app, ["images", "pull", f"oci:{oci_images / 'layout'}:wh", "--name", "t/wh:1"])
    assert res.exit_code == 0, res.output
    listing = cli.invoke(app, ["images"]).output
    assert "t/wh:1" in listing and "1 images, 2 layers" in listing
    assert cli.invoke(app, ["images", "pull", str(tmp_path / "nope")]).exit_code == 2
    assert cli.invoke(app, ["images", "rm", "t/wh:1"]).exit_code == 0
    assert "pruned 1 images, 2 layers" in cli.invoke(app, ["images", "prune"]).output
    assert not any(p.is_dir() for p in (tmp_path / "oci-v1" / "layers").iterdir())


def test_a_killed_runners_oci_sandboxes_are_reaped(oci_store: ImageStore, tmp_path: Path) -> None:
    from sandpool.core.backends.local import reap_stale

    code = (
        "import asyncio\n"
        "from sandpool.core.backends.local import LocalBackend\n"
        "from sandpool.core.images import ImageStore\n"
        "async def main():\n"
        f"    b = LocalBackend(state_root={str(tmp_path / 'state')!r}, store=ImageStore({str(oci_store.root)!r}))\n"
        f"    await b.create({SWE_IMAGE!r})\n"
        "    print(b.run_id, flush=True)\n"
        "    await asyncio.Event().wait()  # the runner idles until it is killed\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().strip()  # the marker: a sandbox is up
        pub = Path("/run/sandpool") / run_id
        assert run_id and any(p.name.startswith("sb-") for p in pub.iterdir())
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert run_id in reap_stale(tmp_path / "state")
    assert not pub.exists()
    assert run_id not in Path("/proc/self/mountinfo").read_text()


async def test_a_disk_full_hydration_leaves_no_usable_image(oci_images: Path, tmp_path: Path) -> None:
    from sandpool.core.backends.local import _quota

    disk = tmp_path / "small"
    disk.mkdir()
    await _quota.attach(_quota.template(48 << 20), tmp_path / "small.img", disk)
    try:
        store = ImageStore(disk / "store")
        with pytest.raises(OSError) as info:  # the 120 MB layer blob does not fit in 48 MB
            hydrate(f"oci:{oci_images / 'layout'}:swe", name="x/swe:1", store=store)
        assert info.value.errno == errno.ENOSPC
        assert store.resolve("x/swe:1") is None and store.images() == []
        assert not store.layers_dir.exists() or not any(store.layers_dir.iterdir())
        assert not any(store.tmp_dir.iterdir())  # its work is gone, so the space is back
    finally:
        _quota.detach(disk, tmp_path / "small.img")


async def test_image_config_user_is_who_commands_run_as(oci_images: Path, oci_store: ImageStore,
                                                      oci_backend: LocalBackend) -> None:
    lay = oci_images / "layout"
    if oci_store.resolve("sandpool.test/user:1") is None:
        subprocess.run(["umoci", "tag", "--image", f"{lay}:base", "usertest"], check=True)
        subprocess.run(["umoci", "config", "--image", f"{lay}:usertest", "--config.user=nobody"], check=True)
        img = hydrate(f"oci:{lay}:usertest", name="sandpool.test/user:1", store=oci_store)
        assert (img.uid, img.gid) == (65534, 65534) and img.user == "nobody"
    sb = await oci_backend.create("sandpool.test/user:1")
    res = await sb.exec("id -u; id -g; touch /etc/nope", cwd="/")
    assert res.text.split()[:2] == ["65534", "65534"] and "Permission denied" in res.err_text


def test_local_docker_and_podman_stores_are_detected_and_named_when_absent(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from sandpool.core.images import normalize_source

    # This machine runs neither daemon: the message says so and names the archive route.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'docker.sock'}")
    with pytest.raises(errors.InputError, match="no Docker daemon here.*docker save"):
        normalize_source("docker-daemon:swebench/x:latest")
    if not Path("/var/lib/containers/storage").is_dir():
        with pytest.raises(errors.InputError, match="no Podman store here.*podman save"):
            normalize_source("containers-storage:swebench/x:latest")
    with pytest.raises(errors.InputError, match="not an OCI layout directory or an archive"):
        normalize_source(str(tmp_path / "missing"))
    assert normalize_source("docker://swebench/x:1") == ("docker://swebench/x:1", "swebench/x:1")
