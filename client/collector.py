"""What a client needs to reach one CHP server: its address, and its collector.

``ServerAddress`` is a server by host and base port P (snapshot P, publisher P+1,
collector P+2); ``parse_server`` reads ``tcp://HOST:P`` or ``HOST:P``.

``KvsetSender`` (the client's write socket, named for what it does; the server's end is
the collector) is one XPUB connected to one server's P+2 collector; a shard agent has one
per server of its shard (a Binary Star pair gets every KVSET at both servers). An XPUB
is a PUB that also reports subscriptions: KVSETs are sent only once the collector's SUB
has subscribed (before that a PUB drops them silently), and with ``XPUB_NODROP`` a full
pipe queues them here instead of dropping them. ``ZMQ_IMMEDIATE`` makes a lost
connection an unsubscription. The queue is bounded; overflow drops the oldest and is
counted.

The collector of the server the shard follows (or the only one) queues while not
subscribed. For the *other* server of a pair, a KVSET is dropped and counted
(``collector_down``) while its collector, once subscribed, is down (dead, restarting);
before its first subscription (start-up) it is queued for at most
``STANDBY_QUEUE_AGE_S``; and a failover clears the queue of a collector that is down.
Otherwise a restarted server would receive a backlog of old KVSETs after it has
resynchronised, hold them as pending, and re-apply stale values if it took over again.
"""
from __future__ import annotations

import asyncio
import re
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import zmq

from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.security import Security
from clonemap.shards.common.zio import AsyncSocket

XPUB_SNDHWM = 100_000
STANDBY_QUEUE_AGE_S = 2.0
"""Longest a KVSET waits for the collector of a server the shard does not follow."""


@dataclass(frozen=True, slots=True)
class ServerAddress:
    """One CHP server: host and base port P (snapshot P, publisher P+1, collector P+2)."""

    host: str
    port: int

    @property
    def snapshot(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def publisher(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    @property
    def collector(self) -> str:
        return f"tcp://{self.host}:{self.port + 2}"

    def __str__(self) -> str:
        return self.snapshot


_ADDRESS_RE = re.compile(r"(?:tcp://)?(\[[^\]]+\]|[^:/\[\]]+):(\d+)/?\Z")


def parse_server(text: "str | ServerAddress") -> ServerAddress:
    """``"tcp://127.0.0.1:6000"`` or ``"127.0.0.1:6000"`` -> ServerAddress (base port)."""
    if isinstance(text, ServerAddress):
        return text
    m = _ADDRESS_RE.match(str(text).strip())
    if not m:
        raise ValueError(f"server address {text!r} is not tcp://HOST:PORT")
    port = int(m.group(2))
    if not 1 <= port <= 65533:
        raise ValueError(f"server address {text!r}: base port must be 1..65533 "
                         "(P, P+1 and P+2 are used)")
    return ServerAddress(m.group(1), port)


class KvsetSender:
    """One XPUB that sends KVSETs to one server's collector (P+2), with a bounded queue."""

    def __init__(self, ctx: zmq.Context, address: ServerAddress, loop, drops: DropCounter,
                 queue_max: int, on_ready_change: Callable[[], None], affinity: int = 0,
                 security: Security | None = None):
        sock = ctx.socket(zmq.XPUB)
        sock.linger = 0
        sock.affinity = affinity
        sock.sndhwm = XPUB_SNDHWM
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        # IMMEDIATE: no pipe while disconnected, so a dead or restarting server is
        # reported as an unsubscription (ready False) and nothing piles up in ZeroMQ
        # for it (a connecting socket otherwise keeps its pipe, and its subscriptions,
        # across reconnects, and would replay a stale backlog to a restarted server)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        (security or Security.off()).connect_side(sock)
        sock.connect(address.collector)
        self.address = address
        self.io = AsyncSocket(sock, self._on_subscription, loop=loop,
                              name=f"collector {address.collector}")
        self.loop = loop
        self.drops = drops
        self.queue_max = queue_max
        self.ready = False
        self.ever_ready = False
        self.on_ready_change = on_ready_change
        self.queue: deque[tuple[float, bool, list[bytes]]] = deque()
        """(queued at, for the followed server, frames)."""
        self.sent = 0
        self.dropped = 0
        self._flusher: asyncio.Task | None = None

    def _on_subscription(self, frames: list[bytes]) -> None:
        head = frames[0][:1]
        if head == b"\x01":
            self.ready = self.ever_ready = True
            self.on_ready_change()
            self._flush_soon()
        elif head == b"\x00":
            self.ready = False
            self.on_ready_change()

    def send(self, frames: list[bytes], keep: bool = True) -> None:
        """Send, or queue. ``keep`` False (not the followed server): dropped, counted, if
        this collector was subscribed and is no longer (the server died or restarts);
        queued for at most ``STANDBY_QUEUE_AGE_S`` otherwise (not subscribed yet at
        start-up, or a full pipe)."""
        if self.ready and not self.queue:
            try:
                self.io.send(frames)
                self.sent += 1
                return
            except zmq.Again:
                pass
        elif not self.ready and not keep and self.ever_ready:
            self.dropped += 1
            self.drops.drop("collector_down", f"{self.address.collector}: not subscribed")
            return
        if len(self.queue) >= self.queue_max:
            self.queue.popleft()
            self.dropped += 1
            self.drops.drop("kvset_queue_full",
                            f"{self.address.collector}: {self.queue_max} KVSETs queued")
        self.queue.append((self.loop.time(), keep, frames))
        self._flush_soon()

    def discard_queue(self) -> None:
        """Drop what is queued (counted): this server is down and not followed."""
        if self.queue:
            n = len(self.queue)
            self.queue.clear()
            self.dropped += n
            self.drops.drop("collector_down", f"{self.address.collector}: {n} queued "
                            "KVSETs dropped (server down, shard moved)")
            self.drops.counts["collector_down"] += n - 1

    def _flush_soon(self) -> None:
        if self.ready and self.queue and (self._flusher is None or self._flusher.done()):
            self._flusher = self.loop.create_task(self._flush())

    async def _flush(self) -> None:
        queue = self.queue
        while queue and self.ready:
            queued_s, keep, frames = queue[0]
            if not keep and self.loop.time() - queued_s > STANDBY_QUEUE_AGE_S:
                # too old for a standby server: the active had it long ago, and the
                # standby would only hold it as pending and might re-apply it stale
                queue.popleft()
                self.dropped += 1
                self.drops.drop("kvset_too_old", f"{self.address.collector}: queued "
                                f"more than {STANDBY_QUEUE_AGE_S} s")
                continue
            try:
                self.io.send(frames)
            except zmq.Again:
                await self.io.wait_writable(None)
                continue
            queue.popleft()
            self.sent += 1

    def close(self, linger_ms: int = 0) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        self.io.close(linger_ms)


def parse_servers(servers: "str | ServerAddress | Sequence[str | ServerAddress]"
                  ) -> tuple[ServerAddress, ...]:
    """One server address or several (a pair's, in order), each parsed."""
    if isinstance(servers, (str, ServerAddress)):
        servers = [servers]
    out = tuple(parse_server(s) for s in servers)
    if not out:
        raise ValueError("servers: give at least one server address (tcp://HOST:PORT)")
    return out
