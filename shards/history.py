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

import struct
from collections import deque

MAX_UPDATES = 100_000
MAX_BYTES = 64 << 20
ENTRY_OVERHEAD = 120
"""Bytes an entry costs besides its payload (the tuple, the list slot, the seq frame)."""

_SEQ = struct.Struct(">Q")


class History:
    """Blocks of published KVPUBs, oldest first: ``(first_seq, items, nbytes)`` where
    ``items`` are ``(key, seq_frame, uuid, props, value)`` tuples with consecutive
    sequences from ``first_seq``. A server hands over each collector batch's published
    tuples at once (``extend``: no work per update beyond summing sizes); a passive or a
    relay adds one update at a time (``append``).

    Trimming drops whole blocks, oldest first, while the bounds are exceeded; only a
    single block larger than the bounds is cut. So the history holds at most the last
    ``max_updates`` updates and ``max_bytes`` bytes, and covers at least that less one
    batch (``collect_batch``, 256 by default)."""

    __slots__ = ("max_updates", "max_bytes", "blocks", "count", "bytes", "base", "last",
                 "counters")

    def __init__(self, max_updates: int = MAX_UPDATES, max_bytes: int = MAX_BYTES,
                 seq: int = 0):
        self.max_updates = max_updates
        self.max_bytes = max_bytes
        self.blocks: deque[tuple[int, list, int]] = deque()
        self.count = 0
        self.bytes = 0
        self.base = seq
        self.last = seq
        self.counters = {"resumes": 0, "resume_updates": 0, "not_covered": 0}

    def reset(self, seq: int) -> None:
        """A map replaced (or recovered) at ``seq``: only later updates can be resumed."""
        self.blocks.clear()
        self.count = self.bytes = 0
        self.base = self.last = seq

    def append(self, seq: int, key: bytes, uuid: bytes, props: bytes, value: bytes) -> None:
        """One update (an empty value is a delete)."""
        if seq != self.last + 1:  # a hole: nothing before it can be resumed any more
            self.reset(seq - 1)
        size = len(key) + len(props) + len(value) + ENTRY_OVERHEAD
        blocks = self.blocks
        item = (key, _SEQ.pack(seq), uuid, props, value)
        if blocks and len(blocks[-1][1]) < 256:
            first, items, nbytes = blocks.pop()
            items.append(item)
            blocks.append((first, items, nbytes + size))
        else:
            blocks.append((seq, [item], size))
        self.last = seq
        self.count += 1
        self.bytes += size
        if self.count > self.max_updates or self.bytes > self.max_bytes:
            self._trim()

    def extend(self, items: list) -> None:
        """Published KVPUBs ``(key, seq_frame, uuid, props, value)`` with consecutive
        sequences; the list is kept as it is (the caller gives it up)."""
        if not items:
            return
        first = _SEQ.unpack(items[0][1])[0]
        if first != self.last + 1:
            self.reset(first - 1)
        n = len(items)
        nbytes = sum([len(k) + len(p) + len(v) for k, _, _, p, v in items]) + n * ENTRY_OVERHEAD
        self.blocks.append((first, items, nbytes))
        self.last = first + n - 1
        self.count += n
        self.bytes += nbytes
        if self.count > self.max_updates or self.bytes > self.max_bytes:
            self._trim()

    def _trim(self) -> None:
        blocks = self.blocks
        max_updates, max_bytes = self.max_updates, self.max_bytes
        while len(blocks) > 1 and (self.count > max_updates or self.bytes > max_bytes):
            first, items, nbytes = blocks.popleft()
            self.count -= len(items)
            self.bytes -= nbytes
            self.base = first + len(items) - 1
        if blocks and (self.count > max_updates or self.bytes > max_bytes):
            first, items, nbytes = blocks.popleft()  # one block over the bounds: cut it
            k = 0
            while k < len(items) and (self.count > max_updates or self.bytes > max_bytes):
                key, _, _, props, value = items[k]
                size = len(key) + len(props) + len(value) + ENTRY_OVERHEAD
                self.count -= 1
                self.bytes -= size
                nbytes -= size
                k += 1
            self.base = first + k - 1
            if k < len(items):
                blocks.append((first + k, items[k:], nbytes))

    def covers(self, seq: int) -> bool:
        return self.max_updates > 0 and self.base <= seq <= self.last

    def since(self, seq: int, subtree: bytes = b"") -> list | None:
        """The updates after ``seq`` under ``subtree``, oldest first, as ``(seq, key,
        uuid, props, value)``, or None when the history does not cover ``seq``."""
        if not self.covers(seq):
            self.counters["not_covered"] += 1
            return None
        out = []
        for first, items, _ in self.blocks:
            if first + len(items) - 1 <= seq:
                continue
            for i in range(max(0, seq + 1 - first), len(items)):
                key, _, uuid, props, value = items[i]
                if not subtree or key.startswith(subtree):
                    out.append((first + i, key, uuid, props, value))
        self.counters["resumes"] += 1
        self.counters["resume_updates"] += len(out)
        return out

    def stats(self) -> dict:
        return {"updates": self.count, "bytes": self.bytes, "base": self.base,
                "last": self.last, **self.counters}
