"""Binary Star: the primary/backup state machine as data plus a pure step function.

``step(machine, event, now) -> (machine, effects)``. Time comes in as ``now`` (float
seconds, monotonic); nothing here reads a clock, touches a socket or logs. The I/O shell
(the shard server) turns what it receives into events and performs the effects:

    event                         where it comes from
    StateMessage (PEER_*)         a decoded state message from the peer's P+3
                                  (shards.common.proto.bstar.decode); its ``state`` picks the event
    Event.CLIENT_REQUEST          an ICANHAZ on the snapshot port: the client's vote
    Event.TICK                    the shell's timer, at least every heartbeat

    effect                        what the shell does
    PublishState(state, term)     publish encode(state_message(machine, sequence)) on P+3
    BecameActive(previous, why)   apply what is still pending, take over the sequence,
                                  serve snapshots and updates
    BecamePassive(previous, why)  take a snapshot from the active, follow its P+1
    AcceptRequest                 answer the ICANHAZ
    RefuseRequest(why)            do not answer it (the client will try the other server)
    Fatal(reason, detail)         log and exit non-zero; the supervisor restarts the
                                  server, which comes back as PRIMARY/BACKUP and goes passive
    SplitBrainSurvived(...)       log it: the peer was told to die, this server carries on
    IgnoredPeer(reason, detail)   count and drop the message (not our pair)

Rules (``TABLE``; rows are this server's state, columns the event)::

    state    PEER_PRIMARY    PEER_BACKUP     PEER_ACTIVE     PEER_PASSIVE    CLIENT_REQUEST
    PRIMARY  fatal: dual     -> ACTIVE (7)   -> PASSIVE      stay (1)        vote (3)
             primary (5)
    BACKUP   stay (7)        fatal: dual     -> PASSIVE      stay (2)        refuse
                             backup (5)
    ACTIVE   stay (4)        stay (4)        dual active (6) stay            accept
    PASSIVE  -> ACTIVE       -> ACTIVE       stay            dual passive(6) vote (3)

    (1) the passive peer holds the data: it takes over when it sees us as PRIMARY, then we
        see it ACTIVE and become passive. Going ACTIVE here would race it.
    (2) the primary goes active when it sees us; we follow when we see it ACTIVE.
    (3) vote: -> ACTIVE and accept if now >= peer_expiry, else refuse (not answered).
    (4) the peer restarted; it sees us ACTIVE and goes passive. The active answers each
        such message at once (PublishState) instead of at its next heartbeat: the
        restarted peer's SUB may have missed the heartbeat before it was connected, and
        it votes itself active once two of its own heartbeats pass without a word from
        us. Without the answer a stall of the active's loop near the end of that window
        is enough for a needless dual active (a restarted primary wins the tie of terms).
    (5) the message's role equals ours, whatever the states: two servers configured with
        the same role can never pair up (they would refuse clients forever), so both exit.
    (6) split brain. With ``Config.split_brain_survivor`` (the default) one side carries
        on (SplitBrainSurvived) and only the other exits (Fatal "dual active" / "dual
        passive"): for dual active the higher (term, is_primary) survives, for dual
        passive the primary. Both sides compute the same answer from values that do not
        move in those states (an active's term is frozen; roles never change). With it
        off, both exit, as in the guide.
    (7) both servers are starting: the one holding the later map goes ACTIVE, the other
        stays and goes PASSIVE when it sees it active. Later means a higher (term,
        sequence) of the map each recovered from disk (``later_state``; the state message
        carries both), the primary winning a tie: with no data, or equal data, the
        primary goes active as in the guide. Terms are not adopted in these two states,
        so the comparison cannot flip while they talk.
    (8) ``needs_peer`` (this server's data directory could not be read and was moved
        aside; it started empty with term 0): it never wins a vote, and at start-up it
        goes ACTIVE only if the peer holds nothing either ((term, sequence) = (0, 0)).
        A PASSIVE one whose peer restarted before the copy was complete goes back to
        PRIMARY/BACKUP, so that the start-up rule (7) makes the peer, which holds the
        data, ACTIVE. ``peer_copied`` ends it once the peer's map is installed and on
        disk.
    (9) ``peer_down``: the supervisor reports that the peer stopped on a disk error or is
        FAILED (it cannot recover by itself). A BACKUP that never heard its primary
        then takes a client's vote like a PASSIVE (after the peer's expiry) instead of
        refusing it, so one broken disk never leaves a shard down while its peer holds
        the map. The copy that serves is the backup's; if the primary held later
        updates, it keeps them in ``dropped-*`` when it comes back and copies the
        backup's map (the crossed-roles rule).
    TICK in any state: PublishState when the heartbeat is due.

Leased mode (``Config.leased``: the pair is coordinated by a lease in etcd, ``clonemap.shards.coord``;
used where the two servers are on different hosts)::

    (L1) every rule above that would make this server ACTIVE instead sets ``wants_lease``
         and leaves the state as it is (a vote is refused: "acquiring the pair's lease");
         the shell acquires while ``lease_wanted``; LEASE_ACQUIRED then makes it ACTIVE.
         A server is ACTIVE only while it holds the lease.
    (L2) LEASE_LOST while ACTIVE -> PASSIVE: the shell fences (it stops acknowledging at
         the lease's deadline, before etcd can hand the lease on) and resynchronises.
    (L3) the lease, not a term, settles dual active: the holder carries on, the other
         goes PASSIVE; nobody exits. Hearing the peer ACTIVE withdraws ``wants_lease``.
    (L4) dual passive (both fenced, e.g. after etcd was unreachable): the server with
         the later map (``later_state`` on the live sequence, ``with_sequence``) wants
         the lease; nobody exits.
    (L5) a restarted server (PRIMARY/BACKUP) that holds a map (term or sequence not 0,
         not ``needs_peer``) and hears its peer PASSIVE wants the lease too, but only
         where etcd's alone record names it (``lease_if_alone``: the shell's acquire
         fails otherwise). Rule (1) expects the passive to take over, and it tries, but
         the record written by this server's last run, which acknowledged writes the
         passive may lack, bars it: without L5 the primary waits for the passive and
         the passive for the lease, and the shard has no active (found across hosts).
         Where the record is absent or names the peer, nothing changes: the passive
         takes over as before.

Decisions the architecture leaves open:

* peer_expiry = now + 2 x the heartbeat the *peer* advertises in its message (it is the
  rate the peer publishes at; a pair with different heartbeats does not flap). A new
  machine starts with peer_expiry = start + 2 x its own heartbeat: a restarted primary
  waits two heartbeats to hear an already-active backup before a vote can make it active
  (else a client's vote right after a restart would cause a needless dual active).
* term: how many takeovers this server knows of. A server that becomes ACTIVE takes
  max(known) + 1; a PASSIVE server (or one going passive) adopts any higher term it
  hears. A durable server starts with the term it persisted (``clonemap.shards.persist``). The side that took
  over most recently has the higher term, so after a freeze (SIGSTOP/SIGCONT) or a healed
  partition the stale active exits and the one the clients moved to keeps the data. Both
  exiting (the guide's rule) would restart both empty and lose the shard's data.
* A state change is published at once (and the heartbeat timer restarts), not only at
  the next heartbeat: the peer follows in milliseconds instead of up to a second.
* A message naming another shard (both names non-empty) is ignored: it neither refreshes
  peer_expiry nor changes state (IgnoredPeer, for the drop counter).
* After Fatal the machine is inert: events change nothing, votes are refused, nothing is
  published. The shell exits.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Union

from clonemap.shards.common.proto.bstar import Role, State, StateMessage
from clonemap.shards.common.timing import HEARTBEAT_S

PEER_EXPIRY_HEARTBEATS = 2


class Event(enum.Enum):
    PEER_PRIMARY = "PEER_PRIMARY"
    PEER_BACKUP = "PEER_BACKUP"
    PEER_ACTIVE = "PEER_ACTIVE"
    PEER_PASSIVE = "PEER_PASSIVE"
    CLIENT_REQUEST = "CLIENT_REQUEST"
    TICK = "TICK"
    LEASE_ACQUIRED = "LEASE_ACQUIRED"
    LEASE_LOST = "LEASE_LOST"


PEER_EVENT = {State.PRIMARY: Event.PEER_PRIMARY, State.BACKUP: Event.PEER_BACKUP,
              State.ACTIVE: Event.PEER_ACTIVE, State.PASSIVE: Event.PEER_PASSIVE}


class Rule(enum.Enum):
    STAY = "stay"
    TO_ACTIVE = "-> ACTIVE"
    TO_PASSIVE = "-> PASSIVE"
    VOTE = "vote"
    ACCEPT = "accept"
    REFUSE = "refuse"
    INCONSISTENT = "ignore: inconsistent state"
    DUAL_ACTIVE = "dual active"
    DUAL_PASSIVE = "dual passive"


_S, _E, _R = State, Event, Rule
TABLE: dict[tuple[State, Event], Rule] = {
    (_S.PRIMARY, _E.PEER_PRIMARY): _R.INCONSISTENT,
    (_S.PRIMARY, _E.PEER_BACKUP): _R.TO_ACTIVE,
    (_S.PRIMARY, _E.PEER_ACTIVE): _R.TO_PASSIVE,
    (_S.PRIMARY, _E.PEER_PASSIVE): _R.STAY,
    (_S.PRIMARY, _E.CLIENT_REQUEST): _R.VOTE,
    (_S.BACKUP, _E.PEER_PRIMARY): _R.STAY,
    (_S.BACKUP, _E.PEER_BACKUP): _R.INCONSISTENT,
    (_S.BACKUP, _E.PEER_ACTIVE): _R.TO_PASSIVE,
    (_S.BACKUP, _E.PEER_PASSIVE): _R.STAY,
    (_S.BACKUP, _E.CLIENT_REQUEST): _R.REFUSE,
    (_S.ACTIVE, _E.PEER_PRIMARY): _R.STAY,
    (_S.ACTIVE, _E.PEER_BACKUP): _R.STAY,
    (_S.ACTIVE, _E.PEER_ACTIVE): _R.DUAL_ACTIVE,
    (_S.ACTIVE, _E.PEER_PASSIVE): _R.STAY,
    (_S.ACTIVE, _E.CLIENT_REQUEST): _R.ACCEPT,
    (_S.PASSIVE, _E.PEER_PRIMARY): _R.TO_ACTIVE,
    (_S.PASSIVE, _E.PEER_BACKUP): _R.TO_ACTIVE,
    (_S.PASSIVE, _E.PEER_ACTIVE): _R.STAY,
    (_S.PASSIVE, _E.PEER_PASSIVE): _R.DUAL_PASSIVE,
    (_S.PASSIVE, _E.CLIENT_REQUEST): _R.VOTE,
}
del _S, _E, _R


# ------------------------------------------------------------------------- machine

@dataclass(frozen=True, slots=True)
class Config:
    role: Role
    heartbeat_s: float = HEARTBEAT_S
    shard: str = ""
    split_brain_survivor: bool = True
    leased: bool = False
    """The pair is coordinated through a lease (``clonemap.shards.coord``): see *Leased mode*."""

    def __post_init__(self):
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s!r}")


@dataclass(frozen=True, slots=True)
class Machine:
    config: Config
    state: State
    peer_expiry: float
    next_publish_at: float
    term: int = 0
    data_seq: int = 0                 # the sequence of the map recovered at start
    peer_state: State | None = None   # last state heard from the peer, for status
    fatal: str = ""                   # the reason once a Fatal was returned
    needs_peer: bool = False
    """This server lost its map (an unreadable data directory, moved aside) and holds
    nothing valid until it has copied its peer's: see ``NEEDS_PEER``."""
    peer_down: bool = False
    """The supervisor reports the peer down and not coming back by itself (it stopped
    on a disk error, or is FAILED): a BACKUP then takes a client's vote (rule 9). Any
    message from the peer ends it."""
    lease_held: bool = False
    """Leased mode: the shell reports that this server holds the pair's lease."""
    wants_lease: bool = False
    """Leased mode: a rule would make this server ACTIVE; it becomes so only once the
    lease is acquired (the shell tries while this is set, or while ACTIVE)."""
    wants_because: str = ""
    lease_if_alone: bool = False
    """Leased mode (L5): the lease is wanted only where etcd's alone record names this
    server; the shell's acquire fails otherwise."""


