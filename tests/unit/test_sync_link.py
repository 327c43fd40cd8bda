"""Synchronous replication, the active's side (``clonemap.shards.sync_link.SyncLink``), alone:
a fake clock and timers, a fake link to the passive, a fake etcd record. The rule under
test: a batch is published (acknowledged) only once the passive confirmed every update
in it, or once going on alone is recorded; batches go out in the order they were
parked; a server that may not publish (past its lease) takes nothing from a
confirmation."""
from __future__ import annotations

import pytest

from clonemap.shards.common.proto.bstar import UPDATES
from clonemap.shards.outbox import Batch
from clonemap.shards.sync_link import SyncLink

TIMEOUT_S = 2.0
LINK = b"link-1"


class Timers:
    """A fake clock and ``call_later``: ``advance`` runs what comes due, in order."""

    def __init__(self):
        self.now = 100.0
        self.pending: list[list] = []

    def call_later(self, delay: float, callback):
        entry = [self.now + delay, callback, False]

        class Handle:
            def cancel(self_inner):
                entry[2] = True

        self.pending.append(entry)
        return Handle()

    def advance(self, seconds: float) -> None:
        until = self.now + seconds
        while True:
            due = sorted((e for e in self.pending if not e[2] and e[0] <= until),
                         key=lambda e: e[0])
            if not due:
                break
            entry = due[0]
            self.pending.remove(entry)
            self.now = entry[0]
            entry[1]()
        self.now = until


class Harness:
    def __init__(self, *, peer_gone: bool = False):
        self.timers = Timers()
        self.sent: list[list[bytes]] = []
        self.published: list[Batch] = []
        self.records: list[tuple[bool, object]] = []
        self.seq = 0
        self.active = True
        self.fenced = False
        self.gone = peer_gone
        self.unparked = 0
        self.link = SyncLink(
            shard="s0", name="primary", timeout_s=TIMEOUT_S, clock=lambda: self.timers.now,
            call_later=self.timers.call_later, send=self.send, publish=self.published.append,
            record_alone=lambda alone, done: self.records.append((alone, done)),
            current_seq=lambda: self.seq, is_active=lambda: self.active,
            may_publish=lambda: self.active and not self.fenced,
            peer_gone=lambda: self.gone, unparked=self.count_unparked)

    def send(self, messages):
        self.sent.extend(messages)
        return True

    def count_unparked(self):
        self.unparked += 1

    def batch(self, *seqs: int, replies: int = 1) -> Batch:
        """Updates ``seqs`` applied (the store's sequence moves to the last)."""
        updates = []
        for seq in seqs:
            updates += [f"/k/{seq}".encode(), seq.to_bytes(8, "big"), b"", b"", b"v"]
        self.seq = max(seqs)
        return Batch(self.seq, updates, [[b"writer", f"reply {s}".encode()]
                                         for s in seqs[:replies]], self.timers.now)

    def confirm(self, seq: int, link: bytes = LINK) -> None:
        self.link.on_confirmation(link, seq)


def published_seqs(h: Harness) -> list[int]:
    return [b.last_seq for b in h.published]


def test_a_batch_is_published_only_once_the_passive_confirms_all_of_it():
    h = Harness()
    h.link.on_follow(LINK, 0)
    batch = h.batch(1, 2, 3)
    assert h.link.park(batch) is True
    assert h.published == [] and h.link.parked == 3
    # every update went to the passive's link, one BSTAR-UPD message each
    assert [m[:2] for m in h.sent] == [[LINK, UPDATES]] * 3
    assert [m[2] for m in h.sent] == [b"/k/1", b"/k/2", b"/k/3"]
    h.confirm(2)  # part of it: not enough
    assert h.published == []
    h.confirm(3)
    assert h.published == [batch] and h.published[0].replies  # replies with the updates
    assert h.link.parked == 0 and h.unparked == 1
    assert h.link.timer is None  # nothing waits: no timeout armed


