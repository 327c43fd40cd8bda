"""The client's shard machine, pure: events in, effects out, time passed in. No zmq."""
from __future__ import annotations

import pytest

from clonemap.client import shard_machine as sm
from clonemap.client.shard_machine import (ACTIVE, INITIAL, SYNCING, BufferOverflow, Config,
                                  Connect, Failover, Gap, InstallSnapshot, RequestSnapshot,
                                  SequenceBackwards, SnapshotDone, Start, State,
                                  SubscriberLive, Tick, step)


def run(state, events):
    """Feed ``(now, event)`` pairs; return the final state and all effects in order."""
    effects = []
    for now, event in events:
        state, out = step(state, event, now)
        effects.extend(out)
    return state, effects


def active(config=Config(), now=0.0, seq=10):
    state, _ = run(State(config), [(now, Start()), (now, SubscriberLive()),
                                   (now, SnapshotDone(seq))])
    assert state.phase == ACTIVE
    return state


def test_start_connects_and_waits_for_the_subscription_before_asking():
    state, effects = step(State(), Start(), 1.0)
    assert state.phase == INITIAL and effects == [Connect(0)]
    # ticks while the subscription is not live ask for nothing (one server: keep waiting)
    state, effects = step(state, Tick(0.0, 0.0), 100.0)
    assert effects == [] and state.phase == INITIAL
    state, effects = step(state, SubscriberLive(), 100.5)
    assert state.phase == SYNCING and effects == [RequestSnapshot(0, "start")]
    assert state.attempts == 1


def test_kthxbai_installs_the_snapshot_and_goes_active():
    state, effects = run(State(), [(0, Start()), (0, SubscriberLive()),
                                   (1, SnapshotDone(42))])
    assert state.phase == ACTIVE and state.snapshot_seq == 42 and state.synced
    assert effects[-1] == InstallSnapshot(42, resync=False)
    assert state.attempts == 0


def test_events_out_of_phase_are_ignored():
    state = State()
    for event in (SubscriberLive(), SnapshotDone(1), Gap(1, 3), Tick(0, 0)):
        assert step(state, event, 0) == (state, [])  # not started
    state, _ = step(state, Start(), 0)
    assert step(state, SnapshotDone(5), 0) == (state, [])   # not SYNCING
    assert step(state, Gap(1, 3), 0) == (state, [])         # not ACTIVE
    assert step(state, BufferOverflow(9), 0) == (state, [])  # INITIAL: nothing to redo
    assert step(state, Start(), 0) == (state, [])
    live = active()
    assert step(live, SubscriberLive(), 1) == (live, [])
    with pytest.raises(TypeError):
        step(live, object(), 0)


def test_snapshot_timeout_retries_then_moves_on():
    cfg = Config(sync_timeout_s=2.0, max_attempts=2)
    state, _ = run(State(cfg), [(0, Start()), (0, SubscriberLive())])
    # snapshot traffic keeps the request alive past the timeout
    state, effects = step(state, Tick(0.0, 1.5), 3.0)
    assert effects == []
    state, effects = step(state, Tick(0.0, 1.5), 3.6)
    assert effects == [RequestSnapshot(0, "snapshot timeout")] and state.attempts == 2
    state, effects = step(state, Tick(0.0, 1.5), 5.7)
    assert state.phase == INITIAL and state.server == 0 and state.attempts == 0
    assert [type(e) for e in effects] == [Failover, Connect]
    assert effects[0].reason == "no snapshot after 2 requests"


def test_a_pair_moves_to_the_other_server_after_two_refused_requests():
    cfg = Config(servers=2, sync_timeout_s=1.0)
    state, effects = run(State(cfg), [
        (0, Start()), (0, SubscriberLive()),
        (1, Tick(0, 0)),            # first request unanswered: ask again
        (2, Tick(0, 0)),            # second unanswered: next server
    ])
    assert state.server == 1 and state.phase == INITIAL
    assert effects == [Connect(0), RequestSnapshot(0, "start"),
                       RequestSnapshot(0, "snapshot timeout"),
                       Failover(0, 1, "no snapshot after 2 requests", 1.0), Connect(1)]
    state, effects = run(state, [(2.1, SubscriberLive()), (2.2, SnapshotDone(7))])
    # never heard: the outage starts at the move; the install ends it, writes resent
    outage = sm.Outage(0, 2, "no snapshot after 2 requests", 1.0)
    assert effects == [RequestSnapshot(1, "start"),
                       InstallSnapshot(7, resync=False, outage=outage, resend=True)]
    assert state.outage is None


