"""Progress of a batch of runs (``fedapps compare`` / ``tune``): one line per run as it starts —
``[done/total] <what> (elapsed …, ETA …)`` — and, only when the output is a terminal, a tqdm bar of runs done
under those lines. Logs and pipes get the lines alone (no carriage returns in a log file)."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from fedapps.reporting.results import Progress


class RunProgress:
    """Runs done / total with the ETA of :class:`fedapps.reporting.results.Progress` (paced by the runs that did
    work)."""

    def __init__(self, total: int, stream: TextIO | None = None, clock: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.total, self.done = total, 0
        self.progress = Progress(total) if clock is None else Progress(total, clock)
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                file=self.stream,
                unit="run",
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} runs [{postfix}]",
            )

    def start(self, what: str) -> str:
        """Announce the next run; returns the line written."""
        self.done += 1
        line = f"[{self.done}/{self.total}] {what} ({self.progress.line()})"
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)
        return line

    def finish(self, worked: bool) -> None:
        """The run announced last is done (``worked``: it ran, rather than being reused)."""
        self.progress.step(worked=worked)
        if self.bar is not None:
            self.bar.set_postfix_str(self.progress.line(), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
