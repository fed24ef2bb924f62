"""OpenHands on pooled sandboxes (openhands-sdk / openhands-tools 1.58, Python >= 3.12).

* :func:`run_conversation` / :func:`openhands_episode`: the agent loop and LLM on the host,
  OpenHands' ``terminal`` and ``file_editor`` tools executing in a leased sandbox.

Importing this package sets ``LITELLM_LOCAL_MODEL_COST_MAP=True`` unless already set: litellm
(imported by openhands-sdk) otherwise fetches its model cost map over the network at import,
and sandboxes and CI have no network.
"""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from sandpool.integrations.openhands.conversation import (  # noqa: E402
    ConversationError,
    ConversationResult,
    openhands_episode,
    run_conversation,
    task_instruction,
)
from sandpool.integrations.openhands.tools import (  # noqa: E402
    SandboxFileEditorExecutor,
    SandboxLink,
    SandboxTerminalExecutor,
    sandbox_tool_specs,
)

__all__ = [
    "ConversationError",
    "ConversationResult",
    "SandboxFileEditorExecutor",
    "SandboxLink",
    "SandboxTerminalExecutor",
    "openhands_episode",
    "run_conversation",
    "sandbox_tool_specs",
    "task_instruction",
]
