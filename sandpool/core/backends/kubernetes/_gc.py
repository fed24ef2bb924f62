"""Garbage collection by run id: delete everything one run labelled (``sandpool gc``)."""

from __future__ import annotations

from pathlib import Path

from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._http import KubeHttp
from sandpool.core.backends.kubernetes._manifests import ns_path

__all__ = ["delete_run", "gc"]

_GC_ORDER = (m.CLAIM, m.SANDBOX, m.WARMPOOL, m.TEMPLATE, "pods")


async def delete_run(http: KubeHttp, namespace: str, run_id: str) -> dict[str, int]:
    """Delete every object labelled ``sandpool.io/run-id=<run_id>`` in ``namespace``.

    One list and one ``deletecollection`` per resource: claims and Sandbox objects first
    (their sandboxes and pods follow by owner references), then warm pools, templates and
    plain pods (prepull pods included).

    Returns:
        Objects found per resource.
    """
    sel = {"labelSelector": f"{m.RUN_ID_LABEL}={run_id}"}
    found: dict[str, int] = {}
    for res in _GC_ORDER:
        path = ns_path(namespace, res)
        listed = await http.request("GET", path, query=sel, ok_missing=True)
        found[res] = len((listed or {}).get("items", []))
        if found[res]:
            q = dict(sel, propagationPolicy="Background")
            if res == "pods":
                q["gracePeriodSeconds"] = "0"
            await http.request("DELETE", path, query=q, ok_missing=True)
    return found


async def gc(
    run_id: str,
    *,
    kubeconfig: str | Path | None = None,
    namespace: str = "default",
    agent_sandbox: bool = True,
) -> dict[str, int]:
    """Remove what run ``run_id`` left in ``namespace`` (``sandpool gc --run-id``).

    Args:
        run_id: The run id label value.
        kubeconfig: The kubeconfig path.
        namespace: The namespace.
        agent_sandbox: Also delete claims, warm pools and templates (skipped, not an error, when
            the CRDs are not installed).

    Returns:
        Objects found (and deleted) per resource.

    Raises:
        BackendUnavailable: The cluster is unreachable or RBAC denies the deletes.
    """
    from sandpool.core.backends.kubernetes.backend import KubernetesBackend

    backend = KubernetesBackend(
        kubeconfig,
        namespace=namespace,
        run_id=run_id,
        mode="agent-sandbox" if agent_sandbox else "pods",
    )
    try:
        http = await backend._ensure_client()
        return await delete_run(http, namespace, run_id)
    finally:
        backend._closed = True
        if backend._client is not None:
            await backend._client.close()
