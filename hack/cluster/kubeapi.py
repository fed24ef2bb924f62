"""A tiny standard-library Kubernetes API client for hack/cluster.

It exists so that `cluster.py` and `provisioner.py` run with any Python 3.10+
and no packages: TLS with client certificates, JSON (or YAML bodies, which the
apiserver parses itself), and line-delimited watch streams.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class ApiError(Exception):
    """A non-2xx answer from the apiserver."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")


class Kube:
    """Client for one apiserver, authenticated with a client certificate.

    Usage: ``Kube(server, ca, cert, key).request("GET", "/api/v1/nodes")``.
    One instance keeps one keep-alive connection; use one instance per thread.
    """

    def __init__(
        self, server: str, ca: Path, cert: Path, key: Path, user_agent: str = "sandpool-cluster"
    ) -> None:
        parts = urlsplit(server)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 443
        self._ctx = ssl.create_default_context(cafile=str(ca))
        self._ctx.load_cert_chain(str(cert), str(key))
        self._headers = {"User-Agent": user_agent, "Accept": "application/json"}
        self._conn: http.client.HTTPSConnection | None = None

    @classmethod
    def from_pki(cls, server: str, pki: Path, user_agent: str = "sandpool-cluster") -> Kube:
        return cls(server, pki / "ca.crt", pki / "admin.crt", pki / "admin.key", user_agent)

    def _connection(self, timeout: float) -> http.client.HTTPSConnection:
        if self._conn is None:
            self._conn = http.client.HTTPSConnection(
                self.host, self.port, context=self._ctx, timeout=timeout
            )
        self._conn.timeout = timeout
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        """Send one request; return the decoded JSON answer (or text).

        Raises:
            ApiError: the apiserver answered with a status >= 300.
            OSError: the connection failed (the connection is reset for the next call).
        """
        data: bytes | None
        if body is None:
            data = None
        elif isinstance(body, (bytes, str)):
            data = body.encode() if isinstance(body, str) else body
        else:
            data = json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):
            conn = self._connection(timeout)
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A keep-alive connection closed by the server: retry once on a new one.
                self.close()
                if attempt:
                    raise
            except (OSError, http.client.HTTPException):
                self.close()
                raise
        text = raw.decode(errors="replace")
        try:
            decoded: Any = json.loads(text) if text else None
        except ValueError:
            decoded = text
        if resp.status >= 300:
            raise ApiError(resp.status, decoded)
        return decoded

    def watch(
        self, path: str, resource_version: str, timeout_seconds: int = 300
    ) -> Iterator[dict[str, Any]]:
        """Yield watch events (``{"type": ..., "object": ...}``) from a list path.

        Opens its own connection, so it can run beside ``request`` on the same instance.
        """
        sep = "&" if "?" in path else "?"
        url = (
            f"{path}{sep}watch=1&allowWatchBookmarks=true"
            f"&resourceVersion={resource_version}&timeoutSeconds={timeout_seconds}"
        )
        conn = http.client.HTTPSConnection(
            self.host, self.port, context=self._ctx, timeout=timeout_seconds + 30
        )
        try:
            conn.request("GET", url, headers=self._headers)
            resp = conn.getresponse()
            if resp.status >= 300:
                raise ApiError(resp.status, resp.read().decode(errors="replace"))
            while True:
                line = resp.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def split_yaml_documents(text: str) -> list[str]:
    """Split a multi-document YAML file on ``---`` lines, dropping empty documents."""
    docs: list[str] = []
    current: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.rstrip() == "---":
            docs.append("".join(current))
            current = []
        else:
            current.append(line)
    docs.append("".join(current))
    return [
        d
        for d in docs
        if any(ln.strip() and not ln.lstrip().startswith("#") for ln in d.splitlines())
    ]


def condition(obj: dict[str, Any], kind: str) -> str | None:
    """The status (``"True"``, ``"False"``, ``"Unknown"``) of ``obj``'s condition ``kind``
    (e.g. ``Ready``), or None when it has none."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c.get("status")
    return None
