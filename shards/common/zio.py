"""ZeroMQ sockets inside an asyncio loop: fast frame I/O and a capped-batch reader.

Why this exists (the figures are in the README's *Performance* section, measured by the
benchmarks, not here):

* ``send_multipart``/``recv_multipart`` spend most of their time in Python-side flag
  handling; the backend calls below are several times cheaper. ``recv_frames`` checks
  ``Frame.more`` on every frame, so a short message can never be merged with the next.
* ``zmq.asyncio`` awaits one message at a time (much slower than draining in batches),
  and draining until EAGAIN starves the loop's timers. ``AsyncSocket`` drains up to ``batch``
  messages per wake-up, then yields with ``call_soon``.

ZeroMQ's ``FD`` is edge-triggered: it signals that ``EVENTS`` *may* have changed, and any
send or recv on the socket can consume the signal. So after every batch, and after every
send through ``AsyncSocket.send``, the adapter re-checks ``EVENTS`` on the next loop turn.

One owner per socket: an ``AsyncSocket`` belongs to the task/agent that created it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
from zmq.backend import Socket as _BackendSocket

from shards.common.errors import Timeout

log = logging.getLogger(__name__)

_recv = _BackendSocket.recv
_send = _BackendSocket.send
NOBLOCK = int(zmq.NOBLOCK)  # plain ints: an enum's | costs ~0.7 us per call here
SNDMORE = int(zmq.SNDMORE)
POLLIN = zmq.POLLIN
POLLOUT = zmq.POLLOUT

MAX_FRAMES = 64
"""Frames kept per received message; the rest are read and discarded, so a decoder sees
``MAX_FRAMES + 1`` frames and rejects the message by its frame count."""

DEFAULT_BATCH = 256


def recv_frames(sock: zmq.Socket, flags: int = NOBLOCK) -> list[bytes]:
    """Receive one whole multipart message as bytes frames. Raises ``zmq.Again``."""
    frame = _recv(sock, flags, False)
    frames = [frame.bytes]
    while frame.more:
        frame = _recv(sock, flags, False)
        if len(frames) <= MAX_FRAMES:
            frames.append(frame.bytes)
    return frames


class Frames(list):
    """A received message's frames, with the User-Id the ZAP handler gave the sender's
    connection (``shards.common.security``), or None."""

    __slots__ = ("user_id",)


def recv_frames_with_user(sock: zmq.Socket) -> Frames:
    """``recv_frames`` that also reads the message's User-Id (non-copying receive: a
    little slower; used where a peer's role matters, such as the MDP broker with CURVE)."""
    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    out = Frames(part.bytes for part in parts)
    try:
        out.user_id = parts[-1].get("User-Id")
    except zmq.ZMQError:
        out.user_id = None
    return out


def send_frames(sock: zmq.Socket, frames: list[bytes], flags: int = NOBLOCK) -> None:
    """Send a multipart message. ``zmq.Again`` can only come from the first frame
    (ZeroMQ checks the high-water mark when a message starts)."""
    last = len(frames) - 1
    more = flags | SNDMORE
    for i in range(last):
        _send(sock, frames[i], more)
    _send(sock, frames[last], flags)


def send_frames5(sock: zmq.Socket, f0: bytes, f1: bytes, f2: bytes, f3: bytes, f4: bytes,
                 flags: int = NOBLOCK) -> None:
    """``send_frames`` unrolled for CHP's 5-frame messages (the hot path)."""
    more = flags | SNDMORE
    _send(sock, f0, more)
    _send(sock, f1, more)
    _send(sock, f2, more)
    _send(sock, f3, more)
    _send(sock, f4, flags)


class AsyncSocket:
    """Drives one zmq socket from an asyncio loop.

    ``on_message(frames)`` is called for each received message, at most ``batch`` per loop
    turn. It must not block; exceptions it raises are logged and counted in ``errors``,
    and never stop the reader. A socket that is only written (PUB) needs no
    ``on_message``: use ``send``; it never blocks (``zmq.Again`` is raised to the caller).
    """

    def __init__(self, sock: zmq.Socket,
                 on_message: Callable[[list[bytes]], None] | None = None, *,
                 batch: int = DEFAULT_BATCH, loop: asyncio.AbstractEventLoop | None = None,
                 name: str = "", recv: Callable[[zmq.Socket], list[bytes]] | None = None):
        self.sock = sock
        self.on_message = on_message
        self._recv = recv or recv_frames
        self.batch = batch
        self.name = name or repr(sock)
        self.loop = loop or asyncio.get_running_loop()
        self.errors = 0
        self.received = 0
        self._scheduled = False
        self._closed = False
        self._writable_waiters: list[asyncio.Future] = []
        self._fd = sock.FD
        self.loop.add_reader(self._fd, self._on_fd)
        self._schedule()

    # ------------------------------------------------------------------ reading
    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._on_fd)

    def _on_fd(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock = self.sock
        handler = self.on_message
        n = 0
        if handler is not None:
            batch = self.batch
            recv = self._recv
            while n < batch:
                try:
                    frames = recv(sock)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ENOTSOCK or self._closed:
                        return
                    raise
                n += 1
                try:
                    handler(frames)
                except Exception:  # a handler bug must not kill the reader
                    self.errors += 1
                    log.exception("%s: handler failed on a %d-frame message", self.name,
                                  len(frames))
                if self._closed:
                    return
            self.received += n
        try:
            events = sock.EVENTS
        except zmq.ZMQError:
            return
        if self._writable_waiters and events & POLLOUT:
            waiters, self._writable_waiters = self._writable_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        if n >= self.batch or (handler is not None and events & POLLIN):
            self._schedule()

    # ------------------------------------------------------------------ writing
    def send(self, frames: list[bytes], flags: int = NOBLOCK) -> None:
        """Send without blocking; raises ``zmq.Again`` at the high-water mark."""
        send_frames(self.sock, frames, flags)
        self._schedule()

    async def wait_writable(self, timeout_s: float | None = None) -> None:
        """Wait until ``EVENTS`` reports POLLOUT (flow control for ROUTER/DEALER)."""
        if self.sock.EVENTS & POLLOUT:
            return
        fut = self.loop.create_future()
        self._writable_waiters.append(fut)
        self._schedule()
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise Timeout(f"{self.name}: not writable within {timeout_s} s",
                          what="writable", deadline_s=timeout_s) from None

    def kick(self) -> None:
        """Re-check the socket on the next loop turn (after using ``sock`` directly)."""
        self._schedule()

    # ------------------------------------------------------------------ closing
    def close(self, linger: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.remove_reader(self._fd)
        except Exception:  # the loop may already be closed
            pass
        for fut in self._writable_waiters:
            if not fut.done():
                fut.cancel()
        self._writable_waiters.clear()
        self.sock.close(linger=linger)
