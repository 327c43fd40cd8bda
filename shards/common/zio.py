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

Two frame paths, chosen once at import (``FRAME_PATH``):

* **compiled** (``clonemap.shards.common._zframes``, a small C extension built at install when a
  compiler is present): a whole message in one call, with libzmq's MORE flag read in C
  after every frame (~0.35 us for a 5-frame message, against ~3.1 us for the pure path),
  ``None`` instead of a raised ``zmq.Again`` when nothing is waiting, and a batch drained
  in C with the handler called per message;
* **pure**: pyzmq's backend calls, one ``zmq.Frame`` per frame to read its MORE flag.

Both keep every message boundary: a short, long or many-frame message is never merged
with the next one. ``CLONEMAP_PURE=1`` in the environment forces the pure path (tests
run both; a machine without a compiler gets it automatically).

One owner per socket: an ``AsyncSocket`` belongs to the task/agent that created it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import select
from typing import Callable

import zmq
from zmq.backend import Socket as _BackendSocket

from clonemap.shards.common.errors import Timeout

log = logging.getLogger(__name__)

_recv = _BackendSocket.recv
_send = _BackendSocket.send
NOBLOCK = int(zmq.NOBLOCK)  # plain ints: an enum's | costs ~0.7 us per call here
SNDMORE = int(zmq.SNDMORE)
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_get = _BackendSocket.get  # sock.EVENTS goes through pyzmq's attribute sugar and an enum

MAX_FRAMES = 64
"""Frames kept per received message; the rest are read and discarded, so a decoder sees
``MAX_FRAMES + 1`` frames and rejects the message by its frame count."""

DEFAULT_BATCH = 256


def _libzmq_path() -> str | None:
    """The file of the libzmq this process has loaded (pyzmq's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libzmq"):
                    return path
    except OSError:
        pass
    return None


def _error_of(errno: int) -> zmq.ZMQError:
    """The exception pyzmq raises for ``errno`` (``zmq.Again`` for EAGAIN)."""
    return zmq.Again(errno) if errno == zmq.EAGAIN else zmq.ZMQError(errno)


def _guard_sends(path: str | None) -> tuple[Callable[[], int], str]:
    """Make libzmq survive a send that fails with EACCES, and say how (``SEND_GUARD``).

    libzmq 4.3.5 aborts the whole process when a TCP send fails with EACCES (an
    assertion in its ``tcp_write``), and Linux gives that error to a connection whose
    route became ``prohibit`` once ``TCP_USER_TIMEOUT`` (``link_heartbeats``) gives up on
    it. The compiled extension points libzmq's own calls to ``send`` at a wrapper that
    reports EHOSTUNREACH instead, which libzmq handles as a dead peer (it closes the
    connection and reconnects). Installed whatever the frame path (``CLONEMAP_PURE``
    chooses frame calls, not safety); without the extension a process is as exposed as
    any pyzmq program. Returns the count of sends so turned, and the state in words."""
    try:
        from clonemap.shards.common import _zframes
    except ImportError:
        return int, "off (the compiled extension is not built)"
    guard = getattr(_zframes, "guard_send", None)
    if guard is None:
        return int, "off (not available on this platform)"
    if path is None:
        return int, "off (pyzmq's libzmq was not found in this process's maps)"
    try:
        slots = guard(path)
    except (ImportError, OSError) as exc:
        return int, f"off ({exc})"
    if slots == 0:
        return int, "off (libzmq does not import send)"
    return _zframes.send_refusals, "on"


_LIBZMQ = _libzmq_path()
refused_sends, SEND_GUARD = _guard_sends(_LIBZMQ)
"""``refused_sends()``: libzmq's sends that failed with EACCES and were reported to it
as EHOSTUNREACH in this process; ``SEND_GUARD``: "on", or "off (why)"."""


def send_guard_stats() -> dict:
    """The guard's state and count, as a server's and a client's stats report them."""
    return {"state": SEND_GUARD, "refused_sends": refused_sends()}


