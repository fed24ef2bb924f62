"""One long-lived agent session per sandbox over a single pod stream.

After a sandbox is claimed, :class:`AgentSession` opens ONE stream (stdin, stdout and stderr)
to sandpool's agent (``sandpool/core/agent/_agent.py``, the same file the local backend
runs): an exec running ``python3 -I -u -c <source>``, or, with the agent as the container's
pid 1 (:mod:`._entrypoint`), an attach to it. Every later command, file read and write,
process listing and kill of strays of the sandbox is a JSON line on that stream: the one
:class:`~sandpool.core.agent.client.AgentClient` over a :class:`~._channel.PodExecChannel`.
The API server then sees one stream per sandbox lifetime, not one per command.

A session that ends while its sandbox lives (API server restart, reset connection, the node's
kubelet gone) fails every pending and later call with ``ExecTransportError`` (infra: the
rollout is retried, never scored) and makes the sandbox not ``alive()``, so the pool deletes
it instead of reusing it; its replacement opens its own stream (counted in ``execs``). A
stream that the API server could not even connect to the node (:func:`._channel.unreached`)
is retried within the HTTP layer's budget; only an agent that itself exited with a status (no
interpreter) makes the image fall back to per-command exec (:mod:`._exec`, a degraded mode).

Who can signal the agent. The policy's commands are the agent's children: if they can kill
it they end the channel, which turns a rollout they are failing into an infra retry. On the
kwok test cluster the session is started by ``unshare --pid --fork --mount-proc``
(``hack/cluster/container.sh``) and the agent is pid 1 of that pid namespace, as
under the local backend's ``bwrap --as-pid-1``: the kernel drops every signal sent to it from
inside that it has no handler for (SIGKILL and SIGSTOP too, even from root), so
``kill -9 -1`` and ``kill -9 1`` leave it running. On a real cluster a pod exec joins the
container's pid namespace, whose pid 1 is the container's entrypoint, so the agent is an
ordinary process there. ``KubernetesBackend(agent_entrypoint=True)`` gives the same
guarantee there: the agent is the container's pid 1 (its command, :mod:`._entrypoint`), and
this session reaches it over ``pods/attach`` instead of ``pods/exec`` (``attach=True``).
Ptrace of the agent and reading its ``/proc/<pid>/fd`` need ``CAP_SYS_PTRACE``, which a
container lacks by default (the agent is non-dumpable). Setting its resource limits
(``prlimit``, which the pod's ``RuntimeDefault`` profile allows to any process of the same
uid: a CPU limit kills even a pid 1, a file limit of 3 fails every request) is denied by the
seccomp filter the agent installs on itself before the first command, with
``no_new_privs``, which every command inherits (:mod:`sandpool.core.agent.seccomp`, the local
sandboxes' filter; kernel keyrings are out of reach under it too). On kwok, commands run as root on the
node host: the signal path is closed, ptrace is not.
"""

from __future__ import annotations

import base64
import itertools
import logging
from typing import TYPE_CHECKING

from sandpool.core import errors
from sandpool.core.agent import seccomp
from sandpool.core.agent.client import AgentClient, agent_source
from sandpool.core.backends.kubernetes._channel import PROTOCOLS, PodExecChannel
from sandpool.core.backends.kubernetes._entrypoint import boot_payload
from sandpool.core.backends.kubernetes._exec import ExecTarget

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._http import KubeHttp

__all__ = ["AgentSession", "AgentUnavailable"]

log = logging.getLogger("sandpool.kubernetes")


class AgentUnavailable(Exception):
    """The agent could not start in the pod (no ``python3``, or it never said ready); the
    sandbox falls back to one pod exec per command."""


