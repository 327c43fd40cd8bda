"""The passive server's pending table: client updates not yet seen from the active.

A passive server hears every KVSET twice: once from the client on its own collector, and
once, re-published as a KVPUB with the same UUID, from the active server's P+1. The two
arrive in either order. This table matches them by UUID so that, on becoming active, the
passive server applies exactly the updates the old active never published::

    event                                   table                        counter
    add(uuid, update, now), new uuid        keep it pending              added
    add, uuid already pending               keep the first one           duplicates
    add, uuid confirmed before (the active
      was faster than the client)           forget both                  early_matched
    add, empty uuid                         not tracked (cannot match)   untracked
    confirm(uuid), pending                  remove it, return True       confirmed
    confirm(uuid), not pending              remember it as "early",      early
                                            return False
    confirm(empty uuid)                     nothing, return False        -
    more than max_entries pending           drop the oldest              evicted
    more than max_bytes pending             drop the oldest              evicted_bytes
    pending longer than max_age_s           drop it (expire/add/confirm) expired
    drain(now)                              expire, then return and      drained
                                            clear all, arrival order

The "early" confirmations (the guide: "updates from the active not yet from clients")
sit in a second table with the same bounds (``early_evicted``, ``early_expired``), so
that a client KVSET arriving after its KVPUB is not kept forever or re-applied later.

Costs: every operation is O(1) amortised: two insertion-ordered dicts; since ``now``
never goes backwards (a later ``now`` smaller than an earlier one is treated as the
earlier one), the oldest entry is always first, so expiry and eviction pop from the
front. Memory is bounded by ``2 * max_entries`` entries whatever the traffic, and the
pending updates by ``max_bytes`` of key, properties and value (each entry's ``size``, as
the caller counts it; the largest update allowed is always kept).

Empty UUIDs: 12/CHP makes the UUID optional. An update without one cannot be matched, so
it is not tracked (counted as ``untracked``); the shell applies it as the active would
when it arrives from the active, and a client update with no UUID that the active never
published is lost on failover. clonemap's clients always send a UUID.

Entries carry their arrival time (``Pending.added_at``): the table ages them out after
``max_age_s``, and at takeover ``clonemap.shards.pair`` drops as stale an entry heard long before
the old active's last message (the active had time to publish it and did not). A
relative TTL was already made absolute when the update was held (``clonemap.shards.pair``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

from clonemap.shards.common.proto import chp

MAX_ENTRIES = 100_000
MAX_AGE_S = 30.0
MAX_BYTES = 64 << 20


class HeldWrite(NamedTuple):
    """A client's write as a passive holds it (``clonemap.shards.pair``): checked and decoded, its
    relative ``ttl`` already made absolute (``expiry_s``), its properties as its KVPUB
    will carry them; applied as they are at a takeover (``ShardServer.apply_write``)."""
    key: bytes
    value: bytes
    props: bytes
    uuid: bytes
    expiry_s: float | None
    reply_to: bytes = b""

    def kvset(self) -> list[bytes]:
        """The KVSET a client would send for this write now: its properties (an absolute
        ``expires=`` for a relative ``ttl``) and its ``reply=`` term."""
        props = self.props + (chp.write_props(reply_to=self.reply_to) if self.reply_to
                              else b"")
        return chp.kvset(self.key, self.value, self.uuid, props)


class Pending(NamedTuple):
    uuid: bytes
    update: Any
    added_at: float
    size: int = 0


COUNTER_NAMES = ("added", "duplicates", "untracked", "confirmed", "early", "early_matched",
                 "evicted", "evicted_bytes", "expired", "early_evicted", "early_expired",
                 "drained")


class PendingTable:
    """Updates heard from clients, by UUID, until the active publishes them."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S,
                 max_bytes: int = MAX_BYTES):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.bytes = 0
        """The sizes of the pending updates, summed."""
        self._pending: OrderedDict[bytes, Pending] = OrderedDict()
        self._early: OrderedDict[bytes, float] = OrderedDict()
        self._now = float("-inf")
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, uuid: bytes) -> bool:
        return uuid in self._pending

    @property
    def early_count(self) -> int:
        """How many confirmations are waiting for their client update."""
        return len(self._early)

    def _clock(self, now: float) -> float:
        if now > self._now:
            self._now = now
        return self._now

    def add(self, uuid: bytes, update: Any, now: float, size: int = 0) -> bool:
        """Record a client update of ``size`` bytes; True if it is now pending."""
        now = self._clock(now)
        self._expire(now)
        counters = self.counters
        if not uuid:
            counters["untracked"] += 1
            return False
        if uuid in self._early:
            del self._early[uuid]
            counters["early_matched"] += 1
            return False
        if uuid in self._pending:
            counters["duplicates"] += 1
            return False
        pending = self._pending
        pending[uuid] = Pending(uuid, update, now, size)
        self.bytes += size
        counters["added"] += 1
        if len(pending) > self.max_entries:
            self.bytes -= pending.popitem(last=False)[1].size
            counters["evicted"] += 1
        while self.bytes > self.max_bytes and len(pending) > 1:
            self.bytes -= pending.popitem(last=False)[1].size
            counters["evicted_bytes"] += 1
        return True

    def confirm(self, uuid: bytes, now: float | None = None) -> bool:
        """The active published ``uuid``: True if it was pending (and is now removed)."""
        if now is not None:
            self._expire(self._clock(now))
        if not uuid:
            return False
        if (entry := self._pending.pop(uuid, None)) is not None:
            self.bytes -= entry.size
            self.counters["confirmed"] += 1
            return True
        if uuid not in self._early:
            self._early[uuid] = self._now
            self.counters["early"] += 1
            if len(self._early) > self.max_entries:
                self._early.popitem(last=False)
                self.counters["early_evicted"] += 1
        return False

    def expire(self, now: float) -> int:
        """Drop entries older than ``max_age_s``; returns how many pending updates went."""
        return self._expire(self._clock(now))

    def _expire(self, now: float) -> int:
        cutoff = now - self.max_age_s
        gone = 0
        pending = self._pending
        while pending:
            first = next(iter(pending.values()))
            if first.added_at >= cutoff:
                break
            pending.popitem(last=False)
            self.bytes -= first.size
            gone += 1
        early = self._early
        early_gone = 0
        while early:
            if next(iter(early.values())) >= cutoff:
                break
            early.popitem(last=False)
            early_gone += 1
        self.counters["expired"] += gone
        self.counters["early_expired"] += early_gone
        return gone

    def discard_pending(self) -> int:
        """Forget the updates pending (a sync starts: each is in the snapshot, or never
        taken); the early confirmations stay, so that a client's copy of an update the
        active published before the sync, arriving after it began, is matched and not
        applied again at a takeover (seen: a replica one sequence past its active's map).
        How many were forgotten."""
        gone = len(self._pending)
        self._pending.clear()
        self.bytes = 0
        self.counters["drained"] += gone
        return gone

    def drain(self, now: float | None = None) -> list[Pending]:
        """Everything still pending, in arrival order (expired entries first dropped when
        ``now`` is given); the table is left empty, early confirmations forgotten."""
        if now is not None:
            self._expire(self._clock(now))
        out = list(self._pending.values())
        self._pending.clear()
        self.bytes = 0
        self._early.clear()
        self.counters["drained"] += len(out)
        return out