def new_machine(role: Role, now: float, heartbeat_s: float = HEARTBEAT_S, shard: str = "",
                split_brain_survivor: bool = True, term: int = 0,
                data_seq: int = 0, needs_peer: bool = False,
                leased: bool = False) -> Machine:
    """A server that has just started: PRIMARY or BACKUP, peer not yet heard. ``term``
    and ``data_seq`` describe the map it recovered from disk (0 for none); ``needs_peer``:
    it recovered none it can trust (see ``NEEDS_PEER``)."""
    config = Config(Role(role), heartbeat_s, shard, split_brain_survivor, leased)
    state = _start_state(config)
    return Machine(config, state, peer_expiry=now + PEER_EXPIRY_HEARTBEATS * heartbeat_s,
                   next_publish_at=now, term=0 if needs_peer else term,
                   data_seq=0 if needs_peer else data_seq, needs_peer=needs_peer)


def _start_state(config: Config) -> State:
    return State.PRIMARY if config.role is Role.PRIMARY else State.BACKUP


def peer_reported_down(machine: Machine) -> Machine:
    """The supervisor says the peer cannot serve now (rule 9)."""
    return replace(machine, peer_down=True)


def peer_copied(machine: Machine) -> Machine:
    """The shell has installed (and persisted) the active peer's whole map: this server
    holds a valid copy again and the ``NEEDS_PEER`` rules end."""
    return replace(machine, needs_peer=False)


