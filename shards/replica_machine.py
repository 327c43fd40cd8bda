"""The passive server's synchronisation, pure: ``step(state, event, now) -> (state, effects)``.

No sockets, no clock, no store: time comes in as ``now``, decisions go out as effects that
the I/O shell (``clonemap.shards.replica.Follower``) performs. The shell keeps the data (the
buffered KVPUBs, the TTL table, the store being built) and this module keeps the rules.

Phases::

    IDLE --StartSync--> SYNCING(TTL) --TtlChunk(last)--> SYNCING(SNAPSHOT) --SnapshotDone--> LIVE
                          ^    |                               |                              |
                          |    +---- a fault: RETRY (one retry_s later: StartSync again) -----+
                          +---------------------------- Gap (not while taking over) ----------+

* **SYNCING(TTL)**: ``BSTAR-TTL?`` is out on a fresh DEALER. The active answers with its
  absolute expiries, a point-in-time copy at its sequence T, in chunks; every chunk must
  name the same T. The last chunk moves on: ``ICANHAZ?`` (``RequestSnapshot``).
* **SYNCING(SNAPSHOT)**: the snapshot streams (KVSYNC*, taken at the active's sequence
  S >= T); a KVSYNC before the TTL table is done is a fault. At ``SnapshotDone(S)`` the
  shell's buffered KVPUBs must hold every sequence T+1..S exactly (``check_span``): those
  are the keys rewritten between the two copies, whose expiry the table does not know.
  Then ``Install(T, S)`` and LIVE at S; the buffered KVPUBs after S follow through the
  live rule.
* **LIVE**: the shell applies each KVPUB itself with ``check_seq`` (the hot path is not an
  event); only a ``Gap`` comes back here, and starts the sync over (while taking over,
  it stops following instead: what follows a gap cannot be applied).
* **RETRY** (inside SYNCING): after a fault (no reply for ``sync_timeout_s``, two TTL
  tables, a chunk after the last, a snapshot before the table, a malformed reply, an
  overflowing buffer, a span not all heard), the link is dropped (``Abandon``) and the
  sync starts over ``retry_s`` later on a fresh DEALER.

``Stop`` (the server is taking over) returns to IDLE from any phase.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence, Union

IDLE, SYNCING, LIVE = "idle", "syncing", "live"
TTL, SNAPSHOT, RETRY = "ttl", "snapshot", "retry"

# check_seq verdicts (live KVPUBs)
APPLY, DUPLICATE, GAP = 0, 1, 2


def check_seq(have: int, got: int) -> int:
    """A live KVPUB with sequence ``got`` on a replica at ``have``: the next one is
    applied, an older one is a duplicate (ignored), a later one means updates were lost."""
    if got <= have:
        return DUPLICATE
    return APPLY if got == have + 1 else GAP


def check_span(ttl_seq: int, snap_seq: int, buffered: Sequence[int]) -> str:
    """"" if the buffered sequences hold exactly T+1..S in order, else why not."""
    between = [q for q in buffered if ttl_seq < q <= snap_seq]
    if len(between) != snap_seq - ttl_seq or any(
            q != ttl_seq + 1 + i for i, q in enumerate(between)):
        return (f"updates {ttl_seq + 1}..{snap_seq} not all heard "
                f"({len(between)} buffered)")
    return ""


@dataclass(frozen=True, slots=True)
class Config:
    sync_timeout_s: float
    """No reply from the active for this long: start over."""
    retry_s: float
    """Pause before starting over after a fault (one heartbeat)."""


@dataclass(frozen=True, slots=True)
class State:
    config: Config
    phase: str = IDLE
    step: str = ""
    """SYNCING: TTL, SNAPSHOT or RETRY."""
    since_s: float = 0.0
    """When the current request went out (SYNCING) or the pause began (RETRY)."""
    ttl_seq: int | None = None
    """T: the sequence of the TTL table being received."""
    seq: int = 0
    """LIVE: the sequence the replica was installed at (the shell's store moves on)."""


# ------------------------------------------------------------------------------ events

class StartSync(NamedTuple):
    pass


class TtlChunk(NamedTuple):
    seq: int
    last: bool


class SnapshotItem(NamedTuple):
    """A KVSYNC arrived: the shell asks (``accepts_snapshot``) only when the step is not
    SNAPSHOT, so this event is the fault case, not the hot path."""


class SnapshotDone(NamedTuple):
    seq: int
    buffered: Sequence[int]
    """The sequences of the KVPUBs buffered since the sync began, in arrival order."""


class Malformed(NamedTuple):
    reason: str


class BufferOverflow(NamedTuple):
    limit: int


class Gap(NamedTuple):
    have: int
    got: int
    taking_over: bool = False


class Tick(NamedTuple):
    last_reply_s: float
    """When the last reply (TTL chunk, KVSYNC, KTHXBAI) arrived."""


class Stop(NamedTuple):
    pass


Event = Union[StartSync, TtlChunk, SnapshotItem, SnapshotDone, Malformed, BufferOverflow,
              Gap, Tick, Stop]


# ----------------------------------------------------------------------------- effects

class OpenSync(NamedTuple):
    """Drop the old link and data, empty the pending table, open a fresh DEALER to the
    active's P and send ``BSTAR-TTL?``."""


class RequestSnapshot(NamedTuple):
    """Start building a new store; send ``ICANHAZ?`` "" on the DEALER."""


class Install(NamedTuple):
    """The snapshot is whole: give the keys rewritten in T+1..S the expiry their buffered
    KVPUB carries, set the store's sequence to S, serve it, then replay the buffered
    KVPUBs after S through the live rule."""
    ttl_seq: int
    snap_seq: int


class Abandon(NamedTuple):
    """Close the DEALER and drop the buffer and the store being built."""
    reason: str
    timeout: bool = False


class StopFollowing(NamedTuple):
    """Close the DEALER, drop the buffer; the shard is no longer followed."""
    incomplete: bool
    """The replica was not complete (the server takes over with what it has)."""


Effect = Union[OpenSync, RequestSnapshot, Install, Abandon, StopFollowing]


def accepts_snapshot(state: State) -> bool:
    """Whether a KVSYNC now belongs to the snapshot being built (the shell's hot path)."""
    return state.phase == SYNCING and state.step == SNAPSHOT


def buffering(state: State) -> bool:
    """Whether a KVPUB from the active now waits in the shell's buffer (not applied)."""
    return state.phase == SYNCING and state.step != RETRY


def discarding(state: State) -> bool:
    """Whether a KVPUB from the active is of no use now: the sync was abandoned, and the
    next one opens with an empty buffer (buffered, it held memory for nothing)."""
    return state.phase == SYNCING and state.step == RETRY


# -------------------------------------------------------------------------------- step

def _retry(state: State, now: float, reason: str, timeout: bool = False) -> tuple[State, list]:
    return (replace(state, phase=SYNCING, step=RETRY, since_s=now, ttl_seq=None),
            [Abandon(reason, timeout)])


def _start(state: State, now: float) -> tuple[State, list]:
    return (replace(state, phase=SYNCING, step=TTL, since_s=now, ttl_seq=None),
            [OpenSync()])


def step(state: State, event: Event, now: float) -> tuple[State, list]:
    """Advance ``state`` by ``event`` at ``now``; events that do not apply are ignored."""
    match event:
        case Stop():
            effects = [StopFollowing(state.phase == SYNCING)] if state.phase != IDLE else []
            return replace(state, phase=IDLE, step="", ttl_seq=None), effects
        case StartSync():
            return _start(state, now)
        case Tick(last_reply_s=last_reply_s):
            if state.phase != SYNCING:
                return state, []
            if state.step == RETRY:
                return _start(state, now) if now >= state.since_s + state.config.retry_s \
                    else (state, [])
            if now > max(state.since_s, last_reply_s) + state.config.sync_timeout_s:
                return _retry(state, now, f"no reply for {state.config.sync_timeout_s:g} s",
                              timeout=True)
            return state, []
        case Gap(taking_over=taking_over):
            if state.phase != LIVE:
                return state, []
            if taking_over:  # what follows the gap cannot be applied: stop following
                return replace(state, phase=IDLE, step=""), [StopFollowing(False)]
            return _start(state, now)
    if state.phase != SYNCING or state.step == RETRY:
        return state, []  # replies to an abandoned request, or while not syncing
    match event:
        case TtlChunk(seq=seq, last=last):
            if state.step != TTL:
                return _retry(state, now, "a TTL chunk after the TTL table's last")
            if state.ttl_seq is not None and seq != state.ttl_seq:
                return _retry(state, now, f"TTL chunks of two tables ({state.ttl_seq}, {seq})")
            state = replace(state, ttl_seq=seq)
            if last:
                return replace(state, step=SNAPSHOT, since_s=now), [RequestSnapshot()]
            return state, []
        case SnapshotItem():
            if state.step != SNAPSHOT:
                return _retry(state, now, "snapshot before the TTL table")
            return state, []
        case SnapshotDone(seq=snap_seq, buffered=buffered):
            if state.step != SNAPSHOT:
                return _retry(state, now, "snapshot before the TTL table")
            why = check_span(state.ttl_seq, snap_seq, buffered)
            if why:
                return _retry(state, now, why)
            return (replace(state, phase=LIVE, step="", seq=snap_seq),
                    [Install(state.ttl_seq, snap_seq)])
        case Malformed(reason=reason):
            return _retry(state, now, f"malformed reply ({reason})")
        case BufferOverflow(limit=limit):
            return _retry(state, now, f"more than {limit} updates while the snapshot streamed")
    raise TypeError(f"not a replica event: {event!r}")
