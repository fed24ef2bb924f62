"""The degraded mode: one pod exec per command, where sandpool's agent cannot run.

A sandbox falls back to it when its image has no interpreter for the agent, or with
``KubernetesBackend(agent=False)``. :class:`ShellExec` then stands in for the agent's client
(:class:`~sandpool.core.agent.client.AgentOps`): each command, file read or write, process
listing and kill of strays opens its own exec stream through the API server and runs under a
small POSIX-sh wrapper (:data:`WRAPPER`) in the pod:

* its stdout and stderr go to files next to the repo's ``.git`` (``.git/sandpool-exec``),
  capped with ``head -c`` when it ends: a background process the command leaves running
  (``server &``) holds a file, not the exec stream, so the exec still ends when the command
  does; a trailer on stderr carries the full sizes (truncation) and the exit code;
* ``timeout -s KILL <t>`` enforces the timeout server-side: GNU ``timeout`` puts the command
  in its own process group and kills the whole group on expiry;
* every process of the exec carries ``SANDPOOL_SANDBOX=<sandbox id>`` and
  ``SANDPOOL_EXEC=<sandbox id>.<n>`` in its environment, so a process that called setsid()
  to leave the group is still found (and killed on timeout) by its marker.

What it cannot do, against the agent:

* errnos: ``read_file`` tells ENOENT, EISDIR and EACCES apart by shell tests, ``write_file``
  reads the errno from coreutils' message; any other failure is an ``ExecTransportError``,
  not the ``SandboxFileError`` the agent would give;
* bounded reads: ``read_file`` is ``cat``, so a FIFO or a device blocks until the exec's
  timeout (the agent refuses a path that is not a regular file with EINVAL);
* process isolation: ``processes`` and ``kill_strays`` see only processes that carry the
  sandbox's marker, so one that clears its environment (``env -i``) is neither listed nor
  killed, nor is a timed-out command's escapee that did so and left its group, unless the
  node confines each exec in a pid namespace of its own (the kwok test cluster does);
* restore and services: there is no in-place restore of repo paths (the reset's generic path
  runs instead) and no service (:class:`~sandpool.core.base.ServiceSpec` needs the agent);
* privacy and load: command output passes through files under the repo's ``.git``, which the
  policy can read, and every command is an API-server stream of its own.
"""

from __future__ import annotations

import base64
import errno
import itertools
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from sandpool.core import errors
from sandpool.core.agent.client import READ_MAX
from sandpool.core.backends.kubernetes._channel import (
    PROTOCOLS,
    STATUS,
    STDERR,
    STDOUT,
    parse_status,
    unreached,
)
from sandpool.core.backends.kubernetes._errors import Channel, translate
from sandpool.core.base import ExecResult

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._http import KubeHttp

__all__ = ["PROCS", "WRAPPER", "ExecTarget", "ShellExec", "build_argv", "run_exec"]

#: Exit code the wrapper uses when it cannot set up the sandbox view (mounts, cwd).
SETUP_FAILED = 125

# $1 image workdir  $2 cwd  $3 timeout seconds  $4 exec marker  $5 sandbox marker  $6 max
# output bytes  $7 N, then N NAME=value environment entries; the rest is the command. Forks
# are kept few: an exec's cost on a kwok node is mostly process creation.
WRAPPER = r"""
export SANDPOOL_SANDBOX="$5" SANDPOOL_EXEC="$4"
d="$1/.git/sandpool-exec"; [ -d "$1/.git" ] || d=/var/tmp/sandpool-exec
[ -d "$d" ] || mkdir -p "$d" || { echo "sandpool: cannot create $d" >&2; exit 125; }
o="$d/$4.out"; e="$d/$4.err"; cwd=$2; t=$3; m=$4; max=$6; shift 6
n=$1; shift; while [ "$n" -gt 0 ]; do export "$1"; shift; n=$((n-1)); done
if cd "$cwd" 2>/dev/null; then
  exec 3>&2 2>/dev/null
  (timeout -s KILL "$t" "$@" >"$o" 2>"$e" </dev/null 3>&-)
  rc=$?
  exec 2>&3 3>&-
else
  printf 'sandpool-exec: cannot cd to %s\n' "$cwd" >"$e"; : >"$o"; rc=127
fi
if [ "$rc" = 137 ]; then
  for f in $(grep -lzx "SANDPOOL_EXEC=$m" /proc/[0-9]*/environ 2>/dev/null); do
    p=${f#/proc/}; p=${p%/environ}
    [ "$p" != $$ ] && kill -9 "$p" 2>/dev/null
  done
fi
set -- $(stat -c %s "$o" "$e")
[ "$1" -gt 0 ] && head -c "$max" "$o"
[ "$2" -gt 0 ] && head -c "$max" "$e" >&2
printf '\n@@sandpool-exec %s %s %s@@' "$1" "$2" "$rc" >&2
rm -f "$o" "$e"
exit "$rc"
"""
_TRAILER = re.compile(rb"\n@@sandpool-exec (\d+) (\d+) (\d+)@@$")

