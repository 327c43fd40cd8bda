"""One pump for every reply a server streams to ROUTER peers: snapshots (``ICANHAZ?``)
and the Binary Star TTL table (``BSTAR-TTL?``).

A *stream* is one reply to one peer, sent a piece per loop turn so the reactor keeps
collecting and publishing between pieces. The pump visits the streams round-robin on the
server's loop and owns the rules they share:

* flow control: the ROUTER has ``ROUTER_MANDATORY`` set, so a full pipe raises
  ``zmq.Again`` instead of dropping; the stream keeps its place and the pump comes back
  after ``PAUSE_S``;
* stall abandonment: a stream whose peer accepted nothing for ``stall_s`` is dropped,
  counted ``abandoned``;
* unreachable peers: a peer that disconnected (``EHOSTUNREACH``) is dropped, counted
  ``unreachable``;
* a bound on streams at once (``max_active``); past it, new ones wait in a bounded queue
  (``max_waiting``; beyond that they are refused) or replace the oldest (``evict=True``);
* stalled peers yield: a stream whose peer accepted nothing for ``yield_s`` while others
  wait gives up its slot (counted ``yielded``). It stays open, retried every
  ``STALLED_RETRY_S``, and takes a normal pace again as soon as its peer reads. At most
  ``max_stalled`` streams yield at once: a stalled stream still has its queue of
  messages in libzmq (libzmq cannot drop one peer's queue, and a peer that does not read
  does not answer heartbeats either), so past that an active stream keeps its slot and
  at most ``max_active + max_stalled`` streams are ever open; a new one waits until one
  ends (done, or its peer gone). So peers that ask for a
  snapshot and never read cannot hold every slot for ``stall_s`` while they are fewer than
  ``max_stalled``, and the bytes queued for all streams together stay within
  ``(max_active + max_stalled)`` x one peer's queue (``ShardServer`` derives the ROUTER's
  mark from a byte budget for that).

A stream implements ``send_some(sock) -> str``: ``PROGRESS`` (sent something, more to
come), ``DONE`` (sent its last message), ``BLOCKED`` (nothing accepted: the pipe was
full at once) or ``PACED`` (a paced stream ahead of its rate: it goes on after its
``wait_s``, and is not stalled). It catches ``zmq.Again`` itself (a pipe that fills up partway is progress
if anything went out) and lets ``zmq.ZMQError`` with ``EHOSTUNREACH`` through to the
pump. ``close()`` releases what it holds.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable, Protocol

import zmq

log = logging.getLogger("clonemap.shards.streams")

PROGRESS, DONE, BLOCKED, PACED = "progress", "done", "blocked", "paced"
PAUSE_S = 0.001
"""Retry delay for a stream whose peer's pipe is full."""
STALLED_RETRY_S = 0.05
"""Retry delay for a stream that yielded its slot."""
YIELD_S = 0.5
MAX_STALLED = 16


class Stream(Protocol):
    identity: bytes

    def send_some(self, sock: zmq.Socket) -> str: ...

    def close(self) -> None: ...


class _Entry:
    __slots__ = ("stream", "progress_s", "retry_at_s", "stalled")

    def __init__(self, stream: Stream, now: float):
        self.stream = stream
        self.progress_s = now
        self.retry_at_s = 0.0
        self.stalled = False


