"""Recently applied UUIDs: what makes a resent write apply once. Pure: the clock is
passed in.

Every update a server applies with a UUID is recorded as ``uuid -> sequence``. A write
sent again (a client's resend after an outage, a conditional write retried on the new
active) whose UUID is still recorded is not applied again: the server answers with the
sequence of the first application (``clonemap.shards.requests``) or drops it, counted
``duplicate`` (a plain KVSET on the collector).

Bounded in entries (from bytes) and in age, with two generations of plain dicts: new
entries go to ``current``; when it holds ``half`` entries, or is ``max_age_s / 2`` old,
it becomes ``previous`` and the old ``previous`` is forgotten. So an entry is kept for at
least ``half`` later writes and ``max_age_s / 2`` seconds (the documented window), and
at most twice that. Recording costs one dict store per update (no per-entry timestamps,
no eviction walk). A forgotten generation is freed a few entries per ``add`` (and a
chunk per ``tick``), not at once: dropping 65,536 entries in one go took the server
~3 ms, and doubled its p99 at half load (``bench hot_path``).

Where it lives: the active records what it applies; the log records each update's UUID,
a snapshot file the table as of its sequence, so a restarted server recovers it; a
passive records the UUIDs of the KVPUBs it replicates, and copies the table with the
BSTAR-TTL table when it synchronises (``clonemap.shards.common.proto.bstar_ttl``).
"""
from __future__ import annotations

FREE_PER_TICK = 4096
"""Entries of a forgotten generation freed per ``tick`` (when writes are too few to)."""

ENTRY_BYTES = 128
"""What one entry costs, measured: a 16-byte ``bytes`` (49 B), an ``int`` (32 B) and its
share of a dict's table (~45 B)."""


class AppliedUuids:
    __slots__ = ("current", "previous", "half", "max_age_s", "_since", "rotations", "_dying")

    def __init__(self, max_bytes: int = 16 << 20, max_age_s: float = 120.0,
                 now: float = 0.0):
        self.half = max(1, max_bytes // ENTRY_BYTES // 2)
        self.max_age_s = max_age_s
        self.current: dict[bytes, int] = {}
        self.previous: dict[bytes, int] = {}
        self._dying: dict[bytes, int] = {}
        """A forgotten generation, freed a little at a time."""
        self._since = now
        self.rotations = 0

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)

    def add(self, uuid: bytes, seq: int) -> None:
        cur = self.current
        cur[uuid] = seq
        if len(cur) >= self.half:
            self.rotate()
        elif dying := self._dying:  # two freed per add (inline: the hot path)
            dying.popitem()
            if dying:
                dying.popitem()

    def get(self, uuid: bytes) -> int | None:
        """The sequence ``uuid`` was applied at, while it is remembered."""
        seq = self.current.get(uuid)
        return seq if seq is not None else self.previous.get(uuid)

    def tick(self, now: float) -> None:
        """Age the table (call it about once a second)."""
        if now - self._since >= self.max_age_s / 2:
            self.rotate()
            self._since = now
        self.free_some(FREE_PER_TICK)

    def rotate(self) -> None:
        """``current`` becomes ``previous``; the old ``previous`` is forgotten (and freed
        bit by bit: what is still dying then is freed now, a fraction of a generation
        at most, since each ``add`` frees two)."""
        self._dying = self.previous
        self.previous, self.current = self.current, {}
        self.rotations += 1

    def free_some(self, n: int) -> None:
        dying = self._dying
        for _ in range(min(n, len(dying))):
            dying.popitem()

    def clear(self, now: float = 0.0) -> None:
        self.current, self.previous, self._dying = {}, {}, {}
        self._since = now

    def generations(self) -> tuple[dict[bytes, int], dict[bytes, int]]:
        """Copies of the two generations, oldest first (C-level dict copies: ~1 ms per
        65,536 entries), which later writes and rotations leave as they are."""
        return dict(self.previous), dict(self.current)

    def load(self, flat: list) -> None:
        """Add ``[uuid, seq, ...]`` (oldest first) as if just applied."""
        add = self.add
        for i in range(0, len(flat) - 1, 2):
            add(flat[i], flat[i + 1])


APPLY, DUPLICATE, CONFLICT = "apply", "duplicate", "conflict"


def decide(mod_seq: int, applied_at: int | None, if_seq: int | None,
           deletes: bool) -> tuple[str, int]:
    """What the active does with one write, and the sequence its reply names:

    * its UUID was applied before (at ``applied_at``): ``(DUPLICATE, applied_at)``,
      whatever its condition says now (a resend is answered as the first send was);
    * a condition (``if_seq``; 0 = the key must be absent) that the key's last-modified
      sequence ``mod_seq`` (0: absent) does not meet, or a conditional delete of an
      absent key: ``(CONFLICT, mod_seq)``: not applied, not published;
    * otherwise ``(APPLY, 0)``: applied with the next sequence.
    """
    if applied_at is not None:
        return DUPLICATE, applied_at
    if if_seq is not None and (mod_seq != if_seq or (deletes and not mod_seq)):
        return CONFLICT, mod_seq
    return APPLY, 0