def test_a_pair_gives_up_on_an_unreachable_server():
    state, _ = step(State(Config(servers=2, connect_timeout_s=3.0)), Start(), 0)
    state, effects = step(state, Tick(0, 0), 2.9)
    assert effects == []
    state, effects = step(state, Tick(0, 0), 3.0)
    assert effects == [Failover(0, 1, "no connection", 3.0), Connect(1)]


def test_silence_fails_over_and_resync_replaces():
    cfg = Config(servers=2, silence_timeout_s=3.0)
    state = active(cfg, now=10.0, seq=50)
    state, effects = step(state, Tick(12.0, 0), 14.9)
    assert effects == []  # heard 2.9 s ago
    state, effects = step(state, Tick(12.0, 0), 15.0)
    assert effects == [Failover(0, 1, "silent", 3.0), Connect(1)]
    state, effects = run(state, [(15.1, SubscriberLive()), (15.5, SnapshotDone(60))])
    assert effects == [RequestSnapshot(1, "reconnect"), InstallSnapshot(
        60, resync=True, outage=sm.Outage(0, 12.0, "silent", 3.0), resend=True)]
    assert state.phase == ACTIVE and state.server == 1


def test_silence_timeout_can_be_disabled():
    state = active(Config(silence_timeout_s=None))
    assert step(state, Tick(0, 0), 1e9) == (state, [])


def test_gap_and_backwards_sequence_resync_from_the_same_server():
    state = active(seq=10)
    state2, effects = step(state, Gap(11, 14), 1.0)
    assert state2.phase == SYNCING and state2.server == 0
    assert effects == [RequestSnapshot(0, "sequence gap (expected 11, got 14)")]
    state3, effects = step(state, SequenceBackwards(10, 3), 1.0)
    assert effects == [RequestSnapshot(0, "sequence went backwards (last 10, got 3)")]
    state4, effects = step(state3, SnapshotDone(3), 2.0)
    assert effects == [InstallSnapshot(3, resync=True)] and state4.snapshot_seq == 3


def test_buffer_overflow_requests_again_without_counting_against_the_server():
    cfg = Config(servers=2, max_attempts=2)
    state, _ = run(State(cfg), [(0, Start()), (0, SubscriberLive())])
    for i in range(5):
        state, effects = step(state, BufferOverflow(100), 1.0 + i)
        assert effects == [RequestSnapshot(0, "sync buffer overflow (100 updates)")]
        assert state.attempts == 1 and state.server == 0
    # while replaying in ACTIVE, an overflow also means the buffer is incomplete
    state, effects = step(active(cfg), BufferOverflow(100), 1.0)
    assert state.phase == SYNCING and effects[0].reason.startswith("sync buffer overflow")


@pytest.mark.parametrize("last, seq, contiguous, verdict", [
    (10, 11, True, sm.ACCEPT),
    (10, 12, True, sm.GAP),
    (10, 10, True, sm.STALE),
    (10, 9, True, sm.STALE),
    (10, 12, False, sm.ACCEPT),   # a subtree filter hides other sequences
    (10, 10, False, sm.STALE),
    (0, 1, True, sm.ACCEPT),
])
def test_check_seq(last, seq, contiguous, verdict):
    assert sm.check_seq(last, seq, contiguous) == verdict


def test_config_is_validated():
    with pytest.raises(ValueError):
        Config(servers=0)
    with pytest.raises(ValueError):
        Config(max_attempts=0)


