"""Rank-0 progress: a bar with the ETA and the loss of the last logged step on a terminal;
periodic log lines otherwise.

The bar moves after every step, but the trainer passes a loss only on the steps whose numbers it
reads anyway (logging steps, and evaluation and checkpoint steps): reading a loss waits for the
device and the loss all-reduce. So the bar shows the loss of the last logged step.

The bar shares the console log stream (stderr). While the bar is shown, that stream is wrapped so
that any log record (a checkpoint message, a warning) first clears the bar line, prints, and the
bar is drawn again below it, the way `tqdm.write` keeps logs and a bar apart. Other ranks never
draw: the Rank0Filter already keeps their info lines off the console.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from ddptrain.distributed import is_rank_zero

_CLEAR = "\r\x1b[K"


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Progress:
    """Steps done out of `total_steps` since `start_step` (a resumed run starts there), and an ETA."""

    def __init__(self, total_steps: int, start_step: int = 0, mode: str = "auto", stream: TextIO | None = None,
                 min_interval_s: float = 0.1):
        self.total_steps = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = is_rank_zero()
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.is_bar = self.enabled and (mode == "bar" or (mode == "auto" and is_tty))
        self.min_interval_s = min_interval_s
        self._started = time.perf_counter()
        self._step = start_step
        self._text = ""
        self._loss: float | None = None  # of the last step the trainer read
        self._drawn_at = 0.0
        self._handlers: list[tuple[logging.StreamHandler, TextIO]] = []
        if self.is_bar:
            self._wrap_console_handlers()

    # -- numbers ---------------------------------------------------------------------------------

    def eta_seconds(self, step: int | None = None) -> float | None:
        """Wall time left at the mean pace of this process so far (None before the first step)."""
        step = self._step if step is None else step
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self._started) / done * max(self.total_steps - step, 0)

    def suffix(self, step: int) -> str:
        """`/200 (5%) | ETA 01:23` for a log line of `step`."""
        eta = self.eta_seconds(step)
        text = f"/{self.total_steps} ({100 * step / self.total_steps:.0f}%)"
        return text + (f" | ETA {format_duration(eta)}" if eta is not None else "")

    # -- the bar ---------------------------------------------------------------------------------

    def update(self, step: int, loss: float | None = None) -> None:
        """After every optimizer step; redraws the bar at most every min_interval_s (and at the end).
        `loss` (the trainer gives it on the steps it reads) is drawn beside the bar."""
        self._step = step
        if loss is not None:
            self._loss = loss
        if not self.is_bar:
            return
        now = time.perf_counter()
        if now - self._drawn_at < self.min_interval_s and step < self.total_steps:
            return
        self._drawn_at = now
        width = 24
        filled = int(width * step / self.total_steps)
        parts = [f"step {step}/{self.total_steps} [{'#' * filled}{'.' * (width - filled)}] "
                 f"{100 * step / self.total_steps:3.0f}%"]
        if self._loss is not None:
            parts.append(f"loss {self._loss:.4f}")
        eta = self.eta_seconds()
        parts.append(f"ETA {format_duration(eta)}" if eta is not None else "ETA --:--")
        self._text = " | ".join(parts)
        self._draw()

    def _draw(self) -> None:
        self.stream.write(_CLEAR + self._text)
        self.stream.flush()

    def close(self) -> None:
        if self._text:
            self.stream.write("\n")
            self.stream.flush()
            self._text = ""
        for handler, original in self._handlers:
            handler.setStream(original)
        self._handlers = []

    # -- log records above the bar -------------------------------------------------------------

    def _wrap_console_handlers(self) -> None:
        for handler in logging.getLogger("ddptrain").handlers:
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is self.stream:
                self._handlers.append((handler, handler.setStream(_AboveBar(self))))


class _AboveBar:
    """A stream for log handlers: clear the bar, write the record, draw the bar again."""

    def __init__(self, progress: Progress):
        self._progress = progress
        self._stream = progress.stream

    def write(self, text: str) -> int:
        if self._progress._text:
            self._stream.write(_CLEAR)
        written = self._stream.write(text)
        if text.endswith("\n") and self._progress._text:
            self._progress._draw()
        return written

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())
