"""A server's memory stays within its byte budgets when hostile or slow peers push it,
measured as the server process's RSS (the number the operator sees).

* four 64 MiB subscription frames on the publisher (P+1) and on the Binary Star state
  port (P+3): the peer is disconnected before libzmq buffers them (``MAXMSGSIZE``);
* 20 never-reading snapshot requesters of a 64 MiB map of 64 KiB values: each ROUTER
  pipe holds its share of ``snapshot_held_bytes``;
* a flat-out writer of 8 KB values over 2,000 keys, with continuous compaction, into a
  pair, and two subscribers that never read: the passive's queue of the active's stream
  is bounded in bytes (it held 100,000 messages, 1.2 GiB), and so is what it buffers
  during a sync; a subscriber that connects after the marks fell gets them too (libzmq
  gave it the bind-time mark, 100,000 messages);
* 100 never-reading snapshot requesters on a 200,000-key map: bounded while they wait,
  and the heap's free pages given back once they are gone.

The budgets are the documented ones (README, *Memory budget*), with a stated margin for
the interpreter and libzmq's own buffers.
"""
from __future__ import annotations

import os
import socket
import struct
import time

import psutil
import pytest
import zmq

from conftest import free_port_base
from clonemap.shards.common.proto import chp

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
MARGIN = 48 * MiB
"""What the process may hold beyond the budgets: allocator slack, libzmq's own buffers,
the interpreter's working set under load."""


def rss(proc) -> int:
    return psutil.Process(proc.pid).memory_info().rss


def fill(zctx, port: int, count: int, value: bytes, prefix: str = "/m/") -> None:
    """``count`` keys written through the collector, then wait for the last one's
    KVPUB: the map holds them all."""
    sub = zctx.socket(zmq.SUB)
    sub.linger = 0
    sub.subscribe(b"")
    sub.connect(f"tcp://127.0.0.1:{port + 1}")
    pub = zctx.socket(zmq.XPUB)  # as the client library: it sees the collector subscribe
    pub.linger = 0
    pub.sndhwm = 0
    pub.connect(f"tcp://127.0.0.1:{port + 2}")
    assert sub.poll(10_000), "no welcome HUGZ"
    sub.recv_multipart()
    assert pub.poll(10_000), "the collector never subscribed"
    pub.recv_multipart()  # its subscription: nothing sent from here on is dropped
    deadline = time.monotonic() + 120
    batch = 500
    for start in range(0, count, batch):  # a batch at a time: none is dropped
        stop = min(count, start + batch)
        for i in range(start, stop):
            pub.send_multipart(chp.kvset(f"{prefix}{i}".encode(), value))
        last = f"{prefix}{stop - 1}".encode()
        while True:
            assert time.monotonic() < deadline, "the map never filled"
            assert sub.poll(10_000), f"no echo of {last!r}"
            if sub.recv_multipart()[0] == last:
                break
    sub.close(0)
    pub.close(0)


def standalone(procs, *extra: str):
    port = free_port_base(4)
    proc = procs.python("-m", "clonemap.shards", "--port", str(port), *extra, ready="READY")
    proc.port = port
    return proc


def never_reading(zctx, port: int, count: int) -> list:
    """``count`` DEALERs that ask for a snapshot and never read a frame of it."""
    socks = []
    for _ in range(count):
        s = zctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvhwm = 1
        s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send_multipart(chp.icanhaz(b""))
        socks.append(s)
    return socks


def settle_peak(proc, seconds: float) -> int:
    """The highest RSS seen over ``seconds`` (sampled every 50 ms)."""
    peak, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, rss(proc))
        time.sleep(0.05)  # sampling, not waiting for an event  # noqa: sleep
    return peak


