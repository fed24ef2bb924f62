"""Deleting what a run made: one object at a time, in batches, or everything by run id.

:class:`Deleter` deletes the backend's objects as sandboxes end (at once, or batched into
one collection delete per resource), and everything labelled with its run id at close.
:func:`gc` is ``sandpool gc --run-id``: the same run-id delete over a client of its own.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._http import KubeHttp, Throttle
from sandpool.core.backends.kubernetes._manifests import ns_path

__all__ = ["Deleter", "delete_run", "gc"]

log = logging.getLogger("sandpool.kubernetes")

_AGENT_SANDBOX = (m.CLAIM, m.SANDBOX, m.WARMPOOL, m.TEMPLATE)


async def delete_run(
    http: KubeHttp, namespace: str, run_id: str, *, agent_sandbox: bool = True
) -> dict[str, int]:
    """Delete every object labelled ``sandpool.io/run-id=<run_id>`` in ``namespace``.

    One list and one ``deletecollection`` per resource: claims and Sandbox objects first
    (their sandboxes and pods follow by owner references), then warm pools, templates and
    plain pods (prepull pods included). A resource the cluster does not serve is skipped.

    Args:
        agent_sandbox: Also delete the agent-sandbox objects (claims, Sandbox objects, warm
            pools, templates).

    Returns:
        Objects found per resource.
    """
    sel = {"labelSelector": f"{m.RUN_ID_LABEL}={run_id}"}
    found: dict[str, int] = {}
    for res in (*(_AGENT_SANDBOX if agent_sandbox else ()), "pods"):
        path = ns_path(namespace, res)
        listed = await http.request("GET", path, query=sel, ok_missing=True)
        found[res] = len((listed or {}).get("items", []))
        if found[res]:
            q = dict(sel, propagationPolicy="Background")
            if res == "pods":
                q["gracePeriodSeconds"] = "0"
            await http.request("DELETE", path, query=q, ok_missing=True)
    return found


class Deleter:
    """Deletes one run's objects in one namespace.

    Args:
        http: The HTTP layer.
        namespace: Where the objects are.
        run_id: The run-id label value of everything the run made.
        batch_s: Seconds a delete may wait to join others of its resource in one collection
            delete (by the per-object label ``sandpool.io/obj``); None deletes each at once.
    """

    def __init__(self, http: KubeHttp, namespace: str, run_id: str, batch_s: float | None) -> None:
        self._http = http
        self.namespace = namespace
        self.run_id = run_id
        self.batch_s = batch_s
        self._pending: dict[str, set[str]] = {}  # resource -> names
        self._flusher: asyncio.Task[None] | None = None

    async def delete(self, resource: str, name: str) -> None:
        """Delete one object now, or (``batch_s``) with others of its resource in one
        collection delete by ``sandpool.io/obj in (...)`` within that many seconds.

        Logs (does not raise) an API failure: ``sandpool gc --run-id`` removes it later.
        """
        if self.batch_s is not None:
            self._pending.setdefault(resource, set()).add(name)
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush_later())
            return
        query = {"propagationPolicy": "Background"}
        if resource == "pods":
            query["gracePeriodSeconds"] = "0"
        try:
            await self._http.request(
                "DELETE", f"{ns_path(self.namespace, resource)}/{name}", query=query,
                ok_missing=True,
            )
        except errors.InfraError as exc:  # gc by run id removes what this could not
            self._log_failure(resource, name, exc)

    async def delete_run(self) -> None:
        """Drop the pending batch and delete everything of the run (by its run-id label).

        Logs (does not raise) a failure, naming the ``sandpool gc`` command.
        """
        if self._flusher is not None:
            self._flusher.cancel()  # the delete by run id removes what it held
        self._pending.clear()
        try:
            await delete_run(self._http, self.namespace, self.run_id)
        except errors.SandpoolError as exc:
            log.warning(
                "could not delete run %s's objects in %s: %s; run `sandpool gc --run-id %s "
                "--namespace %s`", self.run_id, self.namespace, exc, self.run_id, self.namespace,
            )

    def _log_failure(self, resource: str, name: str, exc: Exception) -> None:
        log.warning(
            "deleting %s/%s failed: %s (sandpool gc --run-id %s removes it)",
            resource, name, exc, self.run_id,
        )

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.batch_s or 0)
        await self.flush()

    async def flush(self) -> None:
        """Send every pending delete: one collection delete per resource per 100 names."""
        pending, self._pending = self._pending, {}
        for resource, names in pending.items():
            ordered = sorted(names)
            for i in range(0, len(ordered), 100):
                chunk = ordered[i : i + 100]
                query = {
                    "labelSelector": f"{m.RUN_ID_LABEL}={self.run_id},"
                    f"{m.OBJ_LABEL} in ({','.join(chunk)})",
                    "propagationPolicy": "Background",
                }
                if resource == "pods":
                    query["gracePeriodSeconds"] = "0"
                try:
                    await self._http.request(
                        "DELETE", ns_path(self.namespace, resource), query=query, ok_missing=True
                    )
                except errors.InfraError as exc:
                    self._log_failure(resource, f"{{{len(chunk)} objects}}", exc)


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
        agent_sandbox: Also delete claims, Sandbox objects, warm pools and templates (skipped,
            not an error, when the CRDs are not installed).

    Returns:
        Objects found (and deleted) per resource.

    Raises:
        ConfigError: ``run_id`` is not a run id sandpool makes.
        BackendUnavailable: The cluster is unreachable or RBAC denies the deletes.
    """
    m.check_run_id(run_id)
    http = KubeHttp(None, Throttle(50.0, 100, 64),
                    kubeconfig=str(kubeconfig) if kubeconfig else None)
    try:
        return await delete_run(http, namespace, run_id, agent_sandbox=agent_sandbox)
    finally:
        await http.aclose()
