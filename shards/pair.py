"""A Binary Star server: the ``BinaryStar`` role of a ``clonemap.shards.server.ShardServer``,
driven by the pure machine in ``clonemap.shards.bstar``.

Sockets beyond the reactor's P, P+1, P+2 (all on the server's context and loop)::

    P+3      PUB     this server's state (shards.common.proto.bstar), every heartbeat and at once
                     on a change; a passive's BSTAR-HAVE confirmations (synchronous replication)
    peer P+3 SUB     the peer's state -> bstar.step -> effects; its BSTAR-HAVE -> the link
    peer P+1 SUB     the active's updates  } owned by shards.replica.Follower, used while
    peer P   DEALER  the active's snapshot } passive
    peer P   DEALER  the link (BSTAR-FOLLOW out, BSTAR-UPD in): synchronous replication

With ``--coordination`` (a pair across hosts) the pair also holds a lease in etcd
(``clonemap.shards.leased``; the machine's leased rules L1-L4). The reactor asks ``gate`` for
its verdict on each batch (``clonemap.shards.outbox``): held past the lease's deadline, and,
with synchronous replication (the active's side in ``clonemap.shards.sync_link``), parked
until the passive confirms it holds the batch, or until this server has recorded in etcd
that it goes on alone (shards/README.md, *Pairs across hosts*). ``BSTAR-FOLLOW`` on P (where
the active sends each batch) and ``BSTAR-HAVE`` from the peer's P+3 only (one on P is
dropped and counted: anyone who reaches P could forge it) go to the link.

The role performs the machine's effects:

* ``PublishState``: publish the state message (with this server's sequence) on P+3.
* ``BecameActive``: stop following, first handling whatever the dead active's stream still
  holds in the SUB (``Follower.drain``), ``set_active(True)``, then apply and publish the
  writes still held (``clonemap.shards.held_writes``), in arrival order, continuing the sequence.
  The TTL timer is armed for the replica's absolute expiry times.
* ``BecamePassive``: ``set_active(False)`` and synchronise the replica (``Follower``).
* ``AcceptRequest`` / ``RefuseRequest``: the answer of ``admit_snapshot_request`` (an
  ICANHAZ is the client's vote; a refused one is not answered at all).
* ``Fatal``: log one clear line, stop serving and set ``done``; ``python -m clonemap.shards`` exits 1.
* ``SplitBrainSurvived``: log it; ``IgnoredPeer``: counted as a drop.

Writes heard while passive (``clonemap.shards.held_writes``): every valid KVSET heard on this
server's collector is held, decoded, until the active's KVPUB with the same UUID arrives;
at takeover what is left is applied, except what is stale.

Active side: a ``BSTAR-TTL?`` request on P (``clonemap.shards.replica``) is answered with the
absolute expiry times (``clonemap.shards.ttl_table``), so a passive's snapshot keeps its TTLs.
"""
from __future__ import annotations

import asyncio
import logging
import os

import zmq

from clonemap.shards import bstar, coord

from clonemap.shards.common import zio
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.held_writes import HeldWrites
from clonemap.shards.pending import MAX_AGE_S, MAX_BYTES, MAX_ENTRIES
from clonemap.shards.common.proto import bstar as wire
from clonemap.shards.common.proto import bstar_ttl
from clonemap.shards.common.proto.bstar import FOLLOW, HAVE
from clonemap.shards.replica import Follower
from clonemap.shards.leased import Leased
from clonemap.shards.outbox import Batch, Verdict
from clonemap.shards.pair_map import PairMap
from clonemap.shards.sync_link import SyncLink
from clonemap.shards.ttl_table import TtlTables
from clonemap.shards.server import ShardServer
from clonemap.shards.server_config import ServerConfig

log = logging.getLogger("clonemap.shards.pair")

STATE_OFFSET = 3
"""The state PUB is on P+3."""
STATE_SUBSCRIPTION_MAX = 64 << 10
"""``ZMQ_MAXMSGSIZE`` of the state PUB on P+3: its one honest peer subscribes to
everything (a 1-byte frame), but libzmq applies the limit to the security handshake's
commands too (CURVE's INITIATE carries metadata: 256 B cut every CURVE pair off), so
the limit is 64 KiB, far below the 64 MiB frames it is there for."""
FATAL_LINGER_BEATS = 2
REPLICA_SYNCS_MAX = 16
"""TTL-table requesters remembered until their ICANHAZ (a passive's sync: one at a time)."""
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


