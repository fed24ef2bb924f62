"""``SandpoolWorkspace``: an OpenHands ``RemoteWorkspace`` on a pooled sandbox's agent-server.

``Conversation(agent, workspace=SandpoolWorkspace(pool, task))`` runs with unchanged OpenHands
code: the workspace claims a sandbox whose agent-server is already up (it started while the
pool warmed, see :mod:`sandpool.integrations.openhands.server` for the local backend and
:mod:`sandpool.integrations.openhands.pod_server` for Kubernetes), relays it to
``127.0.0.1:<port>`` (from the sandbox's unix socket, or from the pod's port through
``pods/portforward``), and hands OpenHands that URL and the server's session key.

The workspace is one rollout of the rollout accountant (:mod:`sandpool.core.rollout`), as for
every other adapter: :meth:`SandpoolWorkspace.finish` grades it and records how it ended; an
error that leaves the ``with`` block ends it as the accountant says (the sandbox's failure is
infra, its server killed from inside the policy's). Closing the workspace (or leaving its
``with`` block) releases the sandbox: reset in place for the next rollout, or deleted when it
failed; a rollout neither finished nor failed is given up unrecorded.

OpenHands' workspace API is synchronous and the pool is asyncio: construct and use the
workspace from a thread other than the pool's loop (``await asyncio.to_thread(...)``); its
calls are submitted to :attr:`SandboxPool.loop <sandpool.core.pool.SandboxPool.loop>`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

# The client deserialises the server's events into these tools' action/observation types, so
# their modules must be imported before a conversation starts (importing registers them).
import openhands.tools.file_editor  # noqa: F401
import openhands.tools.terminal  # noqa: F401
from openhands.sdk.workspace import CommandResult, RemoteWorkspace
from pydantic import Field, PrivateAttr, ValidationError
from pydantic.json_schema import SkipJsonSchema

from sandpool.core import errors
from sandpool.core.base import Sandbox
from sandpool.core.metrics import RolloutResult
from sandpool.core.pool import Lease, SandboxPool
from sandpool.core.rollout import Grader, Rollout
from sandpool.core.task import Task
from sandpool.envs.scoring import default_grader
from sandpool.integrations.openhands.relay import Relay
from sandpool.integrations.openhands.server import SESSION_KEY

__all__ = ["SandpoolWorkspace"]

T = TypeVar("T")


def _relay_for(sandbox: Sandbox) -> Relay:
    """The relay to ``sandbox``'s agent-server (:meth:`Sandbox.connect_service`: its unix
    socket on the local backend, its port through ``pods/portforward`` on Kubernetes)."""
    def gone() -> str | None:
        return None if sandbox.alive() else f"sandbox {sandbox.id} died"

    return Relay(sandbox.connect_service, f"sandbox {sandbox.id}'s agent-server", gone=gone)


class SandpoolWorkspace(RemoteWorkspace):
    """A pooled sandbox running the OpenHands agent-server, as a ``RemoteWorkspace``.

    Usage::

        with SandpoolWorkspace(pool, task) as ws:            # on a worker thread
            conv = Conversation(agent=agent, workspace=ws)
            conv.send_message(task.problem_statement); conv.run(); conv.close()
            result = ws.finish()                         # graded and recorded: result.reward

    Args:
        pool: An open :class:`SandboxPool` whose backend runs the agent-server service
            (``LocalBackend(service=agent_server_service(...))`` or
            ``KubernetesBackend(service=agent_server_pod_service(...))``).
        task: The task; the sandbox is claimed at its ``base_commit``, and ``working_dir`` is
            its repo.
        grader: Scores the rollout at :meth:`finish` (default
            :func:`sandpool.envs.scoring.default_grader`).
        on_result: Called with the rollout's record when it ends (a failed claim included).

    Raises:
        ConfigError: The pool's sandboxes run no agent-server.
        InfraError: No sandbox could be claimed, or it failed its first command (recorded).
        RuntimeError: Constructed on the pool's own event loop thread (it would deadlock).
    """

    pool: SkipJsonSchema[Any] = Field(exclude=True, repr=False)
    task: SkipJsonSchema[Any] = Field(exclude=True, repr=False)
    grader: SkipJsonSchema[Any] = Field(default=None, exclude=True, repr=False)
    on_result: SkipJsonSchema[Any] = Field(default=None, exclude=True, repr=False)

    _rollout: Rollout | None = PrivateAttr(default=None)
    _relay: Relay | None = PrivateAttr(default=None)

    def __init__(self, pool: SandboxPool, task: Task, grader: Grader | None = None,
                 on_result: Callable[[RolloutResult], None] | None = None, **data: Any) -> None:
        data.setdefault("host", "http://127.0.0.1:0")  # set once the relay listens
        data.setdefault("working_dir", task.workdir)
        try:
            super().__init__(pool=pool, task=task, grader=grader, on_result=on_result, **data)
        except ValidationError as exc:  # pydantic wraps a ValueError (an InputError) of the claim
            cause = next((e.get("ctx", {}).get("error") for e in exc.errors()), None)
            if isinstance(cause, errors.SandpoolError):
                raise cause from None
            raise

    def model_post_init(self, context: Any) -> None:
        """Claim a sandbox, start the relay, then let ``RemoteWorkspace`` initialise."""
        pool: SandboxPool = self.pool
        if pool.loop is None:
            raise errors.PoolClosed("the pool is not open; open it before making a SandpoolWorkspace")
        rollout = Rollout(pool, self.task, grader=self.grader or default_grader(), on_result=self.on_result)
        self._rollout = rollout
        try:
            lease = self._run(rollout.claim())  # its first command sets TTFC
            key = lease.sandbox.service_env.get(SESSION_KEY)
            if key is None:
                raise errors.ConfigError(
                    "the pool's sandboxes run no OpenHands agent-server; make the pool over "
                    "LocalBackend(service=agent_server_service()) or "
                    "KubernetesBackend(service=agent_server_pod_service())")
            self._relay = _relay_for(lease.sandbox)
            self._run(self._relay.start())
            object.__setattr__(self, "host", self._relay.url)
            object.__setattr__(self, "api_key", key)
            super().model_post_init(context)
        except BaseException:
            self.cleanup()
            raise

    def execute_command(self, command: str, cwd: str | Path | None = None, timeout: float = 30.0) -> CommandResult:
        """``RemoteWorkspace.execute_command``, run in the task repo unless ``cwd`` says otherwise."""
        return super().execute_command(command, cwd if cwd is not None else self.working_dir, timeout)

    # -- sandpool side ----------------------------------------------------------------------

    @property
    def rollout(self) -> Rollout:
        """The workspace's rollout (its record, once ended, on ``rollout.result``).

        Raises:
            PoolClosed: The workspace was closed.
        """
        if self._rollout is None:
            raise errors.PoolClosed("this SandpoolWorkspace was closed")
        return self._rollout

    @property
    def lease(self) -> Lease:
        """The claimed sandbox.

        Raises:
            PoolClosed: The workspace was closed, or its rollout ended.
        """
        lease = self.rollout.lease
        if lease is None:
            raise errors.PoolClosed("this SandpoolWorkspace's rollout has ended")
        return lease

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self.pool.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("SandpoolWorkspace blocks; use it from a worker thread "
                               "(await asyncio.to_thread(...)), not on the pool's event loop")
        try:
            return asyncio.run_coroutine_threadsafe(coro, loop).result()
        except concurrent.futures.CancelledError as exc:
            raise errors.InfraTimeout("the pool's loop cancelled the call") from exc

    def check(self) -> None:
        """Raise the sandbox's infra failure, if it had one (died, broken channel).

        Raises:
            SandboxDied: The sandbox is gone.
            InfraError: An earlier call on the lease failed with this error.
        """
        lease = self.lease
        if lease.broken is not None:
            raise lease.broken
        if not lease.sandbox.alive():
            lease.broken = errors.SandboxDied(f"sandbox {lease.id} died during the conversation")
            raise lease.broken

    def finish(self) -> RolloutResult:
        """End the rollout: the accountant grades the policy's change (on a pristine sandbox),
        records the outcome and releases the sandbox.

        Returns:
            The record (``completed`` with its reward, ``task_failed`` with 0.0,
            ``infra_failed`` or ``rejected`` with ``None``).
        """
        return self._run(self.rollout.finish())

    def cleanup(self) -> None:
        """Stop the relay and release the sandbox (reset for reuse, or deleted if it failed);
        a rollout still running is given up unrecorded. Idempotent.
        """
        relay, self._relay = self._relay, None
        rollout, self._rollout = self._rollout, None
        self.reset_client()  # close OpenHands' HTTP client before the relay goes
        if relay is not None:
            self._run(relay.aclose())
        if rollout is not None and not rollout.ended:
            self._run(rollout.abandon())

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """Leave the ``with`` block: OpenHands' completion callback, then :meth:`cleanup`.

        An error that left the block ends the rollout as the accountant places it, after
        this mapping of OpenHands' own errors (its HTTP client losing the server):

        Raises:
            InfraError: The block raised and the sandbox had failed: the error is the
                sandbox's, so it is reported as infra (``infra_failed``).
            ServiceKilled: The block raised and the sandbox lives but its agent-server was
                killed or stopped: the policy's failure (``task_failed``, scored), never infra.
        """
        running = self._rollout is not None and not self._rollout.ended
        mapped: Exception | None = exc_val if isinstance(exc_val, Exception) else None
        if running and isinstance(exc_val, Exception) and not isinstance(exc_val, errors.SandpoolError):
            try:
                self.check()
                mapped = self._server_killed() or exc_val
            except errors.InfraError as exc:
                mapped = exc
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
            if running and mapped is not None and self._rollout is not None and not self._rollout.ended:
                self._run(self._rollout.fail(mapped))
        finally:
            self.cleanup()
        if mapped is not None and mapped is not exc_val:
            raise mapped from exc_val

    def _server_killed(self) -> errors.ServiceKilled | None:
        """The policy's failure when the sandbox lives but its agent-server does not (killed or
        stopped from inside: OpenHands' client then fails as if the network had); None when
        the server runs, or when the backend cannot say."""
        problems = self._run(self.lease.sandbox.service_problems())
        if not problems:
            return None
        # A sandbox being killed loses its server a moment before its agent's channel closes:
        # that is the sandbox's failure (infra), so look again after the answer.
        self.check()
        return errors.ServiceKilled(f"sandbox {self.lease.id}: {problems[0]}; its sandbox lives, so a "
                                    "process of the rollout did it")