#: Lists (or, with "kill", SIGKILLs) the sandbox's processes other than this exec's own
#: (those carrying its own ``SANDPOOL_EXEC``). $1 sandbox marker value, $2 "list" | "kill".
PROCS = r"""
sweep() {
  n=0
  for f in $(grep -lzx "SANDPOOL_SANDBOX=$1" /proc/[0-9]*/environ 2>/dev/null); do
    grep -qzx "SANDPOOL_EXEC=$SANDPOOL_EXEC" "$f" 2>/dev/null && continue
    p=${f#/proc/}; p=${p%/environ}
    if [ "$2" = kill ]; then kill -9 "$p" 2>/dev/null && n=$((n+1))
    else c=$( (tr '\0' ' ' < "/proc/$p/cmdline") 2>/dev/null); [ -n "$c" ] && printf '%s\n' "$c"; fi
  done
}
if [ "$2" = kill ]; then
  total=0
  for i in 1 2 3; do sweep "$@"; total=$((total+n)); [ "$n" = 0 ] && break; sleep 0.01; done
  echo "$total"
else
  sweep "$@"
fi
exit 0
"""


@dataclass(frozen=True)
class ExecTarget:
    """Where an exec goes: the pod, and how its filesystem view is arranged.

    Attributes:
        namespace: The pod's namespace.
        pod: The pod name.
        container: The container name.
        sandbox_id: The sandbox id carried as ``SANDPOOL_SANDBOX`` by every exec.
        workdir: The repo path as commands see it (``/testbed``).
    """

    namespace: str
    pod: str
    container: str
    sandbox_id: str
    workdir: str


def build_argv(
    target: ExecTarget,
    exec_id: str,
    cmd: str | list[str],
    *,
    timeout: float,
    cwd: str,
    env: dict[str, str],
    max_output: int = 1 << 20,
) -> list[str]:
    """The argv sent to the exec subresource for one command (see :data:`WRAPPER`)."""
    user = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    envs = [f"{k}={v}" for k, v in env.items()]
    return [
        "sh",  # found on the container's PATH, as any exec's command
        "-c",
        WRAPPER,
        "sandpool-exec",
        target.workdir,
        cwd,
        f"{max(timeout, 0.001):.3f}",
        exec_id,
        target.sandbox_id,
        str(max_output),
        str(len(envs)),
        *envs,
        *user,
    ]


async def _drain(
    ws: aiohttp.ClientWebSocketResponse, what: str, t0: float, timeout: float, grace: float,
    cap: int,
) -> tuple[bytearray, bytearray, bool, bool, bytes | None]:
    """Read one exec stream to its end: (stdout, stderr, stdout cut, stderr cut, status
    frame); at most ``cap`` bytes of each stream are kept (the wrapper caps; this only bounds
    memory). Closes ``ws``.

    Raises:
        ExecTransportError: The stream broke, or did not end ``timeout + grace`` seconds
            after ``t0`` (monotonic).
    """
    deadline = t0 + timeout + grace
    out, err = bytearray(), bytearray()
    out_cut = err_cut = False
    status: bytes | None = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.ExecTransportError(
                    f"{what}: the stream did not end within {timeout + grace:.0f} s "
                    f"(timeout {timeout:.0f} s + {grace:.0f} s grace)"
                )
            msg = await ws.receive(timeout=left)
            if msg.type in (
                aiohttp.WSMsgType.CLOSE,
                aiohttp.WSMsgType.CLOSING,
                aiohttp.WSMsgType.CLOSED,
            ):
                break
            if msg.type is aiohttp.WSMsgType.ERROR:
                raise translate(msg.data, what, channel=Channel.EXEC)
            data = msg.data if msg.type is aiohttp.WSMsgType.BINARY else msg.data.encode()
            if not data:
                continue
            ch, payload = data[0], data[1:]
            if ch == STDOUT:
                room = cap - len(out)
                out += payload[: max(room, 0)]
                out_cut |= len(payload) > room
            elif ch == STDERR:
                room = cap - len(err)
                err += payload[: max(room, 0)]
                err_cut |= len(payload) > room
            elif ch == STATUS:
                status = (status or b"") + payload
    except errors.SandpoolError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated at this one boundary
        raise translate(exc, what, channel=Channel.EXEC) from exc
    finally:
        await ws.close()
    return out, err, out_cut, err_cut, status