class AgentSession:
    """The agent of one pod, spoken to over one exec stream.

    Usage: ``session = AgentSession(http, target, sid, "python3"); await session.start(30)``,
    then :meth:`KubernetesSandbox.attach(session) <._sandbox.KubernetesSandbox.attach>`.

    Args:
        http: The backend's HTTP layer.
        target: The pod.
        sandbox_id: For messages.
        python: The interpreter command in the image.
        attach: The agent is the container's pid 1 (:mod:`._entrypoint`): attach to it and
            send it its source, instead of exec'ing it.

    Attributes:
        client: The agent's client, once :meth:`start` returned.
        channel: Its pod-exec stream, once :meth:`start` returned.
    """

    def __init__(self, http: KubeHttp, target: ExecTarget, sandbox_id: str, python: str,
                 attach: bool = False) -> None:
        self._http = http
        self._target = target
        self._sandbox_id = sandbox_id
        self._attach = attach
        self._argv = [] if attach else [python, "-I", "-u", "-c", agent_source()]
        self._what = f"agent session in {target.namespace}/{target.pod}"
        self.client: AgentClient | None = None
        self.channel: PodExecChannel | None = None

    @property
    def protocol(self) -> str | None:
        """The negotiated channel protocol (``v5.channel.k8s.io``...), once open."""
        return self.channel.protocol if self.channel is not None else None

    @property
    def stderr_tail(self) -> bytes:
        """The last bytes the agent wrote to stderr (its service's output too)."""
        return bytes(self.channel.stderr_tail) if self.channel is not None else b""

    @property
    def attached(self) -> bool:
        """True when the agent is its container's pid 1, reached over attach
        (:mod:`._entrypoint`): its pod's root file system is then read-only."""
        return self._attach

    @property
    def ended_cleanly(self) -> bool:
        """True once the stream ended without a transport error (see
        :attr:`PodExecChannel.ended_cleanly`)."""
        return self.channel is not None and self.channel.ended_cleanly

    @property
    def alive(self) -> bool:
        """True from :meth:`start` until the stream ended."""
        return self.client is not None and self.client.alive()

    async def start(self, timeout: float) -> None:
        """Open the stream and wait for the agent's ready line.

        Raises:
            AgentUnavailable: The agent did not start: its process ended with an exit status
                (no ``python3``, a failed prctl), said nothing within ``timeout``, or (attach)
                the entrypoint found no usable interpreter; the stream is closed.
            SandboxDied: The pod is gone.
            ExecTransportError, BackendUnavailable: The handshake failed, or the API server
                could not reach the node (:func:`._channel.unreached`), after the HTTP layer's
                retries; or the stream broke before the ready line without an exit status:
                infra errors, never a reason to give up the agent for the image. Also
                ``ExecTransportError`` when the agent could not install its seccomp filter,
                and ``BackendUnavailable`` when the pod's architecture has none
                (:mod:`sandpool.core.agent.seccomp`): no command runs without it.
        """
        query = [("container", self._target.container), ("stdin", "true"),
                 ("stdout", "true"), ("stderr", "true")]
        query += [("command", a) for a in self._argv]
        sub = "attach" if self._attach else "exec"
        path = f"/api/v1/namespaces/{self._target.namespace}/pods/{self._target.pod}/{sub}"
        for attempt in itertools.count(1):
            channel = PodExecChannel(await self._http.ws_connect(path, query, PROTOCOLS), self._what)
            client = AgentClient(channel, self._sandbox_id)
            try:
                if self._attach:
                    await channel.write(boot_payload())
                hello = await client.ready(timeout)
            except (TimeoutError, errors.SandpoolError) as exc:
                await client.aclose()
                if channel.unreached is not None:
                    # The API server could not reach the node: the agent never started.
                    # Retried within the HTTP layer's budget, like a refused handshake.
                    if await self._http.retry_wait(attempt, 500):
                        continue
                    raise errors.ExecTransportError(
                        f"{self._what}: the API server could not reach the pod's node after "
                        f"{attempt - 1} retries: {channel.unreached[:300]}"
                    ) from None
                if isinstance(exc, errors.SandpoolError) and not channel.exited:
                    # The stream broke (API server restart, reset connection, pod gone) before
                    # the agent could answer: the cluster's failure, not the image's; the next
                    # sandbox of the image tries the agent again.
                    raise exc
                tail = bytes(channel.stderr_tail[-300:]).decode("utf-8", "replace").strip()
                why = f"no ready line within {timeout:.0f} s" if isinstance(exc, TimeoutError) else str(exc)
                raise AgentUnavailable(f"{why}{': ' + tail if tail else ''}") from None
            if hello.get("ready") is not True:  # the entrypoint found no usable interpreter
                await client.aclose()
                raise AgentUnavailable(str(hello.get("error") or hello))
            try:  # before any command: every process the agent starts inherits the filter
                prog = seccomp.program(hello.get("machine"))
                await client.call("seccomp", timeout, program=base64.b64encode(prog).decode())
            except BaseException:
                await client.aclose()
                raise
            self.channel, self.client = channel, client
            return

    async def aclose(self) -> None:
        """Close the agent's stdin (it exits), then the stream; idempotent."""
        if self.client is not None:
            await self.client.aclose()
