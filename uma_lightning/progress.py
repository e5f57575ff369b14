"""Progress of long work (training, data generation, the frame store, conversion, export), one way everywhere.

When stderr is a terminal: a live tqdm bar with the count, the rate and the time left, while log records
are written above it (tqdm's logging redirect) so they do not tear it. Otherwise (a job log under Slurm
or Kubernetes, a pipe, a file): a plain log line at every tenth of the work and at least every
``every_s`` seconds, never one per item, each with the count, the rate and the time left, greppable.

Only rank zero of a distributed run reports, since every rank does the same work; work that one
process does for all of them (a dataset generated under a lock) reports from that process.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import AbstractContextManager

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("uma_lightning")


def format_duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``125m00s``: short enough for a log line."""
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


class Progress:
    """How far a piece of work has got: a bar on a terminal, lines in a log.

    Use as a context manager (or call ``close``) and report the count done with ``update`` (or the
    count just finished with ``advance``).
    """

    def __init__(
        self,
        total: float | None,
        what: str,
        unit: str,
        *,
        initial: float = 0,
        logger: logging.Logger = log,
        every_s: float = 30.0,
        byte_counts: bool = False,
        lines: bool = True,
        all_ranks: bool = False,
    ):
        """
        Args:
            total: The count when the work is done; None when it is not known (then no time left is shown).
            what: What is counted, as the bar's label and the start of each line ("episodes", "convert: episodes").
            unit: One item, for the rate ("episode" gives "2.5 episode/s").
            initial: The count already done when the work starts (a resumed run), left out of the rate.
            logger: Where the plain lines go (the caller's logger, so its name and handlers stay).
            every_s: Off a terminal, the longest wait between two lines.
            byte_counts: The count is bytes: shown as kB, MB, GB.
            lines: Off a terminal, write the plain lines; False when the caller writes its own.
            all_ranks: Report from whichever process runs this, not only rank zero.
        """
        self.total, self.what, self.unit = total, what, unit
        self.initial = self.done = initial
        self.logger, self.every_s, self.byte_counts = logger, every_s, byte_counts
        shown = all_ranks or _rank() == 0
        self.live = shown and stderr_is_terminal()
        self.lines = shown and lines and not self.live
        self._start = self._last_line = time.monotonic()
        self._next_tenth = 1
        self._bar: tqdm | None = None
        self._redirect: AbstractContextManager | None = None
        if self.live:
            sized = _terminal_width() > 0
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=what.rstrip(":"),  # tqdm adds its own colon
                unit="B" if byte_counts else unit,
                unit_scale=byte_counts,
                file=sys.stderr,
                # Follow the terminal's size; tqdm draws nothing on a pseudo-terminal that reports
                # none (0x0, as `script` gives without a terminal around it), so that gets 100x24.
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 24,
            )
            # Every logger that writes to the console writes above the bar for as long as it is live.
            self._redirect = logging_redirect_tqdm(loggers=_console_loggers())
            self._redirect.__enter__()

    def update(self, done: float, postfix: str = "") -> None:
        """``done`` items of ``total`` are finished; ``postfix`` (the bar only) adds figures such as a loss."""
        advanced, self.done = done - self.done, done
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(advanced)
        elif self.lines:
            now = time.monotonic()
            tenth = self._next_tenth * self.total / 10 if self.total else None
            finished = self.total is not None and done >= self.total
            if finished or (tenth is not None and done >= tenth) or now - self._last_line >= self.every_s:
                self.logger.info(self.line(now))
                self._last_line = now
                if self.total:
                    self._next_tenth = int(done * 10 / self.total) + 1

    def advance(self, count: float) -> None:
        """``count`` more items are finished."""
        self.update(self.done + count)

    def line(self, now: float) -> str:
        """The plain line: ``episodes 3/10 (2.95 episode/s, 1s elapsed, eta 2s)``, or for bytes
        ``read step-000000100: 1.20GB/4.80GB (400MB/s, 3s elapsed, eta 9s)``."""
        elapsed = now - self._start
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else 0.0
        count = self._count(self.done) + (f"/{self._count(self.total)}" if self.total is not None else "")
        per_second = f"{self._count(rate)}/s" if self.byte_counts else f"{self._count(rate)} {self.unit}/s"
        parts = [per_second, f"{format_duration(elapsed)} elapsed"]
        if self.total is not None and rate > 0:
            parts.append(f"eta {format_duration(max(self.total - self.done, 0) / rate)}")
        return f"{self.what} {count} ({', '.join(parts)})"

    def _count(self, value: float) -> str:
        if self.byte_counts:
            return tqdm.format_sizeof(value, suffix="B", divisor=1000)
        return f"{value:.3g}" if value != int(value) and value < 1000 else f"{value:,.0f}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._redirect.__exit__(None, None, None)
            self._bar = self._redirect = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _terminal_width() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


def _console_loggers() -> list[logging.Logger]:
    """The root logger and every other one with a handler on stdout or stderr (Lightning's has its own)."""
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    return [
        logger
        for logger in loggers
        if any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr) for h in logger.handlers)
    ]


def _rank() -> int:
    """This process's rank: Lightning's own view where it is loaded (set once a trainer knows it), else
    the launcher's environment, so inference (``Policy``, which reads weights with progress) never
    imports Lightning."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:
        return rank_zero.rank_zero_only.rank
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
