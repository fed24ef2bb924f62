"""Sandbox backends: local (bubblewrap) and kubernetes (agent-sandbox), and
:mod:`~sandpool.core.backends.multi`, one pool over several clusters (any backends)."""
