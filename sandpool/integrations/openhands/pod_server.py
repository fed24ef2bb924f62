"""The OpenHands agent-server as every pod's long-lived service (Kubernetes backend).

``KubernetesBackend(service=agent_server_pod_service())`` starts the agent-server in each pod
when the pod's sandbox is created, i.e. while the pool warms (the claim finds it answering),
through the pod's agent session, so the in-place reset and ``kill_strays`` spare it
(:mod:`sandpool.core.backends.kubernetes._service`). It listens on :data:`POD_PORT` on the
pod's loopback only; :class:`~sandpool.integrations.openhands.workspace.SandpoolWorkspace`
reaches it through ``pods/portforward`` behind the same 127.0.0.1 relay as on the local
backend, with a per-pod session key.

Where the server's code comes from: the read-only agent-server env of
:func:`~sandpool.integrations.openhands.server.agent_server_env` (and ``python_path``
directories) at their host paths. On the kwok test cluster a pod's exec is a host process,
so those paths are there as they are; on a real cluster they must be in the pod's image or a
mounted read-only volume at the same paths (sandpool binds nothing into a pod).

On kwok, pods share the host's network, so the provisioner (``hack/cluster/provisioner.py``)
gives each pod a private directory standing for its loopback, ``$SANDPOOL_POD_PORTS``: the
server listens on the unix socket ``$SANDPOOL_POD_PORTS/<port>`` there instead of a TCP port,
and the pod's kwok ``PortForward`` bridges port-forward streams of ``<port>`` to it. No TCP
port is opened on the host.

The server's state (conversations, bash events, tmux sockets) lives in the pod's service
directory (``$SANDPOOL_POD_RUN/service``, else ``/run/sandpool/service``), outside the repo and
outside ``/tmp``; its ``HOME`` is the pod's. The policy can write that directory, so the
in-place reset holds the server to its fresh state as on the local backend
(``ServiceSpec.reset_argv``: every conversation and bash event deleted through the server's
API, then the directory's tree compared with the fresh one; anything else quarantines).
Not ported from the local launcher: its non-dumpable flag and its refusal to import from
writable directories, which would refuse everything on kwok, whose pod processes are host
root (a real pod's policy should run as another uid than the server).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from sandpool.core import errors
from sandpool.core.service import ServiceSpec
from sandpool.integrations.openhands.server import SESSION_KEY, agent_server_env, reset_steps

__all__ = ["POD_PORT", "agent_server_pod_service"]

#: The port the agent-server serves inside each pod (the agent-server's own default).
POD_PORT = 8000

# Runs in the pod with the env's python, in the service directory: state under it, preload
# modules, then serve OpenHands' FastAPI app on the pod's loopback (or kwok's stand-in).
_LAUNCHER = """
import importlib, os, socket, sys
here = os.getcwd()
os.environ["TMUX_TMPDIR"] = os.path.join(here, "tmux")  # not /tmp, which the reset empties
os.makedirs(os.environ["TMUX_TMPDIR"], exist_ok=True)
sys.path[:0] = [p for p in os.environ.get("SANDPOOL_OH_PATH", "").split(":") if p]
for m in filter(None, os.environ.get("SANDPOOL_OH_PRELOAD", "").split(",")):
    importlib.import_module(m)
import uvicorn
port, ports = int(os.environ["SANDPOOL_OH_PORT"]), os.environ.get("SANDPOOL_POD_PORTS")
app = "openhands.agent_server.api:api"
if ports:  # kwok: the pod's port is a unix socket in its ports directory (bound by a short name)
    sock = socket.socket(socket.AF_UNIX)
    os.chdir(ports)
    if os.path.exists(str(port)):
        os.unlink(str(port))
    sock.bind(str(port))
    os.chdir(here)
    uvicorn.run(app, fd=sock.fileno(), ws="wsproto", log_level="warning")
