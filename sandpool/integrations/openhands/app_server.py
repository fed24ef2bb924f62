"""The OpenHands app server (openhands-ai 1.11.0) running its sandboxes on a sandpool pool.

Select it the way openhands-ai selects any sandbox service, by environment::

    OH_SANDBOX_KIND=sandpool.integrations.openhands.SandpoolSandboxServiceInjector
    OH_SANDBOX_TASKS_PATH=/data/tasks.jsonl          # SWE-bench rows: one sandbox spec per task
    OH_SANDBOX_SPEC_KIND=sandpool.integrations.openhands.SandpoolSandboxSpecServiceInjector
    OH_SANDBOX_SPEC_TASKS_PATH=/data/tasks.jsonl
    OH_LIFESPAN_KIND=sandpool.integrations.openhands.SandpoolAppLifespanService   # recommended

With the lifespan service the pool opens and starts warming at app start-up, and closes (every
sandbox deleted, nothing left mounted or running) at shutdown; without it the pool opens on
the first sandbox request and its sandboxes die with the app server process.

A sandbox spec is a task (``id`` = ``instance_id``, ``working_dir`` = its repo). Starting a
sandbox claims a warm sandbox of that task from one process-wide pool (local bubblewrap
backend; each sandbox runs the agent-server of the version openhands-ai bundles, started while
the pool warms); its ``SandboxInfo`` exposes the ``AGENT_SERVER`` URL of a host-side relay on
127.0.0.1 and the sandbox's own session key. Pausing freezes the sandbox's processes and closes
the relay; resuming thaws it behind a new relay. Each sandbox is one rollout of the rollout
accountant (:mod:`sandpool.core.rollout`), as for every other adapter. Deleting is the end of
the episode: the accountant grades it, its record (a
:class:`~sandpool.core.metrics.RolloutResult`, ``sandbox_id`` being the app server's id) is
appended to ``results_path`` (when set), and the sandbox goes back to the pool (reset in place)
or, if it failed, is deleted; a sandbox that failed is recorded as ``infra_failed``, never as
reward 0.

Differences from openhands-ai's own services: the sandbox has no network, so the agent-server
cannot call the app server's webhooks back (the app server reads it by URL instead); paused
sandboxes keep their memory (frozen by their cgroup's freezer, SIGSTOP where none is
writable: ``LocalBackend.freeze``), like the process service; sandbox records live in this
process, so they do not survive an app server restart.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from fastapi import Request
from openhands.agent_server.utils import utc_now
from openhands.app_server.app_lifespan.oss_app_lifespan_service import OssAppLifespanService
from openhands.app_server.errors import SandboxError
from openhands.app_server.sandbox.preset_sandbox_spec_service import PresetSandboxSpecService
from openhands.app_server.sandbox.sandbox_models import (
    AGENT_SERVER,
    ExposedUrl,
    SandboxInfo,
    SandboxPage,
    SandboxRecord,
    SandboxStatus,
)
from openhands.app_server.sandbox.sandbox_service import SandboxService, SandboxServiceInjector
from openhands.app_server.sandbox.sandbox_spec_models import SandboxSpecInfo
from openhands.app_server.sandbox.sandbox_spec_service import (
    SandboxSpecService,
    SandboxSpecServiceInjector,
    resolve_sandbox_spec,
)
from openhands.app_server.services.injector import InjectorState
from pydantic import Field

from sandpool.core import errors
from sandpool.core.backends.local import LocalBackend
from sandpool.core.base import Sandbox
from sandpool.core.metrics import RolloutResult
from sandpool.core.pool import Lease, PoolLimits, SandboxPool
from sandpool.core.rollout import Rollout
from sandpool.core.task import Task
from sandpool.envs.scoring import default_grader
from sandpool.envs.tasks import load_tasks
from sandpool.integrations.openhands.relay import Relay
from sandpool.integrations.openhands.server import SESSION_KEY, agent_server_env, agent_server_service, installed_versions

__all__ = ["SandpoolAppLifespanService", "SandpoolSandboxService", "SandpoolSandboxServiceInjector",
           "SandpoolSandboxSpecServiceInjector"]

_logger = logging.getLogger(__name__)


def _relay(sandbox: Sandbox) -> Relay:
    """A relay to ``sandbox``'s agent-server (:meth:`Sandbox.connect_service`)."""
    return Relay(sandbox.connect_service, f"sandbox {sandbox.id}'s agent-server")


