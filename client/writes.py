"""A shard agent's writes: the KVSETs it sends, the echoes and replies it waits for.

* **Sending.** A KVSET goes to the collector of every server of the shard (12/CHP:
  fire-and-forget, so a passive holds it by UUID and applies it if it takes over), or,
  through relays, to the followed relay only (each forwards to the whole pair). A
  collector queues (bounded) until its first connection; a collector that was connected
  and went down drops what is sent to it (``clonemap.client.collector``).
* **Echoes** (``wait=True``): a write is confirmed when the shard publishes its UUID back
  and it is applied here, or when an installed snapshot holds its value
  (``clonemap.client.echoes``).
* **Replies** (conditional writes, resends): a server that decides writes (``cas=1``)
  answers a KVSET that asks with a KVREPLY on the agent's replies DEALER
  (``clonemap.client.replies``): applied, duplicate (applied before), conflict or refused.
* **Resends.** After an outage (a failover, or a reconnection to a server that may have
  restarted: the machine's ``InstallSnapshot.resend``) the writes still awaiting their
  echo are sent again with the same UUID: to a ``cas=1`` server asking for a reply, once
  the replies DEALER is connected (applied once); otherwise once the installed snapshot
  has been checked for them (at-least-once).
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import zmq

from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.proto import chp
from clonemap.shards.common.proto.props import drop_props
from clonemap.shards.common.security import Security
from clonemap.client.collector import KvsetSender
from clonemap.client.echoes import Echoes
from clonemap.client.replies import Replies

REPLY_CONNECT_S = 2.0
"""After an outage, how long resent writes that ask for a reply wait for the replies
DEALER's connection before they go anyway."""


