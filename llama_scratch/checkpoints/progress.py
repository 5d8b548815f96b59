"""The one progress bar of the package: tqdm's on a terminal (and a notebook's widget), whole lines in a log.

tqdm redraws its line with a carriage return many times a second. On a terminal that is one line moving; written
to a file (`finetune ... 2> run.log`, a job scheduler, CI) every redraw stays, hundreds of them an epoch glued
together by `\\r`. When stderr is not a terminal, a bar here writes whole lines instead: one when it ends (for a
bar that stays on a terminal, such as an epoch's, or one that ran long), and one at each quarter of a bar that
runs long. It lives here, in the lowest folder that shows progress (loading weights), so every folder above can
use it.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm.auto import tqdm as screen_tqdm
from tqdm.std import tqdm as std_tqdm

QUARTER = 0.25  # a long bar in a log writes a line at each quarter done
# A bar running at least this long is worth lines before its end, and one at its end. A minute: the default CPU
# run's epochs (20-40 s) then write one line each, an hour-long epoch on a large model one a quarter.
LONG_SECONDS = 60.0
# tqdm.auto chose a notebook's widget (a Jupyter kernel, whose stderr is no terminal but shows a live bar).
IN_NOTEBOOK = any(cls.__module__ == "tqdm.notebook" for cls in screen_tqdm.__mro__)


class LineBar(std_tqdm):
    """A tqdm bar that writes whole lines, never a carriage return: at each quarter done once it has run
    LONG_SECONDS, and when it closes, if it stays on a terminal (`leave`, an epoch's bar) or ran that long.
    Each line is tqdm's own (the description, percentage, counts, times, rate and postfix)."""

    def __init__(self, *args, **kwargs) -> None:
        self._next_line = QUARTER  # the fraction done at which the next line is written
        self._started = time.monotonic()
        super().__init__(*args, **kwargs)

    def _long(self) -> bool:
        return time.monotonic() - self._started >= LONG_SECONDS

    def _line(self) -> None:
        self.fp.write(f"{self}\n")
        self.fp.flush()

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """What tqdm calls to redraw: a line when a quarter has been passed, else nothing. `msg` is tqdm clearing
        the bar's line (a bar that does not stay), which a log never drew."""
        if msg is not None:
            return False
        total = self.total
        if total and self.n < total and self.n >= self._next_line * total and self._long():
            self._line()
            self._next_line = (int(self.n / total / QUARTER) + 1) * QUARTER
        return True

    def close(self) -> None:
        if not self.disable and self.n and (self.leave or self._long()):
            self._line()
        self.leave = False  # tqdm's close would otherwise redraw the bar once more and end its line
        super().close()


def is_terminal(stream: IO | None) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_bar(*args, **kwargs) -> std_tqdm:
    """tqdm(*args, **kwargs): a live bar on a terminal or in a notebook, a `LineBar` when the bar's stream
    (stderr unless `file` says otherwise) is a file or a pipe."""
    stream = kwargs.get("file") or sys.stderr
    return (screen_tqdm if IN_NOTEBOOK or is_terminal(stream) else LineBar)(*args, **kwargs)
