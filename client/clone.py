"""``AsyncClone``, the client over its shard agents (asyncio); ``clonemap.client.sync.Clone`` runs
it on a background thread, and ``clonemap.client.api`` is where applications import both from.
The reference, with examples that run, is client/README.md.

Where the cluster is (exactly one of): ``servers=`` the server(s) of ONE shard (a Binary
Star pair in failover order); ``shards=[[p0, b0], ...]``; ``config=`` a supervisor config,
planned on this host; ``control=`` one or more supervisors' MDP ``cluster.map``
(``clonemap.client.router.discover``), fetched in ``start()``. Everything else is an option
(``clonemap.client.options.ClientOptions``).

The router (``clonemap.client.router``): one ``ShardAgent`` per shard that can own a key under the
subtree, each with its own sockets, sequence (the ``version_vector``), failover and
resync; the local map is the union of their parts. Reads are local; a write is a KVSET
to every server of the key's owning shard, fire-and-forget as in 12/CHP, with a fresh
16-byte UUID that ``set``/``delete`` return. ``wait=True`` returns once the owning shard
has published that UUID back and it is applied locally (read-your-writes), or raises
``Timeout`` naming why no server served it. Falling behind and failing:
``clonemap.client.health``. Keys are ``str`` (UTF-8 on the wire) under the client's subtree;
values go through the codec (``clonemap.client.codec``).
"""
from __future__ import annotations

import asyncio
import functools
import random
import logging
import os
import uuid as _uuid
from typing import Any, Callable, Sequence

import zmq

from clonemap.shards.common.errors import ClonemapError, ConfigError, HandshakeRefused, Timeout
from clonemap.shards.common.security import Security, client_keys
from clonemap.shards.common.endpoints import MAX_IO_THREADS
from clonemap.shards.common.proto import chp
from clonemap.shards.common.proto.props import format_props, parse_props
from clonemap.shards.common.routing import OwnerCache, ShardMap
from clonemap.shards.common import timing, zio
from clonemap.shards.common.timing import HEARTBEAT_S
from clonemap.client import shard_machine as sm
from clonemap.client.agent import ShardAgent
from clonemap.client.events import KEPT, KeyMeta
from clonemap.client.collector import ServerAddress, parse_servers
from clonemap.client.codec import BytesCodec, get_codec
from clonemap.client.write_checks import check_write, ttl_text
from clonemap.client.echoes import Expired, expire_after
from clonemap.client.errors import Conflict, NotRunning, NotSupported, WriteRefused
from clonemap.client.options import AgentHooks, ClientOptions
from clonemap.client.health import Health
from clonemap.client.router import Cluster, ShardSpec, discover, fetch_rights
from clonemap.client.watch import Watch, WatchCore, WatchHub

log = logging.getLogger(__name__)


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait for it, so that nothing is left unretrieved."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


_MISSING = object()


_C_VIEWED_GET: Callable[[dict[str, bytes], Callable[..., Any]], Callable[..., Any]] | None = \
    zio.compiled_function("viewed_get")
"""The compiled ``_viewed_get`` (``clonemap.shards.common._zframes``), or None on the pure
path: the same lookup without a Python frame per call."""


def _viewed_get(view: dict[str, bytes],
                slow: Callable[[str, Any], Any]) -> Callable[..., Any]:
    """``AsyncClone.get`` over a flat view: a key the view holds costs one dict lookup
    and no attribute of the client; any other key (absent, not a str, outside the
    subtree, or every key once the client failed and the view was emptied) goes to
    ``slow``, which checks it, raises, or returns ``default``. On the compiled path the
    get is a builtin (no Python frame: a key the view holds costs what ``dict.get``
    does)."""
    if _C_VIEWED_GET is not None:
        return _C_VIEWED_GET(view, slow)
    look = view.get
    missing = _MISSING

    def get(key: str, default: Any = None) -> Any:
        value = look(key, missing)
        if value is missing:
            return slow(key, default)
        return value

    get.__doc__ = ("key's value in the local map, or default: one dict lookup for a key "
                   "the map holds (AsyncClone.get)")
    return get


ADOPT_WAIT_S = 2.0
"""How long an added shard's agent waits for the other parts to read their streams up to
the new routing before it starts anyway (and takes a snapshot if they are behind)."""


def _holder(agent: ShardAgent, key_b: bytes) -> ShardAgent:
    """The part that holds ``key_b``, owned by ``agent``'s shard: its own, or, while it
    adopts keys from other parts (``ShardAgent.lending``), the one that still has it."""
    if key_b in agent.map or not agent.lending:
        return agent
    for other in agent.lending:
        if key_b in other.map:
            return other
    return agent


STAGED_WAIT_S = 10.0
"""How long a shard's part that gained keys it had staged waits for the parts that hold
them to read their streams up to the new routing, before it takes them anyway."""
ROUTING_WAIT_S = 10.0
"""How long a client waits for the cluster map to show a routing epoch a server follows."""
RETIRE_S = 30.0
"""How long a shard that left the routing keeps its agent while its keys move away."""
READ_ROUTES = 1 << 16
"""Routes ``get`` keeps (key -> bytes and agent) at least; at most twice the map's keys
or this, whichever is more; past that it starts over."""
UNAVAILABLE_WINDOW_S = 10.0
"""A write that times out names the servers its shard left this long ago at most."""


