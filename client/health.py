"""A client's health: falling behind its publishers (the guide's Suicidal Snail), and
failing for good.

A client without a subtree that sees a gap in a shard's sequence fell behind (its
high-water marks overflowed); with or without a subtree, a shard read more than
``max_lag_s`` later than usual (by the server clock in HUGZ) is behind too. Both are
counted (``fell_behind``) and handled by ``slow_policy``: ``"resync"`` takes a fresh
snapshot of that shard; ``"die"`` fails the client: every later call and every watch
raises ``clonemap.client.errors.SlowSubscriber``, and ``on_slow`` is called. A server whose HUGZ
names another routing than this client's fails it at once too (a ``ConfigError``: a
client planned from another config), rather than timing out on the keys it misroutes.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from clonemap.shards.common.errors import ClonemapError, ConfigError
from clonemap.client.errors import SlowSubscriber
from clonemap.client.options import RESYNC

if TYPE_CHECKING:
    from clonemap.client.agent import ShardAgent
    from clonemap.client.clone import AsyncClone

log = logging.getLogger("clonemap.client.clone")


class Health:
    """One client's health (see the module doc); it sets ``clone.failed``."""

    def __init__(self, clone: "AsyncClone"):
        self.clone = clone

    def on_behind(self, agent: ShardAgent, expected: int, got: int) -> bool:
        """A gap in an unfiltered shard stream: this client fell behind (Suicidal Snail).
        ``resync``: count it, the agent takes a fresh snapshot of that shard. ``die``:
        fail the client loudly; every later call and every watch raises."""
        return self.fell_behind(agent, lambda: SlowSubscriber(
            f"client fell behind shard {agent.name} ({agent.server}): expected sequence "
            f"{expected}, got {got} ({got - expected} updates lost); slow_policy='die'",
            shard=agent.name, expected=expected, got=got))

    def on_lag(self, agent: ShardAgent, lag_s: float) -> bool:
        """The server clock in a HUGZ: this client reads shard ``agent`` ``lag_s`` late,
        beyond ``max_lag_s``. The same policy and counter as a gap."""
        return self.fell_behind(agent, lambda: SlowSubscriber(
            f"client fell behind shard {agent.name} ({agent.server}) by {lag_s:.2f} s "
            f"(max_lag_s {self.clone.max_lag_s}); slow_policy='die'",
            shard=agent.name, lag_s=lag_s))

    def on_wrong_route(self, agent: ShardAgent, theirs: str) -> None:
        """A server of ``agent``'s shard routes keys with another map than this client:
        the client was planned from another config. It fails at once (every call, every
        watch, a start in progress), rather than timing out on the keys it misroutes."""
        if self.clone.failed is not None:
            return
        index, count, _ = (theirs.split("/") + ["?", "?"])[:3]
        mine = self.clone.cluster.shard_map.shards if self.clone.cluster is not None else "?"
        exc = ConfigError(
            f"wrong cluster map: this client routes keys over "
            f"{mine} shard{'' if mine == 1 else 's'} "
            f"({self.clone.cluster.source if self.clone.cluster is not None else '?'}), but "
            f"{agent.server} is shard {index} of {count} with another routing; use the "
            "running cluster's own config, or control= to fetch its map",
            field="routing")
        self.fail_now(exc)
        agent.loop.call_soon(self.close_agents)  # inside the agent's SUB batch now

    def fail_now(self, exc: ClonemapError) -> None:
        """Fail every call, every watch and a start in progress with ``exc`` (each of them
        raises it, so it is logged at INFO only: an application that logs its errors
        would otherwise see it twice, and ``chp`` printed it twice)."""
        self.clone.failed = exc
        log.info("the clone failed: %s", exc)
        for core in list(self.clone._hub.watches):
            core.failed = exc
            core.wake()
        self.clone._hub.watches.clear()
        if self.clone._failed_future is not None and not self.clone._failed_future.done():
            self.clone._failed_future.set_result(exc)

    def fell_behind(self, agent: ShardAgent, make_exc: Callable[[], SlowSubscriber]) -> bool:
        """True: handled here (die); False: the agent resyncs the shard."""
        if self.clone.failed is not None:
            return True  # already dead; the rest of this batch is dropped
        self.clone.fell_behind += 1
        if self.clone.slow_policy == RESYNC:
            return False
        exc = make_exc()
        self.fail_now(exc)
        # closed on the next loop turn: this runs inside an agent's SUB batch
        agent.loop.call_soon(self.close_agents)
        if self.clone.on_slow is not None:
            try:
                self.clone.on_slow(exc)
            except Exception:
                log.exception("on_slow callback failed")
        return True

    def close_agents(self) -> None:
        for a in self.clone._agents:
            a.close()