def pair_server(config: ServerConfig, **options) -> ShardServer:
    """A server of a Binary Star pair: the reactor with a ``BinaryStar`` role."""
    return ShardServer(config, BinaryStar(config, **options))


class BinaryStar:
    """The role of one server of a Binary Star pair (``role`` "primary" or "backup"):
    see the module doc, and ``clonemap.shards.roles`` for what the reactor asks of it."""

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
        self.held = HeldWrites(pending_max, pending_age_s, pending_max_bytes)
        """Writes heard while passive, applied at takeover (``clonemap.shards.held_writes``)."""
        self.split_brain_survivor = split_brain_survivor
        self.machine: bstar.Machine | None = None
        self.fatal = ""
        self.done = asyncio.Event()
        self.takeovers = 0
        self.term_resyncs = 0
        self._followed_term: int | None = None
        """Passive: the term of the active its replica follows (``_follow_term``)."""
        self.refused_votes = 0
        self.split_brains_survived = 0
        self._state_pub: zmq.Socket | None = None
        self._state_sub_sock: zmq.Socket | None = None
        self._state_sub: zio.AsyncSocket | None = None
        self._tick_handle: asyncio.Handle | None = None
        self._tick_at = 0.0
        """When ``_tick_handle`` fires (loop time)."""
        self.sync_timeout_s = (max(2.0, 10 * config.heartbeat_s) if sync_timeout_s is None
                               else sync_timeout_s)
        self.follower: Follower | None = None
        """The passive's replica of the active's map (made in ``attach``)."""
        self.ttl_tables: TtlTables | None = None
        """BSTAR-TTL replies being streamed (``clonemap.shards.ttl_table``; made in ``attach``)."""
        self.map = PairMap(shard, term=lambda: None if self.machine is None else self.machine.term,
                           drop_parked=self.drop_parked, peer_copied=self.peer_copied)
        """This server's map: its term history, the copy its follower installs and
        updates (``clonemap.shards.pair_map``)."""
        if replication not in ("sync", "async"):
            raise ValueError(f"replication must be sync or async, not {replication!r}")
        self.sync = bool(coordination) and replication == "sync"
        """Synchronous replication (a leased pair, by default): a KVPUB, and so an
        acknowledgement, goes out only once the passive holds its update (see the module
        doc); without a lease, Binary Star's asynchronous replica as before."""
        self.leased: Leased | None = None
        """Leased mode (``--coordination``): the lease, the fence and what waits for them
        (``clonemap.shards.leased``)."""
        if coordination:
            me = f"{role}@{config.host}:{config.port}"
            etcd = coord.Etcd(coordination, timeout_s=min(1.0, lease_s / 4))
            name = lease_name or f"shard-{shard}"
            self.leased = Leased(
                lambda on_change: coord.Lease(etcd, name, me, lease_s=lease_s,
                                              on_change=on_change),
                shard=shard, name=role, heartbeat_s=config.heartbeat_s,
                loop=lambda: self.server.loop if self.server is not None else None,
                machine=lambda: self.machine, step=self._step,
                is_active=lambda: self.server.active,
                parked=lambda: bool(self.link.awaiting),
                answer=self.on_snapshot_request,
                drop=lambda reason, detail: self.server.drops.drop(reason, detail))
        self.gates_publish = self.leased is not None
        """A leased pair is asked before each batch: fenced past its lease, parked until
        the passive confirms (synchronous replication)."""
        self.link: SyncLink | None = None
        """The active's side of synchronous replication (``clonemap.shards.sync_link``); what a
        fenced server keeps unpublished waits there too, whatever the replication."""
        self._replica_syncs: dict[bytes, None] = {}
        """The DEALERs that asked for a TTL table (a passive syncing): their ICANHAZ next
        is answered even while writes are parked."""
        self.unacknowledged_dropped = 0
        """Updates applied and never published (so never acknowledged), dropped when this
        server's map was replaced by its peer's (``SyncLink.drop``)."""

    def attach(self, server: ShardServer) -> None:
        self.server = server
        self.map.attach(server)
        self.follower = Follower(self.map, server, self.peer[0], self.peer[1], shard=self.shard,
                                 sync_timeout_s=self.sync_timeout_s, pending=self.held.table,
                                 confirm=self.confirm_replica if self.sync else None)
        self.link = SyncLink(
            shard=self.shard, name=self.name,
            timeout_s=max(1.0, 2 * self.config.heartbeat_s),
            clock=lambda: server.loop.time(),
            call_later=lambda delay, callback: server.loop.call_later(delay, callback),
            send=self._send_to_passive,
            publish=lambda batch: server.publish_batch(batch, parked=True),
            record_alone=self._record_alone,
            current_seq=lambda: server.store.seq,
            is_active=lambda: server.active,
            may_publish=lambda: server.active and not self.fenced(),
            peer_gone=self._peer_gone,
            unparked=self.leased.unparked if self.leased is not None else lambda: None)
        self.ttl_tables = TtlTables(server)
        self.held.server = server

    @property
    def peer_text(self) -> str:
        return f"{self.peer[0]}:{self.peer[1]}"

    # ================================================================ set-up
    def bind(self) -> None:
        """After the reactor's P..P+2: bind P+3; connect to the peer's P+3 (on a failure
        the reactor closes everything)."""
        server = self.server
        pub = server.sockets.socket(zmq.PUB)
        pub.setsockopt(zmq.MAXMSGSIZE, STATE_SUBSCRIPTION_MAX)  # the peer subscribes to ""
        server.sockets.bind(pub, self.config.endpoint(STATE_OFFSET))
        self._state_pub = pub
        self._state_sub_sock = server.sockets.connect(
            zmq.SUB, f"tcp://{self.peer[0]}:{self.peer[1] + STATE_OFFSET}",
            ((zmq.SUBSCRIBE, b""),))

    def start(self) -> None:
        """After the reactor started (inactive until the machine says so)."""
        now = self.server.loop.time()
        self.machine = bstar.new_machine(
            wire.Role.PRIMARY if self.name == "primary" else wire.Role.BACKUP, now,
            heartbeat_s=self.server.config.heartbeat_s, shard=self.shard,
            split_brain_survivor=self.split_brain_survivor, term=self.map.recovered_term,
            data_seq=self.server.store.seq, needs_peer=self.map.needs_peer,
            leased=self.leased is not None)
        if self.leased is not None:
            self.leased.start()
        self.ttl_tables.start(self.server.router_socket, self.server.kick_router)
        self._state_sub = zio.AsyncSocket(self._state_sub_sock, self.on_peer_state, batch=64,
                                          loop=self.server.loop, name="peer state")
        self.follower.open()
        self.on_tick()

    def close(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if self.leased is not None:
            self.server.set_active(False)  # nothing more is acknowledged, then the lease goes
            self.leased.close()
        if self.follower is not None:
            self.follower.close()
        if self.ttl_tables is not None:
            self.ttl_tables.clear()
        if self._state_sub is not None:
            self._state_sub.close(linger=0)
            self._state_sub = None
        # (the reactor then destroys its context: the P+3 PUB and anything left)

    # ================================================================ machine
    def _step(self, event) -> list:
        now = self.server.loop.time()
        if self.leased is not None:
            self.machine = bstar.with_sequence(self.machine, self.server.store.seq)
        self.machine, effects = bstar.step(self.machine, event, now)
        accepted = False
        for effect in effects:
            accepted = self._perform(effect, now) or accepted
        if self.machine.term != self.map.saved_term:
            self.map.save_terms()
        if self.leased is not None:
            self.leased.want()
        self._arm_tick()
        return accepted

    # ================================================================ the lease
    def link_options(self, sock: zmq.Socket) -> None:
        """A pair across hosts (leased): ZMTP heartbeats on every socket (the pair's state
        link, the replica's links, the clients' connections)."""
        if self.leased is not None:
            self.leased.link_options(sock)

    def fenced(self) -> bool:
        """Asked before publishing anything (``gates_publish``): past the lease's
        deadline nothing goes out (``clonemap.shards.leased``)."""
        return self.leased is not None and self.leased.fenced()

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
        if (self.sync and self.machine.state is bstar.State.PASSIVE
                and self._followed_term is not None):
            # each heartbeat: a lost HAVE is said again, for the term it follows only
            self.follower.reconfirm(self._followed_term)

    def _arm_tick(self) -> None:
        if self.machine is None or self.server.loop is None or self.fatal:
            return
        when = min(bstar.next_wakeup(self.machine), self.server.loop.time() + self.server.config.heartbeat_s)
        if self._tick_handle is not None:
            if self._tick_at <= when:
                return
            self._tick_handle.cancel()
        # (the time is kept here: uvloop's call_at for a time already past returns a
        # plain Handle, which has no when(); asking it failed every later step of the
        # machine, and the pair stopped working under load)
        self._tick_at = when
        self._tick_handle = self.server.loop.call_at(when, self.on_tick)

    def on_tick(self) -> None:
        """The machine's TICK (publishes state when due), sync deadlines, pending ageing."""
        self._tick_handle = None
        now = self.server.loop.time()
        self.held.table.expire(now)
        self.follower.on_tick(now)
        self._step(bstar.Event.TICK)

    def on_peer_state(self, frames: list[bytes]) -> None:
        """A state message, or a replica's confirmation, from the peer's P+3."""
        if wire.is_confirmation(frames):
            self._on_confirmation(frames)
            return
        try:
            msg = wire.decode(frames)
        except ProtocolError as err:
            self.server.drops.drop("peer_" + err.reason, str(err))
            return
        self._step(msg)
        if msg.state is bstar.State.ACTIVE and self.machine.state is bstar.State.PASSIVE:
            self._follow_term(msg.term)

    def _follow_term(self, term: int) -> None:
        """Passive: the active's term, heard in its state. A passive follows one term of
        the active. A later one means that the peer went active again without this
        server taking over in between: its lease lapsed and it took it back (L2 then
        L4), or a restarted server went active through its alone record (L5). Its
        link to this replica was dropped on the way, and its map may hold what this
        replica never saw: the replica copies the map again, and its link follows
        anew. (Kept following, it confirmed nothing more, the active went on alone, and
        after a kill of that active nobody could take over.)"""
        followed = self._followed_term
        if followed is None or term < followed:
            self._followed_term = term
            return
        if term == followed:
            return
        self._followed_term = term
        self.term_resyncs += 1
        log.warning("shard %s: the active's term went from %d to %d under this passive: "
                    "it copies the active's map again", self.shard, followed, term)
        self.follower.start_sync(self.server.loop.time())

    # ================================================================ transitions
    def on_become_active(self, effect: bstar.BecameActive, now: float) -> None:
        drained = self.follower.drain()  # what the old active published before it died
        self.follower.stop()
        self.takeovers += 1
        self.map.took_over(effect.term)
        server = self.server
        server.set_active(True)
        self.link.resume(self.sync)  # first: it holds lower sequences than anything below
        self._followed_term = None
        if self.sync and self.leased is not None and self.leased.alone_mine():
            self.link.adopt_alone()  # its last run went on alone: the record stands
        writes, stale = self.held.take_at_takeover(now, self.follower.last_heard)
        kept = 0
        for write in writes:
            frames = write.kvset()
            # a key that moved to another shard since it was held (resharding) goes on
            # there, never applied here: this shard no longer owns it
            if not server.owns(write.key, frames):
                continue
            # the source's peer of a move holds as the active did: a write to a moving
            # key waits with the hold, as if the client had sent it now. Applied here,
            # it was acknowledged past the target's copy, and forgotten at the flip: an
            # acknowledged write lost (seen across hosts)
            if server.keep_moving(frames):
                kept += 1
                continue
            server.apply_write(*write)
        server.flush()  # published now: this is not a collector batch
        applied = len(writes) - kept
        if self.leased is not None:
            self.leased.became_active()
        if self.sync:
            self.link.go_alone_now()  # after taking over from a silent peer
        log.warning("shard %s: %s is ACTIVE (%s, was %s, term %d): %d late updates from the "
                    "old active, %d pending updates applied (%d stale dropped%s), sequence "
                    "now %d", self.shard, self.name, effect.reason, effect.previous.name,
                    effect.term, drained, applied, stale,
                    f", {kept} held for the move" if kept else "", self.server.store.seq)

    def on_become_passive(self, effect: bstar.BecamePassive, now: float) -> None:
        self.server.set_active(False)
        if self.leased is not None:
            self.leased.became_passive()
        # what was applied and not published stays parked with the map (never
        # acknowledged): published if this server serves it again, dropped with it if it
        # copies its peer's
        outbox = self.server.outbox
        batch = outbox.take(self.server.store.seq, now)
        if batch:
            outbox.park(batch)
        self.link.keep(batch)
        self.ttl_tables.clear()
        log.info("shard %s: %s is PASSIVE (%s, was %s)", self.shard, self.name,
                 effect.reason, effect.previous.name)
        self._followed_term = None
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

    def on_compacted(self, job) -> None:
        """A snapshot is whole on disk (``clonemap.shards.pair_map``)."""
        self.map.on_compacted(job)

    # ================================================================ the reactor's questions
    def serving(self) -> bool:
        """Whether the machine would accept a client's ICANHAZ now (ACTIVE, or a vote
        that would win): otherwise HUGZ say ``serving=0``."""
        if self.machine is None or self.server.loop is None:
            return False
        return bstar.would_accept(self.machine, self.server.loop.time())

    def term(self) -> int:
        return self.machine.term if self.machine is not None else 0

    def resumable(self, term: int, since: int) -> bool:
        """Whether a client whose updates (up to ``since``) came from an active of
        ``term`` holds only updates this map has too (``PairMap.resumable``)."""
        return self.map.resumable(term, self.term(), since)

    def admit_snapshot_request(self) -> bool:
        """An ICANHAZ is the client's vote: answered only if the machine accepts it. A
        server that is not ACTIVE first reads the state messages its peer has already
        sent (``hear_peer_now``): after a stall of its loop longer than the peer's expiry
        (two heartbeats), an ICANHAZ read before those messages would find the peer
        "silent" and win the vote against an active that is alive: two actives (seen as
        an intermittent test failure on a 16-core host, the active then exiting)."""
        if self.machine is None or (self.leased is not None and self.leased.ran_out()):
            # (LEASE_LOST is on its way)
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
        """A message on P: the passive's BSTAR-TTL? (``clonemap.shards.ttl_table``), its link's
        BSTAR-FOLLOW (``clonemap.shards.leased``), or a client's ICANHAZ (its vote)."""
        if len(frames) == 2 and frames[1] == bstar_ttl.REQUEST:
            self._replica_syncs[frames[0]] = None  # its ICANHAZ comes next (a passive's)
            while len(self._replica_syncs) > REPLICA_SYNCS_MAX:
                self._replica_syncs.pop(next(iter(self._replica_syncs)))
            self.ttl_tables.on_request(frames[0], tuple(self.map.history))
            return
        leased = self.leased
        if len(frames) == 3 and frames[1] in (FOLLOW, HAVE):
            self._on_replica_link(frames[0], frames[1], frames[2])
            return
        self.server.flush_pending()  # applied this turn: parked (or published) first
        # A passive's own sync (its BSTAR-TTL? came first, on the same DEALER) never waits
        # for the writes parked for it: the snapshot carries them, and its confirmation
        # of that sequence releases them. Held, it would wait the sync timeout out and
        # the active would go alone with a passive that was a moment from following.
        replica = self._replica_syncs.pop(frames[0], False) is None
        if leased is not None and not replica and leased.must_wait(frames):
            return
        self.server.on_snapshot_request(frames)
        if leased is not None:
            leased.after_vote(frames)

    def confirm_replica(self, link_id: bytes, term: int | None = None) -> None:
        """Passive (the follower's ``confirm``): write what the active's batch brought
        (the log, fsync under always), then say how far this replica goes: ``BSTAR-HAVE``
        on this server's state PUB. ``term``: said again (a heartbeat's repeat), for the
        active's term this replica follows, a fourth frame: an active of another term
        takes nothing from it."""
        self.server.flush()
        seq = self.server.store.seq
        frames = [HAVE, link_id, seq.to_bytes(8, "big")]
        if term is not None:
            frames.append(term.to_bytes(8, "big"))
        try:
            zio.send_frames(self._state_pub, frames)
        except zmq.Again:  # a PUB never blocks; a lost one is followed by the next
            self.server.drops.drop("state_hwm", "BSTAR-HAVE not sent")

    def gate(self, batch: Batch) -> Verdict:
        """The verdict on a batch (``gates_publish``): HOLD past the lease's deadline
        (out if the lease is renewed in time, else parked with the map when this server
        goes passive); PARKED with synchronous replication until the passive holds it
        (or going alone is recorded); else PUBLISH."""
        if self.fenced():
            return Verdict.HOLD
        if self.sync and self.server.active and self.link.park(batch):
            return Verdict.PARKED
        return Verdict.PUBLISH

    def peer_copied(self) -> None:
        """The peer's map is whole on disk here: the needs-peer rule ends (``bstar``
        rule 8)."""
        if self.machine is not None:
            self.machine = bstar.peer_copied(self.machine)

    def drop_parked(self) -> None:
        """The map is replaced by the peer's: what was parked was never acknowledged."""
        dropped = self.link.drop()
        self.server.outbox.unpark(dropped)
        self.unacknowledged_dropped += dropped

    # ================================================================ synchronous link
    def _send_to_passive(self, messages: list[list[bytes]]) -> bool:
        """The link's BSTAR-UPD messages, on P's ROUTER; False if one could not go."""
        sock = self.server.router_socket
        sent = True
        try:
            for frames in messages:
                sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # its pipe is full or gone: it will not confirm
            log.debug("shard %s: a batch for the passive not sent: %s", self.shard, exc)
            sent = False
        # a send on the raw socket can take the edge of its FD: the ROUTER's reader must
        # look again, or a request waiting there waits for the next one
        self.server.kick_router()
        return sent

    def _record_alone(self, alone: bool, done) -> None:
        """Write (or delete) the alone record in etcd off the loop; ``done`` on the loop,
        unless the lease was closed meanwhile."""
        leased = self.leased
        if leased is None:
            return
        call = leased.lease.record_alone if alone else leased.lease.clear_alone
        future = self.server.loop.run_in_executor(None, call)

        def finished(f) -> None:
            if not leased.closed:
                done(f.exception())

        future.add_done_callback(finished)

    def _peer_gone(self) -> bool:
        """The peer has been silent past its expiry (this server took over from it)."""
        machine = self.machine
        return machine is not None and not bstar.peer_alive(machine, self.server.loop.time())

    def _on_replica_link(self, identity: bytes, command: bytes, seq_frame: bytes) -> None:
        """``BSTAR-FOLLOW seq`` on P: send every batch to this link from now on (it says
        where batches go, nothing more: only a ``BSTAR-HAVE`` from the peer's own P+3
        confirms anything). A ``BSTAR-HAVE`` on P is dropped and counted."""
        drops = self.server.drops
        if self.leased is None:
            drops.drop("peer_link_unleased", "BSTAR-FOLLOW/HAVE on P of a pair without a "
                                             "lease")
            return
        if command != FOLLOW:
            drops.drop("peer_have_on_p", "BSTAR-HAVE on the snapshot port (it is only "
                                         "taken from the peer's state port)")
            return
        if len(seq_frame) != 8 or not (self.sync and self.server.active):
            drops.drop("peer_follow_unexpected", "BSTAR-FOLLOW while not a synchronous "
                                                 "active, or malformed")
            return
        self.link.on_follow(identity, int.from_bytes(seq_frame, "big"))

    def _on_confirmation(self, frames: list[bytes]) -> None:
        """``BSTAR-HAVE LINK SEQ`` from the peer's P+3 (``clonemap.shards.sync_link``): for a
        synchronous active only; the link takes nothing past the lease."""
        if self.leased is None:
            return
        if (len(frames) not in (3, 4) or len(frames[2]) != 8 or not frames[1]
                or (len(frames) == 4 and len(frames[3]) != 8)):
            self.server.drops.drop("peer_bad_confirmation",
                                   f"{len(frames)}-frame BSTAR-HAVE")
            return
        if len(frames) == 4 and (term := int.from_bytes(frames[3], "big")) != self.term():
            # a repeat for another term: the passive copied another active's map (or
            # this server's before it went active again), which may differ from this
            # map at the same sequences; it copies this one once it hears this term
            self.server.drops.drop("peer_confirmation_other_term",
                                   f"BSTAR-HAVE for term {term}, this server's is "
                                   f"{self.term()}")
            return
        if self.sync:
            self.link.on_confirmation(frames[1], int.from_bytes(frames[2], "big"))

    def on_collect(self, frames: list[bytes]) -> None:
        """Active: the reactor's write path. Otherwise: keep the KVSET pending by UUID."""
        server = self.server
        if server.active:
            server.on_collect(frames)
            return
        server.note_received(frames)  # the collector's mark holds for a passive too
        if self.fatal:
            server.drops.drop("fatal", "KVSET after a fatal Binary Star error")
            return
        self.held.hold(frames)

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
            "needs_peer": self.map.needs_peer,
            "peer_reported_down": bool(m is not None and m.peer_down),
            "takeovers": self.takeovers,
            "term_resyncs": self.term_resyncs,
            "term_history": [list(pair) for pair in self.map.history],
            "dropped_updates": self.map.dropped_updates,
            "refused_votes": self.refused_votes,
            "split_brains_survived": self.split_brains_survived,
            **self.held.stats(),
            "pending_discarded": self.follower.counters["pending_discarded"],
            "replica": self.follower.stats(),
            "ttl_streams": self.ttl_tables.stats(),
        }
        if self.sync:
            out["sync_replication"] = self.link.stats()
        if self.leased is not None:
            out["lease"] = {**self.leased.stats(),
                            "unacknowledged_dropped": self.unacknowledged_dropped}
        return out
