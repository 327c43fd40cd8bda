"""How far behind its server's publisher a client reads, pure (the guide's Suicidal Snail,
measured by time so that it works under a subtree filter too).

Our servers put their clock in a HUGZ every ``clock_s`` (0.5 s), busy or not. For each one
read live, ``observe(ts, now)`` takes ``delay = now - ts`` (``now``: this host's wall
clock) and keeps ``offset_s``, the smallest delay seen from this server: that absorbs the
clock offset between the hosts and the network's floor, so ``lag = delay - offset_s`` is
how much later than usual the client reads the stream. ``reset()`` when the client moves
to another server (another clock).
"""
from __future__ import annotations


class LagMeter:
    __slots__ = ("offset_s", "lag_s", "max_lag_seen_s")

    def __init__(self):
        self.offset_s: float | None = None
        """The smallest (now - ts) seen from the current server; None before the first."""
        self.lag_s = 0.0
        """The lag at the last observation."""
        self.max_lag_seen_s = 0.0

    def reset(self) -> None:
        """Another server (another clock): the offset is learnt again."""
        self.offset_s = None

    def observe(self, ts: float, now: float) -> float:
        """A HUGZ stamped ``ts`` (the server's wall clock) read at ``now`` (ours): the lag."""
        delay_s = now - ts
        if self.offset_s is None or delay_s < self.offset_s:
            self.offset_s = delay_s
        lag_s = self.lag_s = delay_s - self.offset_s
        if lag_s > self.max_lag_seen_s:
            self.max_lag_seen_s = lag_s
        return lag_s
