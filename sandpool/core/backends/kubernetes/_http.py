"""The HTTP layer of the Kubernetes backend: REST, watch and exec over one aiohttp session.

kubernetes_asyncio loads the kubeconfig (TLS client certificates, bearer tokens, exec
plugins) and builds the TLS session; requests go straight over that session so that
throttling, retries and error translation sit in one place:

* writes (POST/PUT/PATCH/DELETE) pass the cluster's write bucket
  (:class:`~._throttle.Throttle`), whose rate adapts to the cluster's answers
  (:class:`~sandpool.core.rate.AdaptiveRate`: 429, ``Retry-After``, 5xx, refused
  connections and slow writes back it off; fast writes bring it back to ``qps``);
* every REST request holds one of ``max_inflight`` slots (watches and exec streams do not);
* 429, 5xx and connection errors are retried with exponential backoff and jitter, and a
  ``Retry-After`` header sets the wait; after ``retries`` retries the error is raised;
* every lower-layer error is translated by :mod:`._errors`.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlencode

import aiohttp
from sandpool.core import errors
from sandpool.core.backends.kubernetes._errors import RETRY_STATUSES, Channel, for_status, translate
from sandpool.core.backends.kubernetes._kubeconfig import load_api_client
from sandpool.core.backends.kubernetes._throttle import Throttle, backoff_delay, parse_retry_after
from sandpool.core.telemetry import NO_METRICS, Telemetry

# Throttle and the backoff are :mod:`._throttle`'s; named here too for callers that build a KubeHttp.
__all__ = ["KubeHttp", "Throttle", "backoff_delay", "parse_retry_after"]

_WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def resource_of(path: str) -> str:
    """The resource an API path names, for a metric label: ``pods``, ``sandboxclaims``,
    ``pods/exec`` (a subresource); never a namespace or an object name."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]  # past /api/v1 or /apis/<group>/<v>
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    if not rest:
        return "unknown"
    return f"{rest[0]}/{rest[2]}" if len(rest) >= 3 else rest[0]


