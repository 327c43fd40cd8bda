"""The 12/CHP shard server: a reactor that owns its ZeroMQ context and three sockets.

    P    ROUTER  snapshot:  ICANHAZ? -> KVSYNC* KTHXBAI      (ROUTER_MANDATORY: flow control)
    P+1  XPUB    publisher: KVPUB, HUGZ (and one HUGZ for each new subscription)
    P+2  SUB     collector: KVSET (subscribed to everything)

Handlers, one per event, none blocking:

* ``on_collect``: a KVSET (drained in capped batches by ``zio.AsyncSocket``) is checked,
  applied to the ``Store`` and republished as a KVPUB with the next sequence, UUID and
  properties echoed (a ``ttl`` adds ``expires=<epoch s>``; see ``store.ttl_props``).
* ``on_snapshot_request``: an ICANHAZ becomes a ``SnapshotStream`` on the server's
  ``shards.streams.StreamPump`` (or waits in its bounded queue): a point-in-time
  ``SnapshotCursor``, at most ``snapshot_chunk`` KVSYNCs per requester per loop turn,
  round-robin, then KTHXBAI. Every KVSYNC carries the cursor's sequence (the spec gives
  it no meaning; this way "the highest sequence of the KVSYNCs sent" is exactly
  KTHXBAI's). The pump's rules apply: a full pipe pauses only that requester, one that
  makes no progress for ``snapshot_stall_s`` is abandoned, one that disconnected
  (EHOSTUNREACH) is dropped; both are counted.
* ``on_ttl_tick``: a timer armed (``call_at``) for the earliest expiry in the store's heap
  deletes due keys and publishes each as a KVPUB with an empty value, empty UUID and
  empty properties.
* ``on_heartbeat``: one timer for both HUGZ rules. The *clock*: every ``clock_s`` (0.5 s
  by default; 0 disables), busy or not, a HUGZ whose properties frame carries the server
  clock, ``ts=<epoch s, 6 decimals>\\nseq=<current sequence>\\n`` (our deviation from
  12/CHP, whose HUGZ has frame 3 empty; see ``chp.hugz``): a client compares ``ts`` with
  its own clock to see how far behind the publisher it reads, even under a subtree filter
  where sequence gaps are normal. The *idle heartbeat*: every ``heartbeat_s``, a HUGZ if
  nothing else was published since the last beat (with the clock on, it carries the clock
  too). The timer runs every ``min(heartbeat_s, clock_s)``.

Malformed input anywhere is counted by ``ProtocolError.reason`` (``DropCounter``), logged
at a limited rate, and dropped. ``stats()`` returns a JSON-able dict.

Ownership: with a routing map (``ServerConfig.shard_map`` and ``shard_index``, from
``python -m shards --routing JSON --shard-index I``), a KVSET for a key this shard does not
own (``ShardMap.owner(key) != shard_index``) is dropped and counted ``not_owner``. The
answer is cached per *routing slot* in a bounded dict (``OwnerCache``): the key up to and
including the slash that ends its routing segment (``/users/`` for ``/users/42``), or the
whole key when nothing follows the segment (``/k00000001``). The hot path first asks the
store: a key it already holds was owned when it was applied (only owned keys are ever
applied, and a passive's replica is the active's store), and that lookup is the one
``Store.apply`` repeats at once on warm cache lines; only a key new to the store reads
the slot cache (and, the first time a slot is seen, the routing function). So a known key
costs no extra lookup (the README's *Client router* section has the measured figures).
Without a map (or with one shard) every key is owned and the check costs nothing.

Roles: whether this server may publish and answer snapshots is decided in one place,
``set_active``. A standalone server is active from ``start``; a Binary Star server
(``shards.pair.PairServer``) becomes active when its machine says so. A server that is not
active drops KVSETs (counted ``not_active``) and does not answer ICANHAZ (counted
``snapshots_refused``); ``admit_snapshot_request`` is where a pair treats an ICANHAZ as
the client's vote, and ``serving`` what its HUGZ say about it (``serving=0``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import psutil
import zmq
from zmq.backend import Socket as _BackendSocket

from shards import streams
from shards.applied import APPLY, DUPLICATE, AppliedUuids, decide
from shards.history import History
from shards.history import WIDTH as KVPUB_FRAMES
from shards.resume import ResumeStream
from shards.byte_marks import INITIAL_MARK, ByteMarks, derive
from shards.common import zio
from shards.common.drops import DropCounter
from shards.common.memory import give_back
from shards.common.errors import PortInUse, ProtocolError, os_error_text
from shards.common.proto import chp
from shards.common.routing import OwnerCache
from shards.common.security import Authenticator, Security
from shards.store import Store, ttl_props
from shards.server_config import (ServerConfig, collector_frame_limit, new_generation,
                                  request_frame_limit)
from shards.snapshots import SnapshotStream, largest_entry
from shards.persist.driver import PERSIST_TICK_S, Persistence
from shards.roles import Role, Standalone

log = logging.getLogger("shards.server")

SUBSCRIPTION_CHECK_S = 0.05
"""How often the publisher is checked for new subscriptions besides its FD's edges."""

