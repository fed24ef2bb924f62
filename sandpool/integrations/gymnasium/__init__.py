"""Gymnasium integration: ``sandpool/SWE-v0`` as a single env and as a native vector env.

``import sandpool`` registers the id when gymnasium is installed; then::

    env = gym.make("sandpool/SWE-v0", tasks="tasks.jsonl")           # SWEEnv
    envs = gym.make_vec("sandpool/SWE-v0", num_envs=8, tasks=tasks)   # SWEVectorEnv, one pool

``gym.make("sandpool:sandpool/SWE-v0", ...)`` works without importing sandpool first.

``SyncVectorEnv`` / ``AsyncVectorEnv`` over the single env also work. ``AsyncVectorEnv``'s
default shared memory handles ``Text`` (one ``int32`` per character of ``max_length``, copied
character by character); ``shared_memory=False`` pickles the strings instead and is faster
for these long text observations, so it is the recommended setting. Each ``AsyncVectorEnv``
worker has its own pool: a :class:`BackgroundPool` cannot be shared across processes.

Observation text escapes what is outside :data:`CHARSET` reversibly; :func:`from_text`
gives back the exact bytes (see :mod:`sandpool.integrations.gymnasium._text`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandpool.integrations.gymnasium.registration import ENV_ID, register_envs

if TYPE_CHECKING:
    from sandpool.integrations.gymnasium._text import CHARSET, from_text
    from sandpool.integrations.gymnasium.background import BackgroundPool
    from sandpool.integrations.gymnasium.config import EnvConfig
    from sandpool.integrations.gymnasium.env import SWEEnv
    from sandpool.integrations.gymnasium.vector import SWEVectorEnv

__all__ = ["CHARSET", "ENV_ID", "BackgroundPool", "EnvConfig", "SWEEnv", "SWEVectorEnv", "from_text",
           "register_envs"]

_LAZY = {
    "CHARSET": "sandpool.integrations.gymnasium._text",
    "from_text": "sandpool.integrations.gymnasium._text",
    "BackgroundPool": "sandpool.integrations.gymnasium.background",
    "EnvConfig": "sandpool.integrations.gymnasium.config",
    "SWEEnv": "sandpool.integrations.gymnasium.env",
    "SWEVectorEnv": "sandpool.integrations.gymnasium.vector",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that registration at `import sandpool` does not import the envs.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
