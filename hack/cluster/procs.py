"""Processes and state of a running cluster: spawn, wait, find, and the state file.

Shared by the parts of hack/cluster that start processes or log. Standard library only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from gobuild import cache_root


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_dir() -> Path:
    """Where `up` keeps state, PKI, logs, etcd data and pod workdirs."""
    return Path(os.environ.get("SANDPOOL_CLUSTER_RUN_DIR") or cache_root() / "run")


def kubeconfig_path() -> Path:
    return Path(os.environ.get("SANDPOOL_CLUSTER_KUBECONFIG") or run_dir() / "kubeconfig")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_state() -> dict[str, Any] | None:
    p = run_dir() / "state.json"
    return json.loads(p.read_text()) if p.exists() else None


def save_state(state: dict[str, Any]) -> None:
    p = run_dir() / "state.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.rename(p)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def is_ours(proc: dict[str, Any]) -> bool:
    """The recorded pid is still the process we started (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{proc['pid']}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return alive(proc["pid"]) and any(proc["match"].encode() in part for part in cmdline[:3])


def group_members(pgids: set[int]) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) in pgids and fields[0] not in ("Z", "X"):
                pids.append(int(d.name))
    return pids


def spawn(
    state: dict[str, Any], name: str, argv: list[str], env: dict[str, str] | None = None
) -> None:
    logs = run_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    logfile = logs / f"{name}.log"
    with open(logfile, "ab") as f:
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=run_dir(),
            env=env,
            start_new_session=True,
        )
    state["processes"][name] = {
        "pid": p.pid,
        "match": Path(argv[0]).name if name != "provisioner" else "provisioner.py",
        "log": str(logfile),
        "argv": argv,
        # What its environment adds to ours, for a restart (cluster_faults.py).
        "env": {k: v for k, v in (env or {}).items() if os.environ.get(k) != v},
    }
    save_state(state)


def wait_for(
    what: str,
    check,
    timeout: float,
    state: dict[str, Any] | None = None,
    component: str | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if component and state and not alive(state["processes"][component]["pid"]):
            log_tail = Path(state["processes"][component]["log"]).read_text(errors="replace")[
                -3000:
            ]
            raise SystemExit(f"cluster: {component} exited during startup; log tail:\n{log_tail}")
        try:
            if check():
                return
        except Exception as e:  # noqa: BLE001 - readiness probes fail in many ways until ready
            last = e
        time.sleep(0.2)
    raise SystemExit(
        f"cluster: timed out after {timeout:.0f} s waiting for {what} (last error: {last})"
    )