def lease_wanted(machine: Machine) -> bool:
    """Leased mode: whether the shell must hold (or try to acquire) the lease now."""
    return machine.config.leased and not machine.fatal and (
        machine.state is State.ACTIVE or machine.wants_lease)


def lease_if_alone(machine: Machine) -> bool:
    """Leased mode (L5): whether the lease is wanted only where the alone record names
    this server."""
    return lease_wanted(machine) and machine.state is not State.ACTIVE \
        and machine.lease_if_alone


def with_sequence(machine: Machine, seq: int) -> Machine:
    """Leased mode: the shell's current sequence, for the dual-passive rule (L4)."""
    return machine if machine.data_seq == seq else replace(machine, data_seq=seq)


def later_state(m: Machine, msg: StateMessage) -> bool:
    """Both servers are starting (PRIMARY/BACKUP): whether this one holds the later map,
    by (term, sequence), the primary winning a tie. Both sides compute the same answer:
    neither value moves before one of them goes ACTIVE."""
    mine, theirs = (m.term, m.data_seq), (msg.term, msg.sequence)
    return mine >= theirs if m.config.role is Role.PRIMARY else mine > theirs


def state_message(machine: Machine, sequence: int = 0) -> StateMessage:
    """What to publish on P+3 now (encode it with shards.common.proto.bstar.encode)."""
    c = machine.config
    return StateMessage(machine.state, c.role, c.heartbeat_s, machine.term, sequence, c.shard)


