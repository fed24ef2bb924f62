"""The native vector env of ``sandpool/SWE-v0``: ``num_envs`` episodes on one pool, one loop.

``gym.make_vec("sandpool/SWE-v0", num_envs=8, tasks=...)`` builds :class:`SWEVectorEnv`.
Each batched ``step`` runs the ``num_envs`` commands concurrently on the pool's event loop
(one :class:`BackgroundPool` thread), so a batch takes as long as its slowest command instead
of the sum of all of them, as in ``SyncVectorEnv``. Sandboxes released at the end of an
episode are reset in place in the background while the other sub-envs keep stepping.

Autoreset (``metadata["autoreset_mode"]``):

* ``NEXT_STEP`` (default): the step after a sub-env ends resets it instead (its action is
  ignored; reward 0, not terminated, not truncated, info from ``reset``);
* ``DISABLED``: the caller resets ended sub-envs with
  ``reset(options={"reset_mask": mask})`` (``mask``: ``np.bool_`` array of shape
  ``(num_envs,)``); stepping an ended sub-env raises ``ResetNeeded``.

Failures (see ``on_infra_failure`` in :mod:`sandpool.integrations.gymnasium.session`; whose
fault each is comes from the core classifier) hit only the sub-env they happen in; every
other sub-env's step result is kept:

* a sub-env whose sandbox fails mid-episode reports it as the single env would (default:
  reward NaN, ``truncated=True``, ``info["infra_failed"]``);
* a sub-env whose reset or autoreset fails (every claim failed: ``info["infra_failed"]``; or
  its task cannot run: ``info["rejected"]``) reports the same unscored end, with
  ``info["reset_failed"]=True`` and its last observation (its task's first one at a
  ``reset``), and is reset again: at the next step (``NEXT_STEP``), or by the caller
  (``DISABLED``);
* with ``on_infra_failure="raise"``, ``step`` (``reset``) first completes the whole batch,
  then raises the first such sub-env's error with the batch as ``exc.step_results``
  (``(obs, rewards, terminated, truncated, infos)``; ``exc.reset_results``: ``(obs, infos)``),
  the failed sub-envs flagged as above; the env's state has advanced as if the batch had
  been returned, so stepping may go on.

Any other error of a sub-env (a fatal backend error, a bug in a policy's wrapper, an
interrupt) is raised after the others finished their step, whose state is kept.

Observations are batched as Gymnasium does for the single ``Dict`` space: ``Text`` keys become
tuples of ``num_envs`` strings, ``exit_code`` an ``int64`` array of shape ``(num_envs,)``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from sandpool.core import errors
from sandpool.core.base import Backend, Sandbox
from sandpool.core.metrics import Report
from sandpool.core.pool import PoolLimits
from sandpool.core.strategies import Strategy
from sandpool.core.task import Task
from sandpool.integrations.gymnasium.background import BackgroundPool
from sandpool.integrations.gymnasium.config import EnvConfig, load_task_list, make_spaces
from sandpool.integrations.gymnasium.draws import GroupDraws
from sandpool.integrations.gymnasium.env import _Owner, owner_for
from sandpool.integrations.gymnasium.session import Session, StepOutput

__all__ = ["SWEVectorEnv"]

_SUPPORTED = (AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED)


class SWEVectorEnv(VectorEnv):
    """``num_envs`` SWE envs sharing one pool and stepping concurrently on one event loop.

    Takes the arguments of :class:`~sandpool.integrations.gymnasium.env.SWEEnv`, plus:

    Args:
        num_envs: Number of sub-envs (episodes running at once).
        group_size: Sub-envs per group (GRPO's G; NeMo Gym's ``num_repeats``): the ``k``-th
            reset of each of ``group_size`` consecutive sub-envs runs the same task, drawn
            once for the group. It must divide ``num_envs``; 1 draws per sub-env.
        lookahead: Draw each group's next task one round ahead and have the pool warm its
            image while the current round runs (:meth:`SandboxPool.prefetch`).
        limits: As for the single env; the default cap holds the running and (with
            lookahead) the next round's sandboxes and, with ``reuse``, ``group_size`` idle
            sandboxes per image of ``tasks`` beside them.
        autoreset_mode: ``AutoresetMode.NEXT_STEP`` (default) or ``AutoresetMode.DISABLED``.

    ``reset(options=...)`` also takes ``"task_ids"``: a sequence of ``num_envs`` ids (or
    ``None`` entries to draw) naming each sub-env's task. ``info["reuse"]`` at a reset is the
    pool's rollouts per sandbox created so far.

    Raises:
        ConfigError: A bad argument, or an unsupported autoreset mode (``SAME_STEP``).
    """

    metadata: dict[str, Any] = {"autoreset_mode": AutoresetMode.NEXT_STEP, "render_modes": []}

    def __init__(
        self,
        num_envs: int = 1,
        tasks: Sequence[Task | Mapping[str, Any]] | str | Path | None = None,
        *,
        group_size: int = 1,
        lookahead: bool = True,
        backend: Backend | str = "local",
        strategy: str | Strategy = "reuse",
        max_steps: int = 30,
        pool: BackgroundPool | None = None,
        limits: PoolLimits | None = None,
        backend_options: Mapping[str, Any] | None = None,
        step_timeout: float = 60.0,
        grade_timeout: float = 300.0,
        max_output_chars: int = 16_384,
        max_action_chars: int = 16_384,
        max_problem_chars: int = 65_536,
        submit_command: str = "submit",
        claim_retries: int = 2,
        on_infra_failure: str = "nan",
        checkpoint_every: int = 0,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        render_mode: str | None = None,
    ) -> None:
        if num_envs < 1:
            raise errors.ConfigError(f"num_envs={num_envs}: must be at least 1")
        if group_size < 1 or num_envs % group_size:
            raise errors.ConfigError(f"group_size={group_size}: must be at least 1 and divide "
                                     f"num_envs={num_envs}")
        mode = AutoresetMode(autoreset_mode)
        if mode not in _SUPPORTED:
            raise errors.ConfigError(
                f"autoreset_mode={mode.value!r} is not supported; use 'NextStep' or 'Disabled'")
        if render_mode is not None:
            raise errors.ConfigError(f"render_mode={render_mode!r}: this env does not render; pass None")
        self.num_envs = num_envs
        self.autoreset_mode = mode
        self.metadata = {**type(self).metadata, "autoreset_mode": mode}
        self.render_mode = None
        self.tasks = load_task_list(tasks)
        self.config = EnvConfig(max_steps=max_steps, step_timeout=step_timeout,
                                grade_timeout=grade_timeout, max_output_chars=max_output_chars,
                                max_action_chars=max_action_chars, max_problem_chars=max_problem_chars,
                                submit_command=submit_command, claim_retries=claim_retries,
                                on_infra_failure=on_infra_failure, checkpoint_every=checkpoint_every)
        self.single_observation_space, self.single_action_space = make_spaces(self.config)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        # Room for the batch running and, with lookahead, the next one warming; and for each
        # image's group to find its sandboxes idle when the image comes round again.
        self._owner = owner_for(pool, backend=backend, strategy=strategy, limits=limits,
                                backend_options=backend_options,
                                concurrency=num_envs * (2 if lookahead else 1),
                                working_set=len({t.image for t in self.tasks}) * group_size)
        self._finalizer = weakref.finalize(self, _Owner.close, self._owner)
        self._sessions: list[Session] = []
        self._env_obs: list[dict[str, Any] | None] = [None] * num_envs
        self._observations = create_empty_array(self.single_observation_space, n=num_envs)
        self._autoreset = np.zeros(num_envs, dtype=np.bool_)
        self._started = np.zeros(num_envs, dtype=np.bool_)
        self.group_size = group_size
        self.lookahead = lookahead
        self._draws = GroupDraws(self.tasks, num_envs, group_size, lookahead)

    def __repr__(self) -> str:
        return f"<SWEVectorEnv num_envs={self.num_envs} {self.autoreset_mode.value} tasks={len(self.tasks)}>"

    # -- helpers -------------------------------------------------------------------------------

    @property
    def pool(self) -> BackgroundPool:
        """The shared :class:`BackgroundPool` (opened on first use)."""
        self._check_open()
        return self._owner.ensure_runner()

    def sandbox(self, index: int) -> Sandbox | None:
        """The sandbox of sub-env ``index``'s running episode, if any."""
        if index >= len(self._sessions):
            return None
        lease = self._sessions[index].lease
        return lease.sandbox if lease is not None else None

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise errors.PoolClosed("this env was closed; make a new one")

    def _ensure_sessions(self) -> BackgroundPool:
        runner = self._owner.ensure_runner()
        runner.note_tasks(self.tasks, self.num_envs)
        if not self._sessions:
            self._sessions = [Session(runner, self.config) for _ in range(self.num_envs)]
            self._owner.sessions.extend(self._sessions)
        return runner

    def _prefetch(self, runner: BackgroundPool, now: list[Task]) -> None:
        """Warm the draws not yet taken (the next rounds). ``now``, the first round, is
        warmed with them and waited for: its claims are then warm, as after ``prepare``."""
        if not self.lookahead:
            return
        pending = self._draws.pending()
        if not now:
            runner.prefetch(pending, concurrency=self.num_envs)
            return

        async def first() -> None:
            await runner.pool.prefetch([*now, *pending], concurrency=self.num_envs)
            await runner.pool.wait_warm()

        runner.run(first())

    @staticmethod
    def _gather(runner: BackgroundPool, coros: list[Any]) -> list[Any]:
        async def gather() -> list[Any]:
            return await asyncio.gather(*coros, return_exceptions=True)

        return runner.run(gather())

    def _batch_obs(self) -> dict[str, Any]:
        self._observations = concatenate(self.single_observation_space, self._env_obs,
                                         self._observations)
        return {k: (np.copy(v) if isinstance(v, np.ndarray) else v)
                for k, v in self._observations.items()}

    # -- Gymnasium API -------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Reset all sub-envs, or those in ``options["reset_mask"]``, concurrently.

        Args:
            seed: ``int`` seeds sub-env ``i`` with ``seed + i``; a list gives one seed each.
            options: ``reset_mask`` (``np.bool_`` array, shape ``(num_envs,)``) and/or
                ``task_ids`` (``num_envs`` ids or ``None``).

        Returns:
            ``(obs, info)``, batched; ``info`` has ``task_id``, ``sandbox_id``, ``ttfc_s``
            (seconds), ``claims``, each with its ``_key`` mask; a sub-env whose reset failed
            has ``reset_failed`` and ``infra_failed`` or ``rejected`` instead (see the module
            docstring).

        Raises:
            InfraError, InputError: A sub-env's reset failed and ``on_infra_failure="raise"``
                (after the others finished resetting; the batch is ``exc.reset_results``).
            ValueError, TypeError: A malformed ``reset_mask``, ``seed`` or ``task_ids``.
        """
        self._check_open()
        super().reset(seed=seed if isinstance(seed, int) or seed is None else None)
        if seed is None:
            seeds: list[int | None] = [None] * self.num_envs
        elif isinstance(seed, int):
            seeds = [seed + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"seed list has {len(seeds)} entries; num_envs is {self.num_envs}")
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        if mask is None:
            mask = np.ones(self.num_envs, dtype=np.bool_)
        elif not isinstance(mask, np.ndarray) or mask.dtype != np.bool_ or mask.shape != (self.num_envs,):
            raise TypeError(f"options['reset_mask'] must be an np.bool_ array of shape ({self.num_envs},)")
        elif not mask.any():
            raise ValueError("options['reset_mask'] must select at least one sub-env")
        task_ids = list(options.pop("task_ids", [None] * self.num_envs))
        if len(task_ids) != self.num_envs:
            raise ValueError(f"options['task_ids'] has {len(task_ids)} entries; num_envs is {self.num_envs}")
        self._draws.seed(self.np_random, seeds, mask)
        runner = self._ensure_sessions()
        idx = [i for i in range(self.num_envs) if mask[i]]
        tasks = [self._draws.pick(i, task_ids[i]) for i in idx]
        self._prefetch(runner, tasks if not self._started.any() else [])
        results = self._gather(runner, [self._sessions[i].reset(t) for i, t in zip(idx, tasks)])
        infos: dict[str, Any] = {}
        other: BaseException | None = None  # raised once the rest of the batch is kept
        unscored: list[Exception] = []
        for i, r in zip(idx, results):
            if isinstance(r, BaseException):
                failed = self._sessions[i].failed_reset(r)
                if failed is None:
                    other = other or r
                    continue
                # Recorded unscored: reported as a failed autoreset is, and reset again.
                self._env_obs[i], info = failed.obs, failed.info
                if failed.unscored is not None:
                    unscored.append(failed.unscored)
                self._autoreset[i] = True
            else:
                self._env_obs[i], info = r
                self._autoreset[i] = False
            self._started[i] = True
            infos = self._add_info(infos, info, i)
        if other is not None:
            raise other
        if not self._started.all():
            raise ValueError("the first reset must reset every sub-env (no reset_mask)")
        batch = (self._batch_obs(), infos)
        if unscored and self.config.on_infra_failure == "raise":
            exc = unscored[0]
            exc.reset_results = batch  # type: ignore[attr-defined]
            raise exc
        return batch

    def step(self, actions: Sequence[str]) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-env concurrently (autoresetting ended ones in ``NEXT_STEP`` mode).

        Args:
            actions: ``num_envs`` shell commands (a tuple, list or array of ``str``).

        Returns:
            ``(obs, rewards float64 (num_envs,), terminated bool (num_envs,),
            truncated bool (num_envs,), info)``, infos batched with ``_key`` masks.

        Raises:
            gymnasium.error.ResetNeeded: Not reset yet, or (``DISABLED``) a sub-env ended and
                was not reset.
            ValueError: Wrong number of actions.
            InfraError, InputError: A sub-env ended unscored and ``on_infra_failure="raise"``;
                the batch is on the exception as ``step_results`` (see the module docstring).
        """
        self._check_open()
        if not self._started.all():
            raise gym.error.ResetNeeded("call reset() before step()")
        acts = [str(a) for a in iterate(self.action_space, actions)]
        if len(acts) != self.num_envs:
            raise ValueError(f"got {len(acts)} actions for {self.num_envs} sub-envs")
        if self.autoreset_mode is AutoresetMode.DISABLED and self._autoreset.any():
            ended = np.flatnonzero(self._autoreset).tolist()
            raise gym.error.ResetNeeded(
                f"sub-envs {ended} ended; reset them with reset(options={{'reset_mask': mask}})")
        runner = self.pool
        resetting = self._autoreset.copy()
        coros = [self._sessions[i].reset(self._draws.pick(i, None)) if resetting[i]
                 else self._sessions[i].step(acts[i]) for i in range(self.num_envs)]
        if resetting.any():
            self._prefetch(runner, [])
        results = self._gather(runner, coros)
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=np.bool_)
        truncated = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        other: BaseException | None = None  # raised once the rest of the batch is kept
        unscored: list[Exception] = []
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                failed = self._sessions[i].failed_reset(r, self._env_obs[i]) if resetting[i] else None
                if failed is None:
                    other = other or r
                    continue
                # The autoreset failed (every claim failed, or the drawn task cannot run;
                # already recorded): reported like an unscored end mid-episode, and the next
                # step resets again.
                r = failed
            if isinstance(r, StepOutput):
                self._env_obs[i], info = r.obs, r.info
                rewards[i], terminated[i], truncated[i] = r.reward, r.terminated, r.truncated
                if r.unscored is not None:
                    unscored.append(r.unscored)
            else:
                self._env_obs[i], info = r
            infos = self._add_info(infos, info, i)
        self._autoreset = terminated | truncated
        if other is not None:
            raise other
        batch = (self._batch_obs(), rewards, terminated, truncated, infos)
        if unscored and self.config.on_infra_failure == "raise":
            exc = unscored[0]
            exc.step_results = batch  # type: ignore[attr-defined]
            raise exc
        return batch

    def write_file(self, index: int, path: str, data: bytes | str) -> None:
        """Write a file into sub-env ``index``'s sandbox without a shell action (not a step).

        Raises:
            gymnasium.error.ResetNeeded: That sub-env has no running episode.
            InfraError: The sandbox could not be reached.
        """
        self._check_open()
        if not self._sessions:
            raise gym.error.ResetNeeded("call reset() before write_file()")
        raw = data.encode() if isinstance(data, str) else data
        self.pool.run(self._sessions[index].write_file(path, raw))

    def prepare(self) -> dict[str, int]:
        """Hydrate every task's image and fill warm pools for ``num_envs`` episodes (optional)."""
        return self.pool.prepare(self.tasks, self.num_envs)

    def report(self, wall_time_s: float | None = None) -> Report:
        """The pool's report over every finished episode of every sub-env."""
        return self.pool.report(wall_time_s)

    def close_extras(self, **kwargs: Any) -> None:
        """Release every sandbox and, if the env made its pool, close it. Idempotent."""
        self._finalizer()
