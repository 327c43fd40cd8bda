"""The client's per-shard protocol state machine (12/CHP): data plus one pure step function.

``step(state, event, now) -> (state, effects)``. No sockets, no clock reads, no callbacks:
time comes in as ``now`` (float seconds, monotonic), decisions go out as effects that the
I/O shell (``clonemap.client.agent.ShardAgent``) performs. The link (``clonemap.client.link.Link``) owns the
sockets and reports what it saw as events; the agent applies KVPUBs on its hot path with
``check_seq`` and reports the exceptions. Everything that decides what a shard does next
is here: its phase, which server, the liveness of its subscription, whether it buffers,
whether it resumes, the outage it is in, whether it keeps a lost map read-only.

Phases::

    INITIAL  --SubscriberLive-->  SYNCING  --SnapshotDone(S)-->  ACTIVE
       ^                           |   ^                           |
       |   connect timeout (pair), |   | Gap / SequenceBackwards   |
       |   sync attempts used up   |   +---------------------------+
       +---------------------------+---- silence timeout ----------+
    (any)  --Keep-->  KEPT  (read-only, not followed; every event ignored)

What each event does, by phase (``req``: ``RequestSnapshot`` to the same server and
SYNCING; ``move``: ``Failover`` + ``Connect`` to the next server and INITIAL; "-":
ignored). This is ``TABLE``, the data ``step`` reads, as ``render_table`` prints it (a
test keeps this text equal to it)::

    event               INITIAL                  SYNCING                  ACTIVE
    ------------------  -----------------------  -----------------------  -----------------------
    Start               Connect (once)           -                        -
    Handshake           live="start", ArmGrace   if sub_lost:             as SYNCING
                        (not if not_serving)     live="reconnect",
                                                 ArmGrace (not if
                                                 not_serving)
    Disconnected        sub_lost                 sub_lost                 sub_lost
    LiveProven          the pending live event:  the pending live event:  the pending live event:
                        SubscriberLive or        SubscriberLive or        SubscriberLive or
                        Reconnected              Reconnected              Reconnected
    SubscriberLive      req                      -                        -
                        ("start"/"reconnect")
    Reconnected         resend after the next    resend; req              resend; req
                        install
    NotServing          pair: move; every        pair: move; lone: -      pair: move; lone: -
                        server in a row: hold,
                        then move. Lone: req
                        (its vote)
    Serving             not_serving cleared      not_serving cleared      not_serving cleared
    Tick                hold/connect timeouts    sync timeout: req, then  silence: move
                                                 move after max_attempts
    SnapshotDone        -                        ACTIVE, InstallSnapshot  -
    SnapshotRejected    -                        paced like a timeout     -
    BufferOverflow      -                        req (not counted)        req
    Gap                 -                        -                        req
    FellBehind          -                        -                        req
    SequenceBackwards   -                        -                        req
    NewGeneration       -                        -                        req
    Replayed            buffering ends           buffering ends           buffering ends
    Keep                KEPT, Freeze             KEPT, Freeze             KEPT, Freeze

When does a client resync (ask for a snapshot again)? At ``req`` in that table: a gap in an
unfiltered stream, a sequence that went backwards, a new map generation, falling behind
by time (``max_lag_s``), a buffer overflow, a reconnected SUB, a snapshot timeout. Every
request after the first install of a map whose generation is known asks for a resume
(``RequestSnapshot.resume``; the server may answer with a whole snapshot instead).

The rules, at more length:

* **INITIAL**: the shell has connected a SUB (subscribed to the subtree and "HUGZ") to the
  current server. The snapshot is requested only once the subscription is live: a
  handshake only says the subscription was *sent*, and the server's publisher applies it
  a moment later, so a snapshot point taken in between would lose that moment's updates.
  It counts as live at the SUB's first message (our servers answer each new
  subscription with a HUGZ) or ``LIVE_GRACE_S`` after the handshake (``ArmGrace``, for
  servers that send no welcome), both ``LiveProven``. With more than one server (a Binary
  Star pair), no handshake within ``connect_timeout_s`` moves to the next server.
* **SYNCING**: an ICANHAZ is out on a fresh DEALER; the SUB is drained into the shell's
  bounded buffer (``buffering``). ``SnapshotDone(S)`` (KTHXBAI) installs the snapshot,
  REPLACING the shard's part of the local map, then the buffered KVPUBs with sequence > S
  are applied; ``Replayed`` ends buffering. No snapshot traffic for ``sync_timeout_s``
  re-requests (a passive Binary Star server does not answer); after ``max_attempts``
  requests to one server in a row, the next server (the same one, when there is only
  one). A buffer overflow (in SYNCING, or in ACTIVE while the buffer is still being
  replayed) re-requests at once.
* **ACTIVE**: KVPUBs are applied by the shell's hot path (``check_seq`` is its rule). A
  ``Gap`` (unfiltered subscriptions only) or ``SequenceBackwards`` (a restarted server)
  re-requests a snapshot from the same server, keeping the SUB live. So does
  ``Reconnected`` (in SYNCING too): the SUB's connection broke and ZeroMQ re-established
  it, so updates were missed meanwhile, and the server may have restarted with an empty
  map and a new sequence that a subtree client could not tell apart from a jump; writes
  still awaiting their echo are sent again after the next install (``resend``). Silence
  (no KVPUB, no HUGZ) for ``silence_timeout_s`` fails over to the next server.
* **Failover and outages**: the first move away from a server opens an ``Outage`` (the
  server, when it was last heard, why, how long it was silent); further moves keep it;
  the next install ends it (``InstallSnapshot.outage``: the shell reports the shard
  resumed, with the gap) and resends writes awaiting their echo.
* **SnapshotRejected** (SYNCING): nothing of a snapshot could be applied; treated like a
  snapshot that timed out, and paced like one (asked again after ``sync_timeout_s``,
  then the next server), never a tight loop of requests. **NewGeneration** (ACTIVE): the
  server announced another map generation; resync (the shell reports the data loss when
  it installs).
* **NotServing**, in any phase: the current server said in a HUGZ that it would not
  answer an ICANHAZ now (``serving=0``: a Binary Star server that is passive, or just
  restarted, while its peer serves). With a pair, the shard moves to the next server at
  once instead of waiting for snapshot timeouts. If every server of the pair said so in
  a row (the pair is between states, e.g. both just started), the shard stays, holding
  its SUB, and moves on after ``standby_retry_s``; a HUGZ from the held server that no
  longer says so (``Serving``, then its message proves the subscription live) asks
  there. A handshake with a server that said so arms no grace timer. A lone server
  that says so is asked anyway (the ICANHAZ is its vote).
* **Data loss** (at an install): a snapshot of another generation, or a sequence below
  the last applied, is a loss the shell reports; with ``reset_policy="keep"`` it answers
  ``Keep``, and the shard is KEPT: read-only, its map as it was, nothing followed.
* **Epochs**: every ``Connect`` and ``RequestSnapshot`` starts a new ``epoch``; a replay
  or a resend the shell scheduled in an older one is dropped when it runs.

The hot path (one KVPUB) is not an event: stepping a frozen state per message would cost
more than the message. The shell applies updates itself with ``check_seq`` and reports
only the exceptions (``Gap``, ``SequenceBackwards``) and timestamps (in ``Tick``); it
reads ``state.live`` and ``state.buffering`` to know where a message goes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple, Union

from clonemap.shards.common.timing import SILENCE_TIMEOUT_S

INITIAL = "INITIAL"
SYNCING = "SYNCING"
ACTIVE = "ACTIVE"
KEPT = "KEPT"
"""A shard whose data loss was answered by ``reset_policy="keep"``: read-only, not
followed; every event is ignored."""

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
    resume: bool = True
    """Ask for a resume (the updates after ours) when the installed map's generation is
    known; the server decides whether it can."""

    def __post_init__(self):
        if self.servers < 1:
            raise ValueError("a shard needs at least one server")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


class Outage(NamedTuple):
    """Where a failover began: the server left, when it was last heard (a snapshot
    message counts), why, and how long it had been silent. Kept until the shard serves
    again (``InstallSnapshot.outage``), so a run of moves reports one outage."""
    old: int
    heard_s: float
    reason: str
    silent_s: float


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
    # ---- what the shell's buffer, replay and resends belong to
    epoch: int = 0
    """Bumped by every ``Connect`` and ``RequestSnapshot`` (and by ``Keep``): a replay
    or a resend scheduled in an older epoch is for a link or request that is gone."""
    buffering: bool = True
    """SUB messages go to the shell's buffer (from ``Connect``/``RequestSnapshot`` until
    ``Replayed``), not to the map."""
    resuming: bool = False
    """The request out asks for the updates after ours, not a whole snapshot."""
    generation: str = ""
    """The map generation the installed snapshot came from ("" unknown)."""
    heard_s: float = 0.0
    """When the shard last heard its server (SUB or snapshot), as of the last ``Tick``."""
    outage: Outage | None = None
    resend: bool = False
    """The SUB reconnected (the server may have restarted): after the next install,
    writes still awaiting their echo are sent again."""
    # ---- the subscription's liveness (the link reports, the machine decides)
    live: str = ""
    """What a proof that the subscription is live will mean: ``"start"``
    (``SubscriberLive``), ``"reconnect"`` (``Reconnected``), or "" (nothing pending)."""
    sub_lost: bool = False
    """The SUB lost its connection (until its next handshake)."""
    not_serving: bool = False
    """The current server (of a pair) said ``serving=0`` and has not said otherwise."""


# ------------------------------------------------------------------------------ events

class Start(NamedTuple):
    pass


class SubscriberLive(NamedTuple):
    pass


class SnapshotDone(NamedTuple):
    """A KTHXBAI closed the snapshot (or resume) asked for; ``generation``: the map
    generation the server named ("" : it named none)."""
    seq: int
    generation: str = ""


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


class Serving(NamedTuple):
    """The current server's HUGZ no longer says ``serving=0``."""