def peer_alive(machine: Machine, now: float) -> bool:
    return now < machine.peer_expiry


def would_accept(machine: Machine, now: float) -> bool:
    """Whether a CLIENT_REQUEST at ``now`` would be accepted (answered), without stepping:
    ACTIVE, or a vote that would win because the peer has been silent past its expiry.
    In leased mode such a vote starts the acquire (L1) and is answered once the lease is
    held: the HUGZ still say ``serving=1`` so that clients keep voting here."""
    if machine.fatal:
        return False
    rule = TABLE[(machine.state, Event.CLIENT_REQUEST)]
    votes = rule is Rule.VOTE or (rule is Rule.REFUSE and machine.peer_down)
    return rule is Rule.ACCEPT or (votes and now >= machine.peer_expiry
                                   and not machine.needs_peer)


def next_wakeup(machine: Machine) -> float:
    """When the shell must deliver the next TICK at the latest."""
    return machine.next_publish_at


# ------------------------------------------------------------------------- effects

@dataclass(frozen=True, slots=True)
class PublishState:
    state: State
    term: int


@dataclass(frozen=True, slots=True)
class BecameActive:
    previous: State
    reason: str
    term: int


@dataclass(frozen=True, slots=True)
class BecamePassive:
    previous: State
    reason: str


@dataclass(frozen=True, slots=True)
class AcceptRequest:
    pass


@dataclass(frozen=True, slots=True)
class RefuseRequest:
    reason: str


@dataclass(frozen=True, slots=True)
class Fatal:
    reason: str        # "dual active" | "dual passive" | "dual primary" | "dual backup"
    detail: str


@dataclass(frozen=True, slots=True)
class SplitBrainSurvived:
    reason: str        # "dual active" | "dual passive"
    detail: str