def _load_compiled():
    """The bound ``_zframes`` module and why, or None and why not."""
    if os.environ.get("CLONEMAP_PURE", "") not in ("", "0"):
        return None, "pure (CLONEMAP_PURE is set)"
    try:
        from clonemap.shards.common import _zframes
    except ImportError as exc:
        return None, f"pure (the compiled extension is not built: {exc})"
    path = _LIBZMQ
    if path is None:
        return None, "pure (pyzmq's libzmq was not found in this process's maps)"
    try:
        _zframes.bind(path, _error_of)
    except ImportError as exc:
        return None, f"pure ({exc})"
    return _zframes, "compiled"


_compiled, FRAME_PATH = _load_compiled()
COMPILED = _compiled is not None


def compiled_function(name: str):
    """A function of the compiled frame path by name; None on the pure path (or in an
    extension built before it had that function)."""
    return getattr(_compiled, name, None)
"""Whether the compiled frame path is in use (``FRAME_PATH`` says which and why)."""


def _recv_frames_pure(sock: zmq.Socket, flags: int = NOBLOCK) -> list[bytes]:
    frame = _recv(sock, flags, False)
    frames = [frame.bytes]
    while frame.more:
        frame = _recv(sock, flags, False)
        if len(frames) <= MAX_FRAMES:
            frames.append(frame.bytes)
    return frames


def recv_frames(sock: zmq.Socket, flags: int = NOBLOCK) -> list[bytes]:
    """Receive one whole multipart message as bytes frames. Raises ``zmq.Again``."""
    frames = _c_recv(sock.underlying, flags, MAX_FRAMES)
    if frames is None:
        raise zmq.Again()
    return frames


if COMPILED:
    _c_recv = _compiled.recv
    _c_send = _compiled.send
    _c_drain = _compiled.drain
else:
    recv_frames = _recv_frames_pure  # noqa: F811 (the pure path replaces it)


class Frames(list):
    """A received message's frames, with the User-Id the ZAP handler gave the sender's
    connection (``clonemap.shards.common.security``), or None."""

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


def _send_frames_pure(sock: zmq.Socket, frames: list[bytes], flags: int = NOBLOCK) -> None:
    last = len(frames) - 1
    more = flags | SNDMORE
    for i in range(last):
        _send(sock, frames[i], more)
    _send(sock, frames[last], flags)


def _send_frames5_pure(sock: zmq.Socket, f0: bytes, f1: bytes, f2: bytes, f3: bytes,
                       f4: bytes, flags: int = NOBLOCK) -> None:
    more = flags | SNDMORE
    _send(sock, f0, more)
    _send(sock, f1, more)
    _send(sock, f2, more)
    _send(sock, f3, more)
    _send(sock, f4, flags)


def send_frames(sock: zmq.Socket, frames: list[bytes], flags: int = NOBLOCK) -> None:
    """Send a multipart message (bytes frames). ``zmq.Again`` can only come from the
    first frame (ZeroMQ checks the high-water mark when a message starts)."""
    _c_send(sock.underlying, frames, flags)


def send_frames5(sock: zmq.Socket, f0: bytes, f1: bytes, f2: bytes, f3: bytes, f4: bytes,
                 flags: int = NOBLOCK) -> None:
    """``send_frames`` for CHP's 5-frame messages (the hot path)."""
    _c_send(sock.underlying, (f0, f1, f2, f3, f4), flags)


def compiled_recv() -> Callable[[int, int, int], list[bytes] | None]:
    """The compiled path's ``recv(handle, flags, max_frames)`` for a loop of one's own
    (``handle``: ``sock.underlying``): one whole message as at most ``max_frames + 1``
    frames (the rest read and discarded), or None when none is waiting. Only when
    ``COMPILED``; the benchmark subscriber uses it to outrun what it measures."""
    if not COMPILED:
        raise RuntimeError(f"no compiled frame path: {FRAME_PATH}")
    return _compiled.recv


send_rows: Callable[..., int] | None = _compiled.send_rows if COMPILED else None
"""Compiled path only (else None): ``send_rows(handle, identity, keys, values, seqs,
props, start, stop) -> next`` sends rows ``start`` to ``stop - 1`` of the columns (``seqs``
ints, ``props`` one bytes for all or a list) as a ROUTER's KVSYNCs ``[identity, key,
seq, "", props, value]``, non-blocking, and returns the index of the first row not sent
(earlier than ``stop`` where the peer's pipe is full: never half a row). Other errors
raise. One C call per snapshot chunk instead of six per row, and no tuple or packed
sequence per row."""


