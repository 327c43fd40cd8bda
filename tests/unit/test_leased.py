"""The leased mode of a Binary Star server (``clonemap.shards.leased.Leased``), alone: a fake
lease and a fake loop, the real pure machine (``clonemap.shards.bstar``). Under test: the
machine hears LEASE_ACQUIRED / LEASE_LOST as the lease's view says; past the lease's
deadline nothing may be published (``fenced``); an ICANHAZ waits while writes are
parked for the passive; a vote that started the acquire is answered at the takeover,
unless its client gave up."""
from __future__ import annotations

from clonemap.shards import bstar
from clonemap.shards.common.proto.bstar import Role, State, StateMessage
from clonemap.shards.coord import LeaseView
from clonemap.shards.leased import DEFERRED_AGE_S, DEFERRED_MAX, Leased

HB = 1.0
T0 = 1000.0


class FakeLease:
    def __init__(self, on_change):
        self.on_change = on_change
        self.view = LeaseView()
        self.wanted: list[bool] = []
        self.started = self.closed = False

    def start(self):
        self.started = True

    def want(self, wanted, only_if_alone=False):
        self.wanted.append(wanted)
        self.only_if_alone = only_if_alone

    def valid(self, now):
        return self.view.held and now < self.view.valid_until

    def close(self):
        self.closed = True

    def stats(self):
        return {"held": self.view.held}

    def grant(self, until: float):
        """Acquired (again): a grant of its own, as each acquire in etcd is."""
        self.view = LeaseView(True, until, "primary@host", generation=self.view.generation + 1)
        self.on_change(self.view)

    def renew(self, until: float):
        """Renewed: the same grant, a later deadline."""
        self.view = LeaseView(True, until, "primary@host", generation=self.view.generation)
        self.on_change(self.view)

    def lose(self):
        self.view = LeaseView(generation=self.view.generation)
        self.on_change(self.view)


class FakeLoop:
    def __init__(self, clock):
        self.clock = clock
        self.soon: list = []
        self.at: list[tuple[float, object]] = []

    def is_closed(self):
        return False

    def call_soon(self, callback, *args):
        self.soon.append((callback, args))

    call_soon_threadsafe = call_soon

    def call_at(self, when, callback):
        entry = (when, callback)
        self.at.append(entry)

        class Handle:
            def cancel(self_inner):
                if entry in self.at:
                    self.at.remove(entry)

        return Handle()

    def run_soon(self):
        soon, self.soon = self.soon, []
        for callback, args in soon:
            callback(*args)


class Pair:
    """The pair's side: the machine, a step of it, what is parked, what was answered."""

    def __init__(self):
        self.now = T0
        self.machine = bstar.new_machine(Role.PRIMARY, T0, heartbeat_s=HB, leased=True)
        self.parked = False
        self.answered: list[list[bytes]] = []
        self.drops: list[str] = []
        self.loop = FakeLoop(lambda: self.now)
        self.leased = Leased(
            FakeLease, shard="s0", name="primary", heartbeat_s=HB, loop=lambda: self.loop,
            machine=lambda: self.machine, step=self.step,
            is_active=lambda: self.machine.state is State.ACTIVE,
            parked=lambda: self.parked, answer=self.answered.append,
            drop=lambda reason, detail: self.drops.append(reason), clock=lambda: self.now)

    def step(self, event):
        self.machine, effects = bstar.step(self.machine, event, self.now)
        self.leased.want()
        return effects

    @property
    def lease(self) -> FakeLease:
        return self.leased.lease

    def become_active(self):
        """The start-up winner wants the lease; granted, it is ACTIVE."""
        self.step(StateMessage(State.BACKUP, Role.BACKUP, HB, 0, 0, ""))
        assert self.machine.wants_lease and self.lease.wanted[-1] is True
        self.lease.grant(self.now + 5)
        self.loop.run_soon()  # the change, handed to the loop
        assert self.machine.state is State.ACTIVE and self.machine.lease_held


def test_the_machine_goes_active_when_the_lease_is_granted_with_a_fence_timer():
    p = Pair()
    p.leased.start()
    assert p.lease.started
    p.become_active()
    assert [when for when, _ in p.loop.at] == [T0 + 5]  # the fencing deadline


def test_past_the_deadline_nothing_is_published_and_the_machine_loses_the_lease():
    p = Pair()
    p.become_active()
    p.now = T0 + 4.9
    assert not p.leased.fenced()
    p.now = T0 + 5.0  # not renewed
    assert p.leased.ran_out() and p.leased.fenced()
    assert p.leased.fenced_batches == 1
    p.loop.run_soon()  # the check it scheduled
    assert p.machine.state is State.PASSIVE and not p.machine.lease_held
    assert not p.leased.fenced()  # passive: nothing is asked of the lease any more


