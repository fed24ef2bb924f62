"""sandpool: warm pools of isolated sandboxes for agentic RL and evaluation on SWE-style tasks."""

__version__ = "0.1.0"


def _register_gymnasium() -> None:
    # Gymnasium 1.x has no plugin entry points: register `sandpool/SWE-v0` at import, and only
    # when gymnasium is installed. Nothing else happens here.
    import importlib.util

    if importlib.util.find_spec("gymnasium") is None:
        return
    from sandpool.integrations.gymnasium.registration import register_envs

    register_envs()


_register_gymnasium()
