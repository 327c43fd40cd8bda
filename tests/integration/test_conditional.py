"""Conditional writes and exactly-once resends the way users run them: under
``supervisor start`` (durable by default, heartbeat 1 s), with ``supervisor kill`` of the
active in the middle, writer processes using the client's defaults, and frame-level peers
for what must be exact (a resend answered as a duplicate, the sequence counting each
application once)."""
from __future__ import annotations

import json
import os
import textwrap
import threading
import time

import pytest
import zmq

from conftest import PYTHON, ROOT
from test_failover_supervised import shard_key
from test_supervisor_cli import cli, start, wait_status, write_config

pytestmark = pytest.mark.timeout(180)

WRITERS = 3
INCREMENTS = 150

WRITER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    from clonemap.client.api import Clone, Conflict
    config, key, me, count, go = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), \
        sys.argv[5]
    wrote, conflicts, PACE_S = [], 0, 0.01
    with Clone(config=config, timeout_s=15) as c, open(go) as start:
        print("READY", flush=True)
        start.read()  # a FIFO: every writer starts when the test closes its end
        said = time.monotonic()
        while len(wrote) < count:
            if time.monotonic() - said > 5:  # what a failure message shows (stderr)
                said = time.monotonic()
                shard = next(s for s in c.stats()["shards"] if s["shard"] == "s0")
                print(f"progress: wrote {{len(wrote)}}, conflicts {{conflicts}}, key at "
                      f"{{c.meta(key)}}, shard s0 {{json.dumps(shard)}}", file=sys.stderr,
                      flush=True)
            meta = c.meta(key)
            n = json.loads(c.get(key))["n"] if meta else 0
            try:
                if meta is None:
                    c.set(key, json.dumps({{"n": 1, "by": me}}).encode(), create=True)
                else:
                    c.set(key, json.dumps({{"n": n + 1, "by": me}}).encode(),
                          if_seq=meta.seq)
                wrote.append(n + 1)
                time.sleep(PACE_S)  # a paced writer: the kill lands while they run
            except Conflict:
                conflicts += 1
    print(json.dumps({{"wrote": wrote, "conflicts": conflicts}}), flush=True)
