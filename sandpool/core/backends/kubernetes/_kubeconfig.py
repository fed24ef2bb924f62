"""Load a kubeconfig into the client whose session carries every request.

kubernetes_asyncio reads the kubeconfig (TLS client certificates, bearer tokens, exec
plugins) and builds the TLS session; :func:`load_api_client` is the one place that does
it (:meth:`~._http.KubeHttp.open` calls it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes._errors import translate

__all__ = ["kubeconfig_path", "load_api_client"]


def kubeconfig_path() -> str:
    """The kubeconfig used when none is given: the first path of ``$KUBECONFIG``, else
    ``~/.kube/config`` (as kubectl and kubernetes_asyncio choose it)."""
    env = os.environ.get("KUBECONFIG", "")
    first = next((p for p in env.split(os.pathsep) if p), "")
    return str(Path(first or "~/.kube/config").expanduser())


async def load_api_client(kubeconfig: str | Path | None = None) -> Any:
    """Load ``kubeconfig`` (default :func:`kubeconfig_path`); return a
    ``kubernetes_asyncio.client.ApiClient`` over it (the caller closes it).

    Raises:
        BackendUnavailable: No client library, no kubeconfig at the path, or one that cannot
            be used (the message names the path).
    """
    try:
        from kubernetes_asyncio.client import ApiClient, Configuration
        from kubernetes_asyncio.config import load_kube_config
    except ImportError as exc:
        raise errors.BackendUnavailable(
            "the kubernetes backend needs kubernetes_asyncio; install sandpool[kubernetes]"
        ) from exc
    path = str(Path(kubeconfig).expanduser()) if kubeconfig else kubeconfig_path()
    if not Path(path).is_file():
        raise errors.BackendUnavailable(
            f"kubeconfig {path} does not exist; pass kubeconfig=, set $KUBECONFIG, "
            "or start the test cluster (hack/cluster/cluster.py up)"
        )
    cfg = Configuration()
    try:
        await load_kube_config(config_file=path, client_configuration=cfg, persist_config=False)
    except Exception as exc:  # noqa: BLE001 - translated at the one boundary
        raise translate(exc, f"loading kubeconfig {path}") from exc
    cfg.connection_pool_maxsize = 0  # unbounded sockets: the Throttle bounds REST
    return ApiClient(configuration=cfg)