_send = _BackendSocket.send
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_pack_seq = chp.pack_seq
_RESERVED = chp.RESERVED_KEYS


class ShardServer:
    """One CHP server. ``bind()`` (sync, may raise ``PortInUse``), then ``start()`` inside
    a running loop, then ``close()``."""

    def __init__(self, config: ServerConfig, role: Role | None = None):
        self.config = config
        self.role: Role = role if role is not None else Standalone()
        """What this server is for (``shards.roles``): standalone, a server of a Binary
        Star pair (``shards.pair.BinaryStar``) or a relay (``shards.relay.Relay``)."""
        self.store = Store()
        self.generation = new_generation()
        """The map's generation token, announced in every clock HUGZ (``gen=``): a map
        born empty gets a new one; a Binary Star replica takes its active's."""
        self.drops = DropCounter(log)
        self.security = Security.off()
        """CURVE keys (``--keys-dir``): set before ``bind``."""
        self._auth: Authenticator | None = None
        self.persist: Persistence | None = None
        """The data directory on this server's loop when it persists (``--data-dir``;
        ``shards.persist.driver``)."""
        self.disk_error = ""
        """Why the log could not be written (``on_disk_error``); "" while it can."""
        self.disk_failed = asyncio.Event()
        """Set on a disk error: the process stops (``Exit.DISK``)."""
        self._persist_flush: asyncio.Handle | None = None
        self._persist_timer: asyncio.TimerHandle | None = None
        self._held: list[bytes] = []
        self.parked = 0
        """Updates applied and logged whose KVPUBs wait for the passive (``park_for_peer``)."""
        """KVPUBs applied (and, when persisting, logged) but not yet published, as one flat
        list of frames (``KVPUB_FRAMES`` to a message: no tuple per update, see
        ``shards.history``): they go out in order after the collector's batch
        (``_flush_log``), right after the batch's write (and, with ``fsync: always``, its
        fsync: group commit)."""
        self.active = False
        self.ctx: zmq.Context | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._router_sock: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._collector_sock: zmq.Socket | None = None
        self._router: zio.AsyncSocket | None = None
        self._collector: zio.AsyncSocket | None = None
        self._pub_reader: zio.AsyncSocket | None = None
        self._welcome_handle: asyncio.Handle | None = None
        self._sub_check_handle: asyncio.TimerHandle | None = None
        limits = config.limits
        self._limits = limits
        self._max_key = limits.max_key
        self._max_value = limits.max_value
        self.marks = ByteMarks(
            largest_allowed=limits.max_key + limits.max_props + limits.max_value,
            max_value=limits.max_value,
            pub_budget=config.subscriber_held_bytes, pub_cap=config.pub_sndhwm,
            collect_budget=config.writer_held_bytes, collect_cap=config.collect_rcvhwm)
        self._fast_limit = self.marks.fast_limit
        self._snapshots_busy = False
        self._bind_marks: dict[str, int] = {}
        """Each bound socket's mark at ``bind`` (what libzmq gives new peers' pipes)."""
        self.heap_trims = 0
        self.snapshot_largest = 0
        """The largest key + value streamed in a snapshot so far (it only grows)."""
        self.snapshot_hwm = self._snapshot_mark()
        self.applied = AppliedUuids(config.dedup_bytes, config.dedup_s, time.monotonic())
        """UUIDs applied lately: a write sent again is applied once (``shards.applied``)."""
        self._replies: list[list[bytes]] = []
        """KVREPLYs (identity first) decided in this batch: sent after its KVPUBs."""
        self.writes = {"applied": 0, "duplicate": 0, "conflict": 0, "refused": 0,
                       "replies_unsent": 0}
        """Outcomes of writes that asked for a reply or a condition (and duplicates)."""
        self.recent = History(config.history_updates, config.history_bytes)
        """Recent updates, for resumes (reset to the store's sequence at start)."""
        self._remember = self.recent.append if config.history_updates > 0 else None
        owner_map = config.shard_map
        self.owner_cache: OwnerCache | None = None
        if owner_map is not None and (owner_map.shards > 1 or config.shard_index != 0):
            self.owner_cache = OwnerCache(owner_map, config.shard_index)
        self._owned_slots = self.owner_cache.slots if self.owner_cache else None
        self.route = (owner_map.route_of(config.shard_index) if owner_map is not None
                      else "")
        """Said in every HUGZ (``route=I/N/DIGEST``): a client routing with another map
        (a wrong config) is told at once instead of timing out on some keys."""
        # snapshots: streamed by a StreamPump (made in start(), on the loop)
        self.snapshots: streams.StreamPump | None = None
        # timers
        self._ttl_handle: asyncio.TimerHandle | None = None
        self._ttl_when: float | None = None
        self._beat_handle: asyncio.TimerHandle | None = None
        self._seq_at_beat = 0
        self._beat_at = 0.0
        self._clock_at = 0.0
        # counters
        self.started_s = time.monotonic()
        self.snapshots_refused = 0
        self.kvsync_sent = 0
        self.resume_sent = 0
        """Updates sent in resume replies (``shards.resume``), besides ``kvsync_sent``."""
        self.ttl_expired = 0
        self.hugz_sent = 0
        self.hugz_welcome = 0
        self._process = psutil.Process()
        self._gated = self.role.gates_publish
        self.role.attach(self)

    # ================================================================ set-up
    def bind(self) -> None:
        """Create the context and bind P, P+1, P+2. Raises ``PortInUse`` naming the
        endpoint that is taken (everything opened so far is closed first)."""
        cfg = self.config
        self.ctx = zmq.Context()
        self._auth = Authenticator(self.ctx, self.security)
        self.snapshot_entries(largest_entry(self.store))  # a recovered map's
        try:
            router = self.socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, self.snapshot_hwm)
            router.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self.bind_socket(router, cfg.endpoint(0))
            self._router_sock = router
            pub = self.socket(zmq.XPUB)
            pub.setsockopt(zmq.SNDHWM, self.marks.pub_hwm)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self.bind_socket(pub, cfg.endpoint(1))
            self._pub = pub
            self._publish_many = zio.publisher_many(pub, KVPUB_FRAMES)
            """``publish_many([...])``: a batch's KVPUBs in one call."""
            collector = self.socket(zmq.SUB)
            collector.setsockopt(zmq.RCVHWM, self.marks.collect_hwm)
            # a frame far beyond every limit disconnects its peer before it is buffered;
            # one moderately over a limit is read and dropped, counted (oversize_*)
            collector.setsockopt(zmq.MAXMSGSIZE, collector_frame_limit(cfg.limits))
            collector.setsockopt(zmq.SUBSCRIBE, b"")
            self.bind_socket(collector, cfg.endpoint(2))
            self._collector_sock = collector
            self._bind_marks = {"router": self.snapshot_hwm, "pub": self.marks.pub_hwm}
        except BaseException:
            self._auth.stop()
            self.ctx.destroy(linger=0)
            self.ctx = None
            raise
        try:
            self.role.bind()
        except BaseException:
            self.close()
            raise

    def socket(self, kind: int) -> zmq.Socket:
        """A socket of this server's context: linger 0, and the role's link options
        (a pair across hosts adds ZMTP heartbeats)."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.role.link_options(sock)
        return sock

    def connect(self, kind: int, endpoint: str, options: tuple = ()) -> zmq.Socket:
        """A socket (``socket``) with ``options`` (``(option, value)`` pairs, set before
        the connection makes its pipe) and the client side of this server's security,
        connected to ``endpoint``."""
        sock = self.socket(kind)
        for option, value in options:
            sock.setsockopt(option, value)
        self.security.connect_side(sock)
        sock.connect(endpoint)
        return sock

    def bind_socket(self, sock: zmq.Socket, endpoint: str) -> None:
        self.security.bind_side(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EADDRINUSE:
                raise PortInUse(f"{endpoint} is already in use", endpoint=endpoint) from None
            raise

    def start(self) -> None:
        """Attach to the running loop; a standalone server becomes active at once."""
        self.loop = loop = asyncio.get_running_loop()
        self.started_s = time.monotonic()
        self.recent.reset(self.store.seq)  # a recovered map: resumes start from here
        self._router = zio.AsyncSocket(self._router_sock, self.role.on_snapshot_request,
                                       batch=256, loop=loop, name="snapshot")
        cfg = self.config
        self.snapshots = streams.StreamPump(
            loop, self._router_sock, self._router.kick, stall_s=cfg.snapshot_stall_s,
            max_active=cfg.max_active_snapshots, max_waiting=cfg.max_waiting_snapshots,
            yield_s=cfg.snapshot_yield_s,
            name="snapshot")
        self._collector = zio.AsyncSocket(self._collector_sock, self.role.on_collect,
                                          batch=self.config.collect_batch, loop=loop,
                                          name="collector", after_batch=self._flush_log,
                                          recv_only=True)
        self._pub_reader = zio.AsyncSocket(self._pub, self.on_subscription, batch=256,
                                           loop=loop, name="publisher")
        self._sub_check_handle = loop.call_later(SUBSCRIPTION_CHECK_S,
                                                 self._check_subscriptions)
        self._beat_at = self._clock_at = loop.time()
        self._beat_handle = loop.call_later(self._beat_s, self.on_heartbeat)
        if self.persist is not None:
            self.persist.start(loop)
            self._persist_timer = loop.call_later(PERSIST_TICK_S, self._persist_tick)
        self.role.start()

    def close(self) -> None:
        """Stop timers and close every socket with linger 0. Idempotent."""
        self.role.close()
        if self.persist is not None:
            self.persist.close()  # flush and fsync: a clean stop loses nothing
            self.persist = None
        for handle in (self._beat_handle, self._ttl_handle, self._welcome_handle,
                       self._sub_check_handle, self._persist_flush, self._persist_timer):
            if handle is not None:
                handle.cancel()
        self._beat_handle = self._ttl_handle = None
        self._welcome_handle = self._sub_check_handle = None
        if self.snapshots is not None:
            self.snapshots.clear()
        for asock in (self._router, self._collector, self._pub_reader):
            if asock is not None:
                asock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None

    # ================================================================ role
    def set_active(self, active: bool) -> None:
        """The one place that decides whether this server publishes and serves snapshots."""
        if active == self.active or (active and self.disk_error):
            return
        self.active = active
        log.info("%s server on port %d is now %s", self.role.name, self.config.port,
                 "active" if active else "not active")
        if active:
            due = self.store.next_expiry() if self.role.expires_keys else None
            if due is not None and due <= time.time():
                self.on_ttl_tick()  # keys that expired while down go before any snapshot
            self._arm_ttl()
            # tell subscribers at once (a client holding on a server that said
            # serving=0 asks for its snapshot on this HUGZ), after this turn's work
            if self.loop is not None and self._welcome_handle is None:
                self._welcome_handle = self.loop.call_soon(self._send_welcome)
        elif self.snapshots is not None:
            self.snapshots.clear()

    # ================================================================ collector
    def on_collect(self, frames: list[bytes]) -> None:
        """A message on the collector: a KVSET becomes a KVPUB with the next sequence."""
        if len(frames) == 5 and self.active:
            key, seq_frame, uuid, props, value = frames
            # Fast path: a subset of what chp.decode_kvset accepts (ASCII key, no
            # properties); anything else takes the full check below.
            if (not props and len(seq_frame) == 8 and (not uuid or len(uuid) == 16)
                    and 0 < (size := len(key)) <= self._max_key
                    and size + len(value) <= self._fast_limit
                    and key.isascii() and key not in _RESERVED):
                owned = self._owned_slots
                if (owned is not None and key not in self.store.data and owned.get(
                        key if (end := key.find(b"/", 1)) < 0 else key[:end + 1]) is not True
                        and not self.owns(key)):
                    return  # counted not_owner
                if uuid and uuid[6] & 0xF0 == 0x80:  # chp.is_resendable: may come again
                    applied = self.applied
                    if uuid in applied.current or uuid in applied.previous:
                        self.writes["duplicate"] += 1  # sent again: applied once
                        return
                    seq = self.store.apply(key, value)
                    applied.add(uuid, seq)
                    if (persist := self.persist) is not None:
                        persist.append(seq, key, value, None, uuid)  # after the batch
                else:  # fire-and-forget: never sent twice, not remembered
                    seq = self.store.apply(key, value)
                    if (persist := self.persist) is not None:
                        persist.append(seq, key, value, None)  # written after the batch
                # published, and kept in the resume history, after the batch and its
                # log write (_flush_log): one burst wakes libzmq's I/O thread once,
                # where a send per update woke it per update
                self._held += key, _pack_seq(seq), uuid, b"", value
                return
        self._collect_checked(frames)

    def _note_received(self, frames: list[bytes]) -> None:
        """A message off the fast path: a larger one than any so far lowers the
        collector's mark (``shards.byte_marks``), valid or not, active or passive."""
        size = sum(map(len, frames))
        if size > self._fast_limit:
            self._lower_mark(self.marks.received(size))

    def _collect_checked(self, frames: list[bytes]) -> None:
        self._note_received(frames)
        try:
            kvset = chp.decode_kvset(frames, self._limits)
            key, value, props, uuid = kvset.key, kvset.value, kvset.props, kvset.uuid
            terms = chp.write_terms(props)
            expiry_s = None
            if value and props:
                expiry_s, props = ttl_props(props, time.time())
        except ProtocolError as err:
            self.drops.drop(err.reason, str(err))
            return
        reply_to = terms.reply_to
        if not self.active:
            self.drops.drop("not_active", "KVSET while not active")
            if reply_to:
                self._reply(reply_to, uuid, chp.REFUSED, 0, "not active")
            return
        if not self.owns(key):
            if reply_to:
                self._reply(reply_to, uuid, chp.REFUSED, 0, "this shard does not own the key")
            return
        if reply_to or terms.if_seq is not None:
            props = chp.strip_write_terms(props)
        self.apply_write(key, value, props, uuid, expiry_s, reply_to, terms.if_seq)

    def apply_write(self, key: bytes, value: bytes, props: bytes, uuid: bytes,
                    expiry_s: float | None, reply_to: bytes = b"",
                    if_seq: int | None = None) -> None:
        """A checked write of a key this shard owns (``props`` as its KVPUB will carry
        them): decided (a resend is applied once, a condition may fail), applied, logged
        and held for the batch's publish, its reply queued. The collector's slow path,
        and a Binary Star server's writes held while passive, at its takeover."""
        verdict, at = decide(self.store.mod_seq(key),
                             self.applied.get(uuid) if uuid else None, if_seq, not value)
        if verdict != APPLY:  # sent again (applied once, at ``at``), or a conflict
            self.writes[verdict] += 1
            if reply_to:
                self._reply(reply_to, uuid, chp.DUPLICATE if verdict == DUPLICATE
                            else chp.CONFLICT, at)
            return
        size = len(key) + len(props) + len(value)
        if size > self._fast_limit:
            self._lower_mark(self.marks.published(size))
        seq = self.store.apply(key, value, expiry_s)
        self._log_and_publish(seq, key, uuid, props, value, expiry_s)
        if reply_to:
            self.writes["applied"] += 1
            self._reply(reply_to, uuid, chp.APPLIED, seq)
        if expiry_s is not None:
            self._arm_ttl()

    def _reply(self, identity: bytes, uuid: bytes, outcome: bytes, seq: int,
               detail: str = "") -> None:
        """Queue a KVREPLY for the writer's DEALER: sent by ``_flush_log``, after the
        batch's write (and fsync) and its KVPUBs, so an applied reply is never ahead of
        the update it reports."""
        if outcome == chp.REFUSED:
            self.writes["refused"] += 1
        self._replies.append([identity, *chp.kvreply(uuid, outcome, seq, detail)])
        if self._persist_flush is None and self.loop is not None:
            self._persist_flush = self.loop.call_soon(self._flush_log)

    def _send_replies(self) -> None:
        replies, self._replies = self._replies, []
        sock = self._router_sock
        for frames in replies:
            try:
                zio.send_frames(sock, frames)
            except zmq.ZMQError:  # the writer's DEALER is not (or no longer) connected
                self.writes["replies_unsent"] += 1

    def _snapshot_mark(self) -> int:
        """The snapshot ROUTER's mark in messages: a requester's share of
        ``snapshot_held_bytes`` over the largest entry streamed so far."""
        cfg = self.config
        share = cfg.snapshot_held_bytes // (cfg.max_active_snapshots + streams.MAX_STALLED)
        return derive(share, cfg.snapshot_sndhwm,
                      max(self.snapshot_largest, INITIAL_MARK))

    def snapshot_entries(self, biggest: int) -> None:
        """Entries of up to ``biggest`` bytes may be streamed from now on (a recovered or
        installed map, a snapshot's next chunk before it is queued):
        lower the ROUTER's mark if they are the largest yet, so that each requester's
        queue stays within its share. libzmq applies it to the pipes that exist; a pipe
        made later gets the bind-time mark (``shards.byte_marks``), so each stream sets
        it again before its first entry (``reapply_marks``)."""
        if biggest <= self.snapshot_largest:
            return
        self.snapshot_largest = biggest
        hwm = self._snapshot_mark()
        if hwm != self.snapshot_hwm:
            self.snapshot_hwm = hwm
            if self._router_sock is not None:
                self._router_sock.setsockopt(zmq.SNDHWM, hwm)

    def reapply_marks(self, which: str) -> None:
        """Set a lowered ``SNDHWM`` again (``which``: "pub" or "router"), so that it
        reaches the pipes of peers that connected since it was lowered (they got the
        bind-time mark: ``shards.byte_marks``). A no-op while the mark is still the
        bind-time one; otherwise one ``setsockopt`` (libzmq walks the socket's pipes).
        Called when the publisher welcomes new subscriptions (once a loop turn) and when
        a snapshot stream is about to send its first entry."""
        if which == "pub":
            sock, current = self._pub, self.marks.pub_hwm
        else:
            sock, current = self._router_sock, self.snapshot_hwm
        if sock is not None and current != self._bind_marks.get(which):
            sock.setsockopt(zmq.SNDHWM, current)

    def _give_back_after_snapshots(self) -> None:
        """Once the last snapshot stream has ended, give the heap's free pages back to
        the OS (``memory.give_back``): the frames of a flood of never-reading requesters
        (or of many joins) are freed small blocks that the process would keep."""
        pump = self.snapshots
        if pump is None:
            return
        busy = bool(pump.active or pump.waiting)
        if self._snapshots_busy and not busy:
            give_back()
            self.heap_trims += 1
        self._snapshots_busy = busy

    def _lower_mark(self, which: str | None) -> None:
        """A message larger than any so far was read or is about to be published: the
        marks fell (``shards.byte_marks``), so that a subscriber that reads nothing, or
        a writer, pins at most its byte budget. ``which``: the socket to tell, or None."""
        marks = self.marks
        self._fast_limit = marks.fast_limit
        # (not the snapshot ROUTER's mark here: setting it in the middle of a collector
        # batch left a subscriber's updates undelivered 3 times in 15 runs of
        # test_binary_values_round_trip_byte_exact; a snapshot lowers it itself, before
        # a larger entry is queued)
        if which == "pub" and self._pub is not None:
            self._pub.setsockopt(zmq.SNDHWM, marks.pub_hwm)
        elif which == "collect" and self._collector_sock is not None:
            self._collector_sock.setsockopt(zmq.RCVHWM, marks.collect_hwm)

    def _log_and_publish(self, seq: int, key: bytes, uuid: bytes, props: bytes, value: bytes,
                         expiry_s: float | None) -> None:
        """Hold one applied update's KVPUB for ``_flush_log`` (after the collector's batch,
        or at the end of the caller's work), logging it first when the server persists:
        a KVPUB, and so an acknowledgement, never goes out before its update reached the
        OS, and every KVPUB goes out in sequence order through the one burst. A UUID
        that marks a write its client may send again is remembered and logged."""
        kept = uuid if chp.is_resendable(uuid) else b""
        if kept:
            self.applied.add(kept, seq)
        if self.persist is not None:
            self.log_applied(seq, key, value, expiry_s, kept)
        self._held += key, _pack_seq(seq), uuid, props, value

    def publish(self, seq: int, key: bytes, uuid: bytes, props: bytes, value: bytes) -> None:
        """Publish an update applied elsewhere with its own sequence (a relay's copy of
        its shard), now, and keep it for resumes."""
        size = len(key) + len(props) + len(value)
        if size > self._fast_limit:
            self._lower_mark(self.marks.published(size))
        if self._remember is not None:
            self._remember(seq, key, uuid, props, value)
        zio.send_frames5(self._pub, key, _pack_seq(seq), uuid, props, value)

    def log_applied(self, seq: int, key: bytes, value: bytes, expiry_s: float | None,
                    uuid: bytes = b"") -> None:
        """Append one applied update to the data directory; the batch is written at the
        end of the loop turn (``_flush_log``)."""
        self.persist.append(seq, key, value, expiry_s, uuid)
        if self._persist_flush is None and self.loop is not None:
            self._persist_flush = self.loop.call_soon(self._flush_log)

    def _flush_log(self) -> None:
        """Write the batch's records (fsync with ``always``), then publish what was held
        for that write, in sequence order. Runs after every collector batch, and at the
        end of a loop turn that logged outside one."""
        if self._persist_flush is not None:
            self._persist_flush.cancel()
        self._persist_flush = None
        if self.persist is not None and not self.persist.flush():
            self._replies = []  # nothing held is published: never acknowledged
            return
        if self._gated and (self._held or self._replies):
            role = self.role
            if role.fenced():
                return  # held: out if the lease is renewed in time, else parked with the map
            if role.park_for_peer():
                return  # out once the passive holds it (a pair across hosts, shards.pair)
        if self._held:
            held, self._held = self._held, []
            self._publish_many(held)  # key, seq, uuid, props, value, key, ...: in order
            if self._remember is not None:
                self.recent.extend(held)  # the list itself: no copy
        if self._replies:
            self._send_replies()

    # ================================================================ durability
    def attach_persist(self, data_dir) -> None:
        """Log every applied update in ``data_dir`` (a ``shards.persist.DataDir``, already
        opened after the recovered sequence) from now on."""
        self.persist = Persistence(
            data_dir, flush_held=self._flush_log,
            snapshot_of=lambda: (self.store, self.applied.items_upto(self.store.seq)),
            on_disk_error=self.on_disk_error,
            on_compacted=getattr(self.role, "on_compacted", None) or (lambda job: None))

    def on_disk_error(self, what: str, exc: OSError) -> None:
        """The log could not be written or fsynced: a state, not a log line. The server
        stops at once: it acknowledges nothing more (what it holds was never published),
        answers no snapshot (its map may hold updates that are not on disk), and sets
        ``disk_failed``: ``python -m shards`` then exits with ``Exit.DISK``, its peer
        serves, and the supervisor restarts it, recovering from what is on disk, until
        the disk works again."""
        if self.disk_error:
            return
        where = self.persist.path if self.persist is not None else "?"
        self.disk_error = f"{os_error_text(exc)} ({what} in {where})"
        self.active = False  # directly: no snapshot, no KVPUB, no TTL from now on
        if self.snapshots is not None:
            self.snapshots.clear()
        log.critical("disk error: %s; this server stops so that its peer serves",
                     self.disk_error)
        self.disk_failed.set()

    def _persist_tick(self) -> None:
        """Every ``PERSIST_TICK_S``: the data directory's turn (everysec fsync,
        compactions: ``shards.persist.driver``)."""
        self._persist_timer = self.loop.call_later(PERSIST_TICK_S, self._persist_tick)
        if self.persist is not None:
            self.persist.tick()

    def owns(self, key: bytes) -> bool:
        """Whether this shard owns ``key``; if not, the drop is counted ``not_owner``."""
        cache = self.owner_cache
        if cache is None or cache.owns(key):
            return True
        self.drops.drop("not_owner", f"key {key[:64]!r} belongs to shard "
                                     f"{cache.shard_map.owner(key)}, not {cache.index}")
        return False

    # ================================================================ TTL
    def _arm_ttl(self) -> None:
        """(Re)arm the TTL timer for the earliest expiry, if that is sooner than armed (a
        role whose keys expire upstream, a relay's, runs none)."""
        if not self.role.expires_keys:
            return
        expiry_s = self.store.next_expiry()
        if expiry_s is None or self.loop is None:
            return
        when = self.loop.time() + max(0.0, expiry_s - time.time())
        if self._ttl_handle is not None:
            if self._ttl_when is not None and self._ttl_when <= when:
                return
            self._ttl_handle.cancel()
        self._ttl_when = when
        self._ttl_handle = self.loop.call_at(when, self.on_ttl_tick)

    def on_ttl_tick(self) -> None:
        """Delete every due key and publish each delete (empty value, UUID, properties)."""
        self._ttl_handle = None
        self._ttl_when = None
        if not self.active:
            return
        for key, seq in self.store.pop_expired(time.time()):
            if len(key) > self._fast_limit:  # a key recovered from disk, never published
                self._lower_mark(self.marks.published(len(key)))
            self._log_and_publish(seq, key, b"", b"", b"", None)
            self.ttl_expired += 1
        self._flush_log()  # the deletes go out now, in one burst
        self._arm_ttl()

    # ================================================================ heartbeat
    def on_subscription(self, frames: list[bytes]) -> None:
        """A (un)subscription on the publisher (XPUB, verbose). Each new subscription is
        answered with one HUGZ (coalesced per loop turn): a client's SUB knows its
        subscription is live when a message arrives, and asks for its snapshot only then.
        Without it, a snapshot point taken before the publisher applied the subscription
        would lose the updates published in between (12/CHP's "slow joiner" gap). Sent
        in every role: a server that would not answer an ICANHAZ now says so in it
        (``serving=0``), and the client asks the other server of its pair at once."""
        if frames[0][:1] == b"\x01" and self._welcome_handle is None:
            self._welcome_handle = self.loop.call_soon(self._send_welcome)

    def _check_subscriptions(self) -> None:
        """The hot path sends on the publisher directly, which can consume the edge of
        its FD: look for unread subscriptions every SUBSCRIPTION_CHECK_S as well."""
        self._sub_check_handle = self.loop.call_later(SUBSCRIPTION_CHECK_S,
                                                      self._check_subscriptions)
        self._pub_reader.kick()

    def _hugz(self) -> list[bytes]:
        """A HUGZ with the server clock and the map's generation when ``clock_s`` is on,
        else a plain one; either says ``serving=0`` when this server would not answer an
        ICANHAZ now. Its sequence is the last *published* one (updates held for an fsync
        are not announced before they go out)."""
        serving = self.role.serving()
        if self.config.clock_s > 0:
            published = self.store.seq - len(self._held) // KVPUB_FRAMES - self.parked
            return chp.hugz(time.time(), published, serving=serving,
                            generation=self.generation, route=self.route,
                            cas=self.role.decides_writes)
        return chp.hugz(serving=serving, route=self.route)

    @property
    def _beat_s(self) -> float:
        clock_s = self.config.clock_s
        heartbeat_s = self.config.heartbeat_s
        return min(heartbeat_s, clock_s) if clock_s > 0 else heartbeat_s

    def _send_welcome(self) -> None:
        self._welcome_handle = None
        self.reapply_marks("pub")  # the new subscriber's pipe has the bind-time mark
        try:
            zio.send_frames5(self._pub, *self._hugz())
        except zmq.ZMQError as exc:
            self.drops.drop("welcome_unsent", f"HUGZ for a new subscriber: {exc}")
            return
        self.hugz_welcome += 1

    def on_heartbeat(self) -> None:
        """Every ``min(heartbeat_s, clock_s)``: a clock HUGZ when ``clock_s`` is due (busy
        or not), else a HUGZ if nothing was published for ``heartbeat_s``; also re-arms
        the TTL timer (a wall-clock step could have moved the earliest expiry)."""
        loop = self.loop
        config = self.config
        self._beat_handle = loop.call_later(self._beat_s, self.on_heartbeat)
        self._give_back_after_snapshots()
        self.applied.tick(time.monotonic())
        if not self.active:
            return
        now = loop.time()
        # a margin of a tenth of the interval: timers fire a little early or late
        clock_due = (config.clock_s > 0
                     and now - self._clock_at >= 0.9 * config.clock_s)
        beat_due = now - self._beat_at >= 0.9 * config.heartbeat_s
        idle = beat_due and self.store.seq == self._seq_at_beat
        if clock_due or idle:
            zio.send_frames5(self._pub, *self._hugz())
            self.hugz_sent += 1
            self._clock_at = now
        if beat_due:
            self._seq_at_beat = self.store.seq
            self._beat_at = now
        self._arm_ttl()

    # ================================================================ snapshots
    def on_snapshot_request(self, frames: list[bytes]) -> None:
        """An ICANHAZ on the ROUTER: queue a snapshot for this peer."""
        if self._held:  # a snapshot point must not show what is not on disk yet
            self._flush_log()
        identity = frames[0]
        try:
            request = chp.decode_icanhaz(frames[1:], self._limits)
        except ProtocolError as err:
            self.drops.drop(err.reason, str(err))
            return
        if self.disk_error or not self.role.admit_snapshot_request():
            self.snapshots_refused += 1
            return
        make = lambda: SnapshotStream(self, identity, request.subtree,  # noqa: E731
                                      meta=request.meta)
        if request.since is not None:
            make = self._resume_or_snapshot(identity, request)
        if not self.snapshots.add(identity, make):
            self.drops.drop("snapshot_queue_full", f"{len(self.snapshots.waiting)} "
                                                   "requests wait")

    def _resume_or_snapshot(self, identity: bytes, request: chp.Icanhaz):
        """A resume request (``since``): the updates after it when this server's history
        covers them for the client's map generation, else a full snapshot that says
        ``resume=0``. Decided when the request is taken, at the current sequence."""
        entries = None
        if not request.generation or request.generation == self.generation:
            entries = self.recent.since(request.since, request.subtree)
        if entries is None:
            return lambda: SnapshotStream(self, identity, request.subtree,
                                          chp.FULL_AFTER_RESUME, request.meta)
        seq = self.store.seq
        return lambda: ResumeStream(self, identity, request.subtree, entries, seq)

    # ================================================================ stats
    def stats(self) -> dict:
        """Counters for the control plane (JSON-able)."""
        store = self.store
        pump = self.snapshots
        drops = dict(self.drops.counts)
        out = {
            "role": self.role.name,
            "active": self.active,
            "pid": os.getpid(),
            "port": self.config.port,
            "host": self.config.host,
            "seq": store.seq,
            "generation": self.generation,
            "keys": len(store),
            "updates": store.seq - self.ttl_expired,
            "ttl_keys": store.ttl_keys,
            "ttl_expired": self.ttl_expired,
            "writes": dict(self.writes),
            "applied_uuids": len(self.applied),
            "applied_uuids_window": [self.applied.half, self.applied.max_age_s / 2],
            "snapshots_served": pump.counters["done"] if pump is not None else 0,
            "snapshots_active": len(pump.active) if pump is not None else 0,
            "snapshots_waiting": len(pump.waiting) if pump is not None else 0,
            "snapshots_abandoned": pump.counters["abandoned"] if pump is not None else 0,
            "snapshots_unreachable": pump.counters["unreachable"] if pump is not None else 0,
            "snapshots_yielded": pump.counters["yielded"] if pump is not None else 0,
            "snapshots_stalled": pump.stalled if pump is not None else 0,
            "snapshots_refused": self.snapshots_refused,
            "kvsync_sent": self.kvsync_sent,
            "resume_sent": self.resume_sent,
            "hugz_sent": self.hugz_sent,
            "hugz_welcome": self.hugz_welcome,
            "recent": self.recent.stats(),
            "pub_hwm": self.marks.pub_hwm,
            "snapshot_hwm": self.snapshot_hwm,
            "heap_trims": self.heap_trims,
            "collect_hwm": self.marks.collect_hwm,
            "largest_published_bytes": self.marks.pub_mark,
            "largest_received_bytes": self.marks.collect_mark,
            "routing": (None if self.config.shard_map is None else
                        {"shard_index": self.config.shard_index,
                         "shards": self.config.shard_map.shards,
                         "owner_slots": len(self.owner_cache.slots)
                         if self.owner_cache else 0}),
            "drops": drops,
            "drops_total": sum(drops.values()),
            "persist": self.persist.stats() if self.persist is not None else None,
            "disk_error": self.disk_error,
            "handler_errors": sum(a.errors for a in (self._router, self._collector)
                                  if a is not None),
            "rss_bytes": self._process.memory_info().rss,
            "uptime_s": round(time.monotonic() - self.started_s, 3),
            "frame_path": zio.FRAME_PATH,
        }
        out.update(self.role.stats())
        return out
