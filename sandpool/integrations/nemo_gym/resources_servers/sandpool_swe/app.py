"""NeMo Gym entrypoint of the ``sandpool_swe`` resources server.

NeMo Gym starts it as ``python app.py`` from this directory, with the merged config in its
environment; see :class:`sandpool.integrations.nemo_gym.server.SandpoolSweResourcesServer`.
"""

from sandpool.integrations.nemo_gym.server import SandpoolSweResourcesServer

if __name__ == "__main__":
    SandpoolSweResourcesServer.run_webserver()
