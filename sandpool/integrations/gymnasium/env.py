"""``sandpool/SWE-v0``: one SWE task episode per ``reset``, on a sandbox claimed from a pool.

Usage::

    import gymnasium as gym
    import sandpool  # registers sandpool/SWE-v0

    env = gym.make("sandpool/SWE-v0", tasks="tasks.jsonl", backend="local", max_steps=20)
    obs, info = env.reset(seed=0)          # claims a sandbox; info["ttfc_s"], info["sandbox_id"]
    obs, reward, terminated, truncated, info = env.step("git status")
    obs, reward, terminated, truncated, info = env.step("submit")   # runs the tests: reward
    env.close()                            # releases the sandbox, closes the env's own pool

    branches = env.unwrapped.fork(4)       # mid-episode: 4 envs going on from its state now

Spaces, episode rules and infra-failure semantics are documented in
:mod:`sandpool.integrations.gymnasium.session`; text handling in
:mod:`sandpool.integrations.gymnasium._text`.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym

from sandpool.core import errors
from sandpool.core.base import Backend, Sandbox
from sandpool.core.metrics import Report
from sandpool.core.pool import PoolLimits
from sandpool.core.strategies import Strategy, get_strategy
from sandpool.core.task import Task
from sandpool.integrations.gymnasium.background import BackgroundPool, check_backend
from sandpool.integrations.gymnasium.config import EnvConfig, load_task_list, make_spaces
from sandpool.integrations.gymnasium.session import Session

__all__ = ["SWEEnv"]


class _Owner:
    """What an env holds that needs cleanup: its pool (if it made it) and its sessions.

    Kept apart from the env so a ``weakref.finalize`` can clean up without keeping the env alive.
    """

    def __init__(self, pool: BackgroundPool | None, factory: dict[str, Any]) -> None:
        self.shared = pool
        self.factory = factory
        self.runner: BackgroundPool | None = pool
        self.sessions: list[Session] = []

    def ensure_runner(self) -> BackgroundPool:
        if self.runner is None:
            self.runner = BackgroundPool(**self.factory)
        elif self.runner.closed:
            raise errors.PoolClosed("the env's pool was closed; make a new env")
        return self.runner

    def close(self) -> None:
        runner = self.runner
        if runner is None or runner.closed:
            return
        if threading.current_thread() is not runner._thread:
            for s in self.sessions:
                if s.lease is not None:
                    try:
                        runner.run(s.release(reusable=False), timeout=120.0)
                    except errors.SandpoolError:  # the sandbox is deleted either way
                        pass
        if self.shared is None:
            runner.close()




def owner_for(
    pool: BackgroundPool | None,
    *,
    backend: Backend | str,
    strategy: str | Strategy,
    limits: PoolLimits | None,
    backend_options: Mapping[str, Any] | None,
    concurrency: int,
    working_set: int = 0,
) -> _Owner:
    """Validate the pool arguments of an env and return its (lazy) :class:`_Owner`.

    Without ``limits``, the pool's ``max_live`` is the strategy's for ``concurrency`` episodes
    at once and, with a reusing strategy, ``working_set`` sandboxes beside them: the
    sandboxes the env's tasks claim again (one per image per episode of it at once), so a
    sandbox reset in place waits idle for its image's next episode instead of being evicted
    to make room for another image's (that episode would start cold, and evict in turn).

    Raises:
        ConfigError: ``pool`` is not a :class:`BackgroundPool`, or a bad backend, backend
            option or strategy.
        BackendUnavailable: ``backend="kubernetes"`` without its client library.
    """
    if pool is not None and not isinstance(pool, BackgroundPool):
        raise errors.ConfigError(
            f"pool= must be a sandpool.integrations.gymnasium.BackgroundPool, got {type(pool).__name__}; "
            "wrap a fresh SandboxPool with BackgroundPool(pool) to share it between envs"
        )
    if pool is None:  # a shared pool's backend and strategy are already built
        check_backend(backend, backend_options)
        get_strategy(strategy)
    if limits is None:
        strat = get_strategy(strategy)
        limits = PoolLimits(max_live=strat.max_live(concurrency + (working_set if strat.reuse else 0)))
    return _Owner(pool, {"backend": backend, "strategy": strategy, "limits": limits,
                         "backend_options": backend_options})


class SWEEnv(gym.Env[dict[str, Any], str]):
    """A SWE task environment backed by a sandbox pool (registered as ``sandpool/SWE-v0``).

    Construction starts nothing: no thread, no sandbox. The first ``reset`` opens the env's
    pool (unless ``pool=`` shares one) and claims a sandbox.

    Args:
        tasks: A list of :class:`~sandpool.core.task.Task` (or row dicts), or a path to a
            ``tasks.jsonl``. ``reset`` picks one with the env's seeded RNG, or the one named by
            ``options={"task_id": ...}``.
        backend: ``"local"`` (bubblewrap), ``"kubernetes"`` (``backend_options`` are the
            :class:`~sandpool.core.backends.kubernetes.KubernetesBackend` arguments:
            ``kubeconfig``, ``namespace``, ``image_map``, ...) or a
            :class:`~sandpool.core.base.Backend` instance the env's pool will own (and close).
        strategy: ``"cold"``, ``"warm"``, ``"reuse"`` or a :class:`Strategy`.
        max_steps: Steps per episode; the last one is graded and ends with ``truncated=True``.
        pool: A :class:`BackgroundPool` to share with other envs; the env then neither opens
            nor closes it. ``backend``, ``strategy``, ``limits``, ``backend_options`` are ignored.
        limits: Pool limits (default: the strategy's live cap for one env and, with
            ``reuse``, one idle sandbox per image of ``tasks``).
        backend_options: Constructor arguments of a named backend (e.g. ``images_root``).
            Checked at construction; the backend's preflight (e.g. that the kubeconfig
            exists and loads) runs at the first ``reset``, where the pool opens.
        step_timeout: Seconds one command may run (exit code 124 after).
        grade_timeout: Seconds the tests may run when grading.
        max_output_chars: Cap on each of ``stdout``/``stderr`` in an observation (characters).
        max_action_chars: ``max_length`` of the action ``Text`` space.
        max_problem_chars: Cap on ``problem_statement`` in an observation (characters).
        submit_command: The action that ends the episode and grades it.
        claim_retries: Extra claim attempts in ``reset`` after infra failures.
        on_infra_failure: What ``step`` returns when the sandbox or its channel fails
            mid-episode: ``"nan"`` (default: reward NaN, ``truncated=True``,
            ``info["infra_failed"]=True``), ``"raise"`` (``step`` raises the ``InfraError``)
            or ``"truncate"`` (reward 0.0, ``truncated=True``, the same ``info`` flag: only
            for trainers that mask it). The rollout is reported ``infra_failed`` with no
            reward whichever is chosen. See :mod:`sandpool.integrations.gymnasium.session`.
        checkpoint_every: ``1``: snapshot the sandbox after every step; when it fails in the
            middle of a step, the episode goes on in one restored from the step before and the
            step runs again (``info["recoveries"]``). ``0`` (default): no checkpoints.
        render_mode: Must be ``None`` (no rendering).

    Raises:
        ConfigError: A bad argument (message names it and the fix).
        TaskValidationError: A malformed task row.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        tasks: Sequence[Task | Mapping[str, Any]] | str | Path | None = None,
        *,
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
        render_mode: str | None = None,
    ) -> None:
        if render_mode is not None:
            raise errors.ConfigError(f"render_mode={render_mode!r}: this env does not render; pass None")
        self.tasks = load_task_list(tasks)
        self.config = EnvConfig(max_steps=max_steps, step_timeout=step_timeout,
                                grade_timeout=grade_timeout, max_output_chars=max_output_chars,
                                max_action_chars=max_action_chars, max_problem_chars=max_problem_chars,
                                submit_command=submit_command, claim_retries=claim_retries,
                                on_infra_failure=on_infra_failure, checkpoint_every=checkpoint_every)
        self.observation_space, self.action_space = make_spaces(self.config)
        self.render_mode = None
        self._by_id = {t.instance_id: t for t in self.tasks}
        self._owner = owner_for(pool, backend=backend, strategy=strategy, limits=limits,
                                backend_options=backend_options, concurrency=1,
                                working_set=len({t.image for t in self.tasks}))
        self._session: Session | None = None
        self._finalizer = weakref.finalize(self, _Owner.close, self._owner)

    def __repr__(self) -> str:
        return f"<SWEEnv tasks={len(self.tasks)} session={self._session!r}>"

    # -- properties ----------------------------------------------------------------------------

    @property
    def pool(self) -> BackgroundPool:
        """The env's :class:`BackgroundPool` (opened on first use).

        Raises:
            PoolClosed: The env was closed.
        """
        self._check_open()
        return self._owner.ensure_runner()

    @property
    def sandbox(self) -> Sandbox | None:
        """The sandbox of the running episode, if any."""
        s = self._session
        return s.lease.sandbox if s is not None and s.lease is not None else None

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise errors.PoolClosed("this env was closed; make a new one")

    # -- Gymnasium API -------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Claim a sandbox for a task and start an episode.

        Args:
            seed: Seeds the env's RNG (which picks the task).
            options: ``{"task_id": id}`` picks that task instead.

        Returns:
            ``(obs, info)``; ``info`` has ``task_id``, ``sandbox_id``, ``ttfc_s`` (seconds) and
            ``claims``.

        Raises:
            InfraError: Every claim attempt failed (counted in the report as ``infra_failed``).
            InputError: Unknown ``task_id``, unbuilt image or bad ``base_commit``.
            PoolClosed: The env was closed.
        """
        super().reset(seed=seed)
        self._check_open()
        task = self._pick(options)
        runner = self._owner.ensure_runner()
        runner.note_tasks(self.tasks, 1)
        if self._session is None:
            self._session = Session(runner, self.config)
            self._owner.sessions.append(self._session)
        return runner.run(self._session.reset(task))

    def _pick(self, options: dict[str, Any] | None) -> Task:
        tid = (options or {}).get("task_id")
        if tid is not None:
            try:
                return self._by_id[tid]
            except KeyError:
                raise errors.ConfigError(f"options['task_id']={tid!r} is not among this env's tasks") from None
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Run ``action`` (a shell command, or the submit command) in the sandbox.

        Returns:
            ``(obs, reward, terminated, truncated, info)``; the reward is nonzero only at the end
            of an episode (grading), and NaN for an infra failure under the default
            ``on_infra_failure="nan"``. See :mod:`sandpool.integrations.gymnasium.session`.

        Raises:
            gymnasium.error.ResetNeeded: No running episode.
            TypeError: ``action`` is not a string.
            InfraError, InputError: The episode ended unscored (infra failed, or the task
                cannot run) and ``on_infra_failure="raise"``; it is reported
                ``infra_failed`` / ``rejected``.
        """
        self._check_open()
        if not isinstance(action, str):
            raise TypeError(f"the action must be a str (a shell command), got {type(action).__name__}")
        if self._session is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        out = self._owner.ensure_runner().run(self._session.step(str(action)))
        if out.unscored is not None and self.config.on_infra_failure == "raise":
            raise out.unscored
        return out.obs, out.reward, out.terminated, out.truncated, out.info

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file into the episode's sandbox without a shell action (not a step).

        For scripted policies and oracles, e.g. writing a patch before ``git apply``.

        Args:
            path: Absolute, or relative to the task's workdir.
            data: Bytes, or a str written as UTF-8.

        Raises:
            gymnasium.error.ResetNeeded: No running episode.
            InfraError: The sandbox could not be reached.
        """
        self._check_open()
        if self._session is None:
            raise gym.error.ResetNeeded("call reset() before write_file()")
        raw = data.encode() if isinstance(data, str) else data
        self._owner.ensure_runner().run(self._session.write_file(path, raw))

    def fork(self, n: int) -> list[SWEEnv]:
        """``n`` envs that go on from this episode's state now, each in a sandbox of its own
        and graded on its own (a rollout of its own in the report). This env goes on.

        The children share this env's pool (they neither open nor close it; each holds a
        sandbox of it, under its ``max_live``: pass ``limits=`` with room for them); ``close``
        each when done. Their sandboxes start in a snapshot of this one (the repo and ``/tmp``; no
        process), restored and verified (:meth:`Lease.fork <sandpool.core.pool.Lease.fork>`).

        Raises:
            gymnasium.error.ResetNeeded: No running episode.
            ConfigError: ``n`` < 1, or the backend cannot snapshot.
            InfraError: The fork failed (no child is left running).
        """
        self._check_open()
        if self._session is None:
            raise gym.error.ResetNeeded("call reset() before fork()")
        runner = self._owner.ensure_runner()
        sessions = runner.run(self._session.fork(n))
        cfg = dataclasses.asdict(self.config)
        kids = []
        for session in sessions:
            kid = SWEEnv(self.tasks, pool=runner, **cfg)
            kid._session = session
            kid._owner.sessions.append(session)
            kids.append(kid)
        return kids

    def prepare(self) -> dict[str, int]:
        """Hydrate every task's image and fill the warm pool for one env (optional).

        Returns:
            Warm slots per image.
        """
        return self.pool.prepare(self.tasks, 1)

    def report(self, wall_time_s: float | None = None) -> Report:
        """The pool's report over every finished episode (all envs sharing the pool)."""
        return self.pool.report(wall_time_s)

    def close(self) -> None:
        """Release the sandbox and, if the env made its pool, close it. Idempotent."""
        self._finalizer()
        super().close()
