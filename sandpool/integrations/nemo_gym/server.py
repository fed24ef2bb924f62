"""The ``sandpool_swe`` NeMo Gym resources server: SWE tasks on warm, in-place-reset sandboxes.

Routes (all keyed by NeMo Gym's session cookie):

* ``POST /seed_session`` ``{"instance_id": ...}`` (plus the rest of the dataset row) claims a
  sandbox for the task, already at its base commit, and runs a first command.
* ``POST /shell`` ``{"command": ..., "timeout_s": ...}``, ``POST /read_file`` ``{"path": ...}``
  and ``POST /write_file`` ``{"path": ..., "content": ...}`` are the agent's tools.
* ``POST /verify`` grades the sandbox's state against FAIL_TO_PASS/PASS_TO_PASS, returns
  ``reward`` (1.0 resolved, else 0.0), then releases the sandbox for reuse.
* ``POST /prefetch`` ``{"instance_ids": [...], "num_repeats": ...}`` hydrates and warms the
  next batch's sandboxes while the current batch runs (:mod:`.prefetch`; NeMo Gym's side
  calls it with :func:`~sandpool.integrations.nemo_gym.prefetch.prefetch`).
* ``GET /pool_status`` shows pool and session counts, and sandboxes by image and state.
* ``GET /metrics`` serves the pool's Prometheus series (:mod:`sandpool.core.telemetry`), in a
  registry of this server's own.

* ``POST /close_session`` (NeMo Gym >= 0.7) releases the sandbox of a session an Environment
  Server seeded with a typed ``ResourcesSeedSessionRequest``; a later seed of that id is refused.

Failure accounting: each session is one rollout of the rollout accountant
(:mod:`sandpool.core.rollout`), which decides how it ends, as for every other adapter; this
module only answers for it. An infra failure (a sandbox that died, a broken command channel, a
claim that timed out, a session reclaimed for idleness, an error sandpool does not know) is
never a reward. A file errno on the policy's path is a result: the tool answers ``400`` with
``{"outcome": "policy_error", "kind": "file_error", "errno": ...}`` and the session goes on.
The policy's failures that end its rollout (its processes killed or starved the sandbox,
suspected tampering at ``/verify``) score ``reward`` 0 (``task_failed``). A task that cannot
be graded is the input's: ``422`` on 0.4, a masked, terminal (not retried) sample on 0.7.

* ``/seed_session`` and the tools answer ``503`` with
  ``{"outcome": "infra_failed", "kind": ..., "failure_kind": ..., "message": ...}``; NeMo Gym's
  agents and Environment Servers raise on a non-2xx seed, and 0.7's treat a 5xx as retryable.
* ``/verify`` on NeMo Gym 0.4 answers the same ``503`` (its agents raise: a failed rollout).
  On 0.7 (whose ``BaseVerifyResponse`` has ``mask_sample``) it answers ``200`` the way 0.7's
  own ``judge_failsafe`` reports a failed verification: ``mask_sample: true`` (the reward is
  not a measurement: masked from scores and training), ``failure_kind`` from
  ``nemo_gym.failure_kinds`` (or ``sandpool:<kind>``), ``failure_reason``, and
  ``_ng_failure_class``, which routes the row to rollout collection's failures sidecar, from
  where resume retries it. ``reward`` is ``0.0`` only because 0.7's schema requires a float.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import Field, PrivateAttr, field_validator

from nemo_gym.base_resources_server import BaseResourcesServerConfig, SimpleResourcesServer
from nemo_gym.server_utils import SESSION_ID_KEY
from sandpool.core import errors
from sandpool.core.pool import SandboxPool
from sandpool.core.outcome import unrun_result
from sandpool.core.task import Task
from sandpool.envs.scoring import default_grader
from sandpool.envs.tasks import parse_task
from sandpool.integrations.nemo_gym.config import PoolSettings, validate_settings
from sandpool.integrations.nemo_gym.protocol import (
    MASKS_FAILED_VERIFY,
    NEMO_FAILURE_KINDS,
    CloseSessionBody,
    PrefetchRequest,
    PrefetchResponse,
    ReadFileRequest,
    ReadFileResponse,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    SandpoolSeedSessionRequest,
    SandpoolSeedSessionResponse,
    SandpoolVerifyRequest,
    SandpoolVerifyResponse,
    SeedSessionBody,
    ShellRequest,
    ShellResponse,
    WriteFileRequest,
    WriteFileResponse,
    error_response,
    nemo_failure_kind,
    verify_response,
)
from sandpool.integrations.nemo_gym.prefetch import prefetch_tasks
from sandpool.integrations.nemo_gym.sessions import SessionTable

__all__ = [
    "MASKS_FAILED_VERIFY",
    "NEMO_FAILURE_KINDS",
    "ResourcesSeedSessionRequest",
    "ReadFileRequest",
    "ReadFileResponse",
    "SandpoolSeedSessionRequest",
    "SandpoolSeedSessionResponse",
    "SandpoolSweConfig",
    "SandpoolSweResourcesServer",
    "SandpoolVerifyRequest",
    "SandpoolVerifyResponse",
    "ShellRequest",
    "ShellResponse",
    "WriteFileRequest",
    "WriteFileResponse",
    "nemo_failure_kind",
]


class SandpoolSweConfig(BaseResourcesServerConfig):
    """Server config: NeMo Gym's server keys plus the ``sandpool:`` block.

    Attributes:
        sandpool: Backend, strategy, pool sizes, task source and timeouts
            (see :class:`~sandpool.integrations.nemo_gym.config.PoolSettings`).
    """

    sandpool: PoolSettings = Field(default_factory=PoolSettings)

    @field_validator("sandpool", mode="before")
    @classmethod
    def _named_errors(cls, value: Any) -> PoolSettings:
        try:
            return validate_settings(value, where="sandpool")
        except errors.ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("num_workers", check_fields=False)
    @classmethod
    def _one_worker(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError(
                "num_workers: sandpool_swe keeps sessions and its pool in one process; "
                "use num_workers: 1 and raise sandpool.concurrency instead"
            )
        return value

class SandpoolSweResourcesServer(SimpleResourcesServer):
    """A NeMo Gym resources server whose sessions run in pooled sandpool sandboxes.

    Started by NeMo Gym as ``python app.py`` (``SandpoolSweResourcesServer.run_webserver()``)
    from ``resources_servers/sandpool_swe``. The pool opens, hydrates the task images and fills
    its warm pools during application startup, and closes (deleting every sandbox) at shutdown.
    """

    config: SandpoolSweConfig

    _pool: SandboxPool | None = PrivateAttr(default=None)
    _sessions: SessionTable | None = PrivateAttr(default=None)
    _tasks: dict[str, Task] = PrivateAttr(default_factory=dict)
    _registry: CollectorRegistry = PrivateAttr(default_factory=CollectorRegistry)

    @property
    def pool(self) -> SandboxPool:
        """The open pool (available once the app has started).

        Raises:
            PoolClosed: The app has not started, or has shut down.
        """
        if self._pool is None:
            raise errors.PoolClosed("the sandpool_swe server has not started its pool")
        return self._pool

    @property
    def sessions(self) -> SessionTable:
        """The session table (available once the app has started).

        Raises:
            PoolClosed: The app has not started, or has shut down.
        """
        if self._sessions is None:
            raise errors.PoolClosed("the sandpool_swe server has not started its pool")
        return self._sessions

    def setup_webserver(self) -> FastAPI:
        """Build NeMo Gym's app, add the tool routes and tie the pool to the app lifespan."""
        app = super().setup_webserver()
        app.post("/shell")(self.shell)
        app.post("/read_file")(self.read_file)
        app.post("/write_file")(self.write_file)
        app.post("/prefetch")(self.prefetch)
        app.get("/pool_status")(self.pool_status)
        app.get("/metrics")(self.metrics)

        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app_: FastAPI):  # type: ignore[no-untyped-def]
            await self.start()
            try:
                async with inner(app_) as state:
                    yield state
            finally:
                await self.stop()

        app.router.lifespan_context = lifespan
        return app

    async def start(self) -> None:
        """Load tasks, open the pool, prepare warm pools and start the idle reaper.

        Raises:
            ConfigError, TaskValidationError: The task source is wrong (names the key/row).
            BackendUnavailable: The backend cannot run sandboxes here.
            ImageNotFound: A task's image is not built.
        """
        settings = self.config.sandpool
        tasks = await settings.load_tasks()
        self._tasks = {t.instance_id: t for t in tasks}
        pool = settings.build_pool(metrics=self._registry)
        await pool.open()
        try:
            if settings.prepare and tasks:
                await pool.prepare(tasks, concurrency=settings.concurrency,
                                   rollouts_per_task=settings.num_repeats)
        except BaseException:
            await pool.aclose()
            raise
        self._pool = pool
        self._sessions = SessionTable(pool, idle_timeout_s=settings.idle_timeout_s,
                                      grader=default_grader(settings.grade_timeout_s))
        self._sessions.start_reaper()

    async def stop(self) -> None:
        """Release every session and close the pool (deleting its sandboxes). Idempotent."""
        if self._sessions is not None:
            await self._sessions.aclose()
            self._sessions = None
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None

    def _task_for(self, instance_id: str, inline: dict[str, Any] | None) -> Task:
        task = self._tasks.get(instance_id)
        if task is not None:
            return task
        if inline is not None:
            task = parse_task(inline)
            if task.instance_id != instance_id:
                raise errors.TaskValidationError(
                    f"instance_id {instance_id!r} does not match the inline task's "
                    f"{task.instance_id!r}", field="instance_id")
            return task
        raise errors.TaskValidationError(
            f"instance_id {instance_id!r} is not in the task source "
            f"({self.config.sandpool.tasks!r}); fix the dataset row or sandpool.tasks",
            field="instance_id",
        )

    async def seed_session(self, request: Request, body: SeedSessionBody):  # type: ignore[override]
        """Claim a sandbox for the row's task, at its base commit, under this session.

        Takes NeMo Gym's dataset row (keyed by the session cookie) or, on 0.7, an Environment
        Server's typed ``ResourcesSeedSessionRequest`` (keyed by its ``resources_session_id``,
        which the session cookie then carries; the row is its ``task_data``).
        """
        typed = ResourcesSeedSessionRequest is not None and isinstance(body, ResourcesSeedSessionRequest)
        if typed:
            sid = body.resources_session_id
            row = dict(body.task_data)
            instance_id = str(row.get("instance_id") or body.task_id.task_id)
            inline = row.get("task") if isinstance(row.get("task"), dict) else None
        else:
            sid, instance_id, inline = request.session[SESSION_ID_KEY], body.instance_id, body.task
        try:
            task = self._task_for(instance_id, inline)
        except errors.InputError as exc:  # a bad row: its rollout never claims, and is rejected
            result = unrun_result(instance_id, exc, telemetry=self._pool.telemetry if self._pool else None)
            return error_response(exc, result)
        try:
            session = await self.sessions.open(sid, task)
        except Exception as exc:  # noqa: BLE001 - the accountant recorded how the rollout ended
            return self._answer(sid, exc)
        if typed:
            request.session[SESSION_ID_KEY] = sid  # tool calls and /verify carry it in the cookie
            return ResourcesSeedSessionResponse(resources_session_id=sid)
        return SandpoolSeedSessionResponse(instance_id=task.instance_id, sandbox_id=session.lease.id,
                                           workdir=session.lease.workdir, ttfc_s=session.lease.ttfc_s)

    def _answer(self, sid: str | None, exc: Exception) -> JSONResponse:
        """The answer to a request on session ``sid`` that raised ``exc``: the end of its
        rollout as the accountant recorded it, when ``exc`` ended it (see
        :func:`~sandpool.integrations.nemo_gym.protocol.error_response`)."""
        session = self._sessions.get(sid) if sid is not None and self._sessions is not None else None
        result = session.result if session is not None and session.error is exc else None
        return error_response(exc, result)

    async def close_resources_session(self, body: CloseSessionBody):  # type: ignore[override]
        """``/close_session`` (NeMo Gym >= 0.7): release the session's sandbox, refuse a re-seed.

        Succeeds for a session already closed or never seeded (0.7's contract); a release
        that fails answers ``503`` and leaves the session open, so the caller can retry.
        """
        try:
            await self.sessions.close(body.resources_session_id, refuse_reseed=True)
        except Exception as exc:  # noqa: BLE001 - not a rollout's end: the release failed
            return error_response(exc)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def shell(self, request: Request, body: ShellRequest):  # type: ignore[no-untyped-def]
        """Tool: run a shell command in the session's sandbox.

        A non-zero exit or a timeout is the policy's own result (``200``); an infra failure
        ends the rollout (``503``).
        """
        settings = self.config.sandpool
        timeout = settings.tool_timeout(body.timeout_s)
        sid = request.session[SESSION_ID_KEY]
        try:
            async with self.sessions.use(sid) as session:
                res = await session.lease.exec(body.command, timeout=timeout,
                                               max_output=settings.max_output_bytes)
        except Exception as exc:  # noqa: BLE001 - the accountant decided what it ended
            return self._answer(sid, exc)
        return ShellResponse(exit_code=res.exit_code, stdout=res.text, stderr=res.err_text,
                             stdout_truncated=res.stdout_truncated, stderr_truncated=res.stderr_truncated,
                             timed_out=res.timed_out, duration_s=res.duration_s)

    async def read_file(self, request: Request, body: ReadFileRequest):  # type: ignore[no-untyped-def]
        """Tool: read a text file from the session's sandbox (``404`` if it does not exist)."""
        cap = self.config.sandpool.max_file_bytes
        sid = request.session[SESSION_ID_KEY]
        try:
            async with self.sessions.use(sid) as session:
                data = await session.lease.read_file(body.path)
        except FileNotFoundError as exc:
            if isinstance(exc, errors.SandboxFileError):  # the policy's path: a result
                return JSONResponse(status_code=404, content={"outcome": "not_found", "message": str(exc)})
            return self._answer(sid, exc)
        except Exception as exc:  # noqa: BLE001 - the accountant decided what it ended
            return self._answer(sid, exc)
        return ReadFileResponse(path=body.path, content=data[:cap].decode("utf-8", "replace"),
                                size_bytes=len(data), truncated=len(data) > cap)

    async def write_file(self, request: Request, body: WriteFileRequest):  # type: ignore[no-untyped-def]
        """Tool: write a text file in the session's sandbox (``413`` over the size cap)."""
        data = body.content.encode()
        cap = self.config.sandpool.max_file_bytes
        if len(data) > cap:
            return JSONResponse(status_code=413, content={
                "outcome": "too_large", "message": f"{len(data)} bytes exceeds max_file_bytes={cap}"})
        sid = request.session[SESSION_ID_KEY]
        try:
            async with self.sessions.use(sid) as session:
                await session.lease.write_file(body.path, data)
        except Exception as exc:  # noqa: BLE001 - the accountant decided what it ended
            return self._answer(sid, exc)
        return WriteFileResponse(path=body.path, bytes_written=len(data))

    async def verify(self, request: Request, body: SandpoolVerifyRequest):  # type: ignore[override]
        """Grade the session's rollout, return the reward, then release the sandbox.

        The rollout accountant grades and records it; when the sandbox failed or the session
        expired, never a reward: ``503`` on NeMo Gym 0.4, a masked ``200`` on 0.7 (see the
        module doc).
        """
        sid = request.session[SESSION_ID_KEY]
        try:
            session, result = await self.sessions.verify(sid)
        except Exception as exc:  # noqa: BLE001 - no session, or the pool cannot run sandboxes
            return error_response(exc)
        return verify_response(body, result, session.rollout.score, result.sandbox_id)

    async def prefetch(self, body: PrefetchRequest):  # type: ignore[no-untyped-def]
        """Warm the next batch's sandboxes within ``max_live`` and return at once; ids that
        cannot run are listed under ``rejected`` (``503`` only when the pool cannot run
        sandboxes at all)."""
        settings = self.config.sandpool
        try:
            out = await prefetch_tasks(self.pool, lambda iid: self._task_for(iid, None), body.instance_ids,
                                       num_repeats=body.num_repeats or settings.num_repeats,
                                       concurrency=settings.concurrency)
        except Exception as exc:  # noqa: BLE001 - the pool is closed or its backend is gone
            return error_response(exc)
        return PrefetchResponse(warm_targets=out.warm_targets, rejected=out.rejected)

    async def metrics(self) -> Response:
        """The pool's Prometheus series, in the text exposition format."""
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    async def pool_status(self) -> dict[str, Any]:
        """Pool and session counts: sandboxes created, resets, quarantines, infra errors,
        the live cap and sandboxes by image and state."""
        pool = self.pool
        c = pool.counters
        return {
            "pool": repr(pool),
            "sessions": self.sessions.counts(),
            "created": c.created, "deleted": c.deleted, "claims": c.claims, "warm_hits": c.warm_hits,
            "resets": c.resets, "quarantines": c.quarantines,
            "infra_errors": dict(c.infra_errors),
            "max_live": pool.max_live, "sandboxes": pool.sizes(),
        }
