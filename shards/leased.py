"""What a lease adds to a Binary Star server: a pair across hosts (``--coordination``).

The pair holds a lease in etcd (``clonemap.shards.coord``; the machine's leased rules L1-L4 in
``clonemap.shards.bstar``). This part of a ``clonemap.shards.pair.BinaryStar`` server:

* hands the lease's changes (from its thread) to the loop, and steps the machine with
  ``LEASE_ACQUIRED`` / ``LEASE_LOST``, with a timer at the fencing deadline;
* fences: ``fenced`` is asked before each batch is published; past the lease's deadline
  nothing goes out, and the machine hears ``LEASE_LOST`` at once;
* puts ZMTP heartbeats on every socket of the server (``link_options``), so that a link
  a partition stalled is dropped and made again within about three heartbeats of the heal;
* holds ICANHAZ requests that must wait: while the map holds writes the passive has not
  confirmed (no reader may see a write that may yet be lost), and a vote that started
  (or waits on) the lease's acquire, answered at the takeover instead of after the
  client's own snapshot timeout.

The active's side of synchronous replication itself is ``clonemap.shards.sync_link``; the
pair routes ``BSTAR-FOLLOW`` and ``BSTAR-HAVE`` to it.

``Leased`` holds no reference to the server or the pair: it is built from the lease and
callbacks (the machine, a step, the loop, the clock, the answer to a request) and is
unit-tested alone with a fake lease and a fake clock (``tests/unit/test_leased.py``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Protocol

import zmq

from clonemap.shards import bstar, coord
from clonemap.shards.common import zio

log = logging.getLogger("clonemap.shards.pair")

DEFERRED_MAX = 256
"""Votes kept while the lease is being acquired (one per requester, the latest), and
ICANHAZ requests kept while writes wait for the passive."""
DEFERRED_AGE_S = 2.5
"""A deferred vote older than this is not answered: its client (snapshot timeout 3 s)
has asked again, or moved on."""


class Lease(Protocol):
    """What ``Leased`` uses of ``clonemap.shards.coord.Lease``."""

    view: coord.LeaseView

    def start(self) -> None: ...
    def want(self, wanted: bool, only_if_alone: bool = False) -> None: ...
    def valid(self, now: float) -> bool: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...


class Leased:
    """The leased mode of one Binary Star server (see the module doc)."""

    def __init__(self, make_lease: Callable[[Callable[[coord.LeaseView], None]], Lease], *,
                 shard: str, name: str, heartbeat_s: float,
                 loop: Callable[[], asyncio.AbstractEventLoop | None],
                 machine: Callable[[], bstar.Machine | None],
                 step: Callable[[bstar.Event], object],
                 is_active: Callable[[], bool],
                 parked: Callable[[], bool],
                 answer: Callable[[list[bytes]], None],
                 drop: Callable[[str, str], None],
                 clock: Callable[[], float] = time.monotonic):
        """``make_lease(on_change)``: the lease, calling ``on_change`` from its thread;
        ``loop``: the server's loop once it runs; ``machine``/``step``: the pair's
        Binary Star machine and a step of it; ``parked``: writes wait for the passive;
        ``answer``: handle an ICANHAZ again (it may wait again); ``drop``: count a drop;
        ``clock``: the lease's clock (the loop's, ``time.monotonic``)."""
        self.lease = make_lease(self._changed)
        self.shard, self.name, self.heartbeat_s = shard, name, heartbeat_s
        self._loop, self._machine, self._step = loop, machine, step
        self._is_active, self._parked = is_active, parked
        self._answer, self._drop, self._clock = answer, drop, clock
        self.closed = False
        self.fenced_batches = 0
        self.losses_caught_late = 0
        """Leases lost and acquired again before the loop looked (a loss all the same)."""
        self._generation = 0
        """The lease's generation the machine holds (``LeaseView.generation``)."""
        self._fence_handle: asyncio.TimerHandle | None = None
        self._waiting: list[list[bytes]] = []
        """ICANHAZ requests waiting for the passive to confirm what is parked."""
        self._deferred: dict[bytes, tuple[list[bytes], float]] = {}
        """ICANHAZ votes that wait for the lease, by requester."""

    def start(self) -> None:
        self.lease.start()

    def close(self) -> None:
        """The lease goes (the pair made the server inactive first: nothing more is
        acknowledged)."""
        if self._fence_handle is not None:
            self._fence_handle.cancel()
            self._fence_handle = None
        self.closed = True
        self.lease.close()

    # ------------------------------------------------------------------ the lease
    def _changed(self, view: coord.LeaseView) -> None:
        """From the lease's thread: hand the change to the loop."""
        loop = self._loop()
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.check)
            except RuntimeError:  # the loop closed in between
                pass

    def check(self) -> None:
        """On the loop: step LEASE_ACQUIRED / LEASE_LOST as the lease's view says, and keep
        a timer at the fencing deadline."""
        machine = self._machine()
        if machine is None or machine.fatal or self.closed:
            return
        now = self._clock()
        valid = self.lease.valid(now)
        view = self.lease.view
        if valid and machine.lease_held and view.generation != self._generation:
            # lost and acquired again by the lease's thread (still wanted) before this
            # check ran: the machine held the old grant, and between the two the key was
            # free. It hears the loss as if it had looked in time (it stays in its term;
            # the new grant is given back unless the machine wants it again).
            self.losses_caught_late += 1
            log.warning("shard %s: %s fenced: its lease was lost and acquired again "
                        "before it looked (grant %d -> %d); it stops acknowledging",
                        self.shard, self.name, self._generation, view.generation)
            self._step(bstar.Event.LEASE_LOST)
            machine = self._machine()
            if machine is None or machine.fatal or self.closed:
                return
            valid = self.lease.valid(now) and bstar.lease_wanted(machine)
        if valid and not machine.lease_held:
            self._generation = view.generation
            self._step(bstar.Event.LEASE_ACQUIRED)
        elif not valid and machine.lease_held:
            log.warning("shard %s: %s fenced: its lease is not renewed (%s); it stops "
                        "acknowledging", self.shard, self.name,
                        self.lease.view.error or "expired")
            self._step(bstar.Event.LEASE_LOST)
        if self._fence_handle is not None:
            self._fence_handle.cancel()
            self._fence_handle = None
        machine = self._machine()
        loop = self._loop()
        if machine is not None and machine.lease_held and loop is not None:
            # the loop's clock is time.monotonic, as the lease's
            self._fence_handle = loop.call_at(
                max(self.lease.view.valid_until, now + 0.001), self.check)

    def want(self) -> None:
        """After each step: whether the machine wants the lease now."""
        machine = self._machine()
        if machine is not None:
            self.lease.want(bstar.lease_wanted(machine), bstar.lease_if_alone(machine))

    def alone_mine(self) -> bool:
        """The lease was acquired while etcd's alone record named this server."""
        return self.lease.view.alone_mine

    def ran_out(self) -> bool:
        """Holding the lease by the machine's account, but past its deadline now, or
        holding another grant than the one the machine took (lost and acquired again:
        between the two the key was free, and the server must not go on as before)."""
        machine = self._machine()
        return (machine is not None and machine.lease_held
                and (not self.lease.valid(self._clock())
                     or self.lease.view.generation != self._generation))

    def fenced(self) -> bool:
        """Asked before publishing (acknowledging) anything: past the lease's deadline
        nothing goes out; the machine hears LEASE_LOST at once."""
        if not self.ran_out():
            return False
        self.fenced_batches += 1
        loop = self._loop()
        if loop is not None:
            loop.call_soon(self.check)
        return True

    def link_options(self, sock: zmq.Socket[Any]) -> None:
        zio.link_heartbeats(sock, self.heartbeat_s)

    # ------------------------------------------------------------------ requests that wait
    def must_wait(self, frames: list[bytes]) -> bool:
        """An ICANHAZ while the map holds writes the passive has not confirmed (never
        acknowledged): kept until they go out (or are dropped), so that no reader ever
        sees a write that may yet be lost (milliseconds normally; at most until going
        alone is recorded)."""
        if not (self._parked() and self._is_active()):
            return False
        self._waiting.append(frames)
        if len(self._waiting) > DEFERRED_MAX:
            self._waiting.pop(0)
            self._drop("snapshot_waiting_full", "an ICANHAZ waited for the passive and "
                                                "was dropped")
        return True

    def after_vote(self, frames: list[bytes]) -> None:
        """A vote that started (or waits on) the acquire: answered at the takeover, so
        the client is served then instead of after its own snapshot timeout."""
        machine = self._machine()
        if self._is_active() or machine is None or not machine.wants_lease:
            return
        self._deferred[frames[0]] = (frames, self._clock())
        while len(self._deferred) > DEFERRED_MAX:
            self._deferred.pop(next(iter(self._deferred)))

    def unparked(self) -> None:
        """Nothing waits for the passive any more: answer the requests that waited (on
        the next loop turn: this is called from the publish path)."""
        loop = self._loop()
        if self._waiting and loop is not None:
            loop.call_soon(self._answer_waiting)

    def _answer_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for frames in waiting:
            self._answer(frames)

    def became_active(self) -> None:
        loop = self._loop()
        if self._deferred and loop is not None:
            # after this step's effects: a vote is a step of its own
            loop.call_soon(self._answer_deferred)

    def became_passive(self) -> None:
        self._deferred.clear()
        self._waiting.clear()  # their clients ask the new active

    def _answer_deferred(self) -> None:
        """Just became ACTIVE through the lease: answer the votes that waited for it (those
        younger than ``DEFERRED_AGE_S``: their clients still wait for this reply)."""
        deferred, self._deferred = self._deferred, {}
        if not self._is_active():
            return
        oldest = self._clock() - DEFERRED_AGE_S
        for frames, at in deferred.values():
            if at >= oldest:
                self._answer(frames)  # waits too while writes are parked

    def stats(self) -> dict[str, Any]:
        return {**self.lease.stats(), "fenced_batches": self.fenced_batches,
                "losses_caught_late": self.losses_caught_late,
                "snapshots_waiting_passive": len(self._waiting),
                "votes_waiting_lease": len(self._deferred)}