else:
    uvicorn.run(app, host="127.0.0.1", port=port, ws="wsproto", log_level="warning")
"""

# Exits 0 once the server answers /health, 1 as soon as the server process is gone.
_READY = (
    "import http.client, json, os, socket, sys, time\n"
    "port, ports = int(sys.argv[1]), os.environ.get('SANDPOOL_POD_PORTS')\n"
    "class C(http.client.HTTPConnection):\n"
    "    def connect(self):\n"
    "        if not ports: return super().connect()\n"
    "        os.chdir(ports); self.sock = socket.socket(socket.AF_UNIX); self.sock.connect(str(port))\n"
    "while True:\n"
    "    try:\n"
    "        c = C('127.0.0.1', port, timeout=5); c.request('GET', '/health')\n"
    "        if c.getresponse().status == 200: break\n"
    "    except OSError: pass\n"
    "    if not os.path.exists('/proc/' + os.environ['SANDPOOL_SERVICE_PID']): sys.exit(1)\n"
    "    time.sleep(0.05)\n"
)


# ServiceSpec.reset_argv: the reset steps (server.reset_steps, shared with the local backend)
# over the pod's port.
_RESET = _READY.split("while True:")[0] + reset_steps(
    "'127.0.0.1', port", "os.path.join(os.environ.get('SANDPOOL_POD_RUN', '/run/sandpool'), 'service', 'tmux')")


def agent_server_pod_service(
    env: Path | None = None,
    *,
    preload: tuple[str, ...] = (),
    python_path: tuple[str, ...] = (),
    port: int = POD_PORT,
    ready_timeout: float = 600.0,
) -> ServiceSpec:
    """The :class:`ServiceSpec` that runs the agent-server in every pod of a Kubernetes backend.

    Usage: ``KubernetesBackend(..., service=agent_server_pod_service(preload=("my_llm",),
    python_path=(d,)))``.

    Args:
        env: The agent-server env (default :func:`agent_server_env`); its path must exist in
            the pods (see the module docstring).
        preload: Modules imported in the server process before it serves (a scripted LLM
            provider, custom tools), like the agent-server's ``--import-modules``.
        python_path: Directories put on the server's ``sys.path`` for ``preload`` (paths in
            the pod).
        port: The port the server listens on inside the pod.
        ready_timeout: Seconds the server may take to answer ``/health``.

    Returns:
        The service spec; each pod's session key is in ``sandbox.service_env[SESSION_KEY]``.

    Raises:
        ConfigError: ``env`` cannot run the agent-server.
    """
    env = env or agent_server_env()
    py = str(env / "bin" / "python")
    if not Path(py).exists() or subprocess.run([py, "-c", "import uvicorn, openhands.agent_server"],
                                               capture_output=True).returncode:
        raise errors.ConfigError(f"agent_server_pod_service(env={env}): {py} cannot import the agent-server; "
                                 "pass an env made by agent_server_env()")
    service_env = {
        "SANDPOOL_OH_PORT": str(port),
        # OpenHands' terminal and file editor register on import; the server resolves tools by name.
        "SANDPOOL_OH_PRELOAD": ",".join(("openhands.tools.terminal", "openhands.tools.file_editor", *preload)),
        "SANDPOOL_OH_PATH": ":".join(python_path),
        "OH_ENABLE_VSCODE": "false",
        "OH_ENABLE_VNC": "false",
        "OH_PRELOAD_TOOLS": "false",
        "OPENHANDS_SUPPRESS_BANNER": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }  # PATH stays the pod's: the agent's terminal commands run the task image's tools
    return ServiceSpec(argv=(py, "-I", "-c", _LAUNCHER), port=port, env=service_env, secret_env=(SESSION_KEY,),
                       ready_argv=(py, "-I", "-c", _READY, str(port)), ready_timeout=ready_timeout,
                       reset_argv=(py, "-I", "-c", _RESET, str(port)))