async def run_exec(
    http: KubeHttp,
    target: ExecTarget,
    argv: list[str],
    *,
    timeout: float,
    max_output: int,
    grace: float = 15.0,
) -> tuple[ExecResult, str]:
    """Run ``argv`` in the pod; return the result and the negotiated protocol.

    Args:
        http: The HTTP layer.
        target: The pod.
        argv: The full argv (from :func:`build_argv`).
        timeout: The command's server-side timeout in seconds; sets ``timed_out``.
        max_output: Bytes kept of each of stdout and stderr.
        grace: Seconds past ``timeout`` the stream may take to end before it counts as broken.

    Raises:
        SandboxDied: The pod is gone (404 on the handshake).
        ExecTransportError: The stream failed or ended without a status; or the API server
            could not reach the pod's node (:func:`unreached`) on every attempt of the HTTP
            layer's retry budget (each retry counted as :meth:`KubeHttp.ws_connect`'s are).
    """
    query = [("container", target.container), ("stdout", "true"), ("stderr", "true")]
    query += [("command", a) for a in argv]
    path = f"/api/v1/namespaces/{target.namespace}/pods/{target.pod}/exec"
    what = f"exec in {target.namespace}/{target.pod}"
    for attempt in itertools.count(1):
        t0 = time.monotonic()
        ws = await http.ws_connect(path, query, PROTOCOLS)
        out, err, out_cut, err_cut, status = await _drain(
            ws, what, t0, timeout, grace, max_output + 4096
        )
        if out or err or (why := unreached(status)) is None:
            break
        # The command never started: retried within the HTTP layer's budget, like a handshake.
        if not await http.retry_wait(attempt, 500):
            raise errors.ExecTransportError(
                f"{what}: the API server could not reach the pod's node after "
                f"{attempt - 1} retries: {why[:300]}"
            )
    duration = time.monotonic() - t0
    try:
        code, message = parse_status(status)
    except ValueError as exc:
        raise translate(exc, what, channel=Channel.EXEC) from exc
    if code is None:
        raise errors.ExecTransportError(
            f"{what}: the stream ended without an exit status ({message})"
        )
    if code == SETUP_FAILED and b"sandpool: " in err:
        raise errors.ExecTransportError(f"{what}: {err.decode('utf-8', 'replace').strip()}")
    trailer = _TRAILER.search(err)
    if trailer is None:
        raise errors.ExecTransportError(
            f"{what}: the exec wrapper ended without its trailer "
            f"(exit {code}): {bytes(err[-200:])!r}"
        )
    out_size, err_size = int(trailer.group(1)), int(trailer.group(2))
    del err[trailer.start() :]
    timed_out = code == 137 and duration >= timeout
    return ExecResult(
        exit_code=124 if timed_out else code,
        stdout=bytes(out[:max_output]),
        stderr=bytes(err[:max_output]),
        stdout_truncated=out_cut or out_size > max_output,
        stderr_truncated=err_cut or err_size > max_output,
        timed_out=timed_out,
        duration_s=duration,
    ), ws.protocol or "v4.channel.k8s.io"


_FILE_CHUNK = 48 << 10  # bytes per write_file exec (base64 in one argv element < 128 KiB)
# read_file's exit codes for the errnos a policy's path can cause.
_READ = (
    '[ -e "$1" ] || exit 44; [ ! -d "$1" ] || exit 45; [ -r "$1" ] || exit 46; exec cat -- "$1"'
)
_READ_ERRNO = {44: errno.ENOENT, 45: errno.EISDIR, 46: errno.EACCES}
_STDERR_ERRNO = (
    ("Read-only file system", errno.EROFS),
    ("Permission denied", errno.EACCES),
    ("Is a directory", errno.EISDIR),
    ("Not a directory", errno.ENOTDIR),
    ("No space left on device", errno.ENOSPC),
    ("Disk quota exceeded", errno.EDQUOT),
    ("File name too long", errno.ENAMETOOLONG),
    ("File exists", errno.ENOTDIR),  # mkdir -p over a file in the path
)