def _write_key(method: str, path: str) -> str:
    """``"VERB resource"`` of a write, with ``/x`` when the path names one object (so a
    collection delete and per-object deletes are told apart)."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    return f"{method} {resource_of(path)}{'/x' if len(rest) == 2 else ''}"


class KubeHttp:
    """REST, watch and exec requests to one kube-apiserver.

    Usage: ``http = KubeHttp(None, Throttle(50, 100, 64), kubeconfig=path)``; the first
    request loads the kubeconfig (or ``await http.open()``); ``await http.aclose()`` at the end.

    Args:
        api_client: A ``kubernetes_asyncio.client.ApiClient`` built from the kubeconfig, whose
            aiohttp session (TLS, connection pool) carries every request; None builds one
            from ``kubeconfig`` at :meth:`open`.
        throttle: Write rate and in-flight bounds.
        kubeconfig: The kubeconfig path (None: ``$KUBECONFIG`` or ``~/.kube/config``).
        retries: Retries after the first attempt on 429/5xx/connection errors.
        request_timeout: Seconds one REST request may take.
    """

    def __init__(
        self,
        api_client: Any | None,
        throttle: Throttle,
        *,
        kubeconfig: str | None = None,
        retries: int = 6,
        request_timeout: float = 30.0,
    ) -> None:
        self.api_client = api_client
        self.kubeconfig = kubeconfig
        self.throttle = throttle
        self.retries = retries
        self.request_timeout = request_timeout
        self.writes = 0  #: write requests sent (every attempt counts)
        #: writes by "VERB resource" (the path's resource segment; "/x" for one object)
        self.writes_by: Counter[str] = Counter()
        self.reads = 0  #: read requests sent
        self.execs = 0  #: exec streams opened
        self.retried = 0  #: attempts that were retried
        self.telemetry: Telemetry = NO_METRICS  #: the pool's series (writes, retries)
        self._open_lock = asyncio.Lock()
        self._closed = False

    @property
    def host(self) -> str:
        """The API server's URL (empty before :meth:`open`)."""
        return "" if self.api_client is None else self.api_client.configuration.host.rstrip("/")

    async def open(self) -> None:
        """Build the client from the kubeconfig, once; every request calls it first.

        Raises:
            BackendUnavailable: The kubeconfig is missing or cannot be used (its path named).
            PoolClosed: After :meth:`aclose`.
        """
        if self._closed:
            raise errors.PoolClosed("this Kubernetes client was closed; make a new one")
        if self.api_client is None:
            async with self._open_lock:
                if self.api_client is None:
                    self.api_client = await load_api_client(self.kubeconfig)
        if not self.throttle.rate.cluster:
            self.throttle.rate.cluster = self.host.split("://", 1)[-1]

    async def aclose(self) -> None:
        """Close the client's connections; idempotent."""
        self._closed = True
        if self.api_client is not None:
            await self.api_client.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.api_client.rest_client.pool_manager

    async def headers(self) -> dict[str, str]:
        """Authorization headers from the kubeconfig (bearer token, refreshed if a hook is set)."""
        auth = await self.api_client.configuration.auth_settings()
        h = {"Accept": "application/json"}
        if "BearerToken" in auth:
            h["Authorization"] = auth["BearerToken"]["value"]
        return h

    def url(self, path: str, query: Mapping[str, Any] | None = None) -> str:
        q = {k: v for k, v in (query or {}).items() if v is not None}
        return self.host + path + (("?" + urlencode(q, doseq=True)) if q else "")

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        ok_missing: bool = False,
        ok_exists: bool = False,
        content_type: str = "application/json",
    ) -> dict[str, Any] | None:
        """Send one REST request, throttled and retried; return the decoded JSON answer.

        Args:
            method: HTTP verb.
            path: API path, e.g. ``/api/v1/namespaces/ns/pods``.
            body: JSON-serializable body.
            query: Query parameters.
            ok_missing: Return None on 404 instead of raising.
            ok_exists: Return None on 409 AlreadyExists (idempotent create).
            content_type: Body content type (merge patches use
                ``application/merge-patch+json``).

        Raises:
            ApiError: 429/5xx/connection errors after the retry budget, or a conflict.
            BackendUnavailable: 401/403 (RBAC) or broken TLS/kubeconfig.
            ConfigError: 400/422, the server rejected the object.
            InfraTimeout: No answer within ``request_timeout`` on every attempt.
        """
        await self.open()
        method = method.upper()
        write = method in _WRITE_VERBS
        what = f"{method} {path}"
        data = json.dumps(body) if body is not None else None
        attempt = 0
        loop = asyncio.get_running_loop()
        while True:
            attempt += 1
            retry_after = status = sent = None
            try:
                async with self.throttle.slot(write=write):
                    if write:
                        self.writes += 1
                        self.telemetry.api_write(method, resource_of(path))
                        self.writes_by[_write_key(method, path)] += 1
                    else:
                        self.reads += 1
                    headers = await self.headers()
                    if data is not None:
                        headers["Content-Type"] = content_type
                    sent = loop.time()
                    async with self.session.request(
                        method,
                        self.url(path, query),
                        data=data,
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                    ) as resp:
                        text = await resp.text()
                        status = resp.status
                        retry_after = parse_retry_after(resp.headers.get("Retry-After"))
                self._answered(write, status, loop.time() - sent, retry_after)
                if status < 400:
                    return json.loads(text) if text else {}
                if status == 404 and ok_missing:
                    return None
                if status == 409 and (ok_exists or (attempt > 1 and method == "POST")):
                    # AlreadyExists: ours from an earlier attempt whose answer was lost.
                    return None
                if status not in RETRY_STATUSES or attempt > self.retries:
                    raise for_status(status, what, text)
            except (
                aiohttp.ClientConnectionError,
                aiohttp.ClientPayloadError,
                TimeoutError,
                OSError,
            ) as exc:
                if sent is not None:
                    self._answered(write, None, loop.time() - sent, None)
                if attempt > self.retries:
                    raise translate(exc, what) from exc
            except errors.SandpoolError:
                raise
            except Exception as exc:  # noqa: BLE001 - translated at this one boundary
                raise translate(exc, what) from exc
            self.retried += 1
            self.telemetry.api_retry(status)
            await asyncio.sleep(backoff_delay(attempt, retry_after=retry_after))

    def _answered(self, write: bool, status: int | None, seconds: float,
                  retry_after: float | None) -> None:
        """Tell the write bucket how the cluster answered: every 429, ``Retry-After``, 5xx or
        lost connection; a write's latency (slow or fast). A read's latency says nothing of
        the write budget (a large list is slow on a healthy server)."""
        if write or status is None or status == 429 or status >= 500:
            self.throttle.rate.answered(asyncio.get_running_loop().time(), status, seconds,
                                        retry_after=retry_after)

    async def watch(self, path: str, query: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Yield watch events (``{"type", "object"}``) from one watch request until it ends.

        Raises:
            ApiError, BackendUnavailable, ...: As :meth:`request`; a 410 Gone is raised as
                :class:`ApiError` with ``status=410`` for the caller to re-list.
        """
        await self.open()
        what = f"WATCH {path}"
        q = dict(query, watch="true", allowWatchBookmarks="true")
        try:
            async with self.session.get(
                self.url(path, q),
                headers=await self.headers(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None),
            ) as resp:
                self.reads += 1
                if resp.status >= 400:
                    raise for_status(resp.status, what, await resp.text())
                async for line in resp.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        obj = event.get("object") or {}
                        raise errors.ApiError(
                            f"{what}: {obj.get('message', obj)}", status=obj.get("code")
                        )
                    yield event
        except errors.SandpoolError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated at this one boundary
            raise translate(exc, what, channel=Channel.WATCH) from exc

    async def ws_connect(
        self,
        path: str,
        query: list[tuple[str, str]],
        protocols: tuple[str, ...],
        *,
        connect_timeout: float = 30.0,
        accept: str = "*/*",
    ) -> aiohttp.ClientWebSocketResponse:
        """Open a WebSocket to ``path`` (the exec subresource), retrying as :meth:`request` does.

        A handshake answered 429 (a throttling proxy or API gateway in front of the API server;
        kube-apiserver itself exempts exec from APF) or 5xx (500 when the API server cannot dial
        the node's kubelet), or a refused or reset connection, is retried
        up to ``retries`` times with the same backoff, a ``Retry-After`` header setting the
        wait; every retry is counted in ``retried`` and in ``sandpool_kube_api_retries_total``.
        Only an opened stream counts in ``execs``. Used by the agent session's one stream, the
        per-command fallback exec and so its file transfer.

        Args:
            path: The exec subresource's path.
            query: Its query (container, stdin/stdout/stderr, command...).
            protocols: The channel subprotocols offered, preferred first.
            connect_timeout: Seconds one handshake may take (a timeout is not retried).

        Returns:
            The open WebSocket.

        ``accept`` is the ``Accept`` header: any, as kubectl's; a kubelet's CRI stream answers
        an upgrade accepting only JSON with 406 (and kwok 0.8's answers a port-forward asking
        for JSON with 406).

        Raises:
            SandboxDied: 404, the pod is gone.
            ExecTransportError: The handshake failed (after ``retries`` retries for 429/5xx
                and connection errors); an infra error, so the rollout is retried, never scored.
            BackendUnavailable: 401/403.
        """
        await self.open()
        url = self.host.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        url += path + "?" + urlencode(query)
        what = f"EXEC {path}"
        attempt = 0
        while True:
            attempt += 1
            retry_after = status = None
            try:
                ws = await asyncio.wait_for(
                    self.session.ws_connect(
                        url,
                        protocols=protocols,
                        headers={**await self.headers(), "Accept": accept},
                        max_msg_size=0,
                        autoping=True,
                    ),
                    connect_timeout,
                )
                self.execs += 1
                return ws
            except aiohttp.WSServerHandshakeError as exc:
                status = exc.status
                retry_after = parse_retry_after((exc.headers or {}).get("Retry-After"))
                if status == 429:  # a 5xx here is the node's (kubelet unreachable), not the API's
                    self._answered(False, status, 0.0, retry_after)
                if status not in RETRY_STATUSES or attempt > self.retries:
                    raise _after(translate(exc, what, channel=Channel.EXEC), attempt) from exc
            except (aiohttp.ClientConnectionError, OSError) as exc:
                if attempt > self.retries:
                    raise _after(translate(exc, what, channel=Channel.EXEC), attempt) from exc
            except Exception as exc:  # noqa: BLE001 - translated at this one boundary
                raise translate(exc, what, channel=Channel.EXEC) from exc
            await self.retry_wait(attempt, status, retry_after)

    async def retry_wait(
        self, attempt: int, status: int | None, retry_after: float | None = None
    ) -> bool:
        """Count a retry after failed ``attempt`` (1-based; ``status`` None: a connection error)
        and wait its backoff; return False, without waiting, when ``retries`` are spent."""
        if attempt > self.retries:
            return False
        self.retried += 1
        self.telemetry.api_retry(status)
        await asyncio.sleep(backoff_delay(attempt, retry_after=retry_after))
        return True


def _after(err: errors.SandpoolError, attempt: int) -> errors.SandpoolError:
    """``err`` with the retries spent before it in its message (none: unchanged)."""
    if attempt <= 1 or not isinstance(err, errors.ExecTransportError):
        return err
    return errors.ExecTransportError(f"{err} (after {attempt - 1} retries)")
