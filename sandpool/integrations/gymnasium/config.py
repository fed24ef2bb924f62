"""What a SWE env is configured with, shared by the single and the vector env: its settings
(:class:`EnvConfig`), its observation and action spaces (:func:`make_spaces`) and its task
list (:func:`load_task_list`). How an episode uses them is :mod:`.session`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymnasium import spaces

from sandpool.core import errors
from sandpool.core.task import Task
from sandpool.integrations.gymnasium._text import CHARSET

__all__ = ["INFRA_FAILURE_MODES", "NO_EXIT_CODE", "EnvConfig", "load_task_list", "make_spaces"]

#: The values of ``on_infra_failure`` -> the reward ``step`` reports for an unscored end
#: (an infra failure, or a task found broken).
INFRA_FAILURE_MODES: dict[str, float] = {"nan": float("nan"), "raise": float("nan"), "truncate": 0.0}

#: ``exit_code`` in the observation before any command ran in the episode (and on submit).
NO_EXIT_CODE = -1


@dataclass(frozen=True)
class EnvConfig:
    """Settings of the SWE env, shared by the single and the vector env.

    Usage: ``EnvConfig(max_steps=20, step_timeout=30.0)``.

    Attributes:
        max_steps: Steps per episode; the step that reaches it ends the episode (graded,
            ``truncated=True``).
        step_timeout: Seconds one command may run; then its process group is killed
            (exit code 124).
        grade_timeout: Seconds the task's tests may run when grading.
        max_output_chars: Cap, in characters, on each of ``stdout`` and ``stderr`` in an
            observation, after escaping; longer output keeps its head and tail (see
            :func:`~sandpool.integrations.gymnasium._text.truncate`).
        max_action_chars: ``max_length`` of the action space (longer actions still run).
        max_problem_chars: Cap, in characters, on ``problem_statement`` in an observation.
        submit_command: The action (compared after stripping whitespace) that ends the episode
            and grades it.
        claim_retries: Extra claims ``reset`` makes after an infra failure of the claim or of
            the first command, before it raises.
        on_infra_failure: What ``step`` returns when infra fails mid-episode: ``"nan"``
            (default; NaN reward, truncated, flagged in ``info``), ``"raise"`` (the
            ``InfraError``) or ``"truncate"`` (0.0 reward, truncated, flagged). See the
            module docstring.
        checkpoint_every: ``1``: a checkpoint after every step, and a step whose sandbox
            fails runs again on one restored from it; ``0`` (default): none. (Only 1: a
            recovery runs again only the step in flight, never one the policy saw.)
    """

    max_steps: int = 30
    step_timeout: float = 60.0
    grade_timeout: float = 300.0
    max_output_chars: int = 16_384
    max_action_chars: int = 16_384
    max_problem_chars: int = 65_536
    submit_command: str = "submit"
    claim_retries: int = 2
    on_infra_failure: str = "nan"
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if self.checkpoint_every not in (0, 1):
            raise errors.ConfigError(
                f"checkpoint_every={self.checkpoint_every!r}: use 1 (a checkpoint after every step) "
                "or 0 (none); a recovery may only run again the step in flight")
        if self.on_infra_failure not in INFRA_FAILURE_MODES:
            raise errors.ConfigError(
                f"on_infra_failure={self.on_infra_failure!r} is not known; use one of "
                f"{list(INFRA_FAILURE_MODES)} (see sandpool.integrations.gymnasium.session)")
        if self.max_steps < 1:
            raise errors.ConfigError(f"max_steps={self.max_steps}: must be at least 1")
        for name in ("step_timeout", "grade_timeout"):
            if getattr(self, name) <= 0:
                raise errors.ConfigError(f"{name}={getattr(self, name)}: must be > 0 seconds")
        for name in ("max_output_chars", "max_action_chars", "max_problem_chars"):
            if getattr(self, name) < 64:
                raise errors.ConfigError(f"{name}={getattr(self, name)}: must be at least 64")
        if not self.submit_command.strip():
            raise errors.ConfigError("submit_command must not be blank")
        if self.claim_retries < 0:
            raise errors.ConfigError(f"claim_retries={self.claim_retries}: must be >= 0")


def make_spaces(cfg: EnvConfig) -> tuple[spaces.Dict, spaces.Text]:
    """Return ``(observation_space, action_space)`` of one env.

    Observation (a ``Dict``):

    * ``problem_statement``: ``Text(0..max_problem_chars)``, the task's issue text, the same
      at every step of an episode;
    * ``workdir``: ``Text(0..4096)``, the repo's path in the sandbox (``/testbed``);
    * ``stdout`` / ``stderr``: ``Text(0..max_output_chars)``, the last command's output
      (empty after ``reset`` and on submit);
    * ``exit_code``: ``Discrete(257, start=-1)``, the last command's exit status (124 on
      timeout, ``128+N`` on signal ``N``, ``-1`` when no command ran).

    Every ``Text`` uses :data:`~sandpool.integrations.gymnasium._text.CHARSET`.

    Action: ``Text(0..max_action_chars)`` over the same charset, a shell command. ``step``
    accepts any ``str``; characters outside the charset (UTF-8) are passed to bash as is.
    """
    def text(n: int) -> spaces.Text:
        return spaces.Text(max_length=n, min_length=0, charset=CHARSET)

    obs = spaces.Dict({
        "problem_statement": text(cfg.max_problem_chars),
        "workdir": text(4096),
        "stdout": text(cfg.max_output_chars),
        "stderr": text(cfg.max_output_chars),
        "exit_code": spaces.Discrete(257, start=NO_EXIT_CODE),
    })
    return obs, text(cfg.max_action_chars)


def load_task_list(tasks: Any) -> list[Task]:
    """Normalise the ``tasks=`` argument: a list of :class:`Task` (or published rows), or a task
    file (``.jsonl``/``.json``/``.parquet`` of any format :mod:`sandpool.envs.datasets` reads).

    Raises:
        ConfigError: ``tasks`` is missing, empty or of the wrong type.
        TaskValidationError: A row of the JSONL file is malformed.
        FileNotFoundError: No such file.
    """
    if tasks is None:
        raise errors.ConfigError("pass tasks=: a list of sandpool Task rows or the path of a tasks.jsonl")
    if isinstance(tasks, (str, Path)):
        from sandpool.envs.tasks import load_tasks

        out = load_tasks(tasks)
    else:
        try:
            from sandpool.envs.tasks import parse_task

            out = [t if isinstance(t, Task) else parse_task(t) for t in tasks]
        except TypeError:
            raise errors.ConfigError(
                f"tasks= must be a list of Task or a JSONL path, got {type(tasks).__name__}") from None
    if not out:
        raise errors.ConfigError("tasks= is empty; give at least one task")
    return out
