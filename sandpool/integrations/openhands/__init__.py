"""OpenHands on pooled sandboxes: three routes, one per module.

* Agent loop on the host, tools in the sandbox (openhands-sdk / -tools 1.58):
  :func:`run_conversation`, :func:`openhands_episode` (``conversation.py``, ``tools.py``,
  ``editor.py``).
* The agent-server inside the sandbox (1.58): :class:`SandpoolWorkspace`, an OpenHands
  ``RemoteWorkspace`` (``workspace.py``), over a local backend started with
  :func:`agent_server_service` (``server.py``) and reached through :class:`UnixRelay`, or
  over a Kubernetes backend started with :func:`agent_server_pod_service` (``pod_server.py``)
  and reached through a :class:`Relay` over ``pods/portforward``.
* The app server's sandbox selection (openhands-ai 1.11.0):
  ``OH_SANDBOX_KIND=sandpool.integrations.openhands.SandpoolSandboxServiceInjector``
  (``app_server.py``).

Names load lazily, so each route imports only the OpenHands packages it needs (the app server's
venv has an older SDK than the other two routes use).

Importing this package sets ``LITELLM_LOCAL_MODEL_COST_MAP=True`` unless already set: litellm
(imported by openhands-sdk) otherwise fetches its model cost map over the network at import,
and sandboxes and CI have no network.
"""

import importlib
import os
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

_WHERE = {
    "ConversationResult": "conversation",
    "openhands_episode": "conversation",
    "run_conversation": "conversation",
    "task_instruction": "conversation",
    "SandboxFileEditorExecutor": "editor",
    "SandboxLink": "tools",
    "SandboxTerminalExecutor": "tools",
    "sandbox_tool_specs": "tools",
    "SandpoolWorkspace": "workspace",
    "agent_server_env": "server",
    "agent_server_service": "server",
    "agent_server_pod_service": "pod_server",
    "Relay": "relay",
    "UnixRelay": "relay",
    "SandpoolSandboxServiceInjector": "app_server",
    "SandpoolAppLifespanService": "app_server",
    "SandpoolSandboxSpecServiceInjector": "app_server",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
