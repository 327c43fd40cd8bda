"""Synchronous replication, the active's side: a write is acknowledged only once the
passive holds it, or once the active has recorded in etcd that it goes on alone.

A Binary Star server (``clonemap.shards.pair.BinaryStar``) with a lease and
``--replication sync`` owns one ``SyncLink``. The reactor's flush (``ShardServer.flush``,
after the batch's log write) asks the role for its verdict on the outbox's batch
(``clonemap.shards.outbox``); the role hands it to ``park``: the batch (KVPUBs and
replies) waits in ``awaiting`` and each update goes to the passive's link as a
``BSTAR-UPD`` message (``clonemap.shards.common.proto.bstar``). The passive applies them,
writes its log and publishes ``BSTAR-HAVE <link> <seq>`` on its state port P+3, read by
the server's peer SUB: ``on_confirmation`` then publishes, in order, every batch up to
that sequence, unless this server may not publish now (not active, or past its
lease). ``BSTAR-FOLLOW`` on P (``on_follow``) only says where batches
go: a confirmation is taken from the peer's own P+3 only, never from P, where anyone
could forge it.

The passive lost (no confirmation for ``timeout_s``, or at once when the server took
over from a silent peer): ``clonemap/NAME/alone`` is written in etcd first (off the
loop), and only then is everything parked published; from then on batches go out at once
(and to the passive too, if one is attached). Once the passive is attached and holds
everything up to the moment the record was written (or up to where it followed), new
batches wait for it again; once it also holds the last batch acknowledged alone, the
record is deleted. Going passive (fenced) keeps what was parked with the map
(``keep``): published if this server serves that map again (``resume``),
dropped with it when it copies its peer's (``drop``).

**What the passive has to confirm**: every update of a batch, by sequence. A batch is
released when a ``BSTAR-HAVE`` from the peer's P+3 says the passive's replica (applied
and written to its log) reaches the batch's last sequence; batches go out in the order
they were parked, never one before an earlier one. After going alone, the passive must
confirm every sequence acknowledged alone before the record is cleared: a record cleared
earlier would let a passive that lacks an acknowledged write take over.

A ``SyncLink`` holds no reference to the server or the pair: it is built from callbacks
(send to the passive, publish a batch, record in etcd, the clock and a timer) and is
unit-tested alone (``tests/unit/test_sync_link.py``).
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Protocol

from clonemap.shards.common.proto.bstar import UPDATES
from clonemap.shards.outbox import KVPUB_FRAMES, Batch

log = logging.getLogger("clonemap.shards.pair")


class Timer(Protocol):
    def cancel(self) -> None: ...


Done = Callable[[BaseException | None], None]
"""Called on the loop when a record in etcd was written (None) or failed."""


class SyncLink:
    """The active's side of synchronous replication (see the module doc)."""

    def __init__(self, *, shard: str, name: str, timeout_s: float,
                 clock: Callable[[], float],
                 call_later: Callable[[float, Callable[[], None]], Timer],
                 send: Callable[[list[list[bytes]]], bool],
                 publish: Callable[[Batch], None],
                 record_alone: Callable[[bool, Done], None],
                 current_seq: Callable[[], int],
                 is_active: Callable[[], bool],
                 may_publish: Callable[[], bool],
                 peer_gone: Callable[[], bool],
                 unparked: Callable[[], None] = lambda: None):
        """``send``: messages to the passive's link (False: not sent); ``publish``: a
        released batch goes out (the reactor's ``publish_batch``); ``record_alone(alone,
        done)``: write (True) or delete (False) the alone record in etcd off the loop,
        then call ``done`` on the loop; ``may_publish``: active and within the lease;
        ``peer_gone``: the peer was silent past its expiry; ``unparked``: nothing waits
        any more."""
        self.shard, self.name, self.timeout_s = shard, name, timeout_s
        self._clock, self._call_later = clock, call_later
        self._send_messages, self._publish = send, publish
        self._record_alone, self._current_seq = record_alone, current_seq
        self._is_active, self._may_publish = is_active, may_publish
        self._peer_gone, self._unparked = peer_gone, unparked
        self.peer: bytes | None = None
        """The passive's link name (its DEALER's ROUTING_ID) on the server's P."""
        self.peer_has = 0
        self.awaiting: collections.deque[Batch] = collections.deque()
        """Batches parked for the passive, oldest first."""
        self.timer: Timer | None = None
        self.alone = False
        """This active recorded in etcd that it acknowledges without its passive."""
        self._alone_busy = False
        self._clear_alone_at: int | None = None
        """Alone: the sequence the passive must hold before batches wait for it again
        (the map's when going alone was recorded, or when the passive followed)."""
        self._alone_upto = 0
        """Alone: the last sequence acknowledged without the passive. The record is
        cleared only once the passive holds it."""
        self.counters = dict.fromkeys(("batches", "released", "went_alone", "alone_adopted",
                                       "alone_cleared", "alone_failed", "unsent", "links"),
                                      0)

    @property
    def parked(self) -> int:
        """Updates parked, in every batch awaiting."""
        return sum(batch.count for batch in self.awaiting)

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
            self._clear_alone_at = max(self._clear_alone_at or 0, self._current_seq())
        log.info("shard %s: the passive follows synchronously from sequence %d",
                 self.shard, seq)
        for batch in self.awaiting:  # parked while it was away
            if batch.last_seq > seq and batch.updates:
                self._send(batch.updates)

    def on_confirmation(self, link: bytes, seq: int) -> None:
        """``BSTAR-HAVE LINK SEQ`` from the peer's P+3: its replica holds every update up
        to SEQ, and its link is named LINK (adopted if new: the link came back, or
        someone else's FOLLOW redirected the batches). A server that may not publish
        now (not active, past its lease) takes nothing from it."""
        if not self._may_publish():
            return
        if link != self.peer:
            self._attach(link, seq)
        self.peer_has = max(self.peer_has, seq)
        self._release(self.peer_has)
        if self.alone and self._rejoined() and self.peer_has >= self._alone_upto:
            self._set_alone(False)

    def _rejoined(self) -> bool:
        """Alone, with the passive attached and holding everything up to where it
        followed: new batches wait for it again, so that what was acknowledged alone
        stops growing and the passive can hold all of it (published alone until then,
        each batch would move the point it has to reach, and under a steady load it
        could chase that point for ever)."""
        return (self.peer is not None and self._clear_alone_at is not None
                and self.peer_has >= self._clear_alone_at)

    # ------------------------------------------------------------------ the publish path
    def park(self, batch: Batch) -> bool:
        """``batch`` waits until the passive holds it: True. False when it may go out now
        (going alone is recorded; a passive still attached is sent it too)."""
        if self.alone and not self.awaiting and not self._rejoined():
            # acknowledged by this server alone; a passive still attached gets the
            # batch too, and catching up ends the alone record
            self._alone_upto = max(self._alone_upto, batch.last_seq)
            if self.peer is not None and batch.updates:
                self._send(batch.updates)
            return False
        self.awaiting.append(batch)
        self.counters["batches"] += 1
        if self.peer is not None and batch.updates:
            self._send(batch.updates)
        self._release(self.peer_has if self.peer is not None else -1)
        if self.awaiting and self.peer is None and self._peer_gone():
            self._set_alone(True)  # no passive to wait for: say so in etcd, then go on
        self._arm()
        return True

    def _send(self, updates: list[bytes]) -> None:
        """Each update as one ``BSTAR-UPD`` message (a message has at most
        ``zio.MAX_FRAMES`` frames: a whole batch in one would be cut)."""
        peer = self.peer
        if peer is None:
            return
        messages = [[peer, UPDATES, *updates[i:i + KVPUB_FRAMES]]
                    for i in range(0, len(updates), KVPUB_FRAMES)]
        if not self._send_messages(messages):  # its pipe is full or gone
            self.counters["unsent"] += 1

    def _release(self, seq: int) -> None:
        """Publish, in order, every parked batch up to ``seq``."""
        awaiting = self.awaiting
        while awaiting and awaiting[0].last_seq <= seq:
            batch = awaiting.popleft()
            self.counters["released"] += 1
            self._publish(batch)
        if not awaiting:
            self._disarm()
            self._unparked()

    def _arm(self) -> None:
        if self.awaiting and self.timer is None:
            self.timer = self._call_later(self.timeout_s, self._check)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        """The oldest parked batch waited ``timeout_s``: the passive is lost. Go on alone,
        once that is recorded in etcd (so that the passive cannot take over)."""
        self.timer = None
        if not self.awaiting or not self._is_active():
            return
        waited = self._clock() - self.awaiting[0].at
        if waited < self.timeout_s:
            self.timer = self._call_later(self.timeout_s - waited, self._check)
            return
        self._set_alone(True)
        self.timer = self._call_later(self.timeout_s, self._check)

    # ------------------------------------------------------------------ alone
    def _set_alone(self, alone: bool) -> None:
        if self._alone_busy:
            return
        self._alone_busy = True
        self._record_alone(alone, lambda exc: self._alone_done(alone, exc))

    def go_alone_now(self) -> None:
        """Took over from a silent peer: no passive will confirm anything; record going
        on alone before the first write has to wait for it."""
        if not self.alone and self._peer_gone():
            self._set_alone(True)

    def adopt_alone(self) -> None:
        """Became active under a lease acquired while etcd's alone record named this
        server (its last run went on alone, and was then killed): the record stands
        until the passive holds everything from now on, as if written now."""
        if self.alone:
            return
        self.alone = True
        self._clear_alone_at = self._alone_upto = self._current_seq()
        self.counters["alone_adopted"] += 1
        log.warning("shard %s: etcd's alone record names this %s: it acknowledges alone "
                    "until the passive holds sequence %d", self.shard, self.name,
                    self._clear_alone_at)

    def _alone_done(self, alone: bool, exc: BaseException | None) -> None:
        self._alone_busy = False
        if exc is not None:
            self.counters["alone_failed"] += 1
            log.warning("shard %s: cannot %s in etcd: %s", self.shard,
                        "record going on alone" if alone else "clear the alone record", exc)
            return
        if alone:
            self.alone = True
            # what the passive must confirm first: everything released below
            self._clear_alone_at = self._current_seq()
            self._alone_upto = max(self._alone_upto, self._clear_alone_at)
            self.counters["went_alone"] += 1
            log.warning("shard %s: the passive confirmed nothing for %.1f s: recorded in "
                        "etcd, this %s acknowledges alone (the passive may not take over "
                        "until it has copied this map again)", self.shard, self.timeout_s,
                        self.name)
            if self._may_publish():
                self._release(self._current_seq())
        else:
            self.alone = False
            self._clear_alone_at = None
            self.counters["alone_cleared"] += 1
            log.info("shard %s: the passive holds everything again: alone record cleared",
                     self.shard)

    # ------------------------------------------------------------------ state changes
    def keep(self, batch: Batch) -> None:
        """Going passive (fenced): what was applied and not published (``batch``) stays
        parked with the map (never acknowledged): published if this server serves it
        again (``resume``), dropped with it if it copies its peer's (``drop``)."""
        if batch:
            self.awaiting.append(batch)
        self.peer = None
        self._disarm()

    def resume(self, synchronous: bool) -> None:
        """Active again with its own map: what stayed parked goes out as a new batch
        would (at once when not ``synchronous``; else once the passive holds it, or once
        going on alone is recorded)."""
        if not self.awaiting:
            return
        if not synchronous:
            self._release(self._current_seq())
        else:
            self._arm()

    def drop(self) -> int:
        """The map is replaced by the peer's: what was parked was never acknowledged.
        Returns how many updates were dropped."""
        dropped = self.parked
        self.awaiting.clear()
        self.peer = None
        self._disarm()
        return dropped

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "peer_attached": self.peer is not None,
                "peer_has": self.peer_has, "parked": self.parked,
                "awaiting_batches": len(self.awaiting), "alone": self.alone}
