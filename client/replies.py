"""The path on which a writer hears what became of its write: one DEALER per shard agent,
connected to its current server's snapshot port (P) with a fixed routing id.

A write that asks for an answer (a conditional write, or a ``wait=True`` write sent again
after an outage) carries ``reply=<that id in hex>`` in its KVSET's properties; the active
answers with a KVREPLY on its ROUTER (``chp.kvreply``): applied (with the sequence),
duplicate (it was applied before, at that sequence), conflict (with the key's sequence)
or refused. Nothing of it is broadcast: a rejected write reaches no other client.

The id stays the same across servers, so a write sent again to a new active after a
failover is answered on the new connection. Owned by one shard agent, on its loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

import zmq

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.handshake import monitor_event
from clonemap.shards.common.proto import chp
from clonemap.shards.common.security import Security
from clonemap.shards.common.zio import AsyncSocket, close_monitored
from clonemap.client.collector import ServerAddress

log = logging.getLogger("clonemap.client.agent")


class Replies:
    def __init__(self, ctx: zmq.Context, name: str, loop: asyncio.AbstractEventLoop, *,
                 affinity: int = 0, security: Security | None = None,
                 on_reply: Callable[[chp.Kvreply], None] | None = None):
        self.ctx, self.name, self.loop = ctx, name, loop
        self.affinity = affinity
        self.security = security or Security.off()
        self.identity = os.urandom(16)
        self.address: ServerAddress | None = None
        self.dealer: AsyncSocket | None = None
        self.monitor: AsyncSocket | None = None
        self.ready = asyncio.Event()
        """Set once the DEALER's handshake with the current server succeeded."""
        self.waiting: dict[bytes, tuple[asyncio.Future, list[bytes]]] = {}
        """UUID -> (the future of its KVREPLY, its KVSET frames to send again)."""
        self.on_reply = on_reply
        """Called with every KVREPLY (also those nobody waits for: a resent echo's)."""
        self.received = 0

    def connect(self, address: ServerAddress) -> None:
        """A fresh DEALER (same routing id) to ``address``'s snapshot port."""
        if self.address == address and self.dealer is not None:
            return
        self.close()
        self.address = address
        self.ready.clear()
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.affinity = self.affinity
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                          | zmq.EVENT_DISCONNECTED)
        self.security.connect_side(sock)
        sock.connect(address.snapshot)
        self.dealer = AsyncSocket(sock, self._on_message, loop=self.loop,
                                  name=f"{self.name} replies {address.snapshot}")
        self.monitor = AsyncSocket(monitor, self._on_monitor, loop=self.loop,
                                   name=f"{self.name} replies monitor")

    def _on_monitor(self, frames: list[bytes]) -> None:
        got = monitor_event(frames)
        if got is None:
            return
        if got[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.ready.set()
        elif got[0] == zmq.EVENT_DISCONNECTED:
            self.ready.clear()

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            reply = chp.decode_kvreply(frames)
        except ProtocolError as exc:
            log.warning("shard %s: a malformed reply from %s: %s", self.name,
                        self.address.snapshot if self.address else "?", exc)
            return
        self.received += 1
        entry = self.waiting.get(reply.uuid)
        if entry is not None and not entry[0].done():
            entry[0].set_result(reply)
        if self.on_reply is not None:
            self.on_reply(reply)

    def expect(self, uuid: bytes, frames: list[bytes]) -> asyncio.Future:
        """The future of ``uuid``'s KVREPLY; forgotten once done (or cancelled)."""
        fut = self.loop.create_future()
        self.adopt(uuid, fut, frames)
        return fut

    def adopt(self, uuid: bytes, fut: asyncio.Future[chp.Kvreply],
              frames: list[bytes]) -> None:
        """Answer ``fut`` with this path's KVREPLY for ``uuid`` (``expect``'s, or
        another part's wait whose key moved to this part's shard: ``Writes.take_over``);
        forgotten once done (or cancelled)."""
        self.waiting[uuid] = (fut, frames)
        fut.add_done_callback(lambda f, u=uuid: self._forget(u, f))

    def give_up(self, uuid: bytes) -> tuple[asyncio.Future[chp.Kvreply], list[bytes]] | None:
        """Stop waiting here for ``uuid``'s KVREPLY; its future and frames, if still
        open (another part answers it now)."""
        entry = self.waiting.pop(uuid, None)
        if entry is None or entry[0].done():
            return None
        return entry

    def _forget(self, uuid: bytes, fut: asyncio.Future) -> None:
        entry = self.waiting.get(uuid)
        if entry is not None and entry[0] is fut:
            del self.waiting[uuid]

    def unanswered(self) -> list[list[bytes]]:
        """The KVSETs still waiting for their reply, in the order they were made."""
        return [frames for fut, frames in self.waiting.values() if not fut.done()]

    def fail_all(self, exc: BaseException) -> None:
        for fut, _ in list(self.waiting.values()):
            if not fut.done():
                fut.set_exception(exc)

    def close(self) -> None:
        close_monitored(self.dealer, self.monitor)
        self.monitor = self.dealer = None
        self.address = None
        self.ready.clear()

    def cancel_all(self) -> None:
        for fut, _ in list(self.waiting.values()):
            if not fut.done():
                fut.cancel()
        self.waiting.clear()
        self.close()
