"""Live progress of a run's validations: one line per run, redrawn in place on a terminal.

``ProgressRenderer`` turns a run's job counts (``Registry.job_counts(run)``) into a line
such as ``ckval run 'r': 5 reported, 1 queued, 1 running, 3 succeeded, 0 failed``. On a
terminal the line carries a bar and is redrawn in place with ``\\r``; elsewhere (a log
file, a pipe, CI) each change is a plain line of its own. Either way a line is written only
when the counts changed, and at most one per ``min_interval_s``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from validation_service.jobs import JobStatus

BAR_WIDTH = 24


@dataclasses.dataclass(frozen=True)
class RunProgress:
    """How many of a run's validations are in each stage."""

    reported: int = 0
    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0  # FAILED and TIMED_OUT
    cancelled: int = 0
    waiting: int = 0  # WAITING_FOR_RESOURCES: claimed, its Ray task not started yet

    @classmethod
    def from_counts(cls, counts: Mapping[str, int]) -> RunProgress:
        """From ``{status: jobs}`` as ``Registry.job_counts(run)`` returns it."""

        def count(*statuses: JobStatus) -> int:
            return sum(int(counts.get(status.value, 0)) for status in statuses)

        return cls(
            reported=sum(int(n) for n in counts.values()),
            queued=count(JobStatus.QUEUED),
            running=count(JobStatus.RUNNING),
            waiting=count(JobStatus.WAITING_FOR_RESOURCES),
            succeeded=count(JobStatus.SUCCEEDED),
            failed=count(JobStatus.FAILED, JobStatus.TIMED_OUT),
            cancelled=count(JobStatus.CANCELLED),
        )

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.cancelled

    def summary(self) -> str:
        waiting = f"{self.waiting} waiting for resources, " if self.waiting else ""
        text = (
            f"{self.reported} reported, {self.queued} queued, {waiting}{self.running} "
            f"running, {self.succeeded} succeeded, {self.failed} failed"
        )
        return text + (f", {self.cancelled} cancelled" if self.cancelled else "")

    def bar(self, width: int = BAR_WIDTH) -> str:
        filled = width * self.done // self.reported if self.reported else 0
        return "[" + "#" * filled + "-" * (width - filled) + "]"


class ProgressRenderer:
    """Writes the progress of runs to ``stream`` (default: standard error).

    ``isatty`` says whether the stream is a terminal (default: ask the stream). Call
    ``update(run, counts)`` as often as you like and ``close()`` at the end: it writes
    the last state if it was held back, and ends a line redrawn in place.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        isatty: bool | None = None,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream if stream is not None else sys.stderr
        if isatty is None:
            isatty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.isatty = isatty
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._drawn: dict[str, RunProgress] = {}
        self._pending: dict[str, RunProgress] = {}
        self._last_draw = -math.inf
        self._open_line: str | None = None  # run whose line the cursor is on (terminal)
        self._open_width = 0

    def update(self, run: str, counts: Mapping[str, int] | RunProgress) -> bool:
        """Shows the run's counts if they changed and the last line is old enough.

        Returns whether a line was written. A change held back by the rate limit is
        written by a later update or by close().
        """
        progress = counts if isinstance(counts, RunProgress) else RunProgress.from_counts(counts)
        if self._drawn.get(run) == progress:
            self._pending.pop(run, None)
            return False
        self._pending[run] = progress
        if self._clock() - self._last_draw < self.min_interval_s:
            return False
        self._draw_pending()
        return True

    def close(self) -> None:
        """Writes what the rate limit held back and ends a line drawn in place."""
        self._draw_pending()
        if self._open_line is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = None
            self._open_width = 0

    def line(self, run: str, progress: RunProgress) -> str:
        """The text shown for a run (without the terminal's redraw characters)."""
        if self.isatty:
            return (
                f"ckval run {run!r} {progress.bar()} {progress.done}/{progress.reported} "
                f"| {progress.summary()}"
            )
        return f"ckval run {run!r}: {progress.summary()}"

    def _draw_pending(self) -> None:
        for run, progress in list(self._pending.items()):
            self._write(run, self.line(run, progress))
            self._drawn[run] = progress
        if self._pending:
            self._pending.clear()
            self._last_draw = self._clock()
            self.stream.flush()

    def _write(self, run: str, text: str) -> None:
        if not self.isatty:
            self.stream.write(text + "\n")
            return
        if self._open_line is not None and self._open_line != run:
            self.stream.write("\n")  # another run's line stays as it was
            self._open_width = 0
        # Spaces wipe what a longer previous line left behind.
        self.stream.write("\r" + text + " " * max(0, self._open_width - len(text)))
        self._open_line = run
        self._open_width = len(text)
