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
from dataclasses import dataclass, field
from itertools import repeat

import psutil
import zmq
from zmq.backend import Socket as _BackendSocket

from shards import streams
from shards.applied import APPLY, DUPLICATE, AppliedUuids, decide
from shards.history import MAX_BYTES as HISTORY_BYTES, MAX_UPDATES as HISTORY_UPDATES, History
from shards.history import WIDTH as KVPUB_FRAMES
from shards.resume import ResumeStream
from shards.byte_marks import (INITIAL_MARK, SUBSCRIBER_HELD_BYTES, WRITER_HELD_BYTES,
                               ByteMarks, derive)
from shards.common import zio
from shards.common.drops import DropCounter
from shards.common.memory import give_back
from shards.common.errors import PortInUse, ProtocolError, os_error_text
from shards.common.proto import chp
from shards.common.routing import OwnerCache, ShardMap
from shards.common.security import Authenticator, Security
from shards.store import Store, ttl_props
from shards.common.timing import HEARTBEAT_S

log = logging.getLogger("shards.server")

CLOCK_S = 0.5
"""A HUGZ carrying the server clock (ts, seq) at least this often, busy or idle."""
SNAPSHOT_CHUNK = 256
"""KVSYNCs sent to one requester per loop turn (between two collector batches)."""
SNAPSHOT_STALL_S = 30.0
"""A requester that accepts nothing for this long is abandoned."""
MAX_ACTIVE_SNAPSHOTS = 16
"""Cursors streamed at once (each holds a copy of the key list); more requests wait."""
MAX_WAITING_SNAPSHOTS = 1024
COLLECT_BATCH = 512
SUBSCRIPTION_CHECK_S = 0.05
"""How often the publisher is checked for new subscriptions besides its FD's edges."""
PERSIST_TICK_S = 0.25
"""How often a persisting server checks its everysec fsync and whether to compact."""
COMPACT_PACE_S = 0.001
"""Pause between two chunks of a compaction: the snapshot takes at most about a quarter
of the reactor's time (256 keys, ~0.3 ms, per 1.3 ms), so a compaction under full load
costs clients little latency (``python -m bench durability``)."""
PUB_SNDHWM = 100_000
COLLECT_RCVHWM = 100_000
SNAPSHOT_SNDHWM = 10_000
SNAPSHOT_HELD_BYTES = 64 << 20
"""Default of ``ServerConfig.snapshot_held_bytes``: 2 MiB per requester at 16 + 16
streams."""

_send = _BackendSocket.send
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_pack_seq = chp.pack_seq
_RESERVED = chp.RESERVED_KEYS


def _entry_size(item: tuple) -> int:
    return len(item[0]) + len(item[1])


def largest_entry(store: Store) -> int:
    """The largest key + value in ``store`` (one pass: ~5 ms per 100,000 keys)."""
    data = store.data
    if not data:
        return 0
    return max(map(len, data)) + max(map(len, data.values()))


def request_frame_limit(limits: chp.Limits) -> int:
    """``ZMQ_MAXMSGSIZE`` of the sockets whose peers only ask (the snapshot ROUTER's
    ICANHAZ and BSTAR-TTL?, the publisher's subscriptions): the largest subtree or
    properties frame the limits allow, plus 1 KiB. A larger frame disconnects its peer
    before libzmq buffers it (four 64 MiB subscription frames once took a server to
    3 GiB)."""
    return max(limits.max_subtree, limits.max_props) + 1024


def collector_frame_limit(limits: chp.Limits) -> int:
    """The collector's ``ZMQ_MAXMSGSIZE`` (libzmq checks it per frame): twice the largest
    frame the limits allow, plus 64 KiB."""
    return 2 * max(limits.max_key, limits.max_value, limits.max_props) + (64 << 10)


def new_generation() -> str:
    """A fresh generation token: 16 hex digits, random (a restart draws a new one)."""
    return os.urandom(8).hex()


DEDUP_BYTES = 16 << 20
DEDUP_S = 120.0


