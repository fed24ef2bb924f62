"""The one boundary where Kubernetes-client, aiohttp and WebSocket errors become sandpool errors.

Every request the backend makes (REST, watch, exec) goes through :mod:`._http`, which calls
:func:`translate` on any lower-layer exception and :func:`for_status` on an HTTP error
answer. Nothing else in the backend catches a lower-layer exception.

```
lower layer                                   sandpool error
kubernetes_asyncio ConfigException,
  FileNotFoundError (kubeconfig)           -> BackendUnavailable
HTTP 401 / 403                             -> BackendUnavailable (RBAC or credentials)
HTTP 404 on exec                           -> SandboxDied (the pod is gone)
HTTP 400 / 422                             -> ConfigError (the manifest was rejected)
HTTP 409                                   -> ApiError (conflict)
HTTP 429 / 5xx after retries               -> ApiError (REST) / ExecTransportError (exec)
aiohttp.WSServerHandshakeError             -> by its status, as above; else ExecTransportError
aiohttp.ClientConnectionError, OSError     -> ApiError (REST/watch) / ExecTransportError (exec)
aiohttp.ClientPayloadError, WebSocketError,
  WSMessageTypeError                       -> ApiError (REST/watch) / ExecTransportError (exec)
TimeoutError                               -> InfraTimeout (REST/watch) / ExecTransportError (exec)
ssl.SSLError                               -> BackendUnavailable (TLS setup is wrong)
```
"""

from __future__ import annotations

import enum
import json
import ssl

import aiohttp
from kubernetes_asyncio.config import ConfigException

from sandpool.core import errors

__all__ = ["Channel", "for_status", "translate"]

# A WebSocket frame of an unexpected type (a TypeError subclass in newer aiohttp).
_WSMessageTypeError: type[BaseException] = getattr(
    aiohttp, "WSMessageTypeError", aiohttp.WebSocketError
)

#: HTTP statuses that are retried (with backoff, honouring Retry-After).
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class Channel(enum.Enum):
    """What kind of request failed; the same lower-layer error means different things."""

    REST = "rest"
    WATCH = "watch"
    EXEC = "exec"


def _status_message(body: str) -> str:
    """The ``message`` of a Kubernetes ``Status`` answer, else the body itself (one line)."""
    try:
        msg = json.loads(body).get("message")
    except (ValueError, AttributeError):
        msg = None
    return " ".join(str(msg or body).split())


def for_status(
    status: int, what: str, body: str = "", *, channel: Channel = Channel.REST
) -> errors.SandpoolError:
    """Return the sandpool error for an HTTP error ``status`` answering ``what``.

    Args:
        status: The HTTP status code (>= 400).
        what: The request, e.g. ``"POST sandboxclaims/ns"``, for the message.
        body: The server's answer (a Status object, usually), cut for the message.
        channel: REST/watch or exec.
    """
    body = _status_message(body)
    detail = f"{what}: HTTP {status} {body[:300]}".rstrip()
    if status in (401, 403):
        return errors.BackendUnavailable(
            f"the Kubernetes API denied {what} (HTTP {status}: {body[:200]}); grant the "
            "kubeconfig's user this verb with a Role and RoleBinding"
        )
    if channel is Channel.EXEC:
        if status == 404:
            return errors.SandboxDied(f"the pod is gone: {detail}")
        return errors.ExecTransportError(f"exec handshake failed: {detail}")
    if status in (400, 422):
        return errors.ConfigError(f"the Kubernetes API rejected {detail}")
    return errors.ApiError(detail, status=status)


def translate(
    exc: BaseException, what: str, *, channel: Channel = Channel.REST
) -> errors.SandpoolError:
    """Map one lower-layer exception raised while doing ``what`` to a sandpool error.

    A :class:`~sandpool.core.errors.SandpoolError` passes through unchanged.
    """
    if isinstance(exc, errors.SandpoolError):
        return exc
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return for_status(exc.status, what, exc.message or "", channel=channel)
    if isinstance(exc, aiohttp.ClientResponseError):
        return for_status(exc.status, what, exc.message or "", channel=channel)
    if isinstance(exc, (ConfigException, FileNotFoundError)):
        return errors.BackendUnavailable(f"{what}: the kubeconfig cannot be used: {exc}")
    if isinstance(exc, ssl.SSLError) or isinstance(exc, aiohttp.ClientSSLError):
        return errors.BackendUnavailable(f"TLS to the Kubernetes API failed during {what}: {exc}")
    if isinstance(exc, TimeoutError):
        if channel is Channel.EXEC:
            return errors.ExecTransportError(f"{what}: no answer from the exec stream in time")
        return errors.InfraTimeout(f"{what}: the Kubernetes API did not answer in time")
    if isinstance(exc, (aiohttp.ClientError, aiohttp.WebSocketError, _WSMessageTypeError, OSError)):
        if channel is Channel.EXEC:
            return errors.ExecTransportError(
                f"{what}: the exec stream broke: {type(exc).__name__}: {exc}"
            )
        return errors.ApiError(
            f"{what}: cannot reach the Kubernetes API: {type(exc).__name__}: {exc}"
        )
    if isinstance(exc, (ValueError, UnicodeDecodeError)):  # garbled frame or JSON
        if channel is Channel.EXEC:
            return errors.ExecTransportError(f"{what}: garbled exec frame: {exc}")
        return errors.ApiError(f"{what}: garbled answer from the Kubernetes API: {exc}")
    raise TypeError(f"no sandpool mapping for {type(exc).__name__} during {what}") from exc
