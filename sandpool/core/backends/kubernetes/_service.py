"""A long-lived service in every pod of a backend: ``KubernetesBackend(service=PodService(...))``.

The Kubernetes counterpart of the local backend's ``ServiceSpec``. The backend starts the
service through the sandbox's agent session (the agent's ``service`` op: its own session,
spared by ``ps`` and ``kill_strays``, hence by the in-place reset) when the sandbox is
created, i.e. while the pool warms, and waits for its readiness command before the sandbox
is handed out. The service listens on ``port`` inside the pod (declared as the container's
``ports``); the host reaches it through ``pods/portforward``
(:meth:`KubernetesSandbox.open_port`).

Where it runs: in the pod's service directory, ``$SANDPOOL_POD_RUN/service``
(``/run/sandpool/service`` when the cluster sets no ``SANDPOOL_POD_RUN``), outside the repo and
outside ``/tmp``; its output goes to the agent's stderr, i.e. to the host (the session's
``stderr_tail``), never to a file the next rollout could read. Its code must be in the image
or a mounted volume: no host directory is bound into a pod (on the kwok test cluster a pod's
exec is a host process, so host paths are visible as they are).

The in-place reset holds it to its fresh state as the local backend does
(:meth:`KubernetesSandbox.restore_service`, the one hook of
:func:`sandpool.core.reset.reset_in_place`): the same process (pid and start time), running,
``reset_argv`` exits 0, and the service directory's tree (:func:`sandpool.core.backends._service.tree`,
walked inside the pod by the agent's interpreter) equals the one recorded when it was fresh.
"""

from __future__ import annotations

import inspect
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.backends import _service as local_service

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox

__all__ = ["PodService", "restore_service", "start_service"]

_DIR = '"${SANDPOOL_POD_RUN:-/run/sandpool}/service"'
#: Runs the service's argv in its directory.
_IN_DIR = f'd={_DIR}; mkdir -p "$d" && cd "$d" && exec "$@"'
#: Prints the service directory's tree as JSON, inside the pod (the same walk as the local
#: backend's, from its source: stdlib only).
_TREE = "\n".join([
    "import hashlib, json, os, stat, sys", "from pathlib import Path", f"_TREE_MAX = {local_service._TREE_MAX}",
    inspect.getsource(local_service._sha256), inspect.getsource(local_service.tree),
    "print(json.dumps(tree(Path(sys.argv[1]))))"])


@dataclass(frozen=True)
class PodService:
    """A long-lived process every pod of a Kubernetes backend runs beside the policy's commands.

    Usage: ``KubernetesBackend(service=PodService(argv=("/opt/srv/bin/srv",), port=8000))``.

    Attributes:
        argv: The command (absolute paths inside the pod), run with the pod's environment plus
            ``env`` in the pod's service directory (see the module docstring).
        port: The TCP port it serves inside the pod (1-65535); declared as the container's
            port, reached with :meth:`KubernetesSandbox.open_port`.
        env: Extra environment variables.
        ready_argv: A command run once after the start that exits 0 when the service is ready
            (it waits itself; ``$SANDPOOL_SERVICE_PID`` is the service's pid, so it can give up
            when the service dies); creation fails if it does not exit 0.
        ready_timeout: Seconds ``ready_argv`` may take.
        secret_env: Names of variables set to a fresh random secret for each pod's service
            (e.g. the key its clients must present); the values are in
            ``KubernetesSandbox.service_env``.
        reset_argv: A command the in-place reset runs in the service directory (after the
            rollout's processes are killed, with ``env``, the secrets and
            ``$SANDPOOL_SERVICE_PID``) that makes the service drop what the rollout left in it;
            it must exit 0. It also runs once when the service is ready, before the fresh
            tree is recorded. As ``ServiceSpec.reset_argv`` of the local backend.

    Raises:
        ConfigError: ``argv`` is empty or ``port`` is not a TCP port.
    """

    argv: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    ready_argv: tuple[str, ...] | None = None
    ready_timeout: float = 60.0
    secret_env: tuple[str, ...] = ()
    reset_argv: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.argv:
            raise errors.ConfigError("PodService.argv is empty; give the service's command")
        if not 0 < self.port < 65536:
            raise errors.ConfigError(f"PodService.port={self.port} is not a TCP port (1-65535)")


