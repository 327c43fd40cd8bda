"""A client taking the keys a routing change copied to an added shard from the parts it
holds already (an *adoption*), instead of that shard's snapshot.

A client of the whole map follows every shard a change copies from, so it holds every key
the added shard was given, at the value the copy took: the sources apply nothing for
those keys from the hold on (they hold, then forward), and forget them without publishing
deletes. Its first request to the added shard says which maps it holds and how far
(``adopt=<generation>:<sequence>,...``, ``chp.icanhaz``); the shard checks each of the
maps it copied from is held at or past the sequence its copy holds everything up to, and
answers with only the updates after its copy (``adopted=1``;
``clonemap.shards.snapshots``), else with a whole snapshot. Only parts built whole under an
earlier routing qualify: their server had not begun to forget what moved away
(``ShardAgent.part_epoch``, from the KTHXBAI's ``epoch=``).

Once the adoption is installed (its updates re-home their keys as any snapshot's do),
``Adoption`` moves the rest from the parts that lend them into the added shard's part,
``ADOPT_CHUNK`` keys at a time, each followed by an idle (``ADOPT_IDLE``): silently (the
values are those the client held), each key in exactly one part at any time, so
``len``, ``items`` and watches see each key once. Until it ends, a read that misses the
added shard's part looks in the lenders (``ShardAgent.lending``). A lender whose map is
about to be replaced (a snapshot) gives what it still lends first, at once. A key adopted
so has no sequence of its new shard until that shard next writes it: ``meta()`` says 0,
and a compare-and-set with it gets ``Conflict`` naming the current one."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from clonemap.shards.common import zio

ADOPT_CHUNK = 500
"""Keys of the lenders looked at per loop turn. In `bench reshard`'s writer (1M keys
held) a turn of 5,000 took 15-24 ms of its loop's CPU, each a wait for every write in
flight; 500 keep a turn near 2 ms."""
ADOPT_IDLE = 9.0
"""After each chunk the loop idles this many times the chunk's own time: the adoption is
background work, and at a flip the application's own writes wait on the same loop (and
for a threaded ``Clone``, on the same interpreter lock). At full speed, `bench reshard`'s
writer spent about half a second of its loop re-homing 336,160 keys at the flip, and its
writes waited behind it; idling as long as each chunk (half the loop) still took the
loop from ~45% busy to saturated for the 2 s the adoption then lasted. A tenth of the
loop, as the servers' share for their own background passes (their ``FORGET_IDLE``):
at a quarter the writes waited 2.9-6.5 ms at the median for the two seconds after the
flip, at a tenth 0.7-1.4 ms (the servers' forgetting slowed as much). Until it ends a
read that misses the added shard's part looks in the lenders."""


class Adoption:
    """The keys the routing gives the added shard (``owned``: those of a list of keys it
    owns, e.g. ``OwnerCache.owned``), moved out of ``lenders``
    (parts, each with ``map`` and ``give_up``) by ``take(values, props)`` (the added
    shard's part takes what it does not hold yet; how many it took); ``on_done(moved)``
    once every key was looked at."""

    def __init__(self, lenders: tuple, owned: Callable[[list[bytes]], list[bytes]],
                 take: Callable[[dict[bytes, bytes], dict[bytes, bytes]], int],
                 on_done: Callable[[int], None]):
        self.owned = owned
        self.take = take
        self.on_done = on_done
        # each lender's keys, in a tuple taken when its turn comes (the last lender's
        # first, up to ``_at``): a lender gains no key of the added shard once the
        # adoption began (it held its shard's map up to the copy's sequence already: the
        # shard checked ``adopt=``), so a later tuple misses none, and the flip pays for
        # one lender's instead of all. A list taken off the garbage collector's lists
        # (``zio.untrack_frames``: it holds only bytes), which no collection walks: a
        # tracked list of the 500,000 keys a lender holds was walked by every
        # collection the adoption outlived, 13-18 ms of the loop each for the first two,
        # on the writer of `bench reshard`; a tuple (used until 2026-11-30) is walked
        # once, by the next young collection (3.3 ms for 500,000 keys here, idle); a
        # copy of the lender's dict, which no collection walks, cost the writer's loop
        # three times as much CPU at the flip (it touches every key and value). On the
        # pure path (no compiled module) it is a tuple still
        self.queue: list[tuple[Any, Any]] = [(o, None) for o in lenders]
        self._at = 0
        self.moved = 0
        self.done = False
        self._handle: asyncio.Handle | None = None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self._handle = None
        if self.done:
            return
        began = time.perf_counter()
        self.run(ADOPT_CHUNK)
        if not self.done:
            self._handle = asyncio.get_running_loop().call_later(
                (time.perf_counter() - began) * ADOPT_IDLE, self._turn)

    def run(self, budget: int | None = None) -> None:
        """Look at ``budget`` more keys (None: all that are left)."""
        queue, owned = self.queue, self.owned
        while queue and (budget is None or budget > 0):
            other, keys = queue[-1]
            if keys is None:
                keys = (zio.untrack_frames(list(other.map)) if zio.COMPILED
                        else tuple(other.map))
                queue[-1] = (other, keys)
            at = self._at
            end = self._at = len(keys) if budget is None else min(at + budget, len(keys))
            if budget is not None:
                budget -= end - at
            props: dict[bytes, bytes] = {}
            values = other.give_up(owned(keys[at:end]), props)
            if values:
                self.moved += self.take(values, props)
            if end == len(keys):
                queue.pop()
                self._at = 0
        if not queue:
            self.finish()

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.on_done(self.moved)
