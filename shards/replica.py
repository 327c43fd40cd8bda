"""The passive server's replica: a snapshot from the active, then the active's P+1 stream.

A ``Follower`` belongs to a server (``ReplicaOwner``: in practice ``shards.pair.PairServer``)
and owns two sockets on its loop:

    DEALER -> the active's P     BSTAR-TTL? and ICANHAZ? "" (the whole map)
    SUB    -> the active's P+1   KVPUB, HUGZ (subscribed to everything, connected at start)

Synchronisation (``start_sync``), a state with a deadline, never a blocking loop:

1. Every KVPUB heard from now on is buffered (bounded: ``buffer_max``) and its UUID
   confirmed in the owner's pending table. The pending table was emptied just before:
   updates heard before the sync began are covered by the snapshot or lost with the old
   active (see ``PairServer``).
2. The DEALER sends ``BSTAR-TTL?``. The active streams its absolute expiry times (and
   its map's generation), a point-in-time copy at its current sequence T, in chunks (``shards.common.proto.bstar_ttl``: a
   KVSYNC carries no properties, so a snapshot alone would turn every TTL key into a
   permanent one). At the last chunk the DEALER sends ``ICANHAZ?`` and the active streams
   the snapshot at sequence S >= T: KVSYNC*, KTHXBAI.
3. Each KVSYNC goes into a fresh ``Store`` with the expiry from the table. At KTHXBAI the
   keys rewritten between T and S take their expiry from the buffered KVPUBs T+1..S (the
   buffer must hold all of them, else the sync starts over), the store's sequence is set
   to S, the buffered KVPUBs after S are applied, and the new store replaces the owner's,
   which takes over the active's generation (clients see one generation per map).
4. Live: a KVPUB with sequence ``store.seq + 1`` is applied with the active's sequence
   and its ``expires`` property (absolute wall-clock seconds); an older one is a duplicate
   (ignored); a newer one means updates were lost (a gap): the sync starts over.

No reply for ``sync_timeout_s`` (each reply restarts it) or a malformed reply also starts
the sync over on a fresh DEALER. ``drain()`` reads whatever the SUB still holds, so a
server that takes over first applies everything the dead active managed to publish.

The BSTAR-TTL frames are in ``shards.common.proto.bstar_ttl``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import zmq

from shards.common import zio
from shards.common.drops import DropCounter
from shards.common.errors import ProtocolError
from shards.common.proto import bstar_ttl, chp
from shards.pending import PendingTable
from shards.server import ServerConfig
from shards.store import Store

log = logging.getLogger("shards.replica")

BUFFER_MAX = 200_000
"""KVPUBs buffered while a snapshot streams; more restart the sync."""
_EXPIRES = b"expires="


def expires_of(props: bytes) -> float | None:
    """The absolute expiry a KVPUB carries (``expires=<epoch s>``), or None."""
    if not props or _EXPIRES not in props:
        return None
    found = None
    for line in props.split(b"\n"):
        if line.startswith(_EXPIRES):
            try:
                found = float(line[len(_EXPIRES):])
            except ValueError:
                found = None
    return found


class ReplicaOwner(Protocol):
    """What a ``Follower`` uses of the server it belongs to (``shards.pair.PairServer``)."""

    ctx: zmq.Context
    loop: asyncio.AbstractEventLoop
    config: ServerConfig
    shard: str
    store: Store
    drops: DropCounter
    pending: PendingTable

    def reset_pending(self) -> None: ...

    def replace_store(self, store: Store, generation: str = "") -> None: ...


class Follower:
    """Keeps ``owner.store`` a replica of the active peer's map (see the module doc)."""

    def __init__(self, owner: ReplicaOwner, peer_host: str, peer_port: int, *,
                 sync_timeout_s: float, buffer_max: int = BUFFER_MAX):
        self.owner = owner
        self.snapshot_endpoint = f"tcp://{peer_host}:{peer_port}"
        self.updates_endpoint = f"tcp://{peer_host}:{peer_port + 1}"
        self.sync_timeout_s = sync_timeout_s
        self.buffer_max = buffer_max
        self.phase = "idle"            # idle | syncing | live
        self._sub: zio.AsyncSocket | None = None
        self._dealer: zio.AsyncSocket | None = None
        self._buffer: list[chp.Kvpub] = []
        self._building: Store | None = None
        self._ttl_seq: int | None = None
        self._ttl_table: dict[bytes, float] = {}
        self._generation = ""
        """The active's map generation, from its TTL table (taken over at the end)."""
        self._deadline = 0.0
        self._retry_at: float | None = None
        self.counters = dict.fromkeys(
            ("syncs_started", "syncs_done", "sync_timeouts", "sync_retries", "gaps",
             "duplicates", "applied", "hugz", "hugz_not_serving", "ignored_while_idle",
             "kvsync", "ttl_chunks"),
            0)
        self.last_heard = 0.0
        self._taking_over = False

    # ------------------------------------------------------------------ sockets
    def open(self) -> None:
        """Connect the SUB to the active's P+1 (once, at start)."""
        sock = self.owner.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.owner.config.collect_rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.updates_endpoint)
        self._sub = zio.AsyncSocket(sock, self.on_update, batch=self.owner.config.collect_batch,
                                    loop=self.owner.loop, name="peer updates")

    def close(self) -> None:
        self._close_dealer()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    # ------------------------------------------------------------------ control
    def start_sync(self, now: float) -> None:
        """Start (or restart) a full synchronisation from the active."""
        self._close_dealer()
        self.phase = "syncing"
        self.counters["syncs_started"] += 1
        self._buffer = []
        self._building = None
        self._ttl_seq = None
        self._ttl_table = {}
        self._generation = ""
        self._retry_at = None
        self.owner.reset_pending()
        sock = self.owner.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.snapshot_endpoint)
        self._dealer = zio.AsyncSocket(sock, self.on_snapshot_reply, batch=1024,
                                       loop=self.owner.loop, name="peer snapshot")
        self._dealer.send(bstar_ttl.request())
        self._deadline = now + self.sync_timeout_s
        log.info("shard %s: synchronising from the active at %s", self.owner.shard,
                 self.snapshot_endpoint)

    def stop(self) -> None:
        """Stop following (this server is becoming active)."""
        if self.phase == "syncing":
            log.warning("shard %s: taking over before the replica was complete (%s)",
                        self.owner.shard, self.snapshot_endpoint)
        self.phase = "idle"
        self._close_dealer()
        self._buffer = []
        self._building = None

    def _restart_later(self, now: float, why: str) -> None:
        """Start over after a short pause (one heartbeat), on a fresh DEALER."""
        log.warning("shard %s: replica sync restarts: %s", self.owner.shard, why)
        self.counters["sync_retries"] += 1
        self._close_dealer()
        self.phase = "syncing"
        self._buffer = []
        self._building = None
        self._retry_at = now + self.owner.config.heartbeat_s

    def on_tick(self, now: float) -> None:
        """Called by the owner's timer: deadlines and delayed retries."""
        if self.phase != "syncing":
            return
        if self._retry_at is not None:
            if now >= self._retry_at:
                self.start_sync(now)
            return
        if now > self._deadline:
            self.counters["sync_timeouts"] += 1
            self._restart_later(now, f"no reply from {self.snapshot_endpoint} for "
                                     f"{self.sync_timeout_s:g} s")

    def drain(self) -> int:
        """Read and handle everything the SUB holds now (before taking over)."""
        if self._sub is None:
            return 0
        n = 0
        sock = self._sub.sock
        self._taking_over = True  # a gap now must not restart a sync (nor empty pending)
        while True:
            try:
                frames = zio.recv_frames(sock)
            except zmq.Again:
                break
            self.on_update(frames)
            n += 1
        self._taking_over = False
        self._sub.kick()
        return n

    # ------------------------------------------------------------------ stream
    def on_update(self, frames: list[bytes]) -> None:
        """A KVPUB or HUGZ from the active's P+1."""
        owner = self.owner
        if self.phase == "idle":
            self.counters["ignored_while_idle"] += 1
            return
        try:
            msg = chp.decode_update(frames, owner.config.limits)
        except ProtocolError as err:
            owner.drops.drop("peer_" + err.reason, f"from {self.updates_endpoint}: {err}")
            return
        now = owner.loop.time()
        if not isinstance(msg, chp.Kvpub):
            self.counters["hugz"] += 1
            if msg.props and not chp.hugz_info(msg).serving:
                # not from an active: the peer restarted (its welcome HUGZ) and is not
                # serving. It must not count as the active's last word, or KVSETs
                # pending here would look stale at takeover and be dropped.
                self.counters["hugz_not_serving"] += 1
                return
            self.last_heard = now
            return
        self.last_heard = now
        owner.pending.confirm(msg.uuid, now)
        if self.phase == "syncing":
            if len(self._buffer) >= self.buffer_max:
                self._restart_later(now, f"more than {self.buffer_max} updates while the "
                                         "snapshot streamed")
                return
            self._buffer.append(msg)
            return
        self._apply(msg, now)

    def _apply(self, msg: chp.Kvpub, now: float) -> bool:
        store = self.owner.store
        if msg.seq <= store.seq:
            self.counters["duplicates"] += 1
            return True
        if msg.seq != store.seq + 1:
            self.counters["gaps"] += 1
            log.warning("shard %s: gap in the active's stream: have %d, got %d",
                        self.owner.shard, store.seq, msg.seq)
            if self._taking_over:
                self.phase = "idle"  # what follows the gap cannot be applied
                return False
            self.start_sync(now)
            return False
        store.apply(msg.key, msg.value, expires_of(msg.props) if msg.value else None)
        self.counters["applied"] += 1
        return True

    # ------------------------------------------------------------------ snapshot
    def on_snapshot_reply(self, frames: list[bytes]) -> None:
        if self.phase != "syncing" or self._retry_at is not None:
            return
        owner = self.owner
        now = owner.loop.time()
        self._deadline = now + self.sync_timeout_s
        try:
            if frames and frames[0] == bstar_ttl.REPLY:
                self._on_ttl_chunk(bstar_ttl.decode_chunk(frames), now)
                return
            reply = chp.decode_snapshot(frames, owner.config.limits)
        except ProtocolError as err:
            owner.drops.drop("peer_" + err.reason, f"from {self.snapshot_endpoint}: {err}")
            self._restart_later(now, f"malformed snapshot reply ({err.reason})")
            return
        if self._building is None:
            self._restart_later(now, "snapshot before the TTL table")
            return
        if isinstance(reply, chp.Kvsync):
            self.counters["kvsync"] += 1
            self._building.apply(reply.key, reply.value, self._ttl_table.get(reply.key))
            return
        self._finish(reply.seq, now)

    def _on_ttl_chunk(self, chunk: bstar_ttl.Chunk, now: float) -> None:
        if self._building is not None:
            self._restart_later(now, "a TTL chunk after the TTL table's last")
            return
        if self._ttl_seq is None:
            self._ttl_seq = chunk.seq
        elif chunk.seq != self._ttl_seq:
            self._restart_later(now, f"TTL chunks of two tables ({self._ttl_seq}, {chunk.seq})")
            return
        self._ttl_table.update(chunk.table)
        self._generation = chunk.generation or self._generation
        self.counters["ttl_chunks"] += 1
        if chunk.last:
            self._building = Store()
            self._dealer.send(chp.icanhaz(b""))

    def _finish(self, snap_seq: int, now: float) -> None:
        store, ttl_seq = self._building, self._ttl_seq
        # keys rewritten between the TTL table (T) and the snapshot (S)
        between = [m for m in self._buffer if ttl_seq < m.seq <= snap_seq]
        if len(between) != snap_seq - ttl_seq or any(
                m.seq != ttl_seq + 1 + i for i, m in enumerate(between)):
            self._restart_later(now, f"updates {ttl_seq + 1}..{snap_seq} not all heard "
                                     f"({len(between)} buffered)")
            return
        for m in between:
            value = store.get(m.key)
            if value is not None:
                store.apply(m.key, value, expires_of(m.props) if m.value else None)
        store.seq = snap_seq
        later = [m for m in self._buffer if m.seq > snap_seq]
        self._buffer = []
        self._building = None
        self._close_dealer()
        self.owner.replace_store(store, self._generation)
        self.phase = "live"
        self.counters["syncs_done"] += 1
        log.info("shard %s: replica synchronised: %d keys at sequence %d (%d TTL keys)",
                 self.owner.shard, len(store), snap_seq, store.ttl_keys)
        for m in later:
            if not self._apply(m, now):
                return

    def stats(self) -> dict:
        return {"phase": self.phase, "buffered": len(self._buffer), **self.counters}