def _keep_tracked(frames: list) -> list:
    return frames


untrack_frames: Callable[[list], list] = _compiled.untrack if COMPILED else _keep_tracked
"""``untrack_frames(frames) -> frames``: take a list that holds only bytes, and will only
ever hold bytes, off the cyclic garbage collector's lists (``TypeError`` for anything
else). Such a list cannot be in a cycle; its reference count still frees it. For a long-
lived ring of frames (``clonemap.shards.history``), whose lists every older-generation collection
would otherwise walk. On the pure path it leaves the list as it is."""


def publisher_many(sock: zmq.Socket, width: int = 0) -> Callable[[list], None]:
    """``send_many(messages)`` (each non-blocking, in order) for one socket's hot path:
    one call for a whole burst on the compiled path. With ``width``, ``messages`` is one
    flat list of frames, ``width`` to a message (what a server's resume history keeps: no
    tuple per update for the garbage collector to walk). The caller keeps the socket open
    while it uses it. A PUB/XPUB never refuses (it drops at its high-water mark); on
    another socket, ``zmq.Again`` leaves the rest of the burst unsent. A message with a
    frame that is not bytes is refused before any of its frames goes out."""
    if COMPILED:
        if not width:
            return functools.partial(_compiled.send_many, sock.underlying)
        send, handle = _compiled.send_many, sock.underlying

        def send_flat(frames: list) -> None:  # one Python call per burst
            send(handle, frames, width)
        return send_flat

    def send_many(messages: list) -> None:
        for frames in messages:
            if not all(type(frame) is bytes for frame in frames):  # never half a message
                raise TypeError("every frame must be bytes")
            _send_frames_pure(sock, frames)

    def send_many_flat(frames: list) -> None:
        if len(frames) % width:
            raise ValueError(f"{len(frames)} frames are not whole messages of {width}")
        for i in range(0, len(frames), width):
            send_many((frames[i:i + width],))
    return send_many_flat if width else send_many


