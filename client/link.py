"""One shard agent's link to its current server: the SUB on P+1 (with a ZeroMQ monitor)
and, while a snapshot is asked for, a DEALER on P.

The link owns sockets and a timer, and decides nothing. It calls back into the agent
with each SUB message (``on_update``), each DEALER message (``on_snapshot``), and what
it saw as shard machine events (``on_event``): the SUB's handshake (``Handshake``), its
lost connection (``Disconnected``), and the end of the grace timer the machine armed
(``LiveProven``). Whether a handshake makes the subscription live, means a
reconnection, or means nothing (the server said it does not serve) is the machine's
rule (``clonemap.client.shard_machine``). It also keeps what the current server's HUGZ said
that the agent needs later: its map generation and whether it speaks ``cas=1``.

Fresh sockets for every server, and a fresh DEALER for every request, so nothing stale
survives a move.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq

from clonemap.shards.common.proto import chp
from clonemap.shards.common.errors import HANDSHAKE_CAUSES
from clonemap.shards.common.handshake import FAILED_EVENTS, cause_of, monitor_event
from clonemap.shards.common.security import Security
from clonemap.shards.common.zio import AsyncSocket, close_monitored
from clonemap.client import shard_machine as sm
from clonemap.client.collector import ServerAddress

log = logging.getLogger("clonemap.client.agent")

LIVE_GRACE_S = 0.25
"""After the SUB's handshake, how long to wait for its first message before treating the
subscription as live anyway (for servers that send no welcome HUGZ)."""
DEALER_RCVHWM = 100_000


class Link:
    def __init__(self, ctx: zmq.Context, name: str, subtree: bytes, *,
                 loop: asyncio.AbstractEventLoop, affinity: int, sub_rcvhwm: int,
                 on_update: Callable[[list[bytes]], None],
                 on_snapshot: Callable[[list[bytes]], None],
                 on_event: Callable[[object], None], security: Security | None = None,
                 take_rows: Callable[[int, int], tuple | None] | None = None):
        self.ctx, self.name, self.subtree, self.loop = ctx, name, subtree, loop
        self.security = security or Security.off()
        self.handshake_failure = ""
        """Why the last handshake with this server failed ("" if none did): a key of
        ``errors.HANDSHAKE_CAUSES`` (CURVE required, a key it does not admit, ...)."""
        self.refused = asyncio.Event()
        """Set while ``handshake_failure`` is: a client starting up fails at once."""
        self.affinity, self.sub_rcvhwm = affinity, sub_rcvhwm
        self.on_update, self.on_snapshot, self.on_event = on_update, on_snapshot, on_event
        self.take_rows = take_rows
        """The DEALER's ``bulk`` (``clonemap.client.incoming.Incoming.take_rows``), or None."""
        self.address: ServerAddress | None = None
        self.sub: AsyncSocket | None = None
        self.monitor: AsyncSocket | None = None
        self.dealer: AsyncSocket | None = None
        self.disconnects = 0
        self._timer: asyncio.TimerHandle | None = None
        """The grace timer (``arm_grace``)."""
        self.generation = ""
        """The latest map generation this server's HUGZ named."""
        self.term = 0
        """The latest Binary Star term this server's HUGZ named (0: none)."""
        self.cas = False
        """This server said ``cas=1``: it decides conditional writes, keeps applied UUIDs
        and answers ``reply=``; it is asked for ``meta=1`` snapshots."""

    # ------------------------------------------------------------------ sockets
    def connect(self, address: ServerAddress) -> None:
        """Drop the old link; a fresh SUB (and monitor) to ``address``'s publisher."""
        self.close()
        self.address = address
        sub = self.ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.affinity = self.affinity
        sub.rcvhwm = self.sub_rcvhwm
        sub.subscribe(self.subtree)
        if self.subtree:
            sub.subscribe(chp.HUGZ)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                         | zmq.EVENT_DISCONNECTED | FAILED_EVENTS)
        self.security.connect_side(sub)
        sub.connect(address.publisher)
        self.generation = ""
        self.term = 0
        self.cas = False
        self.sub = AsyncSocket(sub, self.on_update, loop=self.loop,
                               name=f"{self.name} SUB {address.publisher}")
        self.monitor = AsyncSocket(monitor, self._on_monitor, loop=self.loop,
                                   name=f"{self.name} monitor")
        log.info("shard %s: subscribing to %s (subtree %r)", self.name, address.publisher,
                 self.subtree)

    def request_snapshot(self, address: ServerAddress, since: int | None = None,
                         generation: str = "", meta: bool = False,
                         term: int | None = None,
                         adopt: dict[str, int] | None = None) -> None:
        """A fresh DEALER to ``address``'s snapshot port, and ICANHAZ on it (an abandoned
        snapshot still streaming to the old identity is dropped by the server's ROUTER,
        so two KTHXBAIs can never be confused). ``since``: ask for a resume (only the
        updates after it, of map ``generation``, from an active of ``term``; see
        ``chp.icanhaz``)."""
        self.close_dealer()
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.affinity = self.affinity
        dealer.rcvhwm = DEALER_RCVHWM
        self.security.connect_side(dealer)
        dealer.connect(address.snapshot)
        self.dealer = AsyncSocket(dealer, self.on_snapshot, loop=self.loop,
                                  name=f"{self.name} DEALER {address.snapshot}",
                                  bulk=self.take_rows)
        self.dealer.send(chp.icanhaz(self.subtree, since, generation, meta, term,
                                     adopt=adopt))

    def close_dealer(self) -> None:
        if self.dealer is not None:
            self.dealer.close()
            self.dealer = None

    def close(self) -> None:
        self._cancel_grace()
        close_monitored(self.sub, self.monitor)
        self.close_dealer()
        self.monitor = self.sub = None

    # ------------------------------------------------------------------ events
    def arm_grace(self) -> None:
        """``LiveProven`` after ``LIVE_GRACE_S`` (an earlier timer is dropped)."""
        self._cancel_grace()
        self._timer = self.loop.call_later(LIVE_GRACE_S, self._grace_over)

    def _cancel_grace(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _grace_over(self) -> None:
        self._timer = None
        self.on_event(sm.LiveProven())

    def _on_monitor(self, frames: list[bytes]) -> None:
        got = monitor_event(frames)
        if got is None or self.monitor is None:
            return
        event, value = got
        why = cause_of(event, value, self.security.curve)
        if why is not None:
            if why != self.handshake_failure:
                log.warning("shard %s: handshake with %s failed: %s", self.name,
                            self.address.publisher if self.address else "?",
                            HANDSHAKE_CAUSES[why])
            self.handshake_failure = why
            self.refused.set()
            return
        if event == zmq.EVENT_DISCONNECTED:
            self.disconnects += 1
            log.info("shard %s: SUB lost its connection to %s", self.name,
                     self.address.publisher if self.address else "?")
            self.on_event(sm.Disconnected())
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshake_failure = ""
            self.refused.clear()
            self.on_event(sm.Handshake())