class Handshake(NamedTuple):
    """The SUB's handshake with the current server finished."""


class Disconnected(NamedTuple):
    """The SUB lost its connection (ZeroMQ reconnects it)."""


class LiveProven(NamedTuple):
    """The subscription is proven live: its first message after a handshake arrived, or
    ``LIVE_GRACE_S`` passed (``ArmGrace``)."""


class Replayed(NamedTuple):
    """The shell applied its whole buffer: SUB messages go to the map again."""


class Keep(NamedTuple):
    """The snapshot being installed is another map than this client's (a data loss) and
    ``reset_policy`` is "keep": stop following, keep the map of ``generation``."""
    generation: str


class Tick(NamedTuple):
    last_heard_s: float
    """Last KVPUB or HUGZ on the SUB (any phase)."""
    last_snapshot_s: float
    """Last KVSYNC/KTHXBAI on the DEALER."""


Event = Union[Start, SubscriberLive, SnapshotDone, BufferOverflow, Gap, FellBehind,
              SequenceBackwards, Reconnected, NotServing, Serving, SnapshotRejected,
              NewGeneration, Tick, Handshake, Disconnected, LiveProven, Replayed, Keep]


# ----------------------------------------------------------------------------- effects

class Connect(NamedTuple):
    """Drop the current link (SUB, DEALER) and open a SUB to ``server``; start buffering."""
    server: int


