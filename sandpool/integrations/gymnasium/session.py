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
* How each episode ends (its outcome, reward and record) is decided by the rollout
  accountant (:mod:`sandpool.core.rollout`), as for every other adapter; this module only
  says what ``step`` returns for it:

  * ``completed``: the grader's reward, ``terminated`` on submit, ``truncated`` at the
    step limit; ``info["resolved"]``.
  * ``task_failed`` (the policy's own failure: its processes exhausted the budget the
    sandbox's agent lives in, as its cgroup counted; suspected tampering; a submission that
    broke its grading): reward ``0.0``, ``info["task_failed"]=True`` with ``error_kind`` and
    ``error``; ``terminated`` unless the step limit ended it.
  * ``infra_failed`` (the sandbox died, the command channel broke, an infra timeout) and
    ``rejected`` (the task cannot be graded, e.g. ``BrokenTaskError``) are never a score.
    The episode ends ``truncated``, with ``info["infra_failed"]`` or ``info["rejected"]``,
    ``error_kind`` and ``error``; the reward is set by ``on_infra_failure`` (a
    ``gym.make`` keyword), so that a trainer cannot take it for a reward without noticing:

    * ``"nan"`` (default): reward ``float("nan")``. A NaN poisons any return or loss it
      enters, so an unmasked failure shows up at once instead of teaching the policy that
      its actions scored 0.
    * ``"raise"``: ``step`` raises the error (the episode is over; call ``reset``).
    * ``"truncate"``: reward ``0.0``. Opt in only if the trainer masks
      ``info["infra_failed"]`` itself: read without the mask, the 0.0 is indistinguishable
      from a failed attempt.

* With ``checkpoint_every=1`` the sandbox is snapshotted after every step; when it fails in
  the middle of a step (infra), the episode goes on in a sandbox restored from the step
  before and the step runs again there (:mod:`sandpool.core.checkpoint`): the step returns
  as if nothing happened but ``info["recoveries"]``, and only an episode that cannot
  recover ends ``infra_failed``.
* :meth:`Session.fork` (``env.unwrapped.fork(n)``) gives n episodes that go on from this
  one's state now, each in a sandbox of its own and graded on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sandpool.core.metrics import Outcome, RolloutResult
from sandpool.core.pool import Lease
from sandpool.core.rollout import Grader, Rollout
from sandpool.core.task import Task
from sandpool.envs.grading import GradeResult
from sandpool.envs.scoring import default_grader
from sandpool.integrations.gymnasium._text import to_text, truncate
from sandpool.integrations.gymnasium.background import BackgroundPool
from sandpool.integrations.gymnasium.config import INFRA_FAILURE_MODES, NO_EXIT_CODE, EnvConfig

