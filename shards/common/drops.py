"""Counted, rate-limited drops of bad input.

Bad input never crashes a process: it is dropped, counted by reason, and logged at most
once per ``interval_s`` per reason (with how many were suppressed), so a flood of garbage
cannot flood the log either. ``counts`` is a plain dict the control plane can report.
"""
from __future__ import annotations

import logging
import time
from typing import Callable


class DropCounter:
    def __init__(self, logger: logging.Logger, *, interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.log = logger
        self.interval_s = interval_s
        self.clock = clock
        self.counts: dict[str, int] = {}
        self._last_logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def drop(self, reason: str, detail: str = "") -> None:
        """Count one dropped message under ``reason`` and maybe log it."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = self.clock()
        last = self._last_logged.get(reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last_logged[reason] = now
        suppressed = self._suppressed.pop(reason, 0)
        more = f" (+{suppressed} more since last report)" if suppressed else ""
        self.log.warning("dropped (%s): %s%s", reason, detail, more)
