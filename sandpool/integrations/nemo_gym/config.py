"""The ``sandpool:`` block of a NeMo Gym config: backend, strategy, pool sizes, task source.

The same block configures the resources server (under its server config) and the sandbox
provider (as the provider's keyword arguments)::

    sandpool:
      backend: local            # local | kubernetes
      strategy: reuse           # cold | warm | reuse
      tasks: default            # a tasks.jsonl path, or "default" for the built-in task pack
      concurrency: 8            # sessions expected at once; sizes the warm pools
      idle_timeout_s: 600       # reclaim an abandoned session's sandbox after this long

Unknown keys are rejected, and every error names the offending key (``sandpool.strategy``).
This module imports neither NeMo Gym nor anything outside sandpool, so a config can be checked
without the integration's dependencies.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sandpool.core import errors
from sandpool.core.base import Backend, ResourceLimits
from sandpool.core.pool import PoolLimits, SandboxPool
from sandpool.core.task import Task

__all__ = ["PoolSettings", "validate_settings"]


class PoolSettings(BaseModel):
    """Validated pool settings, as written under ``sandpool:`` in YAML.

    Usage: ``PoolSettings(tasks="tasks.jsonl", strategy="reuse", concurrency=8)``.

    Attributes:
        backend: ``local`` (bubblewrap on this machine) or ``kubernetes``.
        strategy: ``cold``, ``warm`` or ``reuse`` (see DESIGN: strategy).
        tasks: Path of a SWE-bench-format ``tasks.jsonl``, or ``default`` for the task pack
            sandpool builds locally. ``None`` serves only tasks sent inline.
        images_root: Directory of local image directories (default: sandpool's cache).
        concurrency: Sessions expected at once; the warm pools are sized for it.
        num_repeats: NeMo Gym's ``num_repeats`` (a GRPO group: rollouts of one row at once);
            each task's warm pool is sized for that many of its sessions at once.
        prepare: Hydrate images and fill warm pools at startup, off the rollout path.
        max_live: Cap on live sandboxes (``None``: the strategy's default for ``concurrency``).
        create_rate: Sandbox creations per second, sustained.
        create_burst: Creations allowed back to back.
        claim_timeout_s: Seconds a claim may wait for a sandbox.
        reset_timeout_s: Seconds an in-place reset may take.
        create_timeout_s: Seconds one sandbox creation may take.
        idle_timeout_s: Seconds a session may go without a request before its sandbox is
            reclaimed (released for reuse) and the session expires.
        exec_timeout_s: Default timeout of one tool command, in seconds.
        max_exec_timeout_s: Largest timeout a tool call may ask for, in seconds.
        grade_timeout_s: Seconds the task's tests may run in ``/verify``.
        max_output_bytes: Cap on each of stdout/stderr returned by a tool call, in bytes.
        max_file_bytes: Cap on a file read or written by a tool call, in bytes.
        cpus: CPU quota per sandbox, in cores.
        memory_mib: Memory limit per sandbox, in MiB.
        pids: Process limit per sandbox.
        network: Give sandboxes network access.
        require_limits: Local backend only: refuse to run without cgroup limits.
        kubernetes: Kubernetes backend only: keyword arguments of ``KubernetesBackend``
            (``kubeconfig``, ``namespace``, ``mode``, ``runtime_class``, ...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["local", "kubernetes"] = "local"
    strategy: Literal["cold", "warm", "reuse"] = "reuse"
    tasks: str | None = "default"
    images_root: str | None = None
    concurrency: int = Field(default=8, ge=1)
    num_repeats: int = Field(default=1, ge=1)
    prepare: bool = True
    max_live: int | None = Field(default=None, ge=1)
    create_rate: float = Field(default=20.0, gt=0)
    create_burst: int = Field(default=20, ge=1)
    claim_timeout_s: float = Field(default=300.0, gt=0)
    reset_timeout_s: float = Field(default=60.0, gt=0)
    create_timeout_s: float = Field(default=120.0, gt=0)
    idle_timeout_s: float = Field(default=600.0, gt=0)
    exec_timeout_s: float = Field(default=60.0, gt=0)
    max_exec_timeout_s: float = Field(default=600.0, gt=0)
    grade_timeout_s: float = Field(default=300.0, gt=0)
    max_output_bytes: int = Field(default=64 << 10, ge=1)
    max_file_bytes: int = Field(default=4 << 20, ge=1)
    cpus: float = Field(default=1.0, gt=0)
    memory_mib: int = Field(default=2048, ge=64)
    pids: int = Field(default=512, ge=16)
    network: bool = False
    require_limits: bool = True
    kubernetes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _timeouts_agree(self) -> PoolSettings:
        if self.exec_timeout_s > self.max_exec_timeout_s:
            raise ValueError(
                f"exec_timeout_s ({self.exec_timeout_s}) exceeds max_exec_timeout_s "
                f"({self.max_exec_timeout_s}); lower the first or raise the second"
            )
        return self

    def tool_timeout(self, asked: float | None) -> float:
        """The seconds a tool command may run when the call asks for ``asked``: ``exec_timeout_s``
        when it asks for none (``None``, 0), NaN or a negative number, else ``asked``, never
        over ``max_exec_timeout_s`` (``inf`` gets that). A tool call's numbers are the
        policy's, and no value of them may turn its command into an infra failure."""
        if asked is None or math.isnan(asked) or asked <= 0:
            return self.exec_timeout_s
        return min(float(asked), self.max_exec_timeout_s)

    def limits(self) -> PoolLimits:
        """Return the :class:`PoolLimits` these settings describe."""
        return PoolLimits(
            max_live=self.max_live,
            create_rate=self.create_rate,
            create_burst=self.create_burst,
            claim_timeout=self.claim_timeout_s,
            reset_timeout=self.reset_timeout_s,
            create_timeout=self.create_timeout_s,
        )

    def resource_limits(self) -> ResourceLimits:
        """Return the per-sandbox :class:`ResourceLimits` these settings describe."""
        return ResourceLimits(cpus=self.cpus, memory_bytes=self.memory_mib << 20, pids=self.pids,
                              network=self.network)

    def build_backend(self) -> Backend:
        """Construct the configured backend (not yet preflighted).

        Raises:
            ConfigError: ``sandpool.kubernetes`` holds an option the backend does not take.
            BackendUnavailable: The Kubernetes backend's client library is not installed.
        """
        if self.backend == "local":
            from sandpool.core.backends.local import LocalBackend

            return LocalBackend(self.images_root, limits=self.resource_limits(),
                                require_limits=self.require_limits)
        # Raises BackendUnavailable, naming the extra to install, when its client is missing.
        backend_cls = importlib.import_module("sandpool.core.backends.kubernetes").KubernetesBackend
        try:
            return backend_cls(**self.kubernetes)
        except TypeError as exc:
            raise errors.ConfigError(f"sandpool.kubernetes: {exc}") from None

    def build_pool(self, metrics: Any = None) -> SandboxPool:
        """Construct an unopened :class:`SandboxPool` on the configured backend.

        Args:
            metrics: Prometheus series for the pool (see :class:`SandboxPool`), or ``None``.

        Raises:
            ConfigError: As :meth:`build_backend`.
        """
        return SandboxPool(self.build_backend(), strategy=self.strategy, limits=self.limits(),
                           metrics=metrics)

    async def load_tasks(self) -> list[Task]:
        """Load the task source named by ``tasks``.

        ``default`` builds (once, cached: minutes cold, immediate warm) and loads sandpool's
        local task pack.

        Returns:
            The tasks, in file order (empty when ``tasks`` is ``None``).

        Raises:
            ConfigError: The file does not exist, or the task pack builder is unavailable.
            TaskValidationError: A row of the file is malformed (names row and field).
        """
        if self.tasks is None:
            return []
        from sandpool.envs.tasks import load_tasks

        if self.tasks == "default":
            try:
                from sandpool.envs.taskpack import abuild_default_pack
            except ImportError as exc:
                raise errors.ConfigError(
                    f"sandpool.tasks: 'default' needs the task pack builder ({exc}); "
                    "give a tasks.jsonl path instead"
                ) from None
            return load_tasks(await abuild_default_pack())
        path = Path(self.tasks).expanduser()
        if not path.is_file():
            raise errors.ConfigError(
                f"sandpool.tasks: no such file {str(path)!r}; give the path of a SWE-bench-format "
                "tasks.jsonl, or 'default' for the built-in task pack"
            )
        return load_tasks(path)


def validate_settings(data: Any, *, where: str = "sandpool") -> PoolSettings:
    """Validate a mapping into :class:`PoolSettings`, naming the key of the first error.

    Args:
        data: The mapping from YAML (``None`` means all defaults).
        where: The key path the mapping sits at, used as the prefix of key names in errors.

    Returns:
        The settings.

    Raises:
        ConfigError: E.g. ``sandpool.strategy: Input should be 'cold', 'warm' or 'reuse'
            (got 'fast')``.
    """
    if isinstance(data, PoolSettings):
        return data
    try:
        return PoolSettings.model_validate(dict(data or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join([where, *(str(p) for p in err["loc"])])
            got = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"[:120]
            problems.append(f"{key}: {err['msg']}{got}")
        raise errors.ConfigError("; ".join(problems)) from None
    except TypeError as exc:
        raise errors.ConfigError(f"{where}: must be a mapping of settings, got {data!r}") from exc
