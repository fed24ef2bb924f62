"""The sandbox contract: what a pool hands out, and the values it deals in.

:class:`Sandbox` is one isolated environment started from an image; each backend's sandboxes
implement it (see :mod:`sandpool.core.base` for the :class:`~sandpool.core.base.Backend` that
creates and deletes them). :class:`ExecResult` is what a command run in one returns,
:class:`ResourceLimits` what a backend caps each at, :class:`SandboxState` where the pool has
it in its lifecycle.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from sandpool.core import errors

if TYPE_CHECKING:
    from sandpool.core.service import ServiceStream
    from sandpool.core.snapshot import Snapshot

__all__ = [
    "ExecResult",
    "ResourceLimits",
    "Sandbox",
    "SandboxState",
]


@dataclass(frozen=True)
class ExecResult:
    """The result of one command run in a sandbox.

    Attributes:
        exit_code: The process exit status; ``128 + N`` when killed by signal ``N``, and
            ``124`` on timeout (as coreutils ``timeout`` reports it).
        stdout: Captured standard output, at most ``max_output`` bytes.
        stderr: Captured standard error, at most ``max_output`` bytes.
        stdout_truncated: True when stdout was longer than the cap and was cut.
        stderr_truncated: True when stderr was longer than the cap and was cut.
        timed_out: True when the server-side timeout fired and killed the process group.
        duration_s: Wall time of the command inside the sandbox, in seconds.
    """

    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """Stdout decoded as UTF-8; invalid bytes become U+FFFD."""
        return self.stdout.decode("utf-8", "replace")

    @property
    def err_text(self) -> str:
        """Stderr decoded as UTF-8; invalid bytes become U+FFFD."""
        return self.stderr.decode("utf-8", "replace")


@dataclass(frozen=True)
class ResourceLimits:
    """Per-sandbox resource limits.

    Usage: ``ResourceLimits(cpus=1.0, memory_bytes=2 * 2**30, pids=256)``.

    Attributes:
        cpus: CPU quota in cores (``1.0`` is one full core).
        memory_bytes: Memory limit in bytes.
        pids: Maximum number of processes and threads.
        network: Whether the sandbox gets network access (off by default).
        disk_bytes: Cap in bytes on what the sandbox may write (its overlay upper layer and
            ``/tmp``); a write past it fails with ENOSPC inside the sandbox. 0 = no cap.
    """

    cpus: float = 1.0
    memory_bytes: int = 2 * 2**30
    pids: int = 512
    network: bool = False
    disk_bytes: int = 10 * 2**30


class SandboxState(enum.Enum):
    """Lifecycle of one sandbox as the pool sees it."""

    CREATING = "creating"
    IDLE = "idle"
    LEASED = "leased"
    RESETTING = "resetting"
    DELETED = "deleted"


class Sandbox(abc.ABC):
    """One isolated environment started from an image (a pod, or a bubblewrap process tree).

    Attributes:
        id: Unique id of this sandbox, stable for its lifetime.
        image: The image it was started from.
        workdir: Absolute path of the task repository inside the sandbox.
        head: The commit a fresh sandbox's workdir is at, pristine, when the backend knows it
            from the image (then a claim for that commit needs no checkout); else None.
        scratch: Directories outside the repo that the sandbox can write and that belong to
            it alone; the in-place reset empties them and checks they are empty.
        private_ipc: True when the sandbox has its own System V IPC namespace (the reset
            then removes every IPC object in it); False where it may be shared with others.
        recorded: True when the backend recorded its pristine state
            (:func:`~sandpool.core.reset.record_pristine`) before handing it out, off the
            claim path; the pool then does not record it again.
        service_env: The environment its service (:class:`~sandpool.core.service.ServiceSpec`)
            was started with, its secrets included; empty without a service.
    """

    id: str
    image: str
    workdir: str
    head: str | None = None
    scratch: tuple[str, ...] = ("/tmp",)
    private_ipc: bool = False
    recorded: bool = False
    service_env: Mapping[str, str] = MappingProxyType({})

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output: int = 1 << 20,
    ) -> ExecResult:
        """Run a command; a string runs under ``bash -c``.

        Args:
            cmd: Shell string, or an argv list run without a shell.
            timeout: Server-side timeout in seconds; on expiry the command's whole process
                group is killed and ``timed_out`` is set.
            cwd: Working directory inside the sandbox (default: ``workdir``).
            env: Extra environment variables.
            max_output: Cap in bytes on each of stdout and stderr (the agent's backends cut
                at 160 MiB whatever this says, so an answer never outgrows its channel).

        Returns:
            The :class:`ExecResult`.

        Raises:
            ValueError: ``timeout`` is not a finite number of seconds > 0 (nothing is run).
            SandboxDied: The sandbox is gone.
            ExecTransportError: The command channel failed.
        """

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """Return the bytes of ``path`` (absolute, or relative to ``workdir``).

        Raises:
            SandboxFileError: The path cannot be read (its ``errno``: ``ENOENT`` as a
                ``FileNotFoundError``, ``EACCES`` as a ``PermissionError``, ``EISDIR``,
                ``EFBIG`` for a file over the backend's read cap, 32 MiB for the agent's, ...).
                The policy's result, never an infra failure.
            SandboxDied, ExecTransportError: As for :meth:`exec`.
        """

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` (absolute, or relative to ``workdir``), making parents.

        Raises:
            SandboxFileError: The path cannot be written (``EROFS``, ``EACCES``, ``EISDIR``,
                ``ENOTDIR``, ``ENOSPC`` within the sandbox's quota, ...): the policy's result.
            ValueError: ``mode`` is not a permission int in 0..0o7777 (nothing is sent).
            SandboxDied, ExecTransportError: As for :meth:`exec`.
        """

    @abc.abstractmethod
    async def processes(self) -> list[str]:
        """Return the command lines of processes in the sandbox other than its own agent."""

    @abc.abstractmethod
    async def kill_strays(self) -> int:
        """SIGKILL every process in the sandbox except its agent; return how many."""

    def favour_cpu(self, on: bool) -> None:
        """Raise (``on``) or restore this sandbox's CPU weight against other sandboxes'.

        The pool raises it while the first command after a claim runs (TTFC), so that command
        is not queued behind other sandboxes' work (their grading, their resets) on a busy
        host; the weight is restored when the result is back. A backend without per-sandbox
        CPU weights does nothing (this default).
        """

    @abc.abstractmethod
    def alive(self) -> bool:
        """Cheap local check that the sandbox has not died (no round trip)."""

    async def restore_repo(self, under: str = "", *, timeout: float = 60.0) -> list[str] | None:
        """Make the repo at or below ``under`` identical to the image's, then verify it.

        Optional: a backend that can see what a rollout changed without trusting the sandbox
        (the local backend reads its overlay's upper layer on the host) implements it; the
        default returns None and :mod:`sandpool.core.reset` uses its generic in-sandbox path.
        It restores files, not processes: stop the rollout's processes first.

        Args:
            under: Repo-relative path to restore (``""``: the whole repo, ``.git`` included).
            timeout: Seconds the restore may take.

        Returns:
            None when unsupported; else what still differs after the restore (empty: the
            repo, at or below ``under``, is identical to the image's).

        Raises:
            SandboxDied, ExecTransportError: As for :meth:`exec`.
        """
        return None

    async def repo_meta(self, restore: Mapping[str, dict] | None = None, *,
                        skip: tuple[str, ...] = (), timeout: float = 60.0) -> dict | None:
        """Every repo path (``"."``, ``"./<path>"``; ``skip``'s left out) -> its ``{"t":
        [atime_ns, mtime_ns], "o": [uid, gid], "x": {xattr: base64}}``, read without moving
        its times, after those ``restore`` names were set back (``"t"`` a status where they
        could not be: ``"refreshed"`` to now, ``"unwritable"``). Optional (default None): the
        generic reset keeps them fresh with it, as a rollout can write bits into any of them.
        Raises as :meth:`exec`."""
        return None

    async def pin_repo_state(self, paths: list[str]) -> None:
        """Take the current state of repo files ``paths`` as pristine for later restores.

        Optional (default: nothing is pinned). The reset calls it for ``.git/index`` right
        after sandpool's own ``git update-index --refresh`` on a verified tree, with no
        process of any rollout alive: the file then differs from the image's only in git's
        stat cache, and restoring the pinned bytes keeps that cache valid, so the next
        refresh re-reads only the files a rollout changed (O(paths changed), not O(repo)).

        Args:
            paths: Repo-relative file paths.
        """

    async def restore_scratch(self, *, timeout: float = 60.0) -> list[str] | None:
        """Empty the :attr:`scratch` directories and make their own metadata what it was when
        the sandbox was fresh, then verify both.

        Optional: a backend that can do it from out of the policy's reach (the local
        backend's agent, with a record taken when the sandbox started) implements it; the
        default returns None and :mod:`sandpool.core.reset` empties the directories with
        ``find`` and checks they are empty. Not only the contents carry state: a directory's
        mode, times and extended attributes (POSIX ACLs included) can hand a rollout's state
        to the next one. Call it with no process of the rollout left.

        Returns:
            None when unsupported; else what is still not as fresh, one sentence each (empty:
            as fresh).

        Raises:
            SandboxDied, ExecTransportError: As for :meth:`exec`.
        """
        return None

    async def restore_service(self, *, timeout: float = 60.0) -> list[str]:
        """Bring the sandbox's long-lived service (if it runs one) back to its pristine state.

        Optional (default: no service, nothing to do). The in-place reset calls it right after
        killing the rollout's processes: a service the policy could reach (its state directory,
        its API) must forget the rollout or the sandbox is quarantined. The sandboxes that run
        a :class:`~sandpool.core.service.ServiceSpec` implement it.

        Returns:
            What is not pristine, one sentence each (empty: pristine).

        Raises:
            SandboxDied, ExecTransportError: As for :meth:`exec`.
        """
        return []

    async def service_problems(self, *, timeout: float = 30.0) -> list[str]:
        """Why the sandbox's service is not running as it started (gone, stopped, its limits
        changed), one sentence each; [] when it is, or without a service.

        Raises:
            SandboxDied, ExecTransportError: As for :meth:`exec`.
        """
        return []

    async def connect_service(self) -> ServiceStream:
        """Open one connection to the sandbox's service (its
        :attr:`~sandpool.core.service.ServiceSpec.socket` or ``port``).

        Raises:
            ConfigError: The sandbox runs no service this backend can connect to.
            SandboxDied: The sandbox is gone.
            OSError, ExecTransportError: The connection failed (nothing listens, the transport
                broke).
        """
        raise errors.ConfigError(f"sandbox {self.id} runs no service to connect to; give the "
                                 "backend a ServiceSpec with a socket (local) or port (Kubernetes)")

    async def snapshot(self) -> Snapshot:
        """Capture the sandbox's filesystem state: the repo, and everything it changed outside
        the repo since the image (not its processes). See :mod:`sandpool.core.snapshot`.

        Optional: the default raises ``ConfigError`` (the backend cannot snapshot).

        Raises:
            ConfigError: This backend (or this sandbox's kind of image) cannot snapshot.
            SandboxDied, ExecTransportError, InfraError: The sandbox or the host failed.
        """
        raise errors.ConfigError(f"sandbox {self.id}: this backend ({type(self).__name__}) "
                                 "cannot take snapshots")

    async def load_snapshot(self, snap: Snapshot) -> None:
        """Make this pristine sandbox's filesystem ``snap``'s state (:meth:`snapshot` of a
        sandbox of the same image). The caller verifies it with :meth:`state_hash`.

        Raises:
            ConfigError: The snapshot is of another image, build or backend, or its data is
                gone; or this backend cannot restore snapshots.
            SandboxDied, ExecTransportError, InfraError: The sandbox or the host failed.
        """
        raise errors.ConfigError(f"sandbox {self.id}: this backend ({type(self).__name__}) "
                                 "cannot restore snapshots")

    async def state_hash(self) -> str:
        """The hash of the sandbox's filesystem state, as :meth:`snapshot` would record it
        (its ``content_hash``): a sandbox restored from a snapshot shows the snapshot's.

        Raises:
            ConfigError: This backend cannot snapshot.
            SandboxDied, ExecTransportError: As for :meth:`exec`.
        """
        raise errors.ConfigError(f"sandbox {self.id}: this backend ({type(self).__name__}) "
                                 "cannot take snapshots")

    async def changes_outside_repo(self) -> list[tuple[str, str]] | None:
        """What the rollout changed outside the repo and ``/tmp``, seen from outside the sandbox.

        Optional: the local backend reads an OCI sandbox's root overlay's upper layer on the host;
        a pod's agent (its pid 1) lists what the pod can write; default None (unknown).

        Returns:
            None when unsupported; else ``(path, kind)`` pairs, ``kind`` one of ``added``
            (the image has no such path), ``modified``, ``deleted``, ``replaced``.
        """
        return None
