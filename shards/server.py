"""The 12/CHP shard server's reactor: one ZeroMQ context, three sockets, one store.

    P    ROUTER  snapshot:  ICANHAZ? -> KVSYNC* KTHXBAI      (ROUTER_MANDATORY: flow control)
    P+1  XPUB    publisher: KVPUB, HUGZ (and one HUGZ for each new subscription)
    P+2  SUB     collector: KVSET (subscribed to everything)

It is composed of parts: a role (``clonemap.shards.roles``: standalone, a Binary Star pair's
server, a relay) that decides what differs between them; the context and its sockets
(``clonemap.shards.server_sockets``); the snapshot service on P (``clonemap.shards.snapshots``); the HUGZ
(``clonemap.shards.heartbeat``); the data directory (``clonemap.shards.persist.driver``); the TTL timer
(``clonemap.shards.expiry``). What stays here is the write path and its publish:

* ``on_collect``: a KVSET (drained in capped batches by ``zio.AsyncSocket``) is checked,
  applied to the ``Store`` and held as a KVPUB with the next sequence, UUID and
  properties echoed (a ``ttl`` adds ``expires=<epoch s>``; see ``store.ttl_props``);
  after the batch (``flush``) the log is written (and fsynced under ``always``), then
  the outbox's batch goes out: its KVPUBs in one burst, then the replies to writers that
  asked. A role that gates publishing (a leased pair) decides first, by returning a
  ``Verdict``: publish, hold, or parked until the passive holds it
  (``clonemap.shards.outbox``: when an update may be published).
* expiries (``clonemap.shards.expiry``): due keys are deleted and each delete is published as a
  KVPUB with an empty value, empty UUID and empty properties.

Malformed input anywhere is counted by ``ProtocolError.reason`` (``DropCounter``), logged
at a limited rate, and dropped. ``stats()`` returns a JSON-able dict.

Ownership: with a routing map (``ServerConfig.shard_map`` and ``shard_index``), a KVSET
for a key this shard does not own is dropped and counted ``not_owner``. The answer is
cached per *routing slot* (``OwnerCache``: the key up to the slash that ends its routing
segment; a slot with a pin under it, such as ``/users/`` under ``/users/vip/``, is
answered per key). The hot path first asks the store: a key it already holds was owned
when it was applied, and that lookup is the one ``Store.apply`` repeats at once on warm
cache lines; only a key new to the store reads the slot cache. Without a map (or with
one shard) every key is owned and the check costs nothing. (Until 2026-11-30 a key that
is a slot itself, ``/users/``, cached its own owner for the slot without looking for pins
under it, and a shard that had seen it then took KVSETs for ``/users/vip/...`` that
another shard owned.)

Whether this server may publish and answer snapshots is decided in one place,
``set_active``: a standalone server is active from ``start``, a Binary Star server when
its machine says so, a relay from its first copy. A server that is not active drops
KVSETs (counted ``not_active``) and does not answer ICANHAZ (counted
``snapshots_refused``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from itertools import compress, repeat
from operator import is_not

import psutil
import zmq
from zmq.backend import Socket as _BackendSocket

from clonemap.shards.applied import APPLY, DUPLICATE, AppliedUuids, decide
from clonemap.shards.history import History
from clonemap.shards.byte_marks import ByteMarks
from clonemap.shards.common import cpu_priority, zio
from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.connections import reset_connections
from clonemap.shards.common.errors import ConfigError, ProtocolError, os_error_text
from clonemap.shards.common.live_mark import LiveMark
from clonemap.shards.common.proto import chp
from clonemap.shards.common.routing import OWNER_CACHE_MAX, OwnerCache, ShardMap
from clonemap.shards.common.security import Security
from clonemap.shards.store import Store, ttl_props
from clonemap.shards.server_config import ServerConfig, new_generation
from clonemap.shards.snapshots import SnapshotService, largest_entry
from clonemap.shards.persist.driver import PERSIST_TICK_S, Persistence
from clonemap.shards.roles import Role, Standalone
from clonemap.shards.heartbeat import Heartbeat
from clonemap.shards.expiry import Expiry
from clonemap.shards.outbox import KVPUB_FRAMES, Batch, Outbox, Verdict
from clonemap.shards.server_sockets import ServerSockets
from clonemap.shards.gate import Gate

log = logging.getLogger("clonemap.shards.server")

FORGET_CHUNK = 1_000
"""Keys a source examines and forgets per loop turn after a flip (``forget_moved``), and
a plan's count looks at (``count_leaving``). Each chunk is a wait for the writes that
come meanwhile: in ``bench reshard`` (1M keys, 2 -> 3 shards) a count chunk of 5,000
keys took 12-15 ms of a source's loop, 1,000 about 2 ms."""
COUNT_IDLE = 3.0
"""After each chunk of a plan's count (``count_leaving``), the server idles this many
times the chunk's own time (a quarter of a core at most): every server counts at once,
and at full speed the four of ``bench reshard`` held the writes at a p50 of 23-59 ms for
the count's two seconds; idling as long as each chunk (half a core), the count's
half-seconds had the writes at a p50 of 1.7-3.2 ms; three times as long, 0.5-1.6 ms."""
COUNT_PAUSE_S = float(os.environ.get("CLONEMAP_COUNT_PAUSE_S") or 0.0)
"""Tests only (``CLONEMAP_COUNT_PAUSE_S``): the least idle after each chunk of a count, so
that a small map's count lasts as long as a large one's (a beat of ``count_leaving``)."""
COUNT_BEAT_S = 1.0
"""How often a count that is still running says so (``count_leaving``'s ``beat``),
unless its request asks otherwise: a count lasts as long as the map is large (~3 s of
wall at 500,000 keys here), and whoever asked for it waits for the next word, not for
the whole count."""
FORGET_IDLE = 9.0
"""After each chunk a source forgets, it waits this many times the chunk's own time
before the next (a tenth of a core at most): forgetting is background work, and at a
flip every server of every source forgets at once, beside the writes the flip just let
go (at full speed, the four servers of ``bench reshard`` took 1.4 cores for 1.5 s, and
the writer, runnable, waited for them; at a quarter of a core each, the writes waited
2.9-6.5 ms at the median for two seconds after the flip, at a tenth 0.7-1.4 ms). At
500,000 keys a source forgets for about 10 s; until it is done its snapshots, counts
and copies leave the moved keys out (``forgetting``)."""


_send = _BackendSocket.send
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_pack_seq = chp.pack_seq
_RESERVED = chp.RESERVED_KEYS
_HUGZ = chp.HUGZ


