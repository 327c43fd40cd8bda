"""The client's per-shard protocol state machine (12/CHP): data plus one pure step function.

``step(state, event, now) -> (state, effects)``. No sockets, no clock reads, no callbacks:
time comes in as ``now`` (float seconds, monotonic), decisions go out as effects that the
I/O shell (``client.agent.ShardAgent``) performs. Rules of this file:

Phases::

    INITIAL  --SubscriberLive-->  SYNCING  --SnapshotDone(S)-->  ACTIVE
       ^                           |   ^                           |
       |   connect timeout (pair), |   | Gap / SequenceBackwards   |
       |   sync attempts used up   |   +---------------------------+
       +---------------------------+---- silence timeout ----------+

* **INITIAL**: the shell has connected a SUB (subscribed to the subtree and "HUGZ") to the
  current server. The snapshot is requested only once the subscription is live
  (``SubscriberLive``: the SUB's handshake finished, or a message arrived), so updates
  published after the snapshot point are not lost to ZeroMQ's slow-joiner window.
  With more than one server (a Binary Star pair), no handshake within
  ``connect_timeout_s`` moves to the next server.
* **SYNCING**: an ICANHAZ is out on a fresh DEALER; the SUB is drained into the shell's
  bounded buffer. ``SnapshotDone(S)`` (KTHXBAI) installs the snapshot, REPLACING the
  shard's part of the local map, then the buffered KVPUBs with sequence > S are applied.
  No snapshot traffic for ``sync_timeout_s`` re-requests (a passive Binary Star server
  does not answer); after ``max_attempts`` requests to one server in a row, the next
  server (the same one, when there is only one). A buffer overflow (in SYNCING, or in
  ACTIVE while the buffer is still being replayed) re-requests at once.
* **ACTIVE**: KVPUBs are applied by the shell's hot path (``check_seq`` is its rule). A
  ``Gap`` (unfiltered subscriptions only) or ``SequenceBackwards`` (a restarted server)
  re-requests a snapshot from the same server, keeping the SUB live. So does
  ``Reconnected`` (in SYNCING too): the SUB's connection broke and ZeroMQ re-established
  it, so updates were missed meanwhile, and the server may have restarted with an empty
  map and a new sequence that a subtree client could not tell apart from a jump. Silence (no KVPUB,
  no HUGZ) for ``silence_timeout_s`` fails over to the next server (``Failover`` effect).
* **SnapshotRejected** (SYNCING): nothing of a snapshot could be applied; treated like a
  snapshot that timed out, and paced like one (asked again after ``sync_timeout_s``,
  then the next server), never a tight loop of requests. **NewGeneration** (ACTIVE): the server announced another map
  generation; resync (the shell reports the data loss when it installs).
* **NotServing**, in any phase: the current server said in a HUGZ that it would not
  answer an ICANHAZ now (``serving=0``: a Binary Star server that is passive, or just
  restarted, while its peer serves). With a pair, the shard moves to the next server at
  once instead of waiting for snapshot timeouts. If every server of the pair said so in
  a row (the pair is between states, e.g. both just started), the shard stays, holding
  its SUB, and moves on after ``standby_retry_s``; a HUGZ from the held server that no
  longer says so (it became active) is ``SubscriberLive`` and the snapshot is requested
  there. A lone server that says so is asked anyway (the ICANHAZ is its vote).

The hot path (one KVPUB) is not an event: stepping a frozen state per message would cost
more than the message. The shell applies updates itself with ``check_seq`` and reports
only the exceptions (``Gap``, ``SequenceBackwards``) and timestamps (in ``Tick``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Union

from shards.common.timing import SILENCE_TIMEOUT_S

INITIAL = "INITIAL"
SYNCING = "SYNCING"
ACTIVE = "ACTIVE"

SYNC_TIMEOUT_S = 3.0
CONNECT_TIMEOUT_S = 3.0
MAX_ATTEMPTS = 2
STANDBY_RETRY_S = 0.25
"""When every server of a pair said ``serving=0`` in a row: how long to hold before
asking the next one again (a pair settles within a heartbeat)."""

# check_seq verdicts
ACCEPT = 0
STALE = 1
GAP = 2


def check_seq(last_seq: int, seq: int, contiguous: bool) -> int:
    """12/CHP: a KVPUB whose sequence is not strictly greater than the last applied is
    discarded (STALE). With ``contiguous`` (an unfiltered subscription, which sees every
    sequence the server publishes) anything but ``last_seq + 1`` is a GAP: the SUB dropped
    messages. A subtree filter hides other subtrees' sequences, so gaps are normal there."""
    if seq <= last_seq:
        return STALE
    if contiguous and seq != last_seq + 1:
        return GAP
    return ACCEPT


