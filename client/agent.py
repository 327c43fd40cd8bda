"""The per-shard client agent: the I/O shell around ``client.shard_machine``.

One ``ShardAgent`` per shard owns exactly that shard's sockets (one owner per
socket), all driven from one asyncio loop through ``shards.common.zio.AsyncSocket``:

* its ``client.link.Link`` to the current server: the SUB on P+1 (subscribed to the
  subtree and to "HUGZ", a fresh socket per server, opened by a ``Connect`` effect) with
  its monitor, and a fresh DEALER on P per ``RequestSnapshot``; the link says when the
  subscription is proven live (``SubscriberLive``, or ``Reconnected`` after a
  disconnection) and remembers what the server's HUGZ said (generation, serving);
* one XPUB per server of the shard, connected to its P+2 collector (a Binary Star pair
  gets every KVSET at both servers): ``client.collector.KvsetSender``, which sends a KVSET
  only once that collector has subscribed, queues (bounded) otherwise, and drops what a
  down standby server must not get later (see there).

Hot paths: a KVPUB is one ``decode_update``, one
``check_seq`` and one dict store; a KVSYNC is one ``decode_snapshot`` and one dict
store. While not ACTIVE, SUB messages are kept raw in a bounded buffer and decoded when
replayed after the KTHXBAI.

Sequences (12/CHP: a KVPUB not greater than the last applied is discarded): a discarded
KVPUB whose sequence is at most the installed snapshot's (KTHXBAI) is a late copy of what
the snapshot holds, counted ``skipped``; one above the snapshot's but not above the last
applied means the stream went backwards, counted ``stale``, and starts a resync. A server
restarted behind the same address is noticed by the SUB's reconnection instead.

Serving hint and generation (our HUGZ properties, see ``shards.common.proto.chp``): a HUGZ
read before it is applied (the first message after a handshake, or while the snapshot
streams) is peeked at. ``serving=0`` means this server would not answer the ICANHAZ
(a passive Binary Star server): ``NotServing``, and the machine moves to the other
server at once. ``gen=`` names the generation of the server's map; the link's latest
is kept. When a snapshot is installed over an earlier one, a generation that changed
or a sequence that went backwards is a *data loss*: the server's map is not the one
this client had. It is reported once (``ResetInfo`` to ``on_reset``, a WARNING, the
``resets`` counter, a ``reset`` change to watches) and handled by ``reset_policy``:
``"accept"`` installs the new map, ``"keep"`` keeps the old copy read-only and stops
following the shard.

Tolerance: snapshots and updates are decoded liberally (``strict=False``): the guide's
reference C server sends KVSYNC with UUID and properties, an empty KTHXBAI subtree and
HUGZ with its sequence. Properties that come with a key (KVPUB or KVSYNC) are kept
per key (``props``, sparse). A snapshot whose every KVSYNC was malformed is not a
success (``SnapshotRejected``).

Lag (the guide's Suicidal Snail, with or without a subtree): each clock HUGZ read live
(not replayed after a sync) goes to the agent's ``LagMeter`` (``client.lag``, pure; reset
on every ``Connect``). Above ``max_lag_s`` (None: off) the agent asks ``on_lag(agent,
lag_s)`` (True: handled, e.g. policy "die") or resyncs (``FellBehind``), counted
``lagged``. Writes awaiting their echo (``wait=True``) are ``client.echoes.Echoes``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Sequence

import zmq

from shards.common.drops import DropCounter
from shards.common.errors import ProtocolError
from shards.common.proto import chp
from client import shard_machine as sm
from shards.common.security import Security
from client.collector import KvsetSender, ServerAddress, parse_server
from client.echoes import Echoes
from client.replies import Replies
from client.events import FailoverInfo, ResetInfo
from client.lag import LagMeter
from client.link import Link
from client.options import KEEP, AgentHooks, AgentOptions
from client.watch import WatchHub

log = logging.getLogger(__name__)

TICK_S = 0.1
REPLAY_BATCH = 4096
PHASE_LOG_MAX = 64
REPLY_CONNECT_S = 2.0
"""After an outage, how long resent writes that ask for a reply wait for the replies
DEALER's connection before they go anyway."""

_Hugz = chp.Hugz
_Kvsync = chp.Kvsync
_HUGZ_KEY = chp.HUGZ
_decode_update = chp.decode_update
_decode_snapshot = chp.decode_snapshot_liberal
_check_seq = sm.check_seq