def test_batches_are_released_in_the_order_they_were_parked():
    h = Harness()
    h.link.on_follow(LINK, 0)
    first, second, third = h.batch(1, 2), h.batch(3), h.batch(4, 5)
    for batch in (first, second, third):
        assert h.link.park(batch)
    h.confirm(3)
    assert published_seqs(h) == [2, 3]
    h.confirm(1)  # an older confirmation changes nothing
    assert published_seqs(h) == [2, 3]
    h.confirm(5)
    assert published_seqs(h) == [2, 3, 5]


def test_a_confirmation_to_a_server_past_its_lease_publishes_nothing():
    h = Harness()
    h.link.on_follow(LINK, 0)
    h.link.park(h.batch(1))
    h.fenced = True
    h.confirm(1)
    assert h.published == [] and h.link.peer_has == 0
    h.fenced = False  # renewed in time: the next confirmation releases it
    h.confirm(1)
    assert published_seqs(h) == [1]


def test_a_confirmation_after_going_passive_publishes_nothing():
    h = Harness()
    h.link.on_follow(LINK, 0)
    h.link.park(h.batch(1))
    h.active = False
    h.confirm(1)
    assert h.published == []


def test_a_silent_passive_makes_it_go_alone_recorded_in_etcd_first():
    h = Harness()
    h.link.on_follow(LINK, 0)
    h.link.park(h.batch(1, 2))
    h.timers.advance(TIMEOUT_S - 0.01)
    assert h.records == []
    h.timers.advance(0.02)
    assert [alone for alone, _ in h.records] == [True]
    assert h.published == []  # not before the record is written
    h.link.park(h.batch(3))  # still waiting: parked behind
    assert h.published == []
    _, done = h.records[0]
    done(None)
    assert h.link.alone and published_seqs(h) == [2, 3]
    assert h.link.counters["went_alone"] == 1
    # alone: a new batch goes out at once, and to the passive still attached
    sent_before = len(h.sent)
    assert h.link.park(h.batch(4)) is False
    assert len(h.sent) == sent_before + 1


def test_a_failed_alone_record_publishes_nothing_and_tries_again():
    h = Harness()
    h.link.on_follow(LINK, 0)
    h.link.park(h.batch(1))
    h.timers.advance(TIMEOUT_S + 0.01)
    _, done = h.records[0]
    done(OSError("etcd unreachable"))
    assert h.published == [] and not h.link.alone
    assert h.link.counters["alone_failed"] == 1
    h.timers.advance(TIMEOUT_S)
    assert [alone for alone, _ in h.records] == [True, True]
    h.records[1][1](None)
    assert published_seqs(h) == [1]


def test_the_alone_record_is_cleared_once_the_passive_holds_everything_again():
    h = Harness()
    h.link.park(h.batch(1))
    h.timers.advance(TIMEOUT_S + 0.01)
    h.records[0][1](None)  # alone from sequence 1
    assert h.link.alone
    h.link.park(h.batch(2, 3))  # published at once
    h.link.on_follow(LINK, 1)  # the passive is back: it must confirm up to 3 first
    assert [m[2] for m in h.sent] == []  # nothing is parked: nothing re-sent
    h.confirm(2)
    assert [alone for alone, _ in h.records] == [True]
    h.confirm(3)
    assert [alone for alone, _ in h.records] == [True, False]
    h.records[1][1](None)
    assert not h.link.alone and h.link.counters["alone_cleared"] == 1
    assert h.link.park(h.batch(4)) is True  # synchronous again


def test_an_adopted_alone_record_acknowledges_at_once_and_is_cleared_by_the_passive():
    """A restarted server took the lease through an alone record its last run wrote
    (Binary Star's L5): it is alone from its first write, with nothing written to etcd,
    until the passive that copied its map confirms everything from then on."""
    h = Harness()
    h.seq = 40  # the map it recovered
    h.link.adopt_alone()
    h.link.adopt_alone()  # once
    assert h.link.alone and h.link.counters["alone_adopted"] == 1 and h.records == []
    assert h.link.park(h.batch(41)) is False  # acknowledged alone
    h.link.on_follow(LINK, 41)  # the passive copied the map up to 41
    h.link.park(h.batch(42))
    h.confirm(41)
    assert h.records == []  # it must hold 42 too: the sequence when it followed
    h.confirm(42)
    assert [alone for alone, _ in h.records] == [False]
    h.records[0][1](None)
    assert not h.link.alone and h.link.park(h.batch(43)) is True


