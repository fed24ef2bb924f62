"""Kernel keyrings and other processes' resource limits, attacked from inside a sandbox.

Keys are not namespaced: a key is found by its global serial number, so a policy that stores
the gold diff in a key (world-readable by its own ``setperm``) reaches the next rollout on the
same sandbox (the in-place reset compares files, not keys) and every concurrent sandbox, of
any uid. And the kernel lets a process set the resource limits of any process of its uid: the
policy could give the sandbox's agent a file limit of 3 or a CPU limit, turning its own
failure into an agent death that looks like infrastructure.

Each attack is first shown to work in plain user namespaces under bubblewrap without
sandpool's seccomp filter (``sandpool.core.agent.seccomp``), then shown to fail in real sandboxes
of the default pack and of an OCI image, with the next rollout and a concurrent sibling
finding nothing.
"""

from __future__ import annotations

import asyncio
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandpool.core import Outcome, PoolLimits, SandboxPool, run_rollout
from sandpool.core.backends.local import LocalBackend
from sandpool.core.agent.seccomp import _ABIS

ADD_KEY, _, KEYCTL = _ABIS[platform.machine()][0].keyring
SECRET = "GOLD-DIFF-3f9c"

# One script for every side: `store` puts SECRET in every keyring it can reach, readable by
# anyone, and prints the serials; `read SERIAL...` prints what it can read of those keys and
# of every key /proc/keys shows it. Pure ctypes: images need not have keyutils.
KEYS = f"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def err():
    return ctypes.get_errno()
if sys.argv[1] == "store":
    for ring in (-4, -5, -3):  # user, user-session, session keyrings
        data = b"{SECRET}"
        k = libc.syscall({ADD_KEY}, b"user", b"leak%d" % -ring, data, len(data), ctypes.c_int(ring))
        if k < 0:
            print("add_key", ring, "errno", err())
            continue
        libc.syscall({KEYCTL}, 5, ctypes.c_long(k), ctypes.c_ulong(0x3f3f3f3f))  # KEYCTL_SETPERM
        print("stored", k)
    sys.stdout.flush()
    if len(sys.argv) > 2:
        sys.stdin.readline()  # hold the session keyring until told to go
else:
    serials = [int(s) for s in sys.argv[2:]]
    try:
        serials += [int(ln.split()[0], 16) for ln in open("/proc/keys")]
    except OSError:
        pass
    for k in serials:
        buf = ctypes.create_string_buffer(256)
        n = libc.syscall({KEYCTL}, 11, ctypes.c_long(k), buf, 256)  # KEYCTL_READ
        print("read", k, buf.raw[:n] if n > 0 else "errno %d" % err())
"""


def _bare(uid: int, *argv: str) -> list[str]:
    """A process in its own user, pid and mount namespaces under bubblewrap, as host uid
    ``uid``, without sandpool's filter: what a sandbox was before the defence."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
            shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
            "--proc", "/proc",
            "--dev", "/dev", "--tmpfs", "/tmp", *argv]


def _host_python() -> str:
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def test_without_the_filter_a_key_stored_in_one_namespace_is_read_from_another_of_another_uid(
        spare_ids):
    writer = subprocess.Popen(_bare(spare_ids.host(1000), _host_python(), "-c", KEYS, "store", "hold"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        stored = writer.stdout.readline().split()
        assert stored[0] == "stored", stored
        # Another uid, its own user namespace: only the serial is needed (and /proc/keys shows it).
        res = subprocess.run(_bare(spare_ids.host(2000), _host_python(), "-c", KEYS, "read", stored[1]),
                             capture_output=True, text=True, check=True)
        assert f"read {stored[1]} b'{SECRET}'" in res.stdout, res.stdout
    finally:
        writer.communicate("go\n")


@pytest.fixture(params=["pack", "oci"])
async def keyring_setup(request, default_pack_tasks, test_images_root):
    """(backend, task) for a default-pack image and for the OCI test image."""
    if request.param == "pack":
        backend, task = LocalBackend(), default_pack_tasks[0]
    else:
        store = request.getfixturevalue("oci_store")
        backend, task = LocalBackend(test_images_root, store=store), request.getfixturevalue("swe_task")
    yield backend, task


async def test_no_keyring_is_reachable_so_neither_the_next_rollout_nor_a_sibling_reads_a_key(keyring_setup,
                                                                                             spare_ids):
    backend, task = keyring_setup
    # A key of the host, world-readable, that a sandbox could otherwise read by its serial.
    outsider = await asyncio.create_subprocess_exec(
        *_bare(spare_ids.host(3000), _host_python(), "-c", KEYS, "store", "hold"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert outsider.stdout is not None
    serial = (await outsider.stdout.readline()).decode().split()[1]
    seen: dict[str, str] = {}

    async def episode(name: str, lease) -> float:
        py = "python3" if await _has(lease, "python3") else "python"
        await lease.write_file("/tmp/keys.py", KEYS.encode())
        seen[name] = (await lease.exec(f"{py} /tmp/keys.py store; {py} /tmp/keys.py read {serial}")).text
        return 0.0

    try:
        async with SandboxPool(backend, "reuse", PoolLimits(max_live=2)) as pool:
            # Two concurrent rollouts (siblings on two sandboxes), then the next rollout on a
            # reused one.
            first = await asyncio.gather(*(run_rollout(pool, task, lambda lease, n=n: episode(n, lease))
                                           for n in ("a", "b")))
            after = await run_rollout(pool, task, lambda lease: episode("next", lease))
            assert pool.counters.resets >= 1  # the last rollout ran on a reset sandbox
    finally:
        await outsider.communicate(b"go\n")
    assert [r.outcome for r in (*first, after)] == [Outcome.COMPLETED] * 3
    for name, text in seen.items():
        assert "stored" not in text and SECRET not in text, (name, text)
        assert "add_key -4 errno 38" in text, (name, text)  # ENOSYS: no keyring at all
        assert f"read {serial} errno 38" in text, (name, text)


async def _has(lease, program: str) -> bool:
    return (await lease.exec(f"command -v {program}")).ok


LIMITS = """
import resource, sys
try:
    resource.prlimit(int(sys.argv[1]), resource.RLIMIT_NOFILE, (3, 3))
    print("set the limit of another process")
except OSError as exc:
    print("refused", exc.errno)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
print("own limit", resource.getrlimit(resource.RLIMIT_NOFILE))
"""


def test_without_the_filter_a_process_sets_the_limits_of_pid_1_of_its_uid(spare_ids):
    script = f"{_host_python()} -c '{LIMITS}' 1; true"  # sh, pid 1, stays to be the target
    res = subprocess.run(_bare(spare_ids.host(1000), "--as-pid-1", "sh", "-c", script), capture_output=True,
                         text=True, check=True)
    assert "set the limit of another process" in res.stdout, res.stdout


async def test_the_policy_cannot_set_the_agents_limits_and_its_rollout_stays_scored(default_pack_tasks):
    task = default_pack_tasks[0]

    async def episode(lease) -> float:
        await lease.write_file("/tmp/limits.py", LIMITS.encode())
        out = (await lease.exec("python /tmp/limits.py 1")).text  # the agent is pid 1
        assert "refused 1" in out and "own limit (64, 64)" in out, out
        # The agent still opens files and starts commands as before.
        return 1.0 if (await lease.exec("ls / | wc -l")).ok else 0.0

    async with SandboxPool(LocalBackend(), "reuse") as pool:
        result = await run_rollout(pool, task, episode)
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result