""")


def test_compare_and_set_counter_across_a_kill_of_the_active(procs, tmp_path):
    """Writer processes increment one counter with compare-and-set; the active of its
    shard is killed (SIGKILL) while they run. Every increment a writer was told succeeded
    is in the final value exactly once: the successful values are 1..final, no two
    writers succeeded from the same base (no lost update), and none was applied twice
    (the final value is the count of successes)."""
    from clonemap.client.api import Clone

    config, control = write_config(tmp_path, "2shard.yaml")
    start(procs, config, tmp_path, "--backoff-initial-s", "0.2")
    rows = wait_status(control, lambda r: all(
        {r[f"s{i}/primary"]["bstar"], r[f"s{i}/backup"]["bstar"]} == {"ACTIVE", "PASSIVE"}
        for i in range(2)))
    with Clone(config=str(config)) as watcher:
        key = shard_key(watcher, "s0")
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(root=str(ROOT)))
    go = tmp_path / "go"
    os.mkfifo(go)
    # the test holds the FIFO's write end from before the writers start, so each opens
    # it at once, before READY, and waits in read() for the EOF of its close: a writer
    # that opened it only after READY could open it after that close, and block in
    # open() for good (a writer, descheduled between READY and open, once did)
    barrier = os.open(go, os.O_RDWR)
    writers = [procs.spawn([PYTHON, str(script), str(config), key, f"w{i}",
                            str(INCREMENTS), str(go)], ready="READY", timeout_s=30)
               for i in range(WRITERS)]
    with Clone(config=str(config)) as watcher:
        reached = threading.Event()

        def on_change(change):
            if change.kind == "put" and json.loads(change.value)["n"] >= 60:
                reached.set()

        with watcher.watch(key, on_change):
            os.close(barrier)  # all at once: they contend
            assert reached.wait(60), "the writers made no progress"
        active = "s0/primary" if rows["s0/primary"]["bstar"] == "ACTIVE" else "s0/backup"
        at_kill = json.loads(watcher.get(key))["n"]
        assert cli("kill", active, "--control", control).returncode == 0
    assert at_kill < WRITERS * INCREMENTS  # the writers were still at it
    other = "s0/backup" if active == "s0/primary" else "s0/primary"
    wait_status(control, lambda r: r[other]["bstar"] == "ACTIVE", timeout_s=40)
    results = [json.loads(w.wait_line("{", timeout_s=120)) for w in writers]
    for w in writers:
        assert w.wait(30) == 0
    successes = sorted(n for r in results for n in r["wrote"])
    assert len(successes) == WRITERS * INCREMENTS
    assert sum(r["conflicts"] for r in results) > 0  # they did contend
    with Clone(config=str(config)) as fresh:
        final = json.loads(fresh.get(key))
        meta = fresh.meta(key)
    assert successes == list(range(1, final["n"] + 1))
    assert final["n"] == WRITERS * INCREMENTS and meta.seq > 0


def _raw_pair_sockets(zctx, port: int, identity: bytes):
    """A collector XPUB (P+2), ready once the server subscribed, and a replies DEALER
    (P) with ``identity``, connected."""
    pub = zctx.socket(zmq.XPUB)
    pub.connect(f"tcp://127.0.0.1:{port + 2}")
    assert pub.poll(10_000), "the collector never subscribed"
    pub.recv()
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, identity)
    monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    assert monitor.poll(10_000), "the replies DEALER never connected"
    dealer.disable_monitor()
    monitor.close()
    return pub, dealer


def _kvreply(dealer, timeout_ms: int = 10_000):
    from clonemap.shards.common.proto import chp

    assert dealer.poll(timeout_ms), "no KVREPLY"
    return chp.decode_kvreply(dealer.recv_multipart())


def test_a_resend_after_the_active_died_is_applied_once(procs, tmp_path, zctx):
    """A KVSET applied by the active, whose acknowledgement the writer never saw, sent
    again (same UUID) to the new active after ``supervisor kill``: answered as a
    duplicate naming the first sequence, and nothing is applied again (the key keeps
    that sequence, the shard's sequence does not move). Then the same once more after
    the first server came back, caught up, and took over in turn (the table of applied
    UUIDs reached it)."""
    from clonemap.client.api import Clone
    from clonemap.shards.common.proto import chp

    config, control = write_config(tmp_path, "1shard.yaml", limits={
        "applied_uuid_bytes": 1 << 20, "applied_uuid_s": 90})
    start(procs, config, tmp_path, "--backoff-initial-s", "0.2")
    rows = wait_status(control, lambda r: r["s0/primary"]["bstar"] == "ACTIVE"
                       and r["s0/backup"]["bstar"] == "PASSIVE")
    # the config's table reached both servers: 4,096 writes and 45 s are remembered
    assert {tuple(rows[s]["stats"]["applied_uuids_window"]) for s in rows} == {(4096, 45.0)}
    uuid, identity = chp.resendable_uuid(), b"writer-1"  # as a wait=True write's
    frames = chp.kvset(b"/once", b"v1", uuid)
    pub, dealer = _raw_pair_sockets(zctx, rows["s0/primary"]["port"], identity)
    pub.send_multipart(frames)  # the first send: a plain KVSET, no reply asked
    with Clone(config=str(config)) as c:
        deadline = time.monotonic() + 10
        while c.get("/once") is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        first = c.meta("/once").seq
    pub.close()
    dealer.close()
    assert cli("kill", "s0/primary", "--control", control).returncode == 0
    rows = wait_status(control, lambda r: r["s0/backup"]["bstar"] == "ACTIVE"
                       and r["s0/primary"]["bstar"] == "PASSIVE", timeout_s=40)
    seq_before = rows["s0/backup"]["stats"]["seq"]
    again = chp.kvset(b"/once", b"v1", uuid, chp.write_props(reply_to=identity))
    for survivor, other in (("s0/backup", "s0/primary"), ("s0/primary", "s0/backup")):
        pub, dealer = _raw_pair_sockets(zctx, rows[survivor]["port"], identity)
        pub.send_multipart(again)
        reply = _kvreply(dealer)
        assert (reply.uuid, reply.outcome, reply.seq) == (uuid, chp.DUPLICATE, first)
        pub.close()
        dealer.close()
        rows = wait_status(control, lambda r: r[survivor]["stats"]["seq"] >= seq_before)
        assert rows[survivor]["stats"]["seq"] == seq_before
        assert rows[survivor]["stats"]["writes"]["duplicate"] >= 1
        if survivor == "s0/backup":
            assert cli("kill", survivor, "--control", control).returncode == 0
            rows = wait_status(control, lambda r: r[other]["bstar"] == "ACTIVE"
                               and r[survivor]["bstar"] == "PASSIVE", timeout_s=40)
    with Clone(config=str(config)) as fresh:
        assert fresh.get("/once") == b"v1" and fresh.meta("/once").seq == first


def test_conditional_writes_at_the_frame_level(procs, zctx):
    """A raw peer's conditional KVSETs on a standalone server: a conflict is answered on
    the replies DEALER only (a subscriber sees nothing of it), an applied one is a KVPUB
    without the condition's properties, and a malformed condition is a counted drop."""
    from clonemap.shards.common.proto import chp
    from conftest import free_port_base

    port = free_port_base(4)
    procs.python("-m", "clonemap.shards", "--port", str(port), ready="READY shard")
    sub = zctx.socket(zmq.SUB)
    sub.subscribe(b"/c")
    sub.subscribe(chp.HUGZ)
    sub.connect(f"tcp://127.0.0.1:{port + 1}")
    assert sub.poll(10_000)  # the welcome HUGZ: the subscription is live
    assert sub.recv_multipart()[0] == chp.HUGZ
    pub, dealer = _raw_pair_sockets(zctx, port, b"me")
    reply_to = chp.write_props(reply_to=b"me")
    pub.send_multipart(chp.kvset(b"/c", b"1", b"A" * 16, chp.write_props(0) + reply_to))
    applied = _kvreply(dealer)
    assert applied.outcome == chp.APPLIED and applied.seq == 1
    pub.send_multipart(chp.kvset(b"/c", b"2", b"B" * 16, chp.write_props(0) + reply_to))
    assert _kvreply(dealer)[1:3] == (chp.CONFLICT, 1)
    pub.send_multipart(chp.kvset(b"/c", b"3", b"C" * 16, chp.write_props(1) + reply_to))
    assert _kvreply(dealer)[1:3] == (chp.APPLIED, 2)
    pub.send_multipart(chp.kvset(b"/c", b"", b"D" * 16, chp.write_props(1) + reply_to))
    assert _kvreply(dealer)[1:3] == (chp.CONFLICT, 2)
    pub.send_multipart(chp.kvset(b"/c", b"x", b"E" * 16, b"if-seq=seven\n" + reply_to))
    pub.send_multipart(chp.kvset(b"/c", b"", b"F" * 16, chp.write_props(2) + reply_to))
    assert _kvreply(dealer)[1:3] == (chp.APPLIED, 3)  # the malformed one was dropped
    # a write that may be sent again (its UUID says so: wait=True) is applied once; a
    # fire-and-forget one, never resent by our client, is not remembered
    again, plain = chp.resendable_uuid(), b"P" * 16
    for uuid in (again, again, plain, plain):
        pub.send_multipart(chp.kvset(b"/c", b"r", uuid))
    pub.send_multipart(chp.kvset(b"/c", b"end", b"G" * 16, reply_to))
    assert _kvreply(dealer)[1:3] == (chp.APPLIED, 7)
    seen = []
    while sub.poll(1000) and len(seen) < 7:
        msg = chp.decode_update(sub.recv_multipart())
        if isinstance(msg, chp.Kvpub):
            seen.append((msg.seq, msg.uuid, msg.props, msg.value))
    assert seen == [(1, b"A" * 16, b"", b"1"), (2, b"C" * 16, b"", b"3"),
                    (3, b"F" * 16, b"", b""), (4, again, b"", b"r"), (5, plain, b"", b"r"),
                    (6, plain, b"", b"r"), (7, b"G" * 16, b"", b"end")]


def test_replies_to_nobody_are_counted_and_dropped(procs, zctx):
    """A hostile writer asks for a reply to each of 30,000 writes, naming a routing id
    no DEALER holds: the server sends nothing anywhere (each reply is refused at once by
    the ROUTER, counted ``replies_unsent``), applies the writes, and an honest writer's
    conditional write beside the flood is answered. (A DEALER that holds the id and
    never reads holds at most the snapshot ROUTER's mark for its pipe, plus the kernel's
    socket buffers.)"""
    from clonemap.shards.common.proto import chp
    from conftest import free_port_base
    from test_relay import stats_of

    port = free_port_base(4)
    server = procs.python("-m", "clonemap.shards", "--port", str(port), ready="READY shard")
    pub, honest = _raw_pair_sockets(zctx, port, b"honest")
    pub.sndhwm = 0  # every one of them reaches the server (a PUB drops past its mark)
    props = chp.write_props(reply_to=b"nobody")
    sent = 30_000
    for i in range(sent):
        pub.send_multipart(chp.kvset(b"/h/%d" % (i % 100), b"v", chp.resendable_uuid(),
                                     props))
    # the flood's last write answers the honest DEALER: after it, all were decided
    pub.send_multipart(chp.kvset(b"/h/end", b"1", chp.resendable_uuid(),
                                 chp.write_props(0, b"honest")))
    reply = _kvreply(honest)
    assert (reply.outcome, reply.seq) == (chp.APPLIED, sent + 1)
    stats = stats_of(server)
    assert stats["writes"]["applied"] == sent + 1 and stats["applied_uuids"] == sent + 1
    assert stats["writes"]["replies_unsent"] == sent
