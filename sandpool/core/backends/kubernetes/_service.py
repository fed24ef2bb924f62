"""A long-lived service in every pod of a backend: ``KubernetesBackend(service=PodService(...))``.

The Kubernetes counterpart of the local backend's ``ServiceSpec``. The backend starts the
service through the sandbox's agent session (the agent's ``service`` op: its own session,
spared by ``ps`` and ``kill_strays``, hence by the in-place reset) when the sandbox is
created, i.e. while the pool warms, and waits for its readiness command before the sandbox
is handed out. The service listens on ``port`` inside the pod (declared as the container's
``ports``); the host reaches it through ``pods/portforward``
(:meth:`KubernetesSandbox.open_port`).

Where it runs: in the pod's run directory, ``$SANDPOOL_POD_RUN/service`` (``/run/sandpool``
when the cluster sets no ``SANDPOOL_POD_RUN``), outside the repo and outside ``/tmp``; its
output goes to ``service.log`` there. Its code must be in the image or a mounted volume: no
host directory is bound into a pod (on the kwok test cluster a pod's exec is a host process,
so host paths are visible as they are).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sandpool.core import errors

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._sandbox import KubernetesSandbox

__all__ = ["PodService", "start_service"]

#: Runs the service's argv in its directory, output appended to service.log there.
_IN_DIR = ('d="${SANDPOOL_POD_RUN:-/run/sandpool}/service"; mkdir -p "$d" && cd "$d" '
           '&& exec "$@" >>service.log 2>&1')
_LOG_TAIL = 'tail -c 1500 "${SANDPOOL_POD_RUN:-/run/sandpool}/service/service.log" 2>/dev/null'


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

    Raises:
        ConfigError: ``argv`` is empty or ``port`` is not a TCP port.
    """

    argv: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    ready_argv: tuple[str, ...] | None = None
    ready_timeout: float = 60.0
    secret_env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.argv:
            raise errors.ConfigError("PodService.argv is empty; give the service's command")
        if not 0 < self.port < 65536:
            raise errors.ConfigError(f"PodService.port={self.port} is not a TCP port (1-65535)")


async def start_service(sb: KubernetesSandbox, spec: PodService) -> None:
    """Start ``spec`` in ``sb`` through its agent session and wait until it is ready.

    Sets ``sb.service_env`` and ``sb.service_port``.

    Raises:
        ConfigError: ``sb`` has no agent session (the service needs the agent to keep it
            alive and out of ``kill_strays``' reach).
        SandboxStartError: The readiness command failed (the message has the log's tail).
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
                              env=env, cwd=None, log="/dev/null")
    sb.service_env, sb.service_port = env, spec.port
    if spec.ready_argv is None:
        return
    res = await sb.exec(list(spec.ready_argv), timeout=spec.ready_timeout, cwd="/",
                        env={"SANDPOOL_SERVICE_PID": str(started["pid"])})  # type: ignore[index]
    if not res.ok:
        log = (await sb.exec(_LOG_TAIL, timeout=30.0, cwd="/")).text.strip()
        raise errors.SandboxStartError(
            f"sandbox {sb.id}: its service did not become ready (exit {res.exit_code}, "
            f"timed out: {res.timed_out}): {log or res.err_text[-500:]}")