@dataclass(frozen=True, slots=True)
class Config:
    servers: int = 1
    contiguous: bool = True
    sync_timeout_s: float = SYNC_TIMEOUT_S
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    silence_timeout_s: float | None = SILENCE_TIMEOUT_S
    max_attempts: int = MAX_ATTEMPTS
    standby_retry_s: float = STANDBY_RETRY_S

    def __post_init__(self):
        if self.servers < 1:
            raise ValueError("a shard needs at least one server")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


@dataclass(frozen=True, slots=True)
class State:
    config: Config = Config()
    phase: str = INITIAL
    server: int = 0
    started: bool = False
    attempts: int = 0
    """Snapshot requests sent to the current server in a row without a KTHXBAI."""
    since_s: float = 0.0
    """When the current phase, or the current snapshot request, began."""
    snapshot_seq: int = 0
    """KTHXBAI sequence of the last installed snapshot."""
    synced: bool = False
    """At least one snapshot has been installed."""
    standby_streak: int = 0
    """Servers in a row that said ``serving=0`` since the last installed snapshot."""
    holding: bool = False
    """INITIAL on a server that said ``serving=0`` while every other one had too."""


# ------------------------------------------------------------------------------ events

class Start(NamedTuple):
    pass


class SubscriberLive(NamedTuple):
    pass


class SnapshotDone(NamedTuple):
    seq: int


class BufferOverflow(NamedTuple):
    buffered: int


class Gap(NamedTuple):
    expected: int
    got: int


class FellBehind(NamedTuple):
    """The server clock in a HUGZ says this client reads the stream ``lag_s`` late
    (beyond its ``max_lag_s``): resync (policy "resync")."""
    lag_s: float


class SequenceBackwards(NamedTuple):
    last: int
    got: int


class Reconnected(NamedTuple):
    """The SUB's connection was lost and has been re-established (same server)."""


class SnapshotRejected(NamedTuple):
    """A KTHXBAI closed a snapshot of which nothing could be applied (every KVSYNC was
    malformed): not a success. Asked again, then the next server, as for a timeout."""
    reason: str


class NewGeneration(NamedTuple):
    """A HUGZ from the current server names another map generation than the one the
    installed snapshot came from: its map was lost and started over. Resync (the
    install reports the loss)."""
    old: str
    new: str


class NotServing(NamedTuple):
    """The current server's HUGZ said ``serving=0``: it would not answer an ICANHAZ."""


class Tick(NamedTuple):
    last_heard_s: float
    """Last KVPUB or HUGZ on the SUB (any phase)."""
    last_snapshot_s: float
    """Last KVSYNC/KTHXBAI on the DEALER."""


Event = Union[Start, SubscriberLive, SnapshotDone, BufferOverflow, Gap, FellBehind,
              SequenceBackwards, Reconnected, NotServing, SnapshotRejected, NewGeneration,
              Tick]


# ----------------------------------------------------------------------------- effects

class Connect(NamedTuple):
    """Drop the current link (SUB, DEALER) and open a SUB to ``server``; start buffering."""
    server: int


class RequestSnapshot(NamedTuple):
    """Open a fresh DEALER to ``server``, send ICANHAZ, clear and keep filling the buffer."""
    server: int
    reason: str


class InstallSnapshot(NamedTuple):
    """Replace the shard's map with the received snapshot (diff to watchers), set the last
    applied sequence to ``seq``, then replay the buffer (sequence > ``seq`` only)."""
    seq: int
    resync: bool


class Failover(NamedTuple):
    """Report: the shard moved from server ``old`` to ``new``."""
    old: int
    new: int
    reason: str
    silent_s: float


Effect = Union[Connect, RequestSnapshot, InstallSnapshot, Failover]


# -------------------------------------------------------------------------------- step

def _request(state: State, now: float, reason: str) -> tuple[State, list]:
    return (replace(state, phase=SYNCING, attempts=state.attempts + 1, since_s=now),
            [RequestSnapshot(state.server, reason)])


def _move(state: State, now: float, reason: str, silent_s: float,
          standby_streak: int = 0) -> tuple[State, list]:
    """To the next server; ``standby_streak`` > 0 only for moves because servers said
    ``serving=0`` (any other reason to move starts the count again)."""
    new = (state.server + 1) % state.config.servers
    return (replace(state, phase=INITIAL, server=new, attempts=0, since_s=now,
                    holding=False, standby_streak=standby_streak),
            [Failover(state.server, new, reason, silent_s), Connect(new)])


