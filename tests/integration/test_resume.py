"""Resume from a sequence (our extension of ICANHAZ?): a client that was away briefly gets
only the updates it missed; past the server's history, a full snapshot that says so.

Frame level first (a raw DEALER playing the client against a real server), then the
client across a real Binary Star failover: the backup applied the active's stream with
its sequences, so it serves the resume of a client that moves to it.
"""
from __future__ import annotations

import time

import pytest
import zmq

from conftest import wait_until as wait_for
from clonemap.client.api import Clone
from clonemap.shards.common.proto import chp
from test_pair import ACTIVE, PASSIVE, Watcher, start_pair, two_bases
from test_pair import start_server as start_pair_server
from test_relay import stats_of
from test_server_conformance import DEADLINE_S, Peer, start_server

pytestmark = pytest.mark.timeout(120)


def generation_of(peer: Peer) -> str:
    """The server's map generation, from a clock HUGZ."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        frames = peer.sub.recv_multipart() if peer.sub.poll(200) else None
        if frames and frames[0] == chp.HUGZ and frames[3]:
            gen = chp.parse_props(frames[3]).get("gen")
            if gen:
                return gen
    raise AssertionError("no HUGZ with a generation")


def ask(zctx, port: int, *frames: bytes) -> list[list[bytes]]:
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart(list(frames))
    out = []
    while True:
        assert dealer.poll(DEADLINE_S * 1000), "no reply"
        msg = dealer.recv_multipart()
        out.append(msg)
        if msg[0] == chp.KTHXBAI:
            dealer.close(0)
            return out


def test_a_covered_resume_sends_only_the_updates_after_it(procs, port_base, zctx):
    # room for the writes below and for every probe ``sync`` sends until the paths are
    # live (one each 50 ms: many more on a loaded host, which once pushed the resumed-from
    # sequence out of a 50-update history)
    start_server(procs, port_base, "--history-updates", "1000")
    peer = Peer(zctx, port_base)
    gen = generation_of(peer)
    base = peer.sync()  # the fence's sequence: the writes below follow it
    for i in range(30):
        peer.kvset(b"/r/%d" % (i % 10), b"v%d" % i, uuid=bytes([i + 1]) * 16)
    peer.kvset(b"/r/3", b"")  # a delete
    peer.kvset(b"/other/x", b"o")
    last = peer.sync()
    reply = ask(zctx, port_base, *chp.icanhaz(b"/r/", base + 25, gen))
    kth = chp.decode_snapshot(reply[-1], strict=False)
    assert chp.kthxbai_info(kth.props).resumed and kth.subtree == b"/r/" and kth.seq == last
    updates = [chp.decode_snapshot(m, strict=False) for m in reply[:-1]]
    # writes 26..30, then the delete (31); /other/ and the probes are outside /r/
    assert [u.seq - base for u in updates] == list(range(26, 32))
    assert updates[0].key == b"/r/5" and updates[0].value == b"v25"
    assert updates[0].uuid == bytes([26]) * 16
    assert updates[-1].key == b"/r/3" and updates[-1].value == b"" 
    # nothing missed: an empty resume
    reply = ask(zctx, port_base, *chp.icanhaz(b"", kth.seq, gen))
    assert len(reply) == 1
    assert chp.kthxbai_info(chp.decode_snapshot(reply[0], strict=False).props).resumed


def test_past_the_history_or_another_generation_a_full_snapshot_says_resume_0(
        procs, port_base, zctx):
    start_server(procs, port_base, "--history-updates", "5")
    peer = Peer(zctx, port_base)
    gen = generation_of(peer)
    base = peer.sync()
    for i in range(20):
        peer.kvset(b"/r/%d" % i, b"v")
    last = peer.sync()
    for frames in (chp.icanhaz(b"/r/", base + 3, gen), chp.icanhaz(b"/r/", last, "0" * 16)):
        reply = ask(zctx, port_base, *frames)
        kth = chp.decode_snapshot(reply[-1], strict=False)
        assert chp.kthxbai_info(kth.props).resumed is False
        assert sorted(chp.decode_snapshot(m).key for m in reply[:-1]) == sorted(
            b"/r/%d" % i for i in range(20))
    # a plain 12/CHP ICANHAZ still gets a plain KTHXBAI (frame 3 empty)
    reply = ask(zctx, port_base, *chp.icanhaz(b"/r/"))
    assert chp.decode_snapshot(reply[-1]).subtree == b"/r/"


def client_stats(clone: Clone) -> dict:
    return clone.stats()["shards"][0]




@pytest.mark.parametrize("history, resumed", [("100000", True), ("3", False)])
def test_a_client_that_fails_over_resumes_from_the_backup(procs, zctx, port_base, history,
                                                          resumed):
    primary_port, backup_port = two_bases(port_base)
    primary, backup, watch = start_pair(procs, zctx, primary_port, backup_port,
                                        "--history-updates", history)
    pair = [f"tcp://127.0.0.1:{primary_port}", f"tcp://127.0.0.1:{backup_port}"]
    # the reader notices the silence after 4.5 s, the writer after 0.6 s: every update
    # below is written while the reader is away, and reaches it only by its resync
    with Clone(pair, heartbeat_s=1.5, timeout_s=15) as reader, \
            Clone(pair, heartbeat_s=0.2, timeout_s=15) as writer:
        for i in range(200):
            writer.set(f"/k/{i}", b"before", wait=(i == 199))
        wait_for(lambda: reader.get("/k/199") == b"before", "the reader's copy")
        assert client_stats(reader)["snapshots"] == 1
        first_term = client_stats(reader)["term"]
        assert first_term > 0  # the primary's term, from its KTHXBAI (sent with a resume)
        # the backup's replica holds the 200 (its state messages say so): killed before
        # that, on a loaded host, the backup took over with a new, empty map, which the
        # client reported as DATA LOSS: an in-memory pair's asynchronous replication, not
        # what this test is about
        watch[backup_port].wait_seq(200)
        primary.popen.kill()  # SIGKILL of the active: the writer moves and votes
        for i in range(20):
            writer.set(f"/k/{i}", b"after", wait=True)
        writer.delete("/k/150", wait=True)
        assert client_stats(reader)["failovers"] == 0  # still away: nothing heard yet
        wait_for(lambda: reader.get("/k/19") == b"after" and "/k/150" not in reader,
                 "the missed updates at the reader")
        stats = client_stats(reader)
        assert stats["failovers"] == 1
        assert stats["term"] > first_term  # the backup took over in a later term
        if resumed:
            assert (stats["resumes"], stats["resumes_refused"]) == (1, 0), stats
            assert stats["resume_updates"] == 21, stats  # the 21 missed, nothing else
            assert stats["snapshots"] == 2  # the resume is installed as a sync
        else:
            assert (stats["resumes"], stats["resumes_refused"]) == (0, 1), stats
        assert dict(reader.items()) == dict(writer.items())
        assert len(reader) == 199


def hugz_props(peer: Peer) -> dict[str, str]:
    """The properties of the server's next clock HUGZ."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        frames = peer.sub.recv_multipart() if peer.sub.poll(200) else None
        if frames and frames[0] == chp.HUGZ and b"ts=" in frames[3]:
            return chp.parse_props(frames[3])
    raise AssertionError("no clock HUGZ")


