"""The passive's synchronisation machine, pure (``clonemap.shards.replica_machine``): a fake link in
memory plays the active (its sequence moves while the TTL table and the snapshot stream),
a fake clock drives deadlines. No zmq, no sockets: milliseconds.
"""
from __future__ import annotations

import pytest

from clonemap.shards import replica_machine as rm
from clonemap.shards.replica_machine import (Abandon, BufferOverflow, Gap, Install, Malformed,
                                    OpenSync, RequestSnapshot, SnapshotDone, SnapshotItem,
                                    StartSync, Stop, StopFollowing, Tick, TtlChunk)

CFG = rm.Config(sync_timeout_s=2.0, retry_s=1.0)


class FakeLink:
    """The passive's shell with a fake active behind it: the buffer of KVPUB sequences
    heard during the sync, and every effect the machine asked for."""

    def __init__(self):
        self.state = rm.State(CFG)
        self.effects: list = []
        self.buffered: list[int] = []
        self.active_seq = 100

    def step(self, event, now: float) -> list:
        self.state, out = rm.step(self.state, event, now)
        self.effects.extend(out)
        for e in out:
            if isinstance(e, (OpenSync, Abandon)):
                self.buffered = []
        return out

    def publish(self, n: int = 1) -> None:
        """The active applies ``n`` updates; the passive's SUB hears them in order."""
        for _ in range(n):
            self.active_seq += 1
            if rm.buffering(self.state):
                self.buffered.append(self.active_seq)

    def done(self, snap_seq: int, now: float) -> list:
        return self.step(SnapshotDone(snap_seq, list(self.buffered)), now)


def test_a_sync_with_writes_between_the_table_and_the_snapshot_installs_t_to_s():
    link = FakeLink()
    assert link.step(StartSync(), 0.0) == [OpenSync()]
    link.publish(3)                        # heard while the TTL table is asked for
    table_at = link.active_seq             # T = 103
    assert link.step(TtlChunk(table_at, last=False), 0.1) == []
    link.publish(2)
    assert link.step(TtlChunk(table_at, last=True), 0.2) == [RequestSnapshot()]
    assert link.state.step == rm.SNAPSHOT
    link.publish(4)                        # the snapshot is taken at S = 109
    snap_at = link.active_seq
    assert rm.accepts_snapshot(link.state)
    link.publish(2)                        # after S: replayed by the live rule
    assert link.done(snap_at, 0.5) == [Install(table_at, snap_at)]
    assert link.state.phase == rm.LIVE and link.state.seq == snap_at
    assert not rm.buffering(link.state)


def test_a_snapshot_at_the_table_sequence_needs_no_buffered_update():
    link = FakeLink()
    link.step(StartSync(), 0.0)
    link.step(TtlChunk(100, last=True), 0.1)
    assert link.done(100, 0.2) == [Install(100, 100)]


@pytest.mark.parametrize("heard, why", [
    ([101, 102, 104], "updates 101..104 not all heard (3 buffered)"),  # a hole
    ([102, 103, 104], "updates 101..104 not all heard (3 buffered)"),  # joined late
    ([101, 103, 102, 104], "updates 101..104 not all heard (4 buffered)"),  # out of order
])
def test_a_span_not_all_heard_starts_over_after_a_pause(heard, why):
    link = FakeLink()
    link.step(StartSync(), 0.0)
    link.step(TtlChunk(100, last=True), 0.1)
    link.buffered = heard
    assert link.done(104, 0.2) == [Abandon(why)]
    assert link.state.step == rm.RETRY
    assert link.step(Tick(0.0), 0.2 + CFG.retry_s / 2) == []           # pausing
    assert link.step(Tick(0.0), 0.2 + CFG.retry_s) == [OpenSync()]     # fresh DEALER
    assert link.state.step == rm.TTL


def test_span_check_is_plain_sequence_arithmetic():
    assert rm.check_span(5, 8, [3, 6, 7, 8, 9]) == ""
    assert rm.check_span(5, 5, []) == ""
    assert rm.check_span(5, 8, [6, 8]) != ""