class RequestSnapshot(NamedTuple):
    """Open a fresh DEALER to ``server``, send ICANHAZ, clear and keep filling the buffer.
    ``resume``: ask only for the updates after the installed map's sequence."""
    server: int
    reason: str
    resume: bool = False


class InstallSnapshot(NamedTuple):
    """Replace the shard's map with the received snapshot (diff to watchers), set the last
    applied sequence to ``seq``, then replay the buffer (sequence > ``seq`` only).
    ``old_generation`` -> ``generation``: the maps' generations (a data loss when they
    differ; the shell also compares sequences and may answer ``Keep``). ``outage``: the
    failover this install ends (report it resumed). ``resend``: writes awaiting their
    echo are sent again (after a failover or a reconnection)."""
    seq: int
    resync: bool
    generation: str = ""
    old_generation: str = ""
    outage: Outage | None = None
    resend: bool = False


class ArmGrace(NamedTuple):
    """Start (or restart) the ``LIVE_GRACE_S`` timer whose end is ``LiveProven``."""


class Freeze(NamedTuple):
    """Stop following the shard (``Keep``): close the link, fail waiting writes."""


class Failover(NamedTuple):
    """Report: the shard moved from server ``old`` to ``new``; ``passive``: because the
    server said it does not serve (``serving=0``), the normal state of a passive."""
    old: int
    new: int
    reason: str
    silent_s: float
    passive: bool = False


