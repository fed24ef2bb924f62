"""The ``sandpool_swe`` NeMo Gym resources server: SWE tasks on warm, in-place-reset sandboxes.

Routes (all keyed by NeMo Gym's session cookie):

* ``POST /seed_session`` ``{"instance_id": ...}`` (plus the rest of the dataset row) claims a
  sandbox for the task, already at its base commit, and runs a first command.
* ``POST /shell`` ``{"command": ..., "timeout_s": ...}``, ``POST /read_file`` ``{"path": ...}``
  and ``POST /write_file`` ``{"path": ..., "content": ...}`` are the agent's tools.
* ``POST /verify`` grades the sandbox's state against FAIL_TO_PASS/PASS_TO_PASS, returns
  ``reward`` (1.0 resolved, else 0.0), then releases the sandbox for reuse.
* ``GET /pool_status`` shows pool and session counts.
* ``GET /metrics`` serves the pool's Prometheus series (:mod:`sandpool.core.telemetry`), in a
  registry of this server's own.

* ``POST /close_session`` (NeMo Gym >= 0.7) releases the sandbox of a session an Environment
  Server seeded with a typed ``ResourcesSeedSessionRequest``; a later seed of that id is refused.

Failure accounting: every error is placed by the one classifier,
:func:`sandpool.core.classify.classify`. An infra failure (a sandbox that died, a broken
command channel, a claim that timed out, a session reclaimed for idleness, an error sandpool
does not know) is never a reward. The policy's own errors are results: a tool answers ``400``
with ``{"outcome": "policy_error", "kind": "file_error", "errno": ...}`` and the session goes
on; at ``/verify`` (suspected tampering) they score ``reward`` 0. A task that cannot be graded
is the input's: ``422`` on 0.4, a masked, terminal (not retried) sample on 0.7.

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
from sandpool.core.classify import Verdict, classify
from sandpool.core.pool import SandboxPool
from sandpool.core.task import Task
from sandpool.envs.grading import grade
from sandpool.envs.tasks import parse_task
from sandpool.integrations.nemo_gym.config import PoolSettings, validate_settings
from sandpool.integrations.nemo_gym.protocol import (
    MASKS_FAILED_VERIFY,
    NEMO_FAILURE_KINDS,
    CloseSessionBody,
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
    failed_verify_response,
    nemo_failure_kind,
    scored_failure,
)
from sandpool.integrations.nemo_gym.sessions import SessionClosed, SessionTable, UnknownSession

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
                await pool.prepare(tasks, concurrency=settings.concurrency)
        except BaseException:
            await pool.aclose()
            raise
        self._pool = pool
        self._sessions = SessionTable(pool, idle_timeout_s=settings.idle_timeout_s)
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
        try:
            if typed:
                sid = body.resources_session_id
                row = dict(body.task_data)
                instance_id = row.get("instance_id") or body.task_id.task_id
                inline = row.get("task") if isinstance(row.get("task"), dict) else None
            else:
                sid, instance_id, inline = request.session[SESSION_ID_KEY], body.instance_id, body.task
            task = self._task_for(str(instance_id), inline)
            session = await self.sessions.open(sid, task)
        except (UnknownSession, SessionClosed) as exc:  # the session protocol's, not a rollout's
            return error_response(exc)
        except Exception as exc:  # noqa: BLE001 - placed by the one classifier
            outcome = classify(exc).outcome
            if outcome is not None and self._pool is not None:  # the rollout ends here
                self._pool.telemetry.rollout_done(outcome.value)
            return error_response(exc)
        if typed:
            request.session[SESSION_ID_KEY] = sid  # tool calls and /verify carry it in the cookie
            return ResourcesSeedSessionResponse(resources_session_id=sid)
        return SandpoolSeedSessionResponse(instance_id=task.instance_id, sandbox_id=session.lease.id,
                                           workdir=session.lease.workdir, ttfc_s=session.lease.ttfc_s)

    async def close_resources_session(self, body: CloseSessionBody):  # type: ignore[override]
        """``/close_session`` (NeMo Gym >= 0.7): release the session's sandbox, refuse a re-seed.

        Succeeds for a session already closed or never seeded (0.7's contract); a release
        that fails answers ``503`` and leaves the session open, so the caller can retry.
        """
        try:
            await self.sessions.close(body.resources_session_id, refuse_reseed=True)
        except Exception as exc:  # noqa: BLE001 - placed by the one classifier
            return error_response(exc)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def shell(self, request: Request, body: ShellRequest):  # type: ignore[no-untyped-def]
        """Tool: run a shell command in the session's sandbox.

        A non-zero exit or a timeout is the policy's own result (``200``); an infra failure
        fails the session (``503``).
        """
        settings = self.config.sandpool
        timeout = min(body.timeout_s or settings.exec_timeout_s, settings.max_exec_timeout_s)
        try:
            async with self.sessions.use(request.session[SESSION_ID_KEY]) as session:
                res = await session.lease.exec(body.command, timeout=timeout,
                                               max_output=settings.max_output_bytes)
        except Exception as exc:  # noqa: BLE001 - placed by the one classifier
            return error_response(exc)
        return ShellResponse(exit_code=res.exit_code, stdout=res.text, stderr=res.err_text,
                             stdout_truncated=res.stdout_truncated, stderr_truncated=res.stderr_truncated,
                             timed_out=res.timed_out, duration_s=res.duration_s)

    async def read_file(self, request: Request, body: ReadFileRequest):  # type: ignore[no-untyped-def]
        """Tool: read a text file from the session's sandbox (``404`` if it does not exist)."""
        cap = self.config.sandpool.max_file_bytes
        try:
            async with self.sessions.use(request.session[SESSION_ID_KEY]) as session:
                data = await session.lease.read_file(body.path)
        except FileNotFoundError as exc:
            return JSONResponse(status_code=404, content={"outcome": "not_found", "message": str(exc)})
        except Exception as exc:  # noqa: BLE001 - placed by the one classifier
            return error_response(exc)
        return ReadFileResponse(path=body.path, content=data[:cap].decode("utf-8", "replace"),
                                size_bytes=len(data), truncated=len(data) > cap)

    async def write_file(self, request: Request, body: WriteFileRequest):  # type: ignore[no-untyped-def]
        """Tool: write a text file in the session's sandbox (``413`` over the size cap)."""
        data = body.content.encode()
        cap = self.config.sandpool.max_file_bytes
        if len(data) > cap:
            return JSONResponse(status_code=413, content={
                "outcome": "too_large", "message": f"{len(data)} bytes exceeds max_file_bytes={cap}"})
        try:
            async with self.sessions.use(request.session[SESSION_ID_KEY]) as session:
                await session.lease.write_file(body.path, data)
        except Exception as exc:  # noqa: BLE001 - placed by the one classifier
            return error_response(exc)
        return WriteFileResponse(path=body.path, bytes_written=len(data))

    async def verify(self, request: Request, body: SandpoolVerifyRequest):  # type: ignore[override]
        """Grade the session's sandbox, return the reward, then release the sandbox.

        When the sandbox failed or the session expired, never a reward: ``503`` on NeMo Gym
        0.4, a masked ``200`` on 0.7 (see the module doc).
        """
        sid = request.session[SESSION_ID_KEY]
        try:
            async with self.sessions.use(sid, release_after=True) as session:
                result = await grade(session.lease, session.task,
                                     timeout=self.config.sandpool.grade_timeout_s)
                lease, task = session.lease, session.task
        except (UnknownSession, SessionClosed) as exc:
            return error_response(exc)
        except Exception as exc:  # noqa: BLE001 - placed by the one classifier
            verdict = classify(exc)
            if verdict.outcome is not None and self._pool is not None:
                self._pool.telemetry.rollout_done(verdict.outcome.value)
            if verdict is Verdict.POLICY:  # e.g. suspected tampering: the policy's, scored 0
                return scored_failure(body, exc)
            if verdict in (Verdict.INFRA, Verdict.INPUT):
                return failed_verify_response(body, exc, terminal=verdict is Verdict.INPUT)
            return error_response(exc)
        self.pool.telemetry.rollout_done("completed")
        graded = dict(
            reward=result.reward, instance_id=task.instance_id, sandbox_id=lease.id,
            resolved=result.resolved, f2p_passed=result.f2p_passed, f2p_failed=result.f2p_failed,
            p2p_passed=result.p2p_passed, p2p_failed=result.p2p_failed,
            tests_timed_out=result.timed_out, grade_error=result.error,
            grade_duration_s=result.duration_s, ttfc_s=lease.ttfc_s,
        )
        return SandpoolVerifyResponse(**(body.model_dump() | graded))

    async def metrics(self) -> Response:
        """The pool's Prometheus series, in the text exposition format."""
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)

    async def pool_status(self) -> dict[str, Any]:
        """Pool and session counts: sandboxes created, resets, quarantines, infra errors."""
        pool = self.pool
        c = pool.counters
        return {
            "pool": repr(pool),
            "sessions": self.sessions.counts(),
            "created": c.created, "deleted": c.deleted, "claims": c.claims, "warm_hits": c.warm_hits,
            "resets": c.resets, "quarantines": c.quarantines,
            "infra_errors": dict(c.infra_errors),
        }