async def start_service(sb: KubernetesSandbox, spec: PodService) -> None:
    """Start ``spec`` in ``sb`` through its agent session, wait until it is ready, and record
    its fresh state (pid, start time, directory tree).

    Sets ``sb.service_env``, ``sb.service_port`` and ``sb._service``.

    Raises:
        ConfigError: ``sb`` has no agent session (the service needs the agent to keep it
            alive and out of ``kill_strays``' reach).
        SandboxStartError: The readiness command or the first ``reset_argv`` failed (the
            message has the service's output).
        SandboxDied, ExecTransportError: The pod or its channel failed.
    """
    if sb._dead is not None:
        raise sb._died()
    if sb._session is None:
        raise errors.ConfigError(
            f"sandbox {sb.id}: KubernetesBackend(service=...) needs sandpool's agent in the pod "
            "(agent=True and an image with agent_python)")
    env = {**spec.env, **{name: secrets.token_urlsafe(24) for name in spec.secret_env}}
    started = await sb._agent("call", "service", 30.0, argv=["/bin/sh", "-c", _IN_DIR, "sh", *spec.argv],
                              env=env, cwd=None)
    pid = int(started["pid"])  # type: ignore[index]
    sb.service_env, sb.service_port = env, spec.port
    checks = [(spec.ready_argv, spec.ready_timeout, "become ready"), (spec.reset_argv, 60.0, "reset")]
    for argv, timeout, what in checks:
        if argv is None:
            continue
        res = await sb.exec(list(argv), timeout=timeout, cwd="/",
                            env={**env, "SANDPOOL_SERVICE_PID": str(pid)})
        if not res.ok:
            out = bytes(sb._session.stderr_tail[-1500:]).decode("utf-8", "replace").strip()
            raise errors.SandboxStartError(
                f"sandbox {sb.id}: its service did not {what} (exit {res.exit_code}, "
                f"timed out: {res.timed_out}): {out or res.err_text[-500:]}")
    got = await _proc(sb, pid, 30.0)
    if got is None or got[0] in ("Z", "X"):
        raise errors.SandboxStartError(f"sandbox {sb.id}: its service (pid {pid}) exited after it was ready")
    sb._service = local_service.RunningService(spec, pid, got[1], got[2], await _tree(sb))  # type: ignore[arg-type]


async def restore_service(sb: KubernetesSandbox, timeout: float) -> list[str]:
    """Bring ``sb``'s service back to its fresh state and verify it (the reset's hook).

    Checks, in order: the same process (pid and start time), not stopped, its priority,
    limits and CPU affinity unchanged; ``reset_argv``
    exits 0; the service directory's tree equals the fresh one; the process once more.

    Returns:
        What differs (empty: pristine); [] without a service.

    Raises:
        SandboxDied, ExecTransportError: As :meth:`KubernetesSandbox.exec`.
    """
    svc = sb._service
    if svc is None:
        return []
    problems = await _running(sb, svc, timeout)
    if not problems and svc.spec.reset_argv is not None:
        res = await sb.exec(list(svc.spec.reset_argv), timeout=timeout, cwd="/",
                            env={**sb.service_env, "SANDPOOL_SERVICE_PID": str(svc.pid)})
        if not res.ok:
            problems = [f"its service's reset failed (exit {res.exit_code}, timed out: {res.timed_out}): "
                        f"{(res.err_text or res.text).strip()[-300:]}"]
    if not problems:
        problems = local_service.tree_diff(svc.pristine, await _tree(sb))
    # Again at the end: a fatal signal sent just before the reset may take effect during it.
    return problems or await _running(sb, svc, timeout)


async def service_problems(sb: KubernetesSandbox, timeout: float) -> list[str]:
    """Why ``sb``'s service is not running as it started (gone, stopped, its limits changed),
    one sentence each; [] when it is, or without a service. The reset's first check."""
    return [] if sb._service is None else await _running(sb, sb._service, timeout)


async def _proc(sb: KubernetesSandbox, pid: int, timeout: float) -> tuple[str, str, str] | None:
    """``(state, start time, attributes)`` of ``pid`` in the pod (the local backend's reading)."""
    res = await sb.exec(local_service.proc_argv(pid), timeout=timeout, cwd="/")
    return local_service.proc_state(res.text) if res.ok else None


async def _running(sb: KubernetesSandbox, svc: local_service.RunningService, timeout: float) -> list[str]:
    res = await sb.exec(local_service.proc_argv(svc.pid), timeout=timeout, cwd="/")
    return local_service.running_problems(svc, res.text if res.ok else None)


async def _tree(sb: KubernetesSandbox) -> dict[str, tuple[str, ...]]:
    py = sb.agent_python
    res = await sb.exec(["/bin/sh", "-c", f'exec "$0" -I -c "$1" {_DIR}', py, _TREE], timeout=60.0, cwd="/")
    if not res.ok:
        raise errors.ExecTransportError(
            f"sandbox {sb.id}: listing its service directory failed (exit {res.exit_code}): "
            f"{res.err_text.strip()[-300:]}")
    return {k: tuple(v) for k, v in json.loads(res.stdout).items()}