@dataclass(frozen=True, slots=True)
class IgnoredPeer:
    reason: str        # "wrong shard" | "inconsistent state"
    detail: str


Effect = Union[PublishState, BecameActive, BecamePassive, AcceptRequest, RefuseRequest, Fatal,
               SplitBrainSurvived, IgnoredPeer]
EventLike = Union[StateMessage, Event]


def event_of(event: EventLike) -> Event:
    if isinstance(event, Event):
        return event
    return PEER_EVENT[State(event.state)]


# ------------------------------------------------------------------------- step

def step(machine: Machine, event: EventLike, now: float) -> tuple[Machine, list[Effect]]:
    """Apply one event at time ``now``; returns the new machine and the effects, in the
    order the shell must perform them."""
    kind = event_of(event)
    if kind is Event.TICK:
        return _tick(machine, now)
    if machine.fatal:
        return machine, ([RefuseRequest(f"fatal: {machine.fatal}")]
                         if kind is Event.CLIENT_REQUEST else [])
    if kind is Event.CLIENT_REQUEST:
        return _client_request(machine, now)
    if kind is Event.LEASE_ACQUIRED or kind is Event.LEASE_LOST:
        return _lease(machine, kind, now)
    return _peer(machine, event, kind, now)


def _tick(m: Machine, now: float) -> tuple[Machine, list[Effect]]:
    if m.fatal or now < m.next_publish_at:
        return m, []
    return _publish_now(m, now)


def _publish_now(m: Machine, now: float) -> tuple[Machine, list[Effect]]:
    """Publish this server's state now; the next heartbeat is one interval later."""
    return (replace(m, next_publish_at=now + m.config.heartbeat_s),
            [PublishState(m.state, m.term)])


def _to_active(m: Machine, now: float, reason: str) -> tuple[Machine, list[Effect]]:
    if m.config.leased and not m.lease_held:  # (L1): only through the lease
        return replace(m, wants_lease=True, wants_because=reason, lease_if_alone=False), []
    previous = m.state
    m = replace(m, state=State.ACTIVE, term=m.term + 1,
                next_publish_at=now + m.config.heartbeat_s, lease_if_alone=False)
    return m, [BecameActive(previous, reason, m.term), PublishState(m.state, m.term)]


def _to_passive(m: Machine, now: float, reason: str) -> tuple[Machine, list[Effect]]:
    previous = m.state
    m = replace(m, state=State.PASSIVE, next_publish_at=now + m.config.heartbeat_s,
                wants_lease=False, wants_because="", lease_if_alone=False)
    return m, [BecamePassive(previous, reason), PublishState(m.state, m.term)]


def _client_request(m: Machine, now: float) -> tuple[Machine, list[Effect]]:
    rule = TABLE[(m.state, Event.CLIENT_REQUEST)]
    if rule is Rule.ACCEPT:
        return m, [AcceptRequest()]
    if rule is Rule.REFUSE and not m.peer_down:
        return m, [RefuseRequest("backup: waiting for the primary")]
    # Rule.VOTE
    if m.needs_peer:
        return m, [RefuseRequest("this server lost its map: it serves only after copying "
                                 "its peer's")]
    if now < m.peer_expiry:
        return m, [RefuseRequest(f"peer may be alive for {m.peer_expiry - now:.3f} s more")]
    why = "failover: peer silent, client vote" if m.state is State.PASSIVE else \
        "client vote, the peer reported down" if m.state is State.BACKUP else \
        "client vote, no peer heard"
    m, effects = _to_active(m, now, why)
    if m.state is not State.ACTIVE:  # (L1): acquiring the lease first
        return m, [RefuseRequest("acquiring the pair's lease")]
    effects.append(AcceptRequest())
    return m, effects


def _lease(m: Machine, kind: Event, now: float) -> tuple[Machine, list[Effect]]:
    if kind is Event.LEASE_LOST:
        m = replace(m, lease_held=False)
        if m.state is State.ACTIVE:  # (L2): fenced
            return _to_passive(m, now, "lease lost: it may pass to the peer")
        return m, []
    m = replace(m, lease_held=True)
    if m.wants_lease and m.state is not State.ACTIVE:
        return _to_active(m, now, f"lease acquired ({m.wants_because})")
    return m, []


_START_UP = {(State.PRIMARY, Event.PEER_BACKUP), (State.BACKUP, Event.PEER_PRIMARY)}


