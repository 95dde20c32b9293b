"""`fedapps compare` / `tune` progress: a line per run always; a tqdm bar of runs done only on a terminal."""

from __future__ import annotations

import io

from fedapps_tools.progressbar import RunProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def clock_of(times):
    it = iter(times)
    return lambda: next(it)


def test_lines_without_a_terminal_carry_done_total_and_the_eta_of_the_runs_that_worked():
    out = io.StringIO()
    # started at 0; run 1 reused at 0, run 2 runs 0 -> 10 s, run 3 starts at 10 s
    p = RunProgress(3, out, clock_of([0, 0, 0, 0, 10, 10]))
    p.start("a seed 0: already complete")
    p.finish(worked=False)
    p.start("a seed 1: running")
    p.finish(worked=True)
    line = p.start("a seed 2: running")
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[1/3] a seed 0: already complete (elapsed 0s, ETA ?")
    assert line == lines[2] and line.startswith(
        "[3/3] a seed 2: running (elapsed 10s, ETA 10s)"
    )  # one run left at 10 s
    assert "\r" not in out.getvalue() and "runs" not in out.getvalue()  # no bar in a log or a pipe


def test_a_terminal_gets_a_bar_of_runs_done_below_the_lines():
    out = Terminal()
    p = RunProgress(2, out)
    p.start("x seed 0: running")
    p.finish(worked=True)
    p.start("x seed 1: running")
    p.finish(worked=True)
    p.close()
    text = out.getvalue()
    assert "[1/2] x seed 0: running" in text and "[2/2] x seed 1: running" in text
    assert "2/2 runs" in text and "\r" in text  # tqdm's bar, redrawn in place
