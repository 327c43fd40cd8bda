"""An active Binary Star server's answer to its passive's ``BSTAR-TTL?`` on P.

The passive (``clonemap.shards.replica``) asks before its snapshot: the absolute expiry times, so
that its copy keeps every TTL (a KVSYNC carries no properties). The answer is a
point-in-time copy of the store's expiry index (one C-level copy, ~25 ms per million TTL
keys), with the map's generation, term history and applied UUIDs, streamed in chunks of
``bstar_ttl.CHUNK_ENTRIES``, one chunk per peer per loop turn, so collecting and
publishing go on between chunks (``TtlStream`` on a ``clonemap.shards.streams.StreamPump``, the
same pump that streams snapshots; the frames are in ``clonemap.shards.common.proto.bstar_ttl``).
A full pipe pauses the stream; a peer that accepts nothing for ``snapshot_stall_s``, or
has gone, is dropped (the passive's sync deadline restarts it), and a server that stops
being active drops its streams.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import zmq

from clonemap.shards import streams
from clonemap.shards.common import zio
from clonemap.shards.common.proto import bstar_ttl

if TYPE_CHECKING:
    from clonemap.shards.server import ShardServer

UUID_PIECE = 8192
"""Applied UUIDs packed per loop turn for a table's last chunk (~1.5 ms of the answering
server's loop): the whole table, up to 131,072 entries by default, took 27 ms at once,
and every write to that server waited for it (a move's copy asks its source at its
start)."""
TTL_STREAMS_MAX = 4
"""BSTAR-TTL tables streamed at once: a peer's second request replaces its first; more
peers than this (there is normally one) drop the oldest."""


class TtlStream:
    """One BSTAR-TTL table streamed to one passive peer (a ``clonemap.shards.streams`` stream):
    a point-in-time copy of the expiry index (never mutated later, so an iterator over it
    can span loop turns), one chunk per turn."""

    __slots__ = ("identity", "seq", "generation", "history", "entries", "left", "frames",
                 "counters", "staged", "uuid_items", "packed")

    def __init__(self, identity: bytes, seq: int, expiries: dict[bytes, float],
                 generation: str, counters: dict[str, int],
                 history: tuple[tuple[int, int], ...] = (), staged: list[bytes] = (),
                 uuid_tables: tuple[dict, ...] = ()):
        """``uuid_tables``: copies of the applied UUIDs' generations
        (``AppliedUuids.generations``), oldest first, packed ``UUID_PIECE`` entries a turn
        before the last chunk goes."""
        self.uuid_items = (itertools.chain.from_iterable(t.items() for t in uuid_tables)
                           if any(uuid_tables) else None)
        self.packed: list[bytes] = []
        self.staged = staged
        self.identity = identity
        self.seq = seq
        self.generation = generation
        self.history = history
        self.entries = iter(expiries.items())
        self.left = len(expiries)
        self.frames: list[bytes] | None = None
        """The next chunk, encoded and not yet accepted by the pipe."""
        self.counters = counters

    def send_some(self, sock: zmq.Socket) -> str:
        if self.frames is None:
            if self.uuid_items is not None and self.left <= bstar_ttl.CHUNK_ENTRIES:
                # the next chunk is the last: its UUIDs first, a piece a turn (each turn
                # "progress": the pump goes on at the next one)
                piece = list(itertools.islice(self.uuid_items, UUID_PIECE))
                if piece:
                    seq = self.seq
                    self.packed.append(bstar_ttl.pack_uuids(
                        entry for entry in piece if entry[1] <= seq))
                    return streams.PROGRESS
                self.uuid_items = None
            chunk = list(itertools.islice(self.entries, bstar_ttl.CHUNK_ENTRIES))
            self.left -= len(chunk)
            last = self.left <= 0
            self.frames = bstar_ttl.encode_chunk(
                self.seq, chunk, last=last, generation=self.generation,
                history=self.history, staged=self.staged,
                packed_uuids=b"".join(self.packed) if last else b"")
        try:
            zio.send_frames(sock, [self.identity, *self.frames])
        except zmq.Again:  # the peer's pipe is full: the pump retries, or abandons
            return streams.BLOCKED
        self.frames = None
        self.counters["chunks"] += 1
        return streams.DONE if self.left <= 0 else streams.PROGRESS

    def close(self) -> None:
        self.entries = iter(())


class TtlTables:
    """The BSTAR-TTL tables an active streams (see the module doc)."""

    def __init__(self, server: "ShardServer"):
        self.server = server
        self.pump: streams.StreamPump | None = None
        self.counters = dict.fromkeys(("tables", "chunks"), 0)

    def start(self, sock: zmq.Socket, kick) -> None:
        """Stream on P's ROUTER ``sock``; ``kick`` its reader after each send."""
        server = self.server
        self.pump = streams.StreamPump(
            server.loop, sock, kick,
            stall_s=server.config.snapshot_stall_s, max_active=TTL_STREAMS_MAX, evict=True,
            name="BSTAR-TTL table")

    def clear(self) -> None:
        if self.pump is not None:
            self.pump.clear()

    def on_request(self, identity: bytes, history: tuple[tuple[int, int], ...]) -> None:
        """A passive peer's BSTAR-TTL?: the absolute expiry times at this sequence (with
        the term ``history``), streamed in chunks; refused (not answered) unless active."""
        server = self.server
        if not server.active:
            server.snapshots.refused += 1
            return
        self.counters["tables"] += 1
        seq, expiries = server.store.seq, server.store.expiries()
        tables = server.applied.generations()
        generation = server.generation
        staged = list(server.staged)  # (a move's copy here, not this shard's yet)
        self.pump.add(identity, lambda: TtlStream(identity, seq, expiries, generation,
                                                  self.counters, history, staged, tables))

    def stats(self) -> dict:
        pump = self.pump
        if pump is None:
            return {"active": 0, **self.counters}
        return {"active": len(pump.active), **self.counters, **pump.counters}
