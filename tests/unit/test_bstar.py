"""Binary Star through a fake clock and a fake link: two pure machines exchanging encoded
state messages in memory (h11's ConnectionPair idea), plus the P+3 codec.

The link can be cut one way or both, delayed, and a server can be killed, frozen
(SIGSTOP: its input queues up, it neither ticks nor answers) and restarted. Time is a
number; a whole failover scenario runs in milliseconds.
"""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings, strategies as st

from clonemap.shards import bstar
from clonemap.shards.bstar import (AcceptRequest, BecameActive, BecamePassive, Event, Fatal,
                          IgnoredPeer, PublishState, RefuseRequest, Rule, SplitBrainSurvived,
                          TABLE, new_machine, state_message, step)
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import bstar as wire
from clonemap.shards.common.proto.bstar import Role, State, StateMessage

HB = 1.0
DT = 0.05

PRIMARY, BACKUP, ACTIVE, PASSIVE = State.PRIMARY, State.BACKUP, State.ACTIVE, State.PASSIVE


class Server:
    """One server's shell in miniature: feeds events to the machine, keeps its effects."""

    def __init__(self, pair: "Pair", name: str, role: Role):
        self.pair, self.name, self.role = pair, name, role
        self.machine = new_machine(role, pair.now, heartbeat_s=pair.heartbeat[name],
                                   shard=pair.shard[name],
                                   split_brain_survivor=pair.survivor)
        self.inbox: deque[list[bytes]] = deque()
        self.log: list[tuple[float, object]] = []
        self.alive = True
        self.frozen = False

    @property
    def state(self) -> State:
        return self.machine.state

    def feed(self, event) -> list:
        self.machine, effects = step(self.machine, event, self.pair.now)
        for effect in effects:
            self.log.append((self.pair.now, effect))
            if isinstance(effect, PublishState):
                self.pair.publish(self.name, wire.encode(state_message(self.machine, 0)))
            elif isinstance(effect, Fatal):
                self.alive = False  # the process exits
        return effects

    def effects(self, kind) -> list:
        return [e for _, e in self.log if isinstance(e, kind)]


class Pair:
    """Two servers "a" (primary) and "b" (backup) and the links between them."""

    def __init__(self, heartbeat_a: float = HB, heartbeat_b: float = HB, survivor: bool = True,
                 shard_a: str = "s0", shard_b: str = "s0"):
        self.now = 1000.0
        self.heartbeat = {"a": heartbeat_a, "b": heartbeat_b}
        self.shard = {"a": shard_a, "b": shard_b}
        self.survivor = survivor
        self.roles = {"a": Role.PRIMARY, "b": Role.BACKUP}
        self.servers: dict[str, Server | None] = {"a": None, "b": None}
        self.cut = {("a", "b"): False, ("b", "a"): False}
        self.delay_s = {("a", "b"): 0.0, ("b", "a"): 0.0}
        self.wire: list[tuple[float, str, list[bytes]]] = []   # (deliver_at, to, frames)
        self.history: list[Server] = []

    # -- topology
    @staticmethod
    def other(name: str) -> str:
        return "b" if name == "a" else "a"

    def start(self, name: str) -> Server:
        server = Server(self, name, self.roles[name])
        self.servers[name] = server
        self.history.append(server)
        return server

    def kill(self, name: str) -> Server:
        server = self.servers[name]
        server.alive = False
        return server

    def freeze(self, name: str) -> None:
        self.servers[name].frozen = True

    def thaw(self, name: str) -> None:
        self.servers[name].frozen = False

    def partition(self, cut: bool = True) -> None:
        self.cut = {k: cut for k in self.cut}

    def __getitem__(self, name: str) -> Server:
        return self.servers[name]

    # -- the link
    def publish(self, source: str, frames: list[bytes]) -> None:
        link = (source, self.other(source))
        if not self.cut[link]:
            self.wire.append((self.now + self.delay_s[link], link[1], frames))

    def inject(self, to: str, msg: StateMessage) -> None:
        self.wire.append((self.now, to, wire.encode(msg)))

    def _deliver(self) -> None:
        due = [m for m in self.wire if m[0] <= self.now]
        self.wire = [m for m in self.wire if m[0] > self.now]
        for _, to, frames in due:
            server = self.servers[to]
            if server is not None and server.alive:
                server.inbox.append(frames)   # a frozen server's socket still queues

    # -- time
    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = round(self.now + DT, 6)
            self._deliver()
            for server in self.servers.values():
                if server is None or not server.alive or server.frozen:
                    continue
                while server.inbox and server.alive:
                    server.feed(wire.decode(server.inbox.popleft()))
                if server.alive:
                    server.feed(Event.TICK)

    def run_until(self, predicate, limit_s: float = 30.0) -> float:
        """Advance until ``predicate()``; returns the fake time it took."""
        start = self.now
        while not predicate():
            assert self.now - start < limit_s, f"not reached within {limit_s} fake seconds"
            self.advance(DT)
        return self.now - start

    def vote(self, name: str) -> list:
        """A client's ICANHAZ to ``name``: what the server does with it."""
        return self.servers[name].feed(Event.CLIENT_REQUEST)

    def states(self) -> tuple:
        return tuple(s.state if s and s.alive else None for s in
                     (self.servers["a"], self.servers["b"]))


