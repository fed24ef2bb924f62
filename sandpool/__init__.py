"""sandpool: warm pools of isolated sandboxes for agentic RL and evaluation on SWE-style tasks."""

__version__ = "0.1.0"
