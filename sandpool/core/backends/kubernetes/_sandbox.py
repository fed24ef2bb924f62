"""The sandbox side of the Kubernetes backend: one pod, its agent reached over pod exec.

:class:`KubernetesSandbox` is an :class:`~sandpool.core.agent.sandbox.AgentSandbox`: its
commands, files, processes and service go through its agent session (:mod:`._session`: one
exec stream for the sandbox's lifetime), or, where the agent cannot run, through the
degraded per-command exec (:mod:`._exec`). It adds the pod's lifecycle: its death, set by the
backend's shared pod watch, and the service's place in the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandpool.core import changeset, errors
from sandpool.core.agent.client import AgentOps, AgentStarved
from sandpool.core.agent.sandbox import AgentSandbox
from sandpool.core.backends.kubernetes._exec import ExecTarget, ShellExec
from sandpool.core.backends.kubernetes._manifests import RUN_DIR
from sandpool.core.backends.kubernetes._portforward import PortStream, open_port
from sandpool.core.backends.kubernetes._service import IN_SERVICE_DIR, TREE, service_dir_argv
from sandpool.core.backends.kubernetes._session import AgentSession
from sandpool.core.service import ServiceSpec, ServiceStream
from sandpool.core.snapshot import Snapshot

if TYPE_CHECKING:
    from sandpool.core.backends.kubernetes._http import KubeHttp

__all__ = ["KubernetesSandbox"]

#: What a pod whose agent is its container's pid 1 (its root read-only) can write besides the
#: repo and :data:`._manifests.RUN_DIR` that is its alone: emptied, and restored to its fresh
#: metadata, by the reset (``/dev/shm`` and the mqueue are the pod's IPC namespace's).
CONTAINED_SCRATCH = ("/tmp", "/dev/shm", "/dev/mqueue")
#: What the agent's ``writable`` op says of a path's times it could not set back (see the op).
_UNSET = ("refreshed", "unwritable")
#: Seconds a sandbox whose agent's stream ended waits for the pod watch to say why (the
#: kubelet reports a container's end within seconds); past it the end is a transport error.
_DEATH_WAIT_S = 30.0


@dataclass(frozen=True)
class _Listing:
    """The agent's ``writable`` answer: each path's description, its times, and the
    agent's own state (``own``)."""

    entries: dict[str, str]
    times: dict[str, Any]
    own: list[str] | None = None