def test_a_lease_lost_and_taken_again_before_the_loop_looked_is_still_a_loss():
    """The lease's thread finds the lease gone in etcd (revoked: a lapse under load) and,
    still wanted, acquires a new one, all before the loop runs the check that the loss
    handed it. The machine must still hear LEASE_LOST: it held the old lease, and
    between the two anybody could have taken the pair's key (seen once: the active
    stayed ACTIVE in its old term, and its passive never copied the map again)."""
    p = Pair()
    p.become_active()
    term = p.machine.term
    p.lease.lose()
    p.lease.grant(p.now + 5)  # the thread's next turn, before the loop's
    assert p.leased.ran_out() and p.leased.fenced()  # a batch now: not published
    p.loop.run_soon()  # both checks see the latest view: held, valid
    assert p.machine.state is State.PASSIVE and p.machine.term == term
    assert p.leased.losses_caught_late == 1
    assert p.lease.wanted[-1] is False  # the new grant is given back
    p.lease.lose()  # (released by the thread)
    p.loop.run_soon()
    assert not p.machine.lease_held and p.loop.at == []
    assert p.machine.state is State.PASSIVE and p.leased.losses_caught_late == 1


def test_a_renewed_lease_moves_the_fence_timer():
    p = Pair()
    p.become_active()
    p.lease.renew(T0 + 9)
    p.loop.run_soon()
    assert [when for when, _ in p.loop.at] == [T0 + 9]
    assert p.machine.state is State.ACTIVE and p.leased.losses_caught_late == 0


def test_an_icanhaz_waits_while_writes_are_parked_and_is_answered_after():
    p = Pair()
    p.become_active()
    assert not p.leased.must_wait([b"c1", b"ICANHAZ?"])  # nothing parked: answered now
    p.parked = True
    assert p.leased.must_wait([b"c1", b"ICANHAZ?"])
    assert p.leased.must_wait([b"c2", b"ICANHAZ?"])
    assert p.answered == []
    p.parked = False
    p.leased.unparked()
    assert p.answered == []  # on the next loop turn, not inside the publish path
    p.loop.run_soon()
    assert [f[0] for f in p.answered] == [b"c1", b"c2"]


def test_requests_waiting_are_bounded_and_the_drop_counted():
    p = Pair()
    p.become_active()
    p.parked = True
    for n in range(DEFERRED_MAX + 3):
        p.leased.must_wait([f"c{n}".encode(), b"ICANHAZ?"])
    assert p.drops == ["snapshot_waiting_full"] * 3


def test_a_vote_that_starts_the_acquire_is_answered_at_the_takeover():
    p = Pair()
    p.now = T0 + 3 * HB  # the peer was never heard: a vote may win
    p.step(bstar.Event.CLIENT_REQUEST)  # refused: acquiring first
    assert p.machine.wants_lease
    p.leased.after_vote([b"c1", b"ICANHAZ?"])
    p.lease.grant(p.now + 5)
    p.loop.run_soon()  # LEASE_ACQUIRED: ACTIVE
    assert p.machine.state is State.ACTIVE
    p.leased.became_active()
    p.loop.run_soon()
    assert [f[0] for f in p.answered] == [b"c1"]


def test_a_deferred_vote_whose_client_gave_up_is_not_answered():
    p = Pair()
    p.now = T0 + 3 * HB
    p.step(bstar.Event.CLIENT_REQUEST)
    p.leased.after_vote([b"old", b"ICANHAZ?"])
    p.now += DEFERRED_AGE_S + 0.1
    p.leased.after_vote([b"new", b"ICANHAZ?"])
    p.lease.grant(p.now + 5)
    p.loop.run_soon()
    p.leased.became_active()
    p.loop.run_soon()
    assert [f[0] for f in p.answered] == [b"new"]


def test_going_passive_forgets_what_waited_and_a_closed_lease_steps_nothing():
    p = Pair()
    p.become_active()
    p.parked = True
    p.leased.must_wait([b"c1", b"ICANHAZ?"])
    p.leased.became_passive()
    p.parked = False
    p.leased.unparked()
    p.loop.run_soon()
    assert p.answered == []
    p.leased.close()
    assert p.lease.closed and p.loop.at == []
    p.now = T0 + 10
    p.leased.check()
    assert p.machine.lease_held  # nothing stepped after close