Effect = Union[Connect, RequestSnapshot, InstallSnapshot, Failover, ArmGrace, Freeze]


# -------------------------------------------------------------------------------- step

def _request(state: State, now: float, reason: str) -> tuple[State, list]:
    resume = state.config.resume and state.synced and bool(state.generation)
    return (replace(state, phase=SYNCING, attempts=state.attempts + 1, since_s=now,
                    epoch=state.epoch + 1, buffering=True, resuming=resume),
            [RequestSnapshot(state.server, reason, resume)])


def _connected(state: State, **changes) -> State:
    """A fresh link (``Connect``): nothing buffered belongs to it, nothing is known of
    its subscription or of what its server said."""
    return replace(state, epoch=state.epoch + 1, buffering=True, live="", sub_lost=False,
                   not_serving=False, **changes)


def _move(state: State, now: float, reason: str, silent_s: float,
          standby_streak: int = 0) -> tuple[State, list]:
    """To the next server; ``standby_streak`` > 0 only for moves because servers said
    ``serving=0`` (any other reason to move starts the count again)."""
    new = (state.server + 1) % state.config.servers
    outage = state.outage or Outage(state.server, state.heard_s or now, reason, silent_s)
    return (_connected(state, phase=INITIAL, server=new, attempts=0, since_s=now,
                       holding=False, standby_streak=standby_streak, outage=outage),
            [Failover(state.server, new, reason, silent_s, passive=standby_streak > 0),
             Connect(new)])


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


def _handshake(state: State, event: Handshake, now: float) -> tuple[State, list]:
    if state.phase == INITIAL:
        live = "start"
    elif state.sub_lost:
        state, live = replace(state, sub_lost=False), "reconnect"
    else:
        return state, []
    if state.not_serving:  # its HUGZ said so first: only a later one that does not asks
        return state, []
    return replace(state, live=live), [ArmGrace()]


def _ignored(state: State, event: Event, now: float) -> tuple[State, list]:
    return state, []


def _start(state: State, event: Start, now: float) -> tuple[State, list]:
    if state.started:
        return state, []
    return (_connected(state, started=True, phase=INITIAL, since_s=now),
            [Connect(state.server)])


def _tick(state: State, event: Tick, now: float) -> tuple[State, list]:
    heard_s = max(event.last_heard_s, event.last_snapshot_s)
    if heard_s != state.heard_s:
        state = replace(state, heard_s=heard_s)
    return _on_tick(state, event, now)


def _disconnected(state: State, event: Disconnected, now: float) -> tuple[State, list]:
    return replace(state, sub_lost=True), []


def _live_proven(state: State, event: LiveProven, now: float) -> tuple[State, list]:
    if not state.live:
        return state, []
    proof = SubscriberLive() if state.live == "start" else Reconnected()
    return step(replace(state, live=""), proof, now)


