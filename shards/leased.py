"""What a lease adds to a Binary Star server: a pair across hosts (``--coordination``).

The pair holds a lease in etcd (``clonemap.shards.coord``; the machine's leased rules L1-L4 in
``clonemap.shards.bstar``). This part of a ``clonemap.shards.pair.BinaryStar`` server:

* hands the lease's changes (from its thread) to the loop, and steps the machine with
  ``LEASE_ACQUIRED`` / ``LEASE_LOST``, with a timer at the fencing deadline;
* fences: ``fenced`` is asked before each batch is published; past the lease's deadline
  nothing goes out, and the machine hears ``LEASE_LOST`` at once;
* puts ZMTP heartbeats on every socket of the server (``link_options``), so that a link
  a partition stalled is dropped and made again within about three heartbeats of the heal;
* answers, with synchronous replication, what arrives about it: ``BSTAR-FOLLOW`` on P
  (where the active sends each batch), ``BSTAR-HAVE`` from the peer's P+3 only (a
  ``BSTAR-HAVE`` on P is dropped and counted: anyone who reaches P could forge it);
* holds ICANHAZ requests that must wait: while the map holds writes the passive has not
  confirmed (no reader may see a write that may yet be lost), and a vote that started
  (or waits on) the lease's acquire, answered at the takeover instead of after the
  client's own snapshot timeout.

The active's side of synchronous replication itself is ``clonemap.shards.sync_link``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import zmq

from clonemap.shards import bstar, coord
from clonemap.shards.common import zio
from clonemap.shards.common.proto.bstar import FOLLOW

if TYPE_CHECKING:
    from clonemap.shards.pair import BinaryStar

log = logging.getLogger("clonemap.shards.pair")

DEFERRED_MAX = 256
"""Votes kept while the lease is being acquired (one per requester, the latest), and
ICANHAZ requests kept while writes wait for the passive."""
DEFERRED_AGE_S = 2.5
"""A deferred vote older than this is not answered: its client (snapshot timeout 3 s)
has asked again, or moved on."""


class Leased:
    """The leased mode of one Binary Star server (see the module doc)."""

    def __init__(self, pair: "BinaryStar", coordination: list[tuple[str, int]], *,
                 lease_s: float, lease_name: str, sync: bool):
        self.pair = pair
        config = pair.config
        me = f"{pair.name}@{config.host}:{config.port}"
        self.lease = coord.Lease(coord.Etcd(coordination, timeout_s=min(1.0, lease_s / 4)),
                                 lease_name, me, lease_s=lease_s, on_change=self._changed)
        self.sync = sync
        self.closed = False
        self.fenced_batches = 0
        self._fence_handle: asyncio.TimerHandle | None = None
        self._waiting: list[list[bytes]] = []
        """ICANHAZ requests waiting for the passive to confirm what is parked."""
        self._deferred: dict[bytes, tuple[list[bytes], float]] = {}
        """ICANHAZ votes that wait for the lease, by requester."""

    def start(self) -> None:
        self.lease.start()

    def close(self) -> None:
        """Nothing more is acknowledged (the server is made inactive first), then the
        lease goes."""
        if self._fence_handle is not None:
            self._fence_handle.cancel()
            self._fence_handle = None
        self.closed = True
        self.pair.server.set_active(False)
        self.lease.close()

    # ------------------------------------------------------------------ the lease
    def _changed(self, view: coord.LeaseView) -> None:
        """From the lease's thread: hand the change to the loop."""
        loop = self.pair.server.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.check)
            except RuntimeError:  # the loop closed in between
                pass

    def check(self) -> None:
        """On the loop: step LEASE_ACQUIRED / LEASE_LOST as the lease's view says, and keep
        a timer at the fencing deadline."""
        pair = self.pair
        if pair.machine is None or pair.fatal or self.closed:
            return
        now = time.monotonic()
        valid = self.lease.valid(now)
        if valid and not pair.machine.lease_held:
            pair._step(bstar.Event.LEASE_ACQUIRED)
        elif not valid and pair.machine.lease_held:
            log.warning("shard %s: %s fenced: its lease is not renewed (%s); it stops "
                        "acknowledging", pair.shard, pair.name,
                        self.lease.view.error or "expired")
            pair._step(bstar.Event.LEASE_LOST)
        if self._fence_handle is not None:
            self._fence_handle.cancel()
            self._fence_handle = None
        if pair.machine.lease_held:
            # the loop's clock is time.monotonic, as the lease's
            self._fence_handle = pair.server.loop.call_at(
                max(self.lease.view.valid_until, now + 0.001), self.check)

    def want(self) -> None:
        """After each step: whether the machine wants the lease now."""
        self.lease.want(bstar.lease_wanted(self.pair.machine))

    def ran_out(self) -> bool:
        """Holding the lease by the machine's account, but past its deadline now."""
        machine = self.pair.machine
        return (machine is not None and machine.lease_held
                and not self.lease.valid(time.monotonic()))

    def fenced(self) -> bool:
        """Asked before publishing (acknowledging) anything: past the lease's deadline
        nothing goes out; the machine hears LEASE_LOST at once."""
        if not self.ran_out():
            return False
        self.fenced_batches += 1
        loop = self.pair.server.loop
        if loop is not None:
            loop.call_soon(self.check)
        return True

    def link_options(self, sock: zmq.Socket) -> None:
        zio.link_heartbeats(sock, self.pair.config.heartbeat_s)

    # ------------------------------------------------------------------ requests that wait
    def must_wait(self, frames: list[bytes]) -> bool:
        """An ICANHAZ while the map holds writes the passive has not confirmed (never
        acknowledged): kept until they go out (or are dropped), so that no reader ever
        sees a write that may yet be lost (milliseconds normally; at most until going
        alone is recorded)."""
        pair = self.pair
        if not (pair.link.awaiting and pair.server.active):
            return False
        self._waiting.append(frames)
        if len(self._waiting) > DEFERRED_MAX:
            self._waiting.pop(0)
            pair.server.drops.drop("snapshot_waiting_full", "an ICANHAZ waited for the "
                                                            "passive and was dropped")
        return True

    def after_vote(self, frames: list[bytes]) -> None:
        """A vote that started (or waits on) the acquire: answered at the takeover, so
        the client is served then instead of after its own snapshot timeout."""
        pair = self.pair
        if pair.server.active or pair.machine is None or not pair.machine.wants_lease:
            return
        self._deferred[frames[0]] = (frames, pair.server.loop.time())
        while len(self._deferred) > DEFERRED_MAX:
            self._deferred.pop(next(iter(self._deferred)))

    def unparked(self) -> None:
        """Nothing waits for the passive any more: answer the requests that waited (on
        the next loop turn: this is called from the publish path)."""
        loop = self.pair.server.loop
        if self._waiting and loop is not None:
            loop.call_soon(self._answer_waiting)

    def _answer_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for frames in waiting:
            self.pair.on_snapshot_request(frames)

    def became_active(self) -> None:
        if self._deferred:  # after this step's effects: a vote is a step of its own
            self.pair.server.loop.call_soon(self._answer_deferred)

    def became_passive(self) -> None:
        self._deferred.clear()
        self._waiting.clear()  # their clients ask the new active

    def _answer_deferred(self) -> None:
        """Just became ACTIVE through the lease: answer the votes that waited for it (those
        younger than ``DEFERRED_AGE_S``: their clients still wait for this reply)."""
        deferred, self._deferred = self._deferred, {}
        server = self.pair.server
        if not server.active:
            return
        oldest = server.loop.time() - DEFERRED_AGE_S
        for frames, at in deferred.values():
            if at >= oldest:
                self.pair.on_snapshot_request(frames)  # waits too while writes are parked

    # ------------------------------------------------------------------ replication links
    def on_replica_link(self, identity: bytes, command: bytes, seq_frame: bytes) -> None:
        """``BSTAR-FOLLOW seq`` on P: send every batch to this link from now on (it says
        where batches go, nothing more: only a ``BSTAR-HAVE`` from the peer's own P+3
        confirms anything). A ``BSTAR-HAVE`` on P is dropped and counted."""
        pair = self.pair
        drops = pair.server.drops
        if command != FOLLOW:
            drops.drop("peer_have_on_p", "BSTAR-HAVE on the snapshot port (it is only "
                                         "taken from the peer's state port)")
            return
        if len(seq_frame) != 8 or not (self.sync and pair.server.active):
            drops.drop("peer_follow_unexpected", "BSTAR-FOLLOW while not a synchronous "
                                                 "active, or malformed")
            return
        pair.link.on_follow(identity, int.from_bytes(seq_frame, "big"))

    def on_confirmation(self, frames: list[bytes]) -> None:
        """``BSTAR-HAVE LINK SEQ`` from the peer's P+3 (``clonemap.shards.sync_link``)."""
        pair = self.pair
        if len(frames) != 3 or len(frames[2]) != 8 or not frames[1]:
            pair.server.drops.drop("peer_bad_confirmation", f"{len(frames)}-frame BSTAR-HAVE")
            return
        # a passive's confirmations are for an active; one past its lease publishes
        # nothing, whoever confirmed what
        if self.sync and pair.server.active and not self.fenced():
            pair.link.on_confirmation(frames[1], int.from_bytes(frames[2], "big"))

    def stats(self) -> dict:
        return {**self.lease.stats(), "fenced_batches": self.fenced_batches,
                "unacknowledged_dropped": self.pair.unacknowledged_dropped}
