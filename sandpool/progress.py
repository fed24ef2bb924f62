"""Progress of a long command on stderr: a rich bar at a terminal, plain lines in a log.

Without a terminal (CI, ``nohup``, a pipe) rich draws a bar once, at the end, cut to 80
columns (``rollouts ━━━━ 112… 0:0…``). There :class:`Progress` prints plain lines instead,
every figure whole: one at the start, one every ``every_s`` seconds while results come, and
one at the end; a job with no units (its total unknown or 0, nothing done) prints none::

    rollouts 112/448 (25%) 0:01:23  completed 110  infra_failed 0  task_failed 2  rejected 0
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

__all__ = ["Progress"]


class Progress:
    """Counts a job's units and shows them: a bar at a terminal, else periodic plain lines.

    Usage::

        with Progress("rollouts", total=8, console=console) as bar:
            bar.advance("completed 1  infra_failed 0")

    Args:
        label: What is counted (``rollouts``), the first word of every line.
        total: Units expected; ``None`` until :meth:`set_total` (shown as ``?``).
        console: Where to show it (its ``is_terminal`` decides bar or lines).
        every_s: Seconds between plain lines while units come (the first and last lines are
            always printed).
        transient: A bar disappears when done (plain lines stay: a log keeps them).
        clock: Monotonic seconds (``time.monotonic``).
    """

    def __init__(self, label: str, total: int | None, console: Console, *, every_s: float = 30.0,
                 transient: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.console = label, total, console
        self.every_s, self.clock = every_s, clock
        self.done = 0
        self.status = ""
        self._bar: RichProgress | None = None
        if console.is_terminal:
            self._bar = RichProgress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.description}"),
                                     console=console, transient=transient)
            self._job = self._bar.add_task("", total=total)
        self._t0 = self._last = 0.0
        self._shown = -1  # units at the last plain line

    def __enter__(self) -> Self:
        self._t0 = self.clock()
        if self._bar is not None:
            self._bar.start()
        elif self.total:
            self._line()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self._shown != self.done and (self.total or self.done):
            self._line()

    def set_total(self, total: int) -> None:
        """The number of units expected, once known."""
        self.total = total
        if self._bar is not None:
            self._bar.update(self._job, total=total)
        elif total and self._shown < 0:  # the start line, held back while the total was unknown
            self._line()

    def advance(self, status: str = "") -> None:
        """One unit done; ``status`` (counts by kind, say) is shown after the figures."""
        self.done += 1
        self.status = status or self.status
        if self._bar is not None:
            self._bar.update(self._job, advance=1, description=self.status)
        elif self.done == self.total or self.clock() - self._last >= self.every_s:
            self._line()

    def line(self) -> str:
        """The plain line for the current state."""
        total = "?" if self.total is None else str(self.total)
        pct = f" ({100 * self.done // self.total}%)" if self.total else ""
        s = int(self.clock() - self._t0)
        text = f"{self.label} {self.done}/{total}{pct} {s // 3600}:{s // 60 % 60:02}:{s % 60:02}"
        return f"{text}  {self.status}" if self.status else text

    def _line(self) -> None:
        self._last, self._shown = self.clock(), self.done
        self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)