def accepted(effects) -> bool:
    return any(isinstance(e, AcceptRequest) for e in effects)


def refused(effects) -> bool:
    return any(isinstance(e, RefuseRequest) for e in effects) and not accepted(effects)


def up_pair(**kw) -> Pair:
    pair = Pair(**kw)
    pair.start("a")
    pair.start("b")
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE), limit_s=3 * HB)
    return pair


# --------------------------------------------------------------------- the table

def test_table_covers_every_state_and_peer_or_client_event():
    # TICK and the lease's reports (leased mode, rules L1-L4) are not table events
    events = [e for e in Event if e not in (Event.TICK, Event.LEASE_ACQUIRED,
                                            Event.LEASE_LOST)]
    assert set(TABLE) == {(s, e) for s in State for e in events}


def test_table_matches_the_architecture_summary():
    t = TABLE
    assert t[(PRIMARY, Event.PEER_BACKUP)] is Rule.TO_ACTIVE
    assert t[(PRIMARY, Event.PEER_ACTIVE)] is Rule.TO_PASSIVE
    assert t[(PRIMARY, Event.CLIENT_REQUEST)] is Rule.VOTE
    assert t[(BACKUP, Event.PEER_ACTIVE)] is Rule.TO_PASSIVE
    assert t[(BACKUP, Event.CLIENT_REQUEST)] is Rule.REFUSE
    assert t[(ACTIVE, Event.PEER_ACTIVE)] is Rule.DUAL_ACTIVE
    assert t[(PASSIVE, Event.PEER_PRIMARY)] is Rule.TO_ACTIVE
    assert t[(PASSIVE, Event.PEER_BACKUP)] is Rule.TO_ACTIVE
    assert t[(PASSIVE, Event.PEER_PASSIVE)] is Rule.DUAL_PASSIVE
    assert t[(PASSIVE, Event.CLIENT_REQUEST)] is Rule.VOTE


def test_step_is_pure():
    m = new_machine(Role.PRIMARY, 0.0)
    peer = StateMessage(BACKUP, Role.BACKUP, HB)
    m2, effects = step(m, peer, 0.5)
    assert m.state is PRIMARY and m2.state is ACTIVE   # the input machine is unchanged
    assert step(m, peer, 0.5) == (m2, effects)         # same input, same output


# --------------------------------------------------------------------- start-up

def test_startup_primary_first():
    pair = Pair()
    a = pair.start("a")
    pair.advance(0.5)
    assert refused(pair.vote("a"))          # the backup may be about to announce itself
    assert a.state is PRIMARY
    pair.start("b")
    took = pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))
    assert took < HB
    assert pair["a"].effects(BecameActive)[0].previous is PRIMARY
    assert pair["b"].effects(BecamePassive)[0].previous is BACKUP
    assert accepted(pair.vote("a"))
    assert refused(pair.vote("b"))          # passive, peer alive
    assert pair["a"].machine.term == 1 and pair["b"].machine.term == 1


def test_startup_backup_first_backup_never_serves_alone():
    pair = Pair()
    b = pair.start("b")
    for _ in range(5):
        pair.advance(HB)
        assert refused(pair.vote("b"))      # a backup that has not seen the peer refuses
    assert b.state is BACKUP
    pair.start("a")
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))
    assert accepted(pair.vote("a"))


