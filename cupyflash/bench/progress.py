"""The one progress report of the long commands (bench, compile-check, tune): on stderr, a line
rewritten in place on a terminal, one plain line per step elsewhere (logs, CI, pipes)."""
from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    seconds = round(max(seconds, 0.0))
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}:{seconds:02d}"


class Progress:
    """Counts steps; on a terminal it rewrites one line, elsewhere it prints one per step."""

    def __init__(self, total: int, *, stream=None, enabled: bool = True, clock=time.monotonic):
        self.total = total
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.clock = clock
        self.start = clock()
        self.rewrite = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._shown = ""  # the line on the terminal now, when rewriting

    def line(self, text: str) -> str:
        elapsed = self.clock() - self.start
        width = len(str(self.total))
        eta = ""
        if 0 < self.done < self.total:
            eta = f", ~{format_duration(elapsed / self.done * (self.total - self.done))} left"
        return (f"[{self.done:>{width}}/{self.total} {format_duration(elapsed)}{eta}] {text}")

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        line = self.line(text)
        if self.rewrite:
            self.stream.write("\r\033[2K" + line)
            self._shown = line
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def write(self, text: str, file=None) -> None:
        """Print a line of results (default: on stdout) without tearing the progress line: on a
        terminal the line is cleared first and drawn again below the text."""
        file = sys.stdout if file is None else file
        if self.rewrite and self._shown:
            self.stream.write("\r\033[2K")
            self.stream.flush()
        print(text, file=file, flush=True)
        if self.rewrite and self._shown:
            self.stream.write(self._shown)
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.rewrite and self.done:
            self.stream.write("\n")
            self.stream.flush()
        self._shown = ""