def _tasks(path: str) -> dict[str, Task]:
    if not path:
        raise errors.ConfigError("set OH_SANDBOX_TASKS_PATH (and OH_SANDBOX_SPEC_TASKS_PATH) to a "
                                 "tasks.jsonl of SWE-bench rows: each task is one sandbox spec")
    return {t.instance_id: t for t in load_tasks(Path(path))}


@dataclass(eq=False)
class _Sandbox:
    rollout: Rollout
    lease: Lease
    spec_id: str
    user_id: str | None
    relay: Relay | None
    status: SandboxStatus = SandboxStatus.RUNNING
    created_at: datetime = field(default_factory=utc_now)


class _Pool:
    """The process-wide pool and sandbox table (the app server injects a service per request)."""

    def __init__(self) -> None:
        self.pool: SandboxPool | None = None
        self.tasks: dict[str, Task] = {}
        self.sandboxes: dict[str, _Sandbox] = {}
        self.lock = asyncio.Lock()

    async def open(self, cfg: SandpoolSandboxServiceInjector) -> SandboxPool:
        async with self.lock:
            if self.pool is None:
                self.tasks = _tasks(cfg.tasks_path)
                # The app server's own versions of the agent-server's requirements constrain the
                # env: left free, pip finds no openhands-sdk 1.34.0 / lmnr combination.
                env = await asyncio.to_thread(agent_server_env, cfg.agent_server_version,
                                              constraints=installed_versions())
                service = await asyncio.to_thread(
                    agent_server_service, env, preload=tuple(filter(None, cfg.preload.split(","))),
                    python_path=tuple(filter(None, cfg.python_path.split(":"))))
                backend = LocalBackend(cfg.images_root or None, service=service)
                pool = SandboxPool(backend, strategy="reuse", limits=PoolLimits(create_timeout=900))
                await pool.open()
                # Warm sandboxes start (with their servers) now, in the background.
                await pool.prepare(self.tasks.values(), concurrency=cfg.warm, wait=False)
                self.pool = pool
            return self.pool

    async def aclose(self) -> None:
        async with self.lock:
            for sb in self.sandboxes.values():
                if sb.relay is not None:
                    await sb.relay.aclose()
            self.sandboxes.clear()
            if self.pool is not None:
                await self.pool.aclose()
                self.pool = None


_STATE = _Pool()