def test_lone_primary_serves_after_peer_expiry():
    pair = Pair()
    pair.start("a")
    pair.advance(2 * HB - 2 * DT)
    assert refused(pair.vote("a"))
    pair.advance(2 * DT)
    effects = pair.vote("a")
    assert accepted(effects)
    assert [type(e) for e in effects] == [BecameActive, PublishState, AcceptRequest]
    assert pair["a"].state is ACTIVE
    pair.start("b")                         # the backup arriving later goes passive
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))


def test_simultaneous_start():
    pair = Pair()
    pair.start("a")
    pair.start("b")
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))
    pair.advance(10 * HB)
    assert pair.states() == (ACTIVE, PASSIVE)


# --------------------------------------------------------------------- failover

def test_failover_active_dies_client_votes_after_peer_expiry():
    pair = up_pair()
    pair.kill("a")
    pair.advance(HB)
    assert refused(pair.vote("b"))          # peer may still be alive: no takeover
    assert pair["b"].state is PASSIVE
    waited = pair.run_until(lambda: accepted(pair.vote("b")))
    assert waited <= 2 * HB
    became = pair["b"].effects(BecameActive)
    assert len(became) == 1 and became[0].previous is PASSIVE
    assert "failover" in became[0].reason
    assert pair["b"].machine.term == 2
    assert accepted(pair.vote("b"))         # and keeps serving


def test_no_client_no_failover():
    pair = up_pair()
    pair.kill("a")
    pair.advance(20 * HB)
    assert pair["b"].state is PASSIVE       # Binary Star needs a client's vote


def test_failback_primary_returns_passive_then_takes_over_when_backup_dies():
    pair = up_pair()
    pair.kill("a")
    pair.run_until(lambda: accepted(pair.vote("b")))
    a2 = pair.start("a")                    # the supervisor restarts the primary
    pair.run_until(lambda: pair.states() == (PASSIVE, ACTIVE))
    assert a2.effects(BecamePassive)[0].previous is PRIMARY
    assert not pair["b"].effects(Fatal)
    pair.advance(5 * HB)
    assert pair.states() == (PASSIVE, ACTIVE)
    pair.kill("b")
    assert refused(pair.vote("a"))
    pair.run_until(lambda: accepted(pair.vote("a")))
    assert pair["a"].state is ACTIVE and pair["a"].machine.term == 3
    pair.start("b")
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))


def test_quick_restart_of_the_active_lets_the_passive_take_over_without_votes():
    pair = up_pair()
    pair.kill("a")
    pair.advance(3 * DT)
    pair.start("a")                         # back before its peer expiry ran out
    pair.run_until(lambda: pair.states() == (PASSIVE, ACTIVE))
    assert "peer restarted" in pair["b"].effects(BecameActive)[0].reason


def test_restarted_primary_does_not_grab_a_vote_before_hearing_the_active_backup():
    pair = up_pair()
    pair.kill("a")
    pair.run_until(lambda: accepted(pair.vote("b")))
    pair.delay_s[("b", "a")] = 1.5 * HB     # the backup's state reaches it late
    pair.start("a")
    pair.advance(HB)
    assert refused(pair.vote("a"))          # a new client votes for the primary: refused
    pair.run_until(lambda: pair.states() == (PASSIVE, ACTIVE))
    assert not any(s.effects(Fatal) for s in pair.history[-2:])


def test_the_active_answers_a_restarted_peer_at_once_not_at_its_next_heartbeat():
    # CI once ended a fsync-failure failover with the restarted primary active and the
    # backup, which had taken over, gone: the primary had heard nothing from the backup
    # for the two heartbeats of its start-up window. Here the backup's heartbeats just
    # miss it (its SUB not yet connected for the first, the second late), and only the
    # backup's answer to the primary's own state reaches it in time.
    pair = up_pair()
    pair.kill("a")
    pair.run_until(lambda: accepted(pair.vote("b")))
    beats = len(pair["b"].effects(PublishState))
    pair.run_until(lambda: len(pair["b"].effects(PublishState)) > beats)
    pair.advance(DT)                          # the backup's heartbeat is just out
    pair.cut[("b", "a")] = True               # the restarted primary's SUB connects late
    a = pair.start("a")                       # its PRIMARY reaches the backup at once
    start, expiry = pair.now, a.machine.peer_expiry
    pair.advance(HB)                          # the backup's next heartbeat is lost too
    pair.cut[("b", "a")] = False
    pair.delay_s[("b", "a")] = HB / 2         # and the one after it is late
    pair.run_until(lambda: pair.now >= expiry)
    answered = [t for t, e in pair["b"].log if isinstance(e, PublishState) and t > start
                and t < start + HB / 2]
    assert answered, "the backup did not answer the restarted primary's PRIMARY"
    assert a.state is PASSIVE and refused(pair.vote("a"))
    pair.advance(3 * HB)
    assert pair.states() == (PASSIVE, ACTIVE)
    assert not any(s.effects(Fatal) or s.effects(SplitBrainSurvived) for s in pair.history)