@dataclass(frozen=True)
class ServerConfig:
    port: int
    host: str = "127.0.0.1"
    heartbeat_s: float = HEARTBEAT_S
    clock_s: float = CLOCK_S
    """Interval of the clock HUGZ (sent even when busy); 0 disables it."""
    limits: chp.Limits = field(default_factory=chp.Limits)
    snapshot_chunk: int = SNAPSHOT_CHUNK
    snapshot_stall_s: float = SNAPSHOT_STALL_S
    snapshot_yield_s: float = streams.YIELD_S
    """A requester that accepted nothing this long while others wait yields its slot."""
    max_active_snapshots: int = MAX_ACTIVE_SNAPSHOTS
    max_waiting_snapshots: int = MAX_WAITING_SNAPSHOTS
    collect_batch: int = COLLECT_BATCH
    pub_sndhwm: int = PUB_SNDHWM
    subscriber_held_bytes: int = SUBSCRIBER_HELD_BYTES
    """Bytes one never-reading subscriber may pin: the publisher's mark in messages is
    derived from it and the largest message so far (``shards.byte_marks``); 0: off."""
    writer_held_bytes: int = WRITER_HELD_BYTES
    """The same for what one writer's queued KVSETs may pin in the collector."""
    history_updates: int = HISTORY_UPDATES
    """Recent updates kept for resumes (``shards.history``); 0: none."""
    history_bytes: int = HISTORY_BYTES
    collect_rcvhwm: int = COLLECT_RCVHWM
    snapshot_sndhwm: int = SNAPSHOT_SNDHWM
    snapshot_held_bytes: int = SNAPSHOT_HELD_BYTES
    """Bytes all snapshot streams together may queue in libzmq; each of the streams that
    may be open at once (``max_active_snapshots`` + ``streams.MAX_STALLED``) gets an
    equal share: its ROUTER pipe's mark in messages is derived from it and the largest
    entry streamed so far; 0: off."""
    shard_map: ShardMap | None = None
    """The cluster's routing; None: this server owns every key (standalone use)."""
    shard_index: int = 0
    dedup_bytes: int = DEDUP_BYTES
    """The table of applied UUIDs (``shards.applied``): its size in bytes ..."""
    dedup_s: float = DEDUP_S
    """... and its age: a resend is recognised for at least half of each."""

    def __post_init__(self) -> None:
        if self.shard_map is not None and not 0 <= self.shard_index < self.shard_map.shards:
            raise ValueError(f"shard index {self.shard_index} is not in "
                             f"0..{self.shard_map.shards - 1}")

    def endpoint(self, offset: int) -> str:
        return f"tcp://{self.host}:{self.port + offset}"


