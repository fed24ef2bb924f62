"""Exec into a pod over the exec subresource's WebSocket channel protocol.

Protocols: ``v5.channel.k8s.io`` where the server offers it, else ``v4.channel.k8s.io``.
Every binary frame starts with a channel byte: 1 stdout, 2 stderr, 3 status (a JSON
``Status`` when the command ends), 255 close (v5). Frames are bytes, so output is binary-safe.
Both streams are drained to the end while only ``max_output`` bytes of each are kept, so a
chatty command never blocks on a full pipe.

The command runs under a small POSIX-sh wrapper (:data:`WRAPPER`), in the pod:

* its stdout and stderr go to files next to the repo's ``.git`` (``.git/sandpool-exec``),
  capped with ``head -c`` when it ends: a background process the command leaves running
  (``server &``) holds a file, not the exec stream, so the exec still ends when the command
  does; a trailer on stderr carries the full sizes (truncation) and the exit code;

* ``timeout -s KILL <t>`` enforces the timeout server-side: GNU ``timeout`` puts the command
  in its own process group and kills the whole group on expiry;
* every process of the exec carries ``SANDPOOL_SANDBOX=<sandbox id>`` and
  ``SANDPOOL_EXEC=<sandbox id>.<n>`` in its environment, so a process that called setsid()
  to leave the group is still found (and killed on timeout) by its marker.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
import time
from dataclasses import dataclass

import aiohttp

from sandpool.core import errors
from sandpool.core.backends.kubernetes._errors import Channel, translate
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.base import ExecResult

__all__ = ["PROTOCOLS", "ExecTarget", "parse_status", "run_exec", "unreached"]

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
_STDOUT, _STDERR, _STATUS = 1, 2, 3
_EXIT_STATUS = re.compile(r"exit status (\d+)")
_SIGNALLED = re.compile(r"signal: (\w[\w ]*)")
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


def parse_status(raw: bytes | None) -> tuple[int | None, str]:
    """Exit code and message from the status channel's ``Status`` JSON.

    ``Success`` is 0; a failure carries the code in ``details.causes[reason=ExitCode]``
    (kubelet) or as ``exit status N`` in its message (kwok); ``signal: killed`` gives
    ``128 + 9``. Returns ``(None, message)`` when no exit code can be read.
    """
    if not raw:
        return None, "no status frame"
    st = json.loads(raw)
    if st.get("status") == "Success":
        return 0, ""
    msg = st.get("message", "")
    for cause in (st.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"]), msg
    if m := _EXIT_STATUS.search(msg):
        return int(m.group(1)), msg
    if m := _SIGNALLED.search(msg):
        name = "SIG" + m.group(1).strip().upper().split()[0]
        aliases = {"SIGKILLED": "SIGKILL", "SIGTERMINATED": "SIGTERM", "SIGINTERRUPT": "SIGINT"}
        try:
            return 128 + signal.Signals[aliases.get(name, name)].value, msg
        except KeyError:
            return None, msg
    return None, msg


_UNREACHED = re.compile(r"error dialing backend|error sending request|dial tcp")


def unreached(raw: bytes | None) -> str | None:
    """The message of a status frame saying the API server could not reach the pod's node.

    With the node's kubelet down or unreachable, kube-apiserver still upgrades the exec
    stream, then ends it with a ``Failure`` status (``InternalError``, code 500: "error
    dialing backend: dial tcp ..."; kwok's "error sending request: ... dial tcp ...") and no
    exit code: the command never started, so running it again cannot run it twice.

    Returns:
        The status message, or None for any other status (an exit code, a failure after the
        command started, no or garbled status).
    """
    try:
        st = json.loads(raw or b"")
    except ValueError:
        return None
    if not isinstance(st, dict) or st.get("status") != "Failure":
        return None
    if any(c.get("reason") == "ExitCode" for c in (st.get("details") or {}).get("causes") or []):
        return None
    msg = str(st.get("message", ""))
    return msg if _UNREACHED.search(msg) else None


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
            if ch == _STDOUT:
                room = cap - len(out)
                out += payload[: max(room, 0)]
                out_cut |= len(payload) > room
            elif ch == _STDERR:
                room = cap - len(err)
                err += payload[: max(room, 0)]
                err_cut |= len(payload) > room
            elif ch == _STATUS:
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