def _serving(state: State, event: Serving, now: float) -> tuple[State, list]:
    return (replace(state, not_serving=False), []) if state.not_serving else (state, [])


def _replayed(state: State, event: Replayed, now: float) -> tuple[State, list]:
    return (replace(state, buffering=False), []) if state.buffering else (state, [])


def _keep(state: State, event: Keep, now: float) -> tuple[State, list]:
    return (replace(state, phase=KEPT, generation=event.generation, epoch=state.epoch + 1,
                    live=""), [Freeze()])


def _subscriber_live(state: State, event: SubscriberLive, now: float) -> tuple[State, list]:
    return _request(replace(state, attempts=0, holding=False), now,
                    "start" if not state.synced else "reconnect")


def _not_serving_event(state: State, event: NotServing, now: float) -> tuple[State, list]:
    if state.config.servers > 1:
        state = replace(state, not_serving=True, live="")
    return _not_serving(state, now)


def _rejected(state: State, event: SnapshotRejected, now: float) -> tuple[State, list]:
    # as if this request had timed out, paced like one: the shell has dropped the
    # reply; after sync_timeout_s the next Tick asks again, or moves on
    return replace(state, since_s=now), []


def _new_generation(state: State, event: NewGeneration, now: float) -> tuple[State, list]:
    return _request(replace(state, attempts=0), now,
                    f"map generation changed ({event.old} -> {event.new})")


def _snapshot_done(state: State, event: SnapshotDone, now: float) -> tuple[State, list]:
    outage = state.outage
    return (replace(state, phase=ACTIVE, attempts=0, since_s=now,
                    snapshot_seq=event.seq, synced=True, standby_streak=0,
                    generation=event.generation, outage=None, resend=False,
                    resuming=False),
            [InstallSnapshot(event.seq, resync=state.synced, generation=event.generation,
                             old_generation=state.generation, outage=outage,
                             resend=outage is not None or state.resend)])


def _overflow(state: State, event: BufferOverflow, now: float) -> tuple[State, list]:
    # not the server's fault: do not count it against the server
    attempts = state.attempts - 1 if state.phase == SYNCING else 0
    return _request(replace(state, attempts=attempts), now,
                    f"sync buffer overflow ({event.buffered} updates)")


def _gap(state: State, event: Gap, now: float) -> tuple[State, list]:
    return _request(replace(state, attempts=0), now,
                    f"sequence gap (expected {event.expected}, got {event.got})")


def _fell_behind(state: State, event: FellBehind, now: float) -> tuple[State, list]:
    return _request(replace(state, attempts=0), now,
                    f"fell behind the publisher by {event.lag_s:.2f} s")


def _backwards(state: State, event: SequenceBackwards, now: float) -> tuple[State, list]:
    return _request(replace(state, attempts=0), now,
                    f"sequence went backwards (last {event.last}, got {event.got})")


def _reconnected(state: State, event: Reconnected, now: float) -> tuple[State, list]:
    state = replace(state, resend=True)  # the server may have restarted
    if state.phase == INITIAL:
        return state, []
    return _request(replace(state, attempts=0), now,
                    "subscriber reconnected (updates missed; server restarted?)")


# --------------------------------------------------------------------------- the table

class Cell(NamedTuple):
    """What an event does in one phase: ``does``, the words of the module doc's table,
    and ``run(state, event, now) -> (state, effects)``."""
    does: str
    run: Callable[[Any, Any, float], tuple[State, list]]


NOTHING = Cell("-", _ignored)
PHASES = (INITIAL, SYNCING, ACTIVE)
"""The table's columns (KEPT ignores every event, and before ``Start`` every event but
``Start`` is ignored: ``step`` says so before it reads the table)."""


def _row(initial: Cell, syncing: Cell = NOTHING, active: Cell = NOTHING) -> dict[str, Cell]:
    return {INITIAL: initial, SYNCING: syncing, ACTIVE: active}