class SnapshotStream:
    """One snapshot being streamed to one ROUTER peer (a ``shards.streams`` stream):
    KVSYNCs from a point-in-time cursor, ``chunk`` per turn, then KTHXBAI."""

    __slots__ = ("identity", "subtree", "cursor", "seq_frame", "pending", "pos", "chunk",
                 "sent", "server", "kthxbai_props", "meta")

    def __init__(self, server: "ShardServer", identity: bytes, subtree: bytes,
                 kthxbai_props: bytes = b"", meta: bool = False):
        self.kthxbai_props = kthxbai_props
        """Empty (12/CHP); ``resume=0`` when a resume was asked and not possible."""
        self.server = server
        self.identity = identity
        self.subtree = subtree
        self.meta = meta
        """The requester asked ``meta=1``: a TTL key's KVSYNC says ``expires=``."""
        self.cursor = server.store.open_snapshot(subtree, with_expiry=meta)
        self.seq_frame = _pack_seq(self.cursor.seq)
        self.pending: list[tuple[bytes, bytes]] = []
        self.pos = 0
        self.chunk = server.config.snapshot_chunk
        self.sent = 0

    def close(self) -> None:
        self.cursor.close()

    def send_some(self, sock: zmq.Socket) -> str:
        """Up to ``chunk`` KVSYNCs (then KTHXBAI); EHOSTUNREACH goes to the pump."""
        identity, seq_frame, cursor = self.identity, self.seq_frame, self.cursor
        meta = self.meta
        budget = self.chunk
        pending, pos = self.pending, self.pos
        sent = fetched = 0
        outcome = streams.BLOCKED
        send, more, last, empty = _send, _MORE, _NOBLOCK, b""
        i = pos
        try:
            while sent < budget:
                if pos >= len(pending):
                    if cursor.done:
                        _send(sock, identity, _MORE)
                        zio.send_frames5(sock, chp.KTHXBAI, seq_frame, b"",
                                         self.kthxbai_props, self.subtree)
                        outcome = streams.DONE
                        break
                    if fetched >= 8:  # a sparse subtree: examined enough keys this turn
                        outcome = streams.PROGRESS
                        break
                    keys, values, mods, expiries = cursor.next_columns(budget * 4, meta)
                    props = repeat(b"") if expiries is None else [
                        b"" if e is None else b"expires=%.3f\n" % e for e in expiries]
                    pending = list(zip(keys, values, map(_pack_seq, mods), props))
                    if pending:  # before any of them is queued: the byte bound holds
                        self.server.snapshot_entries(max(map(_entry_size, pending)))
                        if not self.sent:  # this peer's pipe may have the bind-time mark
                            self.server.reapply_marks("router")
                    pos = i = 0
                    fetched += 1
                    continue
                stop = min(len(pending), pos + budget - sent)
                while i < stop:  # the hot loop: one KVSYNC per turn, nothing else
                    key, value, seq, props = pending[i]  # seq: the key's own
                    send(sock, identity, more)  # Again / EHOSTUNREACH come only from here
                    send(sock, key, more)
                    send(sock, seq, more)
                    send(sock, empty, more)
                    send(sock, props, more)
                    send(sock, value, last)
                    i += 1
                sent += i - pos
                pos = i
        except zmq.Again:
            sent += i - pos
            pos = i
        finally:
            self.pending, self.pos = pending, pos
            self.sent += sent
            self.server.kvsync_sent += sent
        if outcome == streams.DONE:
            log.debug("snapshot of %d keys under %r at seq %d sent to %r", self.sent,
                      self.subtree, cursor.seq, identity)
            return outcome
        return streams.PROGRESS if (sent or fetched) else outcome


