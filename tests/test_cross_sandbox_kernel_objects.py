"""No per-user kernel object is shared between concurrent sandboxes.

The kernel keeps some accounting per host uid, across namespaces: inotify instances (128 per
user by default) and pipe buffer pages (past ``fs.pipe-user-pages-soft``, a user's new pipes
get one page instead of sixteen). When every sandbox's uid 1000 was host uid 101000, one
sandbox could starve its concurrent siblings of inotify instances or signal to them through
the size of their pipes: GRPO siblings of one task could pass a fix bit by bit.

Shown first between two plain user namespaces of one host uid under bubblewrap (what every
sandbox was), then between two concurrent sandboxes of the default pack and of an OCI image,
each now in its own range of host ids (``backends/local/_idrange``).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandpool.core.backends.local import LocalBackend
from sandpool.core.images import ID_COUNT

from .waiting import until

# `hold` takes every inotify instance and pipe page it can and says so (a line, and a file in
# /tmp), then waits; `probe` says how many inotify instances it gets and its new pipe's size.
KERNEL = """
import ctypes, fcntl, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[1] == "hold":
    held = []
    while libc.inotify_init() >= 0:
        held.append(1)
    pipes = []
    while len(pipes) < 4096:
        r, w = os.pipe()
        pipes.append((r, w))
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: refused past the soft limit
        except OSError:
            break
    pipes += [os.pipe() for _ in range(64)]  # and past it, for sure
    print("held", len(held), flush=True)
    open("/tmp/held", "w").close()
    time.sleep(600)
else:
    n = 0
    while libc.inotify_init() >= 0:
        n += 1
    r, w = os.pipe()
    print("inotify", n, "pipe", fcntl.fcntl(w, 1032))  # F_GETPIPE_SZ
"""


def _host_python() -> str:
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def _bare(uid: int, *argv: str) -> list[str]:
    """A process in its own user, pid and mount namespaces under bubblewrap, as host uid
    ``uid``: what every sandbox was, one host uid for all."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
            shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
            "--proc", "/proc",
            "--dev", "/dev", "--tmpfs", "/tmp", *argv]


def test_without_own_ids_one_namespace_starves_and_signals_another_of_the_same_uid(spare_ids):
    uid = spare_ids.host(1000)
    probe = subprocess.run(_bare(uid, _host_python(), "-c", KERNEL, "probe"), capture_output=True,
                           text=True, check=True).stdout.split()
    with subprocess.Popen(_bare(uid, _host_python(), "-c", KERNEL, "hold"), stdout=subprocess.PIPE,
                          text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().startswith("held")
            starved = subprocess.run(_bare(uid, _host_python(), "-c", KERNEL, "probe"),
                                     capture_output=True, text=True, check=True).stdout.split()
        finally:
            holder.kill()
    assert probe == ["inotify", probe[1], "pipe", "65536"] and int(probe[1]) > 0, probe
    assert starved == ["inotify", "0", "pipe", "8192"], starved


@pytest.fixture(params=["pack", "oci"])
async def two_sandboxes(request, default_pack_tasks, test_images_root):
    if request.param == "pack":
        backend, image = LocalBackend(), default_pack_tasks[0].image
    else:
        backend = LocalBackend(test_images_root, store=request.getfixturevalue("oci_store"))
        image = request.getfixturevalue("swe_task").image
    try:
        yield await asyncio.gather(backend.create(image), backend.create(image))
    finally:
        await backend.aclose()


def _agent_pid(sb) -> int:
    """Host pid of the sandbox's pid 1, its agent: bubblewrap's only child."""
    return int(Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()[0])


async def _python(sb) -> str:
    return "python3" if (await sb.exec("command -v python3")).ok else "python"


async def test_a_sandbox_holding_every_per_user_object_leaves_its_sibling_untouched(two_sandboxes):
    a, b = two_sandboxes
    assert a.ids is not None and b.ids is not None
    assert abs(a.ids.base - b.ids.base) >= ID_COUNT  # disjoint ranges of host ids
    for sb in (a, b):
        await sb.write_file("/tmp/kernel.py", KERNEL.encode())
    before = (await b.exec(f"{await _python(b)} /tmp/kernel.py probe")).text.split()
    holder = asyncio.create_task(a.exec(f"{await _python(a)} /tmp/kernel.py hold", timeout=600))
    marker = Path(f"/proc/{_agent_pid(a)}/root/tmp/held")  # the holder's /tmp, seen from the host
    await until(marker.exists, "the holder to hold every inotify instance and pipe page")
    after = (await b.exec(f"{await _python(b)} /tmp/kernel.py probe")).text.split()
    await a.kill_strays()
    held_text = (await holder).text
    assert held_text.startswith("held ") and int(held_text.split()[1]) > 0, held_text
    assert before[0] == "inotify" and int(before[1]) > 0 and before[3] == "65536", before
    assert after == before, (before, after)
