"""A small pipelined RESP client of a Valkey (or Redis) cluster, for ``bench reshard``'s
anchor writer (``bench.harness.reshard_writer --valkey``): ``SET`` only, on asyncio.

Why not redis-py: its blocking cluster client, in a pool of threads, cost more than 200 us
of the 2-core host's CPU a write (the writer at 110% of a core sent 2,815 of the 5,000
writes/s asked, and its waits were queueing in the writer: a p50 of 1.8 s before the
move), and its asyncio cluster client failed under the migration (writes lost inside it).
The anchor's column then measured the client, not Valkey. Here each node has one
connection; a command is written at once and its reply is the next one that connection
reads (RESP answers a connection's commands in order), so a write costs a few
microseconds of Python. redis-py still makes and drives the cluster
(``bench.harness.valkey_cluster``); its ``key_slot`` routes here.

Redirects are followed as a cluster client must: ``-MOVED slot host:port`` (the slot's
owner changed: remembered, and the write sent there), ``-ASK slot host:port`` (this once:
``ASKING`` then the write, on that node), ``-TRYAGAIN``, ``-CLUSTERDOWN`` and ``-LOADING``
(sent again after ``RETRY_S``). Any other error fails the write (``RespError``).
"""
from __future__ import annotations

import asyncio
import collections

RETRY_S = 0.01
"""The pause before a write answered TRYAGAIN, CLUSTERDOWN or LOADING is sent again."""
REDIRECTS_MAX = 16
"""Redirects and retries one write may take before it fails."""
_RETRIED = (b"TRYAGAIN", b"CLUSTERDOWN", b"LOADING")
_ASKING = b"*1\r\n$6\r\nASKING\r\n"


class RespError(Exception):
    """A write the cluster refused (its error reply), or one redirected too often."""


def command(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(parts)


def split_replies(buf: bytes) -> tuple[list[bytes | None], bytes]:
    """The whole replies at the start of ``buf``, and what is left of it (a reply not yet
    whole). A simple string, error or integer is its line with its type byte (``+OK``,
    ``-MOVED 12 127.0.0.1:7001``, ``:1``); a bulk string is ``$`` and its bytes (None:
    the null one). Arrays are not parsed: no command sent here is answered by one."""
    replies: list[bytes | None] = []
    pos = 0
    while True:
        end = buf.find(b"\r\n", pos)
        if end < 0:
            break
        kind = buf[pos:pos + 1]
        if kind == b"$":
            size = int(buf[pos + 1:end])
            if size < 0:
                replies.append(None)
                pos = end + 2
                continue
            if len(buf) < end + 2 + size + 2:
                break
            replies.append(b"$" + buf[end + 2:end + 2 + size])
            pos = end + 2 + size + 2
        elif kind in (b"+", b"-", b":"):
            replies.append(buf[pos:end])
            pos = end + 2
        else:
            raise RespError(f"unexpected reply type {kind!r}")
    return replies, buf[pos:]


class _Connection(asyncio.Protocol):
    """One node's connection: futures of the replies it waits for, in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.rest = b""
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, payload: bytes) -> asyncio.Future:
        if self.closed:
            raise ConnectionError("the node's connection closed")
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(payload)
        return future

    def data_received(self, data: bytes) -> None:
        try:
            replies, self.rest = split_replies(self.rest + data if self.rest else data)
        except (RespError, ValueError) as exc:
            self._fail(ConnectionError(f"bad reply: {exc}"))
            self.transport.close()
            return
        for reply in replies:
            if not self.waiting:  # (a reply no command asked for: the stream is lost)
                self._fail(ConnectionError("a reply nothing waited for"))
                self.transport.close()
                return
            future = self.waiting.popleft()
            if not future.done():  # (a write that timed out still takes its reply)
                future.set_result(reply)

    def connection_lost(self, exc) -> None:
        self._fail(ConnectionError(f"the node's connection closed ({exc})"))

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)


class RespCluster:
    """``await set(key, value)`` on the node that owns the key's slot. ``slots``: one
    ``(host, port)`` per slot (16,384), from ``CLUSTER SLOTS`` (``slot_table``)."""

    def __init__(self, slots: list[tuple[str, int]], key_slot):
        self.slots = slots
        self.key_slot = key_slot
        self._conns: dict[tuple[str, int], asyncio.Future] = {}
        self.redirects = collections.Counter()
        """The error replies met, by kind: MOVED, ASK and the retried ones followed, any
        other the write's failure."""

    async def _conn(self, node: tuple[str, int]) -> _Connection:
        opening = self._conns.get(node)
        if opening is None or (opening.done() and (opening.exception() is not None
                                                   or opening.result().closed)):
            opening = self._conns[node] = asyncio.ensure_future(self._open(node))
        return await asyncio.shield(opening)

    @staticmethod
    async def _open(node: tuple[str, int]) -> _Connection:
        _, conn = await asyncio.get_running_loop().create_connection(_Connection, *node)
        return conn

    async def set(self, key: bytes, value: bytes) -> None:
        payload = command(b"SET", key, value)
        node, asking = self.slots[self.key_slot(key)], False
        for _ in range(REDIRECTS_MAX):
            conn = await self._conn(node)
            if asking:
                conn.send(_ASKING)  # (its +OK is read in order; nothing waits on it)
            reply = await conn.send(payload)
            if reply[:1] != b"-":
                return
            kind, *rest = reply[1:].split() or [b"ERR"]  # (a bare "-": an error too)
            self.redirects[kind.decode(errors="replace")] += 1
            if kind in (b"MOVED", b"ASK") and len(rest) == 2:
                host, _, port = rest[1].decode().rpartition(":")
                node, asking = (host, int(port)), kind == b"ASK"
                if not asking:
                    self.slots[int(rest[0])] = node
            elif kind in _RETRIED:
                asking = False
                await asyncio.sleep(RETRY_S)
            else:
                raise RespError(reply.decode(errors="replace"))
        raise RespError(f"{REDIRECTS_MAX} redirects or retries for one write")

    def close(self) -> None:
        for opening in self._conns.values():
            if opening.done() and opening.exception() is None:
                opening.result().transport.close()
            else:
                opening.cancel()


def slot_table(cluster_slots: list, slots: int = 16384) -> list[tuple[str, int]]:
    """The owner of each slot from a ``CLUSTER SLOTS`` reply as redis-py returns it raw
    (``[[start, end, [host, port, id, ...], replica, ...], ...]``)."""
    table: list[tuple[str, int] | None] = [None] * slots
    for start, end, primary, *_ in cluster_slots:
        host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
        for slot in range(int(start), int(end) + 1):
            table[slot] = (host, int(primary[1]))
    missing = [i for i, node in enumerate(table) if node is None]
    if missing:
        raise RespError(f"{len(missing)} slots have no owner (the first: {missing[0]})")
    return table