def _all(does: str, run: Callable[[Any, Any, float], tuple[State, list]]) -> dict[str, Cell]:
    cell = Cell(does, run)
    return _row(cell, cell, cell)


TABLE: dict[type, dict[str, Cell]] = {
    Start: _row(Cell("Connect (once)", _start)),
    Handshake: _row(Cell('live="start", ArmGrace (not if not_serving)', _handshake),
                    Cell('if sub_lost: live="reconnect", ArmGrace (not if not_serving)',
                         _handshake),
                    Cell("as SYNCING", _handshake)),
    Disconnected: _all("sub_lost", _disconnected),
    LiveProven: _all("the pending live event: SubscriberLive or Reconnected", _live_proven),
    SubscriberLive: _row(Cell('req ("start"/"reconnect")', _subscriber_live)),
    Reconnected: _row(Cell("resend after the next install", _reconnected),
                      Cell("resend; req", _reconnected), Cell("resend; req", _reconnected)),
    NotServing: _row(Cell("pair: move; every server in a row: hold, then move. Lone: req "
                          "(its vote)", _not_serving_event),
                     Cell("pair: move; lone: -", _not_serving_event),
                     Cell("pair: move; lone: -", _not_serving_event)),
    Serving: _all("not_serving cleared", _serving),
    Tick: _row(Cell("hold/connect timeouts", _tick),
               Cell("sync timeout: req, then move after max_attempts", _tick),
               Cell("silence: move", _tick)),
    SnapshotDone: _row(NOTHING, Cell("ACTIVE, InstallSnapshot", _snapshot_done)),
    SnapshotRejected: _row(NOTHING, Cell("paced like a timeout", _rejected)),
    BufferOverflow: _row(NOTHING, Cell("req (not counted)", _overflow),
                         Cell("req", _overflow)),
    Gap: _row(NOTHING, NOTHING, Cell("req", _gap)),
    FellBehind: _row(NOTHING, NOTHING, Cell("req", _fell_behind)),
    SequenceBackwards: _row(NOTHING, NOTHING, Cell("req", _backwards)),
    NewGeneration: _row(NOTHING, NOTHING, Cell("req", _new_generation)),
    Replayed: _all("buffering ends", _replayed),
    Keep: _all("KEPT, Freeze", _keep),
}
"""What each event does, by phase: the transitions ``step`` performs, and the table of
the module doc (``render_table``; a test keeps the two equal)."""

_EVENT_W, _CELL_W = 18, 23


def render_table() -> str:
    """``TABLE`` as the module doc shows it: an event per row, a phase per column."""
    import textwrap

    lines = [(f"{'event':<{_EVENT_W}}  " + "  ".join(f"{p:<{_CELL_W}}" for p in PHASES)).rstrip(),
             "  ".join("-" * w for w in (_EVENT_W, *(_CELL_W,) * len(PHASES)))]
    for kind, cells in TABLE.items():
        columns = [[kind.__name__]] + [textwrap.wrap(cells[p].does, _CELL_W)
                                       for p in PHASES]
        for i in range(max(map(len, columns))):
            parts = [(c[i] if i < len(c) else "") for c in columns]
            line = f"{parts[0]:<{_EVENT_W}}  " + "  ".join(
                f"{part:<{_CELL_W}}" for part in parts[1:])
            lines.append(line.rstrip())
    return "\n".join(lines)


def step(state: State, event: Event, now: float) -> tuple[State, list]:
    """Advance ``state`` by ``event`` at time ``now``; return the new state and effects,
    as ``TABLE`` says for the event in the current phase ("-": ignored, no effects)."""
    kind = type(event)
    if state.phase == KEPT or (not state.started and kind is not Start):
        return state, []
    cells = TABLE.get(kind)
    if cells is None:
        raise TypeError(f"not a shard machine event: {event!r}")
    return cells[state.phase].run(state, event, now)
