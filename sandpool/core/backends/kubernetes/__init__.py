"""The Kubernetes backend: agent-sandbox (v1beta1) warm pools and claims, or plain pods.

Layout: :mod:`.backend` (the backend: its options, create/delete/close) over its parts, each
made from the options by :mod:`._parts` and given what it uses: :mod:`._http`
(REST/watch/exec over one session, throttled and retried; :mod:`._kubeconfig` loads its
client), :mod:`._watch` (the shared watch per resource), :mod:`._images` (task image -> pod
spec), :mod:`._claims` (templates, warm pools, claims, Sandbox objects), :mod:`._pods`
(plain pods, pod status), :mod:`._live` (a Ready pod made a sandbox, its death),
:mod:`._presession` (sessions opened on warm pods), :mod:`._prepull` (placement,
:mod:`._placement`, and prepull), :mod:`._preflight` and :mod:`._gc` (deletes by object and
by run id). The sandbox: :mod:`._sandbox` (an agent-backed sandbox) over :mod:`._session`
(the agent over one pod stream, :mod:`._channel`) and :mod:`._exec` (the degraded mode: one
exec per command), :mod:`._service` (where a pod's service lives) and :mod:`._portforward`
(a connection to a pod's port). :mod:`._errors` is the one error-translation boundary and
:mod:`._manifests` the objects sent.

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
    "gc",
]

_WHERE = {"PodImage": "_manifests"}


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