def _stderr_errno(text: str) -> int | None:
    """The errno a coreutils/sh message in ``text`` names (its strerror text), else None."""
    return next((code for needle, code in _STDERR_ERRNO if needle in text), None)


class ShellExec:
    """The agent's operations done with one pod exec each (the degraded mode; see the module
    docstring for what it cannot do).

    Args:
        http: The backend's HTTP layer.
        target: The pod.

    Attributes:
        protocol: The channel protocol the last exec negotiated.
    """

    def __init__(self, http: KubeHttp, target: ExecTarget) -> None:
        self._http = http
        self._target = target
        self._seq = itertools.count(1)
        self.protocol: str | None = None

    def alive(self) -> bool:
        """Always True: each command opens its own stream (the pod's death is the sandbox's)."""
        return True

    async def exec(self, cmd: str | list[str], *, timeout: float, cwd: str, env: dict[str, str],
                   max_output: int) -> ExecResult:
        """Run ``cmd`` under :data:`WRAPPER` in one exec stream; ``cwd`` is absolute."""
        argv = build_argv(self._target, f"{self._target.sandbox_id}.{next(self._seq)}", cmd,
                          timeout=timeout, cwd=cwd, env=env, max_output=max_output)
        res, self.protocol = await run_exec(self._http, self._target, argv, timeout=timeout,
                                            max_output=max_output)
        return res

    async def read_file(self, abs_path: str, shown: str) -> bytes:
        """``cat`` the file; ENOENT, EISDIR, EACCES as ``SandboxFileError``, else
        ``ExecTransportError``."""
        res = await self.exec(["/bin/sh", "-c", _READ, "sh", abs_path], timeout=120.0, cwd="/",
                              env={}, max_output=READ_MAX)
        where = f"in sandbox {self._target.sandbox_id}"
        if res.exit_code in _READ_ERRNO:
            raise errors.sandbox_file_error(_READ_ERRNO[res.exit_code], shown, where)
        if res.stdout_truncated:  # the policy's file, over the cap the agent has too
            raise errors.sandbox_file_error(errno.EFBIG, shown, f"{where}: over {READ_MAX} bytes")
        if not res.ok:
            raise errors.ExecTransportError(
                f"reading {shown} {where} failed (exit {res.exit_code}): {res.err_text.strip()[:200]}")
        return res.stdout

    async def write_file(self, abs_path: str, shown: str, data: bytes, mode: int) -> None:
        """Write ``data`` as base64 chunks, one exec each, then rename into place; the errno
        named in coreutils' message as ``SandboxFileError``, else ``ExecTransportError``."""
        chunks = [data[i : i + _FILE_CHUNK] for i in range(0, len(data), _FILE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            script = ('set -e; [ ! -d "$1" ] || { echo "$1: Is a directory" >&2; exit 1; }; '
                      'mkdir -p "$(dirname "$1")"; ' if i == 0 else "set -e; ")
            script += 'printf %s "$2" | base64 -d ' + ('> "$1.sp-part"' if i == 0 else '>> "$1.sp-part"')
            if i == len(chunks) - 1:
                script += '; chmod "$3" "$1.sp-part"; mv -f "$1.sp-part" "$1"'
            res = await self.exec(
                ["/bin/sh", "-c", script, "sh", abs_path, base64.b64encode(chunk).decode(), f"{mode:o}"],
                timeout=120.0, cwd="/", env={}, max_output=1 << 20)
            if not res.ok:
                where = f"in sandbox {self._target.sandbox_id}"
                code = _stderr_errno(res.err_text)
                if code is not None:  # the policy's path: a result, not a broken channel
                    raise errors.sandbox_file_error(code, shown, where)
                raise errors.ExecTransportError(
                    f"writing {shown} {where} failed (exit {res.exit_code}): {res.err_text.strip()[:200]}")

    async def _procs(self, what: str) -> str:
        res = await self.exec(["/bin/sh", "-c", PROCS, "sh", self._target.sandbox_id, what],
                              timeout=30.0, cwd="/", env={}, max_output=1 << 20)
        return res.text

    async def processes(self) -> list[str]:
        """Command lines of the processes carrying the sandbox's marker, but the asking exec's."""
        return [line for line in (await self._procs("list")).splitlines() if line.strip()]

    async def kill_strays(self) -> int:
        """SIGKILL every process carrying the sandbox's marker but the asking exec's; how many."""
        out = await self._procs("kill")
        try:
            return int(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise errors.ExecTransportError(
                f"kill_strays in sandbox {self._target.sandbox_id}: unexpected answer {out[:100]!r}"
            ) from None