def diff_counts(old: dict[bytes, bytes], new: dict[bytes, bytes]) -> tuple[int, int]:
    """(keys of ``old`` that ``new`` lacks, keys new or changed in ``new``)."""
    get = old.get
    return len(old.keys() - new.keys()), sum(1 for k, v in new.items() if get(k) != v)


class ShardAgent:
    """One shard: its machine, its sockets, its part of the local map.

    ``map`` (key bytes -> value bytes) is replaced as a whole when a snapshot is
    installed, so a reader sees either the old or the new snapshot, never a mix.
    ``last_seq`` is the last applied sequence (this shard's entry of the version vector).
    """

    def __init__(self, ctx: zmq.Context, servers: Sequence[ServerAddress],
                 options: AgentOptions | None = None, hooks: AgentHooks | None = None, *,
                 name: str = "s0", subtree: bytes = b"", hub: WatchHub | None = None,
                 clock: Callable[[], float] = time.monotonic, affinity: int = 0,
                 security: Security | None = None, route: str = "", relays: bool = False):
        options = options if options is not None else AgentOptions()
        hooks = hooks if hooks is not None else AgentHooks()
        self.options = options
        """How this agent follows its shard (``client.options.AgentOptions``)."""
        if not servers:
            raise ValueError(f"shard {name}: no servers")
        self.relays = relays
        """The servers are relays of the shard (each forwards a KVSET to both servers of
        the pair): a KVSET goes to the followed relay only, never twice upstream."""
        self.resumes = self.resume_updates = self.resumes_refused = 0
        self.route = route
        """``I/N/DIGEST`` this client's routing expects of the shard's servers ("" : no
        check); a HUGZ naming another is a wrong config: ``on_wrong_route(agent, theirs)``."""
        self.on_wrong_route = hooks.on_wrong_route
        chp.check_subtree(subtree)
        self.ctx = ctx
        self.security = security or Security.off()
        self.servers = tuple(parse_server(s) for s in servers)
        self.name = name
        self.subtree = subtree
        self.hub = hub if hub is not None else WatchHub()
        self.limits = options.limits
        self.sync_buffer_max = options.sync_buffer_max
        self.kvset_queue_max = options.kvset_queue_max
        self.on_failover = hooks.on_failover
        self.clock = clock
        self.affinity = affinity
        """ZMQ_AFFINITY of every socket of this shard: a bit mask of the context's I/O
        threads (0: ZeroMQ chooses). The Black Box pattern: one I/O thread per shard."""
        self.sub_rcvhwm = options.sub_rcvhwm
        self.on_behind = hooks.on_behind
        self.max_lag_s = options.max_lag_s
        self.on_lag = hooks.on_lag
        self.on_reset = hooks.on_reset
        self.reset_policy = options.reset_policy
        self.resets = 0
        self.last_reset: ResetInfo | None = None
        """The last data loss; when the phase is ``KEPT``, the one this client keeps."""
        self.props: dict[bytes, bytes] = {}
        """Properties that came with a key (KVPUB or KVSYNC), only for keys that had any."""
        self._incoming_props: dict[bytes, bytes] = {}
        self.seqs: dict[bytes, int] = {}
        """key -> the sequence that last changed it (a KVPUB's, or its KVSYNC's from our
        servers, which send each key's own; the guide's C server sends its own too)."""
        self._incoming_seqs: dict[bytes, int] = {}
        self._sync_base = 0
        """``snapshot_messages`` when the current request went out."""
        self._sync_dropped = 0
        self._first_sync_error = ""
        self.snapshots_rejected = 0
        self.lag = LagMeter()
        """How far behind the publisher this client reads (``client.lag``)."""
        self.lagged = 0
        self.contiguous = not subtree
        self.state = sm.State(options.machine(len(self.servers), self.contiguous))
        self.drops = DropCounter(log)
        self.map: dict[bytes, bytes] = {}
        self.last_seq = 0
        self.snapshot_seq = 0
        """KTHXBAI sequence of the installed snapshot."""
        self.last_heard_s = 0.0
        """When the SUB last delivered anything (KVPUB or HUGZ), to TICK_S."""
        self.last_snapshot_s = 0.0
        self.heard = 0
        self.snapshot_messages = 0
        self._heard_at_tick = 0
        self._snapshot_messages_at_tick = 0
        self.synced = False
        # counters
        self.applied = 0
        self.stale = 0
        self.skipped = 0
        self.gaps = 0
        self.overflows = 0
        self.snapshots = 0
        self.failovers = 0
        self.last_failover: FailoverInfo | None = None
        self.left_because: dict[str, tuple[str, float]] = {}
        """Server -> why this client last moved away from it, and when (a write that
        times out says so: e.g. one server unreachable, the other passive)."""
        self.phase_log: deque[tuple[float, str]] = deque(maxlen=PHASE_LOG_MAX)
        """(time, phase) at start and at each phase change, newest last (bounded)."""
        # internals
        self.loop: asyncio.AbstractEventLoop | None = None
        self._synced_event: asyncio.Event | None = None
        self._collector_event: asyncio.Event | None = None
        self._collectors: list[KvsetSender] = []
        self.link: Link | None = None
        """The SUB, its monitor and the DEALER to the current server (made in start())."""
        self._incoming: dict[bytes, bytes] | None = None
        """The snapshot being received (None: none asked for, or it was rejected)."""
        self._buffer: deque[list[bytes]] = deque()
        """SUB messages held while ``state.buffering`` (bounded: ``sync_buffer_max``)."""
        self._tick_handle: asyncio.TimerHandle | None = None
        self._closed = False
        self.echoes = Echoes()
        """Writes awaiting their echo (``wait=True``): ``client.echoes``."""
        self.replies: Replies | None = None
        """Writes awaiting their KVREPLY (conditional writes, resends): made in start(),
        its DEALER connected on first use (``client.replies``)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def server(self) -> ServerAddress:
        return self.servers[self.state.server]

    @property
    def phase(self) -> str:
        return self.state.phase

    @property
    def generation(self) -> str:
        """Generation of the map the installed snapshot came from ("" unknown)."""
        return self.state.generation

    def start(self) -> None:
        """Open the collectors and start syncing (call from the agent's loop)."""
        self.loop = asyncio.get_running_loop()
        self.link = Link(self.ctx, self.name, self.subtree, loop=self.loop,
                         affinity=self.affinity, sub_rcvhwm=self.sub_rcvhwm,
                         on_update=self._on_update, on_snapshot=self._on_snapshot,
                         on_event=self._on_link_event, security=self.security)
        self._synced_event = asyncio.Event()
        self._collector_event = asyncio.Event()
        for address in self.servers:
            self._collectors.append(KvsetSender(self.ctx, address, self.loop, self.drops,
                                               self.kvset_queue_max,
                                               self._on_collector_change, self.affinity,
                                               self.security))
        self.replies = Replies(self.ctx, self.name, self.loop, affinity=self.affinity,
                               security=self.security, on_reply=self._on_reply)
        self._dispatch(sm.Start())
        self._tick_handle = self.loop.call_later(TICK_S, self._tick)

    def _freeze(self) -> None:
        """``reset_policy="keep"``: stop following the shard; the map stays as it was."""
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if self.link is not None:
            self.link.close()
        self._buffer.clear()
        self.echoes.fail_all(self._kept_error())
        if self.replies is not None:
            self.replies.fail_all(self._kept_error())
        if not self._synced_event.is_set():
            self._synced_event.set()

    def _kept_error(self) -> Exception:
        from client.errors import ShardReset

        info = self.last_reset
        return ShardReset(f"shard {self.name} is read-only: its server lost the data this "
                          f"client keeps ({info.describe()})", shard=self.name, info=info)

    async def wait_ready(self) -> None:
        """Until the first snapshot is installed and replayed, and a collector listens."""
        await self._synced_event.wait()
        await self._collector_event.wait()

    @property
    def collector_ready(self) -> bool:
        return any(c.ready for c in self._collectors)

    def _on_collector_change(self) -> None:
        if self.collector_ready:
            self._collector_event.set()
        else:
            self._collector_event.clear()

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; ``linger_ms`` lets KVSETs already handed to ZeroMQ out."""
        if self._closed:
            return
        self._closed = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        if self.link is not None:
            self.link.close()
        for c in self._collectors:
            c.close(linger_ms)
        self.echoes.cancel_all()
        if self.replies is not None:
            self.replies.cancel_all()

    # ------------------------------------------------------------------ machine
    def _dispatch(self, event) -> None:
        if self._closed:
            return
        now = self.clock()
        before = self.state
        self.state, effects = sm.step(before, event, now)
        if self.state.phase != before.phase or not before.started:
            self.phase_log.append((now, self.state.phase))
        for effect in effects:
            match effect:
                case sm.Connect():
                    self._connect(effect)
                case sm.RequestSnapshot():
                    self._request_snapshot(effect)
                case sm.InstallSnapshot():
                    self._install_snapshot(effect)
                case sm.Failover():
                    self._failed_over(effect)
                case sm.ArmGrace():
                    self.link.arm_grace()
                case sm.Freeze():
                    self._freeze()
                case _:
                    raise TypeError(f"not a shard machine effect: {effect!r}")

    def _tick(self) -> None:
        """Every TICK_S: turn the hot paths' message counters into times, then step."""
        if self._closed:
            return
        now = self.clock()
        if self.heard != self._heard_at_tick:
            self._heard_at_tick = self.heard
            self.last_heard_s = now
        if self.snapshot_messages != self._snapshot_messages_at_tick:
            self._snapshot_messages_at_tick = self.snapshot_messages
            self.last_snapshot_s = now
        self._dispatch(sm.Tick(self.last_heard_s, self.last_snapshot_s))
        self._tick_handle = self.loop.call_later(TICK_S, self._tick)

    def _connect(self, eff: sm.Connect) -> None:
        self.link.connect(self.servers[eff.server])
        if self.replies.address is not None:  # in use: follow the shard to its server
            self.replies.connect(self.servers[eff.server])
        self._buffer.clear()
        self.lag.reset()

    def _request_snapshot(self, eff: sm.RequestSnapshot) -> None:
        address = self.servers[eff.server]
        # a map installed from one of our servers (it named its generation): the machine
        # asks for a resume, only the updates after ours; the server decides (resume=1
        # or a full snapshot, resume=0). A foreign server never sees the extension.
        since = self.last_seq if eff.resume else None
        self.link.request_snapshot(address, since, self.generation if since is not None
                                   else "", meta=self.link.cas)
        self._incoming = {}
        self._incoming_props = {}
        self._incoming_seqs = {}
        self._sync_base, self._sync_dropped = self.snapshot_messages, 0
        self._first_sync_error = ""
        self._buffer.clear()
        log.info("shard %s: ICANHAZ %r to %s (%s%s)", self.name, self.subtree,
                 address.snapshot, eff.reason,
                 f"; resume after {since}" if since is not None else "")

    def _install_snapshot(self, eff: sm.InstallSnapshot) -> None:
        old, new = self.map, self._incoming if self._incoming is not None else {}
        self._incoming = None
        self.link.close_dealer()
        reset = self._data_loss(old, new, eff) if self.snapshots else None
        if reset is not None:
            self.resets += 1
            self.last_reset = reset
            log.warning("%s", reset.describe())
            if reset.policy == KEEP:
                self.hub.reset(self.name, reset, None, eff.seq)
                self._report_reset(reset)
                self._dispatch(sm.Keep(eff.old_generation))  # -> Freeze
                return
        self.map = new
        self.props = self._incoming_props
        self._incoming_props = {}
        self.seqs = self._incoming_seqs
        self._incoming_seqs = {}
        self.last_seq = self.snapshot_seq = eff.seq
        self.snapshots += 1
        if reset is not None:
            self.hub.reset(self.name, reset, new, eff.seq)
        else:
            self.hub.installed(self.name, old, new, eff.seq)
        log.info("shard %s: snapshot of %d keys at sequence %d from %s%s", self.name,
                 len(new), eff.seq, self.server, " (resync: replaced)" if eff.resync else "")
        if eff.outage is not None:
            self._resumed(eff.outage, old, new)
        if eff.resend and (self.echoes or self.replies.waiting):
            # writes made while no server took them (a KVSET sent into a connection that
            # was already dead is gone): sent again, same UUID, now that the shard
            # serves again (after a failover, or a reconnection to a server that
            # restarted). A server that keeps applied UUIDs (``cas=1``) applies each
            # once and answers on the replies DEALER (applied, or duplicate: it was
            # applied before the outage); otherwise a snapshot that holds the written
            # value confirms the write first (at-least-once).
            self._resend(self.echoes.unconfirmed() if self.link.cas else None)
        elif self.echoes:
            self.echoes.confirm_in(new, self.last_seq)
        if self.echoes:
            self.echoes.confirm_upto(self.last_seq)
        if reset is not None:
            self._report_reset(reset)
        self._replay(self.state.epoch)

    def _resend(self, echoed: list[list[bytes]] | None) -> None:
        if echoed is None:
            self.echoes.confirm_in(self.map, self.last_seq)
            for frames in self.echoes.unconfirmed():
                self.send_kvset(frames)
            return
        self.replies.connect(self.server)
        ident = self.reply_props()
        again = [[f[0], f[1], f[2], f[3] if b"reply=" in f[3] else f[3] + ident, f[4]]
                 for f in echoed]
        again += self.replies.unanswered()
        self.loop.create_task(self._send_when_ready(again, self.state.epoch))

    async def _send_when_ready(self, frames_list: list[list[bytes]], epoch: int) -> None:
        """Send once the replies DEALER is connected (so no answer is lost), or after
        ``REPLY_CONNECT_S`` anyway."""
        try:
            async with asyncio.timeout(REPLY_CONNECT_S):
                await self.replies.ready.wait()
        except TimeoutError:
            pass
        if self._closed or epoch != self.state.epoch:
            return  # moved on: the next outage sends them again
        for frames in frames_list:
            self.send_kvset(frames)

    def _on_reply(self, reply: chp.Kvreply) -> None:
        """A KVREPLY: a write awaiting its echo that it answers (applied now, or before
        an outage) is confirmed once this client's map is at its sequence (a later one
        is confirmed by its KVPUB, still on the way)."""
        if self.echoes and reply.outcome in (chp.APPLIED, chp.DUPLICATE):
            if reply.seq <= self.last_seq:
                self.echoes.confirm(reply.uuid, self.last_seq)
            else:  # its KVPUB is on the way, or will be folded into a snapshot
                self.echoes.applied(reply.uuid, reply.seq)

    def conditional(self, frames: list[bytes]) -> asyncio.Future:
        """Send a KVSET that asks for a reply (``frames[3]`` already says ``reply=``
        this agent's id, see ``reply_props``); the future of its KVREPLY."""
        fut = self.replies.expect(frames[2], frames)
        self.send_kvset(frames)
        return fut

    def reply_props(self) -> bytes:
        return chp.write_props(reply_to=self.replies.identity)

    async def replies_ready(self) -> None:
        """The replies DEALER connected to the current server (made on first use)."""
        self.replies.connect(self.server)
        await self.replies.ready.wait()

    def _data_loss(self, old: dict[bytes, bytes], new: dict[bytes, bytes],
                   eff: sm.InstallSnapshot) -> ResetInfo | None:
        """A snapshot about to replace an installed one: is it a different map?"""
        old_gen, new_gen, seq = eff.old_generation, eff.generation, eff.seq
        if old_gen and new_gen and old_gen != new_gen:
            reason = "the server's map is a new generation"
        elif seq < self.last_seq:
            reason = "the server's sequence went backwards"
        else:
            return None
        lost, changed = diff_counts(old, new)
        return ResetInfo(self.name, self.server, reason, old_gen, new_gen, self.last_seq,
                         seq, len(old), len(new), lost, changed, self.reset_policy)

    def _report_reset(self, info: ResetInfo) -> None:
        self._call_back(self.on_reset, info, "on_reset")

    def _call_back(self, callback, info, name: str) -> None:
        """An application callback: its failure is logged, never the agent's."""
        if callback is not None:
            try:
                callback(info)
            except Exception:
                log.exception("shard %s: %s callback failed", self.name, name)

    def _resumed(self, outage: sm.Outage, old: dict[bytes, bytes],
                 new: dict[bytes, bytes]) -> None:
        first, heard_s, reason, silent_s = outage
        removed, changed = diff_counts(old, new)
        info = FailoverInfo(self.name, self.servers[first], self.server, reason, silent_s,
                            resumed=True, gap_s=self.clock() - heard_s, removed=removed,
                            changed=changed)
        self.last_failover = info
        log.warning("shard %s: resumed on %s %.2f s after the last message from %s "
                    "(%d keys removed, %d new or changed)", self.name, info.new, info.gap_s,
                    info.old, removed, changed)
        self._report(info)

    def _report(self, info: FailoverInfo) -> None:
        self._call_back(self.on_failover, info, "on_failover")

    def _failed_over(self, eff: sm.Failover) -> None:
        info = FailoverInfo(self.name, self.servers[eff.old], self.servers[eff.new],
                            eff.reason, eff.silent_s)
        self.failovers += 1
        self.last_failover = info
        log.warning("shard %s: %s after %.1f s; moving from %s to %s", self.name, eff.reason,
                    eff.silent_s, info.old, info.new)
        self.left_because[info.old] = (f"{eff.reason} after {eff.silent_s:.1f} s",
                                       self.clock())
        for i, collector in enumerate(self._collectors):
            if i != eff.new and not collector.ready:
                collector.discard_queue()
        self._report(info)

    def unavailable(self, within_s: float) -> str:
        """Why no server of this shard served this client lately: each server it left
        within the last ``within_s`` seconds, and why ("" when it left none)."""
        since = self.clock() - within_s
        recent = [f"{server}: {why}" for server, (why, at) in self.left_because.items()
                  if at >= since]
        if not recent:
            return ""
        text = "; ".join(recent)
        if any("not serving" in why for why, at in self.left_because.values() if at >= since):
            text += (" (a passive server says its peer serves: this client may be cut off "
                     "from the active one)")
        return text

    # ------------------------------------------------------------------ sockets
    def _on_link_event(self, event) -> None:
        """What the link saw: its SUB's handshake or disconnection, or its grace timer's
        end (``LiveProven``). The machine decides what it means."""
        self._dispatch(event)

    def _note_hugz(self, info: chp.HugzInfo) -> bool:
        """What a HUGZ from the current server said: its generation and ``cas`` (kept by
        the link), and whether it serves; True if it does not and there is another
        server to ask (``NotServing``, dispatched here)."""
        self._check_route(info)
        link = self.link
        if info.generation:
            link.generation = info.generation
        link.cas = info.cas
        if not info.serving and len(self.servers) > 1:
            self._dispatch(sm.NotServing())
            return True
        if self.state.not_serving:
            self._dispatch(sm.Serving())
        return False

    def _peek_hugz(self, frames: list[bytes]) -> bool:
        """A HUGZ read before it is applied (not on the hot path): ``_note_hugz``."""
        if len(frames) != 5 or frames[0] != _HUGZ_KEY:
            return False
        try:
            msg = _decode_update(frames, self.limits, strict=False)
        except ProtocolError:
            return False  # counted when applied
        if msg.__class__ is not _Hugz:
            return False
        return self._note_hugz(chp.hugz_info(msg))

    def _check_route(self, info: chp.HugzInfo) -> None:
        if (info.route and self.route and info.route != self.route
                and self.on_wrong_route is not None):
            self.on_wrong_route(self, info.route)

    def _on_update(self, frames: list[bytes]) -> None:
        """A message on the SUB: KVPUB or HUGZ (hot path)."""
        self.heard += 1
        state = self.state
        if state.live:  # the first message since a handshake: the subscription is live
            if frames[0] == _HUGZ_KEY and self._peek_hugz(frames):
                return  # NotServing: ask the other server, not this one
            if state.buffering:
                self._buffer.append(frames)
            else:
                self._apply(frames, False)
            self._dispatch(sm.LiveProven())
            return
        if not state.buffering:
            self._apply(frames, False)
            return
        if frames[0] == _HUGZ_KEY and self._peek_hugz(frames):
            return
        buffer = self._buffer
        if len(buffer) >= self.sync_buffer_max:
            self.overflows += 1
            log.warning("shard %s: %d updates buffered during sync: buffer full, "
                        "requesting a new snapshot", self.name, len(buffer))
            self._buffer.clear()
            self._dispatch(sm.BufferOverflow(self.sync_buffer_max))
            return
        buffer.append(frames)
        if self.state.phase == sm.INITIAL:
            self._dispatch(sm.SubscriberLive())

    def _apply(self, frames: list[bytes], replay: bool) -> None:
        try:
            msg = _decode_update(frames, self.limits, strict=False)
        except ProtocolError as exc:
            self.drops.drop(exc.reason, f"shard {self.name} SUB: {exc}")
            return
        if msg.__class__ is _Hugz:
            if (msg.props or msg.seq) and not replay:
                self._on_hugz(msg)
            return
        seq = msg.seq
        verdict = _check_seq(self.last_seq, seq, self.contiguous)
        if verdict:
            if verdict == sm.STALE:
                if replay or seq <= self.snapshot_seq:
                    # already in the installed snapshot: a late copy (the SUB and the
                    # DEALER are separate connections, read in no fixed order)
                    self.skipped += 1
                    if self.echoes:
                        self.echoes.confirm(msg.uuid, self.last_seq)
                else:
                    # we applied something newer from this stream: it went backwards
                    self.stale += 1
                    self._dispatch(sm.SequenceBackwards(self.last_seq, seq))
            else:
                self._gap(seq)
            return
        self.last_seq = seq
        key = msg.key
        if not key.startswith(self.subtree):
            # only through the "HUGZ" subscription's prefix (a key like "HUGZY")
            self.drops.drop("outside_subtree", f"shard {self.name}: KVPUB {key[:60]!r}")
            return
        value = msg.value
        if value:
            self.map[key] = value
            self.seqs[key] = seq
        else:
            self.map.pop(key, None)
            self.seqs.pop(key, None)
        props = msg.props
        if props and value:
            self.props[key] = props
        elif self.props:
            self.props.pop(key, None)
        self.applied += 1
        if self.hub.watches:
            self.hub.changed(self.name, key, value, seq)
        if self.echoes:
            self.echoes.confirm(msg.uuid, self.last_seq)

    def _gap(self, seq: int) -> None:
        """Sequence ``seq`` is known to be published while ``last_seq + 1`` was never
        applied: the publisher dropped updates for this (unfiltered) subscriber."""
        self.gaps += 1
        log.warning("shard %s: sequence gap: expected %d, got %d", self.name,
                    self.last_seq + 1, seq)
        if self.on_behind is not None and self.on_behind(self, self.last_seq + 1, seq):
            return
        self._dispatch(sm.Gap(self.last_seq + 1, seq))

    def _on_hugz(self, msg: chp.Hugz) -> None:
        """A HUGZ with properties (or a sequence), read live. ``serving=0``: the server
        stopped serving (``NotServing``: move). A generation other than the installed
        map's: its map was lost (``NewGeneration``: resync, and the loss is reported).
        The server clock measures this client's lag. For an unfiltered subscription the
        clock's ``seq`` is also a gap check: every KVPUB up to it was published before it
        on this ordered stream, so a loss that ended the stream (no later KVPUB to show
        the gap) is seen here. A HUGZ sequence without a clock (the reference C
        server's) is only a liveness sign: our gap rule is not its contract."""
        info = chp.hugz_info(msg)
        if self._note_hugz(info):
            return
        if (info.generation and self.generation and info.generation != self.generation
                and self.state.phase == sm.ACTIVE and not self.state.live):
            self._dispatch(sm.NewGeneration(self.generation, info.generation))
            return
        if info.ts is None:
            return
        if (self.contiguous and info.seq > self.last_seq
                and self.state.phase == sm.ACTIVE and not self.state.live):
            # (not the first message after a reconnect: that resyncs as Reconnected)
            self._gap(info.seq)
            return
        lag_s = self.lag.observe(info.ts, time.time())
        if (self.max_lag_s is None or lag_s <= self.max_lag_s
                or self.state.phase != sm.ACTIVE):
            return
        self.lagged += 1
        log.warning("shard %s: %.2f s behind the publisher (max_lag_s %.2f)", self.name,
                    lag_s, self.max_lag_s)
        if self.on_lag is not None and self.on_lag(self, lag_s):
            return
        self._dispatch(sm.FellBehind(lag_s))

    def _replay(self, epoch: int) -> None:
        """Apply the buffered updates in order, a batch per loop turn; updates that arrive
        meanwhile are appended to the buffer, so order holds until it is empty."""
        if epoch != self.state.epoch or self._closed:
            return
        buffer = self._buffer
        apply = self._apply
        n = 0
        while buffer and n < REPLAY_BATCH:
            apply(buffer.popleft(), True)
            n += 1
            if epoch != self.state.epoch:
                return  # a gap or overflow started a new sync
        if buffer:
            self.loop.call_soon(self._replay, epoch)
            return
        self._dispatch(sm.Replayed())
        if not self.synced:
            self.synced = True
            self._synced_event.set()

    def _on_snapshot(self, frames: list[bytes]) -> None:
        """A message on the DEALER: KVSYNC or KTHXBAI (hot path during a sync)."""
        self.snapshot_messages += 1
        incoming = self._incoming
        if incoming is None:
            self.drops.drop("unexpected_snapshot", f"shard {self.name}: no sync in progress")
            return
        try:
            msg = _decode_snapshot(frames, self.limits)
        except ProtocolError as exc:
            if frames and frames[0] != chp.KTHXBAI:
                self._sync_dropped += 1
                self._first_sync_error = self._first_sync_error or str(exc)
            self.drops.drop(exc.reason, f"shard {self.name} DEALER: {exc}")
            return
        if msg.__class__ is _Kvsync:
            key = msg.key
            if not key.startswith(self.subtree):
                self._sync_dropped += 1
                self.drops.drop("outside_subtree", f"shard {self.name}: KVSYNC {key[:60]!r}")
            elif msg.value or self.state.resuming:  # a resume's empty value is a delete
                incoming[key] = msg.value
                self._incoming_seqs[key] = msg.seq
                if msg.props:
                    self._incoming_props[key] = msg.props
            return
        if msg.subtree != self.subtree and msg.subtree:
            # (an empty KTHXBAI subtree is the reference C server's: tolerated)
            self.drops.drop("wrong_subtree", f"shard {self.name}: KTHXBAI for "
                            f"{msg.subtree!r}, asked {self.subtree!r}")
            return
        arrived = self.snapshot_messages - self._sync_base - 1  # KVSYNCs (not KTHXBAI)
        if arrived and self._sync_dropped == arrived:
            self.snapshots_rejected += 1
            reason = (f"{arrived} KVSYNC from {self.server}, none valid (first: "
                      f"{self._first_sync_error or 'outside the subtree'})")
            log.error("shard %s: snapshot rejected: %s", self.name, reason)
            self._incoming = None  # nothing of it is installed
            self.link.close_dealer()
            self._dispatch(sm.SnapshotRejected(reason))
            return
        if self.state.resuming:
            self._merge_resume(msg.props == chp.RESUMED, arrived)
        self._dispatch(sm.SnapshotDone(msg.seq, self.link.generation))

    def _merge_resume(self, resumed: bool, arrived: int) -> None:
        """At the KTHXBAI of a resume request: the updates after our sequence applied on
        a copy of the installed map (``resume=1``), or, when the server could not resume
        (``resume=0``), the full snapshot it sent instead (its deletes dropped)."""
        incoming, props_in, seqs_in = self._incoming, self._incoming_props, self._incoming_seqs
        if not resumed:
            self._incoming = {k: v for k, v in incoming.items() if v}
            self._incoming_props = {k: p for k, p in props_in.items() if incoming.get(k)}
            self._incoming_seqs = {k: s for k, s in seqs_in.items() if incoming.get(k)}
            self.resumes_refused += 1
            return
        merged, props, seqs = dict(self.map), dict(self.props), dict(self.seqs)
        for key, value in incoming.items():
            if value:
                merged[key] = value
                seqs[key] = seqs_in[key]
                if key in props_in:
                    props[key] = props_in[key]
                else:
                    props.pop(key, None)
            else:
                merged.pop(key, None)
                props.pop(key, None)
                seqs.pop(key, None)
        self._incoming, self._incoming_props, self._incoming_seqs = merged, props, seqs
        self.resumes += 1
        self.resume_updates += arrived
        log.info("shard %s: resumed with %d updates after sequence %d", self.name, arrived,
                 self.last_seq)

    # ------------------------------------------------------------------ updates out
    @property
    def kvsets_queued(self) -> int:
        """KVSETs waiting here for a collector (not yet handed to ZeroMQ)."""
        return sum(len(c.queue) for c in self._collectors)

    def send_kvset(self, frames: list[bytes]) -> None:
        """Publish a KVSET to every server of the shard (fire-and-forget)."""
        collectors = self._collectors
        if len(collectors) == 1:
            collectors[0].send(frames)
            return
        current = self.state.server
        if self.relays:  # each relay forwards to the whole pair: one copy, to ours
            collectors[current].send(frames, True)
            return
        for i, collector in enumerate(collectors):
            collector.send(frames, i == current)

    def expect(self, uuid: bytes, key: bytes, value: bytes,
               frames: list[bytes] | None = None) -> asyncio.Future:
        """A future resolved when this shard publishes the update ``uuid`` back (its
        KVPUB applied here), or a snapshot installed here holds ``key`` = ``value``
        (the KVPUB itself was folded into a resync). The caller cancels it on timeout."""
        return self.echoes.expect(self.loop, uuid, key, value, frames)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict:
        return {
            "shard": self.name, "server": str(self.server), "phase": self.phase,
            "keys": len(self.map), "last_seq": self.last_seq, "applied": self.applied,
            "stale": self.stale, "skipped": self.skipped, "gaps": self.gaps,
            "overflows": self.overflows, "snapshots": self.snapshots,
            "lag_s": round(self.lag.lag_s, 6),
            "max_lag_seen_s": round(self.lag.max_lag_seen_s, 6),
            "lagged": self.lagged,
            "failovers": self.failovers,
            "disconnects": self.link.disconnects if self.link is not None else 0,
            "generation": self.generation, "resets": self.resets,
            "last_reset": self.last_reset._asdict() | {"server": str(self.last_reset.server)}
            if self.last_reset is not None else None,
            "snapshots_rejected": self.snapshots_rejected,
            "resumes": self.resumes, "resume_updates": self.resume_updates,
            "resumes_refused": self.resumes_refused,
            "buffered": len(self._buffer),
            "kvsets_sent": sum(c.sent for c in self._collectors),
            "kvsets_queued": sum(len(c.queue) for c in self._collectors),
            "kvsets_dropped": sum(c.dropped for c in self._collectors),
            "kvsets_resent": self.echoes.resent,
            "replies": self.replies.received if self.replies is not None else 0,
            "drops": dict(self.drops.counts),
        }
