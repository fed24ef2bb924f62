"""A conformance suite any :class:`~sandpool.core.base.Backend` can run, as Gymnasium's
``check_env`` does for environments (``gymnasium/utils/env_checker.py``).

Each check starts a fresh sandbox from the backend, drives it only through the
:class:`~sandpool.core.base.Sandbox` contract, and deletes it; a failing check never hides
the others. The checks:

=====================  ==========================================================================
``exit_codes``         ``exit 3`` is 3; death by SIGKILL/SIGTERM is 137/143; a missing binary 127
``timeout_group``      the server-side timeout kills the command's process group and its
                       ``setsid`` children; ``exit_code`` 124, ``timed_out``, output kept
``timeout_escapee``    a double-forked ``env -i setsid`` escapee dies with the timeout, and a
                       process started before the command survives it
``output_cap``         stdout is cut at ``max_output`` and flagged; a short stderr is not
``binary_io``          bytes 0-255 round-trip through write_file/read_file and exec output
``file_errnos``        ENOENT, EISDIR, ENOTDIR and a read-only or forbidden path come back as
                       :class:`~sandpool.core.errors.SandboxFileError`, and the sandbox still works
``disk_quota``         writing past ``ResourceLimits.disk_bytes`` fails with ENOSPC/EDQUOT inside
                       the sandbox, and the space comes back once the file is removed
``processes``          a background process is listed, ``kill_strays`` kills it, none is left
``death``              after the backend's ``kill`` hook, ``alive()`` turns False and a command
                       raises ``SandboxDied`` (not a result, not a hang)
``reset``              after a rollout's mess (edits, commits, stash, tags, a planted hook,
                       ignored files, ``/tmp``, a background process) ``reset_in_place`` passes
                       its verification and the tree, ``.git`` and processes are pristine
=====================  ==========================================================================

Usage::

    report = await check_backend(LocalBackend(limits=ResourceLimits(disk_bytes=64 << 20)),
                                 image, commit=head, kill=backend.kill)
    print(report.render_text())
    assert report.ok, report.failed
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from sandpool.core import errors
from sandpool.core.base import Backend, Sandbox
from sandpool.core.reset import SAFE_GIT, record_pristine, reset_in_place

__all__ = ["CHECKS", "CheckResult", "ConformanceReport", "check_backend"]

#: A fault hook that kills a sandbox from outside, as an OOM kill or an eviction would.
KillHook = Callable[[Sandbox], Awaitable[None] | None]


class CheckFailed(AssertionError):
    """One expectation of a check did not hold (its message says which)."""


class CheckSkipped(Exception):
    """A check cannot run against this backend as configured (its message says why)."""


def _expect(cond: object, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome.

    Attributes:
        name: The check (see the module table).
        status: ``"pass"``, ``"fail"`` or ``"skip"`` (could not run here; never a pass).
        detail: What failed, or why it was skipped.
        seconds: Wall time of the check, sandbox start included.
    """

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """The suite's results for one backend.

    Attributes:
        backend: The backend's ``name``.
        results: One :class:`CheckResult` per check, in suite order.
    """

    backend: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every check passed (a skipped check is not a pass)."""
        return all(r.status == "pass" for r in self.results)

    @property
    def failed(self) -> dict[str, str]:
        """Checks that did not pass, by name, with their detail."""
        return {r.name: f"{r.status}: {r.detail}" for r in self.results if r.status != "pass"}

    def render_text(self) -> str:
        """An aligned table: check, status, seconds, detail."""
        lines = [f"conformance: backend {self.backend}: "
                 f"{sum(r.status == 'pass' for r in self.results)}/{len(self.results)} pass"]
        lines += [f"  {r.name:<16} {r.status:<5} {r.seconds:6.2f} s  {r.detail[:150]}" for r in self.results]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Ctx:
    backend: Backend
    commit: str | None
    kill: KillHook | None
    disk_bytes: int | None


async def _exit_codes(sb: Sandbox, ctx: _Ctx) -> None:
    for cmd, want in (("exit 3", 3), ("kill -9 $$", 137), ("kill -TERM $$", 143), ("true", 0)):
        res = await sb.exec(cmd, timeout=30)
        _expect(res.exit_code == want and not res.timed_out, f"{cmd!r} gave exit {res.exit_code}, want {want}")
    res = await sb.exec(["/no/such-binary"], timeout=30)
    _expect(res.exit_code == 127, f"a missing binary gave exit {res.exit_code}, want 127")


async def _timeout_group(sb: Sandbox, ctx: _Ctx) -> None:
    t0 = time.monotonic()
    res = await sb.exec("sleep 300 & (setsid sleep 301 &); echo started; sleep 302", timeout=1.0)
    _expect(res.timed_out and res.exit_code == 124, f"timed_out={res.timed_out} exit {res.exit_code}, want 124")
    _expect(res.stdout == b"started\n", f"output before the timeout was {res.stdout!r}")
    _expect(time.monotonic() - t0 < 30, "the timeout took over 30 s to return")
    left = [p for p in await sb.processes() if "sleep 30" in p]
    _expect(not left, f"survived the timeout: {left}")


async def _timeout_escapee(sb: Sandbox, ctx: _Ctx) -> None:
    _expect((await sb.exec("sleep 600 &", timeout=30)).ok, "could not start a background process")
    res = await sb.exec("(env -i setsid sh -c 'sleep 303' &); (env -i setsid sleep 304 &); sleep 300",
                        timeout=1.0)
    _expect(res.timed_out, "the command did not time out")
    procs = await sb.processes()
    _expect(not [p for p in procs if "sleep 30" in p], f"an env -i setsid escapee survived: {procs}")
    _expect(any("sleep 600" in p for p in procs), f"a process older than the command was killed: {procs}")


async def _output_cap(sb: Sandbox, ctx: _Ctx) -> None:
    res = await sb.exec("head -c 300000 /dev/zero; head -c 10 /dev/zero >&2", timeout=60, max_output=1000)
    _expect(len(res.stdout) == 1000 and res.stdout_truncated, f"stdout {len(res.stdout)} bytes, "
            f"truncated={res.stdout_truncated}; want 1000, True")
    _expect(len(res.stderr) == 10 and not res.stderr_truncated, f"stderr {len(res.stderr)} bytes, "
            f"truncated={res.stderr_truncated}; want 10, False")


async def _binary_io(sb: Sandbox, ctx: _Ctx) -> None:
    blob = bytes(range(256)) * 257
    await sb.write_file("/tmp/blob.bin", blob)
    _expect(await sb.read_file("/tmp/blob.bin") == blob, "read_file did not return the bytes written")
    res = await sb.exec("sha256sum /tmp/blob.bin; cat /tmp/blob.bin >&2", timeout=60)
    _expect(res.text.split()[:1] == [hashlib.sha256(blob).hexdigest()], f"sha256 in the sandbox: {res.text!r}")
    _expect(res.stderr == blob, "exec's stderr is not binary-safe")
    await sb.write_file("conformance-rel.bin", b"\x00\xff")
    _expect(await sb.read_file(f"{sb.workdir}/conformance-rel.bin") == b"\x00\xff",
            "a path relative to workdir was not written under workdir")


async def _file_errnos(sb: Sandbox, ctx: _Ctx) -> None:
    async def code_of(op: Callable[[], Awaitable[object]]) -> int | None:
        try:
            await op()
        except errors.SandboxFileError as exc:
            return exc.errno
        return None

    cases = [
        ("read of a missing file", lambda: sb.read_file("/no/such/file"), {errno.ENOENT}),
        ("read of a directory", lambda: sb.read_file(sb.workdir), {errno.EISDIR}),
        ("write onto a directory", lambda: sb.write_file(sb.workdir, b"x"), {errno.EISDIR}),
        ("write under a file", lambda: sb.write_file("/tmp/blob/x", b"x"), {errno.ENOTDIR}),
        ("write to /usr", lambda: sb.write_file("/usr/sandpool-conformance", b"x"),
         {errno.EROFS, errno.EACCES, errno.EPERM}),
    ]
    await sb.write_file("/tmp/blob", b"file")
    for what, op, want in cases:
        got = await code_of(op)
        if got is None and what == "write to /usr":  # it got out: leave nothing behind
            await sb.exec("rm -f /usr/sandpool-conformance", timeout=30)
        _expect(got in want, f"{what}: errno {errno.errorcode.get(got or 0, got)}, want "
                f"{'/'.join(errno.errorcode[c] for c in sorted(want))}")
        _expect(sb.alive(), f"{what} killed the sandbox")
    _expect((await sb.exec("echo ok", timeout=30)).text == "ok\n", "the sandbox stopped answering")


async def _disk_quota(sb: Sandbox, ctx: _Ctx) -> None:
    quota = ctx.disk_bytes
    if not quota:
        raise CheckSkipped("no disk quota configured (ResourceLimits.disk_bytes) to test")
    if quota > 2**30:
        raise CheckSkipped(f"quota {quota} bytes is over 1 GiB; run the suite with a small disk_bytes")
    mib = quota // 2**20 + 16
    res = await sb.exec(f"dd if=/dev/zero of=big bs=1M count={mib} 2>&1; echo rc=$?", timeout=300)
    _expect("No space left" in res.text or "Disk quota exceeded" in res.text,
            f"writing {mib} MiB past a {quota >> 20} MiB quota did not fail: {res.text[-200:]!r}")
    try:
        await sb.write_file("more.bin", b"x" * (4 << 20))
        raise CheckFailed("write_file past the quota succeeded")
    except errors.SandboxFileError as exc:
        _expect(exc.errno in (errno.ENOSPC, errno.EDQUOT), f"write_file past the quota: {exc}")
    _expect(sb.alive() and (await sb.exec("rm -f big more.bin && echo freed", timeout=60)).text == "freed\n",
            "the sandbox did not recover after the quota was hit")
    await sb.write_file("after.bin", b"x" * (1 << 20))


async def _processes(sb: Sandbox, ctx: _Ctx) -> None:
    # The command returns once both children run sleep, not while they are still its forks.
    start = ("sleep 600 & a=$!; sleep 601 & b=$!; until [ \"$(tr -d '\\0' < /proc/$a/cmdline)"
             "$(tr -d '\\0' < /proc/$b/cmdline)\" = sleep600sleep601 ]; do :; done")
    _expect((await sb.exec(start, timeout=30)).ok, "could not start background processes")
    procs = await sb.processes()
    _expect(any("sleep 600" in p for p in procs) and any("sleep 601" in p for p in procs),
            f"processes() did not list them: {procs}")
    killed = await sb.kill_strays()
    _expect(killed >= 2, f"kill_strays() reported {killed}, want >= 2")
    _expect(await sb.processes() == [], "processes were left after kill_strays()")


async def _death(sb: Sandbox, ctx: _Ctx) -> None:
    if ctx.kill is None:
        raise CheckSkipped("no kill hook given for this backend")
    _expect(sb.alive(), "a fresh sandbox is not alive()")
    done = ctx.kill(sb)
    if inspect.isawaitable(done):
        await done
    try:
        async with asyncio.timeout(120):
            while True:  # a backend learns of a death asynchronously (a watch event, EOF)
                await sb.exec("true", timeout=30)
                await asyncio.sleep(0.1)
    except errors.SandboxDied:
        pass
    except TimeoutError:
        raise CheckFailed("commands kept succeeding for 120 s after the kill") from None
    _expect(not sb.alive(), "alive() is still True after SandboxDied")


async def _reset(sb: Sandbox, ctx: _Ctx) -> None:
    commit = ctx.commit or sb.head
    if commit is None:
        raise CheckSkipped("no commit given and the backend does not know the image's head")
    await record_pristine(sb)  # as the pool does for a fresh sandbox
    mess = ("echo x >> $(git ls-files | head -1); echo y > conformance-untracked.py; "
            "mkdir -p __pycache__ && echo z > __pycache__/c.pyc; echo t > /tmp/t; "
            "git -c user.name=p -c user.email=p@p commit -qam conformance-mess; git tag conformance-tag; "
            "echo s >> $(git ls-files | head -1); git -c user.name=p -c user.email=p@p stash -q; "
            "printf '#!/bin/sh\\necho planted\\n' > .git/hooks/post-checkout; chmod +x .git/hooks/post-checkout; "
            "git config alias.conformance '!echo planted'; sleep 600 &")
    res = await sb.exec(mess, timeout=60)
    _expect(res.ok, f"making the mess failed: {res.err_text[:200]}")
    outcome = await reset_in_place(sb, commit)
    _expect(outcome.ok, f"reset_in_place failed its verification: {'; '.join(outcome.problems)[:300]}")
    res = await sb.exec(f"{SAFE_GIT} rev-parse HEAD; {SAFE_GIT} status --porcelain --ignored; "
                        f"{SAFE_GIT} stash list; {SAFE_GIT} log --all --oneline | grep conformance; "
                        f"{SAFE_GIT} tag -l conformance-tag; ls .git/hooks | grep -v '\\.sample$'; "
                        f"{SAFE_GIT} config --get alias.conformance; ls -A /tmp", timeout=60)
    _expect(res.text.split() == [commit], f"not pristine after the reset: {res.text[:300]!r}")
    _expect(await sb.processes() == [], "a process of the rollout survived the reset")


#: The suite, in order: (name, check).
CHECKS: tuple[tuple[str, Callable[[Sandbox, _Ctx], Awaitable[None]]], ...] = (
    ("exit_codes", _exit_codes), ("timeout_group", _timeout_group), ("timeout_escapee", _timeout_escapee),
    ("output_cap", _output_cap), ("binary_io", _binary_io), ("file_errnos", _file_errnos),
    ("disk_quota", _disk_quota), ("processes", _processes), ("death", _death), ("reset", _reset),
)


async def check_backend(
    backend: Backend,
    image: str,
    *,
    commit: str | None = None,
    kill: KillHook | None = None,
    disk_bytes: int | None = None,
    only: Sequence[str] | None = None,
) -> ConformanceReport:
    """Run the conformance suite against ``backend``.

    Args:
        backend: The backend under test (preflighted here; not closed).
        image: An image whose workdir is a git repository.
        commit: The commit the image's workdir is at (default: the sandbox's ``head``).
        kill: A hook that kills a sandbox from outside (``LocalBackend.kill``, a pod delete);
            without it ``death`` is skipped.
        disk_bytes: The backend's disk quota in bytes (default: ``backend.limits.disk_bytes``
            when the backend has ``limits``); without one ``disk_quota`` is skipped.
        only: Names of the checks to run (default: all of :data:`CHECKS`).

    Returns:
        A :class:`ConformanceReport`; ``report.ok`` is True when every check passed.

    Raises:
        BackendUnavailable: The backend's preflight failed (nothing could be checked).
    """
    await backend.preflight()
    if disk_bytes is None:
        disk_bytes = getattr(getattr(backend, "limits", None), "disk_bytes", None)
    ctx = _Ctx(backend, commit, kill, disk_bytes)
    report = ConformanceReport(backend.name)
    for name, check in CHECKS:
        if only is not None and name not in only:
            continue
        t0 = time.monotonic()
        sb: Sandbox | None = None
        try:
            sb = await backend.create(image)
            await check(sb, ctx)
            result = CheckResult(name, "pass")
        except CheckSkipped as exc:
            result = CheckResult(name, "skip", str(exc))
        except CheckFailed as exc:
            result = CheckResult(name, "fail", str(exc))
        except Exception as exc:  # noqa: BLE001 - an unexpected error is this check's failure
            result = CheckResult(name, "fail", f"{type(exc).__name__}: {exc}")
        finally:
            if sb is not None:
                await backend.delete(sb)
        report.results.append(CheckResult(result.name, result.status, result.detail, time.monotonic() - t0))
    return report
