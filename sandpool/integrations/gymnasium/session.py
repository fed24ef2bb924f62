"""One SWE episode on a pooled sandbox, async: the logic both Gymnasium envs share.

The single env runs one :class:`Session` on its :class:`BackgroundPool`'s loop; the vector env
runs ``num_envs`` of them concurrently on one loop. Neither adds episode logic of its own.

Episode, from the policy's side:

* ``reset`` claims a sandbox for a task (releasing the previous one, which the pool resets in
  place in the background), runs a first command to measure TTFC, and returns the task.
* ``step(command)`` runs ``command`` under ``bash -c`` in the task's workdir with a per-step
  timeout. A command that times out is the policy's problem: the observation has exit code
  124 and ``info["timed_out"]``; the episode goes on.
* The episode ends when the action is the submit command (``terminated=True``) or the step
  limit is reached (``truncated=True``); then the task's tests run and give the reward (1.0
  resolved, else 0.0), and the sandbox goes back to the pool at once.
* An infra failure (the sandbox died, the command channel broke, an infra timeout) ends the
  episode. It is recorded as ``infra_failed`` with ``reward=None`` and counted in the pool's
  report, never scored. What ``step`` returns is set by ``on_infra_failure`` (a
  ``gym.make`` keyword), so that a trainer cannot take it for a reward without noticing:

  * ``"nan"`` (default): reward ``float("nan")``, ``truncated=True``,
    ``info["infra_failed"]=True``, ``info["error_kind"]`` and ``info["error"]``. A NaN
    poisons any return or loss it enters, so an unmasked failure shows up at once instead
    of teaching the policy that its actions scored 0.
  * ``"raise"``: ``step`` raises the error (an :class:`~sandpool.core.errors.InfraError`;
    the episode is over; call ``reset``).
  * ``"truncate"``: reward ``0.0``, ``truncated=True``, the same ``info`` flags. Opt in only
    if the trainer masks ``info["infra_failed"]`` itself: read without the mask, the 0.0 is
    indistinguishable from a failed attempt.

* An error the classifier lays on the task's input (e.g. ``BrokenTaskError``, a task that
  cannot be graded) ends the episode the same way, flagged ``info["rejected"]`` instead of
  ``info["infra_failed"]``, and is recorded ``rejected``: not a score either.
* The policy's own failure (``SandboxExhausted``: its processes exhausted the budget the
  sandbox's agent lives in, as its cgroup counted; ``TamperingSuspected`` at grading) *is* a
  score: reward ``0.0``, ``terminated=True``, ``info["task_failed"]=True``, recorded
  ``task_failed``.

Whose fault an error is comes from the core's one classifier
(:func:`sandpool.core.classify.classify`), never from this module.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from sandpool.core import errors
from sandpool.core.classify import Verdict, classify, error_kind
from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.pool import Lease
from sandpool.core.task import Task
from sandpool.integrations.gymnasium._text import CHARSET, to_text, truncate
from sandpool.integrations.gymnasium.background import BackgroundPool

__all__ = ["INFRA_FAILURE_MODES", "EnvConfig", "Session", "StepOutput", "load_task_list", "make_spaces",
           "verdict"]

#: The values of ``on_infra_failure`` -> the reward ``step`` reports for an unscored end
#: (an infra failure, or a task found broken).
INFRA_FAILURE_MODES: dict[str, float] = {"nan": float("nan"), "raise": float("nan"), "truncate": 0.0}

#: ``exit_code`` in the observation before any command ran in the episode (and on submit).
NO_EXIT_CODE = -1
_PROBE = "true"  # the first command of an episode; its answer ends TTFC
_PROBE_TIMEOUT_S = 30.0


def verdict(exc: BaseException) -> Verdict | None:
    """The core classifier's verdict on ``exc``; ``None`` for an interrupt or a cancellation
    (``KeyboardInterrupt``, ``asyncio.CancelledError``), which is no rollout's failure and
    propagates."""
    return classify(exc) if isinstance(exc, Exception) else None


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

    def __post_init__(self) -> None:
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


@dataclass
class StepOutput:
    """What one env step returns, before the vector env batches it.

    ``unscored`` is the error that ended the episode without a score (infra, or a broken
    task): the env raises it with ``on_infra_failure="raise"``.
    """

    obs: dict[str, Any]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    unscored: Exception | None = None


class Session:
    """One env's episode state: the task, the leased sandbox and the step count.

    Its coroutines run on the :class:`BackgroundPool`'s loop.

    Args:
        runner: The pool (and loop) to claim from.
        cfg: Env settings.
    """

    def __init__(self, runner: BackgroundPool, cfg: EnvConfig) -> None:
        self.runner = runner
        self.cfg = cfg
        self.task: Task | None = None
        self.lease: Lease | None = None
        self.steps = 0
        self.done = True  # no episode until reset
        self._t0 = 0.0
        self._ttfc: float | None = None
        self._sandbox_id: str | None = None
        self._problem = ""

    def __repr__(self) -> str:
        tid = self.task.instance_id if self.task else None
        return f"<Session task={tid} lease={self.lease} steps={self.steps} done={self.done}>"

    # -- observations ----------------------------------------------------------------------

    def _obs(self, stdout: bytes | str = b"", stderr: bytes | str = b"",
             exit_code: int = NO_EXIT_CODE) -> tuple[dict[str, Any], bool]:
        assert self.task is not None
        out, cut_out = truncate(to_text(stdout), self.cfg.max_output_chars)
        err, cut_err = truncate(to_text(stderr), self.cfg.max_output_chars)
        obs = {
            "problem_statement": self._problem,
            "workdir": truncate(to_text(self.task.workdir), 4096)[0],
            "stdout": out,
            "stderr": err,
            "exit_code": np.int64(min(max(exit_code, NO_EXIT_CODE), 255)),
        }
        return obs, cut_out or cut_err

    # -- lifecycle ---------------------------------------------------------------------------

    async def release(self, *, reusable: bool = True) -> None:
        """Give the leased sandbox back (reset in place in the background, or deleted)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.release(reusable=reusable and lease.broken is None)

    async def reset(self, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode of ``task``: claim a sandbox and run the first command.

        Returns:
            ``(obs, info)``; ``info`` holds ``task_id``, ``sandbox_id``, ``ttfc_s`` (seconds
            from the claim request to the first command's result) and ``claims`` (attempts).

        Raises:
            InfraError: Every claim attempt failed (each failure is counted by the pool; the
                rollout is recorded ``infra_failed``).
            InputError: The task cannot run (unknown image, bad ``base_commit``); recorded
                ``rejected``.
        """
        await self.release()  # an abandoned episode's sandbox is reset in place like any other
        self.task, self.steps, self.done = task, 0, True
        self._problem = truncate(to_text(task.problem_statement), self.cfg.max_problem_chars)[0]
        last: Exception | None = None
        for attempt in range(1, self.cfg.claim_retries + 2):
            self._t0 = time.monotonic()
            try:
                self.lease = await self.runner.pool.acquire(task)
                await self.lease.exec(_PROBE, timeout=_PROBE_TIMEOUT_S)
            except BaseException as exc:
                v = verdict(exc)
                if v is not Verdict.INFRA:  # interrupted, or not infra: the claim is not kept
                    await asyncio.shield(self.release(reusable=False))
                    if v is Verdict.INPUT:  # the task cannot run: it is rejected, with why
                        self._ttfc, self._sandbox_id = None, None
                        self._record(Outcome.REJECTED, None, error=exc)
                    raise
                last = exc  # already counted by the pool or the lease
                await self.release(reusable=False)
                continue
            lease = self.lease
            self.done = False
            self._ttfc = lease.ttfc_s
            self._sandbox_id = lease.id
            obs, _ = self._obs()
            info = {"task_id": task.instance_id, "sandbox_id": lease.id,
                    "ttfc_s": float(lease.ttfc_s or 0.0), "claims": attempt}
            return obs, info
        assert last is not None
        self._ttfc, self._sandbox_id = None, None
        self._record(Outcome.INFRA_FAILED, None, error=last)
        raise last

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (absolute, or relative to the workdir) in the sandbox.

        Raises:
            gymnasium.error.ResetNeeded: No episode is running.
            InfraError: The sandbox could not be reached (the lease is marked broken).
        """
        from gymnasium.error import ResetNeeded

        if self.done or self.lease is None:
            raise ResetNeeded("the episode is over (or never started); call reset() first")
        await self.lease.write_file(path, data)

    async def step(self, action: str) -> StepOutput:
        """Run one action; see the module docstring for the episode rules.

        Raises:
            gymnasium.error.ResetNeeded: No episode is running (call ``reset``).
            FatalError: The backend cannot run sandboxes any more (the pool was closed...).
        """
        from gymnasium.error import ResetNeeded

        if self.done or self.lease is None or self.task is None:
            raise ResetNeeded("the episode is over (or never started); call reset() first")
        lease, task = self.lease, self.task
        self.steps += 1
        info: dict[str, Any] = {"task_id": task.instance_id, "step": self.steps, "timed_out": False,
                                "output_truncated": False, "infra_failed": False,
                                "task_failed": False, "rejected": False}
        try:
            if action.strip() == self.cfg.submit_command:
                obs, _ = self._obs()
                reward = await self._finish(info, submitted=True)
                return StepOutput(obs, reward, True, False, info)
            res = await lease.exec(action, timeout=self.cfg.step_timeout)
            obs, cut = self._obs(res.stdout, res.stderr, res.exit_code)
            info["timed_out"] = res.timed_out
            info["output_truncated"] = cut or res.stdout_truncated or res.stderr_truncated
            if self.steps >= self.cfg.max_steps:
                reward = await self._finish(info, submitted=False)
                return StepOutput(obs, reward, False, True, info)
            return StepOutput(obs, 0.0, False, False, info)
        except BaseException as exc:
            v = verdict(exc)
            if v is Verdict.INFRA or v is Verdict.INPUT:
                return await self._unscored(exc, v, info)
            if v is Verdict.POLICY:
                return await self._policy_failed(exc, info)
            # Interrupted mid-command (KeyboardInterrupt, cancellation), or fatal: the
            # sandbox may still run the command, so it is not handed back for reuse.
            self.done = True
            await asyncio.shield(self.release(reusable=False))
            raise

    async def _finish(self, info: dict[str, Any], *, submitted: bool) -> float:
        assert self.lease is not None and self.task is not None
        from sandpool.envs.grading import grade

        try:
            result = await grade(self.lease, self.task, timeout=self.cfg.grade_timeout)
        except Exception as exc:
            if classify(exc) is not Verdict.POLICY:
                raise  # infra or a broken task: step() reports it unscored
            self._record(Outcome.TASK_FAILED, 0.0, error=exc)
            info.update(resolved=False, task_failed=True, error_kind=error_kind(exc), error=str(exc))
            self.done = True
            await self.release()
            return 0.0
        info.update(resolved=result.resolved, submitted=submitted, f2p_failed=result.f2p_failed,
                    p2p_failed=result.p2p_failed, grade_timed_out=result.timed_out)
        if result.error:
            info["grade_error"] = result.error
        if result.tampering:  # scored 0; the evidence travels with the step
            info["tampering"] = list(result.tampering)
        self._record(Outcome.COMPLETED, float(result.reward))
        self.done = True
        await self.release()
        return float(result.reward)

    async def _unscored(self, exc: Exception, v: Verdict, info: dict[str, Any]) -> StepOutput:
        assert v.outcome is not None
        self._record(v.outcome, None, error=exc)
        self.done = True
        await self.release(reusable=False)
        obs, _ = self._obs()
        return self.unscored_step(exc, obs, info)

    def unscored_step(self, exc: Exception, obs: dict[str, Any], info: dict[str, Any]) -> StepOutput:
        """The step result that reports an unscored end (``exc`` classified infra or input) as
        ``on_infra_failure`` says. Records nothing: the caller has."""
        v = classify(exc)
        info.update(infra_failed=v is Verdict.INFRA, rejected=v is Verdict.INPUT,
                    error_kind=error_kind(exc), error=str(exc))
        return StepOutput(obs, INFRA_FAILURE_MODES[self.cfg.on_infra_failure], False, True, info,
                          unscored=exc)

    async def _policy_failed(self, exc: Exception, info: dict[str, Any]) -> StepOutput:
        # The policy's own doing (it killed or exhausted its sandbox): a score of 0, terminal.
        self._record(Outcome.TASK_FAILED, 0.0, error=exc)
        info.update(task_failed=True, resolved=False, error_kind=error_kind(exc), error=str(exc))
        self.done = True
        await self.release(reusable=False)
        obs, _ = self._obs()
        return StepOutput(obs, 0.0, True, False, info)

    def _record(self, outcome: Outcome, reward: float | None, error: Exception | None = None) -> None:
        assert self.task is not None
        self.runner.pool.telemetry.rollout_done(outcome.value)
        self.runner.results.append(RolloutResult(
            task_id=self.task.instance_id, outcome=outcome, reward=reward, ttfc_s=self._ttfc,
            duration_s=time.monotonic() - self._t0, sandbox_id=self._sandbox_id,
            error_kind=error_kind(error) if error else None, error=str(error) if error else None,
        ))
