"""Progress events of a task-pack build, and an optional rich display for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["BuildEvent", "ProgressCallback", "RichBuildProgress"]


@dataclass(frozen=True)
class BuildEvent:
    """One step of a pack build.

    Attributes:
        package: The distribution being worked on (``""`` for pack-wide steps).
        stage: ``image`` (building an image directory), ``baseline`` (running the clean
            suite), ``mutants`` (trying candidate bugs), ``write`` (writing tasks.jsonl) or
            ``done``.
        done: Units finished in this stage (for ``mutants``: valid tasks found so far).
        total: Units wanted in this stage (for ``mutants``: tasks wanted), 0 if unknown.
        message: A human-readable line.
    """

    package: str
    stage: str
    done: int = 0
    total: int = 0
    message: str = ""


#: A callable that receives every :class:`BuildEvent`; it must not block.
ProgressCallback = Callable[[BuildEvent], None]


class RichBuildProgress:
    """A rich progress display fed by build events: one bar per package, shown from the first
    event (a cached pack shows nothing).

    Usage::

        with RichBuildProgress() as show:
            build_default_pack(progress=show)

    Args:
        console: Where to show it; default stderr, so stdout keeps only a command's output
            (``sandpool build-pack`` prints the pack's path there).
    """

    def __init__(self, console: Console | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
            console=console or Console(stderr=True),
        )
        self._bars: dict[str, object] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bars:
            self._progress.stop()

    def __call__(self, event: BuildEvent) -> None:
        """Update the bar of ``event.package`` (a pack-wide event updates a ``pack`` bar)."""
        key = event.package or "pack"
        if not self._bars:
            self._progress.start()
        if key not in self._bars:
            self._bars[key] = self._progress.add_task(key, total=None, note="")
        bar = self._bars[key]
        self._progress.update(
            bar,  # type: ignore[arg-type]
            completed=event.done, total=event.total or None,
            note=f"{event.stage}: {event.message}"[:60],
        )
