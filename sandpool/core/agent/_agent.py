"""The command agent that runs inside every local sandbox (stdlib only).

It is the sandbox's long-lived process: a warm sandbox is this agent waiting on stdin, so an
exec never pays for a sandbox start. Protocol: one JSON object per line on stdin (a request)
and one per line on stdout (a response with the same ``id``). Requests are served on threads,
so a slow command does not block others.

Why one file: it is copied into every sandbox (and run in every pod) as a single
stdlib script, with no package to import from; the local and Kubernetes backends share it.

Ops:
    exec        {cmd: str|list, timeout: s, cwd, env, max_output: bytes}
                -> {exit_code, stdout(b64), stderr(b64), stdout_truncated, stderr_truncated,
                    timed_out, duration_s}
    read_file   {path, max_bytes?} -> {data(b64)} | {error: "os_error", errno, strerror}; a path
                that is not a regular file (a FIFO, a device) is EINVAL, never a read that
                blocks; one over ``max_bytes`` (default :data:`_READ_MAX`) is EFBIG, never an
                answer over the host's frame or the agent's memory
    write_file  {path, data(b64), mode} -> {} | {error: "os_error", errno, strerror}
    ps          {} -> {procs: [cmdline, ...]} (everything but the agent and pid 1)
    kill_strays {} -> {killed: n}
    restore     {root, image, changes: [[path, "replace"|"meta"], ...],
                 pinned: {path: {data(b64), mode, mtime_ns, atime_ns}}}
                -> {failed: [msg, ...], errnos}
                make each repo-relative path under ``root`` what it is under ``image`` (the
                image's repo, bind-mounted read-only): ``replace`` removes the path and copies
                the image's (type, bytes or target, mode, atime and mtime, user xattrs);
                ``meta`` sets a directory's own mode, times and xattrs; a ``pinned`` path is
                written from the bytes given instead of the image's. Every path to replace is
                removed before anything is copied; trees of any depth (iterative, names
                relative to an open directory). The host computed the list from the overlay's upper layer and
                verifies the result; this op only does the work (``errnos``: each failure's).
    writable    {skip: [abs, ...], times?: {path: [atime_ns, mtime_ns]}}
                -> {entries: {path: desc}, times: {path: [atime_ns, mtime_ns] | status},
                    root_writable, over, own}
                every path on a writable mount (``/proc/self/mountinfo``) but those at or
                below ``skip`` and on :data:`_KERNEL_FS`, described by type, mode, owner,
                size, sha256 of the bytes (read without moving their atime where it may),
                link target, device and extended attributes; a mount point below one is
                described ("m " first), not entered. ``times``: each path's after the path
                given one in the request was set back to it (a status instead, as
                :func:`_set_times` says, where it could not be). ``root_writable``: ``/``
                itself is writable (nothing is walked); ``over``: past :data:`_WRITABLE_MAX`
                entries or bytes hashed (the listing stops there); ``own``: the agent's
                own scheduling, affinity, OOM score and core dump filter (:func:`_own_state`)
    meta        {root, skip?: [rel, ...], restore?: {rel: meta}} -> {meta: {rel: meta | error}}
                every path under ``root`` ("." and "./<path>", as ``find .``), meta = {t:
                [atime_ns, mtime_ns], o: [uid, gid], x: {name: b64}}, after those given were
                set back (owner, xattrs, then times; ``t`` a status where the times could not
                be, as for ``writable``); see :func:`_meta`
    seccomp     {program(b64)} -> {}: set no_new_privs and install ``program`` (classic BPF,
                :mod:`sandpool.core.agent.seccomp`'s) on the agent's main thread, so every
                thread and process it starts afterwards runs under it (served on the main
                thread; sent by the host before any command, where no one else installs it)
    service     {argv, env, cwd, log?} -> {pid}: start a long-lived service process (its own
                session, in the work cgroup, output to ``log``, else to the agent's stderr)
                that ``ps`` and ``kill_strays`` leave alone
    scratch     {paths: [abs, ...], restore?: {path: meta}}
                -> {meta: {path: meta | {error}}, left: {path: [name, ...]}}
                a directory's own metadata, meta = {mode, uid, gid, atime_ns, mtime_ns,
                xattrs: {name: b64}} (every extended attribute it lists, POSIX ACLs
                included); with ``restore``, first empty each directory (any depth) and
                make its metadata that (extra xattrs removed, the rest written, then mode,
                then times; the owner cannot change without privileges and is only read; a
                directory the agent does not own gets its times refreshed to now, reported
                as "refreshed", or if it cannot write it either, "unwritable"); ``left``:
                entries still in it

Any op may answer ``{error: "exhausted", message, refused?, tasks?, agent_tasks?}``: the
kernel refused the agent a thread (the sandbox's pid budget is spent). Where the agent can
read its own cgroup's pid controller (a container's ``/sys/fs/cgroup``), it adds what the
kernel counted: ``refused`` (the controller's count of refused forks in its group moved
across the failed start: the group's pid limit refused it, not the machine's), ``tasks``
(the group's tasks) and ``agent_tasks`` (its own threads); the host says whose it was.
``ps``, ``kill_strays``, ``read_file``, ``write_file``, ``restore``, ``scratch``,
``writable`` and ``meta`` need no thread of their own: refused one, they are served on the main thread
(nothing else is read meanwhile), so a sandbox whose processes hold every pid can still be
emptied and reset.
"""