@dataclass
class SandpoolSandboxService(SandboxService):
    """openhands-ai's ``SandboxService`` over the process-wide sandpool pool.

    Made per request by :class:`SandpoolSandboxServiceInjector`; see the module docstring.
    """

    cfg: SandpoolSandboxServiceInjector
    user_id: str | None
    sandbox_spec_service: SandboxSpecService
    default_sandbox_spec_id: str | None

    def _info(self, sandbox_id: str, sb: _Sandbox) -> SandboxInfo:
        status = sb.status
        if not sb.lease.sandbox.alive() or sb.lease.broken is not None:
            status = SandboxStatus.ERROR
        running = status is SandboxStatus.RUNNING and sb.relay is not None
        urls = [ExposedUrl(name=AGENT_SERVER, url=sb.relay.url, port=sb.relay.port)] if running else None
        key = sb.lease.sandbox.service_env.get(SESSION_KEY) if running else None
        return SandboxInfo(id=sandbox_id, created_by_user_id=sb.user_id, sandbox_spec_id=sb.spec_id,
                           status=status, session_api_key=key, exposed_urls=urls, created_at=sb.created_at)

    async def search_sandboxes(self, page_id: str | None = None, limit: int = 100) -> SandboxPage:
        """List this process's sandboxes, newest first, ``limit`` per page."""
        items = sorted(_STATE.sandboxes.items(), key=lambda kv: kv[1].created_at, reverse=True)
        start = int(page_id) if page_id and page_id.isdigit() else 0
        page = [self._info(i, sb) for i, sb in items[start:start + limit]]
        nxt = str(start + limit) if start + limit < len(items) else None
        return SandboxPage(items=page, next_page_id=nxt)

    async def get_sandbox(self, sandbox_id: str) -> SandboxInfo | None:
        """The sandbox's info, or None."""
        sb = _STATE.sandboxes.get(sandbox_id)
        return self._info(sandbox_id, sb) if sb else None

    def _by_key(self, key: str) -> tuple[str, _Sandbox] | None:
        for sid, sb in _STATE.sandboxes.items():
            if secrets.compare_digest(sb.lease.sandbox.service_env.get(SESSION_KEY, ""), key):
                return sid, sb
        return None

    async def get_sandbox_by_session_api_key(self, session_api_key: str) -> SandboxInfo | None:
        """The sandbox whose agent-server has this session key, or None."""
        hit = self._by_key(session_api_key)
        return self._info(*hit) if hit else None

    async def get_sandbox_record_by_session_api_key(self, session_api_key: str) -> SandboxRecord | None:
        """Identity of the sandbox whose agent-server has this session key, or None."""
        hit = self._by_key(session_api_key)
        return SandboxRecord(id=hit[0], created_by_user_id=hit[1].user_id) if hit else None

    async def start_sandbox(self, sandbox_spec_id: str | None = None, sandbox_id: str | None = None) -> SandboxInfo:
        """Claim a warm sandbox of the spec's task and expose its agent-server.

        Raises:
            SandboxError: No such spec, or no sandbox could be had (the message says why).
        """
        pool = await _STATE.open(self.cfg)
        spec = await resolve_sandbox_spec(sandbox_spec_id, self.default_sandbox_spec_id,
                                          self.sandbox_spec_service, _logger)
        task = _STATE.tasks.get(spec.id)
        if task is None:
            raise SandboxError(f"sandbox spec {spec.id!r} is not a task of {self.cfg.tasks_path}")
        sandbox_id = sandbox_id or f"sandpool-{secrets.token_hex(8)}"
        rollout = Rollout(pool, task, grader=default_grader(self.cfg.grade_timeout),
                          on_result=lambda result: self._record(sandbox_id, result))
        try:
            lease = await rollout.claim()  # its first command sets TTFC
            relay = _relay(lease.sandbox)
            await relay.start()
        except Exception as exc:  # recorded by the accountant (the relay's own failure: infra)
            if not rollout.ended:
                await rollout.fail(exc)
            raise SandboxError(f"sandpool could not start a sandbox for {task.instance_id}: {exc}") from exc
        _STATE.sandboxes[sandbox_id] = _Sandbox(rollout, lease, spec.id, self.user_id, relay)
        return self._info(sandbox_id, _STATE.sandboxes[sandbox_id])

    async def pause_sandbox(self, sandbox_id: str) -> bool:
        """Freeze the sandbox's processes and stop exposing it; False if unknown."""
        sb = _STATE.sandboxes.get(sandbox_id)
        if sb is None:
            return False
        if sb.status is SandboxStatus.RUNNING:
            if sb.relay is not None:
                await sb.relay.aclose()
                sb.relay = None
            await _STATE.pool.backend.freeze(sb.lease.sandbox)  # type: ignore[union-attr]
            sb.status = SandboxStatus.PAUSED
        return True

    async def resume_sandbox(self, sandbox_id: str) -> bool:
        """Thaw a paused sandbox behind a new relay; False if unknown."""
        sb = _STATE.sandboxes.get(sandbox_id)
        if sb is None:
            return False
        if sb.status is SandboxStatus.PAUSED:
            await _STATE.pool.backend.freeze(sb.lease.sandbox, frozen=False)  # type: ignore[union-attr]
            sb.relay = _relay(sb.lease.sandbox)
            await sb.relay.start()
            sb.status = SandboxStatus.RUNNING
        return True

    async def delete_sandbox(self, sandbox_id: str) -> bool:
        """End the episode: grade the sandbox, record the result, give it back; False if unknown."""
        sb = _STATE.sandboxes.pop(sandbox_id, None)
        if sb is None:
            return False
        if sb.relay is not None:
            await sb.relay.aclose()
        if sb.status is SandboxStatus.PAUSED:
            await _STATE.pool.backend.freeze(sb.lease.sandbox, frozen=False)  # type: ignore[union-attr]
        await sb.rollout.finish()  # graded, recorded (see _record) and released
        return True

    def _record(self, sandbox_id: str, result: RolloutResult) -> None:
        """Append the rollout's record to ``results_path``, under the app server's sandbox id."""
        if self.cfg.results_path:
            with open(self.cfg.results_path, "a") as f:
                f.write(json.dumps(result.model_dump(mode="json") | {"sandbox_id": sandbox_id}) + "\n")


