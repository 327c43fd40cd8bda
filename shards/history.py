"""A server's recent updates, so that a client that was away briefly resumes with what it
missed instead of a full snapshot (our extension of ``ICANHAZ?``: see ``chp.icanhaz``).

The history holds the last updates the server published (or, on a passive, applied from
its active: the same sequences), bounded by a count and by bytes (key, properties and
value, plus ``ENTRY_OVERHEAD``), whichever comes first: the oldest go. It *covers* a
sequence S when every update after S is still held: ``base <= S <= last``, where
``base`` is the sequence just before the oldest held update (or the sequence the history
started from, after a start or a replaced map).

A resume is only safe against the same map: a request names its generation, and a
history whose server has another one answers with a full snapshot.
"""
from __future__ import annotations

import itertools
from collections import deque

MAX_UPDATES = 100_000
MAX_BYTES = 64 << 20
ENTRY_OVERHEAD = 120
"""Bytes an entry costs besides its payload (the tuple, the deque slot, the seq frame)."""


class History:
    __slots__ = ("max_updates", "max_bytes", "entries", "bytes", "base", "last",
                 "counters")

    def __init__(self, max_updates: int = MAX_UPDATES, max_bytes: int = MAX_BYTES,
                 seq: int = 0):
        self.max_updates = max_updates
        self.max_bytes = max_bytes
        self.entries: deque[tuple[int, bytes, bytes, bytes, bytes]] = deque()
        """(seq, key, uuid, props, value), oldest first; an empty value is a delete."""
        self.bytes = 0
        self.base = seq
        self.last = seq
        self.counters = {"resumes": 0, "resume_updates": 0, "not_covered": 0}

    def reset(self, seq: int) -> None:
        """A map replaced (or recovered) at ``seq``: only later updates can be resumed."""
        self.entries.clear()
        self.bytes = 0
        self.base = self.last = seq

    def append(self, seq: int, key: bytes, uuid: bytes, props: bytes, value: bytes) -> None:
        if seq != self.last + 1:  # a hole: nothing before it can be resumed any more
            self.reset(seq - 1)
        self.entries.append((seq, key, uuid, props, value))
        self.last = seq
        self.bytes += len(key) + len(props) + len(value) + ENTRY_OVERHEAD
        if len(self.entries) > self.max_updates or self.bytes > self.max_bytes:
            self._trim()

    def _trim(self) -> None:
        entries = self.entries
        while entries and (len(entries) > self.max_updates or self.bytes > self.max_bytes):
            seq, key, _, props, value = entries.popleft()
            self.bytes -= len(key) + len(props) + len(value) + ENTRY_OVERHEAD
            self.base = seq

    def covers(self, seq: int) -> bool:
        return self.max_updates > 0 and self.base <= seq <= self.last

    def since(self, seq: int, subtree: bytes = b"") -> list | None:
        """The updates after ``seq`` under ``subtree``, oldest first, or None when the
        history does not cover ``seq``."""
        if not self.covers(seq):
            self.counters["not_covered"] += 1
            return None
        skip = seq - self.base  # entries[i] has sequence base + 1 + i
        tail = itertools.islice(self.entries, skip, None)
        out = [e for e in tail if e[1].startswith(subtree)] if subtree else list(tail)
        self.counters["resumes"] += 1
        self.counters["resume_updates"] += len(out)
        return out

    def stats(self) -> dict:
        return {"updates": len(self.entries), "bytes": self.bytes, "base": self.base,
                "last": self.last, **self.counters}
