"""A client's health: falling behind its publishers (the guide's Suicidal Snail), and
failing for good.

A client without a subtree that sees a gap in a shard's sequence fell behind (its
high-water marks overflowed); with or without a subtree, a shard read more than
``max_lag_s`` later than usual (by the server clock in HUGZ) is behind too. Both are
counted (``fell_behind``) and handled by ``slow_policy``: ``"resync"`` takes a fresh
snapshot of that shard; ``"die"`` fails the client: every later call and every watch
raises ``clonemap.client.errors.SlowSubscriber``, and ``on_slow`` is called. A server whose HUGZ
names another routing than this client's fails it at once too (a ``ConfigError``: a
client planned from another config), rather than timing out on the keys it misroutes,
unless that routing is a later epoch of this client's cluster, which the client follows
(``follow``: it fetches the cluster map from the supervisor and routes by it).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from clonemap.shards.common.errors import ClonemapError, ConfigError
from clonemap.client.errors import ReadRefused, SlowSubscriber
from clonemap.client.options import RESYNC

if TYPE_CHECKING:
    from clonemap.client.agent_view import AgentView

log = logging.getLogger("clonemap.client.clone")


class Health:
    """One client's health (see the module doc): whether it failed, and why, and how
    many times it fell behind. It is told what to do on a failure (``end_watches``,
    ``close_agents``) and what the client routes with (``routing``)."""

    def __init__(self, *, slow_policy: str, max_lag_s: float | None,
                 on_slow: Callable[[SlowSubscriber], object] | None,
                 routing: Callable[[], tuple[int | str, str]],
                 end_watches: Callable[[ClonemapError], None],
                 close_agents: Callable[[], None],
                 follow: Callable[[int], bool] | None = None,
                 epoch: Callable[[], int] | None = None):
        """``routing()``: (shard count, config source) this client routes with;
        ``follow(epoch)``: True when the client takes that later routing epoch of its
        cluster (it knows where the map is served), False when it cannot; ``epoch()``:
        the routing epoch it follows now."""
        self._follow = follow
        self._epoch = epoch
        self.servers_behind = 0
        """HUGZ from a server of this cluster still on an older routing epoch than this
        client's (``on_wrong_route``): not a wrong config."""
        self.slow_policy = slow_policy
        self.max_lag_s = max_lag_s
        self.on_slow = on_slow
        self._routing = routing
        self._end_watches = end_watches
        self._close_agents = close_agents
        self.failed: ClonemapError | None = None
        """Why this client is dead (``SlowSubscriber`` with slow_policy "die", or a
        ``ConfigError`` for a wrong cluster map); every call raises it."""
        self.fell_behind = 0
        """How many times a shard's stream had a gap (this client fell behind)."""
        self._failure: asyncio.Future[None] | None = None

    def failure(self) -> asyncio.Future[None]:
        """A future done when this client fails (a start waits on it beside the shards)."""
        if self._failure is None or self._failure.done():
            self._failure = asyncio.get_running_loop().create_future()
            if self.failed is not None:
                self._failure.set_result(None)
        return self._failure

    def on_behind(self, agent: AgentView, expected: int, got: int) -> bool:
        """A gap in an unfiltered shard stream: this client fell behind (Suicidal Snail).
        ``resync``: count it, the agent takes a fresh snapshot of that shard. ``die``:
        fail the client loudly; every later call and every watch raises."""
        return self.fell_behind_on(agent, lambda: SlowSubscriber(
            f"client fell behind shard {agent.name} ({agent.server}): expected sequence "
            f"{expected}, got {got} ({got - expected} updates lost); slow_policy='die'",
            shard=agent.name, expected=expected, got=got))

    def on_lag(self, agent: AgentView, lag_s: float) -> bool:
        """The server clock in a HUGZ: this client reads shard ``agent`` ``lag_s`` late,
        beyond ``max_lag_s``. The same policy and counter as a gap."""
        return self.fell_behind_on(agent, lambda: SlowSubscriber(
            f"client fell behind shard {agent.name} ({agent.server}) by {lag_s:.2f} s "
            f"(max_lag_s {self.max_lag_s}); slow_policy='die'",
            shard=agent.name, lag_s=lag_s))

    def on_wrong_route(self, agent: AgentView, theirs: str, epoch: int = 0) -> None:
        """A server of ``agent``'s shard routes keys with another map than this client.
        A later epoch of its cluster's routing is followed (``follow``); otherwise the
        client was planned from another config, and it fails at once (every call, every
        watch, a start in progress), rather than timing out on the keys it misroutes."""
        if self.failed is not None:
            return
        if epoch and self._follow is not None and self._follow(epoch):
            return
        if epoch and self._epoch is not None and epoch < self._epoch():
            # a server of this cluster not yet told of the routing this client follows
            # (during a change's flip the sources take it after the targets, and a
            # server restarted meanwhile starts on the old one): it takes it shortly
            self.servers_behind += 1
            log.info("%s routes by epoch %d, older than this client's %d: it has not "
                     "taken the later routing yet", agent.server, epoch, self._epoch())
            return
        index, count, _ = (theirs.split("/") + ["?", "?"])[:3]
        mine, source = self._routing()
        exc = ConfigError(
            f"wrong cluster map: this client routes keys over "
            f"{mine} shard{'' if mine == 1 else 's'} "
            f"({source}), but "
            f"{agent.server} is shard {index} of {count} with another routing; use the "
            "running cluster's own config, or control= to fetch its map",
            field="routing")
        self.fail_now(exc)
        if agent.loop is not None:  # inside the agent's SUB batch now: next turn
            agent.loop.call_soon(self._close_agents)

    def on_read_refused(self, agent: AgentView) -> None:
        """The server of ``agent``'s shard refused its snapshot: this client's identity
        may read nothing of what it asked. Every later snapshot would be refused too, so
        the client fails at once (``ReadRefused``) instead of timing out."""
        if self.failed is not None:
            return
        shown = agent.subtree.decode("utf-8", "replace")
        self.fail_now(ReadRefused(
            f"shard {agent.name} ({agent.server}) refused the snapshot of {shown!r}: this "
            "client's identity may read nothing under it (see its rights: chp whoami)",
            shard=agent.name, subtree=shown))
        if agent.loop is not None:
            agent.loop.call_soon(self._close_agents)

    def fail_now(self, exc: ClonemapError) -> None:
        """Fail every call, every watch and a start in progress with ``exc`` (each of them
        raises it, so it is logged at INFO only: an application that logs its errors
        would otherwise see it twice, and ``chp`` printed it twice)."""
        self.failed = exc
        log.info("the clone failed: %s", exc)
        self._end_watches(exc)
        if self._failure is not None and not self._failure.done():
            self._failure.set_result(None)

    def fell_behind_on(self, agent: AgentView,
                       make_exc: Callable[[], SlowSubscriber]) -> bool:
        """True: handled here (die); False: the agent resyncs the shard."""
        if self.failed is not None:
            return True  # already dead; the rest of this batch is dropped
        self.fell_behind += 1
        if self.slow_policy == RESYNC:
            return False
        exc = make_exc()
        self.fail_now(exc)
        # closed on the next loop turn: this runs inside an agent's SUB batch
        if agent.loop is not None:
            agent.loop.call_soon(self._close_agents)
        if self.on_slow is not None:
            try:
                self.on_slow(exc)
            except Exception:
                log.exception("on_slow callback failed")
        return True