class StreamPump:
    """Streams to the peers of one ROUTER, pumped on ``loop`` (see the module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket,
                 kick: Callable[[], None], *, stall_s: float, max_active: int,
                 max_waiting: int = 0, evict: bool = False, name: str = "stream",
                 yield_s: float = YIELD_S, max_stalled: int = MAX_STALLED):
        self.loop = loop
        self.sock = sock
        self.kick = kick
        """Re-arms the ROUTER's reader: our sends may consume its edge-triggered FD."""
        self.stall_s = stall_s
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.evict = evict
        self.name = name
        self.yield_s = yield_s
        self.max_stalled = max_stalled
        self.stalled = 0
        """Streams in ``active`` that yielded their slot (not counted against it)."""
        self.active: dict[bytes, _Entry] = {}
        self.waiting: collections.deque[tuple[bytes, Callable[[], Stream]]] = \
            collections.deque()
        self._handle: asyncio.Handle | None = None
        self.counters = dict.fromkeys(("done", "abandoned", "unreachable", "refused",
                                       "yielded", "resumed"), 0)

    def __len__(self) -> int:
        return len(self.active)

    def add(self, identity: bytes, make: Callable[[], Stream]) -> bool:
        """Start ``make()`` for ``identity`` now, or queue it; False if refused (the queue
        is full). ``make`` runs only when the stream starts (a snapshot's point in time).
        With ``evict``, a peer's new stream replaces its old one, and a full pump drops
        its oldest stream."""
        if self.evict:
            if identity in self.active:
                self._remove(identity)
            while len(self.active) >= self.max_active:
                self._remove(next(iter(self.active)))
                self.counters["abandoned"] += 1
            self.active[identity] = _Entry(make(), self.loop.time())
            self._schedule(0.0)
            return True
        if len(self.waiting) >= self.max_waiting:
            self.counters["refused"] += 1
            return False
        self.waiting.append((identity, make))
        self._admit()
        return True

    def clear(self) -> None:
        for entry in self.active.values():
            entry.stream.close()
        self.active.clear()
        self.stalled = 0
        self.waiting.clear()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _admit(self) -> None:
        """Start waiting streams, in order, while there is room; a peer's second stream
        waits until its first is done."""
        if not self.waiting or self._busy() >= self.max_active:
            return
        now = self.loop.time()
        kept: collections.deque = collections.deque()
        while self.waiting:
            identity, make = self.waiting.popleft()
            if identity in self.active or self._busy() >= self.max_active:
                kept.append((identity, make))
                continue
            self.active[identity] = _Entry(make(), now)
        self.waiting = kept
        self._schedule(0.0)

    def _busy(self) -> int:
        """Slots taken: active streams that have not yielded."""
        return len(self.active) - self.stalled

    def _remove(self, identity: bytes) -> None:
        entry = self.active.pop(identity)
        if entry.stalled:
            self.stalled -= 1
        entry.stream.close()

    def _schedule(self, delay_s: float) -> None:
        if self._handle is not None:
            return
        self._handle = (self.loop.call_soon(self._pump) if delay_s <= 0
                        else self.loop.call_later(delay_s, self._pump))

    def _pump(self) -> None:
        """One round-robin turn: a piece of each stream that is not paused."""
        self._handle = None
        if not self.active:
            return
        now = self.loop.time()
        progressed = False
        finished: list[bytes] = []
        next_retry: float | None = None
        for identity, entry in list(self.active.items()):
            if entry.retry_at_s > now:
                next_retry = entry.retry_at_s if next_retry is None else min(
                    next_retry, entry.retry_at_s)
                continue
            try:
                outcome = entry.stream.send_some(self.sock)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self.counters["unreachable"] += 1
                log.info("%s to %r: the peer has gone (%s messages sent, the last "
                         "progress %.1f s ago)", self.name, identity,
                         getattr(entry.stream, "sent", "?"), now - entry.progress_s)
                finished.append(identity)
                continue
            if outcome == DONE:
                self.counters["done"] += 1
                finished.append(identity)
            elif outcome == PACED:
                entry.progress_s = now
                entry.retry_at_s = now + entry.stream.wait_s  # type: ignore[attr-defined]
                next_retry = entry.retry_at_s if next_retry is None else min(
                    next_retry, entry.retry_at_s)
            elif outcome == PROGRESS:
                entry.progress_s = now
                progressed = True
                if entry.stalled:  # its peer reads again
                    entry.stalled = False
                    self.stalled -= 1
                    self.counters["resumed"] += 1
            elif now - entry.progress_s > self.stall_s:
                self.counters["abandoned"] += 1
                log.warning("%s to %r abandoned: nothing accepted for %.1f s", self.name,
                            identity, self.stall_s)
                finished.append(identity)
            else:
                if (not entry.stalled and self.waiting and self.stalled < self.max_stalled
                        and now - entry.progress_s > self.yield_s):
                    entry.stalled = True  # give the slot to a peer that waits
                    self.stalled += 1
                    self.counters["yielded"] += 1
                entry.retry_at_s = now + (STALLED_RETRY_S if entry.stalled else PAUSE_S)
                next_retry = entry.retry_at_s if next_retry is None else min(
                    next_retry, entry.retry_at_s)
        self.kick()
        for identity in finished:
            self._remove(identity)
        if finished or self.stalled:
            self._admit()
        if progressed:
            self._schedule(0.0)
        elif next_retry is not None:
            self._schedule(max(0.0, next_retry - now))
