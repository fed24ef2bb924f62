"""The sandbox agent: the one process every sandbox runs, and the host's side of its protocol.

* ``_agent.py``: the agent, a single stdlib script run inside every sandbox of every backend.
* :mod:`.client`: the host-side client that speaks the agent's JSON-lines protocol.
"""