def test_no_reply_for_the_sync_timeout_starts_over():
    link = FakeLink()
    link.step(StartSync(), 0.0)
    assert link.step(Tick(0.0), CFG.sync_timeout_s) == []  # not past the deadline yet
    assert link.step(Tick(0.0), CFG.sync_timeout_s + 0.01) == [
        Abandon("no reply for 2 s", timeout=True)]
    # every reply moves the deadline: a long snapshot is not a timeout
    link.step(Tick(0.0), 10.0)  # the retry: OpenSync at 10.0
    link.step(TtlChunk(7, last=True), 10.5)
    assert link.step(Tick(11.9), 13.5) == []


@pytest.mark.parametrize("events, why", [
    ([TtlChunk(7, False), TtlChunk(8, True)], "TTL chunks of two tables (7, 8)"),
    ([TtlChunk(7, True), TtlChunk(7, True)], "a TTL chunk after the TTL table's last"),
    ([SnapshotItem()], "snapshot before the TTL table"),
    ([SnapshotDone(7, [])], "snapshot before the TTL table"),
    ([Malformed("bad_ttl_table")], "malformed reply (bad_ttl_table)"),
    ([BufferOverflow(200000)], "more than 200000 updates while the snapshot streamed"),
])
def test_faults_of_the_active_or_the_link_abandon_the_sync(events, why):
    link = FakeLink()
    link.step(StartSync(), 0.0)
    out = []
    for i, event in enumerate(events):
        out = link.step(event, 0.1 * (i + 1))
    assert out == [Abandon(why)] and link.state.step == rm.RETRY
    # replies to the abandoned request are ignored until the retry
    assert link.step(TtlChunk(7, True), 0.9) == []


def test_a_live_gap_resyncs_at_once_but_not_while_taking_over():
    link = FakeLink()
    link.step(StartSync(), 0.0)
    link.step(TtlChunk(100, True), 0.1)
    link.done(100, 0.2)
    assert rm.check_seq(100, 101) == rm.APPLY
    assert rm.check_seq(100, 100) == rm.DUPLICATE
    assert rm.check_seq(100, 103) == rm.GAP
    assert link.step(Gap(100, 103), 1.0) == [OpenSync()]
    link.step(TtlChunk(103, True), 1.1)
    link.done(103, 1.2)
    assert link.step(Gap(103, 105, taking_over=True), 2.0) == [StopFollowing(False)]
    assert link.state.phase == rm.IDLE


def test_stop_mid_sync_says_the_replica_was_incomplete():
    link = FakeLink()
    link.step(StartSync(), 0.0)
    assert link.step(Stop(), 0.5) == [StopFollowing(True)]
    assert link.step(Stop(), 0.6) == []                      # already idle
    assert link.step(TtlChunk(1, True), 0.7) == []           # nothing follows now
    assert link.step(Tick(0.0), 99.0) == []


def test_unknown_events_are_refused():
    link = FakeLink()
    link.step(StartSync(), 0.0)
    with pytest.raises(TypeError):
        rm.step(link.state, object(), 0.1)


def test_an_abandoned_sync_neither_buffers_nor_applies_until_it_starts_again():
    """Between an abandoned sync and the next (the retry's pause), a KVPUB is discarded:
    the next sync opens with an empty buffer, and the map is not live."""
    link = FakeLink()
    link.step(StartSync(), 0.0)
    assert rm.buffering(link.state) and not rm.discarding(link.state)
    assert [type(e) for e in link.step(BufferOverflow(10), 0.1)] == [Abandon]
    assert rm.discarding(link.state) and not rm.buffering(link.state)
    link.publish(5)
    assert link.buffered == []
    assert link.step(Tick(0.1), 1.2) == [OpenSync()]  # retry_s later
    assert rm.buffering(link.state) and not rm.discarding(link.state)
