"""The passive server's pending table: matching by UUID, bounds, order, no leaks."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from clonemap.shards.pending import Pending, PendingTable


def u(n: int) -> bytes:
    return n.to_bytes(16, "big")


def test_client_first_then_active_confirms():
    t = PendingTable()
    assert t.add(u(1), "set a", now=0.0)
    assert len(t) == 1 and u(1) in t
    assert t.confirm(u(1), now=0.1) is True
    assert len(t) == 0
    assert t.counters["added"] == 1 and t.counters["confirmed"] == 1


def test_active_first_then_client_is_not_kept():
    t = PendingTable()
    assert t.confirm(u(1), now=0.0) is False
    assert t.early_count == 1
    assert t.add(u(1), "set a", now=0.1) is False
    assert len(t) == 0 and t.early_count == 0
    assert t.counters["early"] == 1 and t.counters["early_matched"] == 1


def test_a_sync_forgets_what_is_pending_but_not_what_the_active_published_first():
    """A replica's sync starts (``discard_pending``): the updates pending are in its
    snapshot or were never taken. An update the active published just before, whose
    client copy arrives just after, must still match: before, the sync emptied the early
    confirmations too, the copy stayed pending, and a takeover applied it a second time
    (a replica one sequence past its active's map, seen under load)."""
    t = PendingTable()
    t.add(u(1), "set a", now=0.0)
    assert t.confirm(u(2), now=0.1) is False  # the active's KVPUB of b, before b's KVSET
    assert t.discard_pending() == 1 and len(t) == 0
    assert t.early_count == 1
    assert t.add(u(2), "set b", now=0.2) is False  # b's KVSET: matched, not pending
    assert len(t) == 0 and t.counters["early_matched"] == 1
    assert t.drain(now=0.3) == []


def test_drain_returns_unconfirmed_in_arrival_order_with_arrival_times():
    t = PendingTable()
    for i in range(5):
        t.add(u(i), f"v{i}", now=float(i))
    t.confirm(u(2), now=5.0)
    drained = t.drain()
    assert drained == [Pending(u(0), "v0", 0.0), Pending(u(1), "v1", 1.0),
                       Pending(u(3), "v3", 3.0), Pending(u(4), "v4", 4.0)]
    assert len(t) == 0 and t.early_count == 0
    assert t.counters["drained"] == 4


def test_duplicate_uuid_keeps_the_first():
    t = PendingTable()
    assert t.add(u(7), "first", now=0.0)
    assert not t.add(u(7), "second", now=1.0)
    assert t.drain() == [Pending(u(7), "first", 0.0)]
    assert t.counters["duplicates"] == 1


def test_empty_uuid_is_never_tracked_and_never_crashes():
    t = PendingTable()
    assert t.add(b"", "no uuid", now=0.0) is False
    assert t.add(b"", "again", now=0.0) is False
    assert t.confirm(b"", now=0.0) is False
    assert len(t) == 0 and t.early_count == 0
    assert t.counters["untracked"] == 2
    assert t.drain() == []


def test_count_bound_evicts_the_oldest():
    t = PendingTable(max_entries=3, max_age_s=100.0)
    for i in range(5):
        t.add(u(i), i, now=0.0)
    assert len(t) == 3
    assert [p.update for p in t.drain()] == [2, 3, 4]
    assert t.counters["evicted"] == 2


def test_byte_bound_evicts_the_oldest_and_keeps_the_sum_exact():
    t = PendingTable(max_entries=100, max_age_s=10.0, max_bytes=10_000)
    for i in range(5):
        t.add(u(i), i, now=0.0, size=3_000)
    assert t.bytes == 9_000 and t.counters["evicted_bytes"] == 2
    assert [p.update for p in t.drain()][:1] == [2] and t.bytes == 0
    t.add(u(10), 10, now=0.0, size=50_000)  # larger than the budget: kept alone
    assert len(t) == 1 and t.bytes == 50_000
    t.add(u(11), 11, now=1.0, size=100)
    assert [p.update for p in t.drain()] == [11]
    t.add(u(12), 12, now=2.0, size=700)
    t.add(u(13), 13, now=5.0, size=800)
    assert t.confirm(u(12), now=5.0) and t.bytes == 800
    t.expire(100.0)
    assert len(t) == 0 and t.bytes == 0


def test_early_confirmations_are_bounded_too():
    t = PendingTable(max_entries=3, max_age_s=100.0)
    for i in range(10):
        t.confirm(u(i), now=0.0)
    assert t.early_count == 3
    assert t.counters["early_evicted"] == 7
    # an evicted early confirmation no longer matches: the late client update is kept
    assert t.add(u(0), "late", now=1.0) is True


def test_age_bound_expires_on_expire_add_confirm_and_drain():
    t = PendingTable(max_entries=100, max_age_s=10.0)
    t.add(u(1), "old", now=0.0)
    t.add(u(2), "newer", now=5.0)
    assert t.expire(10.0) == 0          # exactly max_age_s old: kept
    assert t.expire(10.5) == 1
    assert list(t.drain(now=10.5)) == [Pending(u(2), "newer", 5.0)]
    t.add(u(3), "x", now=20.0)
    t.add(u(4), "y", now=40.0)          # add expires u(3)
    assert u(3) not in t and u(4) in t
    t.confirm(u(9), now=40.0)
    assert t.confirm(u(10), now=60.0) is False  # confirm expires u(4) and early u(9)
    assert u(4) not in t and t.early_count == 1
    assert t.drain(now=80.0) == []      # drain(now) expires first
    assert t.counters["expired"] == 3
    assert t.counters["early_expired"] == 2  # u(9), then u(10) in drain


def test_clock_going_backwards_keeps_order():
    t = PendingTable(max_entries=10, max_age_s=10.0)
    t.add(u(1), "a", now=100.0)
    t.add(u(2), "b", now=50.0)  # treated as 100.0
    assert [p.added_at for p in t.drain()] == [100.0, 100.0]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        PendingTable(max_entries=0)
    with pytest.raises(ValueError):
        PendingTable(max_age_s=0)


def test_no_leak_over_millions_of_updates():
    """1M updates at 100k/s, both arrival orders, 1% never confirmed, some confirmations
    never matched: the table never holds more than its bounds."""
    t = PendingTable(max_entries=5_000, max_age_s=2.0)
    rng = random.Random(1)
    n = 1_000_000
    high = 0
    for i in range(n):
        now = i * 1e-5
        uuid = u(i)
        r = rng.random()
        if r < 0.5:
            t.add(uuid, None, now)
            t.confirm(uuid, now)
        elif r < 0.99:
            t.confirm(uuid, now)
            t.add(uuid, None, now)
        elif r < 0.995:
            t.add(uuid, None, now)          # the active never publishes it
        else:
            t.confirm(uuid, now)            # the client's copy never reaches us
        if i % 1000 == 0:
            high = max(high, len(t) + t.early_count)
    assert high <= 2 * 5_000
    assert len(t) <= 5_000 and t.early_count <= 5_000
    assert t.counters["expired"] + t.counters["evicted"] > 0
    # everything unconfirmed is older than 2 s or still within bounds
    t.expire(n * 1e-5 + 10.0)
    assert len(t) == 0 and t.early_count == 0


# ----------------------------------------------------------------- properties

events = st.lists(st.tuples(st.sampled_from(["add", "confirm", "tick"]),
                            st.integers(0, 30), st.floats(0, 3)), max_size=200)


@settings(max_examples=200)
@given(events, st.integers(1, 10), st.floats(0.5, 20))
def test_model(evts, max_entries, max_age_s):
    """Against a naive model: what drains is exactly the client updates that were neither
    confirmed (before or after), nor too old, nor evicted, in arrival order."""
    t = PendingTable(max_entries=max_entries, max_age_s=max_age_s)
    now = 0.0
    pending: list[tuple[int, float]] = []   # (uuid, time) in arrival order
    early: list[tuple[int, float]] = []
    for kind, n, dt in evts:
        now += dt
        cutoff = now - max_age_s
        pending = [(x, at) for x, at in pending if at >= cutoff]
        early = [(x, at) for x, at in early if at >= cutoff]
        if kind == "add":
            assert t.add(u(n), n, now) == (n not in [x for x, _ in early + pending])
            if any(x == n for x, _ in early):
                early = [(x, at) for x, at in early if x != n]
            elif not any(x == n for x, _ in pending):
                pending.append((n, now))
                pending = pending[-max_entries:]
        elif kind == "confirm":
            was = any(x == n for x, _ in pending)
            assert t.confirm(u(n), now) == was
            if was:
                pending = [(x, at) for x, at in pending if x != n]
            elif not any(x == n for x, _ in early):
                early.append((n, now))
                early = early[-max_entries:]
        else:
            t.expire(now)
        assert len(t) <= max_entries and t.early_count <= max_entries
    assert [(int.from_bytes(p.uuid, "big"), p.added_at) for p in t.drain(now)] == pending


class PendingMachine(RuleBasedStateMachine):
    """Random interleavings: bounds always hold and counters add up."""

    def __init__(self):
        super().__init__()
        self.t = PendingTable(max_entries=8, max_age_s=5.0)
        self.now = 0.0

    @rule(n=st.integers(0, 20), dt=st.floats(0, 2))
    def add(self, n, dt):
        self.now += dt
        self.t.add(u(n), n, self.now)

    @rule(n=st.integers(0, 20), dt=st.floats(0, 2))
    def confirm(self, n, dt):
        self.now += dt
        self.t.confirm(u(n), self.now)

    @rule()
    def add_empty(self):
        self.t.add(b"", None, self.now)

    @precondition(lambda self: len(self.t) > 0)
    @rule()
    def drain(self):
        out = self.t.drain(self.now)
        assert [p.added_at for p in out] == sorted(p.added_at for p in out)

    @invariant()
    def bounded_and_balanced(self):
        c = self.t.counters
        assert len(self.t) <= 8 and self.t.early_count <= 8
        assert c["added"] == (len(self.t) + c["confirmed"] + c["evicted"] + c["expired"]
                              + c["drained"])


TestPendingMachine = PendingMachine.TestCase
