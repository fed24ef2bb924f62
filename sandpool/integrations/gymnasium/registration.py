"""Registration of ``sandpool/SWE-v0`` with Gymnasium (imports nothing heavy itself)."""

from __future__ import annotations

__all__ = ["ENV_ID", "register_envs"]

#: The Gymnasium id of the SWE environment.
ENV_ID = "sandpool/SWE-v0"


def register_envs() -> None:
    """Register ``sandpool/SWE-v0`` (single and vector entry points). Idempotent.

    The entry points are strings, so nothing of the env is imported until ``gym.make``.

    Raises:
        ImportError: gymnasium is not installed.
    """
    import gymnasium

    if ENV_ID in gymnasium.registry:
        return
    gymnasium.register(
        id=ENV_ID,
        entry_point="sandpool.integrations.gymnasium.env:SWEEnv",
        vector_entry_point="sandpool.integrations.gymnasium.vector:SWEVectorEnv",
    )
