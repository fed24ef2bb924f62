"""The OpenHands agent-server as a sandbox's long-lived service (local backend).

The agent-server runs from a read-only env brought into every sandbox: a venv holding
``openhands-agent-server`` and ``openhands-tools`` of one version, built once (hydration) under
``sandpool_home()/openhands/agent-server-<version>-py<X.Y>`` and bind-mounted read-only with
the interpreter it was made from. Each sandbox starts it as its :class:`ServiceSpec` service
while the pool warms (creation waits until it answers ``/health``), listening on a unix socket
in the sandbox's service directory; the sandbox keeps no network of its own, and a host-side
relay (:mod:`sandpool.integrations.openhands.relay`) exposes the socket on 127.0.0.1.

The server's state (conversations, bash events, persisted settings, tmux sockets) lives in
the service directory, outside the repo and outside ``/tmp``; ``kill_strays`` spares the
server process (and kills its terminals). The policy runs as the server's uid and can write
that directory, so the in-place reset holds the server to its fresh state (the one reset,
:func:`sandpool.core.reset.reset_in_place`, through :attr:`ServiceSpec.reset_argv`): it
deletes every conversation and bash event through the server's API, then compares the
service directory, on the host, with the fresh server's; anything else (a planted file, a
killed or stopped server) quarantines the sandbox. The server is non-dumpable and imports
nothing from where the policy writes (see ``_LAUNCHER``). Its ``HOME`` is the sandbox's
(``/tmp``), which the reset empties; its terminals share it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sandpool.core import errors
from sandpool.core.backends.local import SERVICE_DIR
from sandpool.core.service import ServiceSpec
from sandpool.core.paths import sandpool_home

__all__ = ["AGENT_SERVER_VERSION", "SESSION_KEY", "SOCKET", "agent_server_env", "agent_server_service",
           "installed_versions"]

#: The agent-server release the env is built with (the SDK the client side uses).
AGENT_SERVER_VERSION = "1.58.2"
#: The variable holding a sandbox's agent-server session key (``X-Session-API-Key``).
SESSION_KEY = "OH_SESSION_API_KEYS_0"
#: Where ``python_path`` directories appear inside the sandbox (read-only), outside its scratch.
_PATH_IN_SANDBOX = "/opt/sandpool/service-path"
#: The agent-server's unix socket inside the sandbox.
SOCKET = f"{SERVICE_DIR}/agent-server.sock"

# Runs inside the sandbox with the env's python (-I: no $PYTHON* variables, no user site under
# $HOME, no working directory on sys.path). The policy runs as the same uid beside it, so:
# * non-dumpable: the policy's processes (no CAP_SYS_PTRACE) can neither ptrace it, nor read
#   its /proc files (environ holds the session key, fd its sockets), nor write its memory;
# * no import from a directory the policy can write: litellm appends the working directory
#   (the service directory) to sys.path, so a path hook gives every such entry, present or
#   added later, a finder that finds nothing, and planted code never runs in the server;
# * the catchable signals that stop a server (uvicorn's SIGINT/SIGTERM shutdown, SIGHUP,
#   SIGUSR1...) get a handler that does nothing (a handler, not SIG_IGN, so its terminals'
#   programs start with the defaults); SIGKILL and SIGSTOP remain, and the reset finds them.
# Then it imports the preload modules (a scripted LLM in tests, custom tools) and serves
# OpenHands' FastAPI app on the unix socket.
_LAUNCHER = """
import contextlib, ctypes, importlib, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0: fail closed
    sys.exit("sandpool agent-server: prctl(PR_SET_DUMPABLE, 0) failed: " + os.strerror(ctypes.get_errno()))
class NoImport:
    def find_spec(self, *args):
        return None
    def invalidate_caches(self):
        pass
def writable_guard(entry):
    p = os.path.abspath(entry or ".")
    while not os.path.exists(p):
        p = os.path.dirname(p)
    if os.access(p, os.W_OK):
        return NoImport()
    raise ImportError  # the next hook (the usual file finder) takes it
sys.path_hooks.insert(0, writable_guard)
sys.path_importer_cache.clear()
keep = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT, signal.SIGWINCH, signal.SIGURG,
        signal.SIGPIPE, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP,
        signal.SIGSYS, signal.SIGABRT}
for sig in signal.valid_signals() - keep:
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        signal.signal(sig, lambda *_: None)
os.makedirs(os.environ["TMUX_TMPDIR"], exist_ok=True)
sys.path[:0] = [p for p in os.environ.get("SANDPOOL_OH_PATH", "").split(":") if p]
for m in filter(None, os.environ.get("SANDPOOL_OH_PRELOAD", "").split(",")):
    importlib.import_module(m)
