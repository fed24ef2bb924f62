"""The Kubernetes backend: agent-sandbox (v1beta1) warm pools and claims, or plain pods.

Layout: :mod:`.backend` (the backend: shared state, create/delete/close) assembled from its
seams :mod:`._claims` (templates, warm pools, claims), :mod:`._pods` (plain pods, pod
status), :mod:`._preflight` and :mod:`._gc`; :mod:`._sandbox` (the sandbox) over
:mod:`._exec` (the exec channel protocol and the in-pod command wrapper), :mod:`._service`
(a long-lived service per pod) and :mod:`._portforward` (a connection to a pod's port); :mod:`._http`
(REST/watch/exec over one session, throttled and retried), :mod:`._errors` (the one
error-translation boundary), :mod:`._watch` (the shared watch per resource),
:mod:`._manifests` (the objects sent). The kwok test cluster's pieces live in
:mod:`sandpool.testing.kwok`.

The client library (``kubernetes_asyncio``, with ``aiohttp``; the ``sandpool[kubernetes]``
extra) is imported on first use of a name from this package, never by :mod:`sandpool.core`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ImageMap",
    "KubernetesBackend",
    "KubernetesSandbox",
    "PodImage",
    "PodService",
    "gc",
]

_WHERE = {"PodImage": "_manifests", "PodService": "_service"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(name)
    try:
        mod = importlib.import_module(f"{__name__}.{_WHERE.get(name, 'backend')}")
    except ImportError as exc:
        from sandpool.core.errors import BackendUnavailable

        raise BackendUnavailable(
            f"the kubernetes backend needs {exc.name or 'kubernetes_asyncio'}; "
            "install it with: pip install 'sandpool[kubernetes]'"
        ) from exc
    return getattr(mod, name)
