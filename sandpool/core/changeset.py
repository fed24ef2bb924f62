"""Snapshots as change sets: for sandboxes whose reset keeps a pristine record (pods).

A pod's filesystem cannot be read from the host, but the in-place reset keeps, in this process,
a record of the fresh repo (:func:`sandpool.core.pristine.pristine_record`: every path's type,
mode and link target, every file's sha256, and its ctime and size). A snapshot is the
*change set* against that record, produced in the pod by a stdlib script run through the
sandbox's agent:

* it stops every other process of the pod (SIGSTOP; its own ancestors, the agent, go on) so
  that nothing changes while it reads, and starts them again after; only in the pod's own
  pid namespace, under the agent as its pid 1 (never in the host's, whose init pid namespace
  has a fixed inode): elsewhere nothing is stopped, and a file that changed while it was
  read fails the snapshot (the host checks the archive against the lines);
* it walks the repo: a path the record lacks, or whose type, mode or target differs, is in
  the change set; a file whose ctime and size are the record's is unchanged (a write moves
  the ctime, which no process can set), any other file is hashed and is in it only when its
  sha256 differs; a recorded path that is gone is a deletion;
* ``/tmp`` (empty when the sandbox is pristine) is in it whole;
* a path it cannot read or name (a file its processes made unreadable to it, a tree deeper
  than PATH_MAX) cannot be carried: the snapshot is refused (``ConfigError``, as an
  oversized change set is), never an infra failure of a sound pod;
* it streams those entries as a tar archive in its answer, with one canonical line per entry
  (path, type, mode, sha256 or link target) and per deletion.

The host checks the archive holds what the lines say, splits it into archives of
:data:`CHUNK` bytes and keeps them in its run directory (the backend's snapshot store, on
the host that runs sandpool; removed when the backend closes); the snapshot's
``content_hash`` is the sha256 of the sorted lines. Cost: a ``stat`` per path of the repo,
plus the bytes changed; a change set over :data:`MAX_BYTES` (one answer of the agent) is
refused.

A restore (into a pristine sandbox of the same image) removes the deletions, then writes and
unpacks one archive at a time (each replaces the paths it holds), so the pod's disk quota
needs no room for the change set twice; the state hash (the same script, printing only the
lines) must then equal the snapshot's. Ownership and mtimes are not part of a pod's state
here (the record has neither), so a restored file has the restoring process's owner and a
new mtime.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import uuid
from pathlib import Path
from types import MappingProxyType

from sandpool.core import errors
from sandpool.core.agent.sandbox import AgentSandbox
from sandpool.core.pristine import Pristine, pristine_record
from sandpool.core.sandbox import ExecResult
from sandpool.core.snapshot import Snapshot

__all__ = ["CHUNK", "MAX_BYTES", "capture", "discard", "load", "remove_store", "state_hash"]

#: Bytes of a change set's archive a restore writes into the pod at once (it then unpacks and
#: removes it), so a change set needs no room twice on the pod's disk.
CHUNK = 8 << 20
#: Bytes of a pod's change set a snapshot carries (one answer of its agent).
MAX_BYTES = 160 << 20
_OWN_TMP = ".sandpool-"  # names in /tmp that are sandpool's own, never state
#: The script's exit status for a path it cannot read or name (too deep, unreadable): a state
#: the sandbox's processes made that a change set cannot carry. A ConfigError, as a change set
#: over MAX_BYTES is: the sandbox is sound, and a rollout's lease is not broken by it.
_UNCARRIED = 3

# Runs in the pod (stdlib only, Python 3.6+): argv = record.json, "tar" or "hash", repo, tmp.
# "tar": the change set as a tar stream on stdout, its lines as the last member (SCAN);
# "hash": the lines as JSON on stdout. Exit 3: a path it cannot read or name (see _UNCARRIED).
_SCRIPT = r'''
import errno, hashlib, io, json, os, signal, stat, sys, tarfile
rec_path, mode, root, tmp = sys.argv[1:5]
with open(rec_path) as f:
    rec = json.load(f)
own, files = set(rec["own"]), rec["files"]
TYPES = ((stat.S_ISDIR, "d"), (stat.S_ISREG, "f"), (stat.S_ISLNK, "l"), (stat.S_ISFIFO, "p"))
def kind(st):
    for test, k in TYPES:
        if test(st.st_mode):
            return k
    return None
def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
def line(name, k, st, path):
    pay = sha(path) if k == "f" else os.readlink(path) if k == "l" else ""
    return "%s\0%s\0%o\0%s" % (name, k, stat.S_IMODE(st.st_mode), pay)
anc, p = set(), os.getpid()
while p > 0 and p not in anc:
    anc.add(p)
    try:
        with open("/proc/%d/status" % p) as f:
            p = int([x for x in f if x.startswith("PPid:")][0].split()[1])
    except (OSError, IndexError, ValueError):
        break
stopped = []
# Only in the pod's own pid namespace, under its init: never the host's processes.
alone = 1 in anc and os.readlink("/proc/self/ns/pid") != "pid:[4026531836]"
for d in os.listdir("/proc") if alone else ():
    if d.isdigit() and int(d) not in anc:
        try:
            os.kill(int(d), signal.SIGSTOP)
            stopped.append(int(d))
        except OSError:
            pass
try:
    lines, seen, adds = [], set(), []
    todo = [""]
    while todo:
        rel = todo.pop()
        d = os.path.join(root, rel) if rel else root
        for name in sorted(os.listdir(d)):
            r = rel + "/" + name if rel else name
            if r in own:
                continue
            path = os.path.join(d, name)
            st = os.lstat(path)
            k = kind(st)
            if k is None:
                continue
            seen.add(r)
            if k == "d":
                todo.append(r)
            was = files.get(r)
            if was is not None and was[0] == k and was[1] == "%o" % stat.S_IMODE(st.st_mode):
                if k == "d" or (k == "l" and was[2] == os.readlink(path)):
                    continue
                if k == "f" and was[4] == st.st_ctime_ns and was[5] == st.st_size:
                    continue
                if k == "f" and was[3] == sha(path):
                    continue
            lines.append(line("repo/" + r, k, st, path))
            adds.append((path, "repo/" + r))
    lines += ["repo/%s\0deleted" % r for r in files if r not in seen]
    todo = [""]
    while todo:
        rel = todo.pop()
        d = os.path.join(tmp, rel) if rel else tmp
        for name in sorted(os.listdir(d)):
            if not rel and name.startswith(".sandpool-"):
                continue
            r = rel + "/" + name if rel else name
            path = os.path.join(d, name)
            st = os.lstat(path)
            k = kind(st)
            if k is None:
                continue
            if k == "d":
                todo.append(r)
            lines.append(line("tmp/" + r, k, st, path))
            adds.append((path, "tmp/" + r))
    scan = json.dumps({"lines": lines}).encode()
    if mode == "tar":
        with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT) as t:
            for path, name in adds:
                t.add(path, arcname=name, recursive=False)
            info = tarfile.TarInfo(".sandpool-scan.json")
            info.size = len(scan)
            t.addfile(info, io.BytesIO(scan))
    else:
        sys.stdout.buffer.write(scan)
except OSError as exc:
    # A path the sandbox's own processes made that no process here can read or name: the
    # state cannot be carried (exit 3), not a failure of the pod.
    if exc.errno not in (errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.ELOOP):
        raise
    sys.stderr.write("cannot carry %s: %s\n" % (str(exc.filename)[-200:], os.strerror(exc.errno)))
    sys.exit(3)
finally:
    for p in stopped:
        try:
            os.kill(p, signal.SIGCONT)
        except OSError:
            pass
'''

# Runs in the pod: argv = archive, deletions.json or "", repo, tmp. Removes the deletions,
# then unpacks one archive of a change set (and removes it).
_RESTORE = r'''
import json, os, shutil, sys, tarfile
arc, dels, root, tmp = sys.argv[1:5]
def gone(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
if dels:
    with open(dels) as f:
        for rel in json.load(f):
            gone(os.path.join(root, rel))
with tarfile.open(arc) as t:
    members = t.getmembers()
    for m in members:
        top, _, rel = m.name.partition("/")
        dest = os.path.join(root if top == "repo" else tmp, rel)
        if os.path.lexists(dest) and not (m.isdir() and os.path.isdir(dest) and not os.path.islink(dest)):
            gone(dest)
        m.name = dest.lstrip("/")
    kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    t.extractall("/", members=members, **kw)
os.unlink(arc)
'''


def _record_json(rec: Pristine) -> dict:
    """The pristine record as the pod's script reads it: rel -> [type, mode, target, sha256,
    ctime_ns, size]."""
    files: dict[str, list] = {}
    for ln in rec.paths:
        kind, mode, rest = ln.split(" ", 2)
        path, _, target = rest.rpartition(" -> ")
        if path == ".":
            continue
        files[path[2:]] = [kind, mode, target, "", -1, -1]
    for ln in rec.hashes:
        digest, _, path = ln.partition("  ")
        if path[2:] in files:
            files[path[2:]][3] = digest
    for ln in rec.stats:
        ctime, size, path = ln.split(" ", 2)
        if path[2:] in files:
            sec, _, frac = ctime.partition(".")
            files[path[2:]][4] = int(sec) * 10**9 + int((frac + "000000000")[:9])
            files[path[2:]][5] = int(size)
    return {"files": files, "own": [".git/sandpool-exec"]}


def _check(sb: AgentSandbox, res: ExecResult) -> None:
    """Raise unless the snapshot script's run ``res`` succeeded.

    Raises:
        ConfigError: The state holds what the script cannot carry (the policy's doing).
        InfraError: The script failed otherwise.
    """
    if res.exit_code == _UNCARRIED:
        raise errors.ConfigError(f"sandbox {sb.id}: its state cannot be snapshotted: "
                                 f"{res.err_text.strip()[-300:]} (a path its processes made past "
                                 "PATH_MAX, or one they made unreadable)")
    if not res.ok:
        raise errors.InfraError(f"sandbox {sb.id}: the snapshot script failed (exit {res.exit_code}): "
                                f"{res.err_text.strip()[-400:]}")


async def _run(sb: AgentSandbox, python: str, script: str, *args: str, timeout: float,
               max_output: int = 1 << 28) -> bytes:
    res = await sb.exec(["/bin/sh", "-c", 'exec "$0" -c "$@"', python, script, *args],
                        timeout=timeout, cwd="/", max_output=max_output)
    _check(sb, res)
    return res.stdout


async def _scan(sb: AgentSandbox, python: str, mode: str, timeout: float) -> tuple[bytes, bool]:
    """Run the script in ``mode``; its stdout and whether it was cut at :data:`MAX_BYTES`."""
    rec = pristine_record(sb)
    if rec is None or not rec.stats:
        raise errors.ConfigError(f"sandbox {sb.id} has no pristine record with stats: snapshots of it "
                                 "need a sandbox the pool created (record_pristine)")
    path = f"/tmp/{_OWN_TMP}rec-{uuid.uuid4().hex}.json"
    await sb.write_file(path, json.dumps(_record_json(rec)).encode())
    try:
        res = await sb.exec(["/bin/sh", "-c", 'exec "$0" -c "$@"', python, _SCRIPT, path, mode,
                             sb.workdir, "/tmp"], timeout=timeout, cwd="/", max_output=MAX_BYTES)
    finally:
        await sb.exec(["rm", "-f", path], timeout=timeout, cwd="/")
    _check(sb, res)
    return res.stdout, res.stdout_truncated


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(lines)).encode("utf-8", "surrogateescape")).hexdigest()


async def state_hash(sb: AgentSandbox, python: str, *, timeout: float = 300.0) -> str:
    """The hash of the sandbox's change set against its pristine record now (what a
    snapshot's ``content_hash`` is)."""
    out, _ = await _scan(sb, python, "hash", timeout)
    try:
        return _digest(json.loads(out)["lines"])
    except (ValueError, KeyError):
        raise errors.InfraError(f"sandbox {sb.id}: the state hash script's answer is not its lines: "
                                f"{out[:200]!r}") from None


async def capture(sb: AgentSandbox, python: str, store: Path, backend: str, image_id: str, *,
                  timeout: float = 600.0) -> Snapshot:
    """Take a snapshot of ``sb`` as its change set (see the module docstring).

    Args:
        sb: A sandbox the pool created (its pristine record holds stats).
        python: The interpreter command that runs the script in the sandbox.
        store: The backend's snapshot directory on this host.
        backend: The backend's name (recorded in the snapshot).
        image_id: The image's build identity (recorded).
        timeout: Seconds the script may take.

    Raises:
        ConfigError: The sandbox has no pristine record, its change set is over
            :data:`MAX_BYTES`, or it holds a path the script cannot read or name.
        InfraError: The script failed or its archive does not hold what it listed.
    """
    data, cut = await _scan(sb, python, "tar", timeout)
    if cut:
        raise errors.ConfigError(f"sandbox {sb.id}: its change set is over {MAX_BYTES >> 20} MiB, the "
                                 "most a pod's snapshot carries through its agent")
    archives, lines = _split_archive(sb, data)
    sid = Snapshot.new_id()
    parts = tuple(f"changes/{sid}/{i:04d}.tar" for i in range(len(archives)))
    (store / "changes" / sid).mkdir(parents=True, exist_ok=True)
    for part, blob in zip(parts, archives, strict=True):
        (store / part).write_bytes(blob)
    deleted = sorted(ln.split("\0")[0][len("repo/"):] for ln in lines if ln.endswith("\0deleted"))
    return Snapshot(id=sid, image=sb.image, image_id=image_id, backend=backend,
                    content_hash=_digest(lines), size_bytes=sum(map(len, archives)), parts=parts,
                    location=store, detail=MappingProxyType({"deleted": deleted, "entries": len(lines),
                                                             "own": [f"changes/{sid}"]}))


def _split_archive(sb: AgentSandbox, data: bytes) -> tuple[list[bytes], list[str]]:
    """Check the pod's tar stream holds exactly what its scan lists, with that content, and
    split it into archives of about :data:`CHUNK` bytes (a restore writes one at a time: a
    change set needs no room twice on the pod's disk). Returns ``(archives, lines)``."""
    got, archives, scan = [], [], None
    out, buf = None, None
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as t:
            for m in t:
                f = t.extractfile(m) if m.isfile() else None
                blob = f.read() if f is not None else b""
                if m.name == ".sandpool-scan.json":
                    scan = json.loads(blob)
                    continue
                kind = ("d" if m.isdir() else "f" if m.isfile() else "l" if m.issym()
                        else "p" if m.isfifo() else "?")
                pay = hashlib.sha256(blob).hexdigest() if m.isfile() else m.linkname if m.issym() else ""
                got.append(f"{m.name}\0{kind}\0{m.mode & 0o7777:o}\0{pay}")
                if out is None or buf.tell() > CHUNK:
                    if out is not None:
                        out.close()
                        archives.append(buf.getvalue())
                    buf = io.BytesIO()
                    out = tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT)
                out.addfile(m, io.BytesIO(blob) if m.isfile() else None)
    except (tarfile.TarError, ValueError) as exc:
        raise errors.InfraError(f"sandbox {sb.id}: the snapshot's tar stream is unreadable: {exc}") from None
    if out is not None:
        out.close()
        archives.append(buf.getvalue())
    if scan is None:
        raise errors.InfraError(f"sandbox {sb.id}: the snapshot's tar stream has no scan (cut short)")
    lines = scan["lines"]
    if sorted(got) != sorted(ln for ln in lines if not ln.endswith("\0deleted")):
        raise errors.InfraError(f"sandbox {sb.id}: the snapshot's archive does not hold what its scan "
                                "listed (a file changed while it was read)")
    return archives, lines