if not COMPILED:
    send_frames = _send_frames_pure  # noqa: F811
    send_frames5 = _send_frames5_pure  # noqa: F811


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
                 name: str = "", recv: Callable[[zmq.Socket], list[bytes]] | None = None,
                 after_batch: Callable[[], None] | None = None, recv_only: bool = False,
                 bulk: Callable[[int, int], tuple[int, list[bytes] | None] | None] | None = None,
                 with_user: bool = False):
        """``with_user``: ``on_message(frames, user_id)``, with the User-Id the ZAP
        handler gave the sender's connection (None without one): where rights are
        checked per message (``clonemap.shards.gate``).

        ``after_batch()``: called once after every batch that read a message (a server
        publishes what the batch produced there, one burst per batch).

        ``bulk(handle, limit)`` (compiled path only): tried before each message is read
        one by one; it may take up to ``limit`` messages itself (the client's snapshot
        rows, ``_zframes.take_rows``) and returns ``(n, frames)``: ``frames`` the first
        message it did not take, which goes to ``on_message``, or None when it stopped at
        ``limit`` or found nothing waiting. It returns None when it has nothing to do (no
        snapshot is being received), and the messages are read one by one.

        ``recv_only``: nothing ever sends on this socket (a collector). Then a batch that
        read until ``zmq.Again`` skips the ``EVENTS`` query after it: a receive that finds
        nothing has just processed libzmq's pending commands, as that query would (a
        getpid and a zero-timeout poll each), so the FD fires for the next message. A
        send on the socket could consume that edge; hence only where none happens."""
        self.sock = sock
        if with_user and on_message is not None and not (COMPILED and recv is None):
            told = on_message
            recv = recv or recv_frames_with_user
            on_message = lambda frames: told(frames, frames.user_id)  # noqa: E731
        self.on_message = on_message
        self.after_batch = after_batch
        self._recv = recv or recv_frames
        self.batch = batch
        self.name = name or repr(sock)
        self.loop = loop or asyncio.get_running_loop()
        self.errors = 0
        self.received = 0
        self.late_reads = 0
        """Times ``look_again`` found messages the FD had not announced."""
        self._scheduled = False
        self._closed = False
        self._paused: asyncio.TimerHandle | None = None
        self._writable_waiters: list[asyncio.Future] = []
        self._fd = sock.FD
        self._handle = sock.underlying
        self._drain = ((_compiled.drain_users if with_user else _c_drain)
                       if COMPILED and recv is None else None)
        self._bulk = bulk if self._drain is not None else None
        self._recv_only = recv_only
        self.loop.add_reader(self._fd, self._on_fd)
        self._schedule()

    # ------------------------------------------------------------------ reading
    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._on_fd)

    def pause(self, seconds: float) -> None:
        """Read nothing for ``seconds`` (a reader's pacing): what arrives meanwhile waits
        in the socket, whose high-water mark then pushes back on the sender."""
        if self._closed or seconds <= 0:
            return
        if self._paused is not None:
            self._paused.cancel()
        self._paused = self.loop.call_later(seconds, self._unpause)

    @property
    def paused(self) -> bool:
        """Reading is paused (``pause``)."""
        return self._paused is not None

    def _unpause(self) -> None:
        self._paused = None
        self._schedule()

    def _on_fd(self) -> None:
        self._scheduled = False
        if self._closed or self._paused is not None:
            return
        sock = self.sock
        handler = self.on_message
        n = 0
        if handler is not None and self._drain is not None:
            n = self._drain_compiled(handler)
            if self._closed:
                return
        elif handler is not None:
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
        if n and self.after_batch is not None:
            try:
                self.after_batch()
            except Exception:
                self.errors += 1
                log.exception("%s: after_batch failed", self.name)
        if (self._recv_only and handler is not None and n < self.batch
                and not self._writable_waiters and not self._closed):
            return  # read until Again: libzmq's commands were processed there
        try:
            events = _get(sock, _EVENTS)  # ~1 us where sock.EVENTS costs ~2.5
        except zmq.ZMQError:
            return
        if self._writable_waiters and events & POLLOUT:
            waiters, self._writable_waiters = self._writable_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        if n >= self.batch or (handler is not None and events & POLLIN):
            self._schedule()

    def _drain_compiled(self, handler: Callable[[list[bytes]], None]) -> int:
        """Up to ``batch`` messages read and handled in C (or taken by ``bulk``); a
        handler's exception is logged and counted, and the drain goes on."""
        drain, bulk = self._drain, self._bulk
        batch = self.batch
        n = 0
        while n < batch:
            try:
                taken = bulk(self._handle, batch - n) if bulk is not None else None
                if taken is None:
                    got, exc, frames = drain(self._handle, self, batch - n, MAX_FRAMES,
                                             handler)
                    done = exc is None  # EAGAIN, the limit, or the socket closed
                else:
                    (got, frames), exc = taken, None
                    done = frames is None  # the limit, or nothing waiting
                    if frames is not None:  # one bulk did not take: the handler's
                        got += 1
                        try:
                            handler(frames)
                        except Exception as err:
                            exc = err
            except zmq.ZMQError as err:
                if err.errno == zmq.ENOTSOCK or self._closed:
                    return n
                raise
            n += got
            if exc is not None:
                if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not ours
                    raise exc
                self.errors += 1
                log.error("%s: handler failed on a %d-frame message", self.name, len(frames),
                          exc_info=exc)
            if done or self._closed:
                break
        self.received += n
        return n

    # ------------------------------------------------------------------ writing
    def send(self, frames: list[bytes], flags: int = NOBLOCK) -> None:
        """Send without blocking; raises ``zmq.Again`` at the high-water mark."""
        send_frames(self.sock, frames, flags)
        self._schedule()

    async def wait_writable(self, timeout_s: float | None = None) -> None:
        """Wait until ``EVENTS`` reports POLLOUT (flow control for ROUTER/DEALER)."""
        if _get(self.sock, _EVENTS) & POLLOUT:
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

    def read_now(self) -> None:
        """Read what waits now, in this turn (a handler elsewhere needs it handled
        first)."""
        self._on_fd()

    def look_again(self) -> bool:
        """A periodic look for messages that wait while the FD announces nothing (its
        edge taken by a call on the socket outside this reader that was not followed by
        ``kick``): read them on the next turn, counted in ``late_reads``; True if there
        were. The FD is asked first (a readable one is the loop's to handle), so the
        ``EVENTS`` query here takes no edge the loop was about to see. A message that
        arrives between the two is counted too: about 1 look in 1,000 on a socket
        receiving 1,000 messages/s, 1 in 40 at 20,000/s (measured here), so the count
        alone does not prove a missed wake-up."""
        if self._closed or self._scheduled or self._paused is not None or \
                self.on_message is None:
            return False
        try:
            if select.select([self._fd], [], [], 0)[0]:
                return False
            events = _get(self.sock, _EVENTS)
        except (OSError, ValueError, zmq.ZMQError):  # closed meanwhile
            return False
        if not events & POLLIN:
            return False
        self.late_reads += 1
        log.debug("%s: messages waiting that the socket had not announced: read now (%d "
                  "such reads)", self.name, self.late_reads)
        self._schedule()
        return True

    # ------------------------------------------------------------------ closing
    def close(self, linger: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        try:
            self.loop.remove_reader(self._fd)
        except Exception:  # the loop may already be closed
            pass
        for fut in self._writable_waiters:
            if not fut.done():
                fut.cancel()
        self._writable_waiters.clear()
        self.sock.close(linger=linger)


def close_monitored(io: "AsyncSocket | None", monitor: "AsyncSocket | None") -> None:
    """Close ``io`` and ``monitor``, the socket monitor made for it: the monitor is
    stopped first, so libzmq never writes to a closed PAIR."""
    if io is not None and monitor is not None:
        try:
            io.sock.disable_monitor()
        except zmq.ZMQError:
            pass
    for each in (monitor, io):
        if each is not None:
            each.close()


LINK_BEATS = 3
"""ZMTP heartbeats (``link_heartbeats``) missed before a connection counts as dead."""


def link_heartbeats(sock: zmq.Socket, interval_s: float) -> None:
    """ZMTP 3.1 heartbeats on every connection of ``sock``: a PING every ``interval_s``;
    a connection that answers nothing for ``LINK_BEATS`` intervals is closed (and a
    connecting socket reconnects), a connect that does not complete in that time is
    retried, and TCP gives up on unacknowledged data then too (``TCP_USER_TIMEOUT``).
    Without them a connection stalled by a partition can take 10 s and more to recover
    after the heal (TCP's retransmission backoff). A peer on ZMTP 3.0 is not pinged."""
    ms = max(100, int(interval_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, LINK_BEATS * ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, LINK_BEATS * ms)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, LINK_BEATS * ms)
    sock.setsockopt(zmq.TCP_MAXRT, LINK_BEATS * ms)


def patient_with_readers(sock: zmq.Socket, stall_s: float) -> None:
    """A bound socket that streams to its peers (a server's snapshot ROUTER): with
    ``link_heartbeats`` on it, a connection is closed only when its peer has answered
    nothing for ``stall_s``, TCP included; a peer reconnecting under the routing id of a
    connection not yet closed takes it over (``ROUTER_HANDOVER``). A PING queues behind
    the data already on its way, and its PONG behind what the peer has not read yet: a
    reader that takes a second to drain its buffers (a large snapshot, a loaded host)
    answered too late for three heartbeats and was cut off at every try (and TCP, at a
    zero window held that long). The connecting sides keep the three-heartbeat rule:
    they make a stalled link again within about three heartbeats of a heal. No-op on a
    socket without heartbeats."""
    if sock.getsockopt(zmq.HEARTBEAT_IVL) <= 0:
        return
    ms = max(sock.getsockopt(zmq.HEARTBEAT_TIMEOUT), int(stall_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
    sock.setsockopt(zmq.TCP_MAXRT, ms)
    if sock.type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
