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
``lag_s`` has yet to read: about ``lag_s`` times the rate the publisher keeps up, the
lower of its last two intervals. The agent weighs it against the keys a fresh snapshot
would send before it resyncs for lag (``clonemap.client.agent``).

Why the lower of two: what is left to read after a HUGZ is what came after it, and a
burst that ended before it was read already. A shard that takes a shrink's keys
publishes 168,000 updates between two clock HUGZ (``python -m bench reshard --change
shrink``); a client seconds behind, reading the HUGZ after them, took that interval's
rate for the rate to come and could find a backlog larger than its map, and resync for
nothing. A publisher that keeps a high rate up keeps it in both intervals.
"""
from __future__ import annotations


class LagMeter:
    __slots__ = ("offset_s", "lag_s", "max_lag_seen_s", "rate_per_s", "_last", "_rates")

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
        self._rates: tuple[float, ...] = ()
        """The rates of the last two intervals, the newest last."""

    def reset(self) -> None:
        """Another server (another clock): the offset and the rate are learnt again."""
        self.offset_s = None
        self.rate_per_s = None
        self._last = None
        self._rates = ()

    def observe(self, ts: float, now: float, seq: int | None = None) -> float:
        """A HUGZ stamped ``ts`` (the server's wall clock) at sequence ``seq``, read at
        ``now`` (ours): the lag."""
        if seq is not None:
            last = self._last
            if last is not None and ts > last[0] and seq >= last[1]:
                rate = (seq - last[1]) / (ts - last[0])
                self.rate_per_s = (rate if self.rate_per_s is None
                                   else (self.rate_per_s + rate) / 2)
                self._rates = (*self._rates[-1:], rate)
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
        """The updates a client lagging ``lag_s`` behind has yet to read: the lag times
        the rate its publisher kept up (the lower of the last two intervals: a burst in
        one of them has been read already); None while the rate is unknown."""
        if not self._rates:
            return None
        return lag_s * min(self._rates)