def test_alone_the_record_stays_until_the_passive_holds_the_last_batch_acknowledged_alone():
    """The passive follows from 3 and confirms it while batch 4 went out alone: the
    record must stay until it holds 4 too, and batch 5, written once the passive holds
    where it followed, waits for it (it is not acknowledged alone: nothing to chase)."""
    h = Harness()
    h.link.park(h.batch(1))
    h.timers.advance(TIMEOUT_S + 0.01)
    h.records[0][1](None)
    h.link.park(h.batch(2, 3))
    h.link.on_follow(LINK, 3)
    assert h.link.park(h.batch(4)) is False  # alone: the passive is not there yet
    h.confirm(3)
    assert [alone for alone, _ in h.records] == [True]  # 4 was acknowledged alone
    assert h.link.park(h.batch(5)) is True  # synchronous again
    assert published_seqs(h) == [1]  # (2-3 and 4 went out at once: not parked)
    h.confirm(5)
    assert published_seqs(h) == [1, 5]
    assert [alone for alone, _ in h.records] == [True, False]


def test_with_the_peer_gone_a_parked_batch_records_going_alone_at_once():
    h = Harness(peer_gone=True)
    assert h.link.park(h.batch(1))
    assert [alone for alone, _ in h.records] == [True]
    h.records[0][1](None)
    assert published_seqs(h) == [1]


def test_a_second_record_waits_for_the_first():
    h = Harness(peer_gone=True)
    h.link.park(h.batch(1))
    h.link.go_alone_now()
    assert len(h.records) == 1


def test_parked_batches_are_resent_to_a_link_that_follows_from_before_them():
    h = Harness()
    h.link.park(h.batch(1))
    h.link.park(h.batch(2))
    assert h.sent == []  # no passive attached yet
    h.link.on_follow(LINK, 1)
    assert [m[2] for m in h.sent] == [b"/k/2"]
    h.confirm(2, link=b"link-2")  # a new link name is adopted
    assert h.link.peer == b"link-2" and published_seqs(h) == [1, 2]


def test_kept_while_passive_then_published_if_it_serves_that_map_again():
    h = Harness()
    kept = h.batch(1, 2)
    h.link.keep(kept)
    assert h.link.parked == 2 and h.link.peer is None
    h.link.resume(synchronous=False)
    assert h.published == [kept]


def test_kept_while_passive_then_dropped_with_the_map():
    h = Harness()
    h.link.keep(h.batch(1, 2))
    h.link.keep(Batch(2))  # nothing more: an empty batch is not kept
    assert len(h.link.awaiting) == 1
    assert h.link.drop() == 2
    assert h.link.parked == 0 and h.published == []


def test_resumed_synchronously_it_waits_for_the_passive_again():
    h = Harness()
    h.link.keep(h.batch(1))
    h.link.resume(synchronous=True)
    assert h.published == [] and h.link.timer is not None
    h.confirm(1)
    assert published_seqs(h) == [1]


@pytest.mark.parametrize("sent", [True, False])
def test_an_unsent_batch_is_counted(sent):
    h = Harness()
    h.link = SyncLink(
        shard="s0", name="primary", timeout_s=TIMEOUT_S, clock=lambda: h.timers.now,
        call_later=h.timers.call_later, send=lambda m: sent, publish=h.published.append,
        record_alone=lambda alone, done: None, current_seq=lambda: h.seq,
        is_active=lambda: True, may_publish=lambda: True, peer_gone=lambda: False)
    h.link.on_follow(LINK, 0)
    h.link.park(h.batch(1))
    assert h.link.counters["unsent"] == (0 if sent else 1)
