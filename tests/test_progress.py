"""Progress without a terminal (CI, nohup, a pipe): plain lines that keep every figure."""

from __future__ import annotations

import io

from rich.console import Console

from sandpool.progress import Progress

STATUS = "completed {}  infra_failed 0  task_failed 0  rejected 0"


def test_without_a_terminal_progress_is_plain_lines_at_start_every_period_and_end():
    out = io.StringIO()
    console = Console(file=out, width=40)  # not a terminal, and narrower than any line
    now = 0.0
    with Progress("rollouts", 448, console, every_s=10.0, clock=lambda: now) as bar:
        for i in range(1, 449):
            now = i / 10  # a result every 0.1 s
            bar.advance(STATUS.format(i))
    lines = out.getvalue().splitlines()
    assert lines == [
        "rollouts 0/448 (0%) 0:00:00",
        f"rollouts 100/448 (22%) 0:00:10  {STATUS.format(100)}",
        f"rollouts 200/448 (44%) 0:00:20  {STATUS.format(200)}",
        f"rollouts 300/448 (66%) 0:00:30  {STATUS.format(300)}",
        f"rollouts 400/448 (89%) 0:00:40  {STATUS.format(400)}",
        f"rollouts 448/448 (100%) 0:00:44  {STATUS.format(448)}",
    ]


def test_an_interrupted_job_logs_where_it_stopped_and_an_unknown_total_shows_as_unknown():
    out = io.StringIO()
    now = 0.0
    try:
        with Progress("validate", None, Console(file=out), clock=lambda: now) as bar:
            now = 3725.0
            bar.advance()
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert out.getvalue().splitlines() == ["validate 1/? 1:02:05"]


def test_a_job_found_to_have_no_units_prints_nothing_and_one_found_to_have_some_starts_then():
    # sandpool run's validation learns its total once started: 0 when every task was
    # validated before, where a lone "validate 0/?" line read as a job that never ran.
    for total, expected in [(0, []), (2, ["validate 0/2 (0%) 0:00:01", "validate 2/2 (100%) 0:00:03"])]:
        out = io.StringIO()
        now = 0.0
        with Progress("validate", None, Console(file=out), transient=True, clock=lambda: now) as bar:
            now = 1.0
            bar.set_total(total)
            for _ in range(total):
                now += 1.0
                bar.advance()
        assert out.getvalue().splitlines() == expected
