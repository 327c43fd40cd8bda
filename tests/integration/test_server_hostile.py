"""Hostile input: a stream of malformed multipart messages on the collector (P+2) and on
the snapshot ROUTER (P) leaves the server running and correct for the next valid client,
and every drop is counted under its reason.

Counters are read where the control plane can read them today: the server logs
``stats {json}`` on SIGUSR1 and a short ``stopped: ...`` summary line when it stops. Nothing sleeps; the
one wait on the log polls the collected stderr lines with a deadline.
"""
from __future__ import annotations

import json
import signal
import time

import pytest
import zmq

from helpers import wait_stderr
from clonemap.shards.common import zio
from clonemap.shards.common.proto import chp
from clonemap.shards.common.security import Security
from test_server_conformance import DEADLINE_S, SEQ, Peer, start_server

MAX_VALUE = 4096

Z8 = b"\0" * 8
COLLECTOR_GARBAGE = [
    # (frames, reason)
    ([b""], "frame_count"),                                    # an empty message
    ([b"/k"], "frame_count"),
    ([b"/k", Z8, b"", b"", b"v", b"extra"], "frame_count"),
    ([b"/k", Z8, b"", b"v"], "frame_count"),
    ([b"x"] * 100, "frame_count"),                             # far too many frames
    ([b"/k", b"\0" * 7, b"", b"", b"v"], "bad_sequence"),      # short sequence
    ([b"/k", b"", b"", b"", b"v"], "bad_sequence"),
    ([b"/k", b"\0" * 9, b"", b"", b"v"], "bad_sequence"),
    ([b"/k", Z8, b"u" * 15, b"", b"v"], "bad_uuid"),           # 15-byte UUID
    ([b"/k", Z8, b"u" * 17, b"", b"v"], "bad_uuid"),
    ([b"/k", Z8, b"", b"", b"v" * (MAX_VALUE + 1)], "oversize_value"),
    ([b"/\xff\xfe", Z8, b"", b"", b"v"], "bad_key"),           # not UTF-8
    ([b"/\xc3", Z8, b"", b"", b"v"], "bad_key"),
    ([b"", Z8, b"", b"", b"v"], "bad_key"),                    # empty key
    ([b"HUGZ", Z8, b"", b"", b""], "bad_key"),                 # a command word as a key
    ([b"KTHXBAI", Z8, b"", b"", b"v"], "bad_key"),
    ([b"/" + b"k" * 2000, Z8, b"", b"", b"v"], "oversize_key"),
    ([b"/k", Z8, b"", b"novalue\n", b"v"], "bad_props"),
    ([b"/k", Z8, b"", b"a=1", b"v"], "bad_props"),             # no final newline
    ([b"/k", Z8, b"", b"=1\n", b"v"], "bad_props"),
    ([b"/k", Z8, b"", b"a=\xff\n", b"v"], "bad_props"),
    ([b"/k", Z8, b"", b"a=" + b"x" * 5000 + b"\n", b"v"], "oversize_props"),
    ([b"/k", Z8, b"", b"ttl=soon\n", b"v"], "bad_ttl"),
    ([b"/k", Z8, b"", b"ttl=-1\n", b"v"], "bad_ttl"),
    ([b"/k", Z8, b"", b"ttl=nan\n", b"v"], "bad_ttl"),
    ([b"/k", Z8, b"", b"expires=never\n", b"v"], "bad_expires"),
]
SNAPSHOT_GARBAGE = [
    ([b""], "unknown_command"),                                # an empty message
    ([b"GIMME", b""], "unknown_command"),
    ([b"ICANHAZ", b""], "unknown_command"),                    # no question mark
    ([b"KTHXBAI", Z8, b"", b"", b""], "unknown_command"),      # a server's command
    ([b"ICANHAZ?"], "frame_count"),
    ([b"ICANHAZ?", b"", b""], "frame_count"),
    ([b"ICANHAZ?"] * 70, "frame_count"),
    ([b"ICANHAZ?", b"/a"], "bad_subtree"),                     # bad subtrees
    ([b"ICANHAZ?", b"a/"], "bad_subtree"),
    ([b"ICANHAZ?", b"/"], "bad_subtree"),
    ([b"ICANHAZ?", b"/a//"], "bad_subtree"),
    ([b"ICANHAZ?", b"/\xff/"], "bad_subtree"),
    ([b"ICANHAZ?", b"/" + b"s" * 2000 + b"/"], "bad_subtree"),
]


def expected_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, reason in COLLECTOR_GARBAGE + SNAPSHOT_GARBAGE:
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def stats_now(proc) -> dict:
    start = len(proc.stderr)
    proc.signal(signal.SIGUSR1)
    line = proc.stderr[wait_stderr(proc, " stats {", start=start)]
    return json.loads(line.split(" stats ", 1)[1])


