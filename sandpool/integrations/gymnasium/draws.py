"""Which task each sub-env of :class:`~sandpool.integrations.gymnasium.vector.SWEVectorEnv`
runs next: GRPO groups, rounds and lookahead.

Sub-envs ``g * group_size .. (g + 1) * group_size - 1`` form group ``g``. The ``k``-th reset
of each of them (its round ``k``) runs the same task: drawn once for the group, uniformly
from the env's tasks, by the generator of the group's first sub-env. Lookahead draws round
``k + 1`` when round ``k`` is taken, so its image can be warmed while round ``k`` runs; it
changes no draw (each group's draws come from its own generator, in round order).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sandpool.core import errors
from sandpool.core.task import Task

__all__ = ["GroupDraws"]


class GroupDraws:
    """The draws of ``num_envs`` sub-envs in groups of ``group_size`` over ``tasks``.

    ``group_size`` must divide ``num_envs`` (the env checks it). Generators are made on
    the first :meth:`seed` call.
    """

    def __init__(self, tasks: Sequence[Task], num_envs: int, group_size: int,
                 lookahead: bool) -> None:
        self.tasks = list(tasks)
        self.by_id = {t.instance_id: t for t in self.tasks}
        self.num_envs, self.group_size, self.lookahead = num_envs, group_size, lookahead
        self._rngs: list[np.random.Generator] = []
        self._rounds = [0] * num_envs  # draws taken by each sub-env
        self._draws: dict[tuple[int, int], list] = {}  # (group, round) -> [task, takers left]

    def seed(self, parent: np.random.Generator, seeds: Sequence[int | None],
             mask: Sequence[bool]) -> None:
        """Make the generators (from ``parent``) if not made yet; then reseed sub-env ``i``
        with ``seeds[i]`` where it is given and ``mask[i]`` is set. Reseeding a group's first
        sub-env drops the group's draws not yet taken: they come from the new seed."""
        if not self._rngs:
            self._rngs = [np.random.default_rng(parent.integers(2**63))
                          for _ in range(self.num_envs)]
        for i, s in enumerate(seeds):
            if s is not None and mask[i]:
                self._rngs[i] = np.random.default_rng(s)
                if i % self.group_size == 0:
                    g = i // self.group_size
                    self._draws = {key: d for key, d in self._draws.items() if key[0] != g}

    def pick(self, i: int, task_id: str | None) -> Task:
        """Sub-env ``i``'s next task: ``task_id``'s (no draw taken), else its group's draw
        for its next round.

        Raises:
            ConfigError: ``task_id`` is not among the tasks.
        """
        if task_id is not None:
            try:
                return self.by_id[task_id]
            except KeyError:
                raise errors.ConfigError(f"task id {task_id!r} is not among this env's tasks") from None
        group, k = i // self.group_size, self._rounds[i]
        self._rounds[i] += 1
        draw = self._draw(group, k)
        if self.lookahead:
            self._draw(group, k + 1)
        draw[1] -= 1
        if draw[1] == 0:
            del self._draws[(group, k)]
        return draw[0]

    def pending(self) -> list[Task]:
        """The draws made and not yet taken, a task once per sub-env still to take it."""
        return [t for t, left in self._draws.values() for _ in range(left)]

    def _draw(self, group: int, k: int) -> list:
        key = (group, k)
        if key not in self._draws:
            rng = self._rngs[group * self.group_size]
            self._draws[key] = [self.tasks[int(rng.integers(len(self.tasks)))], self.group_size]
        return self._draws[key]