class KubernetesSandbox(AgentSandbox):
    """One pod (claimed through a SandboxClaim, or created directly) spoken to over exec.

    Created by :meth:`KubernetesBackend.create`; not constructed directly.

    Args:
        http: The backend's HTTP layer.
        sid: The sandbox id.
        image: The task image.
        target: The pod and its exec prefixes.
        pod_uid: The pod's UID when it became Ready.
        claim: The SandboxClaim name (agent-sandbox mode), else None.
        agent_python: The interpreter command that runs sandpool's code in the pod.

    Attributes:
        pod: The pod name.
        pod_uid: The pod's UID when it became Ready (a pod re-created under the same name is
            a different sandbox: this one counts as dead).
        claim: The SandboxClaim name (agent-sandbox mode), else None.
        owner: ``(resource, name)`` deleted to end this sandbox: its claim, Sandbox object or
            pod.
        sandbox_name: Its agent-sandbox Sandbox object (its claim's, or its own), whose
            ``spec.operatingMode`` suspends it; None for a plain pod.
    """

    _service_cwd = "/"  # the service's directory is $SANDPOOL_POD_RUN/service (see _service)

    def __init__(self, http: KubeHttp, sid: str, image: str, target: ExecTarget, pod_uid: str,
                 claim: str | None, *, agent_python: str = "python3") -> None:
        self.id = sid
        self.image = image
        self.workdir = target.workdir
        self.pod = target.pod
        self.pod_uid = pod_uid
        self.claim = claim
        self.owner: tuple[str, str] = ("pods", target.pod)
        self.sandbox_name: str | None = None
        self.agent_python = agent_python
        self.service_env: dict[str, str] = {}
        #: The port the service serves in the pod, or None without one.
        self.service_port: int | None = None
        self._http = http
        self._target = target
        self._dead: str | None = None
        self._death_evidence: list[str] = []
        self._dead_event = asyncio.Event()
        #: Its pod runs a container (the backend's ``agent_entrypoint``): what the pod can
        #: write outside the repo is then held to :meth:`record_fresh`'s record by the reset.
        self.in_container = False
        self._outside: _Listing | None = None  # record_fresh's
        self._session: AgentSession | None = None
        self._shell = ShellExec(http, target)
        #: The build of the image its pod runs (``_live.image_identity``).
        self.image_id = ""
        #: The backend's snapshot store on this host (set by the backend), or None.
        self.snapshots: Path | None = None

    def __repr__(self) -> str:
        state = f"dead: {self._dead}" if self._dead else "alive"
        return f"<KubernetesSandbox {self.id} pod={self.pod} claim={self.claim} {state}>"

    def attach(self, session: AgentSession) -> None:
        """Run this sandbox's work over ``session`` (started on its pod; maybe pre-opened on
        the warm pod before the claim). Without one it runs in the degraded mode."""
        assert session.client is not None, "attach a started session"
        session.client.name = self.id
        self._session = session
        if session.attached:  # its container: a read-only root, an IPC namespace of its own
            self.scratch = CONTAINED_SCRATCH
            self.private_ipc = True

    @property
    def contained(self) -> bool:
        """True when its agent is its container's pid 1 (``agent_entrypoint``): the pod's
        root file system is read-only, and the reset checks every other place it can write
        (:meth:`record_fresh`)."""
        return self._session is not None and self._session.attached

    def _outside_skip(self) -> list[str]:
        # The repo and the scratch directories are the reset's own business, and so is the
        # service's directory while it runs (its restore compares its tree).
        svc = [f"{RUN_DIR}/service"] if self._service is not None else []
        return [self.workdir, *self.scratch, *svc]

    async def record_fresh(self, *, timeout: float = 60.0) -> None:
        """Record, while the pod is fresh, what the reset compares outside the repo: the
        scratch directories' own metadata (:meth:`record_scratch`) and every other path the
        pod can write (the agent's ``writable`` listing: ``/dev``, ``/etc/hosts``, the
        service's run directory...), times included. A no-op unless :attr:`contained`, or
        when recorded already (:meth:`adopt_fresh`).

        Raises:
            SandboxStartError: The listing could not be taken (a writable root, or too much).
        """
        if not self.contained or self._outside is not None:
            return
        await self.record_scratch(timeout=timeout)
        msg = await self._call("writable", timeout, skip=self._outside_skip())
        if msg["root_writable"] or msg["over"]:
            why = "its root file system is writable" if msg["root_writable"] else "too many paths"
            raise errors.SandboxStartError(f"sandbox {self.id}: what its pod can write outside "
                                           f"the repo cannot be recorded ({why})")
        self._outside = _Listing(msg["entries"], msg["times"], msg.get("own"))

    def adopt_fresh(self, source: KubernetesSandbox) -> None:
        """Take the record :meth:`record_fresh` took through ``source``, another handle on
        the same pod made before any rollout touched it (its warm pod's pre-opened session)."""
        self._outside, self._scratch_record = source._outside, source._scratch_record

    async def changes_outside_repo(self) -> list[tuple[str, str]] | None:
        """What changed since :meth:`record_fresh` among the paths the pod can write outside
        the repo, the scratch directories and its running service's directory, listed by its
        agent: ``added``, ``deleted`` or ``modified`` (type, mode, owner, bytes, link target,
        extended attributes, or times it could not set back); also ``modified`` when the
        agent's own scheduling, CPU affinity, I/O priority, OOM score or core dump filter
        moved (a command of its uid can set them; the agent cannot set most back). First
        the agent sets every recorded path's atime and mtime back to the record's, so no
        moment a rollout chose survives (where it does not own a path, moved to now, as the
        scratch directories' are). A listing that cannot be compared is one ``modified`` entry naming why.

        Returns:
            None on a pod that runs no container (kwok); the changes otherwise. A sandbox
            :attr:`in_container` without its agent (the exec channel) answers one
            ``modified`` entry: nothing can list its pod, so its reset never passes.
        """
        if self._outside is None:
            if self.in_container:
                return [("(not listed: its pod runs commands without sandpool's agent)",
                         "modified")]
            return None
        fresh = self._outside
        msg = await self._call("writable", 60.0, skip=self._outside_skip(),
                               times={p: t for p, t in fresh.times.items() if isinstance(t, list)})
        if msg["root_writable"] or msg["over"]:
            why = "the root file system is writable" if msg["root_writable"] else "too many paths"
            return [(f"(not comparable: {why})", "modified")]
        now, times = msg["entries"], msg["times"]
        changes = []
        for p in sorted(set(now) | set(fresh.entries)):
            if p not in fresh.entries or p not in now:
                changes.append((p, "added" if p in now else "deleted"))
            elif now[p] != fresh.entries[p] or times.get(p) not in (fresh.times.get(p), *_UNSET):
                changes.append((p, "modified"))
        if msg.get("own") != fresh.own:  # set on the agent by a command; nothing sets it back
            changes.append(("/proc/1 (the agent's scheduling, affinity, I/O priority, OOM score "
                            "or core dump filter)", "modified"))
        return changes

    @property
    def channel(self) -> str:
        """``"agent"`` when commands go over the agent session, else ``"exec"`` (degraded)."""
        return "agent" if self._session is not None else "exec"

    @property
    def protocol(self) -> str | None:
        """The exec channel protocol negotiated (``v5.channel.k8s.io``...), once known."""
        return self._session.protocol if self._session is not None else self._shell.protocol

    def _ops(self) -> AgentOps:
        if self._session is not None and self._session.client is not None:
            return self._session.client
        return self._shell

    def _gone(self) -> errors.SandpoolError | None:
        return self._died() if self._dead is not None else None

    def _mark_dead(self, reason: str, evidence: list[str] | None = None) -> None:
        """The pod watch saw the pod deleted, evicted, failed or replaced (or sandpool ended it):
        every later request, and any answer still due, raises ``SandboxDied`` naming
        ``reason``, or ``SandboxExhausted`` with ``evidence`` that the pod's own processes
        killed it (:func:`._pods.death_evidence`). The first account stands."""
        if self._dead is None:
            self._dead = reason
            self._death_evidence = list(evidence or [])
            self._dead_event.set()

    def _died(self) -> errors.SandboxDied | errors.SandboxExhausted:
        where = f"sandbox {self.id} (pod {self._target.namespace}/{self.pod})"
        if self._death_evidence:
            return errors.SandboxExhausted(f"{where}: {self._dead}, and "
                                           f"{'; '.join(self._death_evidence)}")
        return errors.SandboxDied(f"{where}: {self._dead} (no OOM kill reported for its "
                                  "container: not its processes' doing)")

    def _starved_evidence(self, exc: AgentStarved) -> list[str]:
        # The agent, its container's pid 1, read its own group's pid controller: no view of
        # the pod from outside is needed (or available to sandpool on a user's cluster).
        return exc.evidence()

    async def _ended(self) -> errors.SandpoolError | None:
        """The agent's stream ended without a transport error (its process exited): wait, for
        at most :data:`_DEATH_WAIT_S`, for the pod watch to say why, so that the death is
        judged by the pod's status (an OOM kill is the policy's) rather than as a lost
        stream."""
        session = self._session
        if self._dead is None and session is not None and session.ended_cleanly:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dead_event.wait(), _DEATH_WAIT_S)
        return self._gone()

    async def _close_session(self) -> None:
        if self._session is not None:
            await self._session.aclose()

    # -- snapshots: change sets against the pristine record (sandpool.core.changeset) -------

    def _snapshot_python(self) -> tuple[str, Path]:
        if self._session is None:
            raise errors.ConfigError(
                f"sandbox {self.id}: snapshots of a pod need sandpool's agent in it (agent=True and "
                "an image with agent_python)")
        if self.snapshots is None:
            raise errors.ConfigError(f"sandbox {self.id} was not made by a KubernetesBackend: no "
                                     "snapshot store")
        return self.agent_python, self.snapshots

    async def snapshot(self) -> Snapshot:
        """Take the pod's change set against its pristine record (the repo and ``/tmp``; see
        :mod:`sandpool.core.changeset`); the archive is kept on this host.

        Raises:
            ConfigError: The pod runs without the agent, or has no pristine record.
            SandboxDied, ExecTransportError, InfraError: The pod or the script failed.
        """
        python, store = self._snapshot_python()
        return await changeset.capture(self, python, store, "kubernetes", self.image_id)

    async def load_snapshot(self, snap: Snapshot) -> None:
        """Write ``snap``'s change set into this pristine pod; see :meth:`Sandbox.load_snapshot`."""
        python, store = self._snapshot_python()
        snap.check_target(self.image, self.image_id, "kubernetes")
        await changeset.load(self, python, snap, store)

    async def state_hash(self) -> str:
        """The hash of the pod's change set now (what its snapshot's ``content_hash`` is)."""
        python, _ = self._snapshot_python()
        return await changeset.state_hash(self, python)

    # -- the service: in the pod's service directory, reached over pods/portforward ---------

    def _service_argv(self, spec: ServiceSpec) -> list[str]:
        return service_dir_argv(spec)

    def _service_log(self) -> str:
        tail = self._session.stderr_tail[-1500:] if self._session is not None else b""
        return tail.decode("utf-8", "replace").strip()

    async def _service_tree(self) -> dict[str, tuple[str, ...]]:
        res = await self.exec(["/bin/sh", "-c", f'exec "$0" -I -c "$1" {IN_SERVICE_DIR}',
                               self.agent_python, TREE], timeout=60.0, cwd="/")
        if not res.ok:
            raise errors.ExecTransportError(
                f"sandbox {self.id}: listing its service directory failed (exit {res.exit_code}): "
                f"{res.err_text.strip()[-300:]}")
        return {k: tuple(v) for k, v in json.loads(res.stdout).items()}

    async def start_service(self, spec: ServiceSpec) -> None:
        """Start ``spec`` through the agent session and record its fresh state (see
        :func:`sandpool.core.agent.service.start`).

        Raises:
            ConfigError: The sandbox runs in the degraded mode: the service needs the agent to
                keep it alive and out of ``kill_strays``' reach.
            SandboxStartError, SandboxDied, ExecTransportError: As the base's.
        """
        if self._session is None:
            raise errors.ConfigError(
                f"sandbox {self.id}: KubernetesBackend(service=...) needs sandpool's agent in the "
                "pod (agent=True and an image with agent_python)")
        await super().start_service(spec)
        self.service_port = spec.port

    async def open_port(self, port: int) -> PortStream:
        """Open one connection to ``port`` inside the pod (``pods/portforward``).

        Raises:
            SandboxDied: The pod is gone.
            ExecTransportError, BackendUnavailable: The handshake failed.
        """
        if (err := self._gone()) is not None:
            raise err
        return await open_port(self._http, self._target.namespace, self.pod, port)

    async def connect_service(self) -> ServiceStream:
        """Connect to the service's :attr:`ServiceSpec.port` in the pod (``pods/portforward``).

        Raises:
            ConfigError: No service, or its spec names no port.
            SandboxDied: The pod is gone.
            ExecTransportError, BackendUnavailable: The handshake failed.
        """
        if self.service_port is None:
            return await super().connect_service()
        return await self.open_port(self.service_port)
