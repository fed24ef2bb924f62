"""Sandbox backends: local (bubblewrap) and kubernetes (agent-sandbox), plus an in-memory one for unit tests."""