class ShardServer:
    """One CHP server. ``bind()`` (sync, may raise ``PortInUse``), then ``start()`` inside
    a running loop, then ``close()``."""

    def __init__(self, config: ServerConfig, role: Role | None = None):
        self.config = config
        self.role: Role = role if role is not None else Standalone()
        """What this server is for (``clonemap.shards.roles``): standalone, a server of a Binary
        Star pair (``clonemap.shards.pair.BinaryStar``) or a relay (``clonemap.shards.relay.Relay``)."""
        self.store = Store()
        self.generation = new_generation()
        """The map's generation token, announced in every clock HUGZ (``gen=``): a map
        born empty gets a new one; a Binary Star replica takes its active's."""
        self.drops = DropCounter(log)
        self.gate = Gate()
        """The rights enforced at every entrance (``clonemap.shards.gate``; ``--rights``):
        set before ``bind``. Nothing is checked when the cluster names no identity."""
        self._last_user: str | None = None
        self._last_scope = None
        """The collector's last writer and its rights (consecutive KVSETs mostly come
        from one connection)."""
        self.security = Security.off()
        """CURVE keys (``--keys-dir``): set before ``bind``."""
        self.persist: Persistence | None = None
        """The data directory on this server's loop when it persists (``--data-dir``;
        ``clonemap.shards.persist.driver``)."""
        self.disk_error = ""
        """Why the log could not be written (``on_disk_error``); "" while it can."""
        self.disk_failed = asyncio.Event()
        """Set on a disk error: the process stops (``Exit.DISK``)."""
        self._persist_flush: asyncio.Handle | None = None
        self._persist_timer: asyncio.TimerHandle | None = None
        self.outbox = Outbox()
        """KVPUBs applied (and, when persisting, logged) but not yet published, and the
        replies behind them (``clonemap.shards.outbox``): they go out in order after the
        collector's batch (``flush``), right after the batch's write (and, with ``fsync:
        always``, its fsync: group commit), as the role decides."""
        self.active = False
        self.ctx: zmq.Context | None = None
        self.sockets = ServerSockets(config, lambda: self.security,
                                     lambda sock: self.role.link_options(sock))
        """The context and the sockets it binds and connects (``clonemap.shards.server_sockets``)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.router_socket: zmq.Socket | None = None
        """P's ROUTER, once bound (a role's parts send on it: replies, TTL tables, the
        synchronous link's batches; they kick its reader after, ``kick_router``)."""
        self._pub: zmq.Socket | None = None
        self._collector_sock: zmq.Socket | None = None
        self._router: zio.AsyncSocket | None = None
        self._collector: zio.AsyncSocket | None = None
        self.heartbeat = Heartbeat(self)
        """The HUGZ: clock, idle beat, welcomes (``clonemap.shards.heartbeat``)."""
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
        self._pub_mark: LiveMark | None = None
        self._collect_mark: LiveMark | None = None
        """The publisher's and the collector's marks, from ``bind``
        (``clonemap.shards.common.live_mark``)."""
        self._publish_many = None
        self.snapshots = SnapshotService(self)
        """ICANHAZ and resumes on P (``clonemap.shards.snapshots``)."""
        self.applied = AppliedUuids(config.dedup_bytes, config.dedup_s, time.monotonic())
        """UUIDs applied lately: a write sent again is applied once (``clonemap.shards.applied``)."""
        self.writes = {"applied": 0, "duplicate": 0, "conflict": 0, "refused": 0, "forwarded": 0,
                       "replies_unsent": 0}
        """Outcomes of writes that asked for a reply or a condition (and duplicates)."""
        self.recent = History(config.history_updates, config.history_bytes)
        """Recent updates, for resumes (reset to the store's sequence at start)."""
        self._remember = self.recent.append if config.history_updates > 0 else None
        self.shard_map = config.shard_map
        """The routing this server follows now (``set_routing``); None: it owns every key."""
        self.owner_cache: OwnerCache | None = None
        self._owned_slots: dict | None = None
        self.route = ""
        """Said in every HUGZ (``route=I/N/DIGEST``): a client routing with another map
        (a wrong config) is told at once instead of timing out on some keys."""
        self.set_routing(config.shard_map)
        self.importing: list = []
        """Copies of the keys moving here, one per source shard (``clonemap.shards.migrate``)."""
        self.in_background = cpu_priority.started_in_background()
        """It runs at background CPU priority (``background``; or it was started so: an
        added shard's server, ``supervisor.runner.add_shard``)."""
        self.routing_provisional = False
        """Started on a routing a change has not committed (``--provisional-routing``: a
        shard the change adds), until it commits or follows a later one. Its stats say
        so, so that a supervisor settling a change whose own supervisor died can tell a
        target that committed from one that only started on the routing."""
        self.handover: tuple[int, int, dict[str, int]] | None = None
        """A shard a change added, at its flip: (its sequence then, the change's routing
        epoch, {each source's map generation: the source sequence its copy holds
        everything up to}). What an adoption (``adopt=`` in an ICANHAZ) is checked
        against, until a later routing."""
        self.hold = None
        """The KVSETs of keys moving away, kept until the flip (``clonemap.shards.migrate``)."""
        self.exporting = None
        """The routing a move copies keys from here by (``export``)."""
        self.move_epoch = 0
        """The latest change (its routing epoch) whose move steps this server took
        (``take_step_of``)."""
        self.slot_owners: tuple[ShardMap, dict[bytes, int]] | None = None
        """The routing the last plan was counted by here, and the owner of each whole slot
        the count found: the export for that routing asks no slot again (at the copy's
        start every key's slot was new to it: ~6 us of hashing each, most of the
        sources' loop for their first second)."""
        self.forgetting = None
        """``owns(key)`` while the keys that moved away are being forgotten
        (``forget_moved``): snapshots hold only what it accepts. None otherwise."""
        self._staged_out = 0
        """Staged updates in the outbox, not published yet (``_publish_staged``)."""
        self.staged: set[bytes] = set()
        """The keys a move staged in this store before this shard owns them
        (``stage_copied``; on a passive or a relay, the staged updates it applied:
        ``note_staged``), until the flip or the roll back. Our clients' snapshots leave
        them out, and no KVSET for one takes the hot path's shortcut."""
        self._exported: dict = {}
        self.forwards: dict = {}
        """Shard index -> the ``Forwarder`` to its collectors, for the keys that moved
        there from here."""
        # timers
        self.expiry = Expiry(next_expiry=lambda: self.store.next_expiry(),
                             expire=self.expire_due, enabled=self.role.expires_keys)
        """The TTL timer (``clonemap.shards.expiry``)."""
        # counters
        self.started_s = time.monotonic()
        self.process = psutil.Process()
        self._gated = self.role.gates_publish
        self.role.attach(self)

    # ================================================================ set-up
    def bind(self) -> None:
        """Bind P, P+1, P+2 (``clonemap.shards.server_sockets``), then what the role binds. Raises
        ``PortInUse`` naming the endpoint that is taken (everything opened so far is
        closed first)."""
        largest = largest_entry(self.store)  # a recovered map's: marks right from bind
        self.snapshots.entries(largest)
        self.marks.published(largest)
        self._fast_limit = self.marks.fast_limit
        gate = self.gate
        bound = self.sockets.open(
            self.snapshots.hwm, self.marks.pub_hwm, self.marks.collect_hwm,
            identities=frozenset(gate.access.identities) if gate.enforcing else None)
        self.router_socket, self._pub, self._collector_sock = bound
        self._publish_many = zio.publisher_many(self._pub, KVPUB_FRAMES)
        self._pub_mark = LiveMark(self._pub, zmq.SNDHWM, bind_value=self.marks.pub_hwm,
                                  name="publisher")
        self._collect_mark = LiveMark(self._collector_sock, zmq.RCVHWM,
                                      bind_value=self.marks.collect_hwm, name="collector")
        self.snapshots.bound(self.router_socket)
        self.ctx = self.sockets.ctx
        try:
            self.role.bind()
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        """Attach to the running loop; a standalone server becomes active at once."""
        self.loop = loop = asyncio.get_running_loop()
        self.expiry.loop = loop
        self.started_s = time.monotonic()
        self.recent.reset(self.store.seq)  # a recovered map: resumes start from here
        checked = self.gate.enforcing  # rights: every message's User-Id is read
        self._router = zio.AsyncSocket(
            self.router_socket, self.on_request_as if checked else self.role.on_snapshot_request,
            batch=256, loop=loop, name="snapshot", with_user=checked)
        self.snapshots.start(loop, self.router_socket, self._router.kick)
        self._collector = zio.AsyncSocket(
            self._collector_sock, self.on_collect_as if checked else self.role.on_collect,
            batch=self.config.collect_batch, loop=loop, name="collector",
            after_batch=self.flush, recv_only=True, with_user=checked)
        self.heartbeat.start(loop, self._pub, self.gate if checked else None)
        self._pub_mark.start(loop, self.heartbeat.kick)
        self._collect_mark.start(loop, self._collector.kick)
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
        self.heartbeat.close()
        self.expiry.close()
        self.stop_import()
        for forwarder in self.forwards.values():
            forwarder.close()
        self.forwards.clear()
        for handle in (self._persist_flush, self._persist_timer):
            if handle is not None:
                handle.cancel()
        self.snapshots.close()
        for mark in (self._pub_mark, self._collect_mark):
            if mark is not None:
                mark.close()
        for asock in (self._router, self._collector):
            if asock is not None:
                asock.close(linger=0)
        self.sockets.close()
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
            if self.expiry.due_now():
                self.expiry.on_tick()  # keys that expired while down go before any snapshot
            self.expiry.arm()
            # tell subscribers at once (a client holding on a server that said
            # serving=0 asks for its snapshot on this HUGZ), after this turn's work
            self.heartbeat.welcome_soon()
        else:
            self.snapshots.clear()

    # ================================================================ rights
    def on_collect_as(self, frames: list[bytes], user_id: str | None) -> None:
        """A KVSET from ``user_id``, in a cluster that enforces rights: one outside the
        writer's rights is refused here, before any role sees it (a passive never holds
        it for a takeover, a relay never forwards it), counted by identity and answered
        ``refused`` when it asked for a reply; the rest go on as without rights."""
        if user_id is self._last_user:  # the compiled path hands the same str per name
            scope = self._last_scope
        else:
            scope = self._last_scope = self.gate.scope(user_id)
            self._last_user = user_id
        key = frames[0]
        if scope is not None:
            allowed = scope.writable.get(key[:scope.depth])
            if allowed is None:
                allowed = scope.may_write(key)
            if not allowed:
                self._refuse_write(scope, frames)
                return
        if key[:4] == _HUGZ and len(frames) == 5:
            self._refuse_hugz_key(user_id, frames)
            return
        self.role.on_collect(frames)

    def _refuse_hugz_key(self, user_id: str | None, frames: list[bytes]) -> None:
        """A key that starts with ``HUGZ``, in a cluster that enforces rights: every
        subscriber that may read anything subscribes to the ``HUGZ`` prefix (a publisher
        matches prefixes), so such a key would reach readers that may not read it. It
        is refused from every writer, the cluster's own pairs included."""
        self._refuse(user_id or "client", frames,
                     f"forbidden: a key that starts with HUGZ ({frames[0][:80]!r}) would "
                     "reach every subscriber: refused where rights are enforced")

    def _refuse_write(self, scope, frames: list[bytes]) -> None:
        self._refuse(scope.name, frames, scope.why_not(frames[0], "write"))

    def _refuse(self, name: str, frames: list[bytes], why: str) -> None:
        """A KVSET refused for want of a right: counted for ``name``, and answered
        ``refused`` with ``why`` when it asked for a reply."""
        self.gate.count(name, "writes_refused", why)
        if len(frames) != 5 or not frames[3]:
            return
        try:
            reply_to = chp.write_terms(frames[3]).reply_to
        except ProtocolError:
            return
        if reply_to and self.active:
            self._reply(reply_to, frames[2], chp.REFUSED, 0, why)

    def reload_rights(self) -> bool:
        """Apply the rights file again (``supervisor reload`` signals SIGHUP): the new
        rights hold from the next message on; the ZAP handler admits only the identities
        it names (a key deleted or a name left out is refused from the next handshake);
        the publisher's connections from the hosts of every identity whose rights changed
        are closed, so that their subscriptions come back narrowed to the new rights
        (``clonemap.shards.common.connections``). False, the old rights kept, when the
        file cannot be read (logged, counted ``reloads_failed``)."""
        old = self.gate
        if not old.source:
            return False
        try:
            new = Gate.load(old.source)
        except ConfigError as exc:
            old.reloads_failed += 1
            log.error("rights not reloaded, version %d kept: %s", old.version, exc)
            return False
        new.take_counts(old)
        changed = old.access.changed(new.access)
        self.gate = new
        self.heartbeat.use_gate(new)
        auth = self.sockets.auth
        hosts: set[str] = set()
        refused = set()
        if auth is not None:
            refused = auth.admit_identities(frozenset(new.access.identities))
            hosts = set().union(*(auth.hosts.get(name, set()) for name in changed))
        closed = reset_connections({self.config.port + 1}, hosts)
        new.connections_closed += closed
        self._last_user = self._last_scope = None  # the next KVSET takes the new rights
        new.loaded_at = time.time()  # applied whole: connections closed too
        log.info("rights version %d applied (%d identities; changed: %s; keys no longer "
                 "admitted: %s; %d publisher connections closed)", new.version,
                 len(new.access.identities), ", ".join(sorted(changed)) or "none",
                 ", ".join(sorted(refused)) or "none", closed)
        return True

    def on_request_as(self, frames: list[bytes], user_id: str | None) -> None:
        """A message on P from ``user_id``, in a cluster that enforces rights: an
        ICANHAZ is answered within its requester's read rights (``snapshots``); anything
        else an identity sends there (the pair's own commands, ``BSTAR-TTL?`` whose
        tables name every key) is dropped, counted ``commands_refused``: only the
        cluster's own processes speak them."""
        scope = self.gate.scope(user_id)
        if len(frames) > 1 and frames[1] == chp.ICANHAZ:
            self.snapshots.requested_by(frames[0], scope)
        elif scope is not None:
            shown = frames[1][:32] if len(frames) > 1 else b""
            self.gate.count(scope.name, "commands_refused",
                            f"identity {scope.name!r} sent {shown!r} on the snapshot port: "
                            "only the cluster's own processes may")
            return
        self.role.on_snapshot_request(frames)

    # ================================================================ collector
    def on_collect(self, frames: list[bytes]) -> None:
        """A message on the collector: a KVSET becomes a KVPUB with the next sequence."""
        if self.hold is not None and self.keep_moving(frames):
            return
        if len(frames) == 5 and self.active:
            key, seq_frame, uuid, props, value = frames
            # Fast path: a subset of what chp.decode_kvset accepts (ASCII key, no
            # properties); anything else takes the full check below.
            if (not props and len(seq_frame) == 8 and (not uuid or len(uuid) == 16)
                    and 0 < (size := len(key)) <= self._max_key
                    and size + len(value) <= self._fast_limit
                    and key.isascii() and key not in _RESERVED):
                owned = self._owned_slots
                if (owned is not None and (key not in self.store.data or key in self.staged)
                        and owned.get(
                        key if (end := key.find(b"/", 1)) < 0 else key[:end + 1]) is not True
                        and not self.owns(key, frames)):
                    return  # forwarded to its new shard, or counted not_owner
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
                # log write (flush): one burst wakes libzmq's I/O thread once, where a
                # send per update woke it per update
                self.outbox.updates += key, _pack_seq(seq), uuid, b"", value
                return
        self._collect_checked(frames)

    def keep_moving(self, frames: list[bytes]) -> bool:
        """A client's KVSET for a key this active holds for a move (``begin_hold``): kept
        until the flip (forwarded then to the key's new shard, or applied here if the
        move rolls back); True if kept. From the collector, and for the writes a passive
        heard and applies as it takes over (``clonemap.shards.pair``)."""
        hold = self.hold
        if hold is None or not self.active or not hold.moves(frames[0]):
            return False
        hold.keep(frames)
        return True

    def note_received(self, frames: list[bytes]) -> None:
        """A message off the fast path: a larger one than any so far lowers the
        collector's mark (``clonemap.shards.byte_marks``), valid or not, active or passive."""
        size = sum(map(len, frames))
        if size > self._fast_limit:
            self._lower_mark(self.marks.received(size))

    def _collect_checked(self, frames: list[bytes]) -> None:
        self.note_received(frames)
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
        if not self.owns(key, frames):
            if reply_to and not self._forwarded(key):
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
            self.expiry.arm()

    def _reply(self, identity: bytes, uuid: bytes, outcome: bytes, seq: int,
               detail: str = "") -> None:
        """Queue a KVREPLY for the writer's DEALER: sent by ``flush``, after the batch's
        write (and fsync) and its KVPUBs, so an applied reply is never ahead of the
        update it reports."""
        if outcome == chp.REFUSED:
            self.writes["refused"] += 1
        self.outbox.reply([identity, *chp.kvreply(uuid, outcome, seq, detail)])
        if self._persist_flush is None and self.loop is not None:
            self._persist_flush = self.loop.call_soon(self.flush)

    def _send_replies(self, replies: list[list[bytes]]) -> None:
        """KVREPLYs on P's ROUTER, from the publish path (never P's reader): the sends
        may take the edge of the FD that reader waits on (a new peer's attach, processed
        here, leaves its first message unsignalled), so the reader looks again after."""
        sock = self.router_socket
        for frames in replies:
            try:
                zio.send_frames(sock, frames)
            except zmq.ZMQError:  # the writer's DEALER is not (or no longer) connected
                self.writes["replies_unsent"] += 1
        self.kick_router()

    def reapply_pub_mark(self) -> None:
        """Set a lowered publisher mark again, so that it reaches the pipes of
        subscribers that connected since it was lowered (they got the bind-time mark:
        ``clonemap.shards.byte_marks``); a no-op while it is still the bind-time one. Called when
        the publisher welcomes new subscriptions (once a loop turn)."""
        if self._pub_mark is not None:
            self._pub_mark.reapply()

    def _lower_mark(self, which: str | None) -> None:
        """A message larger than any so far was read or is about to be published: the
        marks fell (``clonemap.shards.byte_marks``), so that a subscriber that reads nothing, or
        a writer, pins at most its byte budget. ``which``: the socket to tell, or None.
        A socket's mark changes through its ``LiveMark`` (``clonemap.shards.common.live_mark``:
        libzmq 4.3.5 crashes on a mark set while a peer's pipe is being torn down)."""
        marks = self.marks
        self._fast_limit = marks.fast_limit
        # (not the snapshot ROUTER's mark here: setting it in the middle of a collector
        # batch left a subscriber's updates undelivered 3 times in 15 runs of
        # test_binary_values_round_trip_byte_exact; a snapshot lowers it itself, before
        # a larger entry is queued)
        if which == "pub" and self._pub_mark is not None:
            self._pub_mark.set(marks.pub_hwm)
        elif which == "collect" and self._collect_mark is not None:
            self._collect_mark.set(marks.collect_hwm)

    def _log_and_publish(self, seq: int, key: bytes, uuid: bytes, props: bytes, value: bytes,
                         expiry_s: float | None) -> None:
        """Hold one applied update's KVPUB for ``flush`` (after the collector's batch,
        or at the end of the caller's work), logging it first when the server persists:
        a KVPUB, and so an acknowledgement, never goes out before its update reached the
        OS, and every KVPUB goes out in sequence order through the one burst. A UUID
        that marks a write its client may send again is remembered and logged."""
        kept = uuid if chp.is_resendable(uuid) else b""
        if kept:
            self.applied.add(kept, seq)
        if self.persist is not None:
            self.log_applied(seq, key, value, expiry_s, kept)
        self.outbox.updates += key, _pack_seq(seq), uuid, props, value

    def publish(self, seq: int, key: bytes, uuid: bytes, props: bytes, value: bytes,
                staged: bool = False) -> None:
        """Publish an update applied elsewhere with its own sequence (a relay's copy of
        its shard), now, and keep it for resumes. ``staged``: under
        ``chp.STAGED_PREFIX`` (its shard's ``staged_ranges_hugz`` follows: ``publish_raw``)."""
        size = len(key) + len(props) + len(value)
        if size > self._fast_limit:
            self._lower_mark(self.marks.published(size))
        if self._remember is not None:
            self._remember(seq, key, uuid, props, value)
        zio.send_frames5(self._pub, chp.STAGED_PREFIX + key if staged else key,
                         _pack_seq(seq), uuid, props, value)

    def publish_raw(self, frames: list[bytes]) -> None:
        """Publish a message as it came from upstream (a relay: its shard's HUGZ that
        names staged sequences)."""
        if self._pub is not None:
            zio.send_frames5(self._pub, *frames)

    def remember(self, seq: int, key: bytes, uuid: bytes, props: bytes,
                 value: bytes) -> None:
        """Keep an update applied elsewhere (a passive's copy) for resumes."""
        if self._remember is not None:
            self._remember(seq, key, uuid, props, value)

    def log_applied(self, seq: int, key: bytes, value: bytes, expiry_s: float | None,
                    uuid: bytes = b"") -> None:
        """Append one applied update to the data directory; the batch is written at the
        end of the loop turn (``flush``)."""
        self.persist.append(seq, key, value, expiry_s, uuid)
        if self._persist_flush is None and self.loop is not None:
            self._persist_flush = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write the batch's records (fsync with ``always``), then hand the outbox's
        batch to the role's verdict (``clonemap.shards.outbox``): published in sequence
        order, held, or parked. Runs after every collector batch, and at the end of a
        loop turn that logged outside one."""
        if self._persist_flush is not None:
            self._persist_flush.cancel()
        self._persist_flush = None
        outbox = self.outbox
        if self.persist is not None and not self.persist.flush():
            outbox.drop_replies()  # nothing waiting is published: never acknowledged
            return
        if not outbox:
            return
        if not self._gated:  # nothing decides but the order: out now, no clock read
            self.publish_batch(outbox.take(self.store.seq))
            return
        batch = outbox.take(self.store.seq, self.loop.time() if self.loop else 0.0)
        verdict = self.role.gate(batch)
        if verdict is Verdict.HOLD:
            outbox.restore(batch)  # out if the lease is renewed in time
        elif verdict is Verdict.PARKED:
            outbox.park(batch)  # out once the passive holds it (shards.sync_link)
        else:
            self.publish_batch(batch)

    def flush_pending(self) -> None:
        """Flush now if updates wait (a snapshot point must not show what is not on disk
        yet, and a parked write must not be seen before the passive holds it)."""
        if self.outbox.updates:
            self.flush()

    def publish_batch(self, batch: Batch, parked: bool = False) -> None:
        """Publish ``batch``: its KVPUBs in one burst, in order, kept for resumes, then
        its replies. ``parked``: it was parked, and is counted out of the outbox's."""
        updates = batch.updates
        if updates:
            if parked:
                self.outbox.unpark(batch.count)
            if self._staged_out:  # (staged updates go under their own prefix: not to clients)
                self._publish_staged(updates)
            else:
                self._publish_many(updates)  # key, seq, uuid, props, value, key, ...: in order
            if self._remember is not None:
                self.recent.extend(updates)  # the list itself: no copy
        if batch.replies:
            self._send_replies(batch.replies)

    def _publish_staged(self, updates: list[bytes]) -> None:
        """``_publish_many`` for a batch that may hold staged updates (``chp.STAGED``):
        each goes under ``chp.STAGED_PREFIX``, then one HUGZ names their sequences, so
        that our clients, which do not receive them, see no gap."""
        wire, ranges = updates, []
        for i in range(0, len(updates), KVPUB_FRAMES):
            props = updates[i + 3]
            if props and chp.STAGED in props:
                if wire is updates:
                    wire = list(updates)
                wire[i] = chp.STAGED_PREFIX + updates[i]
                seq = int.from_bytes(updates[i + 1], "big")
                if ranges and ranges[-1][1] == seq - 1:
                    ranges[-1] = (ranges[-1][0], seq)
                else:
                    ranges.append((seq, seq))
                self._staged_out -= 1
        self._publish_many(wire)
        if ranges:
            zio.send_frames5(self._pub, *chp.staged_ranges_hugz(ranges))
        elif not self.staged:  # (one dropped with its batch: our clients drop it by its mark)
            self._staged_out = 0

    def replace_store(self, store: Store, uuids=()) -> None:
        """Serve ``store`` from now on (a passive's whole copy of its active's map) with
        its applied ``uuids`` (``[uuid, seq, ...]``): resumes and resends start from it."""
        self.store = store
        self.snapshots.entries(largest_entry(store))
        self.recent.reset(store.seq)  # resumes from this map only
        self.applied.clear(time.monotonic())
        self.applied.load(uuids)

    def published_seq(self) -> int:
        """The last sequence subscribers were sent (what HUGZ announce)."""
        return self.outbox.published_seq(self.store.seq)

    def kick_router(self) -> None:
        """A send on P's ROUTER outside its reader can take the edge of its FD: the
        reader must look again, or a request waiting there waits for the next one."""
        if self._router is not None:
            self._router.kick()

    def late_reads(self) -> int:
        """Times a beat found P's or the collector's messages waiting unannounced
        (``zio.AsyncSocket.look_again``)."""
        return sum(a.late_reads for a in (self._router, self._collector) if a is not None)

    def handler_errors(self) -> int:
        """Exceptions the socket readers caught and logged."""
        return sum(a.errors for a in (self._router, self._collector)
                   if a is not None) + self.heartbeat.errors

    # ================================================================ durability
    def attach_persist(self, data_dir) -> None:
        """Log every applied update in ``data_dir`` (a ``clonemap.shards.persist.DataDir``, already
        opened after the recovered sequence) from now on."""
        self.persist = Persistence(
            data_dir, flush_held=self.flush,
            snapshot_of=lambda: (self.store, self.applied.generations()),
            on_disk_error=self.on_disk_error,
            on_compacted=getattr(self.role, "on_compacted", None) or (lambda job: None))

    def on_disk_error(self, what: str, exc: OSError) -> None:
        """The log could not be written or fsynced: a state, not a log line. The server
        stops at once: it acknowledges nothing more (what it holds was never published),
        answers no snapshot (its map may hold updates that are not on disk), and sets
        ``disk_failed``: ``python -m clonemap.shards`` then exits with ``Exit.DISK``, its peer
        serves, and the supervisor restarts it, recovering from what is on disk, until
        the disk works again."""
        if self.disk_error:
            return
        where = self.persist.path if self.persist is not None else "?"
        self.disk_error = f"{os_error_text(exc)} ({what} in {where})"
        self.set_active(False)  # no snapshot, no KVPUB, no TTL from now on
        log.critical("disk error: %s; this server stops so that its peer serves",
                     self.disk_error)
        self.disk_failed.set()

    def _persist_tick(self) -> None:
        """Every ``PERSIST_TICK_S``: the data directory's turn (everysec fsync,
        compactions: ``clonemap.shards.persist.driver``)."""
        self._persist_timer = self.loop.call_later(PERSIST_TICK_S, self._persist_tick)
        if self.persist is not None:
            self.persist.tick()

    def set_routing(self, shard_map) -> None:
        """Follow ``shard_map`` (a ``ShardMap``, or None: own every key) from now on: the
        owner check, and the ``route=``/``epoch=`` of the HUGZ. The caller has made it
        durable first where it must be (``clonemap.shards.routing_file``). A key the store
        already holds stays writable here (the hot path's shortcut): a routing that takes
        held keys elsewhere comes with their move."""
        index = self.config.shard_index
        cache = None
        if shard_map is not None and (shard_map.shards > 1 or index != 0):
            cache = OwnerCache(shard_map, index)
        self.shard_map = shard_map
        self.owner_cache = cache
        self._owned_slots = cache.slots if cache is not None else None
        self.route = shard_map.route_of(index) if shard_map is not None else ""

    # ================================================================ moves
    def take_step_of(self, epoch: int) -> str:
        """A move step of the change to routing ``epoch`` is about to run here: "" if it
        may, else why not. A step of an earlier change than one this server has taken
        part in (or than the change it was started for, a shard that change adds) is a
        late request: sent before a partition, while this host was cut off, and
        delivered once the link came back (TCP resends what a closed socket had
        written). Run, a stale ``stop-import`` dropped a later change's copies, and a
        stale ``release`` would end a later change's hold early."""
        floor = self.move_epoch
        if self.routing_provisional and self.shard_map is not None:
            floor = max(floor, self.shard_map.epoch)
        if epoch < floor:
            return (f"a step of the change to epoch {epoch}, older than the change to "
                    f"epoch {floor} this server takes part in (a late request)")
        self.move_epoch = epoch
        return ""

    def start_import(self, source: str, prefix: bytes, shard_map,
                     rate: float | None = None, timeout_s: float | None = None) -> str:
        """Copy, from the source active at ``source`` (its P), the keys under ``prefix``
        that ``shard_map`` gives this shard, invisibly (the target's side of a move:
        ``clonemap.shards.migrate.Import``), at ``rate`` bytes per second at most (None:
        unpaced), its snapshot whole within ``timeout_s``; "" once started, else why not."""
        from clonemap.shards.migrate import COPY_TIMEOUT_S, Import

        if not self.active:
            return "not active"
        chp.check_subtree(prefix)
        owns = OwnerCache(shard_map, self.config.shard_index).owns
        for imp in [i for i in self.importing if i.source == source]:
            imp.close()
            self.importing.remove(imp)
        # Each key copied is applied to the store as it arrives, so that the flip has no
        # per-key work: its own sequence, logged, replicated to the passive. A shard this
        # change adds (started on the new routing, which it has not saved) serves no
        # client before the flip (``apply_copied``). A shard that serves marks each such
        # update staged (``stage_copied``): our clients do not apply it, and take the key
        # from the parts that hold it at the flip.
        added = self.shard_map is not None and self.shard_map.epoch == shard_map.epoch
        imp = Import(self.sockets.connect, self.loop, source, prefix, self._limits, owns,
                     self.config.shard_index,
                     stage=self.apply_copied if added else self.stage_copied,
                     flush=self.flush, rate=rate, timeout_s=timeout_s or COPY_TIMEOUT_S)
        self.importing.append(imp)
        imp.start()
        return ""

    def export(self, shard_map) -> str:
        """A move copies from here: a snapshot asked with ``move=<index>`` holds only the
        keys ``shard_map`` gives that shard (``exported_to``). "" once set."""
        self.exporting = shard_map
        self._exported = {}
        return ""

    def exported_to(self, index: int):
        """``key -> bool``: whether the exported routing gives ``key`` to shard ``index``
        (None when nothing is exported)."""
        shard_map = self.exporting
        if shard_map is None or not 0 <= index < shard_map.shards:
            return None
        owns = self._exported.get(index)
        if owns is None:
            counted = self.slot_owners
            known = counted[1] if counted is not None and counted[0] == shard_map else None
            owns = self._exported[index] = OwnerCache(shard_map, index, known=known).owns
        owned = self.forgetting  # a key that moved away, not forgotten yet: not exported
        return owns if owned is None else (lambda key: owned(key) and owns(key))

    def stop_import(self) -> None:
        for imp in self.importing:
            imp.close()
        self.importing = []

    def apply_copied(self, key: bytes, value: bytes, expiry_s: float | None,
                     staged: bool = False) -> None:
        """One key of a move's copy applied here as an update, as it arrives
        (``start_import``): this shard's sequence, logged, replicated to its passive,
        published at the next ``flush``. An empty value deletes. (No UUID, no condition:
        a key no write here decided on yet.) ``staged``: this shard serves, and does
        not own the key yet (``stage_copied``)."""
        props = b"" if expiry_s is None else b"expires=%.3f\n" % expiry_s
        if staged:
            props += chp.STAGED
            self._staged_out += 1
        size = len(key) + len(props) + len(value)
        if size > self._fast_limit:  # (before the batch goes out: ``flush``)
            self._lower_mark(self.marks.published(size))
        self._log_and_publish(self.store.apply(key, value, expiry_s), key, b"", props,
                              value, expiry_s)

    def stage_copied(self, key: bytes, value: bytes, expiry_s: float | None) -> None:
        """``apply_copied`` on a shard that serves: the update says it is staged
        (``chp.STAGED``), so that our clients leave the key to its owner until the flip."""
        self.staged.add(key)
        self.apply_copied(key, value, expiry_s, staged=True)

    def staged_filter(self):
        """``readable(key)`` for our clients' snapshots while keys are staged here (None
        otherwise): everything but them."""
        staged = self.staged
        return (lambda key: key not in staged) if staged else None

    def abort_import(self) -> int:
        """The move was rolled back before the flip: stop the copies, and delete what
        was staged here (``stage_copied``), a chunk per loop turn, each delete marked
        staged: published, logged and replicated as the copy was (our clients ignore
        them, a strict 12/CHP peer sees the keys go). A passive only stops its copies:
        its active's deletes reach it. How many keys go."""
        self.stop_import()
        if not self.staged or not self.active:
            return 0
        gone = tuple(self.staged)  # (none of them this shard's: the flip did not come)
        self._unstage(gone, 0)
        return len(gone)

    def _unstage(self, keys: tuple[bytes, ...], at: int) -> None:
        end = min(at + FORGET_CHUNK, len(keys))
        staged, data = self.staged, self.store.data
        for key in keys[at:end]:
            if key in staged:
                staged.discard(key)
                if key in data:
                    self.apply_copied(key, b"", None, staged=True)
        self.flush()
        if end < len(keys) and self.loop is not None:
            self.loop.call_soon(self._unstage, keys, end)
        elif keys:
            log.info("moves rolled back: %d staged keys deleted", len(keys))

    def note_staged(self, key: bytes, value: bytes) -> None:
        """A passive or a relay applied a staged update of ``key`` from its active."""
        if value:
            self.staged.add(key)
        else:
            self.staged.discard(key)

    def _unstage_for(self, shard_map) -> None:
        """A routing is followed: the keys staged here that it gives this shard are its
        own now; the rest (the move that staged them rolled back, and the routing came
        back under a later epoch) are forgotten, without deletes."""
        staged, self.staged = self.staged, set()
        if not staged:
            return
        owns = OwnerCache(shard_map, self.config.shard_index).owns
        count = self.store.forget([key for key in staged if not owns(key)])
        if count:
            log.info("routing: forgot %d keys a rolled-back move had staged", count)

    def begin_hold(self, shard_map, peer: bool = False,
                   forward_to: dict[int, list[str]] | None = None) -> str:
        """Keep this shard's KVSETs for the keys ``shard_map`` gives to other shards from
        now on (the source's side of a move: ``clonemap.shards.migrate.Hold``); "" once
        holding. ``peer``: this is the active's peer, told in case it takes over (a
        passive is refused otherwise: the move asked the wrong server). ``forward_to``:
        the collectors of the shards the keys go to, connected now (``open_forwards``),
        so that the flip forwards what was held without waiting for them."""
        from clonemap.shards.migrate import Hold

        if not self.active and not peer:
            return "not active"
        owns = OwnerCache(shard_map, self.config.shard_index).owns
        if self.hold is None:
            # (a passive holds too: should it take over before the flip ends, it keeps
            # the moving keys' writes instead of applying them under the old routing)
            self.hold = Hold(lambda key: not owns(key), self.store.seq)
            self.hold.opened = self.open_forwards(forward_to or {})
            if self.active:
                self._announce_hold(self.hold)
        return ""

    def open_forwards(self, forward_to: dict[int, list[str]]) -> list[int]:
        """A ``Forwarder`` to the collectors of each shard in ``forward_to`` that has
        none yet; the shard indexes it opened. Nothing goes through one before this
        shard's routing places a key there."""
        from clonemap.shards.migrate import Forwarder

        opened = []
        for owner, collectors in forward_to.items():
            if owner not in self.forwards and owner != self.config.shard_index:
                self.forwards[owner] = Forwarder(self.ctx, collectors, self.security)
                opened.append(owner)
        return opened

    def _hugz_now(self) -> None:
        """A HUGZ now, out of the heartbeat's turn: a new ``route=``/``epoch=`` that
        clients follow at once, or a hold's clock (``_announce_hold``)."""
        if self._pub is None or self.loop is None:
            return
        try:
            zio.send_frames5(self._pub, *self.heartbeat.hugz())
        except zmq.ZMQError as exc:
            log.warning("the HUGZ out of turn was not sent: %s", exc)

    def _announce_hold(self, hold) -> None:
        """A clock HUGZ as soon as every update up to the hold is published: it tells
        the copies (``clonemap.shards.migrate.Import.source_seq``) at once that nothing
        under the moving keys follows, where the next periodic one could take
        ``--clock-s``."""
        if self.hold is not hold or self._pub is None:
            return
        if self.published_seq() < hold.seq:
            self.loop.call_later(0.002, self._announce_hold, hold)
            return
        self._hugz_now()

    def seal_hold(self) -> str:
        """The flip may begin: the hold no longer ends by itself. "" once sealed."""
        if self.hold is None:
            return "no hold (it was released)"
        if self.hold.failed:
            return f"the hold failed: {self.hold.failed}"
        self.hold.sealed = True
        return ""

    def release_hold(self) -> int:
        """The move was rolled back: apply what was held, here, in order. How many."""
        hold, self.hold = self.hold, None
        if hold is None:
            return 0
        for owner in hold.opened:  # (the routing did not change: nothing went through)
            forwarder = self.forwards.pop(owner, None)
            if forwarder is not None:
                forwarder.close()
        for frames in hold.frames:
            self.on_collect(frames)
        self.flush()
        return len(hold.frames)

    def commit_import(self, shard_map) -> str:
        """The flip on the target: follow ``shard_map`` (which gives this shard the keys
        it copied, staged as they came: ``start_import``; no per-key work here), and
        take the sources' applied UUIDs; durable (fsync) before it answers. "" once
        done, else why not (nothing changed)."""
        imports = self.importing
        unfinished = [i for i in imports if not i.copied or i.error]
        if not imports or unfinished:
            return "no complete copy to commit" + "".join(
                f" ({i.source}: {i.error or 'not copied yet'})" for i in unfinished)
        if not self.active:
            return "not active"
        provisional = self.routing_epoch == shard_map.epoch  # (started on it, unsaved)
        # what the copies staged here is this shard's under ``shard_map`` (they copied
        # only such keys): no pass over it inside the hold
        staged, self.staged = self.staged, set()
        why = self.install_routing(shard_map)
        if why:
            self.staged = staged
            return why
        if provisional and self.persist is not None:  # a shard the change adds
            from clonemap.shards.persist import routing as routing_file

            try:
                routing_file.save_routing(self.persist.path, shard_map,
                                          self.config.shard_index)
            except OSError as exc:
                return f"disk error: {os_error_text(exc)}"
        self.stop_import()
        self.routing_provisional = False
        count = sum(imp.staged for imp in imports)
        self.expiry.arm()
        at = self.store.seq
        for imp in imports:
            uuids = imp.uuids
            for i in range(0, len(uuids) - 1, 2):  # applied here at or before ``at``
                self.applied.add(uuids[i], at)
        self.flush()
        if self.persist is not None and not self.persist.sync():
            return "disk error while committing the copies"  # (the server stops)
        log.info("moves committed: %d keys from %s, at sequence %d", count,
                 ", ".join(i.source for i in imports), at)
        if provisional and all(i.staged and i.source_gen for i in imports):
            # a shard the change added holds, at ``at``, exactly what it copied: a client
            # that holds each source's map past the copy's end resumes from here
            self.handover = (at, shard_map.epoch,
                             {i.source_gen: i.source_seq for i in imports})
        return ""

    def forget_unowned(self) -> int:
        """Forget every key this shard's routing places elsewhere, without publishing
        deletes (its keys moved away: ``Store.forget``), at once. How many."""
        if self.owner_cache is None:
            return 0
        owns = self.owner_cache.owns
        gone = [key for key in self.store.data if not owns(key)]
        count = self.store.forget(gone)
        if count:
            log.info("routing: forgot %d keys now owned by other shards", count)
        return count

    def forget_moved(self) -> None:
        """``forget_unowned`` after a flip, on the loop a chunk at a time
        (``FORGET_CHUNK`` keys a turn: at 500,000 keys, at once, it held the source's
        writes for 1.7 s). The keys with a TTL go at once, first: none of them may expire
        here. Until the last chunk, snapshots and resumes leave out what this shard no
        longer owns (``forgetting``)."""
        if self.owner_cache is None or self.loop is None:
            self.forget_unowned()
            return
        owns = self.owner_cache.owns
        count = self.store.forget([k for k in list(self.store.expiry_table) if not owns(k)])
        self.forgetting = owns
        # (a tuple: the garbage collector stops walking it at its first pass, where a
        # list of 500,000 keys was walked by every collection the forgetting outlived; a
        # copy of the dict, which no collection walks, cost more: it touches every key
        # and value)
        self._forget_chunk(tuple(self.store.data), 0, count)

    def _forget_chunk(self, keys: tuple[bytes, ...], at: int, count: int) -> None:
        if self.owner_cache is None or self.store is None:
            self.forgetting = None
            return
        began = time.perf_counter()
        owns = self.owner_cache.owns  # (the routing now: it may have changed again)
        count += self.store.forget([k for k in keys[at:at + FORGET_CHUNK] if not owns(k)])
        if at + FORGET_CHUNK < len(keys):
            self.loop.call_later((time.perf_counter() - began) * FORGET_IDLE,
                                 self._forget_chunk, keys, at + FORGET_CHUNK, count)
            return
        self.forgetting = None
        if count:
            log.info("routing: forgot %d keys now owned by other shards", count)

    def forward_moved(self, key: bytes, frames: list[bytes]) -> bool:
        """A KVSET for a key that moved away from this shard goes on to the shard that
        owns it now (``clonemap.shards.migrate.Forwarder``); False when no move sent
        keys there."""
        forwarder = self.forwards.get(self.shard_map.owner(key))
        if forwarder is None:
            return False
        forwarder.send(frames)
        self.writes["forwarded"] += 1
        return True

    def background(self, on: bool) -> str:
        """This server at background CPU priority (``on``: a shard a change added, while
        it copies and serves no client) or back to normal
        (``clonemap.shards.common.cpu_priority``): its threads under ``SCHED_IDLE``
        (where it can come back: root, ``CAP_SYS_NICE``), and its own autogroup at nice
        19 (a server that leads its session: no privilege needed). "" once either is
        done, else why neither: the server goes on at normal priority. A leased pair
        (its role gates publishing by the clock) never goes: its lease's renewals have
        deadlines, and a server starved on a busy host lost its lease, and its copy with
        it (``test_reshard_hosts``, under the suite's load)."""
        if not on and not self.in_background:
            return ""
        if on and self._gated:
            why = "a leased pair stays at normal priority: its lease's renewals have deadlines"
            log.info("cpu priority: %s", why)
            return why
        why = cpu_priority.background(on)
        if why:
            log.warning("cpu priority: %s", why)
            if on:
                cpu_priority.background(False)  # (a refusal part way: all back)
        grouped = cpu_priority.own_autogroup()
        if grouped:
            self._autogroup_nice(cpu_priority.AUTOGROUP_NICE if on else 0)
        how = [name for name, done in (("SCHED_IDLE", not why), ("autogroup nice 19", grouped))
               if done] if on else []
        self.in_background = bool(how)
        log.info("cpu priority: %s", f"background ({', '.join(how)})" if how else "normal")
        return why if on and not how else ""

    def _autogroup_nice(self, nice: int, tries: int = 5) -> None:
        """This server's autogroup to ``nice``; the kernel takes one change per 100 ms
        from a process without ``CAP_SYS_ADMIN`` (``EAGAIN``), so a refusal is tried
        again a little later, while it is still wanted."""
        why = cpu_priority.autogroup_nice(nice)
        if not why:
            return
        if tries > 1 and self.loop is not None:
            self.loop.call_later(0.15, lambda: self._autogroup_nice(nice, tries - 1)
                                 if self.in_background == (nice > 0) else None)
        else:
            log.warning("cpu priority: %s", why)

    def install_routing(self, shard_map, forget: bool = False,
                        forward_to: dict[int, list[str]] | None = None) -> str:
        """Follow ``shard_map``, a later routing of this cluster, from now on: durable in
        the data directory first (a restart never goes back to an older one). Returns ""
        once followed (or when it is the routing followed already), else why not: an
        older epoch, the same epoch as another routing, a routing without this shard, a
        server without a routing, a key held here that the routing places elsewhere
        (unless ``forget``: those keys moved, and are forgotten), or a disk error (the
        server goes on with its own). A server in the background (``background``) comes
        back to normal priority first: it serves what it follows."""
        from clonemap.shards.persist import routing as routing_file

        if self.in_background:
            self.background(False)

        mine, index = self.shard_map, self.config.shard_index
        if mine is None:
            return "this server was started without a routing (standalone)"
        if shard_map.epoch < mine.epoch or (shard_map.epoch == mine.epoch
                                            and shard_map != mine):
            return (f"epoch {shard_map.epoch} is not newer than this server's epoch "
                    f"{mine.epoch}" + ("" if shard_map.epoch < mine.epoch else
                                       " (another routing under the same epoch)"))
        if shard_map.epoch == mine.epoch:
            return ""
        if index >= shard_map.shards and not forget:
            return f"shard {index} is not among the {shard_map.shards} shards of that routing"
        # (with ``forget``, a shard the routing removes: it owns nothing from now on, and
        # every write that still reaches it goes on to its key's new shard)
        leaving = {} if forget else self.keys_leaving(shard_map)
        if leaving:  # checked on the reactor: no write gets in between
            keys = sum(k for k, _ in leaving.values())
            return (f"this shard holds {keys} key{'' if keys == 1 else 's'} that routing "
                    f"places on shard{'' if len(leaving) == 1 else 's'} "
                    f"{', '.join(map(str, sorted(leaving)))}: keys are not moved "
                    "between shards by a routing change")
        if self.persist is not None:
            try:
                routing_file.save_routing(self.persist.path, shard_map, index)
            except OSError as exc:
                log.error("routing: cannot make epoch %d durable: %s", shard_map.epoch,
                          os_error_text(exc))
                return f"disk error: {os_error_text(exc)}"
        self.set_routing(shard_map)
        self.routing_provisional = False
        self._unstage_for(shard_map)
        log.info("routing: now epoch %d, %d shards (digest %s)", shard_map.epoch,
                 shard_map.shards, shard_map.digest())
        self._hugz_now()
        self.exporting = self.slot_owners = None
        if forward_to:  # (a passive forwards too, once it is active: ``owns``)
            self.open_forwards(forward_to)
        hold, self.hold = self.hold, None
        if hold is not None and self.forwards and self.active:
            for frames in hold.frames:  # first what was held, in order
                if not self.owns(frames[0], frames):
                    continue  # forwarded
                self.on_collect(frames)  # (a key it still owns: never held, but safe)
        elif hold is not None and self.active:  # no flip naming where they go: apply here
            self.hold = hold
            self.release_hold()
        if forget:  # after the held writes went on: they wait for nothing here
            self.forget_moved()
        return ""

    def keys_leaving(self, shard_map) -> dict[int, tuple[int, int]]:
        """Of the keys this server holds, those ``shard_map`` places on other shards:
        shard index -> (keys, bytes of key and value). One pass over the store, with the
        owner of each routing slot computed once (where a slot's keys all go to one
        shard: no pin under it)."""
        tally = LeavingTally(shard_map, self.config.shard_index)
        tally.add_keys(self._countable(self._keys_that_may_leave(shard_map)),
                       self.store.data)
        return tally.rows()

    def _countable(self, keys):
        """Of ``keys``, those a count of what leaves looks at: not keys that moved away
        and are not forgotten yet (``forgetting``), nor keys a move staged here (not this
        shard's yet)."""
        owned, staged = self.forgetting, self.staged
        if owned is None and not staged:
            return keys
        return [k for k in keys if (owned is None or owned(k)) and k not in staged]

    def _keys_that_may_leave(self, shard_map) -> Iterable[bytes]:
        """The keys of the store that ``shard_map`` may place on another shard, as the
        two routings tell (``ShardMap.may_take_from``): none, those under the pins that
        changed, or all (every key this server holds is its shard's under the routing
        it follows)."""
        data = self.store.data
        where = (None if self.shard_map is None else
                 shard_map.may_take_from(self.shard_map, self.config.shard_index))
        if where is None:
            return data
        return [k for k in data if k.startswith(where)] if where else ()

    async def count_leaving(self, shard_map, beat=None,
                            beat_s: float = COUNT_BEAT_S) -> dict[int, tuple[int, int]]:
        """``keys_leaving`` for a plan (``supervisor reshard`` asks every server at once),
        ``FORGET_CHUNK`` keys per loop turn: at 500,000 keys one pass held each server's
        writes for about half a second. It counts the keys held when it was asked that
        are still held when their chunk's turn comes, at their value then. ``await
        beat(looked_at, of)`` every ``beat_s`` while it runs: its length grows with the
        map, so the one who asked waits for the next beat rather than for the whole
        count (``supervisor reshard`` gives each reply ``ASK_TIMEOUT_S``)."""
        tally = LeavingTally(shard_map, self.config.shard_index)
        data = self.store.data
        keys = tuple(self._keys_that_may_leave(shard_map))  # (as ``forget_moved``'s)
        started, busy = time.perf_counter(), 0.0
        looked_at = 0

        async def beating() -> None:  # (on its own timer: however long a chunk's idle)
            while True:
                await asyncio.sleep(beat_s)
                try:
                    await beat(looked_at, len(keys))
                except Exception as exc:  # noqa: BLE001 - the asker left: the count goes on
                    log.debug("routing: the count's beat not sent (%s)", exc)
                    return

        beater = asyncio.ensure_future(beating()) if beat is not None else None
        try:
            for looked_at in range(0, len(keys), FORGET_CHUNK):
                began = time.perf_counter()
                # (those still held, as they stand when the chunk's turn comes)
                tally.add_keys(self._countable(keys[looked_at:looked_at + FORGET_CHUNK]),
                               data)
                took = time.perf_counter() - began
                busy += took
                # (idle ``COUNT_IDLE`` times as long as the chunk took: a quarter of a core
                # at most, every shard's active counting at once beside the writes)
                await asyncio.sleep(max(took * COUNT_IDLE, COUNT_PAUSE_S))
        finally:
            if beater is not None:
                beater.cancel()
        owners = tally.slot_owners()  # (kept as long as the owner cache would keep them)
        self.slot_owners = (shard_map, owners) if len(owners) <= OWNER_CACHE_MAX else None
        rows = tally.rows()
        log.info("routing: counted %d keys for epoch %d in %.2f s (%.2f s of the loop): %s "
                 "would leave", len(keys), shard_map.epoch, time.perf_counter() - started,
                 busy, sum(k for k, _ in rows.values()))
        return rows

    @property
    def routing_epoch(self) -> int:
        """The epoch of the routing this server follows (0: none)."""
        return self.shard_map.epoch if self.shard_map is not None else 0

    def _forwarded(self, key: bytes) -> bool:
        """Whether a KVSET for ``key`` (not owned here) went on to its shard."""
        return (self.active and self.shard_map is not None
                and self.shard_map.owner(key) in self.forwards)

    def owns(self, key: bytes, frames: list[bytes] | None = None) -> bool:
        """Whether this shard owns ``key``; if not, its KVSET ``frames`` go on to the
        shard the key moved to (``forward_moved``), else the drop is counted
        ``not_owner``."""
        cache = self.owner_cache
        if cache is None or cache.owns(key):
            return True
        if frames is not None and self.forwards and self.active and self.forward_moved(
                key, frames):
            return False
        self.drops.drop("not_owner", f"key {key[:64]!r} belongs to shard "
                                     f"{cache.shard_map.owner(key)}, not {cache.index}")
        return False

    def publish_deletes(self, deletes) -> int:
        """Keys' expiries, each ``(key, seq)`` already applied to the store: logged and
        published in one burst (``flush``). How many."""
        count = 0
        staged = self.staged
        for key, seq in deletes:
            if len(key) > self._fast_limit:  # a key recovered from disk, never published
                self._lower_mark(self.marks.published(len(key)))
            # (a key a move staged here expires as its copy would: not to our clients)
            if key in staged:
                self._staged_out += 1
                self._log_and_publish(seq, key, b"", chp.STAGED, b"", None)
            else:
                self._log_and_publish(seq, key, b"", b"", b"", None)
            count += 1
        self.flush()
        return count

    def expire_due(self) -> int:
        """The TTL timer fired: the store's due keys are deleted and published (none
        while not active). How many."""
        if not self.active:
            return 0
        return self.publish_deletes(self.store.pop_expired(time.time()))

    # ================================================================ periodic duties
    def on_beat(self) -> None:
        """Every heartbeat (``clonemap.shards.heartbeat``): heap pages back after snapshots, the
        applied-UUID table's ageing, and the TTL timer re-armed (a wall-clock step could
        have moved the earliest expiry)."""
        self.snapshots.give_back()
        self.applied.tick(time.monotonic())
        for reader in (self._router, self._collector):  # a missed wake-up waits a beat at most
            if reader is not None:
                reader.look_again()
        if self.hold is not None and self.hold.expired(time.monotonic()):
            log.warning("move: a hold of %d writes was neither sealed nor released within "
                        "its safety bound: applying them here", len(self.hold.frames))
            self.release_hold()
        if self.active:
            self.expiry.arm()

    # ================================================================ snapshots
    def on_snapshot_request(self, frames: list[bytes]) -> None:
        """A message on P (ICANHAZ): ``clonemap.shards.snapshots.SnapshotService``."""
        self.snapshots.on_request(frames)

    # ================================================================ stats
    def stats(self) -> dict:
        """Counters for the control plane, the supervisor's metrics and ``supervisor
        status`` (JSON-able), the role's merged in."""
        store = self.store
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
            "staged": len(self.staged),
            "updates": store.seq - self.expiry.expired,
            "ttl_keys": store.ttl_keys,
            "ttl_expired": self.expiry.expired,
            "writes": dict(self.writes),
            "applied_uuids": len(self.applied),
            "applied_uuids_window": [self.applied.half, self.applied.max_age_s / 2],
            **self.snapshots.stats(),
            "hugz_sent": self.heartbeat.sent,
            "hugz_welcome": self.heartbeat.welcomed,
            "recent": self.recent.stats(),
            "pub_hwm": self.marks.pub_hwm,
            "collect_hwm": self.marks.collect_hwm,
            "largest_published_bytes": self.marks.pub_mark,
            "largest_received_bytes": self.marks.collect_mark,
            "pub_mark": self._pub_mark.stats() if self._pub_mark is not None else None,
            "collect_mark": (self._collect_mark.stats() if self._collect_mark is not None
                             else None),
            "move": ({"imports": [i.stats() for i in self.importing],
                      "hold": self.hold.stats() if self.hold else None,
                      "forwarding": {str(i): f.forwarded for i, f in self.forwards.items()}}
                     if self.importing or self.hold is not None or self.forwards
                     else None),
            "routing": (None if self.shard_map is None else
                        {"shard_index": self.config.shard_index,
                         "shards": self.shard_map.shards,
                         "epoch": self.shard_map.epoch,
                         "provisional": self.routing_provisional,
                         "background": self.in_background,
                         "digest": self.shard_map.digest(),
                         "owner_slots": len(self.owner_cache.slots)
                         if self.owner_cache else 0}),
            "drops": drops,
            "access": self.gate.stats() if self.gate.enforcing else None,
            "drops_total": sum(drops.values()),
            "persist": self.persist.stats() if self.persist is not None else None,
            "disk_error": self.disk_error,
            "handler_errors": self.handler_errors(),
            "late_reads": self.late_reads(),
            "rss_bytes": self.process.memory_info().rss,
            "uptime_s": round(time.monotonic() - self.started_s, 3),
            "frame_path": zio.FRAME_PATH,
            "send_guard": zio.send_guard_stats(),
        }
        out.update(self.role.stats())
        return out