def test_refused_votes_before_peer_expiry_in_every_waiting_state():
    pair = up_pair()
    for _ in range(20):
        pair.advance(HB / 2)
        assert refused(pair.vote("b"))      # passive, active alive
    pair.partition()
    pair.advance(2 * HB - DT)
    assert refused(pair.vote("b"))
    pair.advance(2 * DT)
    assert accepted(pair.vote("b"))


def test_different_heartbeats_do_not_flap():
    # the backup publishes every 3 s; the primary's expiry follows the backup's rate
    pair = Pair(heartbeat_a=0.5, heartbeat_b=3.0)
    pair.start("a")
    pair.start("b")
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))
    pair.kill("a")
    pair.advance(0.5)
    assert refused(pair.vote("b"))
    # the backup's expiry of the primary follows the primary's 0.5 s, not its own 3 s
    pair.run_until(lambda: accepted(pair.vote("b")), limit_s=0.5 + DT)
    pair2 = Pair(heartbeat_a=0.5, heartbeat_b=3.0)
    pair2.start("a")
    pair2.start("b")
    pair2.run_until(lambda: pair2.states() == (ACTIVE, PASSIVE))
    for _ in range(20):
        pair2.advance(1.0)
        assert pair2["b"].machine.peer_expiry > pair2.now
        assert pair2["a"].machine.peer_expiry > pair2.now   # 2 x 3 s covers the gaps


# --------------------------------------------------------------------- split brain

def test_dual_active_after_healed_partition_stale_side_exits():
    pair = up_pair()
    pair.partition()
    pair.run_until(lambda: accepted(pair.vote("b")))   # a client on the far side votes
    assert pair.states() == (ACTIVE, ACTIVE)
    pair.partition(cut=False)
    pair.run_until(lambda: not pair["a"].alive)
    fatal = pair["a"].effects(Fatal)
    assert [f.reason for f in fatal] == ["dual active"]
    assert pair["b"].alive and pair["b"].state is ACTIVE
    assert pair["b"].effects(SplitBrainSurvived)[0].reason == "dual active"
    pair.start("a")                                     # supervisor restart
    pair.run_until(lambda: pair.states() == (PASSIVE, ACTIVE))


def test_dual_active_both_exit_without_survivor_rule():
    pair = up_pair(survivor=False)
    pair.partition()
    pair.run_until(lambda: accepted(pair.vote("b")))
    pair.delay_s = {k: 1.5 * HB for k in pair.delay_s}  # both publish before either hears
    pair.partition(cut=False)
    pair.run_until(lambda: not pair["a"].alive and not pair["b"].alive)
    assert [f.reason for f in pair["a"].effects(Fatal)] == ["dual active"]
    assert [f.reason for f in pair["b"].effects(Fatal)] == ["dual active"]


def test_frozen_active_sigstop_sigcont_ends_with_one_active():
    pair = up_pair()
    pair.freeze("a")
    pair.run_until(lambda: accepted(pair.vote("b")))
    pair.advance(5 * HB)                                # 'a' stays stopped a while
    pair.thaw("a")
    pair.run_until(lambda: not pair["a"].alive)
    assert pair["a"].effects(Fatal)[0].reason == "dual active"
    assert pair["b"].state is ACTIVE and pair["b"].alive
    pair.start("a")
    pair.run_until(lambda: pair.states() == (PASSIVE, ACTIVE))
    pair.advance(5 * HB)
    assert pair.states() == (PASSIVE, ACTIVE)