class SandpoolSandboxServiceInjector(SandboxServiceInjector):
    """Selects sandpool as openhands-ai's sandbox service (``OH_SANDBOX_KIND``); fields are read
    from ``OH_SANDBOX_<FIELD>``."""

    tasks_path: str = Field(default="", description="tasks.jsonl of SWE-bench rows (one spec per task)")
    images_root: str = Field(default="", description="Local images directory (default: sandpool_home()/images)")
    warm: int = Field(default=1, ge=0, description="Sandboxes kept warm across the tasks")
    preload: str = Field(default="", description="Comma-separated modules the agent-servers import")
    python_path: str = Field(default="", description="Colon-separated host dirs for those modules")
    agent_server_version: str = Field(default_factory=lambda: importlib.metadata.version("openhands-agent-server"),
                                      description="agent-server release run in the sandboxes")
    results_path: str = Field(default="", description="JSONL file each deleted sandbox's grade is appended to")
    grade_timeout: float = Field(default=300.0, description="Seconds the task's tests may run")

    async def inject(self, state: InjectorState, request: Request | None = None) -> AsyncGenerator[SandboxService, None]:
        """Yield a :class:`SandpoolSandboxService` for this request."""
        from openhands.app_server.config import get_sandbox_spec_service, get_user_context

        async with (get_sandbox_spec_service(state, request) as spec_service,
                    get_user_context(state, request) as user_context):
            yield SandpoolSandboxService(cfg=self, user_id=await user_context.get_user_id(),
                                         sandbox_spec_service=spec_service,
                                         default_sandbox_spec_id=await user_context.get_default_sandbox_spec_id())


class SandpoolSandboxSpecServiceInjector(SandboxSpecServiceInjector):
    """Sandbox specs from a tasks file (``OH_SANDBOX_SPEC_KIND``; ``OH_SANDBOX_SPEC_TASKS_PATH``)."""

    tasks_path: str = Field(default="", description="tasks.jsonl of SWE-bench rows (one spec per task)")

    async def inject(self, state: InjectorState, request: Request | None = None) -> AsyncGenerator[SandboxSpecService, None]:
        """Yield a preset spec service listing one spec per task."""
        specs = [SandboxSpecInfo(id=t.instance_id, command=None, working_dir=t.workdir)
                 for t in _tasks(self.tasks_path).values()]
        yield PresetSandboxSpecService(specs=specs)





class SandpoolAppLifespanService(OssAppLifespanService):
    """openhands-ai's OSS lifespan (``OH_LIFESPAN_KIND``) plus the pool's: opened and warming at
    start-up, closed at shutdown."""

    async def __aenter__(self):  # type: ignore[no-untyped-def]
        """Run the OSS start-up (database migrations), then open and warm the pool."""
        await super().__aenter__()
        from openhands.app_server.config import get_global_config

        cfg = get_global_config().sandbox
        if isinstance(cfg, SandpoolSandboxServiceInjector):
            await _STATE.open(cfg)
        return self

    async def __aexit__(self, exc_type, exc_value, traceback):  # type: ignore[no-untyped-def]
        """Close the pool: every sandbox deleted."""
        await _STATE.aclose()
        await super().__aexit__(exc_type, exc_value, traceback)