def test_machine_module_does_not_import_zmq():
    import sys
    import subprocess

    code = ("import sys, client.shard_machine, client.watch, client.codec; "
            "print('zmq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_reconnected_resyncs_from_the_same_server():
    """A SUB that reconnected may face a restarted, empty server: take a fresh snapshot
    from the same server; before any server is followed, a reconnect means nothing."""
    state = active(Config(servers=2))
    state, effects = step(state, sm.Reconnected(), 10.0)
    assert state.phase == SYNCING and state.server == 0
    assert [type(e) for e in effects] == [RequestSnapshot]
    assert step(State(Config()), sm.Reconnected(), 0.0)[1] == []


# ------------------------------------------------------------------ serving hint (pairs)

PAIR = Config(servers=2)


def test_a_server_that_says_it_is_not_serving_is_left_at_once():
    state, _ = step(State(PAIR), Start(), 0.0)
    state, effects = step(state, sm.NotServing(), 0.01)
    assert effects == [Failover(0, 1, "server not serving (passive)", 0.0, passive=True),
                       Connect(1)]
    assert state.phase == INITIAL and state.server == 1 and state.standby_streak == 1
    # the other server serves: the snapshot is asked there, and the streak ends with it
    state, effects = step(state, SubscriberLive(), 0.02)
    assert effects == [RequestSnapshot(1, "start")]
    state, _ = step(state, SnapshotDone(7), 0.05)
    assert state.phase == ACTIVE and state.standby_streak == 0


def test_when_every_server_says_so_the_shard_holds_then_tries_again():
    state, _ = step(State(PAIR), Start(), 0.0)
    state, _ = step(state, sm.NotServing(), 0.0)        # 0 -> 1
    state, effects = step(state, sm.NotServing(), 0.01)  # 1 too: hold on 1
    assert effects == [] and state.holding and state.server == 1
    assert step(state, sm.NotServing(), 0.02)[1] == []   # still holding
    assert step(state, Tick(0, 0), 0.01 + PAIR.standby_retry_s / 2)[1] == []
    state, effects = step(state, Tick(0, 0), 0.01 + PAIR.standby_retry_s)
    assert effects[-1] == Connect(0) and effects[0].reason == "every server not serving (passive)"
    assert not state.holding and state.standby_streak == 2
    state, effects = step(state, sm.NotServing(), 0.3)  # 0 still not: hold again
    assert effects == [] and state.holding


def test_a_held_server_that_starts_serving_is_asked():
    state, _ = run(State(PAIR), [(0, Start()), (0, sm.NotServing()), (0, sm.NotServing())])
    assert state.holding
    state, effects = step(state, SubscriberLive(), 0.1)  # a HUGZ without serving=0
    assert effects == [RequestSnapshot(1, "start")] and not state.holding


def test_an_active_shard_whose_server_stops_serving_moves():
    state = active(PAIR)
    state, effects = step(state, sm.NotServing(), 5.0)
    assert effects == [Failover(0, 1, "server not serving (passive)", 0.0, passive=True),
                       Connect(1)]


def test_a_lone_server_that_is_not_serving_is_asked_anyway():
    state, _ = step(State(), Start(), 0.0)
    state, effects = step(state, sm.NotServing(), 0.1)
    assert effects == [RequestSnapshot(0, "start (server not serving)")]
    assert step(active(), sm.NotServing(), 1.0)[1] == []


def test_timeouts_start_the_not_serving_count_again():
    state, _ = run(State(PAIR), [(0, Start()), (0, sm.NotServing())])
    assert state.standby_streak == 1
    state, effects = step(state, Tick(0, 0), 0 + PAIR.connect_timeout_s)  # 1 never connects
    assert effects[-1] == Connect(0) and state.standby_streak == 0


# ------------------------------------------------------------------ rejected snapshots

def test_a_rejected_snapshot_is_paced_like_a_timeout():
    state, _ = run(State(PAIR), [(0, Start()), (0, SubscriberLive())])
    state, effects = step(state, sm.SnapshotRejected("garbage"), 0.5)
    assert effects == [] and state.phase == SYNCING and state.attempts == 1
    assert step(state, Tick(0, 0.5), 0.5 + PAIR.sync_timeout_s / 2)[1] == []  # no tight loop
    state, effects = step(state, Tick(0, 0.5), 0.5 + PAIR.sync_timeout_s)
    assert effects == [RequestSnapshot(0, "snapshot timeout")] and state.attempts == 2
    state, _ = step(state, sm.SnapshotRejected("garbage"), 4.0)
    state, effects = step(state, Tick(0, 4.0), 4.0 + PAIR.sync_timeout_s)
    assert effects[-1] == Connect(1)  # attempts used up: the next server
    assert step(active(), sm.SnapshotRejected("x"), 1)[1] == []


def test_a_new_generation_resyncs_an_active_shard():
    state, effects = step(active(), sm.NewGeneration("aa", "bb"), 2.0)
    assert effects == [RequestSnapshot(0, "map generation changed (aa -> bb)")]
    state, _ = run(State(), [(0, Start())])
    assert step(state, sm.NewGeneration("aa", "bb"), 1)[1] == []  # not ACTIVE: ignored


# ------------------------------------------------------------------ the shell's state, here

def test_a_handshake_arms_the_grace_and_its_proof_asks_for_the_snapshot():
    state, _ = step(State(PAIR), Start(), 0.0)
    state, effects = step(state, sm.Handshake(), 0.1)
    assert effects == [sm.ArmGrace()] and state.live == "start"
    state, effects = step(state, sm.LiveProven(), 0.2)  # first message, or the grace's end
    assert effects == [RequestSnapshot(0, "start")] and state.live == ""
    assert step(state, sm.LiveProven(), 0.3) == (state, [])  # a late timer: nothing


def test_a_handshake_after_a_lost_connection_is_a_reconnection_and_resends_later():
    state = active(PAIR)
    assert step(state, sm.Handshake(), 1.0) == (state, [])  # connected all along: nothing
    state, _ = step(state, sm.Disconnected(), 1.0)
    assert state.sub_lost
    state, effects = step(state, sm.Handshake(), 2.0)
    assert effects == [sm.ArmGrace()] and state.live == "reconnect" and not state.sub_lost
    state, effects = step(state, sm.LiveProven(), 2.1)
    assert [type(e) for e in effects] == [RequestSnapshot] and state.resend
    state, effects = step(state, SnapshotDone(20), 2.5)
    assert effects[0].resend and effects[0].outage is None and not state.resend


def test_a_restarted_server_s_hugz_read_before_the_handshake_event_costs_one_resume():
    """The restarted server's first HUGZ (a new generation) and the SUB's handshake
    event reach the shell in either order. HUGZ first: the new map is asked for and
    installed, then the handshake's proof asks again; the map's generation is known by
    then, so that second request is a resume (what the integration test of a restarted
    server allows), never a second whole snapshot."""
    state, _ = run(State(Config(servers=1)), [(0, Start()), (0, SubscriberLive()),
                                              (1, SnapshotDone(5, "g1"))])
    state, _ = step(state, sm.Disconnected(), 2.0)
    state, effects = step(state, sm.NewGeneration("g1", "g2"), 2.5)
    assert [e.resume for e in effects] == [True]  # the server refuses it: a whole map
    state, effects = step(state, SnapshotDone(0, "g2"), 2.6)
    assert effects[0].old_generation == "g1" and effects[0].generation == "g2"
    state, effects = step(state, sm.Handshake(), 2.7)
    assert effects == [sm.ArmGrace()]
    state, effects = step(state, sm.LiveProven(), 2.8)
    assert [type(e) for e in effects] == [RequestSnapshot] and effects[0].resume
    state, effects = step(state, SnapshotDone(0, "g2"), 2.9)
    assert effects[0].generation == effects[0].old_generation == "g2"  # no data loss


def test_a_server_that_said_it_is_not_serving_gets_no_grace_until_it_says_otherwise():
    state, _ = run(State(PAIR), [(0, Start()), (0, sm.NotServing()), (0, sm.NotServing())])
    assert state.holding and state.not_serving
    assert step(state, sm.Handshake(), 0.1) == (state, [])
    state, _ = step(state, sm.Serving(), 0.15)
    assert not state.not_serving
    state, effects = step(state, sm.Handshake(), 0.2)  # (a later handshake would arm it)
    assert effects == [sm.ArmGrace()]
    state, effects = step(state, sm.NotServing(), 0.21)  # said so again: pending dropped
    assert state.live == "" and state.not_serving


def test_buffering_and_epochs_follow_connects_requests_and_replays():
    state, _ = step(State(PAIR), Start(), 0.0)
    assert state.buffering and state.epoch == 1
    state, _ = step(state, SubscriberLive(), 0.1)
    assert state.buffering and state.epoch == 2
    state, _ = step(state, SnapshotDone(5), 0.2)
    assert state.buffering  # until the shell has replayed its buffer
    state, _ = step(state, sm.Replayed(), 0.2)
    assert not state.buffering and step(state, sm.Replayed(), 0.3) == (state, [])
    state, _ = step(state, Gap(6, 9), 0.4)
    assert state.buffering and state.epoch == 3
    state, _ = step(state, Tick(0.4, 0.4), 0.4 + PAIR.sync_timeout_s)
    state, _ = step(state, Tick(0.4, 0.4), 0.4 + 2 * PAIR.sync_timeout_s)  # -> move
    assert state.phase == INITIAL and state.epoch == 5 and state.server == 1


def test_a_map_of_a_known_generation_is_resumed_unless_resume_is_off():
    for resume in (True, False):
        cfg = Config(servers=2, resume=resume)
        state, effects = run(State(cfg), [(0, Start()), (0, SubscriberLive()),
                                          (1, SnapshotDone(5, "g1"))])
        assert effects[-1] == InstallSnapshot(5, resync=False, generation="g1")
        state, effects = step(state, Gap(6, 8), 2)
        assert effects[0].resume is resume and state.resuming is resume
        state, effects = step(state, SnapshotDone(9, "g2"), 3)
        assert effects == [InstallSnapshot(9, resync=True, generation="g2",
                                           old_generation="g1")]
        assert state.generation == "g2" and not state.resuming
    state, effects = run(State(), [(0, Start()), (0, SubscriberLive()), (1, SnapshotDone(5)),
                                   (2, Gap(6, 8))])
    assert effects[-1].resume is False  # no generation named: a whole snapshot


def test_one_outage_spans_every_move_until_an_install():
    cfg = Config(servers=2, silence_timeout_s=1.0, connect_timeout_s=1.0)
    state = active(cfg, now=0.0)
    state, _ = step(state, Tick(3.0, 2.5), 3.5)
    assert state.heard_s == 3.0
    state, _ = step(state, Tick(3.0, 2.5), 4.0)       # silent 1 s: move to 1
    assert state.outage == sm.Outage(0, 3.0, "silent", 1.0)
    state, _ = step(state, Tick(3.0, 2.5), 5.0)       # 1 never connects: back to 0
    assert state.server == 0 and state.outage == sm.Outage(0, 3.0, "silent", 1.0)
    state, effects = run(state, [(5.1, SubscriberLive()), (5.2, SnapshotDone(11))])
    assert effects[-1].outage == sm.Outage(0, 3.0, "silent", 1.0) and effects[-1].resend
    assert state.outage is None


def test_keep_freezes_the_shard_and_every_later_event_is_ignored():
    state = active(PAIR)
    state, effects = step(state, sm.Keep("g1"), 1.0)
    assert effects == [sm.Freeze()] and state.phase == sm.KEPT and state.generation == "g1"
    for event in (Tick(0, 0), sm.Handshake(), sm.NotServing(), Gap(1, 3), Start(),
                  SubscriberLive(), sm.Reconnected(), sm.Keep("g2")):
        assert step(state, event, 100.0) == (state, [])


def test_the_module_doc_shows_the_table_step_reads():
    """The header's table is ``TABLE`` rendered: a change to a transition changes the
    doc's words, or this fails."""
    shown = "\n".join(("    " + line) if line else "" for line in
                      sm.render_table().splitlines())
    assert shown in sm.__doc__
    assert shown.count("\n") > 20


def test_the_table_has_a_row_for_every_event_and_a_cell_for_every_phase():
    events = set(sm.Event.__args__)
    assert set(sm.TABLE) == events and len(events) == 18
    for kind, cells in sm.TABLE.items():
        assert set(cells) == set(sm.PHASES), kind
        for phase, cell in cells.items():
            # "-" in the doc is exactly the cells that change nothing
            assert (cell.does == "-") == (cell.run is sm.NOTHING.run), (kind, phase)


def test_an_ignored_cell_changes_nothing_and_an_unknown_event_is_an_error():
    state = sm.step(sm.State(Config(servers=2)), sm.Start(), 0.0)[0]
    assert state.phase == INITIAL and sm.TABLE[sm.Gap][INITIAL] is sm.NOTHING
    assert sm.step(state, sm.Gap(1, 3), 1.0) == (state, [])
    with pytest.raises(TypeError, match="not a shard machine event"):
        sm.step(state, object(), 1.0)
