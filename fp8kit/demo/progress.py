"""A small progress display on stderr (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """`update(done, info)` reports the progress of a run of `total` steps.

    On a terminal one line is rewritten in place (at most 10 times a second):
    `label [####.....] done/total  info  elapsed, ~remaining left` (the remaining time extrapolates the average
    step time of the run so far, so it moves when the machine's load does).
    Elsewhere (a CI log, a file, a pipe) it prints plain lines without a bar or an estimate, at each quarter of the
    run and at least once a minute: `label  done/total (pct%)  info  elapsed`. `enabled=False` prints nothing.
    """

    LOG_PARTS = 4  # lines per run off a terminal (plus one a minute on long runs)
    LOG_EVERY_S = 60.0

    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, enabled: bool = True,
                 width: int = 24):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_draw = self.start
        self._last_part = 0
        self._line = ""

    def update(self, done: int, info: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw < 0.1 and done < self.total:
                return
        else:
            part = done * self.LOG_PARTS // self.total
            if part == self._last_part and now - self._last_draw < self.LOG_EVERY_S:
                return
            self._last_part = part
        self._last_draw = now
        if self.tty:
            self._line = self._bar(done, now, info)
            self.stream.write("\r" + self._line + "\x1b[K")
        else:
            self._line = self._log_line(done, now, info)
            self.stream.write(self._line + "\n")
        self.stream.flush()

    def _bar(self, done: int, now: float, info: str) -> str:
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self.start
        left = f", ~{_clock(elapsed / done * (self.total - done))} left" if 0 < done < self.total else ""
        return f"{self.label:<8} [{bar}] {done:>{len(str(self.total))}}/{self.total}  {info}  {_clock(elapsed)}{left}"

    def _log_line(self, done: int, now: float, info: str) -> str:
        return (f"{self.label:<8} {done:>{len(str(self.total))}}/{self.total} ({100 * done // self.total:>3}%)  "
                f"{info}  {_clock(now - self.start)} elapsed")

    def close(self) -> None:
        if self.tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
