"""Byte budgets for a server's per-peer queues: message high-water marks derived from bytes.

libzmq's high-water marks count messages. A subscriber that never reads can thus pin
``SNDHWM x (largest message)`` bytes in the server: 100,000 x 8 KB = 800 MB. A writer
that outruns the server can pin ``RCVHWM x (largest message)`` in the collector's queue.
This module turns a byte budget ``B`` per peer into a mark in messages:

    mark = min(cap, max(1, B // cost(M)))      cost(M) = M + MESSAGE_OVERHEAD

``M`` is the largest message since the server started: for the publisher, the largest
update published (key, properties and value bytes); for the collector, the largest
message received, valid or not, counted up to the largest the limits allow. So a
malformed message lowers the collector's mark only. ``M`` only grows, so the marks only
fall. A server whose updates are small keeps the
whole ``cap`` (``--pub-hwm``, ``--collect-hwm``).

*Publisher (strict).* The mark is lowered before a larger update is published. Every
message queued for a subscriber was admitted while its queue held fewer than
``B // cost(M')`` messages, with ``M'`` at least as large as every message queued so far.
So the bytes one subscriber pins stay below ``max(B, cost(M_max))``, where ``M_max`` is
the largest message the limits allow.

*Collector (after the first large message).* The mark is lowered when the server reads
a larger message. libzmq may already have queued up to the old mark behind it, so the
bound holds from then on. ``ZMQ_MAXMSGSIZE`` on the collector bounds any one frame.

libzmq applies a changed mark to the pipes that already exist (checked in
``tests/integration/test_byte_marks.py``), so one ``setsockopt`` bounds every peer connected then.
But a peer that connects later to a *bound* socket gets the mark the socket had when it
was bound (the listener keeps a copy of the options from ``bind``): a subscriber that
came after a lowered mark could queue ``bind-time mark x (largest message)`` bytes
(measured: 1,747 messages of 64 KiB instead of 15). So the server sets the lowered mark
again once new peers are there (``ShardServer.reapply_pub_mark``,
``SnapshotService.reapply``): the publisher's when it welcomes a new subscription, the
snapshot ROUTER's when a stream starts. Not the
collector's: setting ``RCVHWM`` again on a SUB whose pipes carry traffic stalled a
writer's pipe for good in a test (its updates stopped arriving), so a writer that
connects after the collector's mark fell keeps the bind-time mark (its frames are still
bounded by ``ZMQ_MAXMSGSIZE``).

Every change to a socket with live peers goes through ``clonemap.shards.common.live_mark``:
libzmq 4.3.5 crashes on a mark set while a peer's pipe is being torn down, so a change
waits until the socket's peers have stayed connected for a moment (the bound then holds
from that moment). A server binds with the marks of the map it recovered.

The check costs nothing on the hot path. The collector's fast path admits only messages
no larger than ``fast_limit``; a larger one takes the checked path, which calls
``received`` before it decodes and ``published`` before it publishes.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SUBSCRIBER_HELD_BYTES = 64 << 20
"""Default ``B`` of the publisher: bytes one subscriber that reads nothing can pin."""
WRITER_HELD_BYTES = 64 << 20
"""Default ``B`` of the collector: bytes one writer's queued KVSETs can pin."""
MESSAGE_OVERHEAD = 5 * 64 + 24
"""Bytes a queued CHP message costs beyond key, properties and value. libzmq keeps a
64-byte ``msg_t`` per frame in the pipe (five frames), plus the sequence and the UUID.
Measured with a never-reading SUB: 150-290 B beyond the payload per queued message."""
INITIAL_MARK = 256
"""``M`` before the first update: covers HUGZ (about 100 B of properties) and short keys."""


def derive(budget: int, cap: int, largest: int) -> int:
    """The mark in messages for a byte ``budget`` (0: off, the mark is ``cap``) and
    messages of up to ``largest`` bytes; ``cap`` 0 is libzmq's unlimited."""
    if budget <= 0:
        return cap
    derived = max(1, budget // (largest + MESSAGE_OVERHEAD))
    return derived if cap == 0 else min(cap, derived)


def worst_case(budget: int, cap: int, largest: int) -> int | None:
    """Bytes one peer's queue can pin once messages reach ``largest`` (None: unbounded)."""
    cost = largest + MESSAGE_OVERHEAD
    if budget <= 0:
        return cap * cost if cap else None
    bound = max(budget, cost)
    return bound if cap == 0 else min(cap * cost, bound)


class ByteMarks:
    """The publisher's and the collector's marks of one server. ``received(n)`` and
    ``published(n)`` are called for a message larger than ``fast_limit``; each returns
    the socket option to lower (``"pub"``, ``"collect"``) or None."""

    __slots__ = ("largest_allowed", "max_value", "pub_budget", "pub_cap", "collect_budget",
                 "collect_cap", "pub_mark", "collect_mark", "pub_hwm", "collect_hwm",
                 "fast_limit", "lowered")

    def __init__(self, *, largest_allowed: int, max_value: int,
                 pub_budget: int, pub_cap: int, collect_budget: int, collect_cap: int):
        self.largest_allowed = largest_allowed
        """The largest message the limits allow (key + properties + value + 24)."""
        self.max_value = max_value
        self.pub_budget, self.pub_cap = pub_budget, pub_cap
        self.collect_budget, self.collect_cap = collect_budget, collect_cap
        self.pub_mark = self.collect_mark = INITIAL_MARK
        self.lowered = 0
        self.pub_hwm = derive(pub_budget, pub_cap, INITIAL_MARK)
        self.collect_hwm = derive(collect_budget, collect_cap, INITIAL_MARK)
        self.fast_limit = min(INITIAL_MARK, max_value)
        """A message whose key and value fit is below both marks: no call needed."""

    def received(self, size: int) -> str | None:
        """A message of ``size`` bytes was read from the collector."""
        size = min(size, self.largest_allowed)
        if size <= self.collect_mark:
            return None
        self.collect_mark = size
        hwm = derive(self.collect_budget, self.collect_cap, size)
        if hwm == self.collect_hwm:
            return None
        self.collect_hwm = hwm
        self.lowered += 1
        log.info("collector mark is now %d messages per writer: the largest message "
                 "received so far is %d bytes", hwm, size)
        return "collect"

    def published(self, size: int) -> str | None:
        """An update of ``size`` bytes is about to be published."""
        size = min(size, self.largest_allowed)
        if size <= self.pub_mark:
            return None
        self.pub_mark = size
        self.fast_limit = min(size, self.collect_mark, self.max_value)
        hwm = derive(self.pub_budget, self.pub_cap, size)
        if hwm == self.pub_hwm:
            return None
        self.pub_hwm = hwm
        self.lowered += 1
        log.info("publisher mark is now %d messages per subscriber: the largest update so "
                 "far is %d bytes", hwm, size)
        return "pub"
