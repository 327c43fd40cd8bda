"""Synchronous replication, the active's side: a write is acknowledged only once the
passive holds it, or once the active has recorded in etcd that it goes on alone.

A Binary Star server (``clonemap.shards.pair.BinaryStar``) with a lease and ``--replication sync`` owns one ``SyncLink``. The
server's publish path (``ShardServer._flush_log``, after the batch's log write) calls
``park``: the batch's KVPUBs and replies wait in ``awaiting`` and each update goes to the
passive's link as a ``BSTAR-UPD`` message (``clonemap.shards.common.proto.bstar``). The passive
applies them, writes its log and publishes ``BSTAR-HAVE <link> <seq>`` on its state port
P+3, read by the server's peer SUB: ``on_confirmation`` then publishes, in order, every
batch up to that sequence. ``BSTAR-FOLLOW`` on P (``on_follow``) only says where batches
go: a confirmation is taken from the peer's own P+3 only, never from P, where anyone
could forge it.

The passive lost (no confirmation for ``timeout_s``, or at once when the server took
over from a silent peer): ``clonemap/NAME/alone`` is written in etcd first (off the
loop), and only then is everything parked published; from then on batches go out at once
(and to the passive too, if one is attached). Once the passive has confirmed everything
up to the moment the record was written, the record is deleted and the server waits for
the passive again. Going passive (fenced) keeps what was parked with the map
(``keep_unpublished``): published if this server serves that map again (``resume``),
dropped with it when it copies its peer's (``drop``).
"""
from __future__ import annotations

import asyncio
import collections
import logging

import zmq

from clonemap.shards import bstar
from clonemap.shards.common.proto.bstar import UPDATES
from clonemap.shards.history import WIDTH as KVPUB_FRAMES

log = logging.getLogger("clonemap.shards.pair")


