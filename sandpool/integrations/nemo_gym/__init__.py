"""NeMo Gym integration: the ``sandpool_swe`` resources server and the ``sandpool`` sandbox provider.

Needs the ``nemo-gym`` extra (Python >= 3.12): ``pip install 'sandpool[nemo-gym]'``.

* :mod:`.server` -- :class:`~.server.SandpoolSweResourcesServer`, started by NeMo Gym from
  ``resources_servers/sandpool_swe/app.py`` under :data:`ROOT`.
* :mod:`.provider` -- :class:`~.provider.SandpoolProvider`, registered under the
  ``nemo_gym.sandbox_providers`` entry-point group as ``sandpool``.
* :mod:`.protocol` -- the server's request/response bodies, NeMo Gym 0.4/0.7 differences and
  the mapping of errors to HTTP answers.
* :mod:`.config` -- the ``sandpool:`` YAML block both share (importable without NeMo Gym).
* :mod:`.sessions` -- NeMo Gym sessions mapped to leased sandboxes, with idle reclaim.
* :mod:`.prefetch` -- the next batch warmed ahead: the server's ``/prefetch`` and the call
  NeMo Gym's side makes.

NeMo Gym resolves a resources server as ``resources_servers/<name>/`` under the directory it
is started from; :data:`ROOT` is such a directory, so NeMo Gym runs the server from here::

    cd "$(python -m sandpool.integrations.nemo_gym)"   # prints ROOT
    ng_run "+config_paths=[resources_servers/sandpool_swe/configs/sandpool_swe.yaml]"
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIG_PATH", "ROOT", "SERVER_DIR"]

#: A NeMo Gym working directory holding ``resources_servers/sandpool_swe``.
ROOT = Path(__file__).resolve().parent
#: The resources server directory (``app.py``, ``configs/``, ``requirements.txt``).
SERVER_DIR = ROOT / "resources_servers" / "sandpool_swe"
#: The shipped server config.
CONFIG_PATH = SERVER_DIR / "configs" / "sandpool_swe.yaml"
