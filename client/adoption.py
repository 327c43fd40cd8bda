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
``ADOPT_CHUNK`` keys looked at per loop turn: silently (the values are those the client
held), each key in exactly one part at any time, so ``len``, ``items`` and watches see
each key once. Until it ends, a read that misses the added shard's part looks in the
lenders (``ShardAgent.lending``). A lender whose map is about to be replaced (a snapshot)
gives what it still lends first, at once. A key adopted so has no sequence of its new
shard until that shard next writes it: ``meta()`` says 0, and a compare-and-set with it
gets ``Conflict`` naming the current one."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

log = logging.getLogger("clonemap.client.agent")

ADOPT_CHUNK = 5_000
"""Keys of the lenders looked at per loop turn."""


class Adoption:
    """The keys ``agent`` (an added shard's part) takes from ``agent.lending``; ``owns``:
    whether the routing gives a key to that shard."""

    def __init__(self, agent: Any, owns: Callable[[bytes], bool]):
        self.agent = agent
        self.owns = owns
        self.queue = [(other, list(other.map)) for other in agent.lending]
        self.moved = 0
        self.done = False
        self._handle: asyncio.Handle | None = None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self._handle = None
        if self.done:
            return
        self.run(ADOPT_CHUNK)
        if not self.done:
            self._handle = asyncio.get_running_loop().call_soon(self._turn)

    def run(self, budget: int | None = None) -> None:
        """Look at ``budget`` more keys (None: all that are left)."""
        queue, owns, agent = self.queue, self.owns, self.agent
        while queue and (budget is None or budget > 0):
            other, keys = queue[-1]
            n = len(keys) if budget is None else min(budget, len(keys))
            chunk = keys[len(keys) - n:]
            del keys[len(keys) - n:]
            if budget is not None:
                budget -= n
            self._move(other, [k for k in chunk if owns(k)])
            if not keys:
                queue.pop()
        if not queue:
            self.finish()

    def _move(self, other: Any, keys: list[bytes]) -> None:
        agent = self.agent
        held, props, seqs = other.map, other.props, other.seqs
        mine, my_props = agent.map, agent.props
        for key in keys:
            value = held.pop(key, None)
            if value is None:
                continue
            seqs.pop(key, None)
            prop = props.pop(key, None)
            if key not in mine:  # (else its new shard wrote it since: that value stays)
                mine[key] = value
                if prop:
                    my_props[key] = prop
                self.moved += 1

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        agent = self.agent
        lenders, agent.lending, agent.lent_at = agent.lending, (), []
        agent.adoption = None
        log.info("shard %s: adopted %d keys from %s", agent.name, self.moved,
                 ", ".join(o.name for o in lenders))
