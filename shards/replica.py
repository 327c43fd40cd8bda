"""The passive server's replica: a snapshot from the active, then the active's P+1 stream.

A ``Follower`` runs on a server's reactor (its loop, context and security) and writes the
copy into a ``ReplicaSink``: a passive Binary Star server (``clonemap.shards.pair.BinaryStar``) or a
relay (``clonemap.shards.relay.Relay``). It owns two sockets on the loop:

    DEALER -> the active's P     BSTAR-TTL? and ICANHAZ? "" (the whole map)
    SUB    -> the active's P+1   KVPUB, HUGZ (subscribed to everything, a move's staged
                                 updates too: ``chp.STAGED_PREFIX``; connected at start)

The rules are the pure machine ``clonemap.shards.replica_machine`` (phases, the T..S check,
deadlines, retries); this module is its I/O shell: sockets, the buffer, the TTL table and
the store being built. Synchronisation (``start_sync``), a state with a deadline, never a
blocking loop:

1. Every KVPUB heard from now on is buffered (bounded: ``buffer_max``) and its UUID
   confirmed in the pending table, when the follower has one (a passive's). The pending
   table was emptied just before: updates heard before the sync began are covered by the
   snapshot or lost with the old active (see ``clonemap.shards.pair``).
2. The DEALER sends ``BSTAR-TTL?``. The active streams its absolute expiry times (and
   its map's generation), a point-in-time copy at its current sequence T, in chunks (``clonemap.shards.common.proto.bstar_ttl``: a
   KVSYNC carries no properties, so a snapshot alone would turn every TTL key into a
   permanent one). At the last chunk the DEALER sends ``ICANHAZ?`` and the active streams
   the snapshot at sequence S >= T: KVSYNC*, KTHXBAI.
3. Each KVSYNC goes into a fresh ``Store`` with the expiry from the table. At KTHXBAI the
   keys rewritten between T and S take their expiry from the buffered KVPUBs T+1..S (the
   buffer must hold all of them, else the sync starts over), the store's sequence is set
   to S, the new store is installed (``ReplicaSink.install``: the sink takes over the
   active's generation, so clients see one generation per map), and the buffered
   KVPUBs after S are applied.
4. Live: a KVPUB with sequence ``sink.seq + 1`` is applied with the active's sequence
   and its ``expires`` property (absolute wall-clock seconds: ``ReplicaSink.apply``); an
   older one is a duplicate (ignored); a newer one means updates were lost (a gap): the
   sync starts over.

No reply for ``sync_timeout_s`` (each reply restarts it) or a malformed reply also starts
the sync over on a fresh DEALER. ``drain()`` reads whatever the SUB still holds, so a
server that takes over first applies everything the dead active managed to publish.

The BSTAR-TTL frames are in ``clonemap.shards.common.proto.bstar_ttl``.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, Protocol

import zmq

from clonemap.shards.common import zio
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards import replica_machine as rm
from clonemap.shards.byte_marks import INITIAL_MARK, MESSAGE_OVERHEAD, derive
from clonemap.shards.common.proto import bstar_ttl, chp
from clonemap.shards.common.proto.bstar import FOLLOW, UPDATES
from clonemap.shards.pending import PendingTable
from clonemap.shards.store import Store

if TYPE_CHECKING:
    from clonemap.shards.server import ShardServer

log = logging.getLogger("clonemap.shards.replica")

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


class ReplicaSink(Protocol):
    """Where a follower's copy of the active's map goes."""

    @property
    def seq(self) -> int:
        """The sequence the copy has reached (its store's)."""

    def apply(self, msg: chp.Kvpub, expiry_s: float | None) -> None:
        """One update of the active's stream, with its sequence: applied to the store
        (and logged, kept for resumes, published by a relay)."""

    def install(self, store: Store, generation: str, history: tuple[tuple[int, int], ...],
                uuids: list) -> None:
        """A whole copy: ``store`` at its sequence, the active's map ``generation`` (kept
        when it sent none), term ``history`` and applied ``uuids``."""

    def staged_ranges(self, frames: list[bytes]) -> None:
        """The active's HUGZ that names the sequences of staged updates it published
        under ``chp.STAGED_PREFIX`` (``chp.staged_ranges_hugz``): a relay publishes it on."""


class Follower:
    """Keeps a ``ReplicaSink`` a replica of the active peer's map: the I/O shell around
    ``clonemap.shards.replica_machine`` (see the module doc)."""

    def __init__(self, sink: ReplicaSink, reactor: "ShardServer", peer_host: str,
                 peer_port: int, *, shard: str, sync_timeout_s: float,
                 buffer_max: int = BUFFER_MAX, pending: PendingTable | None = None,
                 confirm: Callable[..., None] | None = None):
        self.sink = sink
        self.reactor = reactor
        """The server whose loop, context and security the follower's sockets use."""
        self.shard = shard
        self.pending = pending
        """A passive's table of writes heard from clients (``clonemap.shards.pending``): the
        active's KVPUB confirms each; emptied when a sync starts."""
        self.confirm = confirm
        """Synchronous replication (a leased pair): ``confirm(link_id, term=None)``
        writes what the link brought and says how far the replica goes (``BSTAR-HAVE``;
        ``term``: a repeat, for that term of the active); None: no link."""
        self.snapshot_endpoint = f"tcp://{peer_host}:{peer_port}"
        self.updates_endpoint = f"tcp://{peer_host}:{peer_port + 1}"
        self.sync_timeout_s = sync_timeout_s
        self.buffer_max = buffer_max
        config = reactor.config
        self.held_bytes = config.writer_held_bytes
        """Byte budget of the active's stream here: the SUB's queue (its mark in messages
        derived from it and the largest update heard, as ``clonemap.shards.byte_marks`` does for
        the collector) and, separately, the updates buffered during a sync. Counted in
        messages only, a flat-out writer of 8 KB values once took a passive to 1.2 GiB
        (100,000 queued messages) with no subscriber stalled."""
        self._largest = INITIAL_MARK
        self._buffer_bytes = 0
        self.state = rm.State(rm.Config(sync_timeout_s=sync_timeout_s,
                                        retry_s=config.heartbeat_s))
        self._sub: zio.AsyncSocket | None = None
        self._dealer: zio.AsyncSocket | None = None
        self._buffer: list[chp.Kvpub] = []
        self._building: Store | None = None
        self._uuids: list = []
        self._staged: set[bytes] = set()
        """The keys staged in the active's store (its BSTAR-TTL table's, then the staged
        updates T+1..S): the server's ``staged`` once the copy is installed."""
        """The active's applied UUIDs (BSTAR-TTL), for the installed map."""
        self._ttl_table: dict[bytes, float] = {}
        self._generation = ""
        """The active's map generation, from its TTL table (taken over at the end)."""
        self._history: tuple[tuple[int, int], ...] = ()
        """The active's term history, from its TTL table (taken over at the end)."""
        self._last_reply = 0.0
        self._now = 0.0
        self.counters = dict.fromkeys(
            ("syncs_started", "syncs_done", "sync_timeouts", "sync_retries", "gaps",
             "duplicates", "applied", "hugz", "hugz_not_serving", "ignored_while_idle",
             "ignored_while_retrying",
             "kvsync", "ttl_chunks", "pending_discarded"),
            0)
        self.last_heard = 0.0
        self._taking_over = False
        self._link: zio.AsyncSocket | None = None
        self.link_id = b""
        """Synchronous replication: the DEALER on the active's P that receives each batch
        before it is published, and confirms it (``FOLLOW``, ``UPDATES``, ``HAVE``)."""
        self.link_counters = dict.fromkeys(("links", "updates", "confirmed", "reconfirmed",
                                           "malformed"), 0)
        self._unconfirmed = False

    @property
    def phase(self) -> str:
        return self.state.phase

    # ------------------------------------------------------------------ sockets
    def open(self) -> None:
        """Connect the SUB to the active's P+1 (once, at start)."""
        sock = self.reactor.sockets.connect(
            zmq.SUB, self.updates_endpoint, ((zmq.RCVHWM, self._mark()), (zmq.SUBSCRIBE, b""),
                                             (zmq.SUBSCRIBE, chp.STAGED_PREFIX)))
        self._sub = zio.AsyncSocket(sock, self.on_update,
                                    batch=self.reactor.config.collect_batch,
                                    loop=self.reactor.loop, name="peer updates")

    def close(self) -> None:
        self._close_dealer()
        self._close_link()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _close_link(self) -> None:
        if self._link is not None:
            self._link.close(linger=0)
            self._link = None

    def _open_link(self) -> None:
        """The replica is complete: ask the active for every batch before it publishes."""
        self._close_link()
        # the active addresses the link by this name, the one its confirmations carry
        self.link_id = b"L" + os.urandom(15)
        sock = self.reactor.sockets.connect(zmq.DEALER, self.snapshot_endpoint,
                                            ((zmq.ROUTING_ID, self.link_id),))
        self._link = zio.AsyncSocket(sock, self.on_link, batch=256, loop=self.reactor.loop,
                                     name="peer link", after_batch=self._confirm)
        self._unconfirmed = False
        self.link_counters["links"] += 1
        self._link.send([FOLLOW, self.sink.seq.to_bytes(8, "big")])
        self.confirm(self.link_id)

    def on_link(self, frames: list[bytes]) -> None:
        """An update from the active (``UPDATES`` and its five KVPUB frames), sent before
        it is published: applied as its P+1 stream would be; confirmed after the read
        burst (``_confirm``)."""
        if len(frames) != 6 or frames[0] != UPDATES:
            self.link_counters["malformed"] += 1
            self.reactor.drops.drop("peer_link_malformed", f"{len(frames)} frames on the link")
            return
        self.link_counters["updates"] += 1
        link = self._link
        self.on_update(frames[1:])
        if self._link is link and self.state.phase == rm.LIVE:
            self._unconfirmed = True  # else a gap restarted the sync: nothing to confirm

    def _confirm(self) -> None:
        """After a read burst on the link: write what it brought (the log; fsync under
        always), then say how far this replica goes (``HAVE``, on this server's state
        PUB: the one channel the active reads from its configured peer only)."""
        if not self._unconfirmed or self._link is None:
            return
        self._unconfirmed = False
        self.confirm(self.link_id)
        self.link_counters["confirmed"] += 1

    def reconfirm(self, term: int) -> None:
        """Say again how far the replica goes (the pair's heartbeat), for the active's
        ``term`` it follows: a ``HAVE`` lost on its way (the active's SUB on this state
        PUB reconnecting after a stall, the PUB dropping it meanwhile) was otherwise
        repeated only by the next batch, and with no more writes the active's alone
        record stayed (seen once this server's link outlived a 2 s freeze: the link's
        batches came, their HAVE was lost). The term keeps a repeat from confirming
        anything to an active that went active again (restarted, say) before this
        replica heard of it: its map may differ at the same sequences."""
        if self.confirm is None or self._link is None or self.state.phase != rm.LIVE:
            return
        self.confirm(self.link_id, term)
        self.link_counters["reconfirmed"] += 1

    # ------------------------------------------------------------------ machine
    def _dispatch(self, event, now: float) -> None:
        self._now = now
        self.state, effects = rm.step(self.state, event, now)
        for effect in effects:
            match effect:
                case rm.OpenSync():
                    self._open_sync()
                case rm.RequestSnapshot():
                    self._building = Store()
                    self._dealer.send(chp.icanhaz(b""))
                case rm.Install(ttl_seq=ttl_seq, snap_seq=snap_seq):
                    self._install(ttl_seq, snap_seq)
                case rm.Abandon(reason=reason, timeout=timeout):
                    self.counters["sync_retries"] += 1
                    if timeout:
                        self.counters["sync_timeouts"] += 1
                    log.warning("shard %s: replica sync restarts: %s (%s)", self.shard,
                                reason, self.snapshot_endpoint)
                    self._drop_sync()
                case rm.StopFollowing(incomplete=incomplete):
                    if incomplete:
                        log.warning("shard %s: taking over before the replica was complete "
                                    "(%s)", self.shard, self.snapshot_endpoint)
                    self._drop_sync()
                case _:
                    raise TypeError(f"not a replica effect: {effect!r}")

    def _mark(self) -> int:
        return derive(self.held_bytes, self.reactor.config.collect_rcvhwm, self._largest)

    def _drop_sync(self) -> None:
        self._close_dealer()
        self._close_link()
        self._buffer = []
        self._buffer_bytes = 0
        self._building = None

    def _open_sync(self) -> None:
        self._close_dealer()
        self._close_link()
        self.counters["syncs_started"] += 1
        self._buffer = []
        self._buffer_bytes = 0
        self._building = None
        self._ttl_table = {}
        self._generation = ""
        self._history = ()
        self._uuids = []
        self._staged = set()
        if self.pending is not None:  # heard before: in the snapshot, or never taken
            self.counters["pending_discarded"] += self.pending.discard_pending()
        sock = self.reactor.sockets.connect(zmq.DEALER, self.snapshot_endpoint)
        self._dealer = zio.AsyncSocket(sock, self.on_snapshot_reply, batch=1024,
                                       loop=self.reactor.loop, name="peer snapshot")
        self._dealer.send(bstar_ttl.request())
        log.info("shard %s: synchronising from the active at %s", self.shard,
                 self.snapshot_endpoint)

    # ------------------------------------------------------------------ control
    def start_sync(self, now: float) -> None:
        """Start (or restart) a full synchronisation from the active."""
        self._dispatch(rm.StartSync(), now)

    def stop(self) -> None:
        """Stop following (this server is becoming active)."""
        self._dispatch(rm.Stop(), self.reactor.loop.time())

    def on_tick(self, now: float) -> None:
        """Called by the role's timer: deadlines and delayed retries."""
        if self.state.phase == rm.SYNCING:
            self._dispatch(rm.Tick(self._last_reply), now)

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
        """A KVPUB or HUGZ from the active's P+1 (a staged update under its prefix)."""
        reactor = self.reactor
        state = self.state
        frames = chp.unstaged(frames)
        try:
            msg = chp.decode_update(frames, reactor.config.limits)
        except ProtocolError as err:
            reactor.drops.drop("peer_" + err.reason, f"from {self.updates_endpoint}: {err}")
            return
        now = reactor.loop.time()
        if self.pending is not None and isinstance(msg, chp.Kvpub):
            # confirmed in every phase, while not following yet too (an early
            # confirmation, kept when a sync starts): its KVSET may still wait in this
            # server's collector, read only once the sync began. Held then, never
            # confirmed (its KVPUB came already), it was applied again at a takeover: a
            # second application of a write the snapshot held (a raw 12/CHP writer's
            # UUID is not in the applied table)
            self.pending.confirm(msg.uuid, now)
        if state.phase == rm.IDLE:
            self.counters["ignored_while_idle"] += 1
            return
        if not isinstance(msg, chp.Kvpub):
            self.counters["hugz"] += 1
            if msg.props.startswith(chp.STAGED_RANGES):  # (after the staged updates it names)
                self.sink.staged_ranges(frames)
                return
            info = chp.hugz_info(msg) if msg.props else None
            if info is not None and not info.serving:
                # not from an active: the peer restarted (its welcome HUGZ) and is not
                # serving. It must not count as the active's last word, or KVSETs
                # pending here would look stale at takeover and be dropped.
                self.counters["hugz_not_serving"] += 1
                return
            self.last_heard = now
            if (info is not None and state.phase == rm.LIVE and not self._taking_over
                    and info.seq > self.sink.seq):
                # the active has published past this replica: updates were lost on the
                # way (a connection dropped and made again): copy the map again rather
                # than stay behind until the next update shows the gap
                self.counters["gaps"] += 1
                log.warning("shard %s: the active's HUGZ says sequence %d, this replica has "
                            "%d: synchronising again", self.shard, info.seq,
                            self.sink.seq)
                self._dispatch(rm.Gap(self.sink.seq, info.seq), now)
            return
        self.last_heard = now
        size = len(msg.key) + len(msg.value) + len(msg.props)
        if size > self._largest:  # the queue's mark falls before it can hold more bytes
            self._largest = size
            if self._sub is not None:
                self._sub.sock.setsockopt(zmq.RCVHWM, self._mark())
        if rm.discarding(state):
            self.counters["ignored_while_retrying"] += 1
            return
        if rm.buffering(state):
            self._buffer_bytes += size + MESSAGE_OVERHEAD
            if (len(self._buffer) >= self.buffer_max
                    or (self.held_bytes and self._buffer_bytes > self.held_bytes)):
                self._dispatch(rm.BufferOverflow(self.buffer_max), now)
                return
            self._buffer.append(msg)
            return
        self._apply(msg, now)

    def _apply(self, msg: chp.Kvpub, now: float) -> bool:
        """The live rule (``replica_machine.check_seq``); False after a gap."""
        seq = self.sink.seq
        verdict = rm.check_seq(seq, msg.seq)
        if verdict == rm.DUPLICATE:
            self.counters["duplicates"] += 1
            return True
        if verdict == rm.GAP:
            self.counters["gaps"] += 1
            log.warning("shard %s: gap in the active's stream: have %d, got %d",
                        self.shard, seq, msg.seq)
            self._dispatch(rm.Gap(seq, msg.seq, self._taking_over), now)
            return False
        self.sink.apply(msg, expires_of(msg.props) if msg.value else None)
        self.counters["applied"] += 1
        return True

    # ------------------------------------------------------------------ snapshot
    def on_snapshot_reply(self, frames: list[bytes]) -> None:
        state = self.state
        if state.phase != rm.SYNCING or state.step == rm.RETRY:
            return
        reactor = self.reactor
        now = self._last_reply = reactor.loop.time()
        try:
            if frames and frames[0] == bstar_ttl.REPLY:
                chunk = bstar_ttl.decode_chunk(frames)
                self._dispatch(rm.TtlChunk(chunk.seq, chunk.last), now)
                if self.state.phase == rm.SYNCING and self.state.step != rm.RETRY:
                    self._ttl_table.update(chunk.table)
                    self._generation = chunk.generation or self._generation
                    self._history = chunk.history or self._history
                    self._uuids += chunk.uuids
                    self._staged.update(chunk.staged)
                    self.counters["ttl_chunks"] += 1
                return
            reply = chp.decode_snapshot(frames, reactor.config.limits)
        except ProtocolError as err:
            reactor.drops.drop("peer_" + err.reason, f"from {self.snapshot_endpoint}: {err}")
            self._dispatch(rm.Malformed(err.reason), now)
            return
        if isinstance(reply, chp.Kvsync):
            if not rm.accepts_snapshot(state):
                self._dispatch(rm.SnapshotItem(), now)
                return
            self.counters["kvsync"] += 1
            self._building.put(reply.key, reply.value, self._ttl_table.get(reply.key),
                               reply.seq)
            return
        self._dispatch(rm.SnapshotDone(reply.seq, [m.seq for m in self._buffer]), now)

    def _install(self, ttl_seq: int, snap_seq: int) -> None:
        """``Install(T, S)``: the snapshot is whole and T+1..S were all heard."""
        store = self._building
        uuids = self._uuids
        # keys rewritten between the TTL table (T) and the snapshot (S)
        staged = self._staged
        for m in self._buffer:
            if ttl_seq < m.seq <= snap_seq:
                if chp.is_resendable(m.uuid):
                    uuids += (m.uuid, m.seq)
                if m.props and chp.STAGED in m.props:
                    (staged.add if m.value else staged.discard)(m.key)
                value = store.get(m.key)
                if value is not None:
                    store.put(m.key, value, expires_of(m.props) if m.value else None,
                              store.mod[m.key])
        store.rebuild_ttl_index()
        store.seq = snap_seq
        later = [m for m in self._buffer if m.seq > snap_seq]
        self._buffer = []
        self._buffer_bytes = 0
        self._building = None
        self._close_dealer()
        self._uuids = []
        self._staged = set()
        self.sink.install(store, self._generation, self._history, uuids)
        self.reactor.staged = staged  # (then each staged update: ``ReplicaSink.apply``)
        self.counters["syncs_done"] += 1
        log.info("shard %s: replica synchronised: %d keys at sequence %d (%d TTL keys)",
                 self.shard, len(store), snap_seq, store.ttl_keys)
        for m in later:
            if not self._apply(m, self._now):
                return
        if self.confirm is not None:
            self._open_link()

    def stats(self) -> dict:
        return {"phase": self.phase, "buffered": len(self._buffer),
                "buffered_bytes": self._buffer_bytes, "rcvhwm": self._mark(),
                **self.counters, "link": dict(self.link_counters)}
