"""One shared watch per (namespace, resource): a small informer.

It lists once, then watches from the list's resourceVersion (with bookmarks), keeps the
latest object per name in a cache, and calls the subscribers of a name on every change.
Readiness waits subscribe to names; nothing polls and nothing opens a watch per claim.
A 410 Gone (history compacted) re-lists and emits the differences; any other failure
backs off and re-watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes._http import KubeHttp, backoff_delay

__all__ = ["Informer"]

log = logging.getLogger("sandpool.kubernetes")

#: A subscriber gets the object after a change, or ``None`` when it was deleted.
Subscriber = Callable[[dict[str, Any] | None], None]


class Informer:
    """Cache and change feed of one resource in one namespace, filtered by a label selector.

    Usage::

        pods = Informer(http, "/api/v1/namespaces/ns/pods", "sandpool.io/run-id=abc")
        await pods.start()                      # list + watch in a background task
        obj = await pods.wait("pod-1", lambda o: o if ready(o) else None, timeout=60)

    Args:
        http: The HTTP layer.
        path: Collection path of the resource.
        label_selector: Only objects matching it are cached.
    """

    def __init__(self, http: KubeHttp, path: str, label_selector: str) -> None:
        self.http = http
        self.path = path
        self.selector = label_selector
        self.cache: dict[str, dict[str, Any]] = {}
        self.events = 0  #: watch events seen
        self.relists = 0  #: lists made (1 + one per 410)
        self._subs: dict[str, list[Subscriber]] = {}
        self._global: list[Subscriber] = []
        self._rv = ""
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._error: errors.SandpoolError | None = None

    def __repr__(self) -> str:
        return f"<Informer {self.path} cached={len(self.cache)} events={self.events} rv={self._rv}>"

    async def start(self) -> None:
        """List and start watching; return once the cache holds the listed state.

        Raises:
            SandpoolError: The first list failed (RBAC, connection, missing resource).
        """
        if self._task is None:
            await self._list()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"sandpool-watch{self.path}"
            )
        await self._synced.wait()

    async def aclose(self) -> None:
        """Stop the watch."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def get(self, name: str) -> dict[str, Any] | None:
        """The cached object ``name``, or None."""
        return self.cache.get(name)

    def subscribe(self, name: str | None, fn: Subscriber) -> Callable[[], None]:
        """Call ``fn`` on every change of ``name`` (every object if None); returns an unsubscribe."""
        lst = self._global if name is None else self._subs.setdefault(name, [])
        lst.append(fn)

        def off() -> None:
            with contextlib.suppress(ValueError):
                lst.remove(fn)
            if name is not None and not lst:
                self._subs.pop(name, None)

        return off

    async def wait(
        self, name: str, check: Callable[[dict[str, Any] | None], Any], timeout: float
    ) -> Any:
        """Wait until ``check(obj)`` returns a non-None value for object ``name``; return it.

        ``check`` sees the cached object (None while absent or after deletion) now and after
        every change; it may raise to end the wait with an error.

        Raises:
            TimeoutError: Not within ``timeout`` seconds (callers translate it).
            Whatever ``check`` raises.
        """
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def on_change(obj: dict[str, Any] | None) -> None:
            if fut.done():
                return
            try:
                value = check(obj)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
                return
            if value is not None:
                fut.set_result(value)

        off = self.subscribe(name, on_change)
        try:
            on_change(self.cache.get(name))
            return await asyncio.wait_for(fut, timeout)
        finally:
            off()

    # -- the watch loop ----------------------------------------------------------------------

    def _emit(self, name: str, obj: dict[str, Any] | None) -> None:
        for fn in list(self._subs.get(name, ())) + list(self._global):
            try:
                fn(obj)
            except Exception:  # noqa: BLE001 - one bad subscriber must not stop the feed
                log.exception("watch subscriber failed for %s %s", self.path, name)

    async def _list(self) -> None:
        body = await self.http.request("GET", self.path, query={"labelSelector": self.selector})
        assert body is not None
        self.relists += 1
        fresh = {o["metadata"]["name"]: o for o in body.get("items", [])}
        gone = [n for n in self.cache if n not in fresh]
        old = self.cache
        self.cache = fresh
        self._rv = body.get("metadata", {}).get("resourceVersion", "")
        for n in gone:
            self._emit(n, None)
        for n, o in fresh.items():
            if old.get(n, {}).get("metadata", {}).get("resourceVersion") != o["metadata"].get(
                "resourceVersion"
            ):
                self._emit(n, o)
        self._synced.set()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                async for ev in self.http.watch(
                    self.path,
                    {
                        "labelSelector": self.selector,
                        "resourceVersion": self._rv,
                        "timeoutSeconds": 300,
                    },
                ):
                    failures = 0
                    obj = ev.get("object") or {}
                    rv = obj.get("metadata", {}).get("resourceVersion")
                    if rv:
                        self._rv = rv
                    if ev["type"] == "BOOKMARK":
                        continue
                    self.events += 1
                    name = obj["metadata"]["name"]
                    if ev["type"] == "DELETED":
                        self.cache.pop(name, None)
                        self._emit(name, None)
                    else:
                        self.cache[name] = obj
                        self._emit(name, obj)
            except asyncio.CancelledError:
                raise
            except errors.SandpoolError as exc:
                failures += 1
                if isinstance(exc, errors.ApiError) and exc.status == 410:
                    failures = 0
                else:
                    log.warning("watch %s failed (%s); re-watching", self.path, exc)
                    await asyncio.sleep(backoff_delay(failures, cap=5.0))
                try:
                    if isinstance(exc, errors.ApiError) and exc.status == 410:
                        await self._list()
                except asyncio.CancelledError:
                    raise
                except errors.SandpoolError as exc2:
                    log.warning("re-list of %s failed: %s", self.path, exc2)
                    await asyncio.sleep(backoff_delay(failures + 1, cap=5.0))
