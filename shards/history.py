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

from clonemap.shards.common.zio import untrack_frames

MAX_UPDATES = 100_000
MAX_BYTES = 64 << 20
WIDTH = 5
"""Frames of one KVPUB (key, sequence, UUID, properties, value)."""
ENTRY_OVERHEAD = 100
"""Bytes an entry costs besides its frames' payload: five list slots and the headers of
the sequence and UUID frames' bytes objects (key and value are shared with the map)."""

_SEQ = struct.Struct(">Q")


class History:
    """Blocks of published KVPUBs, oldest first: ``(first_seq, frames, nbytes)`` where
    ``frames`` is one flat list, ``WIDTH`` frames (key, sequence, UUID, properties,
    value) to an update, with consecutive sequences from ``first_seq``. A server hands over
    each collector batch's published frames at once (``extend``: no work per update beyond
    summing sizes); a passive or a relay adds one update at a time (``append``).

    Flat, because a ring of per-update tuples defeats the cyclic garbage collector: at a
    steady state every update allocates one and frees one, so the young generation's
    counter barely moves while its list grows by an object per update, and the rare
    collection that does come walks all of them (29-35 ms pauses at 100,000 updates/s, the
    server's p99). And each block's list is taken off the collector's lists
    (``zio.untrack_frames``: it only ever holds bytes), or every older-generation
    collection would walk the ~500,000 frames of a full history (4-7 ms).

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
        entry = (key, _SEQ.pack(seq), uuid, props, value)
        size = sum(map(len, entry)) + ENTRY_OVERHEAD  # as extend and _trim count it
        blocks = self.blocks
        if blocks and len(blocks[-1][1]) < 256 * WIDTH:
            first, frames, nbytes = blocks.pop()
            frames += entry
            blocks.append((first, frames, nbytes + size))
        else:
            blocks.append((seq, untrack_frames(list(entry)), size))
        self.last = seq
        self.count += 1
        self.bytes += size
        if self.count > self.max_updates or self.bytes > self.max_bytes:
            self._trim()

    def extend(self, frames: list) -> None:
        """Published KVPUBs as one flat list of frames, ``WIDTH`` to an update, with
        consecutive sequences; the list is kept as it is (the caller gives it up)."""
        if not frames:
            return
        first = _SEQ.unpack(frames[1])[0]
        if first != self.last + 1:
            self.reset(first - 1)
        n = len(frames) // WIDTH
        nbytes = sum(map(len, frames)) + n * ENTRY_OVERHEAD
        self.blocks.append((first, untrack_frames(frames), nbytes))
        self.last = first + n - 1
        self.count += n
        self.bytes += nbytes
        if self.count > self.max_updates or self.bytes > self.max_bytes:
            self._trim()

    def _trim(self) -> None:
        blocks = self.blocks
        max_updates, max_bytes = self.max_updates, self.max_bytes
        while len(blocks) > 1 and (self.count > max_updates or self.bytes > max_bytes):
            first, frames, nbytes = blocks.popleft()
            n = len(frames) // WIDTH
            self.count -= n
            self.bytes -= nbytes
            self.base = first + n - 1
        if blocks and (self.count > max_updates or self.bytes > max_bytes):
            first, frames, nbytes = blocks.popleft()  # one block over the bounds: cut it
            n = len(frames) // WIDTH
            k = 0
            while k < n and (self.count > max_updates or self.bytes > max_bytes):
                size = sum(map(len, frames[k * WIDTH:(k + 1) * WIDTH])) + ENTRY_OVERHEAD
                self.count -= 1
                self.bytes -= size
                nbytes -= size
                k += 1
            self.base = first + k - 1
            if k < n:
                blocks.append((first + k, untrack_frames(frames[k * WIDTH:]), nbytes))

    def covers(self, seq: int) -> bool:
        return self.max_updates > 0 and self.base <= seq <= self.last

    def since(self, seq: int, subtree: bytes = b"") -> list | None:
        """The updates after ``seq`` under ``subtree``, oldest first, as ``(seq, key,
        uuid, props, value)``, or None when the history does not cover ``seq``."""
        if not self.covers(seq):
            self.counters["not_covered"] += 1
            return None
        out = []
        for first, frames, _ in self.blocks:
            n = len(frames) // WIDTH
            if first + n - 1 <= seq:
                continue
            for i in range(max(0, seq + 1 - first), n):
                key, _, uuid, props, value = frames[i * WIDTH:(i + 1) * WIDTH]
                if not subtree or key.startswith(subtree):
                    out.append((first + i, key, uuid, props, value))
        self.counters["resumes"] += 1
        self.counters["resume_updates"] += len(out)
        return out

    def stats(self) -> dict:
        return {"updates": self.count, "bytes": self.bytes, "base": self.base,
                "last": self.last, **self.counters}
