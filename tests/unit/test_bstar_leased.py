"""The Binary Star machine in leased mode (rules L1-L4 of ``clonemap.shards.bstar``): a server is
ACTIVE only while it holds the pair's lease; the lease, not an exit, settles dual active.
The lease itself is etcd's (tested against a real one in tests/integration); here the
shell's reports LEASE_ACQUIRED / LEASE_LOST are events like any other."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from clonemap.shards import bstar
from clonemap.shards.bstar import (AcceptRequest, BecameActive, BecamePassive, Event, Fatal,
                          RefuseRequest, SplitBrainSurvived, new_machine, step)
from clonemap.shards.common.proto.bstar import Role, State, StateMessage

HB = 1.0
T0 = 1000.0


def peer(state: State, role: Role = Role.BACKUP, term: int = 0, seq: int = 0) -> StateMessage:
    return StateMessage(state, role, HB, term, seq, "")


def kinds(effects) -> list[type]:
    return [type(e) for e in effects]


def leased(role: Role = Role.PRIMARY, **kw) -> bstar.Machine:
    return new_machine(role, T0, heartbeat_s=HB, leased=True, **kw)


def active(role: Role = Role.PRIMARY) -> bstar.Machine:
    m, _ = step(leased(role), peer(State.BACKUP if role is Role.PRIMARY else State.PRIMARY,
                                   Role.BACKUP if role is Role.PRIMARY else Role.PRIMARY),
                T0)
    m, effects = step(m, Event.LEASE_ACQUIRED, T0 + 0.1)
    assert m.state is State.ACTIVE and BecameActive in kinds(effects)
    return m


def test_l1_the_start_up_winner_goes_active_only_once_it_holds_the_lease():
    m, effects = step(leased(), peer(State.BACKUP), T0)
    assert m.state is State.PRIMARY and BecameActive not in kinds(effects)
    assert m.wants_lease and bstar.lease_wanted(m)
    m, effects = step(m, Event.LEASE_ACQUIRED, T0 + 0.5)
    assert m.state is State.ACTIVE and m.term == 1 and m.lease_held
    assert BecameActive in kinds(effects)
    assert "lease acquired" in effects[0].reason and "PEER_BACKUP" in effects[0].reason


def test_l1_a_vote_after_the_peers_expiry_starts_the_acquire_and_is_refused():
    m = leased()
    assert bstar.would_accept(m, T0 + 10)  # HUGZ say serving=1: clients keep voting here
    m, effects = step(m, Event.CLIENT_REQUEST, T0 + 10)
    assert kinds(effects) == [RefuseRequest] and "lease" in effects[0].reason
    assert m.state is State.PRIMARY and m.wants_lease
    m, effects = step(m, Event.LEASE_ACQUIRED, T0 + 11)
    assert m.state is State.ACTIVE
    m, effects = step(m, Event.CLIENT_REQUEST, T0 + 11)
    assert kinds(effects) == [AcceptRequest]


def test_l1_a_vote_before_the_peers_expiry_asks_for_no_lease():
    m, _ = step(leased(), peer(State.PASSIVE), T0)
    m, effects = step(m, Event.CLIENT_REQUEST, T0 + 0.5)
    assert kinds(effects) == [RefuseRequest] and not m.wants_lease


def test_l2_an_active_that_loses_its_lease_goes_passive_and_stops_wanting_it():
    m = active()
    m, effects = step(m, Event.LEASE_LOST, T0 + 5)
    assert m.state is State.PASSIVE and BecamePassive in kinds(effects)
    assert "lease lost" in effects[0].reason
    assert not m.lease_held and not bstar.lease_wanted(m)


def test_l2_losing_a_lease_that_was_not_used_changes_no_state():
    m, _ = step(leased(), Event.LEASE_ACQUIRED, T0)  # acquired after the wish was withdrawn
    assert m.state is State.PRIMARY and m.lease_held and not bstar.lease_wanted(m)
    m, effects = step(m, Event.LEASE_LOST, T0 + 1)
    assert m.state is State.PRIMARY and effects == []


def test_l3_dual_active_the_holder_carries_on_and_nobody_exits():
    m = active()
    m, effects = step(m, peer(State.ACTIVE, term=7), T0 + 1)
    assert m.state is State.ACTIVE and kinds(effects) == [SplitBrainSurvived]
    assert not m.fatal


def test_l3_hearing_the_peer_active_withdraws_the_wish():
    m, _ = step(leased(Role.BACKUP), peer(State.PRIMARY, Role.PRIMARY), T0)
    m, _ = step(m, peer(State.ACTIVE, Role.PRIMARY), T0 + 0.1)
    m, _ = step(m, Event.CLIENT_REQUEST, T0 + 5)  # the primary went silent: a vote
    assert m.wants_lease
    m, _ = step(m, peer(State.ACTIVE, Role.PRIMARY), T0 + 5.5)  # it was only slow
    assert not m.wants_lease and not bstar.lease_wanted(m)
    m, effects = step(m, Event.LEASE_ACQUIRED, T0 + 6)  # a late grant is not used
    assert m.state is State.PASSIVE and BecameActive not in kinds(effects)


def test_l4_both_passive_the_later_map_asks_for_the_lease():
    behind = bstar.with_sequence(active(Role.PRIMARY), 10)
    behind, _ = step(behind, Event.LEASE_LOST, T0 + 5)
    ahead = bstar.with_sequence(behind, 12)
    msg_behind = peer(State.PASSIVE, Role.BACKUP, term=1, seq=10)
    msg_ahead = peer(State.PASSIVE, Role.BACKUP, term=1, seq=12)
    m, effects = step(ahead, msg_behind, T0 + 6)
    assert m.wants_lease and not any(isinstance(e, Fatal) for e in effects)
    m, effects = step(behind, msg_ahead, T0 + 6)
    assert not m.wants_lease and not m.fatal and effects == []


def test_l5_a_restarted_server_with_a_map_hearing_a_passive_wants_the_lease_only_if_alone():
    """Its last run went on alone and was killed: the passive cannot take the lease, and
    rule (1) keeps the primary waiting for it. L5 asks etcd whether the record names
    this server; granted, it serves its own map."""
    m = leased(term=3, data_seq=40)
    m, effects = step(m, peer(State.PASSIVE, term=3, seq=30), T0)
    assert m.state is State.PRIMARY and effects == []
    assert bstar.lease_wanted(m) and bstar.lease_if_alone(m)
    m, effects = step(m, Event.LEASE_ACQUIRED, T0 + 0.3)
    assert m.state is State.ACTIVE and m.term == 4 and BecameActive in kinds(effects)
    assert "alone" in effects[0].reason
    assert bstar.lease_wanted(m) and not bstar.lease_if_alone(m)


def test_l5_a_server_that_holds_no_map_waits_for_the_passive():
    for m in (leased(), leased(term=3, data_seq=40, needs_peer=True)):
        m, _ = step(m, peer(State.PASSIVE, term=3, seq=30), T0)
        assert not bstar.lease_wanted(m) and m.state is State.PRIMARY


def test_l5_the_wish_ends_when_the_peer_serves_and_a_vote_makes_it_an_ordinary_one():
    m, _ = step(leased(Role.BACKUP, term=2, data_seq=5),
                peer(State.PASSIVE, Role.PRIMARY, term=2), T0)
    assert bstar.lease_if_alone(m)
    served, _ = step(m, peer(State.ACTIVE, Role.PRIMARY, term=3), T0 + 0.5)
    assert not bstar.lease_wanted(served) and not served.lease_if_alone
    m, _ = step(leased(term=2, data_seq=5), peer(State.PASSIVE, term=2), T0)
    assert bstar.lease_if_alone(m)
    m, effects = step(m, Event.CLIENT_REQUEST, T0 + 5)  # the peer went silent
    assert kinds(effects) == [RefuseRequest]
    assert bstar.lease_wanted(m) and not bstar.lease_if_alone(m)  # the peer is gone


def test_unleased_machines_are_untouched_by_lease_events():
    m = new_machine(Role.PRIMARY, T0, heartbeat_s=HB)
    assert not bstar.lease_wanted(m)
    m, effects = step(m, peer(State.BACKUP), T0)
    assert m.state is State.ACTIVE and BecameActive in kinds(effects)


EVENTS = st.one_of(
    st.sampled_from([Event.CLIENT_REQUEST, Event.TICK, Event.LEASE_ACQUIRED,
                     Event.LEASE_LOST]),
    st.builds(peer, st.sampled_from(list(State)), st.just(Role.BACKUP),
              st.integers(0, 3), st.integers(0, 3)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(EVENTS, st.floats(0, 3)), max_size=40))
def test_a_leased_server_is_active_only_while_it_holds_the_lease(events):
    m, now = leased(), T0
    for event, dt in events:
        now += dt
        m, effects = step(m, event, now)
        assert not any(isinstance(e, Fatal) and e.reason == "dual active" for e in effects)
        if m.state is State.ACTIVE:
            assert m.lease_held
        if any(isinstance(e, BecameActive) for e in effects):
            assert m.lease_held