def zmtp_sub(port: int) -> socket.socket:
    """A raw TCP peer that speaks ZMTP 3.0 as a SUB (NULL mechanism), so that it can send
    a subscription frame of any size without keeping it itself (a libzmq XSUB stores
    each subscription in a trie, one node per byte, and crashes freeing a 64 MiB one)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    greeting = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
                + b"\x00" + b"\x00" * 31)
    sock.sendall(greeting)
    got = b""
    while len(got) < 64:
        chunk = sock.recv(64 - len(got))
        assert chunk, "the server closed during the greeting"
        got += chunk
    assert got[:1] == b"\xff" and got[10:11] == b"\x03"
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
    sock.sendall(b"\x04" + bytes([len(body)]) + body)
    return sock


def send_long_frame(sock: socket.socket, body_len: int) -> bool:
    """One frame of ``body_len`` bytes (a subscription: ``\\x01`` then the topic); False
    once the server has closed the connection."""
    try:
        sock.sendall(b"\x02" + struct.pack(">Q", body_len) + b"\x01")
        chunk = b"x" * (1 << 20)
        for _ in range((body_len - 1) // len(chunk)):
            sock.sendall(chunk)
    except OSError:  # reset or broken pipe: disconnected before the frame was whole
        return False
    return True


def closed_by_peer(sock: socket.socket, timeout_s: float = 20.0) -> bool:
    sock.settimeout(timeout_s)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except OSError:
        return False


def test_oversized_subscription_frames_are_refused_on_p1_and_p3(procs, zctx):
    pa, pb = free_port_base(4), free_port_base(4)
    primary = procs.python("-m", "clonemap.shards", "--port", str(pa), "--primary", "--peer",
                           f"127.0.0.1:{pb}", ready="READY")
    base = rss(primary)
    for offset in (1, 3):
        for _ in range(4):
            hostile = zmtp_sub(pa + offset)
            send_long_frame(hostile, 64 * MiB)
            assert closed_by_peer(hostile), f"P+{offset}: the hostile peer was kept"
            hostile.close()
    grown = rss(primary) - base
    assert grown < 16 * MiB, f"the server grew by {grown >> 20} MiB"
    # an honest subscription still works, and the server answers a snapshot
    honest = zmtp_sub(pa + 1)
    honest.sendall(b"\x00\x05\x01/ok/")
    honest.close()
    d = zctx.socket(zmq.DEALER)
    d.linger = 0
    d.connect(f"tcp://127.0.0.1:{pa}")
    answered = False
    for _ in range(20):  # a vote refused while the (absent) peer may be alive
        d.send_multipart(chp.icanhaz(b""))
        if d.poll(500):
            answered = True
            break
    assert answered, "no answer after the flood"


def test_never_reading_snapshot_requesters_hold_at_most_the_snapshot_budget(procs, zctx):
    server = standalone(procs, "--max-value-bytes", str(128 * 1024))
    fill(zctx, server.port, 1024, os.urandom(64 * 1024))  # a 64 MiB map
    base = rss(server)
    socks = never_reading(zctx, server.port, 20)
    peak = settle_peak(server, 3.0)
    budget = 64 * MiB  # snapshot_held_bytes, shared by the 16 streams at most
    assert peak - base < budget + MARGIN, (
        f"{(peak - base) >> 20} MiB over the map, budget {budget >> 20} + margin")
    for s in socks:
        s.close(0)


def test_a_flat_out_writer_with_compaction_keeps_the_pair_within_budget(procs, zctx,
                                                                        tmp_path):
    pa, pb = free_port_base(4), free_port_base(4)
    budget = ["--history-bytes", str(16 * MiB), "--writer-held-bytes", str(16 * MiB),
              "--subscriber-held-bytes", str(16 * MiB), "--compact-min-bytes", str(8 * MiB),
              "--fsync", "everysec", "--heartbeat-s", "0.5"]
    primary = procs.python("-m", "clonemap.shards", "--port", str(pa), "--primary", "--peer",
                           f"127.0.0.1:{pb}", "--data-dir", str(tmp_path / "a"), *budget,
                           ready="READY")
    backup = procs.python("-m", "clonemap.shards", "--port", str(pb), "--backup", "--peer",
                          f"127.0.0.1:{pa}", "--data-dir", str(tmp_path / "b"), *budget,
                          ready="READY")
    d = zctx.socket(zmq.DEALER)
    d.linger = 0
    d.connect(f"tcp://127.0.0.1:{pa}")
    for _ in range(40):  # votes are refused until the pair has settled
        d.send_multipart(chp.icanhaz(b""))
        if d.poll(500):
            break
    else:
        raise AssertionError("the primary never served")
    base = max(rss(primary), rss(backup))
    pub = zctx.socket(zmq.PUB)
    pub.linger = 0
    pub.sndhwm = 20_000
    for port in (pa, pb):
        pub.connect(f"tcp://127.0.0.1:{port + 2}")
    value = os.urandom(8192)
    peaks = {"primary": 0, "backup": 0}
    end = time.monotonic() + 8.0
    n = 0
    stalled = []
    while time.monotonic() < end:
        if n > 20_000 and not stalled:  # after the marks fell: they get them too
            for _ in range(2):
                s = zctx.socket(zmq.SUB)
                s.linger = 0
                s.rcvhwm = 1
                s.setsockopt(zmq.RCVBUF, 4096)
                s.subscribe(b"")
                s.connect(f"tcp://127.0.0.1:{pa + 1}")
                stalled.append(s)
        for _ in range(500):
            n += 1
            try:
                pub.send_multipart(chp.kvset(f"/k/{n % 2000}".encode(), value,
                                             uuid=os.urandom(16)), zmq.NOBLOCK)
            except zmq.Again:
                break
        for name, proc in (("primary", primary), ("backup", backup)):
            peaks[name] = max(peaks[name], rss(proc))
    pub.close(0)
    # the passive: history + pending + its queue of the active's stream + the sync
    # buffer + the collector's queue for this writer (16 MiB each), the map (16 MiB);
    # the active: history + the collector's queue + a publisher queue for each of its
    # three subscribers (the passive and two that never read), the map
    budget_bytes = 6 * 16 * MiB + 16 * MiB
    for name, peak in peaks.items():
        assert peak - base < budget_bytes + MARGIN, (
            f"{name} peaked {(peak - base) >> 20} MiB above its start, budget "
            f"{budget_bytes >> 20} MiB + margin {MARGIN >> 20} (both, MiB above "
            f"{base >> 20}: {({k: (v - base) >> 20 for k, v in peaks.items()})})")
    assert n > 50_000, f"only {n} writes offered: not a flood"


def test_many_never_reading_requesters_are_bounded_and_the_memory_comes_back(procs, zctx):
    server = standalone(procs)
    fill(zctx, server.port, 200_000, b"v" * 100)
    base = rss(server)
    socks = never_reading(zctx, server.port, 100)
    peak = settle_peak(server, 3.0)
    # at most 16 + 16 streams open (active + stalled): their shares of 64 MiB together,
    # and each one's cursor, a copy of the key list (8 bytes a key)
    from clonemap.shards.server_config import MAX_ACTIVE_SNAPSHOTS
    from clonemap.shards.streams import MAX_STALLED

    cursors = (MAX_ACTIVE_SNAPSHOTS + MAX_STALLED) * 200_000 * 8
    assert peak - base < 64 * MiB + cursors + MARGIN, f"{(peak - base) >> 20} MiB"
    for s in socks:
        s.close(0)
    # the server abandons them (unreachable, or stalled) and gives the heap back
    deadline = time.monotonic() + 60
    while rss(server) - base > 24 * MiB:
        assert time.monotonic() < deadline, (
            f"still {(rss(server) - base) >> 20} MiB above the map after they left")
        time.sleep(0.2)  # polling the RSS of another process  # noqa: sleep
