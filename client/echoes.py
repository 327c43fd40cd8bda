"""Writes awaiting their echo (``set(..., wait=True)``): UUID -> the future that resolves
when the owning shard publishes that update back, or when a snapshot installed by the
client already holds the written value (the KVPUB itself was folded into a resync).
Owned by one shard agent, on its loop."""
from __future__ import annotations

import asyncio


class Expired(Exception):
    """An echo not seen within its deadline (``expire_after``)."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(Expired())


def expire_after(fut: asyncio.Future, timeout_s: float) -> asyncio.TimerHandle:
    """A timer that fails ``fut`` with ``Expired`` after ``timeout_s`` unless it is done
    by then; cancel it once it is. One timer handle a write, where wrapping the await in
    ``asyncio.timeout()`` also makes a context manager and reschedules the task's
    cancellation (about twice the cost a write, on the 5,000/s path)."""
    return fut.get_loop().call_later(timeout_s, _expire, fut)


class Echoes:
    def __init__(self):
        self.waiters: dict[bytes, tuple[bytes, bytes, asyncio.Future]] = {}
        self.frames: dict[bytes, list[bytes]] = {}
        """The KVSET of each waiting write, to send again after an outage."""
        self.resent = 0
        self.applied_at: dict[bytes, int] = {}
        """UUID -> the sequence its shard said it was applied at (a KVREPLY), for writes
        whose KVPUB is still on the way: a snapshot at or past it confirms them."""

    def __bool__(self) -> bool:
        return bool(self.waiters)

    def __len__(self) -> int:
        return len(self.waiters)

    def expect(self, loop: asyncio.AbstractEventLoop, uuid: bytes, key: bytes,
               value: bytes, frames: list[bytes] | None = None) -> asyncio.Future:
        """A future for the echo of ``uuid`` (``key`` = ``value``); the caller cancels it
        on its timeout, and it is forgotten then."""
        fut = loop.create_future()
        self.waiters[uuid] = (key, value, fut)
        if frames is not None:
            self.frames[uuid] = frames
        fut.add_done_callback(lambda _f, u=uuid: self._forget(u, _f))
        return fut

    def _forget(self, uuid: bytes, fut: asyncio.Future) -> None:
        entry = self.waiters.get(uuid)
        if entry is not None and entry[2] is fut:
            del self.waiters[uuid]
            self.frames.pop(uuid, None)
            self.applied_at.pop(uuid, None)

    def applied(self, uuid: bytes, seq: int) -> None:
        """The shard applied ``uuid`` at ``seq`` (its KVREPLY said so)."""
        if uuid in self.waiters:
            self.applied_at[uuid] = seq

    def confirm_upto(self, seq: int) -> None:
        """A map at ``seq`` was installed: every write known to be applied at or before
        it is in it (however its value was overwritten since)."""
        for uuid, at in list(self.applied_at.items()):
            if at <= seq:
                self.confirm(uuid, seq)

    def confirm(self, uuid: bytes, seq: int) -> None:
        """The KVPUB with ``uuid`` was applied (or was already in the snapshot)."""
        entry = self.waiters.get(uuid)
        if entry is not None and not entry[2].done():
            entry[2].set_result(seq)

    def confirm_in(self, data: dict[bytes, bytes], seq: int) -> None:
        """A snapshot was installed: every write whose value it holds is confirmed."""
        for key, value, fut in list(self.waiters.values()):
            if not fut.done() and data.get(key, b"") == value:
                fut.set_result(seq)

    def unconfirmed(self) -> list[list[bytes]]:
        """The KVSETs of the writes still waiting, in the order they were made."""
        out = [self.frames[u] for u, (_, _, fut) in self.waiters.items()
               if not fut.done() and u in self.frames]
        self.resent += len(out)
        return out

    def fail_all(self, exc: BaseException) -> None:
        for _, _, fut in list(self.waiters.values()):
            if not fut.done():
                fut.set_exception(exc)

    def cancel_all(self) -> None:
        for _, _, fut in list(self.waiters.values()):
            if not fut.done():
                fut.cancel()
        self.waiters.clear()
        self.frames.clear()
