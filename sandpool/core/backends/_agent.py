"""The command agent that runs inside every local sandbox (stdlib only).

It is the sandbox's long-lived process: a warm sandbox is this agent waiting on stdin, so an
exec never pays for a sandbox start. Protocol: one JSON object per line on stdin (a request)
and one per line on stdout (a response with the same ``id``). Requests are served on threads,
so a slow command does not block others.

Ops:
    exec        {cmd: str|list, timeout: s, cwd, env, max_output: bytes}
                -> {exit_code, stdout(b64), stderr(b64), stdout_truncated, stderr_truncated,
                    timed_out, duration_s}
    read_file   {path} -> {data(b64)} | {error: "not_found"|...}
    write_file  {path, data(b64), mode} -> {}
    ps          {} -> {procs: [cmdline, ...]} (everything but the agent and pid 1)
    kill_strays {} -> {killed: n}
"""

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

_out_lock = threading.Lock()
_SELF = os.getpid()


def _send(obj):
    line = json.dumps(obj, separators=(",", ":")) + "\n"
    with _out_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class _Capture:
    """Drains one pipe on a thread, keeping at most ``cap`` bytes (the rest is counted as cut).

    Draining to EOF means a chatty child never blocks on a full pipe.
    """

    def __init__(self, stream, cap):
        self.buf = bytearray()
        self.truncated = False
        self._stream, self._cap = stream, cap
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            chunk = self._stream.read1(65536)
            if not chunk:
                return
            room = self._cap - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            if len(chunk) > max(room, 0):
                self.truncated = True

    def snapshot(self):
        return bytes(self.buf), self.truncated


def _children_of():
    """Map pid -> list of child pids, read from /proc."""
    kids = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _descendants(pid):
    kids = _children_of()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _tagged(marker):
    """Pids whose environment carries ``marker`` (every descendant of one exec inherits it)."""
    needle = marker.encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


def _kill_tree(proc, marker):
    # The process group first (the documented contract), then descendants that called
    # setsid() to escape it and were re-parented to init: they still carry the exec's marker.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for _ in range(3):
        pids = set(_descendants(proc.pid)) | set(_tagged(marker))
        pids.discard(_SELF)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


def _exec(req):
    cmd = req["cmd"]
    argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    timeout = float(req.get("timeout") or 60.0)
    cap = int(req.get("max_output") or (1 << 20))
    env = dict(os.environ)
    env.update(req.get("env") or {})
    marker = f"SANDPOOL_EXEC={_SELF}.{req.get('id')}"
    env["SANDPOOL_EXEC"] = marker.split("=", 1)[1]
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=req.get("cwd") or None,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        msg = f"sandpool-agent: cannot start {argv[0]!r}: {exc.strerror}\n".encode()
        return {"exit_code": 127, "stdout": "", "stderr": base64.b64encode(msg).decode(),
                "stdout_truncated": False, "stderr_truncated": False, "timed_out": False,
                "duration_s": time.monotonic() - t0}
    out, err = _Capture(proc.stdout, cap), _Capture(proc.stderr, cap)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc, marker)
        proc.wait()
    # A background child the command left running (a server, `sleep &`) may hold the pipes
    # open: return what was captured instead of waiting for it. In-place reset kills it later.
    deadline = time.monotonic() + (1.0 if timed_out else 0.2)
    for c in (out, err):
        c.thread.join(timeout=max(0.0, deadline - time.monotonic()))
    rc = proc.returncode
    if timed_out:
        rc = 124
    elif rc < 0:
        rc = 128 - rc
    out, out_trunc = out.snapshot()
    err, err_trunc = err.snapshot()
    return {
        "exit_code": rc,
        "stdout": base64.b64encode(out).decode(),
        "stderr": base64.b64encode(err).decode(),
        "stdout_truncated": out_trunc,
        "stderr_truncated": err_trunc,
        "timed_out": timed_out,
        "duration_s": time.monotonic() - t0,
    }


def _read_file(req):
    try:
        with open(req["path"], "rb") as f:
            return {"data": base64.b64encode(f.read()).decode()}
    except FileNotFoundError:
        return {"error": "not_found"}
    except IsADirectoryError:
        return {"error": "is_a_directory"}


def _write_file(req):
    path = req["path"]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(req["data"]))
    os.chmod(path, int(req.get("mode") or 0o644))
    return {}


def _others():
    """Pids in this pid namespace other than the init (1), the agent and its helper threads."""
    mine = {1, _SELF, os.getppid()}
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in mine:
            out.append(int(name))
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _ps(_req):
    procs = []
    for pid in _others():
        line = _cmdline(pid)
        if line:  # zombies and vanished pids have no cmdline
            procs.append(line)
    return {"procs": procs}


def _kill_strays(_req):
    killed = 0
    for _ in range(3):  # processes may fork while we kill; a few sweeps settle it
        pids = _others()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.01)
    return {"killed": killed}


_OPS = {"exec": _exec, "read_file": _read_file, "write_file": _write_file, "ps": _ps,
        "kill_strays": _kill_strays}


def _serve(req):
    rid = req.get("id")
    try:
        body = _OPS[req["op"]](req)
    except Exception as exc:  # report every failure to the host; the agent stays up
        body = {"error": "agent_exception", "message": f"{type(exc).__name__}: {exc}"}
    body["id"] = rid
    _send(body)


def main():
    # Reap re-parented zombies is pid 1's job (bubblewrap's init); we only serve requests.
    _send({"id": 0, "ready": True, "pid": _SELF})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError:
            _send({"id": None, "error": "bad_request"})
            continue
        threading.Thread(target=_serve, args=(req,), daemon=True).start()


if __name__ == "__main__":
    main()
