"""Faults of the local test cluster's control plane, injected on demand.

Used by the fault matrix (``bench/_k8s_faults.py``) and the cluster tests for what a failing
cluster does that cannot be asked of it through its API: a component killed and started
again (kube-apiserver: every stream through it breaks; kwok, the nodes' kubelet: the API
server cannot dial it and answers 500 on pod exec), or started again with other flags.
Standard library only; import it with this directory on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["kill", "restart", "start"]

# Starts a component in a session of its own and prints its pid, then exits: the component
# is then the cluster's (as those ``cluster.py up`` starts), not a child of the caller, which
# would otherwise have to wait for it (``cluster.py down`` stops it, from another process).
_LAUNCH = (
    "import json, subprocess, sys\n"
    "a = json.loads(sys.argv[1])\n"
    "with open(a['log'], 'ab') as log:\n"
    "    p = subprocess.Popen(a['argv'], stdin=subprocess.DEVNULL, stdout=log, stderr=log,\n"
    "                         cwd=a['cwd'], env=a['env'], start_new_session=True)\n"
    "print(p.pid)\n"
)


def _state_path(run_dir: Path) -> Path:
    return run_dir / "state.json"


def _component(state: dict, name: str) -> str:
    return next(k for k in state["processes"] if name in k)


def kill(run_dir: Path, name: str) -> None:
    """SIGKILL cluster component ``name`` (a substring of its ``state.json`` key: ``apiserver``,
    ``kwok``, ``agent-sandbox``) and wait until its ports are free; :func:`start` brings it back.

    Raises:
        StopIteration: No component of that name.
    """
    state = json.loads(_state_path(run_dir).read_text())
    key = _component(state, name)
    proc = state["processes"][key]
    try:
        os.killpg(proc["pid"], signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 60
    # Its listening ports are free only once every thread has exited: a zombie leader whose
    # other threads are still dying holds them (a restart then fails "address already in use").
    while time.monotonic() < deadline:
        try:
            zombie = Path(f"/proc/{proc['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if zombie and len(os.listdir(f"/proc/{proc['pid']}/task")) <= 1:
                break
        except OSError:
            break  # gone
        time.sleep(0.05)
    time.sleep(0.5)


def start(run_dir: Path, name: str, extra: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> None:
    """Start component ``name`` again with the flags and environment it last ran with
    (+ ``extra``, flags starting with any of ``drop`` removed); ``state.json`` gets the new
    pid and argv, so ``cluster.py down`` stops it. The component is not the caller's child.

    Raises:
        subprocess.CalledProcessError: It could not be started.
    """
    state = json.loads(_state_path(run_dir).read_text())
    proc = state["processes"][_component(state, name)]
    argv = [a for a in proc["argv"] if not a.startswith(drop)] if drop else list(proc["argv"])
    argv += list(extra)
    spec = {"argv": argv, "log": proc["log"], "cwd": str(run_dir),
            "env": dict(os.environ, **proc.get("env", {}))}
    launched = subprocess.run([sys.executable, "-c", _LAUNCH, json.dumps(spec)], check=True,
                              capture_output=True, text=True)
    proc["pid"], proc["argv"] = int(launched.stdout), argv
    _state_path(run_dir).write_text(json.dumps(state, indent=2))


def restart(run_dir: Path, name: str, extra: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> None:
    """:func:`kill` component ``name``, then :func:`start` it (see there for ``extra``, ``drop``)."""
    kill(run_dir, name)
    start(run_dir, name, extra, drop)
