"""A Binary Star server: a ``ShardServer`` driven by the pure machine in ``shards.bstar``.

Sockets beyond the CHP server's P, P+1, P+2 (all on the server's context and loop)::

    P+3      PUB     this server's state (shards.common.proto.bstar), every heartbeat and at once
                     on a change; a passive's BSTAR-HAVE confirmations (synchronous replication)
    peer P+3 SUB     the peer's state -> bstar.step -> effects; its BSTAR-HAVE -> the link
    peer P+1 SUB     the active's updates  } owned by shards.replica.Follower, used while
    peer P   DEALER  the active's snapshot } passive
    peer P   DEALER  the link (BSTAR-FOLLOW out, BSTAR-UPD in): synchronous replication

With ``--coordination`` (a pair across hosts) the pair also holds a lease in etcd
(``shards.coord``; the machine's leased rules L1-L4): ``fenced`` stops every publish past
the lease's deadline, and with synchronous replication (``park_for_peer``, the active's
side in ``shards.sync_link``) a batch's KVPUBs and replies wait until the passive confirms
it holds the batch, or until this server has recorded in etcd that it goes on alone
(shards/README.md, *Pairs across hosts*).

The shell performs the machine's effects:

* ``PublishState``: publish the state message (with this server's sequence) on P+3.
* ``BecameActive``: stop following, first handling whatever the dead active's stream still
  holds in the SUB (``Follower.drain``), ``set_active(True)``, then apply and publish what
  is still in the pending table, in arrival order, continuing the sequence. The TTL timer
  is armed for the replica's absolute expiry times.
* ``BecamePassive``: ``set_active(False)`` and synchronise the replica (``Follower``).
* ``AcceptRequest`` / ``RefuseRequest``: the answer of ``admit_snapshot_request`` (an
  ICANHAZ is the client's vote; a refused one is not answered at all).
* ``Fatal``: log one clear line, stop serving and set ``done``; ``python -m shards`` exits 1.
* ``SplitBrainSurvived``: log it; ``IgnoredPeer``: counted as a drop.

Pending table (``shards.pending.PendingTable``, keyed by UUID, bounded by count and age,
O(1)): while not active, every valid KVSET heard on this server's collector is kept until
the active's KVPUB with the same UUID arrives. A relative ``ttl`` is turned into an
absolute ``expires`` at arrival, so an update applied at takeover expires when the client
meant. The table is emptied when a synchronisation starts: what was heard before it is in
the snapshot (or was never taken by the active). A KVSET with an empty UUID cannot be
matched: it is not tracked (``pending.untracked``), never an error. At takeover, an entry
heard more than ``pending_grace_s`` before the old active's last message is stale (the
active had time to publish it and did not: e.g. a KVSET a client's socket queued while
this server was down and delivered on reconnection): dropped and counted, never replayed
over newer values. A KVSET for a key this shard does not own (``--routing``) is not held:
it is dropped and counted ``not_owner``, as the active does.

Active side: a ``BSTAR-TTL?`` request on P (``shards.replica``) is answered with the
absolute expiry times, so a passive's snapshot keeps its TTLs: a point-in-time copy of
the store's expiry index (one C-level copy, ~25 ms per million TTL keys) streamed in
chunks of ``bstar_ttl.CHUNK_ENTRIES``, one chunk per peer per loop turn, so collecting
and publishing go on between chunks (``TtlStream`` on a ``shards.streams.StreamPump``, the
same pump that streams snapshots; the frames are in
``shards.common.proto.bstar_ttl``). A full pipe pauses the stream; a peer that accepts nothing
for ``snapshot_stall_s``, or has gone, is dropped (the passive's sync deadline restarts
it), and a server that stops being active drops its streams.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

import zmq

from shards import bstar, coord

from shards.common import zio
from shards.common.errors import ProtocolError
from shards.pending import MAX_AGE_S, MAX_BYTES, MAX_ENTRIES, HeldWrite, PendingTable
from shards.persist.recovery import fork_point
from shards.common.proto import bstar as wire
from shards.common.proto import bstar_ttl, chp
from shards.common.proto.bstar import FOLLOW, HAVE
from shards.replica import Follower
from shards.sync_link import SyncLink
from shards import streams
from shards.server import ShardServer
from shards.server_config import ServerConfig
from shards.snapshots import largest_entry
from shards.store import Store, ttl_props

log = logging.getLogger("shards.pair")

STATE_OFFSET = 3
DEFERRED_MAX = 256
"""Votes kept while the lease is being acquired (one per requester, the latest)."""
DEFERRED_AGE_S = 2.5
"""A deferred vote older than this is not answered: its client (snapshot timeout 3 s)
has asked again, or moved on."""
STATE_SUBSCRIPTION_MAX = 64 << 10
"""``ZMQ_MAXMSGSIZE`` of the state PUB on P+3: its one honest peer subscribes to
everything (a 1-byte frame), but libzmq applies the limit to the security handshake's
commands too (CURVE's INITIATE carries metadata: 256 B cut every CURVE pair off), so
the limit is 64 KiB, far below the 64 MiB frames it is there for."""
"""The state PUB is on P+3."""
PENDING_GRACE_HEARTBEATS = 2
PENDING_GRACE_MIN_S = 1.0


def pending_grace_s(heartbeat_s: float) -> float:
    """At takeover, a pending update heard more than this long before the old active's
    last KVPUB/HUGZ is stale (the active had time to publish it) and is dropped: two
    heartbeats, at least ``PENDING_GRACE_MIN_S`` (an active under load publishes late)."""
    return max(PENDING_GRACE_HEARTBEATS * heartbeat_s, PENDING_GRACE_MIN_S)
TTL_STREAMS_MAX = 4
"""BSTAR-TTL tables streamed at once: a peer's second request replaces its first; more
peers than this (there is normally one) drop the oldest."""
FATAL_LINGER_BEATS = 2
"""After a same-role fatal, the state is still published this many heartbeats."""


def parse_peer(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (PORT the peer's base P) -> (host, port). Raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    try:
        port_n = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: port {port!r} is not a number") from None
    if not 1 <= port_n <= 65532:
        raise ValueError(f"{text!r}: port must be 1..65532 (it uses P..P+3)")
    return host, port_n


class TtlStream:
    """One BSTAR-TTL table streamed to one passive peer (a ``shards.streams`` stream):
    a point-in-time copy of the expiry index (never mutated later, so an iterator over it
    can span loop turns), one chunk per turn."""

    __slots__ = ("identity", "seq", "generation", "history", "entries", "left", "frames",
                 "counters", "uuids")

    def __init__(self, identity: bytes, seq: int, expiries: dict[bytes, float],
                 generation: str, counters: dict[str, int],
                 history: tuple[tuple[int, int], ...] = (), uuids: list = ()):
        self.uuids = uuids
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
            chunk = list(itertools.islice(self.entries, bstar_ttl.CHUNK_ENTRIES))
            self.left -= len(chunk)
            self.frames = bstar_ttl.encode_chunk(self.seq, chunk, last=self.left <= 0,
                                                 generation=self.generation,
                                                 history=self.history, uuids=self.uuids)
        try:
            zio.send_frames(sock, [self.identity, *self.frames])
        except zmq.Again:  # the peer's pipe is full: the pump retries, or abandons
            return streams.BLOCKED
        self.frames = None
        self.counters["chunks"] += 1
        return streams.DONE if self.left <= 0 else streams.PROGRESS

    def close(self) -> None:
        self.entries = iter(())


def pair_server(config: ServerConfig, **options) -> ShardServer:
    """A server of a Binary Star pair: the reactor with a ``BinaryStar`` role."""
    return ShardServer(config, BinaryStar(config, **options))


class BinaryStar:
    """The role of one server of a Binary Star pair (``role`` "primary" or "backup"):
    see the module doc, and ``shards.roles`` for what the reactor asks of it."""

    decides_writes = True
    expires_keys = True

    def __init__(self, config: ServerConfig, *, role: str, peer: tuple[str, int],
                 shard: str = "0", pending_max: int = MAX_ENTRIES,
                 pending_age_s: float = MAX_AGE_S, pending_max_bytes: int = MAX_BYTES,
                 split_brain_survivor: bool = True,
                 sync_timeout_s: float | None = None,
                 coordination: list[tuple[str, int]] | None = None,
                 lease_s: float = coord.LEASE_S, lease_name: str | None = None,
                 replication: str = "sync"):
        if role not in ("primary", "backup"):
            raise ValueError(f"role must be primary or backup, not {role!r}")
        self.name = role
        self.config = config
        self.server: ShardServer | None = None
        """The reactor this role runs in (``attach``)."""
        self.shard = shard
        self.peer = peer
        self.pending = PendingTable(pending_max, pending_age_s, pending_max_bytes)
        self.split_brain_survivor = split_brain_survivor
        self.machine: bstar.Machine | None = None
        self.fatal = ""
        self.done = asyncio.Event()
        self.pending_applied = 0
        self.pending_stale = 0
        self.takeovers = 0
        self.refused_votes = 0
        self.split_brains_survived = 0
        self._state_pub: zmq.Socket | None = None
        self._state_sub_sock: zmq.Socket | None = None
        self._state_sub: zio.AsyncSocket | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self.sync_timeout_s = (max(2.0, 10 * config.heartbeat_s) if sync_timeout_s is None
                               else sync_timeout_s)
        self.follower: Follower | None = None
        """The passive's replica of the active's map (made in ``attach``)."""
        self.ttl_streams: streams.StreamPump | None = None
        """BSTAR-TTL replies being streamed (made in start(), on the loop)."""
        self.ttl_counters = dict.fromkeys(("tables", "chunks"), 0)
        self.history: list[tuple[int, int]] = []
        """The term history of this server's map: ``(term, first sequence)`` for each
        takeover its map went through, oldest first (``shards.persist.fork_point``)."""
        self._recovered_term = 0
        self._saved_term = 0
        self.dropped_updates = 0
        self.needs_peer = False
        """This server's map was unreadable (moved aside): it serves only after it has
        installed and written its peer's (``bstar`` rule 8)."""
        self._install_job = None
        """The compaction writing the map installed from the active (``replace_store``)."""
        self.lease: coord.Lease | None = None
        """Leased mode (``--coordination``): this pair's lease in etcd (``shards.coord``);
        the machine's rules L1-L4 and the fence in ``fenced``."""
        if coordination:
            me = f"{role}@{config.host}:{config.port}"
            self.lease = coord.Lease(coord.Etcd(coordination, timeout_s=min(1.0, lease_s / 4)),
                                     lease_name or f"shard-{shard}", me, lease_s=lease_s,
                                     on_change=self._lease_changed)
        self._fence_handle: asyncio.TimerHandle | None = None
        if replication not in ("sync", "async"):
            raise ValueError(f"replication must be sync or async, not {replication!r}")
        self.sync = self.lease is not None and replication == "sync"
        """Synchronous replication (a leased pair, by default): a KVPUB, and so an
        acknowledgement, goes out only once the passive holds its update (see the module
        doc); without a lease, Binary Star's asynchronous replica as before."""
        self.gates_publish = self.lease is not None
        """A leased pair is asked before each batch: fenced past its lease, parked until
        the passive confirms (synchronous replication)."""
        self.link: SyncLink | None = None
        """The active's side of synchronous replication (``shards.sync_link``); what a
        fenced server keeps unpublished waits there too, whatever the replication."""
        self.lease_closed = False
        self._snapshot_waiting: list[list[bytes]] = []
        """ICANHAZ requests waiting for the passive to confirm what is parked."""
        self._deferred: dict[bytes, tuple[list[bytes], float]] = {}
        """Leased mode: ICANHAZ votes that wait for the lease, by requester (``DEFERRED_MAX``)."""
        self.unacknowledged_dropped = 0
        """Updates applied and never published (so never acknowledged), dropped when this
        server's map was replaced by its peer's (``SyncLink.drop``)."""
        self.fenced_batches = 0

    def attach(self, server: ShardServer) -> None:
        self.server = server
        self.follower = Follower(self, server, self.peer[0], self.peer[1], shard=self.shard,
                                 sync_timeout_s=self.sync_timeout_s, pending=self.pending,
                                 confirm=self.confirm_replica if self.sync else None)
        self.link = SyncLink(server, self, timeout_s=max(1.0, 2 * self.config.heartbeat_s))

    @property
    def peer_text(self) -> str:
        return f"{self.peer[0]}:{self.peer[1]}"

    # ================================================================ set-up
    def bind(self) -> None:
        """After the reactor's P..P+2: bind P+3; connect to the peer's P+3 (on a failure
        the reactor closes everything)."""
        server = self.server
        pub = server.socket(zmq.PUB)
        pub.setsockopt(zmq.MAXMSGSIZE, STATE_SUBSCRIPTION_MAX)  # the peer subscribes to ""
        server.bind_socket(pub, self.config.endpoint(STATE_OFFSET))
        self._state_pub = pub
        self._state_sub_sock = server.connect(
            zmq.SUB, f"tcp://{self.peer[0]}:{self.peer[1] + STATE_OFFSET}",
            ((zmq.SUBSCRIBE, b""),))

    def start(self) -> None:
        """After the reactor started (inactive until the machine says so)."""
        now = self.server.loop.time()
        self.machine = bstar.new_machine(
            wire.Role.PRIMARY if self.name == "primary" else wire.Role.BACKUP, now,
            heartbeat_s=self.server.config.heartbeat_s, shard=self.shard,
            split_brain_survivor=self.split_brain_survivor, term=self._recovered_term,
            data_seq=self.server.store.seq, needs_peer=self.needs_peer,
            leased=self.lease is not None)
        if self.lease is not None:
            self.lease.start()
        self.ttl_streams = streams.StreamPump(
            self.server.loop, self.server._router_sock, self.server._router.kick,
            stall_s=self.server.config.snapshot_stall_s, max_active=TTL_STREAMS_MAX, evict=True,
            name="BSTAR-TTL table")
        self._state_sub = zio.AsyncSocket(self._state_sub_sock, self.on_peer_state, batch=64,
                                          loop=self.server.loop, name="peer state")
        self.follower.open()
        self.on_tick()

    def close(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if self._fence_handle is not None:
            self._fence_handle.cancel()
            self._fence_handle = None
        if self.lease is not None:
            self.lease_closed = True
            self.server.set_active(False)  # nothing more is acknowledged, then the lease goes
            self.lease.close()
        if self.follower is not None:
            self.follower.close()
        if self.ttl_streams is not None:
            self.ttl_streams.clear()
        if self._state_sub is not None:
            self._state_sub.close(linger=0)
            self._state_sub = None
        # (the reactor then destroys its context: the P+3 PUB and anything left)

    def recovered(self, term: int, history: list[tuple[int, int]],
                  needs_peer: bool = False) -> None:
        """Before ``start``: the Binary Star term and term history persisted with the map
        just recovered (the start-up election compares (term, sequence)); ``needs_peer``:
        the directory's map was unreadable and moved aside (``bstar`` rule 8)."""
        self._recovered_term = self._saved_term = term
        self.history = list(history)
        self.needs_peer = needs_peer

    def _save_terms(self) -> None:
        if self.server.persist is None or self.machine is None:
            return
        self._saved_term = self.machine.term
        try:
            self.server.persist.save_terms(self.machine.term, self.history)
        except OSError as exc:
            log.error("shard %s: cannot save the term in %s: %s", self.shard,
                      self.server.persist.path, exc)

    # ================================================================ machine
    def _step(self, event) -> list:
        now = self.server.loop.time()
        if self.lease is not None:
            self.machine = bstar.with_sequence(self.machine, self.server.store.seq)
        self.machine, effects = bstar.step(self.machine, event, now)
        accepted = False
        for effect in effects:
            accepted = self._perform(effect, now) or accepted
        if self.machine.term != self._saved_term:
            self._save_terms()
        if self.lease is not None:
            self.lease.want(bstar.lease_wanted(self.machine))
        self._arm_tick()
        return accepted

    # ================================================================ the lease
    def _lease_changed(self, view: coord.LeaseView) -> None:
        """From the lease's thread: hand the change to the loop."""
        loop = self.server.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._check_lease)
            except RuntimeError:  # the loop closed in between
                pass

    def _check_lease(self) -> None:
        """On the loop: step LEASE_ACQUIRED / LEASE_LOST as the lease's view says, and keep
        a timer at the fencing deadline."""
        if self.machine is None or self.fatal or self.lease is None or self.lease_closed:
            return
        now = time.monotonic()
        valid = self.lease.valid(now)
        if valid and not self.machine.lease_held:
            self._step(bstar.Event.LEASE_ACQUIRED)
        elif not valid and self.machine.lease_held:
            log.warning("shard %s: %s fenced: its lease is not renewed (%s); it stops "
                        "acknowledging", self.shard, self.name,
                        self.lease.view.error or "expired")
            self._step(bstar.Event.LEASE_LOST)
        if self._fence_handle is not None:
            self._fence_handle.cancel()
            self._fence_handle = None
        if self.machine.lease_held:
            # the loop's clock is time.monotonic, as the lease's
            self._fence_handle = self.server.loop.call_at(
                max(self.lease.view.valid_until, now + 0.001), self._check_lease)

    def link_options(self, sock: zmq.Socket) -> None:
        """A pair across hosts (leased): ZMTP heartbeats on every socket (the pair's state
        link, the replica's links, the clients' connections), so that a link a partition
        stalled is dropped and made again within about three heartbeats of the heal."""
        if self.lease is not None:
            zio.link_heartbeats(sock, self.server.config.heartbeat_s)

    def _lease_ran_out(self) -> bool:
        """Holding the lease by the machine's account, but past its deadline now."""
        return (self.lease is not None and self.machine is not None
                and self.machine.lease_held and not self.lease.valid(time.monotonic()))

    def fenced(self) -> bool:
        """Asked before publishing (acknowledging) anything: past the lease's deadline
        nothing goes out; the machine hears LEASE_LOST at once."""
        if not self._lease_ran_out():
            return False
        self.fenced_batches += 1
        if self.server.loop is not None:
            self.server.loop.call_soon(self._check_lease)
        return True

    def _perform(self, effect, now: float) -> bool:
        """Perform one of the machine's effects; True for AcceptRequest (answer it)."""
        match effect:
            case bstar.PublishState():
                self._publish_state()
            case bstar.AcceptRequest():
                return True
            case bstar.RefuseRequest(reason=reason):
                self.refused_votes += 1
                log.debug("shard %s: ICANHAZ refused: %s", self.shard, reason)
            case bstar.BecameActive():
                self.on_become_active(effect, now)
            case bstar.BecamePassive():
                self.on_become_passive(effect, now)
            case bstar.Fatal():
                self.on_fatal(effect)
            case bstar.SplitBrainSurvived(reason=reason, detail=detail):
                self.split_brains_survived += 1
                log.warning("shard %s: %s survived: %s", self.shard, reason, detail)
            case bstar.IgnoredPeer(reason=reason, detail=detail):
                self.server.drops.drop("peer_" + reason.replace(" ", "_"), detail)
            case _:
                raise TypeError(f"not a Binary Star effect: {effect!r}")
        return False

    def _publish_state(self) -> None:
        frames = wire.encode(bstar.state_message(self.machine, self.server.store.seq))
        try:
            zio.send_frames(self._state_pub, frames)
        except zmq.Again:  # a PUB never blocks; kept for safety
            self.server.drops.drop("state_hwm", "state message not sent")

    def _arm_tick(self) -> None:
        if self.machine is None or self.server.loop is None or self.fatal:
            return
        when = min(bstar.next_wakeup(self.machine), self.server.loop.time() + self.server.config.heartbeat_s)
        if self._tick_handle is not None:
            if self._tick_handle.when() <= when:
                return
            self._tick_handle.cancel()
        self._tick_handle = self.server.loop.call_at(when, self.on_tick)

    def on_tick(self) -> None:
        """The machine's TICK (publishes state when due), sync deadlines, pending ageing."""
        self._tick_handle = None
        now = self.server.loop.time()
        self.pending.expire(now)
        self.follower.on_tick(now)
        self._step(bstar.Event.TICK)

    def on_peer_state(self, frames: list[bytes]) -> None:
        """A state message, or a replica's confirmation, from the peer's P+3."""
        if wire.is_confirmation(frames):
            self.on_confirmation(frames)
            return
        try:
            msg = wire.decode(frames)
        except ProtocolError as err:
            self.server.drops.drop("peer_" + err.reason, str(err))
            return
        self._step(msg)

    # ================================================================ transitions
    def on_become_active(self, effect: bstar.BecameActive, now: float) -> None:
        drained = self.follower.drain()  # what the old active published before it died
        self.follower.stop()
        self.takeovers += 1
        # this term's updates start here (what a restarted peer compares its log with)
        self.history.append((effect.term, self.server.store.seq + 1))
        self._save_terms()
        self.server.set_active(True)
        self.link.resume(self.sync)  # first: it holds lower sequences than anything below
        pending = self.pending.drain(now)
        # An update the active heard too and had time to publish, but did not, is stale:
        # typically a KVSET a client's socket queued while this server was down and
        # delivered when it came back, long since published by the active (and so never
        # confirmed here). Re-applying it would overwrite newer values.
        heard = self.follower.last_heard
        cutoff = heard - pending_grace_s(self.server.config.heartbeat_s) if heard else None
        stale = 0
        for entry in pending:
            if cutoff is not None and entry.added_at < cutoff:
                stale += 1
                continue
            self.server.apply_write(*entry.update)  # a HeldWrite: decoded when heard
        self.server._flush_log()  # publish them now: this is not a collector batch
        self.pending_applied += len(pending) - stale
        self.pending_stale += stale
        if self._deferred:  # after this step's effects: a vote is a step of its own
            self.server.loop.call_soon(self._answer_deferred)
        if self.sync:
            self.link.go_alone_now()  # after taking over from a silent peer
        log.warning("shard %s: %s is ACTIVE (%s, was %s, term %d): %d late updates from the "
                    "old active, %d pending updates applied (%d stale dropped), sequence now "
                    "%d", self.shard, self.name, effect.reason, effect.previous.name,
                    effect.term, drained, len(pending) - stale, stale, self.server.store.seq)

    def on_become_passive(self, effect: bstar.BecamePassive, now: float) -> None:
        self.server.set_active(False)
        self._deferred.clear()
        self._snapshot_waiting.clear()  # their clients ask the new active
        self.link.keep_unpublished(now)
        self.ttl_streams.clear()
        log.info("shard %s: %s is PASSIVE (%s, was %s)", self.shard, self.name,
                 effect.reason, effect.previous.name)
        self.follower.start_sync(now)

    def on_fatal(self, effect: bstar.Fatal) -> None:
        self.fatal = f"{effect.reason}: {effect.detail}"
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        self.server.set_active(False)
        self.follower.stop()
        log.error("shard %s: FATAL Binary Star %s (%s server on port %d): %s", self.shard,
                  effect.reason, self.name, self.server.config.port, effect.detail)
        if effect.reason in ("dual primary", "dual backup"):
            # Both must exit; the peer may not have heard us yet (it may have started just
            # now): keep telling it for two more heartbeats. (A split-brain loser stays
            # silent: the survivor must not take it for a live peer.)
            self._linger(FATAL_LINGER_BEATS)
        else:
            self.done.set()

    def _linger(self, beats: int) -> None:
        self._publish_state()
        if beats <= 0:
            self.done.set()
            return
        self._tick_handle = self.server.loop.call_later(self.server.config.heartbeat_s, self._linger,
                                                 beats - 1)

    # ================================================================ the replica (its sink)
    @property
    def seq(self) -> int:
        return self.server.store.seq

    def apply(self, msg: chp.Kvpub, expiry_s: float | None) -> None:
        """The active's update, applied here with its sequence and logged; kept for
        resumes, so a client that fails over to this server resumes instead of taking a
        snapshot, and its UUID, so that a resend is applied once."""
        server = self.server
        server.store.apply(msg.key, msg.value, expiry_s)
        resendable = chp.is_resendable(msg.uuid)
        if server.persist is not None:  # the active's stream, with its sequences
            server.log_applied(msg.seq, msg.key, msg.value, expiry_s,
                               msg.uuid if resendable else b"")
        if server._remember is not None:
            server._remember(msg.seq, msg.key, msg.uuid, msg.props, msg.value)
        if resendable:
            server.applied.add(msg.uuid, msg.seq)

    def install(self, store: Store, generation: str = "",
                history: tuple[tuple[int, int], ...] = (), uuids: list = ()) -> None:
        """The replica is complete: serve ``store``, whose map is the active's
        ``generation`` (kept when the active sent none), term ``history`` and applied
        ``uuids`` (``[uuid, seq, ...]``, as of ``store.seq``). A durable
        server rewrites its data directory from it; updates of its own that the active's
        map never had (``persist.fork_point``) are kept in a ``dropped-*`` file."""
        server = self.server
        old_seq = server.store.seq
        self.unacknowledged_dropped += self.link.drop()
        server.store = store
        server.snapshot_entries(largest_entry(store))
        server.recent.reset(store.seq)  # resumes from this map only
        server.applied.clear(time.monotonic())
        server.applied.load(uuids)
        if server.persist is not None:
            fork = fork_point(self.history, list(history)) if history else None
            dropped_from = fork if fork is not None and fork <= old_seq else None
            replaced = server.persist.replace(store, generation or server.generation,
                                              dropped_from, server.applied.items_upto(store.seq))
            if replaced is None:  # a disk error (reported: this server stops)
                return
            dropped, self._install_job = replaced
            if dropped:
                self.dropped_updates += dropped
                log.warning("shard %s: %d updates of this server's map (sequence %d..%d, "
                            "never in the active's map) were dropped; kept in %s/dropped-*",
                            self.shard, dropped, dropped_from, old_seq, server.persist.path)
        if history:
            self.history = list(history)
            self._save_terms()
        if generation and generation != server.generation:
            log.info("shard %s: map generation %s (the active's; was %s)", self.shard,
                     generation, server.generation)
            server.generation = generation

    def on_compacted(self, job) -> None:
        """A snapshot is whole on disk. The one that wrote the map installed from the
        active ends the ``needs-peer`` rule: this server holds a valid copy again."""
        if job is not self._install_job:
            return
        self._install_job = None
        if self.needs_peer and self.server.persist is not None:
            from shards.persist.recovery import peer_copy_written

            peer_copy_written(self.server.persist.path)
            self.needs_peer = False
            if self.machine is not None:
                self.machine = bstar.peer_copied(self.machine)
            log.warning("shard %s: the peer's map (%d keys, sequence %d) is written here: "
                        "this server holds a valid copy again", self.shard, len(self.server.store),
                        self.server.store.seq)

    # ================================================================ the reactor's questions
    def serving(self) -> bool:
        """Whether the machine would accept a client's ICANHAZ now (ACTIVE, or a vote
        that would win): otherwise HUGZ say ``serving=0``."""
        if self.machine is None or self.server.loop is None:
            return False
        return bstar.would_accept(self.machine, self.server.loop.time())

    def admit_snapshot_request(self) -> bool:
        """An ICANHAZ is the client's vote: answered only if the machine accepts it. A
        server that is not ACTIVE first reads the state messages its peer has already
        sent (``hear_peer_now``): after a stall of its loop longer than the peer's expiry
        (two heartbeats), an ICANHAZ read before those messages would find the peer
        "silent" and win the vote against an active that is alive: two actives (seen as
        an intermittent test failure on a 16-core host, the active then exiting)."""
        if self.machine is None or self._lease_ran_out():  # LEASE_LOST is on its way
            return False
        if self.machine.state is not bstar.State.ACTIVE:
            self.hear_peer_now()
        return self._step(bstar.Event.CLIENT_REQUEST)

    def peer_reported_down(self, why: str = "") -> None:
        """The supervisor says the peer cannot serve by itself (a disk error, FAILED):
        a BACKUP that never heard it may take a client's vote (``bstar`` rule 9)."""
        if self.machine is None or self.machine.peer_down:
            return
        self.machine = bstar.peer_reported_down(self.machine)
        log.warning("shard %s: the supervisor reports the peer down%s; a client's vote "
                    "makes this %s serve with its own copy (sequence %d)", self.shard,
                    f" ({why})" if why else "", self.name, self.server.store.seq)

    def hear_peer_now(self) -> int:
        """Step the machine with every state message waiting on the peer SUB (without
        waiting for the loop to get to it); how many."""
        sock = self._state_sub_sock
        if sock is None or sock.closed:
            return 0
        count = 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            count += 1
            self.on_peer_state(frames)
        if count and self._state_sub is not None:
            self._state_sub.kick()  # its reader must not wait on an edge it missed
        return count

    def on_snapshot_request(self, frames: list[bytes]) -> None:
        if len(frames) == 2 and frames[1] == bstar_ttl.REQUEST:
            self.on_ttl_request(frames[0])
            return
        if len(frames) == 3 and frames[1] in (FOLLOW, HAVE):
            self.on_replica_link(frames[0], frames[1], frames[2])
            return
        if self.server._held:  # applied this turn: parked (or published) before deciding
            self.server._flush_log()
        if self.link.awaiting and self.server.active:
            # the map holds writes the passive has not confirmed (never acknowledged):
            # a snapshot waits until they go out (or are dropped), so that no reader
            # ever sees a write that may yet be lost (milliseconds normally; at most
            # until going alone is recorded)
            self._snapshot_waiting.append(frames)
            if len(self._snapshot_waiting) > DEFERRED_MAX:
                self._snapshot_waiting.pop(0)
                self.server.drops.drop("snapshot_waiting_full", "an ICANHAZ waited for the "
                                                         "passive and was dropped")
            return
        self.server.on_snapshot_request(frames)
        if not self.server.active and self.machine is not None and self.machine.wants_lease:
            # a vote that started (or waits on) the acquire: answered at the takeover,
            # so the client is served then instead of after its own snapshot timeout
            self._deferred[frames[0]] = (frames, self.server.loop.time())
            while len(self._deferred) > DEFERRED_MAX:
                self._deferred.pop(next(iter(self._deferred)))

    def unparked(self) -> None:
        """Nothing waits for the passive any more: answer the snapshot requests that
        waited (on the next loop turn: this is called from the publish path)."""
        if self._snapshot_waiting and self.server.loop is not None:
            self.server.loop.call_soon(self._answer_waiting_snapshots)

    def _answer_waiting_snapshots(self) -> None:
        waiting, self._snapshot_waiting = self._snapshot_waiting, []
        for frames in waiting:
            self.on_snapshot_request(frames)

    def _answer_deferred(self) -> None:
        """Just became ACTIVE through the lease: answer the votes that waited for it (those
        younger than ``DEFERRED_AGE_S``: their clients still wait for this reply)."""
        deferred, self._deferred = self._deferred, {}
        if not self.server.active:
            return
        oldest = self.server.loop.time() - DEFERRED_AGE_S
        for frames, at in deferred.values():
            if at >= oldest:
                self.on_snapshot_request(frames)  # waits too while writes are parked

    # ================================================================ synchronous replication
    def on_replica_link(self, identity: bytes, command: bytes, seq_frame: bytes) -> None:
        """``BSTAR-FOLLOW seq`` on P: send every batch to this link from now on (it says
        where batches go, nothing more: only a ``BSTAR-HAVE`` from the peer's own P+3
        confirms anything). A ``BSTAR-HAVE`` on P is dropped and counted: anyone who
        reaches P could forge it."""
        if command != FOLLOW:
            self.server.drops.drop("peer_have_on_p", "BSTAR-HAVE on the snapshot port (it is only "
                                              "taken from the peer's state port)")
            return
        if len(seq_frame) != 8 or not (self.sync and self.server.active):
            self.server.drops.drop("peer_follow_unexpected", "BSTAR-FOLLOW while not a "
                                                      "synchronous active, or malformed")
            return
        self.link.on_follow(identity, int.from_bytes(seq_frame, "big"))

    def on_confirmation(self, frames: list[bytes]) -> None:
        """``BSTAR-HAVE LINK SEQ`` from the peer's P+3 (``shards.sync_link``)."""
        if len(frames) != 3 or len(frames[2]) != 8 or not frames[1]:
            self.server.drops.drop("peer_bad_confirmation", f"{len(frames)}-frame BSTAR-HAVE")
            return
        # a passive's confirmations are for an active; one past its lease publishes
        # nothing, whoever confirmed what
        if self.sync and self.server.active and not self.fenced():
            self.link.on_confirmation(frames[1], int.from_bytes(frames[2], "big"))

    def confirm_replica(self, link_id: bytes) -> None:
        """Passive (the follower's ``confirm``): write what the active's batch brought
        (the log, fsync under always), then say how far this replica goes: ``BSTAR-HAVE``
        on this server's state PUB."""
        self.server._flush_log()
        seq = self.server.store.seq
        try:
            zio.send_frames(self._state_pub, [HAVE, link_id, seq.to_bytes(8, "big")])
        except zmq.Again:  # a PUB never blocks; a lost one is followed by the next
            self.server.drops.drop("state_hwm", "BSTAR-HAVE not sent")

    def park_for_peer(self) -> bool:
        """Synchronous replication: this batch waits until the passive holds it."""
        return self.sync and self.server.active and self.link.park()

    def on_ttl_request(self, identity: bytes) -> None:
        """A passive peer's BSTAR-TTL?: the absolute expiry times at this sequence,
        streamed in chunks (``TtlStream``)."""
        if not self.server.active:
            self.server.snapshots_refused += 1
            return
        self.ttl_counters["tables"] += 1
        seq, expiries = self.server.store.seq, self.server.store.expiries()
        history = tuple(self.history)
        uuids = self.server.applied.items_upto(seq)
        self.ttl_streams.add(identity, lambda: TtlStream(identity, seq, expiries,
                                                         self.server.generation, self.ttl_counters,
                                                         history, uuids))

    def on_collect(self, frames: list[bytes]) -> None:
        """Active: the reactor's write path. Otherwise: keep the KVSET pending by UUID."""
        server = self.server
        if server.active:
            server.on_collect(frames)
            return
        server._note_received(frames)  # the collector's mark holds for a passive too
        self.hold_pending(frames)

    def hold_pending(self, frames: list[bytes]) -> None:
        """A KVSET heard while passive, checked and kept decoded (``HeldWrite``) as the
        active would apply it: a relative ``ttl`` made absolute now, the write terms
        stripped from what its KVPUB will carry."""
        server = self.server
        try:
            kvset = chp.decode_kvset(frames, server._limits)
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
        if self.fatal:
            server.drops.drop("fatal", "KVSET after a fatal Binary Star error")
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
        self.pending.add(kvset.uuid, write, server.loop.time(),
                         len(kvset.key) + len(props) + len(kvset.value))

    def _ttl_stats(self) -> dict:
        pump = self.ttl_streams
        if pump is None:
            return {"active": 0, **self.ttl_counters}
        return {"active": len(pump.active), **self.ttl_counters, **pump.counters}

    def stats(self) -> dict:
        """Merged into the reactor's stats."""
        m = self.machine
        out = {
            "shard": self.shard,
            "role": self.name,
            "bstar_state": m.state.name if m is not None else None,
            "peer": self.peer_text,
            "pid": os.getpid(),
            "term": m.term if m is not None else 0,
            "peer_state": m.peer_state.name if m is not None and m.peer_state else None,
            "fatal": self.fatal,
            "needs_peer": self.needs_peer,
            "peer_reported_down": bool(m is not None and m.peer_down),
            "takeovers": self.takeovers,
            "term_history": [list(pair) for pair in self.history],
            "dropped_updates": self.dropped_updates,
            "refused_votes": self.refused_votes,
            "split_brains_survived": self.split_brains_survived,
            "pending": len(self.pending),
            "pending_bytes": self.pending.bytes,
            "pending_early": self.pending.early_count,
            "pending_applied": self.pending_applied,
            "pending_discarded": self.follower.counters["pending_discarded"],
            "pending_stale": self.pending_stale,
            "pending_counters": dict(self.pending.counters),
            "replica": self.follower.stats(),
            "ttl_streams": self._ttl_stats(),
        }
        if self.sync:
            out["sync_replication"] = self.link.stats()
        if self.lease is not None:
            out["lease"] = {**self.lease.stats(), "fenced_batches": self.fenced_batches,
                            "unacknowledged_dropped": self.unacknowledged_dropped}
        return out