__all__ = ["Session", "StepOutput"]

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
    """One env's episode: a :class:`~sandpool.core.rollout.Rollout` and its step count.

    Its coroutines run on the :class:`BackgroundPool`'s loop.

    Args:
        runner: The pool (and loop) to claim from; every ended episode's record is appended
            to its ``results``.
        cfg: Env settings.
        grader: Scores each episode (default :func:`sandpool.envs.scoring.default_grader`).
    """

    def __init__(self, runner: BackgroundPool, cfg: EnvConfig, grader: Grader | None = None) -> None:
        self.runner = runner
        self.cfg = cfg
        self.grader = grader or default_grader(cfg.grade_timeout)
        self.task: Task | None = None
        self.rollout: Rollout | None = None
        self.steps = 0
        self.done = True  # no episode until reset
        self._problem = ""

    def __repr__(self) -> str:
        tid = self.task.instance_id if self.task else None
        return f"<Session task={tid} rollout={self.rollout} steps={self.steps} done={self.done}>"

    @property
    def lease(self) -> Lease | None:
        """The running episode's sandbox, if any."""
        return self.rollout.lease if self.rollout is not None else None

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
        """Give up a running episode, unrecorded: its sandbox goes back (reset in place), or
        is deleted when not ``reusable``."""
        rollout, self.rollout = self.rollout, None
        self.done = True
        if rollout is not None:
            await rollout.abandon(reusable=reusable)

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
        self.task, self.steps = task, 0
        self._problem = truncate(to_text(task.problem_statement), self.cfg.max_problem_chars)[0]
        self.rollout = self._rollout(task)
        lease = await self.rollout.claim()
        self.done = False
        obs, _ = self._obs()
        counters = self.runner.pool.counters
        info = {"task_id": task.instance_id, "sandbox_id": lease.id,
                "ttfc_s": float(lease.ttfc_s or 0.0), "claims": self.rollout.attempts,
                "reuse": counters.claims / max(1, counters.created)}
        return obs, info

    def _rollout(self, task: Task) -> Rollout:
        return Rollout(self.runner.pool, task, grader=self.grader, claim_retries=self.cfg.claim_retries,
                       on_result=self.runner.results.append,
                       checkpoint="step" if self.cfg.checkpoint_every else None)

    async def fork(self, n: int) -> list[Session]:
        """``n`` sessions that go on from this episode's state now: each holds a sandbox of its
        own (:meth:`Lease.fork <sandpool.core.pool.Lease.fork>`), the same task and step
        count, and is a rollout of its own (graded and recorded on its own). This episode goes
        on.

        Raises:
            gymnasium.error.ResetNeeded: No episode is running.
            ConfigError: ``n`` < 1, or the backend cannot snapshot.
            InfraError: The fork failed (no child is left running; this episode goes on, its
                lease marked broken if its own sandbox failed).
        """
        rollout = self._running()
        assert self.task is not None
        # Not a policy action: a child that cannot be had fails the fork, not this episode.
        leases = await rollout._active().fork(n)
        kids = []
        for lease in leases:
            kid = Session(self.runner, self.cfg, self.grader)
            kid.task, kid.steps, kid._problem = self.task, self.steps, self._problem
            kid.rollout = kid._rollout(self.task)
            kid.rollout.adopt(lease)
            kid.done = False
            kids.append(kid)
        return kids

    def _running(self) -> Rollout:
        from gymnasium.error import ResetNeeded

        if self.done or self.rollout is None or self.rollout.ended:
            raise ResetNeeded("the episode is over (or never started); call reset() first")
        return self.rollout

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (absolute, or relative to the workdir) in the sandbox.

        Raises:
            gymnasium.error.ResetNeeded: No episode is running.
            SandboxFileError: The policy's path cannot be written (the episode goes on).
            InfraError: The sandbox could not be reached (the episode ended ``infra_failed``).
        """
        rollout = self._running()
        try:
            await rollout.step(lambda lease: lease.write_file(path, data))
        finally:
            self.done = rollout.ended

    async def step(self, action: str) -> StepOutput:
        """Run one action; see the module docstring for the episode rules.

        Raises:
            gymnasium.error.ResetNeeded: No episode is running (call ``reset``).
            FatalError: The backend cannot run sandboxes any more (the pool was closed...).
        """
        rollout = self._running()
        assert self.task is not None
        self.steps += 1
        info: dict[str, Any] = {"task_id": self.task.instance_id, "step": self.steps, "timed_out": False,
                                "output_truncated": False, "infra_failed": False,
                                "task_failed": False, "rejected": False}
        try:
            return await self._step(rollout, action, info)
        finally:
            info["recoveries"] = rollout.recoveries
            self.done = rollout.ended

    async def _step(self, rollout: Rollout, action: str, info: dict[str, Any]) -> StepOutput:
        if action.strip() == self.cfg.submit_command:
            info["submitted"] = True
            return self._ended(await rollout.finish(), self._obs()[0], info, by_limit=False)
        try:
            res = await rollout.step(lambda lease: lease.exec(action, timeout=self.cfg.step_timeout))
        except Exception:
            if rollout.result is None:  # fatal, or no end of the episode
                raise
            return self._ended(rollout.result, self._obs()[0], info, by_limit=False)
        obs, cut = self._obs(res.stdout, res.stderr, res.exit_code)
        info["timed_out"] = res.timed_out
        info["output_truncated"] = cut or res.stdout_truncated or res.stderr_truncated
        if self.steps >= self.cfg.max_steps:
            info["submitted"] = False
            return self._ended(await rollout.finish(), obs, info, by_limit=True)
        return StepOutput(obs, 0.0, False, False, info)

    def _ended(self, result: RolloutResult, obs: dict[str, Any], info: dict[str, Any], *,
               by_limit: bool) -> StepOutput:
        """The step that reports the episode's end as the accountant recorded it."""
        assert self.rollout is not None
        if result.outcome in (Outcome.INFRA_FAILED, Outcome.REJECTED):
            return self.unscored_step(result, obs, info)
        failed = result.outcome is Outcome.TASK_FAILED
        info.update(task_failed=failed, resolved=not failed and result.reward == 1.0)
        if failed:
            info.update(error_kind=result.error_kind, error=result.error)
        detail = self.rollout.score.detail if self.rollout.score is not None else None
        if isinstance(detail, GradeResult):
            info.update(f2p_failed=detail.f2p_failed, p2p_failed=detail.p2p_failed,
                        grade_timed_out=detail.timed_out)
            if detail.error:
                info["grade_error"] = detail.error
            if detail.tampering:  # the evidence travels with the step
                info["tampering"] = list(detail.tampering)
        reward = float(result.reward or 0.0)
        return StepOutput(obs, reward, not by_limit, by_limit, info)

    def unscored_step(self, result: RolloutResult, obs: dict[str, Any], info: dict[str, Any]) -> StepOutput:
        """The step result that reports an unscored end (``infra_failed`` or ``rejected``) as
        ``on_infra_failure`` says. Records nothing: the accountant has."""
        assert self.rollout is not None and self.rollout.error is not None
        info.update(infra_failed=result.outcome is Outcome.INFRA_FAILED,
                    rejected=result.outcome is Outcome.REJECTED,
                    error_kind=result.error_kind, error=result.error)
        return StepOutput(obs, INFRA_FAILURE_MODES[self.cfg.on_infra_failure], False, True, info,
                          unscored=self.rollout.error)

    def failed_reset(self, exc: BaseException, obs: dict[str, Any] | None = None) -> StepOutput | None:
        """How a :meth:`reset` that raised ``exc`` is reported to a vector env: the unscored end
        the accountant recorded (every claim failed, or the task cannot run), as
        :meth:`unscored_step` says, with ``info["reset_failed"]`` and ``obs`` (default: the
        task's observation before any command). None when ``exc`` ended nothing (fatal, an
        interrupt): the caller raises it."""
        r = self.rollout
        if r is None or r.result is None or r.error is not exc or self.task is None:
            return None
        if r.result.outcome not in (Outcome.INFRA_FAILED, Outcome.REJECTED):
            return None
        info = {"task_id": self.task.instance_id, "reset_failed": True}
        return self.unscored_step(r.result, obs if obs is not None else self._obs()[0], info)
