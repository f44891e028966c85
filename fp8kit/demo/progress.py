"""A small progress bar on stderr (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """`update(done, info)` redraws `label [####.....] done/total  info  elapsed<remaining`.

    On a terminal the line is rewritten in place (at most 10 times a second); elsewhere (a log file, a pipe) a
    line is printed at every 10 %. `enabled=False` prints nothing.
    """

    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, enabled: bool = True,
                 width: int = 24):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._line = ""

    def update(self, done: int, info: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw < 0.1 and done < self.total:
                return
        else:
            decile = done * 10 // self.total
            if decile == self._last_decile:
                return
            self._last_decile = decile
        self._last_draw = now
        self._line = self._render(done, now, info)
        if self.tty:
            self.stream.write("\r" + self._line + "\x1b[K")
        else:
            self.stream.write(self._line + "\n")
        self.stream.flush()

    def _render(self, done: int, now: float, info: str) -> str:
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        return f"{self.label:<8} [{bar}] {done:>{len(str(self.total))}}/{self.total}  {info}  " \
               f"{_clock(elapsed)}<{_clock(eta)}"

    def close(self) -> None:
        if self.tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