def _start(mode: str, procs, port_base, cluster_keys):
    if mode == "curve":
        proc = start_server(procs, port_base, "--max-value-bytes", str(MAX_VALUE),
                            "--keys-dir", str(cluster_keys))
        proc.security = Security.load(cluster_keys, "client")
    elif mode == "pure":
        proc = procs.python("-m", "clonemap.shards", "--port", str(port_base), "--heartbeat-s", "0.2",
                            "--log-level", "info", "--max-value-bytes", str(MAX_VALUE),
                            ready="READY", env={"CLONEMAP_PURE": "1"})
        proc.security = None
    else:
        proc = start_server(procs, port_base, "--max-value-bytes", str(MAX_VALUE))
        proc.security = None
    proc.frame_path = mode
    return proc


@pytest.fixture(params=["plain", "curve", "pure"])
def server(request, procs, port_base, cluster_keys):
    """Each test runs three times: plain TCP, CURVE on every socket (``--keys-dir``, the
    test's raw peers presenting the cluster's client key), and plain TCP on the pure-Python
    frame path (``CLONEMAP_PURE=1``; the first two use the compiled one when it is built)."""
    return _start(request.param, procs, port_base, cluster_keys)


@pytest.fixture(params=["plain", "curve"])
def streaming_server(request, procs, port_base, cluster_keys):
    """Plain TCP and CURVE, for the tests of snapshot streaming (no frame parsing of
    note: the frame paths are covered by the tests on ``server``)."""
    return _start(request.param, procs, port_base, cluster_keys)


def test_malformed_messages_are_dropped_counted_by_reason_and_harm_no_one(
        server, port_base, zctx):
    peer = Peer(zctx, port_base, security=server.security)
    peer.sync()  # the collector is live: nothing written from now on is lost
    data = {b"/h/%d" % i: b"v%d" % i for i in range(20)}
    for key, value in data.items():
        peer.kvset(key, value)
    base = peer.sync()  # everything before the fence is applied
    # A stream of garbage on both ports, interleaved, twice over.
    for _ in range(2):
        for i in range(max(len(COLLECTOR_GARBAGE), len(SNAPSHOT_GARBAGE))):
            if i < len(COLLECTOR_GARBAGE):
                peer.send_raw(COLLECTOR_GARBAGE[i][0])
            if i < len(SNAPSHOT_GARBAGE):
                peer.dealer.send_multipart(SNAPSHOT_GARBAGE[i][0])
    # The same connections still work: nothing of the garbage was sequenced or answered.
    peer.kvset(b"/h/after", b"ok", b"A" * 16, b"p=q=r\n")
    assert peer.recv_update() == [b"/h/after", SEQ.pack(base + 1), b"A" * 16, b"p=q=r\n",
                                  b"ok"]
    data[b"/h/after"] = b"ok"
    items, seq, _ = peer.snapshot(b"/h/")  # the first reply on this DEALER is this one
    assert items == data and seq == base + 1
    assert server.alive()
    stats = stats_now(server)
    want = {reason: 2 * n for reason, n in expected_counts().items()}
    assert stats["drops"] == want
    assert stats["drops_total"] == sum(want.values())
    assert stats["handler_errors"] == 0
    assert stats["seq"] == base + 1 and stats["keys"] == len(data)
    compiled = zio.COMPILED and server.frame_path != "pure"
    assert stats["frame_path"] == "compiled" if compiled else stats["frame_path"].startswith(
        "pure")
    # A log line names each reason (rate-limited: at most one per reason per interval).
    for reason in want:
        assert any(f"dropped ({reason})" in line for line in server.stderr), reason


def test_the_next_valid_client_gets_a_correct_service(server, port_base, zctx):
    first = Peer(zctx, port_base, security=server.security)
    first.sync()
    first.kvset(b"/n/a", b"1")
    base = first.sync()
    for frames, _ in COLLECTOR_GARBAGE:
        first.send_raw(frames)
    for frames, _ in SNAPSHOT_GARBAGE:
        first.dealer.send_multipart(frames)
    # Both paths are ordered: a fence on each proves every garbage message was read by
    # the server before the sockets close (close(0) would discard what is still queued).
    first.sync()
    assert first.snapshot(b"/n/")[0] == {b"/n/a": b"1"}
    for sock in (first.dealer, first.sub, first.pub):
        sock.close(0)
    nxt = Peer(zctx, port_base, security=server.security)
    fence = nxt.sync()
    assert fence > base  # its own probes only: garbage was never sequenced
    nxt.kvset(b"/n/b", b"2")
    assert nxt.recv_update() == [b"/n/b", SEQ.pack(fence + 1), b"", b"", b"2"]
    items, seq, _ = nxt.snapshot(b"/n/")
    assert items == {b"/n/a": b"1", b"/n/b": b"2"} and seq == fence + 1
    stats = stats_now(server)
    assert stats["drops"] == expected_counts()