def _rank(term: int, role: Role) -> tuple[int, bool]:
    return term, role is Role.PRIMARY


def _peer(m: Machine, msg: StateMessage, kind: Event,
          now: float) -> tuple[Machine, list[Effect]]:
    c = m.config
    if c.shard and msg.shard and msg.shard != c.shard:
        return m, [IgnoredPeer("wrong shard", f"state from shard {msg.shard!r}, this server "
                                              f"serves {c.shard!r}")]
    peer_role, peer_state = Role(msg.role), State(msg.state)
    if peer_role is c.role:
        name = c.role.name.lower()
        return replace(m, fatal=f"dual {name}", peer_state=peer_state), [
            Fatal(f"dual {name}", f"the peer is also configured as {name} "
                                  f"(check --primary/--backup)")]
    rule = TABLE[(m.state, kind)]
    if rule is Rule.INCONSISTENT:  # PRIMARY from a backup or BACKUP from a primary
        return m, [IgnoredPeer("inconsistent state", f"{peer_state.name} from the "
                                                     f"{peer_role.name.lower()}")]
    m = replace(m, peer_expiry=now + PEER_EXPIRY_HEARTBEATS * msg.heartbeat_s,
                peer_state=peer_state, peer_down=False)
    if (m.state, kind) in _START_UP:  # (7): the later map goes active
        rule = Rule.TO_ACTIVE if later_state(m, msg) else Rule.STAY
        if m.needs_peer and (msg.term, msg.sequence) != (0, 0):
            rule = Rule.STAY  # (8): the peer holds data, this server holds none it trusts
    elif m.needs_peer and rule is Rule.TO_ACTIVE:  # (8): a passive without a copy yet
        start = _start_state(c)
        return replace(m, state=start, next_publish_at=now + c.heartbeat_s), [
            PublishState(start, m.term)]
    if (m.state is State.PASSIVE or rule is Rule.TO_PASSIVE) and msg.term > m.term:
        m = replace(m, term=msg.term)
    if c.leased:
        if peer_state is State.ACTIVE and m.wants_lease and m.state is not State.ACTIVE:
            m = replace(m, wants_lease=False, wants_because="",
                        lease_if_alone=False)  # (L3): it serves
        if rule is Rule.DUAL_ACTIVE:  # (L3): the lease decides, nobody exits
            if m.lease_held:
                return m, [SplitBrainSurvived("dual active", "this server holds the lease")]
            return _to_passive(m, now, "peer is active and this server holds no lease")
        if (m.state in (State.PRIMARY, State.BACKUP) and peer_state is State.PASSIVE
                and not m.wants_lease and not m.needs_peer
                and (m.term, m.data_seq) != (0, 0)):  # (L5)
            return replace(m, wants_lease=True, lease_if_alone=True,
                           wants_because="the passive peer does not take over: this "
                                         "server's last run may have gone on alone"), []
        if rule is Rule.DUAL_PASSIVE:  # (L4): nobody serves; the later map asks
            if later_state(m, msg) and not m.needs_peer:
                return _to_active(m, now, "both passive: this server holds the later map")
            return m, []
    if rule is Rule.STAY:
        if m.state is State.ACTIVE and peer_state in (State.PRIMARY, State.BACKUP):
            return _publish_now(m, now)  # (4): answer a restarted peer at once
        return m, []
    if rule is Rule.TO_ACTIVE:
        return _to_active(m, now, f"peer restarted ({kind.name})")
    if rule is Rule.TO_PASSIVE:
        return _to_passive(m, now, "peer is active")
    # Rule.DUAL_ACTIVE / Rule.DUAL_PASSIVE: split brain
    reason = rule.value
    if rule is Rule.DUAL_ACTIVE:  # terms are frozen while active: both sides see the same
        mine, theirs = _rank(m.term, c.role), _rank(msg.term, peer_role)
    else:  # passive terms drift by adoption; the role alone is symmetric
        mine, theirs = _rank(0, c.role), _rank(0, peer_role)
    detail = (f"both servers {m.state.name}: this {c.role.name.lower()} term {m.term}, "
              f"peer term {msg.term}")
    if c.split_brain_survivor and mine > theirs:
        return m, [SplitBrainSurvived(reason, detail + "; the peer exits")]
    return replace(m, fatal=reason), [Fatal(reason, detail)]