import base64
import errno
import fcntl
import hashlib
import json
import os
import re
import select
import signal
import stat
import subprocess
import sys
import termios
import threading
import time

_out_lock = threading.Lock()
_SELF = os.getpid()
_SERVICES = {}  # pid -> Popen of the service processes (spared by ps and kill_strays)


def _send(obj):
    line = json.dumps(obj, separators=(",", ":")) + "\n"
    with _out_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class _Capture:
    """Drains one pipe on a thread, keeping at most ``cap`` bytes (the rest is counted as cut).

    Draining to EOF means a chatty child never blocks on a full pipe. The thread reads only
    while it holds ``_lock``, so once the command has exited :meth:`finish` takes what the
    pipe still holds itself: whether the thread has been scheduled since does not matter (on
    a loaded node a starved thread would otherwise lose a finished command's output).
    """

    def __init__(self, stream, cap):
        self.buf = bytearray()
        self.truncated = False
        self._stream, self._cap = stream, cap  # the stream object keeps the fd open
        self._fd = stream.fileno()
        os.set_blocking(self._fd, False)
        self._lock = threading.Lock()
        self._eof = False
        self.thread = _thread(self._run)

    def _take(self, limit):
        """Read up to ``limit`` bytes the pipe holds now (the caller holds the lock)."""
        while limit > 0 and not self._eof:
            try:
                chunk = os.read(self._fd, min(limit, 65536))
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._eof = True
                return
            limit -= len(chunk)
            room = self._cap - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            if len(chunk) > max(room, 0):
                self.truncated = True

    def _run(self):
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        while not self._eof:
            poll.poll()
            with self._lock:  # held briefly: a background child writing without end
                self._take(1 << 20)  # cannot keep finish() waiting

    def finish(self):
        """The command has exited: take the rest of its output; return (bytes, truncated).

        What the pipe holds now is everything the command wrote that the thread has not
        read. A background child it left running (a server, ``sleep &``) may keep the pipe
        open and write more later; that is not waited for (in-place reset kills it).
        """
        with self._lock:
            pending = bytearray(4)
            try:
                fcntl.ioctl(self._fd, termios.FIONREAD, pending)
                self._take(int.from_bytes(pending, sys.byteorder))
            except OSError:  # the pipe is gone: what was read is all there is
                pass
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


def _start_time(pid):
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().decode("utf-8", "replace").rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


_running = {}  # exec id -> (pid, marker) of every command still running
_running_lock = threading.Lock()
# As the sandbox's pid 1 the agent adopts every orphan and must reap it, but never one of its
# own commands, whose exit status its exec waits for: spawning and reaping take this lock.
_spawn_lock = threading.Lock()
_spawned = set()


def _late_orphans(start, own, older):
    """Processes of this sandbox (its pid namespace) started after ``start`` that belong to no
    other running command: what a command left behind by double-forking out of its group and
    clearing its environment (``env -i setsid``), so neither its group nor its marker finds it.
    A process that a concurrent command's escapee started is caught too (its owner cannot be
    told apart); processes older than the command are never touched: ``older`` holds the pids
    there were before it started, since start times only have clock-tick resolution (a
    ``sleep &`` of the previous command can share the command's tick)."""
    with _running_lock:
        others = [v for k, v in _running.items() if k != own]
    keep = set()
    for pid, marker in others:
        keep.add(pid)
        keep.update(_descendants(pid))
        keep.update(_tagged(marker))
    out = []
    for pid in _others():
        t = _start_time(pid)
        if t is not None and pid not in keep and (t > start or (t == start and pid not in older)):
            out.append(pid)
    return out


def _kill_tree(proc, marker, start, own, older):
    # The process group first (the documented contract); then descendants that called setsid()
    # to leave it; then processes carrying the exec's marker; then anything in the sandbox
    # started since the command began that no other command owns (an escapee with no marker).
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 2.0
    while True:
        pids = set(_descendants(proc.pid)) | set(_tagged(marker))
        if start is not None:
            pids |= set(_late_orphans(start, own, older))
        pids = {p for p in pids - {_SELF, 1} if not _zombie(p)}  # a zombie is dead already
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


