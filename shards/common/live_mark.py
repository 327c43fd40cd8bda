"""Changing a high-water mark on a socket whose peers come and go, without crashing libzmq.

``setsockopt(SNDHWM or RCVHWM)`` on a socket that has pipes sends the new mark to the
far end of every pipe (the session in libzmq's I/O thread). libzmq 4.3.5, the version
pyzmq's wheels bundle, sends it even down a pipe whose connection is being torn down,
and that far end may already be freed: the I/O thread then reads freed memory and the
process dies of SIGSEGV (libzmq issue 4524; fixed upstream by pull request 4647, "pipe
should only send to peer when active", in no release yet). Found here as a shard server
killed at the moment it took over, when its publisher's mark fell while the clients
that had voted for it were leaving; ``tests/integration/test_live_mark.py`` crashes a
bare socket within a second.

The teardown of one pipe, as libzmq 4.3.5 does it for a peer that disconnected:

1. the I/O thread sees the connection fail, emits ``EVENT_DISCONNECTED`` on the socket's
   monitor, and asks the socket's end of the pipe to terminate;
2. the socket (this thread, inside any call that processes its commands) acknowledges;
3. the I/O thread receives the acknowledgement, acknowledges back and frees its end;
4. the socket (this thread again) receives that and drops the pipe.

A mark set between 2 and 4 reaches freed memory. So ``LiveMark`` sets one only

* after processing the socket's pending commands (``EVENTS``), which finishes step 4 for
  every pipe whose step 3 is done, and
* when the socket's monitor has reported no disconnection for ``quiet_s``. Step 1 comes
  before step 2, so a pipe that step 2 reached is always seen as a disconnection; and
  step 3 is a few microseconds of I/O-thread work, done long before ``quiet_s`` passes.

Otherwise the change waits on a timer until the socket has been quiet for ``quiet_s``,
and is counted (``deferred``). Under constant churn the mark can thus fall late, never
wrongly: a mark that falls late only lets a peer queue what the old mark allowed for a
while longer.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import zmq

from clonemap.shards.common import zio

QUIET_S = 0.25
"""How long a socket's peers must have stayed connected before its mark is changed."""


class LiveMark:
    """One socket option (``zmq.SNDHWM`` or ``zmq.RCVHWM``) of a bound socket, made at
    ``bind`` with the mark it was bound with. ``set(value)`` changes it, ``reapply()``
    sets it again for peers that connected since (a bound socket gives them the mark it
    had at ``bind``). Until ``start(loop)`` a change applies at once (nothing has run the
    socket's commands: no teardown can be half done); after, at once when that is safe,
    else later on the loop. ``close()`` before the socket closes."""

    def __init__(self, sock: zmq.Socket, option: int, *, bind_value: int, name: str = "",
                 quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic):
        self.sock = sock
        self.option = option
        self.loop: asyncio.AbstractEventLoop | None = None
        self.name = name
        self.quiet_s = quiet_s
        self.clock = clock
        self.bind_value = bind_value
        """The mark the socket had at ``bind``: what libzmq gives a new peer's pipe."""
        self.value = bind_value
        """The mark wanted."""
        self.applied = bind_value
        """The mark last given to libzmq."""
        self.stale = False
        """Peers connected since the mark was last applied (``reapply``)."""
        self.sets = 0
        self.deferred = 0
        self.disconnects = 0
        self._last_disconnect: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._settled: asyncio.Future | None = None
        self._monitor: zmq.Socket | None = None
        self._reader: zio.AsyncSocket | None = None
        self._kick: Callable[[], None] | None = None
        self._closed = False

    def start(self, loop: asyncio.AbstractEventLoop,
              kick: Callable[[], None] | None = None) -> "LiveMark":
        """From now on a change waits for a quiet socket. The monitor is read as its
        events come, so that each is timed when it happened (give or take a loop turn),
        not when a mark is next changed. ``kick()``: tell the socket's own reader to
        look again (``zio.AsyncSocket.kick``): processing the socket's commands here can
        take the edge of its FD, and a message waiting there would wait for the next."""
        self.loop = loop
        self._kick = kick
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._reader = zio.AsyncSocket(self._monitor, self._on_disconnect, loop=loop,
                                       name=f"{self.name or 'socket'} monitor",
                                       recv_only=True)
        return self

    def set(self, value: int) -> None:
        """Want ``value`` from now on."""
        self.value = value
        self._try()

    def reapply(self) -> None:
        """New peers connected: give their pipes the wanted mark, unless that is still
        the bind-time one (then they have it)."""
        if self.value != self.bind_value:
            self.stale = True
            self._try()

    @property
    def pending(self) -> bool:
        """A change is waiting for the socket to be quiet."""
        return self._timer is not None

    async def settled(self) -> None:
        """Return once no change waits (at once if none does)."""
        if self._timer is not None:
            if self._settled is None:
                self._settled = self.loop.create_future()
            await asyncio.shield(self._settled)

    def _wake(self) -> None:
        waiter, self._settled = self._settled, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _try(self) -> None:
        if self._closed or (self.value == self.applied and not self.stale):
            return
        quiet_in = self._quiet_in() if self._monitor is not None else 0.0
        if quiet_in > 0:
            if self._timer is None:
                self.deferred += 1
                self._timer = self.loop.call_later(quiet_in, self._retry)
            return
        if self._timer is not None:  # asked again once quiet: no need to wait on
            self._timer.cancel()
            self._timer = None
        self.sock.setsockopt(self.option, self.value)
        self.applied, self.stale = self.value, False
        self.sets += 1
        self._wake()

    def _retry(self) -> None:
        self._timer = None
        self._try()
        if self._timer is None:
            self._wake()

    def _on_disconnect(self, frames: list[bytes]) -> None:
        self.disconnects += 1
        self._last_disconnect = self.clock()

    def _quiet_in(self) -> float:
        """Seconds until the socket has been quiet for ``quiet_s`` (0: it has). First
        the socket's own commands (step 4 of every finished teardown), then its
        monitor (step 1 of every teardown that step 2 reached)."""
        self.sock.getsockopt(zmq.EVENTS)
        if self._kick is not None:
            self._kick()
        monitor = self._monitor
        assert monitor is not None
        monitor.getsockopt(zmq.EVENTS)  # an unthrottled look at its commands
        drained = False
        while True:  # what the reader has not had yet: it came within a loop turn
            try:
                self._on_disconnect(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            drained = True
        if drained and self._reader is not None:
            self._reader.kick()  # its FD's edge may have gone with these reads
        if self._last_disconnect is None:
            return 0.0
        return max(0.0, self._last_disconnect + self.quiet_s - self.clock())

    def stats(self) -> dict:
        return {"value": self.value, "applied": self.applied, "sets": self.sets,
                "deferred": self.deferred, "disconnects": self.disconnects}

    def close(self) -> None:
        """Stop the timer and the monitor (before the socket itself closes). Idempotent."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()
        reader, self._reader, self._monitor = self._reader, None, None
        if reader is None:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        reader.close(linger=0)