class SyncLink:
    def __init__(self, server, pair, timeout_s: float):
        self.server = server
        """The reactor (its store, loop, sockets and the batch it holds)."""
        self.pair = pair
        """The ``clonemap.shards.pair.BinaryStar`` role (its lease, machine and name)."""
        self.timeout_s = timeout_s
        self.peer: bytes | None = None
        """The passive's link name (its DEALER's ROUTING_ID) on the server's P."""
        self.peer_has = 0
        self.awaiting: collections.deque = collections.deque()
        """Batches parked for the passive: (last sequence, held frames, replies, since)."""
        self.timer: asyncio.TimerHandle | None = None
        self.alone = False
        """This active recorded in etcd that it acknowledges without its passive."""
        self._alone_busy = False
        self._clear_alone_at: int | None = None
        self.counters = dict.fromkeys(("batches", "released", "went_alone", "alone_cleared",
                                       "alone_failed", "unsent", "links"), 0)

    # ------------------------------------------------------------------ the passive
    def on_follow(self, identity: bytes, seq: int) -> None:
        """``BSTAR-FOLLOW seq`` on P: batches go to ``identity`` from now on. Its arrival
        proves the link's connection is there: what is parked goes (again) now, for a
        send to a link named by an earlier ``BSTAR-HAVE`` can fail before it is."""
        self._attach(identity, seq, again=True)

    def _attach(self, identity: bytes, seq: int, again: bool = False) -> None:
        """Batches go to ``identity``; what is parked beyond ``seq`` is sent to it now."""
        if identity == self.peer and not again:
            return
        self.peer = identity
        self.counters["links"] += 1
        if self.alone:
            self._clear_alone_at = max(self._clear_alone_at or 0, self.server.store.seq)
        log.info("shard %s: the passive follows synchronously from sequence %d",
                 self.pair.shard, seq)
        for last, held, _, _ in self.awaiting:  # parked while it was away
            if last > seq and held:
                self._send(held)

    def on_confirmation(self, link: bytes, seq: int) -> None:
        """``BSTAR-HAVE LINK SEQ`` from the peer's P+3: its replica holds every update up
        to SEQ, and its link is named LINK (adopted if new: the link came back, or
        someone else's FOLLOW redirected the batches)."""
        if link != self.peer:
            self._attach(link, seq)
        self.peer_has = max(self.peer_has, seq)
        self._release(self.peer_has)
        if (self.alone and self._clear_alone_at is not None
                and self.peer_has >= self._clear_alone_at):
            self._set_alone(False)

    # ------------------------------------------------------------------ the publish path
    def park(self) -> bool:
        """The server's batch (its ``_held`` KVPUBs and ``_replies``) waits until the
        passive holds it; False when it may go out now (going alone is recorded)."""
        server = self.server
        if self.alone and not self.awaiting:
            # acknowledged by this server alone; a passive still attached gets the
            # batch too, and catching up ends the alone record
            if self.peer is not None and server._held:
                self._send(server._held)
            return False
        held, replies = server._held, server._replies
        server._held, server._replies = [], []
        self.awaiting.append((server.store.seq, held, replies, server.loop.time()))
        server.parked += len(held) // KVPUB_FRAMES
        self.counters["batches"] += 1
        if self.peer is not None and held:
            self._send(held)
        self._release(self.peer_has if self.peer is not None else -1)
        if self.awaiting and self.peer is None and self.peer_gone():
            self._set_alone(True)  # no passive to wait for: say so in etcd, then go on
        self._arm()
        return True

    def peer_gone(self) -> bool:
        """The peer has been silent past its expiry (this server took over from it)."""
        machine = self.pair.machine
        return machine is not None and not bstar.peer_alive(machine,
                                                            self.server.loop.time())

    def _send(self, held: list[bytes]) -> None:
        """Each update of the batch as one ``BSTAR-UPD`` message (a message has at most
        ``zio.MAX_FRAMES`` frames: a whole batch in one would be cut)."""
        server = self.server
        peer, sock = self.peer, server._router_sock
        try:
            for i in range(0, len(held), KVPUB_FRAMES):
                sock.send_multipart([peer, UPDATES, *held[i:i + KVPUB_FRAMES]], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # its pipe is full or gone: it will not confirm
            self.counters["unsent"] += 1
            log.debug("shard %s: a batch for the passive not sent: %s", self.pair.shard, exc)
        # a send on the raw socket can take the edge of its FD: the ROUTER's reader must
        # look again, or a request waiting there waits for the next one
        server._router.kick()

    def _release(self, seq: int) -> None:
        """Publish, in order, every parked batch up to ``seq``."""
        server, awaiting = self.server, self.awaiting
        while awaiting and awaiting[0][0] <= seq:
            _, held, replies, _ = awaiting.popleft()
            self.counters["released"] += 1
            if held:
                server.parked -= len(held) // KVPUB_FRAMES
                server._publish_many(held)
                if server._remember is not None:
                    server.recent.extend(held)
            if replies:
                server._replies = replies
                server._send_replies()
        if not awaiting:
            self._disarm()
            self.pair.leased.unparked()

    def _arm(self) -> None:
        if self.awaiting and self.timer is None:
            self.timer = self.server.loop.call_later(self.timeout_s, self._check)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        """The oldest parked batch waited ``timeout_s``: the passive is lost. Go on alone,
        once that is recorded in etcd (so that the passive cannot take over)."""
        self.timer = None
        if not self.awaiting or not self.server.active:
            return
        loop = self.server.loop
        waited = loop.time() - self.awaiting[0][3]
        if waited < self.timeout_s:
            self.timer = loop.call_later(self.timeout_s - waited, self._check)
            return
        self._set_alone(True)
        self.timer = loop.call_later(self.timeout_s, self._check)

    # ------------------------------------------------------------------ alone
    def _set_alone(self, alone: bool) -> None:
        lease = self.pair.leased.lease
        if self._alone_busy or lease is None:
            return
        self._alone_busy = True
        call = lease.record_alone if alone else lease.clear_alone
        future = self.server.loop.run_in_executor(None, call)
        future.add_done_callback(lambda f: self._alone_done(alone, f))

    def go_alone_now(self) -> None:
        """Took over from a silent peer: no passive will confirm anything; record going
        on alone before the first write has to wait for it."""
        if not self.alone and self.peer_gone():
            self._set_alone(True)

    def _alone_done(self, alone: bool, future) -> None:
        self._alone_busy = False
        server = self.server
        if self.pair.leased.closed:
            return
        exc = future.exception()
        if exc is not None:
            self.counters["alone_failed"] += 1
            log.warning("shard %s: cannot %s in etcd: %s", self.pair.shard,
                        "record going on alone" if alone else "clear the alone record", exc)
            return
        if alone:
            self.alone = True
            self._clear_alone_at = server.store.seq  # what the passive must confirm first
            self.counters["went_alone"] += 1
            log.warning("shard %s: the passive confirmed nothing for %.1f s: recorded in "
                        "etcd, this %s acknowledges alone (the passive may not take over "
                        "until it has copied this map again)", self.pair.shard, self.timeout_s,
                        self.pair.name)
            if server.active and not self.pair.fenced():
                self._release(server.store.seq)
        else:
            self.alone = False
            self._clear_alone_at = None
            self.counters["alone_cleared"] += 1
            log.info("shard %s: the passive holds everything again: alone record cleared",
                     self.pair.shard)

    # ------------------------------------------------------------------ state changes
    def keep_unpublished(self, now: float) -> None:
        """Going passive (fenced): what was applied and not published stays parked with
        the map (never acknowledged): published if this server serves it again
        (``resume``), dropped with it if it copies its peer's (``drop``)."""
        server = self.server
        if server._held or server._replies:
            self.awaiting.append((server.store.seq, server._held, server._replies, now))
            server.parked += len(server._held) // KVPUB_FRAMES
            server._held, server._replies = [], []
        self.peer = None
        self._disarm()

    def resume(self, synchronous: bool) -> None:
        """Active again with its own map: what stayed parked goes out as a new batch
        would (at once when not ``synchronous``; else once the passive holds it, or once
        going on alone is recorded)."""
        if not self.awaiting:
            return
        if not synchronous:
            self._release(self.server.store.seq)
        else:
            self._arm()

    def drop(self) -> int:
        """The map is replaced by the peer's: what was parked was never acknowledged.
        Returns how many updates were dropped."""
        dropped = sum(len(held) // KVPUB_FRAMES for _, held, _, _ in self.awaiting)
        self.awaiting.clear()
        self.server.parked = 0
        self.peer = None
        self._disarm()
        return dropped

    def stats(self) -> dict:
        return {**self.counters, "peer_attached": self.peer is not None,
                "peer_has": self.peer_has, "parked": self.server.parked,
                "awaiting_batches": len(self.awaiting), "alone": self.alone}