def test_a_requester_that_vanishes_mid_snapshot_does_not_stall_others(streaming_server,
                                                                      port_base, zctx):
    server = streaming_server
    peer = Peer(zctx, port_base, security=server.security)
    value = bytes(200)
    peer.sync()
    for i in range(20_000):
        peer.kvset(b"/v/%06d" % i, value)
    base = peer.sync()
    for _ in range(5):  # ask, read one message, disconnect
        gone = zctx.socket(zmq.DEALER)
        if server.security is not None:
            server.security.connect_side(gone)
        gone.rcvhwm = 10
        gone.connect(f"tcp://127.0.0.1:{port_base}")
        gone.send_multipart(chp.icanhaz(b""))
        assert gone.poll(DEADLINE_S * 1000)
        gone.close(0)
    items, seq, _ = peer.snapshot(b"/v/", timeout_s=30)
    assert len(items) == 20_000 and seq == base
    peer.kvset(b"/v/after", b"x")
    assert peer.recv_update()[:2] == [b"/v/after", SEQ.pack(base + 1)]
    stats = stats_now(server)
    assert stats["drops"] == {}
    # Each vanished requester was dropped when its pipe closed (or, had its whole
    # snapshot fitted in the buffers first, counted as served): none is left open.
    assert stats["snapshots_unreachable"] + stats["snapshots_served"] == 6
    assert stats["snapshots_served"] >= 1 and stats["snapshots_active"] == 0
    assert stats["handler_errors"] == 0


def test_final_stats_are_logged_on_stop(streaming_server, port_base, zctx):
    server = streaming_server
    peer = Peer(zctx, port_base, security=server.security)
    peer.sync()
    peer.send_raw([b"/k", b"short", b"", b"", b"v"])
    peer.dealer.send_multipart([b"ICANHAZ?", b"nope"])
    peer.snapshot()  # both garbage messages were handled before this reply
    peer.kvset(b"/x", b"y")
    peer.recv_update()
    server.signal(signal.SIGTERM)
    assert server.wait(10) == 0
    server.stop()
    (line,) = [x for x in server.stderr if "stopped: " in x]
    assert "1 keys" in line and "1 snapshots served" in line, line
    assert "2 dropped (bad_sequence 1, bad_subtree 1)" in line, line


def test_requesters_that_never_read_do_not_keep_a_reader_from_its_snapshot(procs, zctx):
    """16 peers (as many as ``streams.MAX_STALLED``) ask for a snapshot of 60,000 keys
    and never read: their pipes fill and they hold every streaming slot. Each yields its
    slot once it has accepted nothing for ``--snapshot-yield-s``, so a client that then
    asks gets its whole snapshot long before the stalled ones would be abandoned
    (``--snapshot-stall-s 120``). (More never-reading peers than that wait for a slot:
    each stalled one keeps its queue in libzmq, and the bytes of all the queues together
    are bounded; see ``test_memory_bounds``.)"""
    import asyncio

    from clonemap.client.api import AsyncClone
    from conftest import free_port_base
    from test_client_server import fetch_map

    port = free_port_base(4)
    server = start_server(procs, port, "--snapshot-stall-s", "120")
    keys = 60_000

    async def fill():
        async with AsyncClone(f"tcp://127.0.0.1:{port}") as clone:
            for i in range(keys - 1):
                await clone.set(f"/fill/{i:06d}", b"v" * 100)
            await clone.set("/fill/last", b"v" * 100, wait=True, timeout_s=60)
    asyncio.run(fill())
    from clonemap.shards.streams import MAX_STALLED

    stalled = []
    for _ in range(MAX_STALLED):
        dealer = zctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.rcvhwm = 100
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"ICANHAZ?", b""])
        stalled.append(dealer)
    deadline = time.monotonic() + DEADLINE_S
    while True:  # until the server has read all 100 requests
        before = stats_now(server)
        if before["snapshots_active"] + before["snapshots_waiting"] == MAX_STALLED:
            break
        assert time.monotonic() < deadline, before
    assert before["snapshots_active"] == 16  # every slot is taken
    got, seq = fetch_map(zctx, port, timeout_s=60)
    assert len(got) == keys and seq == keys
    after = stats_now(server)
    assert after["snapshots_yielded"] >= 1 and after["snapshots_abandoned"] == 0
    assert after["snapshots_stalled"] >= 1  # at least one gave its slot to the reader
