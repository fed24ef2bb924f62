"""Where a pod's service (``KubernetesBackend(service=ServiceSpec(..., port=N))``) lives.

The backend starts the service through the sandbox's agent session (the agent's ``service``
op: its own session, spared by ``ps`` and ``kill_strays``, hence by the in-place reset) when
the sandbox is created, i.e. while the pool warms, and waits for its readiness command before
the sandbox is handed out (:func:`sandpool.core.agent.service.start`, as on the local
backend). The service listens on :attr:`ServiceSpec.port` inside the pod (declared as the
container's ``ports``); the host reaches it through ``pods/portforward``
(:meth:`KubernetesSandbox.connect_service`).

Where it runs: in the pod's service directory, ``$SANDPOOL_POD_RUN/service``
(``/run/sandpool/service`` when the cluster sets no ``SANDPOOL_POD_RUN``), outside the repo and
outside ``/tmp``; its output goes to the agent's stderr, i.e. to the host (the session's
``stderr_tail``), never to a file the next rollout could read. Its code must be in the image
or a mounted volume: no host directory is bound into a pod (``ServiceSpec.binds`` is refused;
on the kwok test cluster a pod's exec is a host process, so host paths are visible as they
are).

The in-place reset holds it to its fresh state as the local backend does
(:func:`sandpool.core.agent.service.restore`); the service directory's tree is walked inside
the pod by the agent's interpreter (:data:`TREE`, the same walk as the local backend's, from
its source).
"""

from __future__ import annotations

import inspect

from sandpool.core.agent import service
from sandpool.core.service import ServiceSpec

__all__ = ["IN_SERVICE_DIR", "TREE", "service_dir_argv"]

#: The pod's service directory, as a shell word.
IN_SERVICE_DIR = '"${SANDPOOL_POD_RUN:-/run/sandpool}/service"'
#: Runs the service's argv in its directory.
_IN_DIR = f'd={IN_SERVICE_DIR}; mkdir -p "$d" && cd "$d" && exec "$@"'
#: Prints the service directory's tree (argv[1]) as JSON, inside the pod (stdlib only).
TREE = "\n".join([
    "import hashlib, json, os, stat, sys", "from pathlib import Path", f"_TREE_MAX = {service._TREE_MAX}",
    inspect.getsource(service._sha256), inspect.getsource(service.tree),
    "print(json.dumps(tree(Path(sys.argv[1]))))"])


def service_dir_argv(spec: ServiceSpec) -> list[str]:
    """The argv the agent starts: ``spec.argv`` run in the pod's service directory."""
    return ["/bin/sh", "-c", _IN_DIR, "sh", *spec.argv]