class ShardServer:
    """One CHP server. ``bind()`` (sync, may raise ``PortInUse``), then ``start()`` inside
    a running loop, then ``close()``."""

    DECIDES_WRITES = True
    """Says ``cas=1`` in its clock HUGZ: decides conditional writes and answers
    ``reply=`` (``--clock-s 0`` keeps every HUGZ plain 12/CHP, and so says nothing)."""

    def __init__(self, config: ServerConfig, *, role: str = "standalone"):
        self.config = config
        self.role = role
        self.store = Store()
        self.generation = new_generation()
        """The map's generation token, announced in every clock HUGZ (``gen=``): a map
        born empty gets a new one; a Binary Star replica takes its active's."""
        self.drops = DropCounter(log)
        self.security = Security.off()
        """CURVE keys (``--keys-dir``): set before ``bind``."""
        self._auth: Authenticator | None = None
        self.persist = None
        """A ``shards.persist.DataDir`` when the server persists (``--data-dir``)."""
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

    # ================================================================ set-up
    def bind(self) -> None:
        """Create the context and bind P, P+1, P+2. Raises ``PortInUse`` naming the
        endpoint that is taken (everything opened so far is closed first)."""
        cfg = self.config
        self.ctx = zmq.Context()
        self._auth = Authenticator(self.ctx, self.security)
        self.snapshot_entries(largest_entry(self.store))  # a recovered map's
        try:
            router = self._socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, self.snapshot_hwm)
            router.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self._bind(router, cfg.endpoint(0))
            self._router_sock = router
            pub = self._socket(zmq.XPUB)
            pub.setsockopt(zmq.SNDHWM, self.marks.pub_hwm)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            pub.setsockopt(zmq.MAXMSGSIZE, request_frame_limit(cfg.limits))
            self._bind(pub, cfg.endpoint(1))
            self._pub = pub
            self._publish_many = zio.publisher_many(pub, KVPUB_FRAMES)
            """``publish_many([...])``: a batch's KVPUBs in one call."""
            collector = self._socket(zmq.SUB)
            collector.setsockopt(zmq.RCVHWM, self.marks.collect_hwm)
            # a frame far beyond every limit disconnects its peer before it is buffered;
            # one moderately over a limit is read and dropped, counted (oversize_*)
            collector.setsockopt(zmq.MAXMSGSIZE, collector_frame_limit(cfg.limits))
            collector.setsockopt(zmq.SUBSCRIBE, b"")
            self._bind(collector, cfg.endpoint(2))
            self._collector_sock = collector
            self._bind_marks = {"router": self.snapshot_hwm, "pub": self.marks.pub_hwm}
        except BaseException:
            self._auth.stop()
            self.ctx.destroy(linger=0)
            self.ctx = None
            raise

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.link_options(sock)
        return sock

    def link_options(self, sock: zmq.Socket) -> None:
        """Options of every socket this server makes (a pair across hosts adds ZMTP
        heartbeats: ``shards.pair``)."""

    def _bind(self, sock: zmq.Socket, endpoint: str) -> None:
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
        self._router = zio.AsyncSocket(self._router_sock, self.on_snapshot_request,
                                       batch=256, loop=loop, name="snapshot")
        cfg = self.config
        self.snapshots = streams.StreamPump(
            loop, self._router_sock, self._router.kick, stall_s=cfg.snapshot_stall_s,
            max_active=cfg.max_active_snapshots, max_waiting=cfg.max_waiting_snapshots,
            yield_s=cfg.snapshot_yield_s,
            name="snapshot")
        self._collector = zio.AsyncSocket(self._collector_sock, self.on_collect,
                                          batch=self.config.collect_batch, loop=loop,
                                          name="collector", after_batch=self._flush_log,
                                          recv_only=True)
        self._pub_reader = zio.AsyncSocket(self._pub, self.on_subscription, batch=256,
                                           loop=loop, name="publisher")
        self._sub_check_handle = loop.call_later(SUBSCRIPTION_CHECK_S,
                                                 self._check_subscriptions)
        self._beat_at = self._clock_at = loop.time()
        self._beat_handle = loop.call_later(self._beat_s, self.on_heartbeat)
        self._persist_timer = loop.call_later(PERSIST_TICK_S, self._persist_tick)
        if self.role == "standalone":
            self.set_active(True)

    def close(self) -> None:
        """Stop timers and close every socket with linger 0. Idempotent."""
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
        log.info("%s server on port %d is now %s", self.role, self.config.port,
                 "active" if active else "not active")
        if active:
            due = self.store.next_expiry()
            if due is not None and due <= time.time():
                self.on_ttl_tick()  # keys that expired while down go before any snapshot
            self._arm_ttl()
            # tell subscribers at once (a client holding on a server that said
            # serving=0 asks for its snapshot on this HUGZ), after this turn's work
            if self.loop is not None and self._welcome_handle is None:
                self._welcome_handle = self.loop.call_soon(self._send_welcome)
        elif self.snapshots is not None:
            self.snapshots.clear()

    def park_for_peer(self) -> bool:
        """Whether this batch's KVPUBs and replies wait for the passive's confirmation
        (``shards.pair``, synchronous replication); it then owns them."""
        return False

    def fenced(self) -> bool:
        """Whether acknowledging is forbidden now (a pair whose lease ran out, see
        ``shards.pair``): asked once per batch, before anything is published."""
        return False

    def admit_snapshot_request(self) -> bool:
        """Whether an ICANHAZ is answered now (a Binary Star role adds the client vote)."""
        return self.active

    def serving(self) -> bool:
        """Whether an ICANHAZ would be answered now, without acting on it (no vote): a
        HUGZ from a server that would not says ``serving=0``, so a client asks the other
        server of its pair at once."""
        return self.active

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
        verdict, at = decide(self.store.mod_seq(key),
                             self.applied.get(uuid) if uuid else None, terms.if_seq,
                             not value)
        if verdict != APPLY:  # sent again (applied once, at ``at``), or a conflict
            self.writes[verdict] += 1
            if reply_to:
                self._reply(reply_to, uuid, chp.DUPLICATE if verdict == DUPLICATE
                            else chp.CONFLICT, at)
            return
        if reply_to or terms.if_seq is not None:
            props = chp.strip_write_terms(props)
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
        if self.persist is not None:
            try:
                self.persist.flush()
            except OSError as exc:  # nothing held is published: never acknowledged
                self._replies = []
                self.on_disk_error("writing the log", exc)
                return
        if (self._held or self._replies) and self.fenced():
            return  # held: out if the lease is renewed in time, else parked with the map
        if (self._held or self._replies) and self.park_for_peer():
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
        self.persist = data_dir

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
        """Every ``PERSIST_TICK_S``: the everysec fsync, and a compaction when due."""
        self._persist_timer = self.loop.call_later(PERSIST_TICK_S, self._persist_tick)
        persist = self.persist
        if persist is None or self.disk_error:
            return
        try:
            persist.tick()
        except OSError as exc:  # a failed fsync (here or on the background thread)
            self.on_disk_error("fsync of the log", exc)
            return
        if persist.compaction_due():
            self._flush_log()
            try:
                job = persist.start_compaction(self.store,
                                               self.applied.items_upto(self.store.seq))
            except OSError:
                return  # counted and logged by the data directory; it tries again later
            self.drive_compaction(job)

    def drive_compaction(self, job) -> None:
        """Write ``job``'s snapshot a chunk at a time (``COMPACT_PACE_S`` apart), then
        fsync and rename it off the loop thread, and delete what it covers."""
        log.info("compaction: writing the snapshot at sequence %d (%d keys)", job.seq,
                 len(self.store))
        self.loop.call_soon(self._compact_step, job)

    def _compact_step(self, job) -> None:
        if self.persist is None or self.persist.compaction is not job:
            return  # closed, or replaced by another
        try:
            written = job.step()
        except OSError as exc:  # a full disk: the partial snapshot goes, the log stays
            self.persist.abort_compaction()
            self._compaction_failed(job, exc)
            return
        if not written:
            self.loop.call_later(COMPACT_PACE_S, self._compact_step, job)
            return
        job.finishing = True
        fut = self.loop.run_in_executor(None, job.finish)
        fut.add_done_callback(lambda f: self._compacted(job, f))

    def _compacted(self, job, fut) -> None:
        job.finishing = False
        if fut.exception() is not None:
            log.error("compaction: the snapshot at sequence %d failed: %s", job.seq,
                      fut.exception())
            if self.persist is not None and self.persist.compaction is job:
                self.persist.abort_compaction()
                self._compaction_failed(job, fut.exception())
            return
        if self.persist is None:
            return
        if self.persist.compaction is not job:
            # replaced meanwhile (a passive installed its active's map): this snapshot
            # belongs to the old map and must not outlive it
            job.path.unlink(missing_ok=True)
            return
        removed = self.persist.compacted(job)
        self.on_compacted(job)
        log.info("compaction: snapshot at sequence %d (%d keys, %d bytes) in %.2f s; %d "
                 "older files removed", job.seq, job.keys, job.bytes,
                 self.persist.last_compaction_s, len(removed))

    def _compaction_failed(self, job, exc: BaseException) -> None:
        """A snapshot could not be written. Its log still holds the map: try again later.
        But the snapshot of a map installed from the peer is its only copy here: a disk
        error (``on_disk_error``)."""
        if job.only_copy and isinstance(exc, OSError):
            self.on_disk_error("writing the installed map's snapshot", exc)
        elif self.persist is not None:
            self.persist.compaction_failed(exc)

    def on_compacted(self, job) -> None:
        """A compaction's snapshot is whole on disk (a role's hook)."""

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
        """(Re)arm the TTL timer for the earliest expiry, if that is sooner than armed."""
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
        serving = self.serving()
        if self.config.clock_s > 0:
            published = self.store.seq - len(self._held) // KVPUB_FRAMES - self.parked
            return chp.hugz(time.time(), published, serving=serving,
                            generation=self.generation, route=self.route,
                            cas=self.DECIDES_WRITES)
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
        if self.disk_error or not self.admit_snapshot_request():
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
        return {
            "role": self.role,
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
