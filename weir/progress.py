"""Progress of a batch on the command line: tqdm's bar on a terminal, plain lines in a log file."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

LINE_EVERY_FRACTION = 0.1
LINE_EVERY_S = 30.0


class ProgressLines:
    """A progress bar for a stream that is not a terminal: one plain line (``enrich: 40/400 jobs
    (10 %), 12 s``) each time another ``every_fraction`` of the jobs has finished or ``every_s``
    has passed since the last line, and one at the end; never a redraw.

    Has what :meth:`weir.jobs.client.Client.wait` sets and calls on a tqdm bar: ``total``, ``n``
    and ``refresh()``.
    """

    def __init__(self, total: int, desc: str, stream: TextIO, *,
                 every_fraction: float = LINE_EVERY_FRACTION, every_s: float = LINE_EVERY_S) -> None:
        self.total, self.n, self.desc, self.stream = total, 0, desc, stream
        self.every_fraction, self.every_s = every_fraction, every_s
        self._started = time.monotonic()
        self._last_line_at = self._started
        self._last_step: Optional[int] = None
        self._last_n: Optional[int] = None

    def refresh(self) -> None:
        now = time.monotonic()
        step = int(self.n / self.total / self.every_fraction) if self.total else 0
        if self._last_step is None or step > self._last_step or now - self._last_line_at >= self.every_s:
            self._line(now)
            self._last_step = step

    def close(self) -> None:
        if self._last_n != self.n:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        percent = 100 * self.n / self.total if self.total else 0.0
        print(f"{self.desc}: {self.n}/{self.total} jobs ({percent:.0f} %), {now - self._started:.0f} s",
              file=self.stream, flush=True)
        self._last_line_at, self._last_n = now, self.n

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(total: int, desc: str, stream: TextIO = sys.stderr) -> Any:
    """tqdm's bar (redrawn at most every 0.5 s) when ``stream`` is a terminal, else
    :class:`ProgressLines`. Use it as a context manager."""
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit="job", desc=desc, mininterval=0.5, file=stream)
    return ProgressLines(total, desc, stream)