def test_a_resume_across_a_takeover_is_refused_past_what_the_new_active_holds(
        procs, zctx, port_base, tmp_path):
    """Replication is asynchronous: the active can publish an update its passive never
    gets. The passive then takes over and gives that sequence to another update. A client
    holding the lost update must not be resumed past it (it would keep the lost update
    and never get the new one): the resume names the term its updates came from, and
    the new active resumes it only before the first sequence of its own term."""
    primary_port, backup_port = two_bases(port_base)
    backup_dir = str(tmp_path / "backup")
    durable = ("--data-dir", backup_dir, "--fsync", "always")
    primary = start_pair_server(procs, primary_port, "primary", backup_port)
    backup = start_pair_server(procs, backup_port, "backup", primary_port, *durable)
    watch = Watcher(zctx, backup_port)
    watch.wait_state(PASSIVE)
    peer = Peer(zctx, primary_port)
    old = hugz_props(peer)
    gen, old_term = old["gen"], int(old["term"])
    peer.sync()  # the writes below are not lost to a connection still being made
    for i in range(5):
        peer.kvset(b"/t/%d" % i, b"kept")
    common = peer.sync()
    watch.wait_seq(common)  # the backup holds everything up to here
    backup.popen.kill()
    backup.popen.wait()
    peer.kvset(b"/t/lost", b"never replicated", uuid=b"L" * 16)
    lost = chp.decode_update(peer.recv_update())
    assert (lost.key, lost.seq) == (b"/t/lost", common + 1)  # a client applied it
    primary.popen.kill()
    primary.popen.wait()
    # the durable backup holds the later map: it becomes active in a new term
    backup = start_pair_server(procs, backup_port, "backup", primary_port, *durable)
    start_pair_server(procs, primary_port, "primary", backup_port)
    Watcher(zctx, backup_port).wait_state(ACTIVE)
    new = hugz_props(Peer(zctx, backup_port))
    assert new["gen"] == gen and int(new["term"]) > old_term
    with Clone(f"tcp://127.0.0.1:{backup_port}", timeout_s=15) as writer:
        writer.set("/t/new", b"after the takeover", wait=True)
    # the client of the old term, holding the lost update: a full snapshot instead
    reply = ask(zctx, backup_port, *chp.icanhaz(b"/t/", lost.seq, gen, term=old_term))
    kth = chp.decode_snapshot(reply[-1], strict=False)
    assert chp.kthxbai_info(kth.props)[:2] == (False, int(new["term"]))
    full = {m.key: m.value for m in map(chp.decode_snapshot, reply[:-1])}
    assert full == {**{b"/t/%d" % i: b"kept" for i in range(5)},
                    b"/t/new": b"after the takeover"}
    # a client of the old term that stopped before it: resumed, with the new update
    reply = ask(zctx, backup_port, *chp.icanhaz(b"/t/", common, gen, term=old_term))
    assert chp.kthxbai_info(chp.decode_snapshot(reply[-1], strict=False).props).resumed
    updates = [chp.decode_snapshot(m, strict=False) for m in reply[:-1]]
    assert [(u.key, u.seq) for u in updates] == [(b"/t/new", lost.seq)]  # the same number
    # a client of the new term: resumed; of a term the map never had: refused
    for term, resumed in ((int(new["term"]), True), (int(new["term"]) + 1, False)):
        reply = ask(zctx, backup_port, *chp.icanhaz(b"/t/", lost.seq, gen, term=term))
        assert chp.kthxbai_info(chp.decode_snapshot(reply[-1], strict=False).props
                                ).resumed is resumed
    assert stats_of(backup)["resumes_refused_term"] == 2


