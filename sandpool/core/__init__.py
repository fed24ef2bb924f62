"""The core: pool, strategies, in-place reset, rate limiting, failure accounting and reports.

It knows nothing of gymnasium, NeMo Gym or OpenHands.
"""

from sandpool.core.base import Backend, ExecResult, ResourceLimits, Sandbox, SandboxState
from sandpool.core.errors import (
    ApiError,
    BackendUnavailable,
    ConfigError,
    ExecTransportError,
    FatalError,
    ImageNotFound,
    InfraError,
    InfraTimeout,
    InputError,
    PoolClosed,
    SandboxDied,
    SandboxExhausted,
    SandboxFileError,
    SandboxStartError,
    SandpoolError,
    TaskError,
    TaskValidationError,
)
from sandpool.core.metrics import Outcome, Report, RolloutResult, TTFCStats, Workload
from sandpool.core.outcome import Score
from sandpool.core.pool import Lease, PoolLimits, PoolState, SandboxPool
from sandpool.core.reset import ResetOutcome, reset_in_place
from sandpool.core.rollout import Episode, Grader, Rollout, run_rollout
from sandpool.core.service import ServiceSpec
from sandpool.core.snapshot import Snapshot
from sandpool.core.strategies import Cold, Reuse, Strategy, Warm, get_strategy
from sandpool.core.task import Task
from sandpool.core.telemetry import PoolMetrics

__all__ = [
    "ApiError",
    "Backend",
    "BackendUnavailable",
    "Cold",
    "ConfigError",
    "Episode",
    "ExecResult",
    "ExecTransportError",
    "FatalError",
    "Grader",
    "ImageNotFound",
    "InfraError",
    "InfraTimeout",
    "InputError",
    "Lease",
    "Outcome",
    "PoolClosed",
    "PoolLimits",
    "PoolMetrics",
    "PoolState",
    "Report",
    "ResetOutcome",
    "ResourceLimits",
    "Reuse",
    "Rollout",
    "RolloutResult",
    "Sandbox",
    "SandboxDied",
    "SandboxExhausted",
    "SandboxFileError",
    "SandboxPool",
    "SandboxStartError",
    "SandboxState",
    "SandpoolError",
    "Score",
    "ServiceSpec",
    "Snapshot",
    "Strategy",
    "TTFCStats",
    "Task",
    "TaskError",
    "TaskValidationError",
    "Warm",
    "Workload",
    "get_strategy",
    "reset_in_place",
    "run_rollout",
]