def _zombie(pid):
    """Whether ``pid`` is dead: gone, or a zombie none of whose threads runs. A leader that
    exited alone (``SYS_exit``, not ``exit_group``) is "Z" in its own ``stat``, with no
    ``cmdline`` or ``environ``, while its other threads run on: alive, to be killed."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True  # gone
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                    return False
        except (OSError, IndexError):
            continue  # that thread is gone
    return True


#: The work cgroup's ``cgroup.procs`` files, opened by the host and inherited (see _take_work_fds).
_WORK_FDS = ()
#: Held at this pipe until the agent has moved it, the command then replaces the shell.
_HELD = 'read -r go && [ "$go" = go ] || exit 125; exec "$@" </dev/null'


def _take_work_fds():
    """Take the descriptors of the work cgroup's ``cgroup.procs`` files that the host opened
    and passed in (``SANDPOOL_WORK_CGROUP_FDS``), keeping them from every child.

    Only the agent can move a process between cgroups: no such file is visible in the
    sandbox, and these descriptors (opened by the host, so the kernel's permission check is
    the host's) never reach a command. The policy's processes, which run as the agent's uid,
    cannot move the agent into their own budget, where their OOM kill or pid limit would
    take it down without evidence in its group.
    """
    global _WORK_FDS
    names = os.environ.pop("SANDPOOL_WORK_CGROUP_FDS", "").split()
    fds = tuple(int(n) for n in names)
    for fd in fds:
        os.set_inheritable(fd, False)
    _WORK_FDS = fds


def _cpu_confined():
    """True when the agent shares a CPU quota of its own group with its commands and no work
    group takes them (a container's ``/sys/fs/cgroup``: v1 ``cpu.cfs_quota_us``, v2 ``cpu.max``).
    A kwok pod or a local sandbox sees no such quota (the host's root group, or no view)."""
    for path in ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max"):
        try:
            with open(path) as f:
                quota = f.read().split()[0]
        except (OSError, IndexError):
            continue
        return quota not in ("-1", "max")
    return False


def _take_idle():
    """Whether commands run under ``SCHED_IDLE``: where they share the agent's CPU quota, so
    that however many processes the policy keeps busy, the agent gets the CPU when it has an
    answer to give (an unprivileged process cannot leave ``SCHED_IDLE``). Where a work group
    takes the commands, its ``cpu.shares`` does this instead."""
    global _IDLE_COMMANDS
    _IDLE_COMMANDS = (not _WORK_FDS and hasattr(os, "SCHED_IDLE") and _cpu_confined())


_IDLE_COMMANDS = False


def _popen(argv, **kwargs):
    """Start ``argv`` as a command, in the work cgroup (the policy's pid, memory and CPU budget)
    before it runs, so everything it forks is counted there and never against the agent's
    own budget: the child waits at a pipe until the agent has written its pid into each
    work ``cgroup.procs`` (or, with no work group but a CPU quota shared with the agent, has
    set it ``SCHED_IDLE``, see :func:`_take_idle`). ``stdin`` is ``/dev/null``. Raises OSError
    when it cannot be started or moved (the child is then killed)."""
    if not _WORK_FDS and not _IDLE_COMMANDS:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kwargs)
    proc = subprocess.Popen(["/bin/sh", "-c", _HELD, "sh", *argv], stdin=subprocess.PIPE, **kwargs)
    try:
        if _IDLE_COMMANDS:
            os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
        for fd in _WORK_FDS:
            os.write(fd, b"%d" % proc.pid)
        proc.stdin.write(b"go\n")
        proc.stdin.close()
    except OSError as exc:
        proc.kill()
        proc.wait()
        why = "cannot move it into the sandbox's work cgroup: %s" % exc.strerror
        raise _NotMoved(exc.errno, why) from None
    return proc


class _NotMoved(OSError):
    """A command could not join the work cgroup (exit status 125, as a wrapper's refusal)."""


def _exec(req):
    cmd = req["cmd"]
    argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    timeout = float(req.get("timeout") or 60.0)
    cap = int(req.get("max_output") or (1 << 20))
    env = dict(os.environ)
    env.update(req.get("env") or {})
    marker = f"SANDPOOL_EXEC={_SELF}.{req.get('id')}"
    env["SANDPOOL_EXEC"] = marker.split("=", 1)[1]
    if req.get("cwd"):  # the agent's own PWD would name its directory, not the command's
        env["PWD"] = req["cwd"]
    t0 = time.monotonic()
    rid = req.get("id")
    older = set(_others())
    try:
        with _spawn_lock:
            proc = _popen(
                argv,
                cwd=req.get("cwd") or None,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            _spawned.add(proc.pid)
    except (OSError, ValueError, TypeError) as exc:
        # A missing program (127), or an argument no program can receive, such as one with a
        # NUL byte (126): the caller's command is at fault, so it gets a result, not an error.
        code, why = (127, exc.strerror) if isinstance(exc, OSError) else (126, str(exc))
        code = 125 if isinstance(exc, _NotMoved) else code
        if isinstance(exc, ValueError) and "null" in why:
            why = "an argument, cwd or environment entry contains a NUL byte"
        name = argv[0] if argv else ""
        msg = f"sandpool-agent: cannot start {name!r}: {why}\n".encode("utf-8", "surrogateescape")
        return {"exit_code": code, "stdout": "", "stderr": base64.b64encode(msg).decode(),
                "stdout_truncated": False, "stderr_truncated": False, "timed_out": False,
                "duration_s": time.monotonic() - t0}
    start = _start_time(proc.pid)
    with _running_lock:
        _running[rid] = (proc.pid, marker)
    out, err = _Capture(proc.stdout, cap), _Capture(proc.stderr, cap)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc, marker, start, rid, older)
        proc.wait()
    finally:
        with _running_lock:
            _running.pop(rid, None)
        with _spawn_lock:
            _spawned.discard(proc.pid)  # waited for: the reaper may have any later holder
    rc = proc.returncode
    if timed_out:
        rc = 124
    elif rc < 0:
        rc = 128 - rc
    out, out_trunc = out.finish()
    err, err_trunc = err.finish()
    return {
        "exit_code": rc,
        "stdout": base64.b64encode(out).decode(),
        "stderr": base64.b64encode(err).decode(),
        "stdout_truncated": out_trunc,
        "stderr_truncated": err_trunc,
        "timed_out": timed_out,
        "duration_s": time.monotonic() - t0,
    }


def _os_error(exc):
    # The policy's path or the state it left (EACCES, EROFS, EISDIR, ENOENT, ENOSPC, ...): a
    # result the host hands to the policy, not a failure of the agent.
    return {"error": "os_error", "errno": exc.errno or 0, "strerror": exc.strerror or str(exc)}


#: Bytes ``read_file`` returns at most (unless the request says): the policy sizes the file, so
#: a larger one is its result (EFBIG), never an answer past the host's frame cap (base64 adds a
#: third) or the agent's memory margin, which would end the channel as an infra failure.
_READ_MAX = 32 << 20


def _read_file(req):
    limit = int(req.get("max_bytes") or _READ_MAX)
    try:
        # Regular files only, opened without blocking: a FIFO the policy put at the path would
        # hold the read (and the caller, until its wait ends as an infra error) forever.
        fd = os.open(req["path"], os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "Invalid argument: not a regular file")
            # The size first (a sparse file costs the policy nothing); then at most one byte
            # past the limit, as a file may grow, or say 0 and hold more (/proc's).
            data = f.read(limit + 1) if st.st_size <= limit else b""
            if st.st_size > limit or len(data) > limit:
                raise OSError(errno.EFBIG, f"File too large: over the {limit} bytes a read may return")
            return {"data": base64.b64encode(data).decode()}
    except OSError as exc:
        return _os_error(exc)
    except ValueError:  # a NUL byte in the path: no file can have that name
        return _os_error(OSError(22, "Invalid argument: the path contains a NUL byte"))


def _write_file(req):
    path = req["path"]
    try:
        parent = os.path.dirname(path) or "."
        if os.path.lexists(parent) and not os.path.isdir(parent):  # makedirs would say EEXIST
            raise NotADirectoryError(20, "Not a directory", parent)
        os.makedirs(parent, exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(req["data"]))
        os.chmod(path, int(req.get("mode") or 0o644))
    except OSError as exc:
        return _os_error(exc)
    except ValueError:  # a NUL byte in the path
        return _os_error(OSError(22, "Invalid argument: the path contains a NUL byte"))
    return {}


def _others():
    """Pids in this pid namespace other than the init (1), the agent and its helper threads."""
    mine = {1, _SELF, os.getppid(), *_SERVICES}
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
        if not _zombie(pid):  # a live process may have no cmdline (its leader exited alone)
            procs.append(_cmdline(pid) or f"[pid {pid}, no cmdline]")
    return {"procs": procs}


def _kill_strays(_req):
    killed = set()  # (pid, start time): a process still dying is killed again, counted once
    deadline = time.monotonic() + 5.0
    # Processes may fork while we kill (a fork bomb refills every freed pid): sweep until
    # none is left. Each sweep kills faster than a bomb at its pid limit can fork.
    while time.monotonic() < deadline:
        # A killed child of the agent stays a zombie until the reaper collects it: dead, and
        # not to be killed again.
        pids = [p for p in _others() if not _zombie(p)]
        if not pids:
            break
        for pid in pids:
            t = _start_time(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add((pid, t))
            except OSError:
                pass
        time.sleep(0.002)
    if _SELF == 1:
        _reap()  # the dead hold their pids until reaped: free them before the next request
    return {"killed": len(killed)}


def _copy_attrs(src, dst, st):
    # Order matters: xattrs and mode first, mtime last (setting xattrs does not touch it).
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError:
        names = []
    for n in names:
        if n.startswith("user."):
            os.setxattr(dst, n, os.getxattr(src, n, follow_symlinks=False), follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _strip_xattrs(path):
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return
    for n in names:
        if n.startswith("user."):
            os.removexattr(path, n, follow_symlinks=False)


def _remove(path):
    """Remove ``path`` and everything below it, without following symlinks, whatever its modes
    and however deep: iteratively, one directory open at a time and every name relative to
    it, so neither the recursion limit nor PATH_MAX bounds the tree a rollout can leave (its
    processes are gone: nothing moves the tree meanwhile, and ``..`` leads back up)."""
    parent, name = os.path.split(path)
    try:
        pfd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.lstat(name, dir_fd=pfd)
        except FileNotFoundError:
            return
        if not os.stat(pfd).st_mode & stat.S_IWUSR:  # a rollout may have made it read-only
            os.chmod(pfd, stat.S_IMODE(os.stat(pfd).st_mode) | 0o700)  # its attrs are restored later
        if stat.S_ISDIR(st.st_mode):
            _remove_tree(pfd, name)
        else:
            os.unlink(name, dir_fd=pfd)
    finally:
        os.close(pfd)


def _open_dir(pfd, name):
    os.chmod(name, 0o700, dir_fd=pfd)  # a rollout may have left it unreadable or unwritable
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)


def _remove_tree(top_pfd, top):
    names = [top]  # the directories from ``top`` down to the one open
    fd = _open_dir(top_pfd, top)
    try:
        while True:
            sub = None
            with os.scandir(fd) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        sub = e.name
                        break
                    os.unlink(e.name, dir_fd=fd)
            if sub is not None:  # down into the first subdirectory left
                child = _open_dir(fd, sub)
                os.close(fd)
                fd = child
                names.append(sub)
                continue
            empty = names.pop()
            if not names:
                os.rmdir(empty, dir_fd=top_pfd)
                return
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = up
            os.rmdir(empty, dir_fd=fd)
    finally:
        if fd >= 0:
            os.close(fd)
            fd = -1


def _copy(src, dst):
    """Copy the image's ``src`` to ``dst`` (type, bytes or target, mode, mtime, user xattrs),
    iteratively; a directory's attributes are set after everything inside it."""
    todo = [(src, dst, False)]
    while todo:
        s, d, done = todo.pop()
        st = os.lstat(s)
        if done:  # every entry of this directory is in place: now its own attributes
            _copy_attrs(s, d, st)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(d, 0o700)
            todo.append((s, d, True))
            todo.extend((os.path.join(s, n), os.path.join(d, n), False) for n in os.listdir(s))
        else:
            _copy_leaf(s, d, st)
            _copy_attrs(s, d, st)


def _copy_leaf(src, dst, st):
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                while os.sendfile(fo, fi, None, 1 << 24):
                    pass
            finally:
                os.close(fo)
        finally:
            os.close(fi)
    elif stat.S_ISFIFO(st.st_mode):
        os.mkfifo(dst, 0o600)
    else:
        raise OSError(errno.EINVAL, f"cannot copy {src}: unsupported file type")


def _restore(req):
    root, image, pinned = req["root"], req["image"], req.get("pinned") or {}
    failed, errnos, dirs = [], [], set()

    def fail(rel, exc):
        failed.append(f"{rel or '.'}: {exc}")
        errnos.append(exc.errno or 0)

    # Everything to replace goes first, then the image's copies come back: what the rollout
    # left frees its space before anything is written (a disk it filled inside the restored
    # paths never stops the restore).
    for rel, kind in req["changes"]:
        if kind == "replace":
            try:
                _remove(os.path.join(root, rel) if rel else root)
            except OSError as exc:
                fail(rel, exc)
    for rel, kind in req["changes"]:
        dst = os.path.join(root, rel) if rel else root
        src = os.path.join(image, rel) if rel else image
        try:
            if kind == "replace" and rel in pinned:
                pin = pinned[rel]
                fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(base64.b64decode(pin["data"]))
                os.chmod(dst, pin["mode"])
                os.utime(dst, ns=(pin.get("atime_ns", pin["mtime_ns"]), pin["mtime_ns"]),
                         follow_symlinks=False)
            elif kind == "replace":
                if os.path.lexists(src):
                    _copy(src, dst)
            else:
                dirs.add(rel)
            if rel:
                dirs.add(os.path.dirname(rel))  # removing and creating entries moved its mtime
        except OSError as exc:
            fail(rel, exc)
    # Deepest first: fixing a directory's mtime must come after every change inside it.
    for rel in sorted(dirs, key=lambda r: (r.count("/") + bool(r)), reverse=True):
        dst = os.path.join(root, rel) if rel else root
        src = os.path.join(image, rel) if rel else image
        try:
            st = os.lstat(src)
            if stat.S_ISDIR(st.st_mode) and stat.S_ISDIR(os.lstat(dst).st_mode):
                _strip_xattrs(dst)
                _copy_attrs(src, dst, st)
        except OSError as exc:
            fail(rel, exc)
    return {"failed": failed, "errnos": errnos}


#: Entries, and bytes hashed, past which ``writable`` stops (a pod's runtime mounts hold few).
_WRITABLE_MAX = (20000, 64 << 20)
#: Kernel file systems ``writable`` leaves out: read-only in a container (sysfs, cgroup), or
#: holding only what dies with its processes (proc) or what the reset empties (mqueue).
_KERNEL_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "mqueue"})


def _unescape(field):
    # mountinfo writes a space, tab, newline and backslash of a path as \040, \011, \012, \134.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _open_noatime(path, flags):
    # O_NOATIME (the owner's or CAP_FOWNER's): reading does not move what the listing records.
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_NOATIME)
    except PermissionError:
        return os.open(path, flags | os.O_NOFOLLOW)


