"""A kwok pod's directories on the host, and the end of its processes when it is deleted.

Each pod ``<ns>/<name>`` gets ``<root>/pods/<ns>/<name>/`` (its workdir), ``<workdir>.run``
(``$SANDPOOL_POD_RUN``, with ``ports/`` for its unix-socket ports) and, from container.sh,
``<workdir>.tmp`` (its private /tmp); ``<root>/meta/<ns>/<name>.uid`` records which pod
of that name owns them. Used by provisioner.py. Standard library only.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

LOG = logging.getLogger("provisioner")


class SourceError(Exception):
    """The pod's ``workdir-source`` cannot be copied into its workdir."""


class PodDirs:
    """The pods' directories under ``root`` (the cluster's run directory)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def workdir(self, ns: str, name: str) -> Path:
        return self.root / "pods" / ns / name

    def _uid_file(self, ns: str, name: str) -> Path:
        return self.root / "meta" / ns / f"{name}.uid"

    def prepare(self, ns: str, name: str, uid: str, source: str | None) -> Path:
        """Make pod ``uid``'s workdir (replacing an earlier pod's of the same name), copy
        ``source``'s contents in (``cp -a``) when given, and make its run directory.

        Returns the workdir.

        Raises:
            SourceError: ``source`` is not a directory, or the copy failed.
        """
        workdir = self.workdir(ns, name)
        uid_file = self._uid_file(ns, name)
        if workdir.exists():
            old = uid_file.read_text() if uid_file.exists() else ""
            if old != uid:
                shutil.rmtree(workdir, ignore_errors=True)
                shutil.rmtree(f"{workdir}.run", ignore_errors=True)
        uid_file.parent.mkdir(parents=True, exist_ok=True)
        uid_file.write_text(uid)
        workdir.mkdir(parents=True, exist_ok=True)
        if source:
            if not Path(source).is_dir():
                raise SourceError(f"workdir-source {source!r} is not a directory")
            res = subprocess.run(
                ["cp", "-a", f"{source}/.", str(workdir)],
                check=False,
                capture_output=True,
                text=True,
            )
            if res.returncode:
                raise SourceError(f"copy of {source!r} failed: {res.stderr.strip()}")
        (Path(f"{workdir}.run") / "ports").mkdir(parents=True, exist_ok=True)
        return workdir

    def remove(self, ns: str, name: str, uid: str | None) -> None:
        """Remove the directories of pod ``uid`` (of any pod of that name when None); those
        of a newer pod of the same name stay."""
        uid_file = self._uid_file(ns, name)
        if not uid_file.exists():
            return
        if uid is not None and uid_file.read_text() != uid:
            return
        workdir = self.workdir(ns, name)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(f"{workdir}.tmp", ignore_errors=True)
        shutil.rmtree(f"{workdir}.run", ignore_errors=True)
        uid_file.unlink(missing_ok=True)
        LOG.info("removed workdir of %s/%s", ns, name)

    def stale(self, live: dict[tuple[str, str], str]) -> Iterator[tuple[str, str, str]]:
        """``(ns, name, uid)`` of each pod with directories but not in ``live`` (``(ns, name)``
        to uid of every pod that exists)."""
        meta_root = self.root / "meta"
        if not meta_root.exists():
            return
        for f in meta_root.glob("*/*.uid"):
            ns, name = f.parent.name, f.name[: -len(".uid")]
            if live.get((ns, name)) != f.read_text():
                yield ns, name, f.read_text()


class Reaper:
    """Kills the processes of deleted pods, as a kubelet stops a pod's containers.

    kwok's exec does not end a command when its stream closes, so a pod's long-lived exec
    (sandpool's agent session) and whatever its commands left running would outlive the
    pod. Every exec'd process carries ``SANDPOOL_WORKDIR=<the pod's workdir>``; one scan of
    /proc per interval serves every pod deleted in it.
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def add(self, workdir: Path) -> None:
        """Kill, at the next scan, every process whose ``SANDPOOL_WORKDIR`` is ``workdir``."""
        with self._lock:
            self._pending.add(str(workdir))

    def run(self) -> None:
        """Scan forever (run it in a daemon thread)."""
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                batch, self._pending = self._pending, set()
            if batch:
                self._kill(batch)

    @staticmethod
    def _kill(workdirs: set[str]) -> None:
        needles = {f"SANDPOOL_WORKDIR={w}".encode() for w in workdirs}
        killed = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needles.intersection(env):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
        if killed:
            LOG.info("killed %d processes of %d deleted pods", killed, len(workdirs))