import uvicorn
class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # its SIGINT/SIGTERM shutdown would let the policy stop it
        yield
Server(uvicorn.Config("openhands.agent_server.api:api", uds=os.environ["SANDPOOL_OH_SOCKET"], ws="wsproto",
                      log_level="warning")).run()
"""

# Exits 0 once the server answers /health on its socket (it polls, inside the sandbox), 1 as
# soon as the server process is gone.
_READY = (
    "import http.client, os, socket, sys, time\n"
    "class C(http.client.HTTPConnection):\n"
    "    def connect(self):\n"
    "        self.sock = socket.socket(socket.AF_UNIX); self.sock.connect(sys.argv[1])\n"
    "while True:\n"
    "    try:\n"
    "        c = C('localhost', timeout=5); c.request('GET', '/health')\n"
    "        if c.getresponse().status == 200: break\n"
    "    except OSError: pass\n"
    "    if not os.path.exists('/proc/' + os.environ['SANDPOOL_SERVICE_PID']): sys.exit(1)\n"
    "    time.sleep(0.05)\n"
)


def reset_steps(address: str, tmux_dir: str) -> str:
    """Return the Python source of the agent-server's part of the in-place reset.

    Run after the rollout's processes were killed: delete every conversation and bash event
    through the server's own API (the server drops them from memory and disk), then the
    sockets of the terminals' tmux servers, which died with the rollout. The reset then
    compares the service directory with its fresh tree. One script for both backends.

    Args:
        address: Source of the arguments that open ``C`` (an ``http.client.HTTPConnection``
            subclass the caller's prelude defines), e.g. ``"'localhost'"``.
        tmux_dir: Source of an expression for the tmux servers' directory.

    Returns:
        Source to append to a prelude that imports ``os``/``sys`` and defines ``C``; it exits
        non-zero with the failing call when the server answers other than 200.
    """
    return (
        "import glob, json, stat\n"
        f"key = {{'X-Session-API-Key': os.environ[{SESSION_KEY!r}]}}\n"
        "def call(method, path):\n"
        f"    c = C({address}, timeout=30); c.request(method, path, headers=key)\n"
        "    r = c.getresponse(); body = r.read(); c.close()\n"
        "    if r.status != 200: sys.exit(f'{method} {path}: HTTP {r.status} {body[:200]!r}')\n"
        "    return json.loads(body or b'null')\n"
        "for _ in range(1000):\n"
        "    items = call('GET', '/api/conversations/search?limit=100')['items']\n"
        "    if not items: break\n"
        "    for item in items: call('DELETE', '/api/conversations/' + item['id'])\n"
        "else: sys.exit('conversations keep appearing')\n"
        "call('DELETE', '/api/bash/bash_events')\n"
        f"for p in glob.glob({tmux_dir} + '/tmux-*/openhands-*'):\n"
        "    if stat.S_ISSOCK(os.lstat(p).st_mode): os.unlink(p)\n"
    )


# ServiceSpec.reset_argv: the reset steps over the server's unix socket.
_RESET = (
    "import http.client, os, socket, sys\n"
    "class C(http.client.HTTPConnection):\n"
    "    def connect(self):\n"
    "        self.sock = socket.socket(socket.AF_UNIX); self.sock.settimeout(self.timeout)\n"
    "        self.sock.connect(os.environ['SANDPOOL_OH_SOCKET'])\n"
) + reset_steps("'localhost'", "os.environ['TMUX_TMPDIR']")


def agent_server_env(version: str = AGENT_SERVER_VERSION, *, python: str | None = None,
                     constraints: Sequence[str] = ()) -> Path:
    """Return the read-only agent-server env for ``version``, building it once (minutes).

    Args:
        version: The openhands-agent-server / openhands-tools / openhands-sdk release.
        python: The interpreter to build it with (default: this one; it must be >= 3.12).
        constraints: ``name==version`` lines pip must respect (e.g. the app server's own
            versions, so the env resolves as its venv did); they key the cache too.

    Returns:
        The venv directory (``<venv>/bin/python`` runs the server).

    Raises:
        ConfigError: The interpreter is older than 3.12, or the install failed (the message
            carries pip's last lines).
    """
    python = python or sys.executable
    ver = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    if tuple(int(x) for x in ver.split(".")) < (3, 12):
        raise errors.ConfigError(f"the OpenHands agent-server needs Python >= 3.12; {python} is {ver}")
    suffix = "-" + hashlib.sha256("\n".join(sorted(constraints)).encode()).hexdigest()[:8] if constraints else ""
    venv = sandpool_home() / "openhands" / f"agent-server-{version}-py{ver}{suffix}"
    if (venv / ".installed").exists():
        return venv
    subprocess.run(["rm", "-rf", str(venv)], check=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    # -I everywhere: a PYTHONPATH of the caller's (a test venv's extras, say) would make pip
    # count its packages as installed and leave them out of the env, which the sandbox lacks.
    subprocess.run([python, "-I", "-m", "venv", str(venv)], check=True)
    # All three pinned: the server and tools packages accept older SDKs, which lack their imports.
    pins = [f"openhands-agent-server=={version}", f"openhands-tools=={version}", f"openhands-sdk=={version}"]
    cflags: list[str] = []
    if constraints:
        (venv / "constraints.txt").write_text("\n".join(constraints) + "\n")
        cflags = ["-c", str(venv / "constraints.txt")]
    py = str(venv / "bin" / "python")
    res = subprocess.run([py, "-I", "-m", "pip", "install", "-q", *cflags, *pins], capture_output=True, text=True)
    if res.returncode == 0:  # the env must run the server by itself, as the sandbox runs it
        res = subprocess.run([py, "-I", "-c", "import openhands.agent_server.api, openhands.tools"],
                             capture_output=True, text=True)
    if res.returncode != 0:
        raise errors.ConfigError(f"building the agent-server env {venv} failed: {res.stderr[-800:]}")
    (venv / ".installed").write_text("\n".join(pins) + "\n")
    return venv


def installed_versions(roots: Sequence[str] = ("openhands-agent-server", "openhands-tools")) -> list[str]:
    """``name==version`` of ``roots`` and everything they require, as installed here.

    Constraints that make an agent-server env resolve as this venv did (e.g. the app server's),
    and stay the same when unrelated packages are added to this venv.
    """
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(f"{n}=={v}" for n, v in seen.items())


def agent_server_service(
    env: Path | None = None,
    *,
    preload: tuple[str, ...] = (),
    python_path: tuple[str, ...] = (),
    ready_timeout: float = 600.0,
) -> ServiceSpec:
    """The :class:`ServiceSpec` that runs the agent-server in every sandbox of a local backend.

    Usage: ``LocalBackend(service=agent_server_service(preload=("my_llm",), python_path=(d,)))``.

    Args:
        env: The agent-server env (default :func:`agent_server_env`).
        preload: Modules imported in the server process before it serves (a scripted LLM
            provider, custom tools), like the agent-server's ``--import-modules``.
        python_path: Host directories bind-mounted read-only and put on the server's
            ``sys.path`` for ``preload``.
        ready_timeout: Seconds the server may take to answer ``/health``.

    Returns:
        The service spec.
    """
    env = env or agent_server_env()
    base = subprocess.run([str(env / "bin" / "python"), "-c", "import sys; print(sys.base_prefix)"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # python_path directories get fixed paths inside the sandbox: bound at their host path, one
    # under /tmp (a checkout there) would put a mount point into the scratch space reset empties.
    inside = tuple(f"{_PATH_IN_SANDBOX}/{i}" for i in range(len(python_path)))
    binds = ((str(env), str(env)), (base, base), *zip(python_path, inside))
    service_env = {
        "SANDPOOL_OH_SOCKET": SOCKET,
        # OpenHands' terminal and file editor register on import; the server resolves tools by name.
        "SANDPOOL_OH_PRELOAD": ",".join(("openhands.tools.terminal", "openhands.tools.file_editor", *preload)),
        "SANDPOOL_OH_PATH": ":".join(inside),
        "OH_ENABLE_VSCODE": "false",
        "OH_ENABLE_VNC": "false",
        "OH_PRELOAD_TOOLS": "false",
        # tmux (the server's terminal backend) would keep its sockets in /tmp, which reset clears.
        "TMUX_TMPDIR": f"{SERVICE_DIR}/tmux",
        "OPENHANDS_SUPPRESS_BANNER": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        # PATH stays the sandbox's: the agent's terminal must run the task's own python and
        # tools, the ones the grader runs, not the server's env (started by its full path).
    }
    py = f"{env}/bin/python"
    # Each sandbox's server demands its own X-Session-API-Key (LocalSandbox.service_env).
    return ServiceSpec(argv=(py, "-I", "-c", _LAUNCHER), env=service_env, binds=binds, secret_env=(SESSION_KEY,),
                       socket=SOCKET.rsplit("/", 1)[1],
                       ready_argv=(py, "-I", "-c", _READY, SOCKET), ready_timeout=ready_timeout,
                       reset_argv=(py, "-I", "-c", _RESET))