async def load(sb: AgentSandbox, python: str, snap: Snapshot, store: Path, *,
               timeout: float = 600.0) -> None:
    """Write ``snap``'s change set into the pristine sandbox ``sb``, one archive at a time;
    verify with :func:`state_hash` after.

    Raises:
        ConfigError: The snapshot's data is gone.
        InfraError: The copy or the unpack failed.
    """
    snap = snap.unpacked(store / "loaded")
    tag = uuid.uuid4().hex
    dels = f"/tmp/{_OWN_TMP}del-{tag}.json"
    await sb.write_file(dels, json.dumps(list(snap.detail["deleted"])).encode())
    try:
        for i, part in enumerate(snap.parts or ("",)):
            arc = f"/tmp/{_OWN_TMP}load-{tag}-{i}.tar"
            data = (snap.location / part).read_bytes() if part else _EMPTY_TAR
            await sb.write_file(arc, data)
            res = await sb.exec(["/bin/sh", "-c", 'exec "$0" -c "$@"', python, _RESTORE, arc,
                                 dels if i == 0 else "", sb.workdir, "/tmp"], timeout=timeout, cwd="/")
            if not res.ok:
                raise errors.InfraError(f"sandbox {sb.id}: restoring snapshot {snap.id} failed "
                                        f"(exit {res.exit_code}): {res.err_text.strip()[-400:]}")
    finally:
        await sb.exec(["/bin/sh", "-c", f"rm -f {dels} /tmp/{_OWN_TMP}load-{tag}-*"], timeout=timeout,
                      cwd="/")


_EMPTY_TAR = b"\0" * 1024


def discard(store: Path, snap: Snapshot, keep: Snapshot | None) -> None:
    """Remove ``snap``'s archives from ``store``. Never raises."""
    if snap.location != store:
        return
    for part in snap.detail.get("own", ()):
        shutil.rmtree(store / part, ignore_errors=True)


def remove_store(store: Path) -> None:
    """Remove the whole store (the backend closes). Never raises."""
    shutil.rmtree(store, ignore_errors=True)