def test_equal_terms_primary_wins_dual_active():
    # a tie needs a double fault (a restarted primary hears the passive's term, then a
    # partition with clients voting on both sides); a hand-made tie checks the rule
    a = new_machine(Role.PRIMARY, 0.0)
    a, _ = step(a, Event.CLIENT_REQUEST, 5.0)
    b_msg = StateMessage(ACTIVE, Role.BACKUP, HB, term=a.term)
    a2, effects = step(a, b_msg, 6.0)
    assert isinstance(effects[0], SplitBrainSurvived) and a2.state is ACTIVE
    b = bstar.Machine(bstar.Config(Role.BACKUP), ACTIVE, 0.0, 0.0, term=a.term)
    b2, effects = step(b, state_message(a), 6.0)
    assert effects == [Fatal("dual active", effects[0].detail)] and b2.fatal == "dual active"


def test_dual_passive_is_fatal_for_the_backup_and_the_primary_takes_over():
    pair = up_pair()
    pair.kill("a")
    pair.start("a")
    pair.run_until(lambda: pair.states() == (PASSIVE, ACTIVE))
    # force the backup passive too (as if it had acted on a stale ACTIVE): no legal path
    # of this machine gets there, but a bug or a forged message could
    b = pair["b"]
    b.machine = bstar.Machine(b.machine.config, PASSIVE, b.machine.peer_expiry, pair.now,
                              term=b.machine.term)
    b.feed(Event.TICK)                                   # it announces PASSIVE
    pair.run_until(lambda: not pair["b"].alive)
    assert [f.reason for f in pair["b"].effects(Fatal)] == ["dual passive"]
    assert pair["a"].effects(SplitBrainSurvived)[0].reason == "dual passive"
    assert pair["a"].alive and pair["a"].state is PASSIVE
    pair.start("b")                                      # restarted backup: primary active
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))


def test_dual_passive_both_exit_without_survivor_rule():
    for role, other in ((Role.PRIMARY, Role.BACKUP), (Role.BACKUP, Role.PRIMARY)):
        m = bstar.Machine(bstar.Config(role, split_brain_survivor=False), PASSIVE, 0.0, 0.0)
        m, effects = step(m, StateMessage(PASSIVE, other, HB), 1.0)
        assert [type(e) for e in effects] == [Fatal] and effects[0].reason == "dual passive"


@pytest.mark.parametrize("role", [Role.PRIMARY, Role.BACKUP])
def test_two_servers_with_the_same_role_both_exit(role):
    m = new_machine(role, 0.0)
    peer_state = PRIMARY if role is Role.PRIMARY else BACKUP
    m, effects = step(m, StateMessage(peer_state, role, HB), 0.1)
    name = role.name.lower()
    assert effects[0] == Fatal(f"dual {name}", effects[0].detail)
    assert "--primary/--backup" in effects[0].detail
    m2, effects = step(m, StateMessage(ACTIVE, role, HB), 0.2)
    assert effects == [] and m2 == m


# --------------------------------------------------------------------- odds and ends

def test_wrong_shard_is_ignored():
    pair = Pair(shard_a="s0", shard_b="s1")
    pair.start("a")
    pair.start("b")
    pair.advance(3 * HB)
    assert pair.states() == (PRIMARY, BACKUP)
    assert pair["a"].effects(IgnoredPeer)[0].reason == "wrong shard"
    assert accepted(pair.vote("a"))           # as if alone: the peer never counted


def test_unnamed_shard_pairs_with_anything():
    pair = Pair(shard_a="", shard_b="s1")
    pair.start("a")
    pair.start("b")
    pair.run_until(lambda: pair.states() == (ACTIVE, PASSIVE))


def test_inconsistent_message_is_ignored():
    m = new_machine(Role.BACKUP, 0.0)
    m2, effects = step(m, StateMessage(BACKUP, Role.PRIMARY, HB), 0.1)
    assert m2 == m and effects[0].reason == "inconsistent state"


def test_fatal_machine_is_inert():
    m = bstar.Machine(bstar.Config(Role.PRIMARY), ACTIVE, 0.0, 0.0, term=1)
    m, effects = step(m, StateMessage(ACTIVE, Role.BACKUP, HB, term=5), 1.0)
    assert effects[0].reason == "dual active" and m.fatal
    assert step(m, Event.TICK, 100.0) == (m, [])
    assert step(m, StateMessage(PASSIVE, Role.BACKUP, HB), 100.0) == (m, [])
    m2, effects = step(m, Event.CLIENT_REQUEST, 100.0)
    assert m2 == m and isinstance(effects[0], RefuseRequest)