class ShardWrites:
    """One shard's writes (see the module doc). Given what it sends through and to
    (``ctx``, the shard's ``servers``, ...), and three questions it asks the agent when
    it acts: ``current()``, the index of the server the shard follows; ``last_seq()``,
    the sequence the local map is at; ``epoch()``, the shard's outage epoch, or None
    once the agent closed. Anything else comes as arguments."""

    def __init__(self, ctx: "zmq.Context[Any]", servers: Sequence[Any], *, name: str,
                 relays: bool, drops: DropCounter, queue_max: int, affinity: int,
                 security: Security, current: Callable[[], int],
                 last_seq: Callable[[], int], epoch: Callable[[], int | None]):
        self.ctx = ctx
        self.servers = servers
        self.name = name
        self.relays = relays
        self.drops = drops
        self.queue_max = queue_max
        self.affinity = affinity
        self.security = security
        self._current = current
        self._last_seq = last_seq
        self._epoch = epoch
        self.loop: asyncio.AbstractEventLoop | None = None
        self.collectors: list[KvsetSender] = []
        self.echoes = Echoes()
        """Writes awaiting their echo (``wait=True``): ``clonemap.client.echoes``."""
        self.replies: Replies | None = None
        """Writes awaiting their KVREPLY (conditional writes, resends): made in start(),
        its DEALER connected on first use (``clonemap.client.replies``)."""
        self.connected: asyncio.Event | None = None
        """Set while at least one collector is connected."""
        self.resend_owed = False
        """A resend was dropped because the shard asked its server again before it went
        (``_send_when_ready``): the next install sends the writes again, whatever made
        it."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.connected = asyncio.Event()
        for address in self.servers:
            self.collectors.append(KvsetSender(self.ctx, address, loop, self.drops,
                                               self.queue_max, self._on_change,
                                               self.affinity, self.security))
        self.replies = Replies(self.ctx, self.name, loop, affinity=self.affinity,
                               security=self.security, on_reply=self._on_reply)

    def close(self, linger_ms: int) -> None:
        for c in self.collectors:
            c.close(linger_ms)
        self.echoes.cancel_all()
        if self.replies is not None:
            self.replies.cancel_all()

    def fail_all(self, exc: Exception) -> None:
        self.echoes.fail_all(exc)
        if self.replies is not None:
            self.replies.fail_all(exc)

    @property
    def ready(self) -> bool:
        return any(c.ready for c in self.collectors)

    def _on_change(self) -> None:
        if self.ready:
            self.connected.set()
        else:
            self.connected.clear()

    # ------------------------------------------------------------------ out
    @property
    def queued(self) -> int:
        """KVSETs waiting here for a collector (not yet handed to ZeroMQ)."""
        return sum(len(c.queue) for c in self.collectors)

    def send_kvset(self, frames: list[bytes]) -> None:
        """Publish a KVSET to every server of the shard (fire-and-forget)."""
        collectors = self.collectors
        if len(collectors) == 1:
            collectors[0].send(frames)
            return
        current = self._current()
        if self.relays:  # each relay forwards to the whole pair: one copy, to ours
            collectors[current].send(frames, True)
            return
        for i, collector in enumerate(collectors):
            collector.send(frames, i == current)

    def expect(self, uuid: bytes, key: bytes, value: bytes,
               frames: list[bytes] | None = None) -> asyncio.Future:
        """A future resolved when this shard publishes the update ``uuid`` back (its
        KVPUB applied here), or a snapshot installed here holds ``key`` = ``value``
        (the KVPUB itself was folded into a resync). The caller cancels it on timeout."""
        return self.echoes.expect(self.loop, uuid, key, value, frames)

    def conditional(self, frames: list[bytes]) -> asyncio.Future:
        """Send a KVSET that asks for a reply (``frames[3]`` already says ``reply=``
        this agent's id, see ``reply_props``); the future of its KVREPLY."""
        fut = self.replies.expect(frames[2], frames)
        self.send_kvset(frames)
        return fut

    def reply_props(self) -> bytes:
        return chp.write_props(reply_to=self.replies.identity)

    async def replies_ready(self) -> None:
        """The replies DEALER connected to the current server (made on first use)."""
        self.replies.connect(self.servers[self._current()])
        await self.replies.ready.wait()

    def _on_reply(self, reply: chp.Kvreply) -> None:
        """A KVREPLY: a write awaiting its echo that it answers (applied now, or before
        an outage) is confirmed once this client's map is at its sequence (a later one
        is confirmed by its KVPUB, still on the way)."""
        echoes, last_seq = self.echoes, self._last_seq()
        if echoes and reply.outcome in (chp.APPLIED, chp.DUPLICATE):
            if reply.seq <= last_seq:
                echoes.confirm(reply.uuid, last_seq)
            else:  # its KVPUB is on the way, or will be folded into a snapshot
                echoes.applied(reply.uuid, reply.seq)

    def take_over(self, waits: list[tuple[bytes, asyncio.Future[chp.Kvreply],
                                          list[bytes]]]) -> None:
        """Writes another part sent, waiting for their KVREPLY, whose keys belong to this
        part's shard under a later routing: the old shard forwarded them here, and this
        shard's answer went to a reply id it does not know. Each is sent again, same
        UUID (applied once: this shard knows it, forwarded or copied with the keys),
        saying this part's reply id, and its answer resolves the same future."""
        if not waits:
            return
        self.replies.connect(self.servers[self._current()])
        ident = self.reply_props()
        again = []
        for uuid, fut, frames in waits:
            props = drop_props(frames[3], (b"reply",)) + ident
            resent = [frames[0], frames[1], frames[2], props, frames[4]]
            self.replies.adopt(uuid, fut, resent)
            again.append(resent)
        self.loop.create_task(self._send_when_connected(again))

    async def _send_when_connected(self, frames_list: list[list[bytes]]) -> None:
        """Send once the replies DEALER is connected (or after ``REPLY_CONNECT_S``)."""
        await self._replies_connected()
        for frames in frames_list:
            if frames[2] in self.replies.waiting:  # (not answered or closed meanwhile)
                self.send_kvset(frames)

    # ------------------------------------------------------------------ the shard moved
    def connected_to(self, server) -> None:
        """The shard follows ``server`` now: the replies DEALER too, if in use."""
        if self.replies.address is not None:
            self.replies.connect(server)

    def left(self, new: int) -> None:
        """A failover to server ``new``: collectors that are down drop their queues (a
        restarted server never receives a stale backlog)."""
        for i, collector in enumerate(self.collectors):
            if i != new and not collector.ready:
                collector.discard_queue()

    def installed(self, resend: bool, cas: bool, held: dict[bytes, bytes],
                  last_seq: int) -> None:
        """A snapshot is installed (``held`` is now the map, at ``last_seq``): confirm what
        it holds, and after an outage send again what still awaits its echo (see the
        module doc)."""
        echoes = self.echoes
        resend, self.resend_owed = resend or self.resend_owed, False
        if resend and (echoes or self.replies.waiting):
            # writes made while no server took them (a KVSET sent into a connection that
            # was already dead is gone), sent again now that the shard serves again
            self._resend(echoes.unconfirmed() if cas else None, held, last_seq)
        elif echoes:
            echoes.confirm_in(held, last_seq)
        if echoes:
            echoes.confirm_upto(last_seq)

    def _resend(self, echoed: list[list[bytes]] | None, held: dict[bytes, bytes],
                last_seq: int) -> None:
        if echoed is None:
            self.echoes.confirm_in(held, last_seq)
            for frames in self.echoes.unconfirmed():
                self.send_kvset(frames)
            return
        self.replies.connect(self.servers[self._current()])
        ident = self.reply_props()
        again = [[f[0], f[1], f[2], f[3] if b"reply=" in f[3] else f[3] + ident, f[4]]
                 for f in echoed]
        again += self.replies.unanswered()
        epoch = self._epoch()
        if epoch is not None:
            self.loop.create_task(self._send_when_ready(again, epoch))

    async def _replies_connected(self) -> None:
        """Until the replies DEALER is connected (so no answer is lost), or
        ``REPLY_CONNECT_S`` passed anyway."""
        try:
            async with asyncio.timeout(REPLY_CONNECT_S):
                await self.replies.ready.wait()
        except TimeoutError:
            pass

    async def _send_when_ready(self, frames_list: list[list[bytes]], epoch: int) -> None:
        """Send once the replies DEALER is connected (``_replies_connected``), unless the
        shard asked its server again meanwhile."""
        await self._replies_connected()
        now = self._epoch()
        if epoch != now:  # asked again (or closed: None): the next install sends them
            # (an outage's install resent anyway, but a request for a gap, a new
            # generation or a lag made none, and a conditional write waiting for its
            # answer waited out its timeout, its outcome unknown)
            self.resend_owed = now is not None
            return
        for frames in frames_list:
            self.send_kvset(frames)

    def stats(self) -> dict:
        collectors = self.collectors
        return {"kvsets_sent": sum(c.sent for c in collectors),
                "kvsets_queued": sum(len(c.queue) for c in collectors),
                "kvsets_dropped": sum(c.dropped for c in collectors),
                "kvsets_resent": self.echoes.resent,
                "replies": self.replies.received if self.replies is not None else 0}