class AsyncClone:
    """A live local copy of the map under ``subtree``, for asyncio code.

    ``await start()`` (or ``async with``) returns once every shard's snapshot is installed
    and a collector listens, or raises ``clonemap.shards.common.errors.Timeout`` after ``timeout_s``.
    When a shard fails over, resyncs, or finds its server lost data, and what the client
    then does (``on_failover``, ``on_reset``, ``reset_policy``), is the shard machine's
    rule (``clonemap.client.shard_machine``) and client/README.md's *Client* section.
    """

    def __init__(self, servers: "str | ServerAddress | Sequence[str | ServerAddress] | None"
                 = None, *, shards: "Sequence[str | Sequence[str]] | None" = None,
                 config: "str | os.PathLike[str] | None" = None,
                 control: "str | Sequence[str] | None" = None,
                 context: "zmq.Context[Any] | None" = None,
                 options: ClientOptions | None = None, **option_fields: Any) -> None:
        opts = ClientOptions.given(options, "AsyncClone()", **option_fields)
        self.options = opts
        """Every option this client was made with (``clonemap.client.options.ClientOptions``)."""
        given = [name for name, v in (("servers", servers), ("shards", shards),
                                      ("config", config), ("control", control))
                 if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of servers=, shards=, config=, control= "
                             f"(got {', '.join(given) or 'none'})")
        self.subtree = opts.subtree
        self._subtree_b = opts.subtree.encode("utf-8")
        self.via = opts.via
        self.only_key = opts.only_key
        self.keys_dir = opts.keys
        self.security = Security.off()
        self.servers = parse_servers(servers) if servers is not None else ()
        self.control = control
        self.control_timeout_s = opts.control_timeout_s
        self.codec = get_codec(opts.codec)
        self._identity_codec = isinstance(self.codec, BytesCodec)
        """Values are the blobs themselves: ``get`` skips the decode call."""
        self.timeout_s = opts.timeout_s
        self.limits = opts.limits
        self.watch_capacity = opts.watch_capacity
        self.silence_timeout_s: float | None = None
        """The silence timeout settled on once the cluster is known (``"auto"``)."""
        self.max_lag_s = opts.max_lag_s
        self._hub = WatchHub()
        self._agents: list[ShardAgent] = []
        self._parts_changed = asyncio.Event()
        """Set when a part is retired (``_parts_ready``)."""
        self._threads = 0
        """I/O threads the shards' sockets spread over (0: ZeroMQ's choice)."""
        self.health = Health(slow_policy=opts.slow_policy, max_lag_s=opts.max_lag_s,
                             on_slow=opts.on_slow, routing=self._routing,
                             end_watches=self._on_failed, close_agents=self._close_agents,
                             follow=self._follow_routing,
                             epoch=lambda: self.routing_epoch)
        self._following = 0
        """The routing epoch this client is fetching the map of (0: none)."""
        self._routing_task: asyncio.Task[None] | None = None
        """The fetch of a later routing a server follows (``_follow_routing``)."""
        self.routing_followed = 0
        """How many later routing epochs this client took while it ran."""
        """Falling behind, and failing (``clonemap.client.health``)."""
        self._hooks = AgentHooks(on_failover=opts.on_failover, on_reset=opts.on_reset,
                                 on_behind=self.health.on_behind, on_lag=self.health.on_lag,
                                 on_wrong_route=self.health.on_wrong_route,
                                 on_read_refused=self.health.on_read_refused)
        if opts.io_threads is not None and context is not None:
            raise ValueError("io_threads applies to the client's own context: give "
                             "io_threads or context, not both")
        self.io_threads = opts.io_threads
        self.slow_policy = opts.slow_policy
        self.on_slow = opts.on_slow
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self.cluster: Cluster | None = None
        self._by_index: dict[int, ShardAgent] = {}
        self._staged_adoptions: dict[ShardAgent, tuple[Callable[[list[bytes]], list[bytes]],
                                                        int]] = {}
        """Agents whose shard gained keys it had staged, waiting to adopt them from the
        parts that hold them: which keys it owns now (``OwnerCache.owned``), and the
        routing epoch (``_adopt_staged``)."""
        self._routes: dict[str, tuple[bytes, ShardAgent]] = {}
        self._routes_max = READ_ROUTES
        """``get``'s routes: a key read before -> (its bytes, its shard's agent)."""
        self._view: dict[str, bytes] | None = \
            {} if self._identity_codec and opts.read_view else None
        """The flat read view (the identity codec's): every key the agents hold, as
        ``str``, and its value, kept by the agents on the loop thread; ``get`` looks
        there first. Emptied, and no longer kept, once the client fails."""
        if self._view is not None:
            self.get = _viewed_get(self._view, self._get_slow)  # type: ignore[method-assign]
        self._started = False
        self._closed = False
        try:
            if servers is not None:
                self._route(Cluster.from_servers(self.servers))
            elif shards is not None:
                self._route(Cluster.from_pairs(shards))
            elif config is not None:
                self._route(Cluster.from_config(config))
        except BaseException:
            if self._own_ctx:
                self._ctx.destroy(linger=0)
            raise

    def _route(self, cluster: Cluster) -> None:
        """One agent per shard that can own a key under the subtree."""
        chosen = self.options.silence_timeout_s
        silence: float | None
        if isinstance(chosen, str):  # AUTO
            given_s = self.options.heartbeat_s
            if given_s is None and cluster.silence_timeout_s is not None:
                silence = cluster.silence_timeout_s
            else:
                heartbeat_s = given_s or cluster.heartbeat_s or HEARTBEAT_S
                silence = timing.silence_timeout_s(heartbeat_s)
        else:
            silence = chosen
        self.silence_timeout_s = silence
        self.cluster = cluster
        self._routes.clear()  # routes of another map's agents
        if self._view is not None:
            self._view.clear()  # (the new agents fill it from their snapshots)
        self.security = client_keys(self.keys_dir, curve=cluster.curve,
                                    cluster_keys_dir=cluster.keys_dir, source=cluster.source,
                                    identity=self.options.identity)
        if self.only_key is not None:
            specs = [cluster.shards[cluster.shard_map.owner(self.only_key.encode("utf-8"))]]
        else:
            specs = cluster.shards_for(self._subtree_b)
        threads = 0
        if self.io_threads is not None:
            # the Black Box pattern: the shards' sockets spread over the context's I/O
            # threads (set before the context's first socket: fetch_cluster used its own)
            threads = (min(len(specs), MAX_IO_THREADS) if isinstance(self.io_threads, str)
                       else self.io_threads)  # a number, or PER_SHARD
            self._ctx.io_threads = threads
        self._threads = threads
        for position, spec in enumerate(specs):
            self._agent_of_spec(cluster, spec, position)
        self._wire_moves(installs=False)

    def _wire_moves(self, installs: bool) -> None:
        """A client of several shards tells its agents how to re-home a key that moved
        between them (``_rehome``); ``installs``: its routing changed, so snapshots are
        checked too, and writes another part waits for may be confirmed by them."""
        if len(self._agents) < 2:
            return
        for agent in self._agents:
            agent.rehome = self._rehome
            agent.superseded = self._superseded
            agent.rehome_many = self._rehome_many
            if installs:
                agent.rehome_installs = True
                agent.moved_snapshot = self._moved_snapshot
                agent.moved_echo = self._moved_echo

    def _agent_of_spec(self, cluster: Cluster, spec: ShardSpec, position: int) -> ShardAgent:
        """A new agent for shard ``spec``, registered (not started)."""
        servers = spec.servers
        through = self.via == "relays" and bool(spec.relays or self.servers)
        if through:
            servers = self._relays_of(spec)
        threads = self._threads
        agent = ShardAgent(self._ctx, servers, self.options.agent(self.silence_timeout_s),
                           self._hooks, name=spec.name, relays=through,
                           subtree=self._subtree_b, hub=self._hub,
                           affinity=1 << (position % threads) if threads else 0,
                           security=self.security,
                           route=cluster.shard_map.route_of(spec.index), view=self._view)
        self._agents.append(agent)
        self._by_index[spec.index] = agent
        return agent

    def _relays_of(self, spec: ShardSpec) -> tuple[ServerAddress, ...]:
        """The shard's relays in this client's order: rotated at random, so that clients
        spread over them (the rest of the list is the failover order)."""
        relays = spec.relays if spec.relays else spec.servers
        start = random.randrange(len(relays))
        return tuple(relays[start:]) + tuple(relays[:start])

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float | None = None) -> "AsyncClone":
        if self._closed:
            raise NotRunning("this client is closed")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self.cluster is None and self.control is not None:
            # control=: discover the cluster (Timeout if no supervisor answers)
            cluster = await discover(self.control, timeout_s=min(self.control_timeout_s,
                                                                 timeout_s),
                                     keys_dir=self.keys_dir,
                                     identity=self.options.identity)
            if self.cluster is None:
                self._route(cluster)
        if not self._started:
            self._started = True
            for agent in self._agents:
                agent.start()
        if self.failed is not None:
            raise self.failed
        failure = self.health.failure()
        ready = asyncio.ensure_future(self._parts_ready())
        # a server that refuses this client's handshake (no keys for a CURVE cluster, a
        # key it does not admit) refuses every retry too: fail at once, not at the deadline
        links = [a.link for a in self._agents if a.link is not None]
        refusals = {link: asyncio.ensure_future(link.refused.wait()) for link in links}
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
            # that lands just as the agents become ready
            async with asyncio.timeout(timeout_s):
                while True:
                    waits: set[asyncio.Future[Any]] = {ready, failure,
                                                        *refusals.values()}
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if self.failed is not None:
                        await _cancelled(ready)
                        raise self.failed
                    if ready.done():
                        break
                    if any(link.handshake_failure for link in links):
                        await _cancelled(ready)
                        self._raise_refused()
                    # refused, then admitted before this task ran: wait on
                    refusals = {link: f if not f.done() else
                                asyncio.ensure_future(link.refused.wait())
                                for link, f in refusals.items()}
                await ready
                # a server said it follows a later routing than this client's config
                # (a change since the config was written): follow it before returning,
                # or the keys that moved to a shard this client did not know are missed
                while self._routing_task is not None and not self._routing_task.done():
                    await asyncio.wait({self._routing_task, failure},
                                       return_when=asyncio.FIRST_COMPLETED)
                    if self.failed is not None:
                        raise self.failed
                await self._parts_ready()  # (the parts the routing added too)
        except TimeoutError:
            await _cancelled(ready)
            self._raise_refused()  # a refused handshake is the cause, not the wait
            states = "; ".join(
                f"shard {a.name} at {a.server}: {a.phase}"
                f"{', synced' if a.synced else ''}"
                f"{', collector listening' if a.writes.ready else ', collector silent'}"
                for a in self._agents)
            raise Timeout(f"clone not ready within {timeout_s} s ({states})",
                          what="snapshot", deadline_s=timeout_s) from None
        finally:
            for fut in refusals.values():
                fut.cancel()
        return self

    async def _parts_ready(self) -> None:
        """Until every part this client has is ready (``ShardAgent.wait_ready``). A
        routing followed during ``start`` may retire a part before its first snapshot
        came (its shard holds nothing this client needs any more, ``_retire``): from
        then on it does not count. ``start`` waited on the parts it began with, and one
        retired so kept it waiting to its deadline, the added shard's part ready beside
        it (``chp --config BEFORE get KEY`` of a key a growth gave the added shard, once
        in the suite: "clone not ready within 5.0 s")."""
        while True:
            self._parts_changed.clear()
            waits = {asyncio.ensure_future(a.wait_ready()) for a in self._agents}
            changed = asyncio.ensure_future(self._parts_changed.wait())
            try:
                while waits and not changed.done():
                    done, _ = await asyncio.wait({*waits, changed},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    for fut in done - {changed}:
                        fut.result()
                        waits.discard(fut)
                if not waits:
                    return
            finally:
                for fut in (*waits, changed):
                    fut.cancel()

    def _raise_refused(self) -> None:
        """Raise ``HandshakeRefused`` for the first server that refused this client's
        handshake, named as it was given (its port P, not the publisher's P+1)."""
        for a in self._agents:
            if a.link is not None and a.link.handshake_failure:
                raise HandshakeRefused(str(a.server), a.link.handshake_failure) from None

    @property
    def failed(self) -> ClonemapError | None:
        """Why this client is dead (``SlowSubscriber`` with slow_policy "die", or a
        ``ConfigError`` for a wrong cluster map); every call raises it."""
        return self.health.failed

    @property
    def fell_behind(self) -> int:
        """How many times a shard's stream had a gap (this client fell behind)."""
        return self.health.fell_behind

    @property
    def closed(self) -> bool:
        """``close`` was called (or the client never started and was released)."""
        return self._closed

    @property
    def agents(self) -> tuple[ShardAgent, ...]:
        """The shard agents, in shard order (one per shard this client reads)."""
        return tuple(self._agents)

    def _routing(self) -> tuple[int | str, str]:
        if self.cluster is None:
            return "?", "?"
        return self.cluster.shard_map.shards, self.cluster.source

    # ------------------------------------------------------------------ routing epochs
    def _follow_routing(self, epoch: int) -> bool:
        """A server follows routing ``epoch``: if it is later than this client's and the
        cluster map can be fetched (``control=``, or the config's control endpoint), fetch
        it and route by it (``_take_routing``); True while that is under way."""
        cluster = self.cluster
        control = self.control or (cluster.control if cluster is not None else None)
        if cluster is None or control is None or epoch <= cluster.shard_map.epoch:
            return False
        if self._following < epoch:
            self._following = epoch
            self._routing_task = asyncio.get_running_loop().create_task(
                self._fetch_routing(control, epoch))
        return True

    async def _fetch_routing(self, control: "str | Sequence[str]", epoch: int) -> None:
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + ROUTING_WAIT_S
            while True:
                try:
                    # (the keys this client already uses: with config= they are the
                    # config's, which keys_dir does not name)
                    cluster = await discover(control, timeout_s=self.control_timeout_s,
                                             security=self.security)
                    if cluster.shard_map.epoch >= epoch:
                        break
                    # a change's targets take the new routing just before the
                    # supervisor's map does: ask again
                    why = f"is still at epoch {cluster.shard_map.epoch}"
                except ClonemapError as exc:  # a supervisor busy with the change: again
                    if isinstance(exc, ConfigError):
                        raise
                    why = f"did not answer ({exc})"
                if loop.time() > deadline:
                    raise ConfigError(f"a server follows routing epoch {epoch}, but the "
                                      f"cluster map at {control} {why} after "
                                      f"{ROUTING_WAIT_S:g} s", field="routing")
                await asyncio.sleep(0.02)
            self._take_routing(cluster)
        except ClonemapError as exc:
            log.error("routing epoch %d: %s", epoch, exc)
            self.health.fail_now(exc if isinstance(exc, ConfigError) else ConfigError(
                f"routing epoch {epoch}: the cluster map could not be fetched from "
                f"{control} ({exc})", field="routing"))
            self._close_agents()
        finally:
            if self._following == epoch:
                self._following = 0

    def _take_routing(self, cluster: Cluster) -> None:
        """Route by ``cluster``'s later routing, in place: the shards it keeps keep their
        agents, maps and watches (nothing is fetched again), each agent now expecting its
        server's new ``route=``; a shard it adds that this client needs gets an agent,
        whose snapshot re-homes the keys that moved to it without events; a shard it
        removes keeps its agent until the keys it held have moved (``_retire``)."""
        current = self.cluster
        if current is None or self.failed is not None:
            return
        if cluster.shard_map.epoch <= current.shard_map.epoch:
            return
        needed = ({cluster.shard_map.owner(self.only_key.encode("utf-8"))}
                  if self.only_key is not None else
                  {spec.index for spec in cluster.shards_for(self._subtree_b)})
        self.cluster = cluster
        self._routes.clear()  # ``get``'s routes of the old map
        held_by = dict(self._by_index)  # (the parts that may lend keys that moved)
        retired = [i for i in self._by_index if i not in needed]
        for index in retired:
            self._retire(self._by_index.pop(index))
        for index, agent in self._by_index.items():
            agent.route = cluster.shard_map.route_of(index)
        added = [self._agent_of_spec(cluster, cluster.shards[i], len(self._agents))
                 for i in sorted(needed - set(self._by_index))]
        self._wire_moves(installs=True)
        if added and not self._subtree_b and self.only_key is None and self.via == "servers":
            # a client of the whole map holds every key an added shard copied: it asks to
            # adopt them (only the updates after the copy come), not for a snapshot,
            # once its other parts read their streams up to the new routing (the copy's
            # end is before it), or after ADOPT_WAIT_S anyway
            epoch = cluster.shard_map.epoch
            for agent in added:
                agent.adopt_claim = self._adopt_claim
                agent.on_adopted = self._adopted
                agent.adopt_ready = (lambda a=agent, e=epoch: self._lenders_read_up_to(a, e))
            for other in self._agents:
                if other not in added:
                    other.on_epoch = self._epoch_seen
                    other.lent_out = self._lent_out
            asyncio.get_running_loop().call_later(ADOPT_WAIT_S, self._adopt_now, added)
        if self.only_key is None:
            self._adopt_staged(current.shard_map, cluster.shard_map, held_by, added)
        if self._started:
            for agent in added:
                agent.start()
        self._hand_over_replies(cluster)
        self.routing_followed += 1
        log.info("routing: now epoch %d over %d shards (%s)%s", cluster.shard_map.epoch,
                 cluster.shard_map.shards, cluster.source,
                 f"; following {len(added)} more" if added else "")

    def _hand_over_replies(self, cluster: Cluster) -> None:
        """Writes waiting for a KVREPLY from a shard that no longer owns their key (a
        conditional write, or a named identity's ``wait=True``, sent before this client
        followed): that shard forwarded them to the key's new owner, whose answer went
        to a reply id it does not know, and was lost. The new owner's part sends each
        again (same UUID: applied once) and its answer resolves the same wait
        (``Writes.take_over``). Found by a growth under a named identity's writer: its
        writes timed out with their outcome unknown."""
        owner = cluster.shard_map.owner
        moves: dict[int, list[tuple[bytes, asyncio.Future[chp.Kvreply], list[bytes]]]] = {}
        for agent in self._agents:
            replies = agent.writes.replies
            if replies is None or not replies.waiting:
                continue
            for uuid, (_, frames) in list(replies.waiting.items()):
                index = owner(frames[0])
                new = self._by_index.get(index)
                if new is None or new is agent or new.writes.replies is None:
                    continue  # (a part not started yet: its answer cannot come here)
                entry = replies.give_up(uuid)
                if entry is not None:
                    moves.setdefault(index, []).append((uuid, *entry))
        for index, waits in moves.items():
            new = self._by_index[index]
            for uuid, fut, _ in waits:
                fut.add_done_callback(functools.partial(self._answered_moved, uuid=uuid,
                                                        agent=new))
            new.writes.take_over(waits)
            log.info("routing: %d writes waiting for an answer sent again to shard %s, "
                     "their key's owner now", len(waits), new.name)

    def _answered_moved(self, fut: asyncio.Future[chp.Kvreply], *, uuid: bytes,
                        agent: ShardAgent) -> None:
        """A handed-over write was answered by its key's new shard: applied at a
        sequence ``agent``'s map already holds, its echo waits in vain in the part
        that sent it first (its KVPUB came before, or inside a snapshot): confirm it."""
        if fut.cancelled() or fut.exception() is not None:
            return
        reply = fut.result()
        if reply.outcome in (chp.APPLIED, chp.DUPLICATE) and reply.seq <= agent.last_seq:
            self._moved_echo(uuid, agent.last_seq)

    def _adopt_staged(self, old: ShardMap, new: ShardMap, held_by: dict[int, ShardAgent],
                      added: list[ShardAgent]) -> None:
        """A shard this client already follows gains keys (a shrink's target, a pin
        moved to it): its server staged them before the flip, and this client did not
        apply those updates (``chp.STAGED``); it holds them in the parts of the shards
        they leave. They move into its part (an adoption, as for an added shard's, no
        event) once each of those parts read its stream up to the new routing (what its
        server published before it followed, every value up to the hold), or after
        ``STAGED_WAIT_S`` anyway. Meanwhile a read that misses its part looks there."""
        lenders = tuple(agent for index, agent in held_by.items()
                        if new.may_take_from(old, index) != ())
        if not lenders:
            return
        for index, agent in self._by_index.items():
            if agent in added or agent.lending or old.may_take_from(new, index) == ():
                continue  # (gains nothing, or an adoption runs there already)
            mine = tuple(o for o in lenders if o is not agent)
            if not mine:
                continue
            agent.lending = mine
            self._staged_adoptions[agent] = (OwnerCache(new, index).owned, new.epoch)
            for other in mine:
                other.on_epoch = self._epoch_seen
                other.lent_out = self._lent_out
        if self._staged_adoptions:
            asyncio.get_running_loop().call_later(STAGED_WAIT_S, self._adopt_staged_now,
                                                  True)
            self._adopt_staged_now()

    def _adopt_staged_now(self, late: bool = False) -> None:
        """Start each pending adoption of staged keys whose lenders read their streams
        up to its routing (``late``: every one still pending)."""
        for agent, (owned, epoch) in list(self._staged_adoptions.items()):
            if agent.closed or not agent.lending:
                del self._staged_adoptions[agent]
                continue
            if late or all(o.epoch_seen >= epoch for o in agent.lending
                           if o.phase == sm.ACTIVE):
                del self._staged_adoptions[agent]
                if late:
                    log.warning("shard %s: adopting the keys it gained before %s read "
                                "their streams up to routing epoch %d", agent.name,
                                ", ".join(o.name for o in agent.lending), epoch)
                agent.start_adoption(owned)

    def _lenders_read_up_to(self, agent: ShardAgent, epoch: int) -> bool:
        """Every other part that could lend ``agent`` its keys read its stream up to a
        HUGZ naming ``epoch``: everything its server published before it followed that
        routing (the copies' ends among it) is applied there."""
        return all(o.epoch_seen >= epoch for o in self._agents
                   if o is not agent and o.phase == sm.ACTIVE and o.adopt_claim is None)

    def _epoch_seen(self, other: ShardAgent) -> None:
        for agent in self._agents:
            if agent.may_adopt():
                agent.release_request()
        if self._staged_adoptions:
            self._adopt_staged_now()

    def _adopt_now(self, added: list[ShardAgent]) -> None:
        """``ADOPT_WAIT_S`` passed: the added shards' first requests go now (a part
        still behind makes the shard refuse the adoption and send a snapshot)."""
        for agent in added:
            agent.adopt_ready = None
            agent.release_request()

    def _adopt_claim(self, agent: ShardAgent) -> tuple[dict[str, tuple[int, int]],
                                                       tuple[ShardAgent, ...]] | None:
        """What an added shard's agent claims in its adoption, and the parts it counts
        on: each other part built whole under an earlier routing (its server had not
        begun to forget what moved away), by its map's generation, up to its sequence.
        None: no part qualifies."""
        cluster = self.cluster
        if cluster is None:
            return None
        epoch = cluster.shard_map.epoch
        lenders = [o for o in self._agents
                   if o is not agent and o.phase == sm.ACTIVE and o.generation
                   and 0 < o.part_epoch < epoch]
        if not lenders:
            return None
        return {o.generation: (o.last_seq, o.part_epoch) for o in lenders}, tuple(lenders)

    def _adopted(self, agent: ShardAgent) -> None:
        """An adoption was installed: the keys its lenders hold for the added shard move
        into its part, a chunk per loop turn (``ShardAgent.start_adoption``)."""
        cluster = self.cluster
        index = next((i for i, a in self._by_index.items() if a is agent), None)
        if cluster is not None and index is not None:
            agent.start_adoption(OwnerCache(cluster.shard_map, index).owned)

    def _lent_out(self, lender: ShardAgent) -> None:
        """``lender``'s map is about to be replaced (a snapshot): every adoption that
        takes keys from it finishes first, at once, so that no key it lends is lost."""
        for agent in self._agents:
            if lender not in agent.lending:
                continue
            if agent in self._staged_adoptions:  # (it had not begun: it begins now)
                owned, _ = self._staged_adoptions.pop(agent)
                agent.start_adoption(owned)
            if agent.adoption is not None:
                agent.adoption.run()

    def _retire(self, agent: ShardAgent) -> None:
        """A shard this client no longer follows: its agent goes once its keys moved to
        other parts (re-homed) and the writes it sent are confirmed, or after ``RETIRE_S``
        (what it still holds then is dropped from its part, without events, and logged;
        a write still waiting fails as at a close)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETIRE_S
        # its server says a route of the new routing that names it nowhere (a shard the
        # routing removed): that is no wrong config, so its route is not checked now
        agent.route = ""

        def check() -> None:
            # its keys re-homed, and its waiting writes confirmed (a write it sent before
            # the change is forwarded by its old shard; its echo comes from the new one)
            if (agent.map or agent.echoes) and loop.time() < deadline:
                loop.call_later(0.05, check)
                return
            if agent.map:
                log.warning("shard %s left the routing with %d keys not re-homed in %g s",
                            agent.name, len(agent.map), RETIRE_S)
            agent.close()
            if agent in self._agents:
                self._agents.remove(agent)
                self._parts_changed.set()  # (a ``start`` under way waits on it no more)

        check()

    def _rehome(self, agent: ShardAgent, key: bytes, value: bytes) -> bool:
        """``key`` arrived from ``agent``'s shard and another part holds it: it moved
        there (resharding). It leaves the other part without an event; True when
        ``value`` is the value the client held (the move itself: no event either). From
        now on a KVPUB's UUID on any part is also matched against the other parts'
        waiting writes (held writes the old shard forwarded)."""
        for other in self._agents:
            if other is not agent and key in other.map:
                held = other.give_up((key,))
                if agent.moved_echo is None:
                    self._echoes_across()
                return held.get(key) == value
        return False

    def _superseded(self, agent: ShardAgent, key: bytes) -> bool:
        """``key`` arrived from ``agent``'s shard, whose part does not hold it, while
        that part's stream has not reached this client's routing: when the routing gives
        the key to another part that holds it, the update is one that shard published
        before the key moved, and the part holding it has a later value (a write the
        new shard applied after the flip). Taking the key back would undo that write,
        and the adoption would keep the older value."""
        cluster = self.cluster
        if cluster is None or agent.epoch_seen >= cluster.shard_map.epoch:
            return False
        owner = self._by_index.get(cluster.shard_map.owner(key))
        return owner is not None and owner is not agent and key in owner.map

    def _rehome_many(self, agent: ShardAgent, old: dict[bytes, bytes],
                     new: dict[bytes, bytes]) -> dict[bytes, bytes]:
        """``_rehome`` for a whole snapshot installed by ``agent``: the keys new to it
        that other parts hold leave them (found by set intersection, not key by key);
        returns those whose value is unchanged."""
        quiet: dict[bytes, bytes] = {}
        for other in self._agents:
            if other is agent or not other.map:
                continue
            common = other.map.keys() & new.keys()
            if old:
                common -= old.keys()
            if not common:
                continue
            quiet.update((k, v) for k, v in other.give_up(common).items() if v == new[k])
            if agent.moved_echo is None:
                self._echoes_across()
        return quiet

    def _echoes_across(self) -> None:
        """Keys moved between parts: a KVPUB's UUID on any part may answer a write
        another part waits for (``_moved_echo``)."""
        for each in self._agents:
            each.moved_echo = self._moved_echo

    def _moved_snapshot(self, data: dict[bytes, bytes], seq: int) -> None:
        for agent in self._agents:
            if agent.echoes:
                agent.echoes.confirm_in(data, seq)

    def _moved_echo(self, uuid: bytes, seq: int) -> None:
        for agent in self._agents:
            if agent.echoes:
                agent.echoes.confirm(uuid, seq)

    @property
    def routing_epoch(self) -> int:
        """The epoch of the routing this client routes by (0: no cluster yet)."""
        return self.cluster.shard_map.epoch if self.cluster is not None else 0

    def _close_agents(self) -> None:
        for agent in self._agents:
            agent.close()

    def release_unstarted(self) -> None:
        """Never to start (its loop thread did not come up): its own context goes now."""
        if not self._started and not self._closed:
            self._closed = True
            if self._own_ctx:
                self._ctx.destroy(linger=0)

    async def close(self, linger_s: float = 0.0) -> None:
        """Close every socket; ``linger_s`` > 0 lets queued KVSETs out for that long."""
        if self._closed:
            return
        self._closed = True
        self._hub.end_all()
        linger_ms = max(0, int(linger_s * 1000))
        for agent in self._agents:
            agent.close(linger_ms)
        if self._own_ctx:
            self._ctx.destroy(linger=linger_ms)

    async def __aenter__(self) -> "AsyncClone":
        try:
            return await self.start()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ keys
    def _key(self, key: str) -> bytes:
        if self.failed is not None:
            raise self.failed
        if not isinstance(key, str):
            raise TypeError(f"keys are str, not {type(key).__name__}")
        key_b = key.encode("utf-8")
        chp.check_key(key_b, "", self.limits)
        if not key_b.startswith(self._subtree_b):
            raise ValueError(f"key {key!r} is outside this client's subtree {self.subtree!r}")
        return key_b

    def _agent_for(self, key_b: bytes) -> ShardAgent:
        """The agent of the shard that owns ``key_b`` (``ShardMap.owner``)."""
        if self.cluster is None:
            raise NotRunning("start() the client first (the cluster map is not known yet)")
        index = self.cluster.shard_map.owner(key_b)
        try:
            return self._by_index[index]
        except KeyError:
            # cannot happen for a key under the subtree (owners_of_subtree covers it)
            if self.only_key is not None:
                raise ValueError(f"key {key_b[:60]!r} is owned by shard {index}; this client "
                                 f"follows only the owner of {self.only_key!r}") from None
            raise RuntimeError(f"routing: key {key_b[:60]!r} is owned by shard {index}, "
                               f"which subtree {self.subtree!r} does not fan out to") from None

    def agent_of(self, key: str) -> ShardAgent | None:
        """The agent that follows ``key``'s shard (None if this client does not)."""
        try:
            return self._agent_for(self._key(key))
        except (KeyError, ValueError, RuntimeError, ClonemapError):
            return None

    @property
    def shard_names(self) -> list[str]:
        """The shards this client follows (its subtree's fan-out), in index order."""
        return [a.name for a in self._agents]

    def _prefix(self, prefix: str) -> bytes:
        if self.failed is not None:
            raise self.failed
        if not isinstance(prefix, str):
            raise TypeError(f"prefixes are str, not {type(prefix).__name__}")
        prefix_b = prefix.encode("utf-8")
        if not (prefix_b.startswith(self._subtree_b) or self._subtree_b.startswith(prefix_b)):
            raise ValueError(f"prefix {prefix!r} is outside this client's subtree "
                             f"{self.subtree!r}")
        return prefix_b

    # ------------------------------------------------------------------ reads (local)
    def get(self, key: str, default: Any = None) -> Any:
        """``key``'s value in the local map, or ``default``: no round trip, no thread
        hop, no lock. With the ``bytes`` codec, a key the map holds is one lookup in
        the flat view (``_viewed_get``); otherwise, and for a key the view lacks, a key
        read before is found by one lookup of its route (its bytes and its shard's
        agent, ``READ_ROUTES`` of them kept) and the agent's map is read at each call,
        so a resync's new map is seen at once; a first read checks the key."""
        return self._get_slow(key, default)

    def _get_slow(self, key: str, default: Any = None) -> Any:
        route = self._routes.get(key)
        if route is None:
            return self._get_routed(key, default)
        failed = self.health.failed
        if failed is not None:
            raise failed
        blob = route[1].map.get(route[0])
        if blob is None:
            if not route[1].lending:
                return default
            blob = _holder(route[1], route[0]).map.get(route[0])
            if blob is None:
                return default
        return blob if self._identity_codec else self.codec.decode(blob)

    def _on_failed(self, exc: ClonemapError) -> None:
        """The client failed for good: every watch ends, and every ``get`` misses the
        flat view (emptied, and no longer kept) and raises."""
        view, self._view = self._view, None
        if view is not None:
            for agent in self._agents:
                agent.view = None
            view.clear()
        self._hub.end_all(exc)

    def _get_routed(self, key: str, default: Any) -> Any:
        key_b = self._key(key)
        agent = self._agent_for(key_b)
        routes = self._routes
        if len(routes) >= self._routes_max:  # a bound, not an LRU
            # twice the map's keys (at least READ_ROUTES): every key of the map can have
            # its route; past that, keys read that are not in it: start over
            self._routes_max = max(READ_ROUTES, 2 * sum(len(a.map) for a in self._agents))
            if len(routes) >= self._routes_max:
                routes.clear()
        routes[key] = (key_b, agent)
        blob = _holder(agent, key_b).map.get(key_b)
        return default if blob is None else self.codec.decode(blob)

    def __contains__(self, key: str) -> bool:
        key_b = self._key(key)
        return key_b in _holder(self._agent_for(key_b), key_b).map

    def properties(self, key: str) -> dict[str, str]:
        """The properties the server sent with ``key``'s current value (e.g. our
        servers' ``expires=<epoch s>`` for a TTL key, or the reference C server's
        ``ttl``); empty if none or if the key is absent."""
        key_b = self._key(key)
        raw = _holder(self._agent_for(key_b), key_b).props.get(key_b)
        return parse_props(raw) if raw else {}

    def meta(self, key: str) -> KeyMeta | None:
        """``key``'s metadata as this client holds it: the sequence that last changed it
        (for ``set(..., if_seq=)``), its absolute expiry and properties; None if the key
        is absent. A local read, like ``get``."""
        key_b = self._key(key)
        owner = self._agent_for(key_b)
        agent = _holder(owner, key_b)
        if key_b not in agent.map:
            return None
        raw = agent.props.get(key_b)
        props = parse_props(raw) if raw else {}
        try:
            expires = float(props["expires"]) if "expires" in props else None
        except ValueError:
            expires = None
        # a key adopted from another part has no sequence of its new shard yet (0: a
        # compare-and-set with it gets Conflict, which names the current one)
        seq = agent.seqs.get(key_b, 0) if agent is owner else 0
        return KeyMeta(key, seq, expires, props, owner.name)

    def items(self, prefix: str = "") -> list[tuple[str, Any]]:
        """(key, value) pairs under ``prefix``, in no particular order (a copy)."""
        prefix_b = self._prefix(prefix)
        decode = self.codec.decode
        return [(k.decode("utf-8"), decode(v)) for a in self._agents
                for k, v in list(a.map.items()) if k.startswith(prefix_b)]

    def keys(self, prefix: str = "") -> list[str]:
        prefix_b = self._prefix(prefix)
        return [k.decode("utf-8") for a in self._agents for k in list(a.map)
                if k.startswith(prefix_b)]

    def __len__(self) -> int:
        if self.failed is not None:
            raise self.failed
        return sum(len(a.map) for a in self._agents)

    @property
    def version_vector(self) -> dict[str, int]:
        """The last applied sequence of each shard."""
        return {a.name: a.last_seq for a in self._agents}

    @property
    def synced(self) -> bool:
        return self.cluster is not None and all(a.synced for a in self._agents)

    async def rights(self, timeout_s: float | None = None) -> dict[str, Any]:
        """This client's identity and its rights as the cluster sees them (``cluster.
        whoami`` on the control plane): ``identity``, ``role``, ``read``, ``write``,
        ``deny`` (prefixes), ``admin``, ``rights`` (one line), ``enforced`` (the servers
        check rights). Needs the control endpoint (``control=``, or the config's)."""
        self._check_running()
        given = self.control or (self.cluster.control if self.cluster else None)
        if not given:
            raise NotSupported("rights() asks the supervisor: give control= (or a config "
                               "that names its control endpoint)")
        first = given if isinstance(given, str) else given[0]
        endpoint = first.split(",")[0].strip()
        return await fetch_rights(endpoint, timeout_s=timeout_s or self.control_timeout_s,
                                  security=self.security)

    @property
    def narrowed(self) -> bool:
        """A shard's last snapshot left out keys this client's identity may not read."""
        return any(a.narrowed for a in self._agents)

    def stats(self) -> dict[str, Any]:
        return {"shards": [a.stats() for a in self._agents], "watches": len(self._hub.watches),
                "resets": sum(a.outages.resets for a in self._agents),
                "slow_policy": self.slow_policy, "fell_behind": self.fell_behind,
                "max_lag_s": self.max_lag_s,
                "failed": str(self.failed) if self.failed is not None else None,
                # process-wide: libzmq's sends turned from EACCES into a dead peer
                "send_guard": zio.send_guard_stats()}

    # ------------------------------------------------------------------ writes
    def prepare_write(self, key: str, value: Any, ttl: float | None,
                      resendable: bool = False) -> tuple[ShardAgent, list[bytes], bytes]:
        """Validate and encode a KVSET (any thread): the owning agent, frames, UUID
        (frames[0] is the key and frames[4] the encoded value). ``resendable``: a write
        that may be sent again after an outage (``wait=True``, conditional): its UUID
        says so (``chp.resendable_uuid``), and our servers apply it once."""
        key_b = self._key(key)
        blob = b"" if value is None else self.codec.encode(value)
        check_write(key, blob, ttl, self.limits)
        props = b"" if not ttl else format_props({"ttl": ttl_text(ttl)})
        agent = self._agent_for(key_b)
        if agent.phase == KEPT:
            raise agent.kept_error()
        uuid = chp.resendable_uuid() if resendable else _uuid.uuid4().bytes
        return agent, chp.kvset(key_b, blob, uuid, props), uuid

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise NotRunning("start() the client first" if not self._closed
                             else "this client is closed")

    async def set(self, key: str, value: Any, ttl: float | None = None, *,
                  wait: bool = False, timeout_s: float | None = None,
                  if_seq: int | None = None, create: bool = False) -> Any:
        """Send a KVSET; returns its 16-byte UUID. ``ttl`` in seconds. Fire-and-forget,
        or with ``wait=True`` once the owning shard has published it back and it is in
        the local map (``Timeout`` after ``timeout_s``, default the client's).

        Conditional (``if_seq=S``: only if the key was last changed by sequence S, see
        ``meta``; ``create=True``: only if the key is absent): the shard's active
        decides; returns the write's sequence once it is in the local map, or raises
        ``Conflict`` (with the key's current sequence: nothing was applied or
        published). ``Timeout``: the outcome is unknown (sent again with the same UUID
        after an outage, so it is applied at most once)."""
        self._check_running()
        if value is None:
            raise ValueError("value is None: use delete() to delete a key")
        if create and if_seq not in (None, 0):
            raise ValueError("create=True is if_seq=0: give one or the other")
        agent, frames, uuid = self.prepare_write(key, value, ttl,
                                            wait or create or if_seq is not None)
        if create or if_seq is not None:
            return await self._send_if(agent, key, frames, 0 if if_seq is None else if_seq,
                                       timeout_s)
        if wait and self._answered(agent):
            await self._send_if(agent, key, frames, None, timeout_s)
            return uuid
        return await self._send(agent, frames, uuid, wait, timeout_s)

    async def delete(self, key: str, *, wait: bool = False,
                     timeout_s: float | None = None, if_seq: int | None = None) -> Any:
        """Send a KVSET with an empty value (delete); returns its UUID. ``wait`` as
        for ``set``. ``if_seq=S``: only if the key was last changed by sequence S
        (returns the delete's sequence, or raises ``Conflict``, as ``set``)."""
        self._check_running()
        agent, frames, uuid = self.prepare_write(key, None, None, wait or if_seq is not None)
        if if_seq is not None:
            return await self._send_if(agent, key, frames, if_seq, timeout_s)
        if wait and self._answered(agent):
            await self._send_if(agent, key, frames, None, timeout_s)
            return uuid
        return await self._send(agent, frames, uuid, wait, timeout_s)

    def _answered(self, agent: ShardAgent) -> bool:
        """A ``wait=True`` write asks the shard for a reply (as a conditional write
        does) when this client presents a named identity and the shard decides writes
        (``cas=1``, not a relay): a write outside the identity's rights is then refused
        at once with ``WriteRefused`` naming why, where an echo would only time out."""
        return (agent.security.identity is not None and not agent.relays
                and agent.link is not None and agent.link.cas)

    async def _send_if(self, agent: ShardAgent, key: str, frames: list[bytes],
                       if_seq: int | None, timeout_s: float | None) -> int:
        """A write that asks for a reply: conditional (``if_seq``), or, with None,
        plain (``_answered``)."""
        if if_seq is not None and (not isinstance(if_seq, int) or isinstance(if_seq, bool)
                                   or if_seq < 0):
            raise ValueError(f"if_seq is a sequence (an int >= 0), got {if_seq!r}")
        if agent.relays or agent.link is None or not agent.link.cas:
            raise NotSupported(f"shard {agent.name} ({agent.server}) does not decide "
                               "conditional writes (a relay, or a server that does not "
                               "say cas=1): it would apply this one unconditionally")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        uuid = frames[2]
        reply = echo = None
        try:
            async with asyncio.timeout(timeout_s):
                await agent.writes.replies_ready()
                frames[3] += chp.write_props(if_seq) + agent.writes.reply_props()
                echo = agent.writes.expect(uuid, frames[0], frames[4])
                reply = await agent.writes.conditional(frames)
                if reply.outcome in (chp.APPLIED, chp.DUPLICATE):
                    await echo  # in the local map, as wait=True
        except TimeoutError:
            if reply is not None:
                raise Timeout(f"shard {agent.name} applied the write of {key!r} at "
                              f"sequence {reply.seq} but did not publish it back here "
                              f"within {timeout_s} s", what="echo",
                              deadline_s=timeout_s) from None
            raise Timeout(f"shard {agent.name} ({agent.server}) did not answer the "
                          f"conditional write of {key!r} within {timeout_s} s: its "
                          "outcome is unknown", what="reply", deadline_s=timeout_s) from None
        finally:
            if echo is not None:
                echo.cancel()
        if reply.outcome == chp.CONFLICT:
            raise Conflict(f"conflict: {key!r} was last changed at sequence {reply.seq}"
                           if reply.seq else f"conflict: {key!r} is absent",
                           key=key, expected=if_seq or 0, current_seq=reply.seq)
        if reply.outcome == chp.REFUSED:
            raise WriteRefused(f"shard {agent.name} refused the write of {key!r}: "
                               f"{reply.detail}", reason=reply.detail, key=key)
        seq: int = reply.seq
        return seq

    async def _send(self, agent: ShardAgent, frames: list[bytes], uuid: bytes, wait: bool,
                    timeout_s: float | None) -> bytes:
        if not wait:
            agent.writes.send_kvset(frames)
            return uuid
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        echo = agent.writes.expect(uuid, frames[0], frames[4], frames)
        agent.writes.send_kvset(frames)
        timer = expire_after(echo, timeout_s)
        try:
            await echo
        except Expired:
            why = agent.unavailable(max(timeout_s, UNAVAILABLE_WINDOW_S))
            raise Timeout(f"shard {agent.name} ({agent.server}) did not publish the update "
                          f"of {frames[0][:60].decode('utf-8', 'replace')!r} back within "
                          f"{timeout_s} s" + (f": no server of the shard served this "
                                              f"client: {why}" if why else ""),
                          what="echo", deadline_s=timeout_s) from None
        finally:
            timer.cancel()
            echo.cancel()
        return uuid

    async def flush(self, timeout_s: float | None = None) -> None:
        """Until every KVSET queued here has been handed to ZeroMQ (``Timeout``
        otherwise). A short-lived process then closes with ``close(linger_s=...)``."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(a.writes.queued for a in self._agents):
            if loop.time() >= deadline:
                raise Timeout(f"KVSETs still queued after {timeout_s} s (no collector "
                              "listening)", what="flush", deadline_s=timeout_s)
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ watches
    def new_watch_core(self, prefix: str, capacity: int | None) -> WatchCore:
        """A watch's state, not yet fed (``open_watch_core``); any thread (the blocking
        facade's ``watch`` makes one, then opens it on the loop)."""
        return WatchCore(self._prefix(prefix), self.codec,
                         self.watch_capacity if capacity is None else capacity)

    def open_watch_core(self, core: WatchCore) -> None:
        """Feed ``core`` from now on (the loop's thread): the items under its prefix,
        then ``synced`` and every change."""
        if self._closed:
            core.closed = True
            return
        if self.cluster is None:
            raise NotRunning("start() the client first (the cluster map is not known yet)")
        self._hub.add(core, self._agents)

    def close_watch_core(self, core: WatchCore) -> None:
        """Stop feeding ``core`` (the loop's thread)."""
        self._hub.remove(core)

    def watch(self, prefix: str = "", *, capacity: int | None = None) -> Watch:
        """``async with clone.watch("/orders/") as w: async for change in w: ...``"""
        return Watch(self.new_watch_core(prefix, capacity), self.open_watch_core,
                     self.close_watch_core)