def test_tick_publishes_every_heartbeat_and_state_changes_publish_at_once():
    m = new_machine(Role.PRIMARY, 0.0, heartbeat_s=1.0)
    m, effects = step(m, Event.TICK, 0.0)
    assert effects == [PublishState(PRIMARY, 0)]
    m, effects = step(m, Event.TICK, 0.5)
    assert effects == []
    m, effects = step(m, StateMessage(BACKUP, Role.BACKUP, HB), 0.7)
    assert effects[-1] == PublishState(ACTIVE, 1)
    assert bstar.next_wakeup(m) == pytest.approx(1.7)
    m, effects = step(m, Event.TICK, 1.0)
    assert effects == []
    m, effects = step(m, Event.TICK, 1.7)
    assert effects == [PublishState(ACTIVE, 1)]
    assert bstar.peer_alive(m, 2.6) and not bstar.peer_alive(m, 2.7)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["advance", "kill", "restart", "vote_a", "vote_b",
                                           "cut_ab", "cut_ba", "heal", "freeze", "thaw"]),
                          st.sampled_from(["a", "b"]), st.floats(0.05, 4.0)),
                max_size=25))
def test_random_faults_never_leave_two_actives_talking(actions):
    """Whatever happens, once the link is healed and both servers run (restarting any that
    exited), within a few heartbeats exactly one is ACTIVE and the other PASSIVE."""
    pair = Pair()
    pair.start("a")
    pair.start("b")
    for action, name, seconds in actions:
        server = pair[name]
        if action == "advance":
            pair.advance(round(seconds, 2))
        elif action == "kill" and server.alive:
            pair.kill(name)
        elif action == "restart" and not server.alive:
            pair.start(name)
        elif action in ("vote_a", "vote_b"):
            target = pair[action[-1]]
            if target.alive and not target.frozen:
                pair.vote(action[-1])
        elif action == "cut_ab":
            pair.cut[("a", "b")] = True
        elif action == "cut_ba":
            pair.cut[("b", "a")] = True
        elif action == "heal":
            pair.partition(cut=False)
        elif action == "freeze" and server.alive:
            pair.freeze(name)
        elif action == "thaw":
            server.frozen = False
    pair.partition(cut=False)
    for name in ("a", "b"):
        pair[name].frozen = False
    pair.delay_s = {k: 0.0 for k in pair.delay_s}

    def settled() -> bool:
        for name in ("a", "b"):
            if not pair[name].alive:
                pair.start(name)                # the supervisor restarts what exited
        if set(pair.states()) == {ACTIVE, PASSIVE}:
            return True
        for name in ("a", "b"):                 # clients keep voting for whoever
            if pair[name].alive:
                pair.vote(name)
        return False

    pair.run_until(settled, limit_s=20 * HB)
    pair.advance(3 * HB)
    assert set(pair.states()) == {ACTIVE, PASSIVE}


# --------------------------------------------------------------------- P+3 codec

def test_codec_round_trip():
    msg = StateMessage(ACTIVE, Role.BACKUP, 0.25, term=7, sequence=123456789, shard="s3/é")
    frames = wire.encode(msg)
    assert frames[0] == b"BSTAR1" and len(frames) == 2
    assert len(frames[1]) == wire.BODY_SIZE + len("s3/é".encode())
    assert wire.decode(frames) == msg


@given(st.sampled_from(list(State)), st.integers(1, wire.MAX_HEARTBEAT_MS),
       st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.text(max_size=60))
def test_codec_round_trip_property(state, heartbeat_ms, term, sequence, shard):
    role = Role.BACKUP if state is BACKUP else Role.PRIMARY
    msg = StateMessage(state, role, heartbeat_ms / 1000, term, sequence, shard)
    if len(shard.encode("utf-8", "surrogatepass")) > 255:
        return
    try:
        shard.encode("utf-8")
    except UnicodeEncodeError:
        return
    assert wire.decode(wire.encode(msg)) == msg


