"""The backend contract: what creates and deletes the sandboxes a pool hands out.

A backend creates and deletes sandboxes; a sandbox runs commands and moves files
(:mod:`sandpool.core.sandbox`: the :class:`Sandbox` contract and its value types, importable
from here too). Local (bubblewrap) and Kubernetes (agent-sandbox) backends are peers behind
:class:`Backend`, in the way httpx's transports are peers behind ``BaseTransport``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from sandpool.core.metrics import ClusterStats
from sandpool.core.rate import AdaptiveRate
from sandpool.core.sandbox import ExecResult, ResourceLimits, Sandbox, SandboxState
from sandpool.core.telemetry import NO_METRICS, Telemetry

if TYPE_CHECKING:
    from sandpool.core.snapshot import Snapshot

__all__ = [
    "Backend",
    "ExecResult",
    "ResourceLimits",
    "Sandbox",
    "SandboxState",
]


class Backend(abc.ABC):
    """Creates and deletes sandboxes. One async method per operation.

    Backends translate every lower-layer error into :mod:`sandpool.core.errors` at their
    boundary.
    """

    #: Short name used in reports (``local``, ``kubernetes``, ``memory``).
    name: str = "backend"
    #: Where a backend records control-plane requests (set by the pool that uses it).
    telemetry: Telemetry = NO_METRICS

    async def preflight(self) -> None:
        """Check that this backend can run at all; raise :class:`BackendUnavailable` if not."""

    async def hydrate(self, image: str) -> None:
        """Make ``image`` present where sandboxes will start (pull, or verify a build).

        Raises:
            ImageNotFound: The image does not exist and cannot be obtained.
        """

    async def set_warm_target(self, image: str, n: int, *, reuse: bool) -> int:
        """Take the strategy's warm-pool target of ``n`` sandboxes for ``image``.

        A backend with a warm pool of its own (agent-sandbox's SandboxWarmPool) keeps some
        or all of them there and returns how many the pool must still keep itself, by
        :meth:`create`. The default keeps none: the pool keeps all ``n``.

        Args:
            image: The image.
            n: Warm sandboxes the strategy wants for it (0 for none).
            reuse: Whether the strategy resets sandboxes in place and keeps them.

        Returns:
            How many warm sandboxes the pool keeps itself (``0 <= result <= n``).
        """
        return n

    async def wait_warm(self) -> None:
        """Wait until the backend's own warm pools (see :meth:`set_warm_target`) are filled."""

    @abc.abstractmethod
    async def create(self, image: str) -> Sandbox:
        """Start a sandbox from ``image`` and return once it accepts commands.

        Raises:
            ImageNotFound: Unknown image.
            SandboxStartError: The sandbox failed to start.
        """

    @abc.abstractmethod
    async def delete(self, sandbox: Sandbox) -> None:
        """Stop ``sandbox`` and remove everything it made. Idempotent; never raises for a
        sandbox that is already gone."""

    async def suspend(self, sandbox: Sandbox) -> bool:
        """Freeze every process of ``sandbox`` in place, keeping its memory and state.

        Optional: the default returns False (this backend cannot freeze; a lease's suspend
        then snapshots the sandbox and :meth:`park` s it or lets it go, see
        :mod:`sandpool.core.pool.snapshots`).

        Returns:
            True when frozen.
        """
        return False

    async def resume(self, sandbox: Sandbox) -> None:
        """Thaw a sandbox :meth:`suspend` froze (default: nothing to do)."""

    async def park(self, sandbox: Sandbox) -> bool:
        """Release what runs ``sandbox`` (its processes, their memory and its filesystem)
        while the sandbox's identity stays, for :meth:`unpark` to run it again. The pool
        takes a snapshot first; nothing else of its state is kept.

        Optional: the default returns False (then the pool deletes the sandbox, and a resume
        claims another). The Kubernetes backend sets its agent-sandbox Sandbox's
        ``spec.operatingMode`` to ``Suspended``: the controller deletes the pod, the Sandbox
        object and its claim remain.

        Returns:
            True when released and kept.

        Raises:
            InfraError: The release failed (the sandbox is then unusable).
        """
        return False

    async def unpark(self, sandbox: Sandbox) -> Sandbox:
        """Run a sandbox :meth:`park` released again: a new handle on the same identity,
        fresh from its image (nothing of the parked state), returned once it accepts
        commands. The pool then records it pristine and restores the suspend's snapshot
        into it, verified. Called only after :meth:`park` returned True.

        Raises:
            InfraError: It did not come back (the pool then deletes it and claims another).
        """
        raise NotImplementedError(f"{type(self).__name__} parks no sandbox")

    async def discard_snapshot(self, snap: Snapshot, *, keep: Snapshot | None = None) -> None:
        """Remove what only ``snap`` holds of this backend's snapshot data (none of ``keep``'s):
        a snapshot nobody will restore again (a superseded checkpoint). Optional; the default
        keeps everything until :meth:`aclose`. Never raises."""

    async def aclose(self) -> None:
        """Release backend-wide resources (clients, state directories)."""

    @property
    def api_writes(self) -> int:
        """Number of write requests this backend sent to a control plane (0 for local)."""
        return 0

    @property
    def write_rates(self) -> dict[str, AdaptiveRate]:
        """The write bucket of each cluster this backend talks to, by cluster name (none for
        a backend without a control plane)."""
        return {}

    @property
    def cluster_stats(self) -> list[ClusterStats]:
        """What was placed on each cluster, for a backend over several (empty otherwise)."""
        return []

    @property
    def api_execs(self) -> int:
        """Number of exec/attach streams this backend opened through a control plane (0 for
        local)."""
        return 0
