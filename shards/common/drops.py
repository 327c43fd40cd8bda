"""Counted, rate-limited drops of bad input.

Bad input never crashes a process: it is dropped, counted by reason, and logged at most
once per ``interval_s`` per reason (with how many were suppressed), so a flood of garbage
cannot flood the log either. ``counts`` is a plain dict the control plane can report.
``RateLimiter`` is the rate rule alone, for other rate-limited log lines (the broker's
lifecycle notes).
"""
from __future__ import annotations

import logging
import time
from typing import Callable


class RateLimiter:
    """Decides which of many events of one kind get a log line: at most one per
    ``interval_s`` per kind, and says how many were held back since the last one."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, kind: str, now: float) -> int | None:
        """None: hold this one back. Else log it, with the returned count of events of
        this kind held back since the last line."""
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._suppressed.pop(kind, 0)


class DropCounter:
    def __init__(self, logger: logging.Logger, *, interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.log = logger
        self.interval_s = interval_s
        self.clock = clock
        self.counts: dict[str, int] = {}
        self._limiter = RateLimiter(interval_s)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def drop(self, reason: str, detail: str = "") -> None:
        """Count one dropped message under ``reason`` and maybe log it."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        suppressed = self._limiter.allow(reason, self.clock())
        if suppressed is None:
            return
        more = f" (+{suppressed} more since last report)" if suppressed else ""
        self.log.warning("dropped (%s): %s%s", reason, detail, more)