def _not_serving(state: State, now: float) -> tuple[State, list]:
    cfg = state.config
    if cfg.servers == 1:
        # nobody else to ask: the ICANHAZ is this server's vote (answered, or timed out)
        if state.phase == INITIAL:
            return _request(replace(state, attempts=0), now, "start (server not serving)")
        return state, []
    if state.holding:
        return state, []
    streak = state.standby_streak + 1
    if streak >= cfg.servers:
        # every server said so in a row: hold here, try the next one after a pause
        return replace(state, phase=INITIAL, attempts=0, since_s=now, holding=True,
                       standby_streak=streak), []
    return _move(state, now, "server not serving (passive)", 0.0, streak)


def _on_tick(state: State, ev: Tick, now: float) -> tuple[State, list]:
    cfg = state.config
    if state.phase == INITIAL:
        if state.holding:
            if now - state.since_s >= cfg.standby_retry_s:
                return _move(state, now, "every server not serving (passive)",
                             now - state.since_s, state.standby_streak)
            return state, []
        if cfg.servers > 1 and now - state.since_s >= cfg.connect_timeout_s:
            return _move(state, now, "no connection", now - state.since_s)
        return state, []
    if state.phase == SYNCING:
        progress_s = max(state.since_s, ev.last_snapshot_s)
        if now - progress_s < cfg.sync_timeout_s:
            return state, []
        if state.attempts < cfg.max_attempts:
            return _request(state, now, "snapshot timeout")
        return _move(state, now, f"no snapshot after {state.attempts} requests",
                     now - progress_s)
    # ACTIVE
    if cfg.silence_timeout_s is None:
        return state, []
    heard_s = max(state.since_s, ev.last_heard_s)
    if now - heard_s >= cfg.silence_timeout_s:
        return _move(state, now, "silent", now - heard_s)
    return state, []


def step(state: State, event: Event, now: float) -> tuple[State, list]:
    """Advance ``state`` by ``event`` at time ``now``; return the new state and effects.
    Events that do not apply in the current phase are ignored (no effects)."""
    kind = type(event)
    phase = state.phase
    if kind is Tick:
        if not state.started:
            return state, []
        return _on_tick(state, event, now)
    if kind is Start:
        if state.started:
            return state, []
        return (replace(state, started=True, phase=INITIAL, since_s=now),
                [Connect(state.server)])
    if not state.started:
        return state, []
    if kind is SubscriberLive:
        if phase != INITIAL:
            return state, []
        return _request(replace(state, attempts=0, holding=False), now,
                        "start" if not state.synced else "reconnect")
    if kind is NotServing:
        return _not_serving(state, now)
    if kind is SnapshotRejected:
        # as if this request had timed out, paced like one: the shell has dropped the
        # reply; after sync_timeout_s the next Tick asks again, or moves on
        if phase != SYNCING:
            return state, []
        return replace(state, since_s=now), []
    if kind is NewGeneration:
        if phase != ACTIVE:
            return state, []
        return _request(replace(state, attempts=0), now,
                        f"map generation changed ({event.old} -> {event.new})")
    if kind is SnapshotDone:
        if phase != SYNCING:
            return state, []
        return (replace(state, phase=ACTIVE, attempts=0, since_s=now,
                        snapshot_seq=event.seq, synced=True, standby_streak=0),
                [InstallSnapshot(event.seq, resync=state.synced)])
    if kind is BufferOverflow:
        if phase == INITIAL:
            return state, []
        # not the server's fault: do not count it against the server
        attempts = state.attempts - 1 if phase == SYNCING else 0
        return _request(replace(state, attempts=attempts), now,
                        f"sync buffer overflow ({event.buffered} updates)")
    if kind is Gap:
        if phase != ACTIVE:
            return state, []
        return _request(replace(state, attempts=0), now,
                        f"sequence gap (expected {event.expected}, got {event.got})")
    if kind is FellBehind:
        if phase != ACTIVE:
            return state, []
        return _request(replace(state, attempts=0), now,
                        f"fell behind the publisher by {event.lag_s:.2f} s")
    if kind is SequenceBackwards:
        if phase != ACTIVE:
            return state, []
        return _request(replace(state, attempts=0), now,
                        f"sequence went backwards (last {event.last}, got {event.got})")
    if kind is Reconnected:
        if phase == INITIAL:
            return state, []
        return _request(replace(state, attempts=0), now,
                        "subscriber reconnected (updates missed; server restarted?)")
    raise TypeError(f"not a shard machine event: {event!r}")
