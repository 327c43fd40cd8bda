"""The per-shard client agent: the I/O shell around ``clonemap.client.shard_machine``.

One ``ShardAgent`` per shard owns that shard's part of the local map and, through its
parts, that shard's sockets (one owner per socket), all driven from one asyncio loop
through ``clonemap.shards.common.zio.AsyncSocket``. It steps the machine with what its parts saw
and performs the machine's effects; it decides nothing the machine decides. Its parts:

* ``clonemap.client.link.Link``: the SUB on the current server's P+1 (subtree and "HUGZ"; a fresh
  socket per server) with its monitor, and a fresh DEALER on P per snapshot request;
* ``clonemap.client.incoming.Incoming``: the snapshot (or resume) being received on that DEALER;
* ``clonemap.client.writes.ShardWrites``: one XPUB per server to its P+2 collector, the echoes and
  replies awaited, the resends after an outage;
* ``clonemap.client.outages.Outages``: failovers and data losses, reported to the application.

Hot path: a KVPUB is one ``decode_update``, one ``check_seq`` and one dict store, applied
here (``_apply``); only the exceptions go to the machine (``Gap``,
``SequenceBackwards``). While the machine says ``buffering``, SUB messages are kept raw
in a bounded buffer and replayed after the install. A discarded KVPUB (12/CHP: not
greater than the last applied) at most the installed snapshot's sequence is a late copy
(``skipped``); one above it means the stream went backwards (``stale``, a resync).

HUGZ read before they are applied (the first message after a handshake, or while
buffering) are peeked at: what the server says of itself (``serving``, ``gen``, ``cas``,
``route``) goes to the link and the machine at once. Lag (the guide's Suicidal Snail):
each clock HUGZ read live goes to the ``LagMeter`` (``clonemap.client.lag``); above ``max_lag_s``
the agent asks ``on_lag(agent, lag_s)`` (True: handled, e.g. policy "die") or resyncs
(``FellBehind``): once per episode, and only when the backlog (the lag times the
publisher's rate, from the same HUGZ) outnumbers the keys a snapshot would send. Snapshots and updates are decoded liberally (``strict=False``): the
guide's reference C server's dialect works.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Sequence

import zmq

from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import chp
from clonemap.client import shard_machine as sm
from clonemap.shards.common.security import Security
from clonemap.client.collector import ServerAddress, parse_server
from clonemap.client.lag import LagMeter
from clonemap.client.incoming import Incoming
from clonemap.client.link import Link
from clonemap.client.outages import Outages
from clonemap.client.writes import ShardWrites
from clonemap.client.options import KEEP, AgentHooks, AgentOptions
from clonemap.client.watch import WatchHub
from clonemap.client.adoption import Adoption

log = logging.getLogger(__name__)

TICK_S = 0.1
REPLAY_BATCH = 4096
PHASE_LOG_MAX = 64

_Hugz = chp.Hugz
_HUGZ_KEY = chp.HUGZ
_STAGED = chp.STAGED
_STAGED_RANGES = chp.STAGED_RANGES
_decode_update = chp.decode_update
_check_seq = sm.check_seq


def _text(key: bytes) -> str | None:
    """A key as ``get`` is given it (UTF-8), or None for bytes that are not UTF-8 (no str
    can name them, so a flat view leaves them out)."""
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


def replace_in_view(view: dict[str, bytes], old: dict[bytes, bytes],
                    new: dict[bytes, bytes], same: dict[bytes, bytes] | None = None) -> None:
    """One shard's keys in a flat view go from ``old`` to ``new`` (a snapshot installed):
    the keys it lost leave, and the keys whose value is not the very object ``old``
    held are set (a resume's map is a copy of ``old`` plus the changes, so only those
    are decoded and set). ``same``: keys that moved here from another shard's part with
    the value the view holds already (resharding): not set again (at 336,160 keys that
    was a third of a second of the client's loop, in one turn)."""
    for key in old:
        if key not in new:
            text = _text(key)
            if text is not None:
                view.pop(text, None)
    was, same = old.get, same or {}
    for key, value in new.items():
        if was(key) is not value and key not in same:
            text = _text(key)
            if text is not None:
                view[text] = value

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
                 security: Security | None = None, route: str = "", relays: bool = False,
                 view: dict[str, bytes] | None = None):
        options = options if options is not None else AgentOptions()
        self.rehome: Callable[[ShardAgent, bytes, bytes], bool] | None = None
        """Set by a client of several shards: a key new to this shard's part that another
        shard's part holds moved here (resharding): it leaves that part; True when the
        value is the one the client held (no event)."""
        self.superseded: Callable[[ShardAgent, bytes], bool] | None = None
        """Set with ``rehome``: whether an update of a key this part does not hold is
        older than the part that holds it (its shard published it before the key moved
        there): it is then not applied."""
        self.rehome_many: Callable[[ShardAgent, dict, dict], dict] | None = None
        """The same for a snapshot installed here: ``(agent, old, new)`` -> the moved
        keys whose value is the one the client held (no event for them)."""
        self.rehome_installs = False
        """Snapshots installed here are checked for keys that moved here too (set once
        the client's routing changed: a snapshot of a shard it did not follow before)."""
        self.moved_snapshot: Callable[[dict, int], None] | None = None
        """With ``rehome_installs``: a snapshot installed here may hold writes another
        shard's part waits for (sent there before the client followed the change)."""
        self.moved_echo: Callable[[bytes, int], None] | None = None
        """Set while keys move here: a KVPUB's UUID may be a write another shard's part
        waits for (a held write the old shard forwarded)."""
        self.adopt_claim: Callable[[ShardAgent], tuple[dict[str, tuple[int, int]],
                                                        tuple[ShardAgent, ...]] | None
                                   ] | None = None
        """Set by the client for a shard a routing change added: its first request may be
        an adoption (``adopt=``, the maps the client holds and how far, and the parts that
        hold them), which the shard answers with only the updates after its copy
        (``clonemap.shards.snapshots``)."""
        self.adopt_ready: Callable[[], bool] | None = None
        """With ``adopt_claim``: whether the client's other parts are ready to lend (read
        up to the new routing); until then the first request waits (``release_request``)."""
        self._deferred: sm.RequestSnapshot | None = None
        self.on_adopted: Callable[[ShardAgent], None] | None = None
        """Called once an adoption is installed: the client moves the keys it holds for
        this shard into its part, a chunk per loop turn (``lending`` meanwhile)."""
        self.lending: tuple[ShardAgent, ...] = ()
        """While an adoption's keys move here: the parts that still hold some of them
        (reads that miss this part look there)."""
        self.lent_at: list[tuple[ShardAgent, int]] = []
        """Each part an adoption counts on, with its ``snapshots`` when it was claimed."""
        self.adoption: Adoption | None = None
        """The ``clonemap.client.adoption.Adoption`` moving keys here, while it runs."""
        self.lent_out: Callable[[ShardAgent], None] | None = None
        """Called before a snapshot replaces this part's map while another part adopts
        keys from it: they move there first."""
        self.epoch_seen = 0
        """The latest routing epoch a HUGZ applied in stream order named: every update
        its server published before it follows that routing is applied here."""
        self.on_epoch: Callable[[ShardAgent], None] | None = None
        """Called when ``epoch_seen`` grows (an adoption waits on its lenders' streams)."""
        self.part_epoch = 0
        """The routing epoch this part's server followed when it sent the whole snapshot
        the part was last built from (0: not said). Forgetting what moved away begins
        only past that epoch, so such a part holds every key it was given."""
        self.view = view
        """The client's flat read view (every shard's keys as ``str`` -> value), which
        this agent keeps current for its keys beside ``map``; None: none kept (a codec
        that decodes, or a client that failed)."""
        hooks = hooks if hooks is not None else AgentHooks()
        self.options = options
        """How this agent follows its shard (``clonemap.client.options.AgentOptions``)."""
        if not servers:
            raise ValueError(f"shard {name}: no servers")
        self.relays = relays
        """The servers are relays of the shard (each forwards a KVSET to both servers of
        the pair): a KVSET goes to the followed relay only, never twice upstream."""
        self.route = route
        """``I/N/DIGEST`` this client's routing expects of the shard's servers ("" : no
        check); a HUGZ naming another is a wrong config: ``on_wrong_route(agent, theirs)``."""
        self.on_wrong_route = hooks.on_wrong_route
        self.on_read_refused = hooks.on_read_refused
        self.narrowed = False
        """The last snapshot left out keys this client's identity may not read."""
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
        self.clock = clock
        self.affinity = affinity
        """ZMQ_AFFINITY of every socket of this shard: a bit mask of the context's I/O
        threads (0: ZeroMQ chooses). The Black Box pattern: one I/O thread per shard."""
        self.sub_rcvhwm = options.sub_rcvhwm
        self.on_behind = hooks.on_behind
        self.max_lag_s = options.max_lag_s
        self.on_lag = hooks.on_lag
        self.reset_policy = options.reset_policy
        self.outages = Outages(self, hooks.on_failover, hooks.on_reset)
        """Failovers and data losses, reported to the application (``clonemap.client.outages``)."""
        self.props: dict[bytes, bytes] = {}
        """Properties that came with a key (KVPUB or KVSYNC), only for keys that had any."""
        self.seqs: dict[bytes, int] = {}
        """key -> the sequence that last changed it (a KVPUB's, or its KVSYNC's from our
        servers, which send each key's own; the guide's C server sends its own too)."""
        self.incoming = Incoming(self)
        """The snapshot (or resume) being received (``clonemap.client.incoming``)."""
        self.lag = LagMeter()
        """How far behind the publisher this client reads (``clonemap.client.lag``)."""
        self.lagged = 0
        self._behind = False
        """Set at a resync for lag, cleared by the first HUGZ read in time again: one
        resync per episode of falling behind (``_on_hugz``)."""
        self.lag_resyncs_spared = 0
        """HUGZ read late with no resync for it: read again before the client caught up
        since its resync for lag (another snapshot adds to the work it is behind on), or
        its backlog (``LagMeter.backlog``) is fewer updates than the keys it holds (a
        snapshot would be more to read than the updates it skips)."""
        self._reading_on = False
        """A resync for lag was spared for its cost in this episode (logged once)."""
        self.contiguous = not subtree
        self.state = sm.State(options.machine(len(self.servers), self.contiguous))
        self.drops = DropCounter(log)
        self.map: dict[bytes, bytes] = {}
        self.last_seq = 0
        self.snapshot_seq = 0
        """KTHXBAI sequence of the installed snapshot."""
        self.term = 0
        """The Binary Star term of the server whose stream the map holds (its KTHXBAI's or
        HUGZ's ``term=``; 0: none known). Sent with a resume request."""
        self.last_heard_s = 0.0
        """When the SUB last delivered anything (KVPUB or HUGZ), to TICK_S."""
        self.last_snapshot_s = 0.0
        self.heard = 0
        self._heard_at_tick = 0
        self._snapshot_messages_at_tick = 0
        self.synced = False
        # counters
        self.applied = 0
        self.stale = 0
        self.skipped = 0
        self.staged = 0
        """KVPUBs of keys a move staged on this shard, not applied (``chp.STAGED``)."""
        self.superseded_updates = 0
        """Updates of keys that had moved on, not applied (``superseded``)."""
        self.gaps = 0
        self.overflows = 0
        self.snapshots = 0
        self.phase_log: deque[tuple[float, str]] = deque(maxlen=PHASE_LOG_MAX)
        """(time, phase) at start and at each phase change, newest last (bounded)."""
        # internals
        self.loop: asyncio.AbstractEventLoop | None = None
        self._synced_event: asyncio.Event | None = None
        self.link: Link | None = None
        """The SUB, its monitor and the DEALER to the current server (made in start())."""
        self._buffer: deque[list[bytes]] = deque()
        """SUB messages held while ``state.buffering`` (bounded: ``sync_buffer_max``)."""
        self._tick_handle: asyncio.TimerHandle | None = None
        self._closed = False
        self.writes = ShardWrites(
            self.ctx, self.servers, name=self.name, relays=self.relays, drops=self.drops,
            queue_max=self.kvset_queue_max, affinity=self.affinity, security=self.security,
            current=lambda: self.state.server, last_seq=lambda: self.last_seq,
            epoch=lambda: None if self._closed else self.state.epoch)
        """KVSETs out, echoes and replies awaited, resends (``clonemap.client.writes``)."""
        self.echoes = self.writes.echoes  # (read on the hot path)

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
                         on_event=self._on_link_event, security=self.security,
                         take_rows=self.incoming.take_rows)
        if self._synced_event is None:  # (``wait_ready`` may have made it already)
            self._synced_event = asyncio.Event()
        self.writes.start(self.loop)
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
        self.writes.fail_all(self.kept_error())
        if not self._synced_event.is_set():
            self._synced_event.set()

    def kept_error(self) -> Exception:
        from clonemap.client.errors import ShardReset

        info = self.outages.last_reset
        return ShardReset(f"shard {self.name} is read-only: its server lost the data this "
                          f"client keeps ({info.describe()})", shard=self.name, info=info)

    async def wait_ready(self) -> None:
        """Until the first snapshot is installed and replayed, and a collector listens
        (an agent not started yet, an added shard's waiting to adopt: until it is)."""
        if self._synced_event is None:
            self._synced_event = asyncio.Event()
        await self._synced_event.wait()
        await self.writes.connected.wait()

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; ``linger_ms`` lets KVSETs already handed to ZeroMQ out."""
        if self._closed:
            return
        self._closed = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        if self.link is not None:
            self.link.close()
        self.writes.close(linger_ms)

    @property
    def closed(self) -> bool:
        return self._closed

    def _on_snapshot(self, frames: list[bytes]) -> None:
        """A message on the DEALER: the snapshot being received takes it, and says when
        the machine must hear of it (done, rejected)."""
        event = self.incoming.on_message(frames)
        if event is not None:
            self._dispatch(event)

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
                    self.writes.left(effect.new)  # before the application hears of it
                    self.outages.failed_over(effect)
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
        if self.incoming.messages != self._snapshot_messages_at_tick:
            self._snapshot_messages_at_tick = self.incoming.messages
            self.last_snapshot_s = now
        self._dispatch(sm.Tick(self.last_heard_s, self.last_snapshot_s))
        self._tick_handle = self.loop.call_later(TICK_S, self._tick)

    def _connect(self, eff: sm.Connect) -> None:
        self.link.connect(self.servers[eff.server])
        self.writes.connected_to(self.servers[eff.server])
        self._buffer.clear()
        self.lag.reset()

    def _request_snapshot(self, eff: sm.RequestSnapshot) -> None:
        address = self.servers[eff.server]
        # a map installed from one of our servers (it named its generation): the machine
        # asks for a resume, only the updates after ours; the server decides (resume=1
        # or a full snapshot, resume=0). A foreign server never sees the extension.
        # The map's term goes with it: a server resumes only a client whose updates are
        # all in its own map (an active may have published one its passive never got).
        since = self.last_seq if eff.resume else None
        adopt = None
        if since is None and not self.snapshots and self.adopt_claim is not None:
            if self.adopt_ready is not None and not self.may_adopt():
                self._deferred = eff  # (the machine's sync deadline still runs)
                return
            claimed = self.adopt_claim(self) if self.link.cas else None  # (our server)
            if claimed is not None:
                adopt, self.lending = claimed
                self.lent_at = [(o, o.snapshots) for o in self.lending]
        self._deferred = None
        self.link.request_snapshot(address, since, self.generation if since is not None
                                   else "", meta=self.link.cas, term=self.term, adopt=adopt)
        self.incoming.begin(adopting=adopt is not None)
        self._buffer.clear()
        log.info("shard %s: ICANHAZ %r to %s (%s%s)", self.name, self.subtree,
                 address.snapshot, eff.reason,
                 f"; resume after {since}" if since is not None else
                 f"; adoption of {adopt}" if adopt is not None else "")

    def _install_snapshot(self, eff: sm.InstallSnapshot) -> None:
        if self.lent_out is not None:
            self.lent_out(self)  # keys another part adopts from this one go there first
        old = self.map
        adopted, whole = self.incoming.adopted, self.incoming.whole
        new, new_props, new_seqs = self.incoming.take()
        if adopted:
            new = self._adoption_deletes(new, new_props, new_seqs)
        elif whole:
            self.part_epoch = self.incoming.epoch
        self.link.close_dealer()
        outages = self.outages
        first = not self.snapshots
        reset = outages.data_loss(old, new, eff) if not first else None
        if reset is not None:
            if reset.policy == KEEP:
                self.hub.reset(self.name, reset, None, eff.seq, {})
                outages.report_reset(reset)
                self._dispatch(sm.Keep(eff.old_generation))  # -> Freeze
                return
        events_old = old
        moved = None
        if self.rehome_many is not None and self.rehome_installs:
            # keys that moved here from another shard's part: they leave it, and a value
            # the client held already is no event (resharding)
            moved = self.rehome_many(self, old, new)
            if moved and self.hub.watches:
                events_old = {**old, **moved}
            if self.moved_snapshot is not None:  # writes other parts sent, applied here
                self.moved_snapshot(new, eff.seq)
        if self.view is not None:  # (the values before their sequences, as in _apply)
            replace_in_view(self.view, old, new, moved)
        self.map = new
        self.props = new_props
        self.seqs = new_seqs
        self.term = self.incoming.term if self.incoming.term is not None else self.link.term
        self.last_seq = self.snapshot_seq = eff.seq
        self.snapshots += 1
        if reset is not None:
            self.hub.reset(self.name, reset, new, eff.seq, new_seqs)
        else:
            self.hub.installed(self.name, events_old, new, eff.seq, new_seqs)
        log.info("shard %s: snapshot of %d keys at sequence %d from %s%s", self.name,
                 len(new), eff.seq, self.server, " (resync: replaced)" if eff.resync else "")
        if eff.outage is not None:
            outages.resumed(eff.outage, old, new, first)
        self.writes.installed(eff.resend, self.link.cas, self.map, self.last_seq)
        if reset is not None:
            outages.report_reset(reset)
        self.adopt_claim = self.adopt_ready = None  # (the first request only)
        if adopted and self.on_adopted is not None:
            self.on_adopted(self)
        self._replay(self.state.epoch)

    def may_adopt(self) -> bool:
        """The first request may go as an adoption: this shard's server said in a HUGZ
        that it is ours (``cas=1``), and the client's other parts are ready to lend."""
        return bool(self.link.cas) and self.adopt_ready is not None and self.adopt_ready()

    def release_request(self) -> None:
        """Send the first request that waited for the client's other parts to lend."""
        eff, self._deferred = self._deferred, None
        if eff is not None and not self._closed and self.state.phase == sm.SYNCING:
            self._request_snapshot(eff)

    def lenders_intact(self) -> bool:
        """No part an adoption counts on installed a snapshot since it was claimed (one
        from a server that forgets what moved away may lack the keys it lends)."""
        return all(other.snapshots == n for other, n in self.lent_at)

    def _adoption_deletes(self, new: dict, props: dict, seqs: dict) -> dict:
        """An adoption's rows are the updates after the copy: an empty value deleted a
        key the client holds in another part (it leaves it, with a delete event). The
        rest is installed as a snapshot is."""
        gone = [k for k, v in new.items() if not v]
        for key in gone:
            del new[key]
            props.pop(key, None)
            seq = seqs.pop(key, 0)
            for other in self.lending:
                if other.give_up((key,)):
                    if self.view is not None:
                        text = _text(key)
                        if text is not None:
                            self.view.pop(text, None)
                    if self.hub.watches:
                        self.hub.changed(self.name, key, b"", seq)
        return new

    def unavailable(self, within_s: float) -> str:
        """Why no server of this shard served this client lately (``clonemap.client.outages``)."""
        return self.outages.unavailable(within_s)

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
        if info.term:
            link.term = info.term
            if self.state.phase == sm.ACTIVE and not self.state.live and not self.term:
                self.term = info.term  # (the stream we follow is of that term)
        link.cas = info.cas
        if self._deferred is not None and self.may_adopt():
            self.release_request()
        if not info.serving and len(self.servers) > 1:
            self._dispatch(sm.NotServing())
            return True
        if self.state.not_serving:
            self._dispatch(sm.Serving())
        return False

    def give_up(self, keys, props_out: dict[bytes, bytes] | None = None
                ) -> dict[bytes, bytes]:
        """``keys`` moved to another shard's part (resharding): they leave this part's
        map, sequences and properties, with no event; their values, for those held
        (``props_out``: their properties go there)."""
        held, seqs, props = self.map, self.seqs, self.props
        out = {}
        for key in keys:
            value = held.pop(key, None)
            if value is not None:
                out[key] = value
                seqs.pop(key, None)
                prop = props.pop(key, None)
                if prop and props_out is not None:
                    props_out[key] = prop
        return out

    def start_adoption(self, owned) -> None:
        """An adoption was installed: the keys ``owned`` gives this shard (of a list of
        keys, those it owns: ``OwnerCache.owned``) move here from
        ``lending``, a chunk per loop turn (``clonemap.client.adoption``)."""
        if not self.lending:
            self.lent_at = []
            return
        self.adoption = Adoption(self.lending, owned, self._take_adopted, self._adopted)
        self.adoption.start()

    def _take_adopted(self, values: dict[bytes, bytes], props: dict[bytes, bytes]) -> int:
        """Keys another part held for this shard (its copy's values); one this shard
        wrote since keeps that value. How many were taken."""
        mine, my_props = self.map, self.props
        taken = 0
        for key, value in values.items():
            if key not in mine:
                mine[key] = value
                prop = props.get(key)
                if prop:
                    my_props[key] = prop
                taken += 1
        return taken

    def _adopted(self, moved: int) -> None:
        lenders, self.lending, self.lent_at = self.lending, (), []
        self.adoption = None
        log.info("shard %s: adopted %d keys from %s", self.name, moved,
                 ", ".join(o.name for o in lenders))

    def _peek_hugz(self, frames: list[bytes]) -> bool:
        """A HUGZ read before it is applied (not on the hot path): ``_note_hugz``."""
        if len(frames) != 5 or frames[0] != _HUGZ_KEY:
            return False
        try:
            msg = _decode_update(frames, self.limits, strict=False)
        except ProtocolError:
            return False  # counted when applied
        if msg.__class__ is not _Hugz or msg.props.startswith(_STAGED_RANGES):
            return False
        return self._note_hugz(chp.hugz_info(msg))

    def _check_route(self, info: chp.HugzInfo) -> None:
        if (info.route and self.route and info.route != self.route
                and self.on_wrong_route is not None):
            self.on_wrong_route(self, info.route, info.epoch)

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
            if msg.props.startswith(_STAGED_RANGES):  # (in a replay too: a place in the stream)
                self._skip_staged(msg.props)
            elif (msg.props or msg.seq) and not replay:
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
        props = msg.props
        if props and _STAGED in props:
            # a key a move copies here before this shard owns it: the client holds it in
            # its owner's part, and takes it from there when it follows the new routing
            self.staged += 1
            return
        key = msg.key
        if not key.startswith(self.subtree):
            # only through the "HUGZ" subscription's prefix (a key like "HUGZY")
            self.drops.drop("outside_subtree", f"shard {self.name}: KVPUB {key[:60]!r}")
            return
        value = msg.value
        view = self.view
        # the value before its sequence, in the map and in the view: a thread that reads
        # meta() then get() between the two sees a new value with an old sequence (its
        # conditional write conflicts and is tried again), never an old value with the
        # new sequence (which would be accepted, and lose an update)
        quiet = False
        if self.rehome is not None and key not in self.map:  # (``superseded`` is set too)
            if self.superseded(self, key):
                # published by this shard before the key moved on: the key's new shard
                # has sent it since (resharding); only its echo counts
                self.superseded_updates += 1
                if self.echoes:
                    self.echoes.confirm(msg.uuid, self.last_seq)
                if self.moved_echo is not None and msg.uuid:
                    self.moved_echo(msg.uuid, self.last_seq)
                return
            if value:  # new to this shard: if another shard's part holds it, it moved here
                quiet = self.rehome(self, key, value)
        if value:
            self.map[key] = value
            if view is not None:
                text = _text(key)
                if text is not None:
                    view[text] = value
            self.seqs[key] = seq
        else:
            self.map.pop(key, None)
            if view is not None:
                text = _text(key)
                if text is not None:
                    view.pop(text, None)
            self.seqs.pop(key, None)
        if props and value:
            self.props[key] = props
        elif self.props:
            self.props.pop(key, None)
        self.applied += 1
        if self.hub.watches and not quiet:
            self.hub.changed(self.name, key, value, seq)
        if self.echoes:
            self.echoes.confirm(msg.uuid, self.last_seq)
        if self.moved_echo is not None and msg.uuid:
            self.moved_echo(msg.uuid, self.last_seq)

    def _skip_staged(self, props: bytes) -> None:
        """The server published staged updates (``chp.STAGED``) under a key prefix it
        sends to no client, and says their sequences: the stream goes on after
        them (no gap). A range that begins past the next sequence is left to the gap
        rule."""
        for first, last in chp.staged_ranges(props) or ():
            if first - 1 <= self.last_seq < last:
                self.staged += last - self.last_seq
                self.last_seq = last

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
        if info.epoch > self.epoch_seen and self.state.phase == sm.ACTIVE:
            # (in stream order: every update published before it is applied here)
            self.epoch_seen = info.epoch
            if self.on_epoch is not None:
                self.on_epoch(self)
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
        lag_s = self.lag.observe(info.ts, time.time(), info.seq if info.seq >= 0 else None)
        if self.max_lag_s is None or lag_s <= self.max_lag_s:
            self._behind = self._reading_on = False  # caught up: a later lag is another episode
            return
        if self.state.phase != sm.ACTIVE:
            return
        self.lagged += 1
        log.warning("shard %s: %.2f s behind the publisher (max_lag_s %.2f)", self.name,
                    lag_s, self.max_lag_s)
        if self.on_lag is not None and self.on_lag(self, lag_s):
            return
        if self._behind:
            # still behind since the resync for this episode (a client short of CPU,
            # not a backlog to skip): another snapshot would only add to the work
            self.lag_resyncs_spared += 1
            return
        backlog = self.lag.backlog(lag_s)
        if backlog is not None and backlog < len(self.map):
            # reading on is less work than a snapshot of every key held: a resync would
            # only put the client further behind (it is short of CPU, not of updates)
            self.lag_resyncs_spared += 1
            if not self._reading_on:
                self._reading_on = True
                log.info("shard %s: reading on: about %d updates behind, fewer than the "
                         "%d keys a snapshot would send", self.name, backlog, len(self.map))
            return
        self._behind = True
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

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict:
        return {
            "shard": self.name, "server": str(self.server), "phase": self.phase,
            "keys": len(self.map), "last_seq": self.last_seq, "applied": self.applied,
            "stale": self.stale, "skipped": self.skipped, "staged": self.staged,
            "superseded": self.superseded_updates,
            "gaps": self.gaps,
            "overflows": self.overflows, "snapshots": self.snapshots,
            "lag_s": round(self.lag.lag_s, 6),
            "max_lag_seen_s": round(self.lag.max_lag_seen_s, 6),
            "lagged": self.lagged, "lag_resyncs_spared": self.lag_resyncs_spared,
            "disconnects": self.link.disconnects if self.link is not None else 0,
            "generation": self.generation, "term": self.term,
            **self.outages.stats(),
            **self.incoming.stats(),
            "buffered": len(self._buffer),
            **self.writes.stats(),
            "drops": dict(self.drops.counts),
        }