_UNSEEN = object()
"""A routing slot ``OwnerCache`` has not placed yet (``LeavingTally.add_keys``)."""


class LeavingTally:
    """The keys and bytes that a routing takes off one shard, by the shard it places
    them on (``ShardServer.keys_leaving``), added up from any runs of keys of a map.
    The owner of each routing slot is asked once where a slot's keys all go to one shard
    (no pin under it)."""

    __slots__ = ("_cache", "_owner", "_owners", "_out", "_index")

    def __init__(self, shard_map, index: int, max_slots: int = OWNER_CACHE_MAX):
        """``max_slots``: the slots its owner cache keeps (``OwnerCache``)."""
        self._cache = OwnerCache(shard_map, index, max_slots)
        self._owner = shard_map.owner
        self._owners: dict[bytes, int] = {}
        self._out: dict[int, list[int]] = {}
        self._index = index

    def slot_owners(self) -> dict[bytes, int]:
        """The owner of every routing slot the tally saw whole (no pin under it), this
        shard's included: what a move's export asks again of each key
        (``OwnerCache``'s ``known``)."""
        owners = {slot: self._index for slot, owned in self._cache.slots.items()
                  if owned is True and slot[-1:] == b"/"}
        owners.update(self._owners)
        return owners

    def add_keys(self, keys, data: dict) -> None:
        """Count each of ``keys`` that ``data`` holds and the routing places on another
        shard, with its bytes (key and ``data[key]``). The per-key work is in C where it
        can be: each key's slot, and what the owner cache knows of it, are C-level maps,
        and only the keys whose slot does not stay here (or is not known yet) take a
        Python step. On ``bench reshard``'s keys (a growth 2 -> 3 keeps two keys in
        three on a source) it takes 0.66-0.71 us a key, where a Python step for every
        key took 0.87-1.08 (500,770 keys, this 2-core host, idle)."""
        cache = self._cache
        known = cache.slots
        keys = list(filter(data.__contains__, keys))
        slots = list(map(cache.slot, keys))
        flags = list(map(known.get, slots, repeat(_UNSEEN)))
        owner, owners, out, index = self._owner, self._owners, self._out, self._index
        owns = cache.owns
        for key, slot, flag in compress(zip(keys, slots, flags),
                                        map(is_not, flags, repeat(True))):
            if flag is _UNSEEN:  # (asked once; the cache remembers the slot)
                if owns(key):
                    continue
                flag = known.get(slot)
            if flag is False and len(slot) < len(key):  # the whole slot goes
                to = owners.get(slot)
                if to is None:
                    to = owners[slot] = owner(key)
            else:  # the slot is the whole key, or a pin under it decides per key
                to = owner(key)
                if to == index:
                    continue
            row = out.get(to)
            if row is None:
                row = out[to] = [0, 0]
            row[0] += 1
            row[1] += len(key) + len(data[key])

    def rows(self) -> dict[int, tuple[int, int]]:
        return {i: (k, b) for i, (k, b) in self._out.items()}
