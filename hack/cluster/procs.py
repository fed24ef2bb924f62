"""Processes and state of a running cluster: spawn, wait, find, and the state file.

Shared by the parts of hack/cluster that start processes or log. Standard library only.
"""

from __future__ import annotations

import json
import os
import random
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


_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago, for a server to listen on.

    Drawn at random outside the kernel's ephemeral range (``ip_local_port_range``): a port the
    kernel handed out (``bind(0)``) is the kind it also gives to outgoing connections, so a
    client connecting between the draw and the server's ``listen`` can hold it (EADDRINUSE).
    Never returns a port twice in one process. Raises ``RuntimeError`` when none is free.
    """
    lo, hi = _ephemeral_range()
    spans = [(r0, r1) for r0, r1 in ((10000, lo - 1), (hi + 1, 65535)) if r1 - r0 > 1000]
    rng = random.SystemRandom()
    for _ in range(500):
        r0, r1 = rng.choice(spans)
        port = rng.randint(r0, r1)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free TCP port on 127.0.0.1 outside the ephemeral range")


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
