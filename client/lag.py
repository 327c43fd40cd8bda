"""How far behind its server's publisher a client reads, pure (the guide's Suicidal Snail,
measured by time so that it works under a subtree filter too).

Our servers put their clock in a HUGZ every ``clock_s`` (0.5 s), busy or not. For each one
read live, ``observe(ts, now)`` takes ``delay = now - ts`` (``now``: this host's wall
clock) and keeps ``offset_s``, the smallest delay seen from this server: that absorbs the
clock offset between the hosts and the network's floor, so ``lag = delay - offset_s`` is
how much later than usual the client reads the stream. ``reset()`` when the client moves
to another server (another clock).

The same HUGZ carry the server's sequence, so two of them give the publisher's rate
(updates per second of its clock). ``backlog(lag_s)`` is what a client that lags by
``lag_s`` has yet to read: about ``lag_s`` times that rate. The agent weighs it against the
keys a fresh snapshot would send before it resyncs for lag (``clonemap.client.agent``).
"""
from __future__ import annotations


class LagMeter:
    __slots__ = ("offset_s", "lag_s", "max_lag_seen_s", "rate_per_s", "_last")

    def __init__(self):
        self.offset_s: float | None = None
        """The smallest (now - ts) seen from the current server; None before the first."""
        self.lag_s = 0.0
        """The lag at the last observation."""
        self.max_lag_seen_s = 0.0
        self.rate_per_s: float | None = None
        """The publisher's updates per second between its last clock HUGZ (a moving
        average, half from the newest interval); None before two of them."""
        self._last: tuple[float, int] | None = None

    def reset(self) -> None:
        """Another server (another clock): the offset and the rate are learnt again."""
        self.offset_s = None
        self.rate_per_s = None
        self._last = None

    def observe(self, ts: float, now: float, seq: int | None = None) -> float:
        """A HUGZ stamped ``ts`` (the server's wall clock) at sequence ``seq``, read at
        ``now`` (ours): the lag."""
        if seq is not None:
            last = self._last
            if last is not None and ts > last[0] and seq >= last[1]:
                rate = (seq - last[1]) / (ts - last[0])
                self.rate_per_s = (rate if self.rate_per_s is None
                                   else (self.rate_per_s + rate) / 2)
            if last is None or ts > last[0]:
                self._last = (ts, seq)
        delay_s = now - ts
        if self.offset_s is None or delay_s < self.offset_s:
            self.offset_s = delay_s
        lag_s = self.lag_s = delay_s - self.offset_s
        if lag_s > self.max_lag_seen_s:
            self.max_lag_seen_s = lag_s
        return lag_s

    def backlog(self, lag_s: float) -> float | None:
        """The updates a client lagging ``lag_s`` behind has yet to read (its publisher's
        rate times the lag); None while the rate is unknown."""
        if self.rate_per_s is None:
            return None
        return lag_s * self.rate_per_s