def _body(state=3, role=1, hb=1000, term=0, seq=0, shard=b""):
    return wire._BODY.pack(state, role, hb, term, seq) + shard


@pytest.mark.parametrize("frames, reason", [
    ([b"BSTAR1"], "frame_count"),
    ([b"BSTAR1", _body(), b""], "frame_count"),
    ([b"BSTAR2", _body()], "bad_signature"),
    ([b"", _body()], "bad_signature"),
    ([b"BSTAR1", _body()[:21]], "bad_size"),
    ([b"BSTAR1", _body(shard=b"x" * 256)], "bad_size"),
    ([b"BSTAR1", _body(state=0)], "bad_state"),
    ([b"BSTAR1", _body(state=5)], "bad_state"),
    ([b"BSTAR1", _body(role=3)], "bad_role"),
    ([b"BSTAR1", _body(state=1, role=2)], "bad_state"),
    ([b"BSTAR1", _body(state=2, role=1)], "bad_state"),
    ([b"BSTAR1", _body(hb=0)], "bad_heartbeat"),
    ([b"BSTAR1", _body(hb=3_600_001)], "bad_heartbeat"),
    ([b"BSTAR1", _body(shard=b"\xff")], "bad_shard"),
])
def test_codec_rejects(frames, reason):
    with pytest.raises(ProtocolError) as info:
        wire.decode(frames)
    assert info.value.reason == reason
    assert info.value.protocol == "bstar/1"


@given(st.lists(st.binary(max_size=40), max_size=4))
def test_codec_never_crashes_on_garbage(frames):
    try:
        msg = wire.decode(frames)
    except ProtocolError:
        return
    assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize("msg", [
    StateMessage(PRIMARY, Role.BACKUP, 1.0),
    StateMessage(ACTIVE, Role.PRIMARY, 0.0),
    StateMessage(ACTIVE, Role.PRIMARY, 1.0, shard="x" * 256),
    StateMessage(ACTIVE, Role.PRIMARY, 1.0, term=-1),
])
def test_codec_refuses_to_encode_bad_fields(msg):
    with pytest.raises(ProtocolError):
        wire.encode(msg)


# ------------------------------------------------------------- durable start-up (7)

def _start_up(p_data: tuple[int, int], b_data: tuple[int, int]) -> tuple[State, State]:
    """Both servers of a pair start from disk with (term, sequence) each, exchange state
    messages in either order until nothing changes: the states they settle in."""
    now = 0.0
    p = new_machine(Role.PRIMARY, now, term=p_data[0], data_seq=p_data[1])
    b = new_machine(Role.BACKUP, now, term=b_data[0], data_seq=b_data[1])
    for _ in range(4):
        p_msg = state_message(p, p_data[1] if p.state is PRIMARY else p.data_seq)
        b_msg = state_message(b, b_data[1] if b.state is BACKUP else b.data_seq)
        p, _ = step(p, b_msg, now)
        b, _ = step(b, p_msg, now)
        now += DT
    return p.state, b.state


@pytest.mark.parametrize("p_data, b_data, expected", [
    ((0, 0), (0, 0), (ACTIVE, PASSIVE)),        # no data: the primary, as in the guide
    ((3, 100), (3, 100), (ACTIVE, PASSIVE)),    # a tie: the primary
    ((1, 100), (2, 90), (PASSIVE, ACTIVE)),     # the backup took over later: a later term
    ((2, 150), (2, 120), (ACTIVE, PASSIVE)),    # the same term: the longer map
    ((2, 120), (2, 150), (PASSIVE, ACTIVE)),    # ... whichever role holds it
    ((1, 150), (2, 120), (PASSIVE, ACTIVE)),    # the term first, then the sequence
])
def test_at_start_up_the_later_map_goes_active(p_data, b_data, expected):
    assert _start_up(p_data, b_data) == expected


def test_a_starting_server_does_not_adopt_its_peers_term_so_the_election_cannot_flip():
    p = new_machine(Role.PRIMARY, 0.0, term=1, data_seq=150)
    p, effects = step(p, StateMessage(BACKUP, Role.BACKUP, HB, term=2, sequence=120), 0.0)
    assert p.state is PRIMARY and p.term == 1 and effects == []
    # and the backup, hearing the primary's unchanged (1, 150), goes active
    b = new_machine(Role.BACKUP, 0.0, term=2, data_seq=120)
    b, effects = step(b, state_message(p, 150), 0.0)
    assert b.state is ACTIVE and b.term == 3
    # the primary then sees it active, goes passive and adopts its term
    p, effects = step(p, state_message(b, 120), 0.1)
    assert p.state is PASSIVE and p.term == 3