def _describe(path, st, budget):
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "l " + os.readlink(path)
    head = "%s %o %d %d" % ("d" if stat.S_ISDIR(st.st_mode) else "f" if stat.S_ISREG(st.st_mode)
                            else "o", mode, st.st_uid, st.st_gid)
    if stat.S_ISREG(st.st_mode):
        digest = hashlib.sha256()
        budget[1] -= st.st_size
        try:
            if budget[1] >= 0:
                with os.fdopen(_open_noatime(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        digest.update(chunk)
        except OSError as exc:  # compared as such (a mode the agent cannot read)
            head += " unread:%d" % exc.errno
        head += " %d %s" % (st.st_size, digest.hexdigest())
    elif not stat.S_ISDIR(st.st_mode):
        head += " %x %x" % (stat.S_IFMT(st.st_mode), st.st_rdev)
    try:
        names = sorted(os.listxattr(path, follow_symlinks=False))
    except OSError:
        names = []
    for n in names:
        try:
            value = os.getxattr(path, n, follow_symlinks=False)
        except OSError:
            value = b"?"
        head += " %s=%s" % (n, hashlib.sha256(value).hexdigest()[:16])
    return head


def _set_times(path, want):
    """Make ``path``'s (atime_ns, mtime_ns) ``want``, as :func:`_set_dir_meta` does a
    directory's: "set"; "refreshed" (not its owner: moved to now); "unwritable" (not even
    that, or a read-only mount: the policy, of the agent's uid, could not move them either)."""
    try:
        os.utime(path, ns=(want[0], want[1]), follow_symlinks=False)
        return "set"
    except PermissionError:
        try:
            os.utime(path, follow_symlinks=False)
            return "refreshed"
        except OSError:
            return "unwritable"
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return "unwritable"
        raise


#: ``ioprio_get``'s number where the agent knows it (no Python binding exists).
_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}


def _ioprio(tid):
    """A thread's I/O priority (``ioprio_get(IOPRIO_WHO_PROCESS, tid)``), or None."""
    nr = _IOPRIO_GET.get(os.uname().machine)
    if nr is None:
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(nr, 1, int(tid))


def _own_state():
    """The agent's own state a process of its uid may set, most of which it cannot set back
    without CAP_SYS_NICE: each thread's scheduling policy, real-time priority, nice, CPU
    affinity (``/proc/self/task``) and I/O priority, its OOM score adjustment and core dump
    filter."""
    threads = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/stat" % tid, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # fields[0] is field 3
            with open("/proc/self/task/%s/status" % tid) as f:
                cpus = [ln.split()[1] for ln in f if ln.startswith("Cpus_allowed_list:")]
        except OSError:
            continue  # a request's thread that ended
        threads.add("policy=%s rt=%s nice=%s cpus=%s io=%s" % (
            fields[38].decode(), fields[37].decode(), fields[16].decode(), cpus, _ioprio(tid)))
    out = sorted(threads)
    for name in ("oom_score_adj", "coredump_filter"):
        try:
            with open("/proc/self/" + name) as f:
                out.append("%s=%s" % (name, f.read().strip()))
        except OSError as exc:
            out.append("%s: %s" % (name, exc.strerror))
    return out


def _writable(req):
    skip = [s.rstrip("/") or "/" for s in req.get("skip") or []]
    restore = req.get("times") or {}

    def skipped(p):
        return any(p == s or p.startswith(s + "/") for s in skip)

    tops = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields = pre.split()
            point, opts, fstype = _unescape(fields[4]), fields[5].split(","), post.split()[0]
            if "rw" not in opts or fstype in _KERNEL_FS or skipped(point):
                continue
            if point == "/":
                return {"entries": {}, "times": {}, "root_writable": True, "over": False}
            if point != "/proc" and not point.startswith("/proc/"):  # /dev/null over masked files
                tops.append(point)
    entries, budget = {}, [_WRITABLE_MAX[0], _WRITABLE_MAX[1]]
    for top in sorted(set(tops)):  # a mount's own walk comes after its parent's "m"
        todo = [(top, None)]
        while todo:
            path, dev = todo.pop()
            try:
                st = os.lstat(path)
            except OSError:
                continue
            budget[0] -= 1
            if budget[0] < 0 or budget[1] < 0:
                return {"entries": entries, "times": {}, "root_writable": False, "over": True}
            if dev is not None and st.st_dev != dev:  # a mount point: described, not entered
                entries[path] = "m " + _describe(path, st, budget)
                continue
            entries[path] = _describe(path, st, budget)
            if stat.S_ISDIR(st.st_mode):
                try:
                    names = _listdir_noatime(path)
                except OSError as exc:  # compared as such (a mode the agent cannot read)
                    entries[path] += " unlisted:%d" % exc.errno
                    names = []
                for name in names:
                    child = os.path.join(path, name)
                    if not skipped(child):
                        todo.append((child, st.st_dev))
    times = {}
    for path in entries:  # times last: the walk and the removals before it moved some
        done = "set"
        want = restore.get(path)
        try:
            st = os.lstat(path)
            if want is not None and [st.st_atime_ns, st.st_mtime_ns] != want:
                done = _set_times(path, want)
                st = os.lstat(path)
        except OSError as exc:
            times[path] = "error: %s" % exc
            continue
        times[path] = [st.st_atime_ns, st.st_mtime_ns] if done == "set" else done
    return {"entries": entries, "times": times, "root_writable": False, "over": budget[1] < 0,
            "own": _own_state()}


def _listdir_noatime(path):
    fd = _open_noatime(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _path_meta(path):
    st = os.lstat(path)
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:  # a file system without xattrs: none
        names = []
    xattrs = {}
    for n in names:
        try:
            xattrs[n] = base64.b64encode(os.getxattr(path, n, follow_symlinks=False)).decode()
        except OSError:
            xattrs[n] = None
    return {"t": [st.st_atime_ns, st.st_mtime_ns], "o": [st.st_uid, st.st_gid], "x": xattrs}


def _set_path_meta(path, now, want):
    """Make ``path``'s owner, then extended attributes, then times ``want``'s, changing only
    what differs; returns how its times were set (:func:`_set_times`). A failed owner or
    attribute change is left for the caller's compare to find."""
    if now["o"] != want["o"]:
        try:
            os.chown(path, want["o"][0], want["o"][1], follow_symlinks=False)
            now = _path_meta(path)  # a chown drops file capabilities
        except OSError:
            pass
    for n in now["x"]:
        if n not in want["x"]:
            try:
                os.removexattr(path, n, follow_symlinks=False)
            except OSError:
                pass
    for n, v in want["x"].items():
        if v is not None and now["x"].get(n) != v:
            try:
                os.setxattr(path, n, base64.b64decode(v), follow_symlinks=False)
            except OSError:
                pass
    return _set_times(path, want["t"]) if now["t"] != want["t"] else "set"


def _meta(req):
    """Every path under ``root`` (itself ".", the rest "./<relative>", as ``find .`` names
    them) but those in ``skip``, with its times, owner and extended attributes after those in
    ``restore`` were set back (:func:`_set_path_meta`; a times status replaces the pair where
    they could not be); lstat only, a directory listed before its own times are set, so
    nothing but a set moves one. Iterative: any depth."""
    root = req["root"]
    skip = frozenset(req.get("skip") or ())
    restore = req.get("restore") or {}
    out, todo = {}, ["."]
    while todo:
        rel = todo.pop()
        path = root if rel == "." else os.path.join(root, rel[2:])
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                for name in _listdir_noatime(path):
                    child = ("./" if rel == "." else rel + "/") + name
                    if child not in skip:
                        todo.append(child)
            now = _path_meta(path)
            done = "set"
            if rel in restore and now != restore[rel]:
                done = _set_path_meta(path, now, restore[rel])
                now = _path_meta(path)
        except OSError as exc:
            out[rel] = "error: %s" % exc
            continue
        if done != "set":
            now["t"] = done
        out[rel] = now
    return {"meta": out}


def _seccomp(req):
    import ctypes

    prog = base64.b64decode(req["program"])

    class Fprog(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = Fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_NO_NEW_PRIVS (needed without CAP_SYS_ADMIN), then PR_SET_SECCOMP, MODE_FILTER.
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return {}


def _service(req):
    env = dict(os.environ)
    env.update(req.get("env") or {})
    # Without a log, the output goes to the agent's own stderr (the host's file, not the sandbox's).
    log = open(req["log"], "ab") if req.get("log") else None
    try:
        proc = _popen(req["argv"], cwd=req.get("cwd") or None, env=env,
                      stdout=log or sys.stderr.fileno(), stderr=subprocess.STDOUT,
                      start_new_session=True)
    finally:
        if log is not None:
            log.close()
    _SERVICES[proc.pid] = proc
    return {"pid": proc.pid}


def _dir_meta(fd):
    st = os.fstat(fd)
    try:
        names = os.listxattr(fd)
    except OSError:  # a filesystem without xattrs (mqueue): none
        names = []
    xattrs = {}
    for n in names:
        try:
            xattrs[n] = base64.b64encode(os.getxattr(fd, n)).decode()
        except OSError:
            xattrs[n] = None
    return {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
            "atime_ns": st.st_atime_ns, "mtime_ns": st.st_mtime_ns, "xattrs": xattrs}


def _set_dir_meta(fd, meta):
    """Make the directory's metadata ``meta``, changing only what differs: what a directory of
    another owner has (a root-owned ``/tmp`` of a non-root image) the policy could not change
    either. Returns how its times were restored: "set"; "refreshed" (not its owner: moved to
    now, so no moment the policy chose survives); "unwritable" (not its owner and not
    writable: the policy, of the agent's uid, could not move them but by reading it)."""
    now = _dir_meta(fd)
    want = {n: base64.b64decode(v) for n, v in meta["xattrs"].items() if v is not None}
    for n in now["xattrs"]:
        if n not in want:
            os.removexattr(fd, n)
    for n, v in want.items():
        if now["xattrs"].get(n) != meta["xattrs"][n]:
            os.setxattr(fd, n, v)
    if now["mode"] != meta["mode"]:
        os.chmod(fd, meta["mode"])  # after the ACL, which would rewrite the group bits
    if os.fstat(fd).st_uid == os.geteuid():
        os.utime(fd, ns=(meta["atime_ns"], meta["mtime_ns"]))
        return "set"
    name = f".sandpool-refresh-{os.getpid()}-{threading.get_ident()}"
    # An entry made and removed (a file: mqueue's directory takes no mkdir) moves mtime and
    # ctime to now; reading the directory after moves atime.
    try:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=fd))
    except PermissionError:
        return "unwritable"
    os.unlink(name, dir_fd=fd)
    os.listdir(fd)
    return "refreshed"


def _scratch(req):
    out, left = {}, {}
    restore = req.get("restore") or {}
    for path in req["paths"]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            out[path] = {"error": str(exc)}
            continue
        try:
            times = "set"
            if path in restore:
                for name in os.listdir(fd):
                    try:
                        _remove(os.path.join(path, name))
                    except OSError:
                        pass  # listed in ``left``
            left[path] = sorted(os.listdir(fd))[:5]  # before the times: a listing moves atime
            if path in restore:
                times = _set_dir_meta(fd, restore[path])
            out[path] = _dir_meta(fd)
            if times != "set":
                out[path].update(atime_ns=times, mtime_ns=times)
        except OSError as exc:
            out[path] = {"error": str(exc)}
        finally:
            os.close(fd)
    return {"meta": out, "left": left}


_OPS = {"exec": _exec, "read_file": _read_file, "write_file": _write_file, "ps": _ps,
        "kill_strays": _kill_strays, "restore": _restore, "service": _service, "scratch": _scratch,
        "seccomp": _seccomp, "writable": _writable, "meta": _meta}


#: Ops that start neither a thread nor a process: served on the main thread when refused one.
_INLINE = frozenset({"ps", "kill_strays", "read_file", "write_file", "restore", "scratch",
                     "writable", "meta"})


def _open_pid_events():
    # The pid controller of the agent's own group, as a container sees it (cgroup v1, then
    # v2): its directory and an open ``pids.events``; (None, None) where there is no such view
    # (a local sandbox, a kwok pod).
    for d in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        try:
            return d, os.open(d + "/pids.events", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
    return None, None


_PID_DIR, _PID_EVENTS = _open_pid_events()


def _refused_forks():
    """Forks the pid controller refused to the agent's group so far (its ``max`` event), or None."""
    if _PID_EVENTS is None:
        return None
    try:
        for line in os.pread(_PID_EVENTS, 256, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _group_tasks():
    try:
        with open(_PID_DIR + "/pids.current") as f:
            return int(f.read())
    except (OSError, TypeError, ValueError):
        return None


class _Exhausted(Exception):
    """The kernel refused the agent a thread: answered ``exhausted``, never a crash.

    ``refused``: whether the pid controller counted a refused fork in the agent's group across
    the failed start (None: it cannot be read)."""

    def __init__(self, message, refused):
        super().__init__(message)
        self.refused = refused

    def answer(self):
        body = {"error": "exhausted", "message": str(self)}
        if self.refused is not None:
            body.update(refused=self.refused, tasks=_group_tasks(),
                        agent_tasks=threading.active_count())
        return body


def _thread(target, *args):
    t = threading.Thread(target=target, args=args, daemon=True)
    before = _refused_forks()
    try:
        t.start()
    except RuntimeError as exc:  # "can't start new thread": no pid left in the sandbox's budget
        after = _refused_forks()
        raise _Exhausted(str(exc), None if before is None or after is None else after > before) from None
    return t


def _serve(req):
    rid = req.get("id")
    try:
        body = _OPS[req["op"]](req)
    except _Exhausted as exc:
        body = exc.answer()
    except Exception as exc:  # report every failure to the host; the agent stays up
        body = {"error": "agent_exception", "message": f"{type(exc).__name__}: {exc}"}
    body["id"] = rid
    _send(body)


def _reap():
    # Pid 1's duty: collect the dead orphans re-parented to the agent (a double fork's child,
    # what kill_strays killed), never one of its own commands (their exec waits for them).
    with _spawn_lock:
        for pid in _children_of().get(_SELF, []):
            if pid not in _spawned and _zombie(pid):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def _reap_orphans():
    while True:
        time.sleep(0.2)
        _reap()


def _protect():
    """Keep the policy's commands, which run as the agent's uid, away from its channel.

    The local backend starts the agent as the sandbox's pid 1 (bubblewrap ``--as-pid-1``), so
    no other process inside holds its pipes, and no signal from inside reaches it (an init
    only gets signals it handles: SIGINT is given back its default). Non-dumpable, its
    ``/proc/<pid>/fd``, ``mem`` and ptrace need CAP_SYS_PTRACE, which the commands lack:
    they cannot read its requests or write it answers (grading's included).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _SELF == 1:
        threading.Thread(target=_reap_orphans, name="reaper", daemon=True).start()


def main():
    _take_work_fds()
    _take_idle()
    try:
        _protect()
    except (ImportError, AttributeError, OSError) as exc:  # fail closed: no unprotected channel
        sys.stderr.write(f"sandpool-agent: cannot protect its channel (prctl): {exc}\n")
        sys.exit(70)
    _send({"id": 0, "ready": True, "pid": _SELF, "machine": os.uname().machine})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError:
            _send({"id": None, "error": "bad_request"})
            continue
        if isinstance(req, dict) and req.get("op") == "seccomp":
            _serve(req)  # on the main thread, which starts every later thread
            continue
        try:
            _thread(_serve, req)
        except _Exhausted as exc:
            if isinstance(req, dict) and req.get("op") in _INLINE:
                _serve(req)  # no thread needed: the sandbox can still be emptied and reset
            else:
                _send({"id": req.get("id") if isinstance(req, dict) else None, **exc.answer()})


if __name__ == "__main__":
    main()