def test_a_standalone_map_restored_without_its_tail_refuses_a_resume_past_it(
        procs, zctx, port_base, tmp_path):
    """A durable standalone server restarted from a copy of its data directory taken
    before its last update (a restored backup; or the tail ``fsync: everysec`` loses to an
    OS crash) gives that update's sequence to another one, under the same generation. A
    client that saw the lost update resumes only up to where the new process started."""
    import shutil

    data, backup = tmp_path / "data", tmp_path / "backup"
    durable = ("--data-dir", str(data), "--fsync", "always")
    server = start_server(procs, port_base, *durable)
    peer = Peer(zctx, port_base)
    gen = hugz_props(peer)["gen"]
    peer.sync()
    for i in range(5):
        peer.kvset(b"/t/%d" % i, b"kept")
    common = peer.sync()
    server.popen.terminate()  # a clean stop, then the backup
    assert server.popen.wait(15) == 0
    shutil.copytree(data, backup)
    server = start_server(procs, port_base, *durable)
    peer = Peer(zctx, port_base)
    seen = hugz_props(peer)
    assert seen["gen"] == gen
    peer.sync()
    peer.kvset(b"/t/lost", b"not in the backup")
    while (lost := chp.decode_update(peer.recv_update())).key != b"/t/lost":
        pass
    assert lost.seq > common
    server.popen.kill()
    server.popen.wait()
    shutil.rmtree(data)
    shutil.copytree(backup, data)  # restored: the map ends at ``common`` again
    restored = start_server(procs, port_base, *durable)
    now = hugz_props(Peer(zctx, port_base))
    assert now["gen"] == gen and now["term"] != seen["term"]  # another process
    with Clone(f"tcp://127.0.0.1:{port_base}", timeout_s=15) as writer:
        for i in range(lost.seq - common):  # the lost sequence, given to another update
            writer.set(f"/t/new{i}", b"after the restore", wait=True)
    old_term, new_term = int(seen["term"]), int(now["term"])
    reply = ask(zctx, port_base, *chp.icanhaz(b"/t/", lost.seq, gen, term=old_term))
    assert chp.kthxbai_info(chp.decode_snapshot(reply[-1], strict=False).props)[:2] == (
        False, new_term)
    full = {m.key for m in map(chp.decode_snapshot, reply[:-1])}
    assert b"/t/lost" not in full and b"/t/new0" in full and b"/t/4" in full
    reply = ask(zctx, port_base, *chp.icanhaz(b"/t/", common, gen, term=old_term))
    assert chp.kthxbai_info(chp.decode_snapshot(reply[-1], strict=False).props).resumed
    assert {chp.decode_snapshot(m, strict=False).key for m in reply[:-1]} == {
        b"/t/new%d" % i for i in range(lost.seq - common)}
    reply = ask(zctx, port_base, *chp.icanhaz(b"/t/", lost.seq, gen, term=new_term))
    assert chp.kthxbai_info(chp.decode_snapshot(reply[-1], strict=False).props).resumed
    assert stats_of(restored)["resumes_refused_term"] == 1