# --------------------------------------------------------------------- rule 8: needs_peer

def _msg(state: State, role: Role, term: int = 0, seq: int = 0) -> StateMessage:
    return StateMessage(state, role, HB, term, seq, "s0")


def test_a_server_that_lost_its_map_lets_the_peer_holding_data_serve():
    now = 0.0
    lost = new_machine(Role.PRIMARY, now, heartbeat_s=HB, shard="s0", term=7, data_seq=900,
                       needs_peer=True)
    assert (lost.term, lost.data_seq) == (0, 0), "its recovered term and sequence are void"
    # start-up: the backup holds data, so the primary stays, whatever the tie rule says
    lost, effects = step(lost, _msg(BACKUP, Role.BACKUP, term=1, seq=400), now)
    assert lost.state is PRIMARY and not any(isinstance(e, BecameActive) for e in effects)
    backup = new_machine(Role.BACKUP, now, heartbeat_s=HB, shard="s0", term=1, data_seq=400)
    backup, effects = step(backup, _msg(PRIMARY, Role.PRIMARY), now)
    assert backup.state is ACTIVE
    # it never wins a vote, not even once the peer is silent
    later = now + 100 * HB
    _, effects = step(lost, Event.CLIENT_REQUEST, later)
    assert refused(effects) and not bstar.would_accept(lost, later)


def test_a_server_that_lost_its_map_serves_when_the_peer_holds_nothing_either():
    lost = new_machine(Role.BACKUP, 0.0, heartbeat_s=HB, shard="s0", needs_peer=True)
    lost, effects = step(lost, _msg(PRIMARY, Role.PRIMARY, 0, 0), 0.0)
    assert lost.state is BACKUP  # the primary wins the (0, 0) tie and goes active
    primary = new_machine(Role.PRIMARY, 0.0, heartbeat_s=HB, shard="s0", needs_peer=True)
    primary, effects = step(primary, _msg(BACKUP, Role.BACKUP, 0, 0), 0.0)
    assert primary.state is ACTIVE  # nothing is at stake on either side


def test_a_passive_without_its_copy_yet_goes_back_to_start_when_the_peer_restarts():
    m = new_machine(Role.BACKUP, 0.0, heartbeat_s=HB, shard="s0", needs_peer=True)
    m, _ = step(m, _msg(ACTIVE, Role.PRIMARY, 3, 50), 0.0)
    assert m.state is PASSIVE
    m, effects = step(m, _msg(PRIMARY, Role.PRIMARY, 3, 50), 1.0)  # the active restarted
    assert m.state is BACKUP and any(isinstance(e, PublishState) for e in effects)
    m = bstar.peer_copied(m)
    m, _ = step(m, _msg(ACTIVE, Role.PRIMARY, 3, 50), 2.0)
    assert m.state is PASSIVE and not m.needs_peer
    m, effects = step(m, _msg(PRIMARY, Role.PRIMARY, 3, 50), 3.0)
    assert m.state is ACTIVE  # with its copy, the usual rule: the passive takes over


def test_a_backup_told_its_primary_is_down_takes_a_vote():
    """Rule 9: a BACKUP that never heard its primary refuses votes (it may be slow to
    start), unless the supervisor reports the primary down on a disk error or FAILED."""
    b = new_machine(Role.BACKUP, 0.0, heartbeat_s=HB, shard="s0", term=1, data_seq=40)
    later = 10 * HB
    _, effects = step(b, Event.CLIENT_REQUEST, later)
    assert refused(effects) and not bstar.would_accept(b, later)
    b = bstar.peer_reported_down(b)
    assert bstar.would_accept(b, later) and not bstar.would_accept(b, 0.0)  # after expiry
    b2, effects = step(b, Event.CLIENT_REQUEST, later)
    assert accepted(effects) and b2.state is ACTIVE
    # any word from the primary ends the report
    b3, _ = step(b, _msg(PRIMARY, Role.PRIMARY, 0, 0), later)
    assert not b3.peer_down
