"""The writes a passive Binary Star server holds (``HeldWrites``), and applies at takeover.

A passive server hears every KVSET twice: once from the client on its own collector, and
once, re-published as a KVPUB with the same UUID, from the active's P+1. The pending table
(``clonemap.shards.pending.PendingTable``, keyed by UUID, bounded by count, bytes and age, O(1))
matches them: while not active, every valid KVSET heard here is held until the active's
KVPUB with the same UUID arrives. It is held decoded (``HeldWrite``), as the active would
apply it: a relative ``ttl`` turned into an absolute expiry at arrival, so an update
applied at takeover expires when the client meant; the write terms (``reply=``) kept
apart from the properties its KVPUB will carry. The table is emptied when a
synchronisation starts (``clonemap.shards.replica``): what was heard before it is in the snapshot
(or was never taken by the active). A KVSET with an empty UUID cannot be matched: it is
not tracked (``pending.untracked``), never an error. A KVSET for a key this shard does
not own (``--routing``) is not held: it is dropped and counted ``not_owner``, as the
active does. A conditional write is not held either: the active alone decides it.

At takeover (``take_at_takeover``), what is still held is applied in arrival order,
continuing the sequence (``ShardServer.apply_write``: a resend already applied is applied
once). An entry heard more than ``pending_grace_s`` before the old active's last message
is stale (the active had time to publish it and did not: e.g. a KVSET a client's socket
queued while this server was down and delivered on reconnection): dropped and counted,
never replayed over newer values.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import chp
from clonemap.shards.pending import MAX_AGE_S, MAX_BYTES, MAX_ENTRIES, HeldWrite, PendingTable
from clonemap.shards.store import ttl_props

if TYPE_CHECKING:
    from clonemap.shards.server import ShardServer

PENDING_GRACE_HEARTBEATS = 2
PENDING_GRACE_MIN_S = 1.0


def pending_grace_s(heartbeat_s: float) -> float:
    """At takeover, a pending update heard more than this long before the old active's
    last KVPUB/HUGZ is stale (the active had time to publish it) and is dropped: two
    heartbeats, at least ``PENDING_GRACE_MIN_S`` (an active under load publishes late)."""
    return max(PENDING_GRACE_HEARTBEATS * heartbeat_s, PENDING_GRACE_MIN_S)


class HeldWrites:
    """A passive's held writes (see the module doc)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S,
                 max_bytes: int = MAX_BYTES):
        self.table = PendingTable(max_entries, max_age_s, max_bytes)
        self.server: ShardServer | None = None
        self.applied = 0
        self.stale = 0

    def hold(self, frames: list[bytes]) -> None:
        """A KVSET heard while passive: checked, decoded, held by UUID."""
        server = self.server
        try:
            kvset = chp.decode_kvset(frames, server.config.limits)
            props = kvset.props
            terms = chp.write_terms(props)
            expiry_s = None
            if kvset.value and props:
                expiry_s, props = ttl_props(props, time.time())
                if expiry_s is not None and b"ttl=" in props:
                    props = chp.drop_props(props, (b"ttl",))  # the absolute expires
        except ProtocolError as err:
            server.drops.drop(err.reason, str(err))
            return
        if not server.owns(kvset.key):  # the active drops it too: never confirmed
            return
        if terms.if_seq is not None:
            # A conditional write is decided by the active alone: held here, it could be
            # applied at a takeover after the active refused it (a conflict the writer
            # was told). Its writer sends it again to the new active (same UUID).
            server.drops.drop("conditional_not_held", "a conditional KVSET while passive")
            return
        if terms.reply_to:
            props = chp.strip_write_terms(props)
        write = HeldWrite(kvset.key, kvset.value, props, kvset.uuid, expiry_s, terms.reply_to)
        self.table.add(kvset.uuid, write, server.loop.time(),
                       len(kvset.key) + len(props) + len(kvset.value))

    def take_at_takeover(self, now: float, last_heard: float) -> tuple[list, int]:
        """What is still held (the server is active now), in arrival order, except
        entries heard ``pending_grace_s`` before the old active's last message
        (``last_heard``; 0: never heard), which are dropped as stale. Returns the writes
        to apply (``ShardServer.apply_write`` arguments) and how many were stale."""
        held = self.table.drain(now)
        cutoff = (last_heard - pending_grace_s(self.server.config.heartbeat_s) if last_heard
                  else None)
        writes = [entry.update for entry in held
                  if cutoff is None or entry.added_at >= cutoff]
        stale = len(held) - len(writes)
        self.applied += len(writes)
        self.stale += stale
        return writes, stale

    def stats(self) -> dict:
        table = self.table
        return {"pending": len(table), "pending_bytes": table.bytes,
                "pending_early": table.early_count, "pending_applied": self.applied,
                "pending_stale": self.stale, "pending_counters": dict(table.counters)}
