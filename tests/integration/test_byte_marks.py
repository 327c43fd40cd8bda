"""What one subscriber that never reads can pin in a server, in bytes (``clonemap.shards.pub_budget``).

* The mark arithmetic, pure: it only falls, it follows the largest update, and the bytes
  it admits stay within ``max(B, cost(largest))``.
* libzmq applies a lowered ``SNDHWM`` to a pipe that already exists (the mechanism
  depends on it): raw XPUB and SUB sockets, ``XPUB_NODROP`` counting what is admitted.
* Under ``supervisor start`` with the defaults (64 MiB per subscriber): a raw SUB that
  never reads, 40,000 writes of 8 KB values (330 MB through the server) in batches a
  healthy ``Clone`` has seen; the active's RSS stays within the budget plus a small
  constant, and the ``Clone`` converges.
* The same flood at a standalone server with the budget off (``--subscriber-held-bytes
  0``, the old behaviour) pins far more: the measurement above can fail.
"""
from __future__ import annotations

import time

import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from conftest import wait_until as wait_for
from clonemap.client.api import Clone
from clonemap.shards.common.proto import chp
from clonemap.shards.byte_marks import MESSAGE_OVERHEAD, ByteMarks, derive, worst_case
from test_server_conformance import start_server
from test_supervisor_cli import start, status, wait_status, write_config

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20
SLACK = 48 * MiB
"""The small constant: ZeroMQ's buffers, the allocator's slack, the map's own growth
is measured separately (it is not what the subscriber pins)."""
VALUE = 8192
WRITES = 40_000
DEADLINE_S = 60.0


# ---------------------------------------------------------------- the arithmetic

def marks(budget: int = 64 * MiB, cap: int = 100_000) -> ByteMarks:
    return ByteMarks(largest_allowed=(1 << 20) + 5120, max_value=1 << 20,
                     pub_budget=budget, pub_cap=cap, collect_budget=budget,
                     collect_cap=cap)


def test_the_marks_follow_the_largest_message_and_only_fall():
    m = marks()
    assert (m.pub_hwm, m.collect_hwm) == (100_000, 100_000)  # small updates: whole caps
    assert m.received(200) is None and m.published(200) is None
    assert m.received(VALUE + 20) == "collect"
    assert m.collect_hwm == 64 * MiB // (VALUE + 20 + MESSAGE_OVERHEAD)
    assert m.pub_hwm == 100_000 and m.fast_limit == 256  # not published yet
    assert m.published(VALUE + 20) == "pub" and m.pub_hwm == m.collect_hwm
    assert m.fast_limit == VALUE + 20
    assert m.published(100) is None and m.pub_mark == VALUE + 20  # never rises again
    assert m.received(1 << 20) == "collect" and m.published(1 << 20) == "pub"
    assert m.pub_hwm == 63 and m.fast_limit == 1 << 20
    assert m.published((1 << 20) + 5000) is None  # a key and properties beyond the value:
    assert m.pub_mark == (1 << 20) + 5000 and m.pub_hwm == 63  # the same mark
    assert m.fast_limit == 1 << 20  # larger than the value limit never takes the fast path
    assert m.received(1 << 30) is None and m.collect_mark == (1 << 20) + 5120  # the limits
    assert m.lowered == 4


def test_a_malformed_large_message_lowers_the_collectors_mark_only():
    m = marks()
    assert m.received(900_000) == "collect" and m.collect_hwm == 64 * MiB // (
        900_000 + MESSAGE_OVERHEAD)
    assert m.pub_hwm == 100_000 and m.fast_limit == 256  # dropped: never published


def test_the_admitted_bytes_stay_within_the_budget_whatever_the_order():
    """A queue that is never read: each message is admitted (after ``published``) while
    the queue holds fewer than the mark; any order of sizes stays within the worst case."""
    for sizes in ([100] * 50 + [9000] * 50 + [200_000] * 50,
                  [200_000] * 50 + [100] * 5000,
                  [300, 3000, 30_000, 300_000, 30, 3] * 40):
        m = marks(2 * MiB)
        queued = held = 0
        for size in sizes:
            m.published(size)
            if queued < m.pub_hwm:
                queued += 1
                held += size + MESSAGE_OVERHEAD
        assert held <= worst_case(2 * MiB, 100_000, max(sizes)) == 2 * MiB, sizes


def test_a_budget_of_zero_counts_messages_only_and_cap_zero_is_unlimited():
    assert derive(0, 100_000, VALUE) == 100_000
    assert worst_case(0, 100_000, VALUE) == 100_000 * (VALUE + MESSAGE_OVERHEAD)
    assert worst_case(0, 0, VALUE) is None
    assert derive(MiB, 0, 256) == MiB // (256 + MESSAGE_OVERHEAD)
    assert derive(MiB, 0, 10 * MiB) == 1
    assert worst_case(MiB, 0, 10 * MiB) == 10 * MiB + MESSAGE_OVERHEAD


# ---------------------------------------------------------------- libzmq's part

def test_libzmq_applies_a_lowered_mark_to_an_existing_pipe(zctx, port_base):
    """The server lowers SNDHWM on a bound XPUB with subscribers already connected; the
    subscriber's pipe must take the new mark, or the bound would hold for new ones only."""
    pub = zctx.socket(zmq.XPUB)
    pub.sndhwm = 1000
    pub.setsockopt(zmq.XPUB_NODROP, 1)  # Again instead of a silent drop: countable
    pub.bind(f"tcp://127.0.0.1:{port_base}")
    sub = zctx.socket(zmq.SUB)
    sub.rcvhwm = 1
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.subscribe(b"")
    sub.connect(f"tcp://127.0.0.1:{port_base}")
    assert pub.poll(10_000) and pub.recv() == b"\x01"

    def fill() -> int:
        """Messages admitted until Again twice, the second after the I/O thread had
        time to move what it could (a poll on the subscriber, which gets nothing)."""
        admitted = 0
        while True:
            try:
                pub.send(b"v" * 4096, zmq.NOBLOCK)
                admitted += 1
            except zmq.Again:
                sub.poll(100)  # nothing arrives: rcvhwm 1 and its one slot is full
                try:
                    pub.send(b"v" * 4096, zmq.NOBLOCK)
                    admitted += 1
                except zmq.Again:
                    return admitted

    first = fill()
    assert first >= 1000
    pub.sndhwm = 100
    assert fill() == 0  # the existing pipe holds more than the new mark: nothing more
    pub.sndhwm = 2000
    assert fill() >= 900  # and a raised mark is applied to it as well


# ---------------------------------------------------------------- a real server

def flood(zctx, collector: str, writes: int, value_bytes: int, live,
          seen=None) -> zmq.Socket:
    """A raw PUB at the collector: probes until ``live()`` says one arrived (a PUB drops
    what it sends before the server's subscription reaches it), then the flood. With
    ``seen(mark)``: after every 1,000 writes a ``/flood/mark`` write, and a wait until a
    reader has it, so the server's collector never holds a backlog (what is measured is
    then the subscribers' side, not a writer outrunning the server)."""
    pub = zctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.connect(collector)
    wait_for(lambda: pub.send_multipart(chp.kvset(b"/flood/probe", b"p")) or live(),
             "probe at the server")
    value = b"v" * value_bytes
    for i in range(writes):
        pub.send_multipart(chp.kvset(b"/flood/%d" % (i % 1000), value))
        if seen is not None and i % 1000 == 999:
            mark = b"%d" % i
            pub.send_multipart(chp.kvset(b"/flood/mark", mark))
            wait_for(lambda: seen(mark), "the batch at the reader")
    pub.send_multipart(chp.kvset(b"/flood/last", b"done"))
    return pub


def never_reading_subscriber(zctx, publisher: str) -> zmq.Socket:
    """A SUB that reads one message, the welcome HUGZ (so its subscription is live at
    the server), and nothing after it."""
    sub = zctx.socket(zmq.SUB)
    sub.rcvhwm = 1
    sub.setsockopt(zmq.RCVBUF, 8192)
    sub.subscribe(b"")
    sub.connect(publisher)
    assert sub.poll(10_000), "no welcome HUGZ"
    assert sub.recv_multipart()[0] == chp.HUGZ
    return sub




def test_a_never_reading_subscriber_pins_at_most_the_budget_under_the_supervisor(
        procs, tmp_path, zctx):
    config, control = write_config(tmp_path, "1shard.yaml")
    start(procs, config, tmp_path)
    rows = wait_status(control, lambda rows: rows["s0/primary"]["bstar"] == "ACTIVE"
                       and rows["s0/backup"]["bstar"] == "PASSIVE")
    row = rows["s0/primary"]
    server = psutil.Process(row["pid"])
    port = row["port"]
    snail = never_reading_subscriber(zctx, f"tcp://127.0.0.1:{port + 1}")
    with Clone(config=str(config), codec="bytes", timeout_s=10) as reader:
        before = server.memory_info().rss
        writer = flood(zctx, f"tcp://127.0.0.1:{port + 2}", WRITES, VALUE,
                       lambda: reader.get("/flood/probe") == b"p",
                       seen=lambda mark: reader.get("/flood/mark") == mark)
        wait_for(lambda: reader.get("/flood/last") == b"done", "final write at the reader")
        assert reader.get("/flood/999") == b"v" * VALUE
        after = server.memory_info().rss
        writer.close(0)
    stats = wait_for(lambda: (s := status(control)["s0/primary"].get("stats", {})).get(
        "largest_published_bytes", 0) >= VALUE and s, "stats after the flood")
    assert stats["pub_hwm"] == 64 * MiB // (stats["largest_published_bytes"]
                                           + MESSAGE_OVERHEAD) < 10_000
    assert stats["collect_hwm"] == 64 * MiB // (stats["largest_received_bytes"]
                                               + MESSAGE_OVERHEAD) < 10_000
    # the documented worst case for one snail, 64 MiB, beside the resume history's 64 MiB
    # (it holds the last updates' values), the map's 1,000 keys of 8 KB and a constant
    # (the writer waits for its batches: no collector backlog)
    stats_recent = stats["recent"]
    assert stats_recent["bytes"] <= 64 * MiB
    assert after - before <= 64 * MiB + 64 * MiB + SLACK, (before, after)
    print(f"server RSS grew {(after - before) / MiB:.0f} MiB")
    snail.close(0)


def test_without_the_budget_the_same_flood_pins_far_more(procs, port_base, zctx):
    start_server(procs, port_base, "--subscriber-held-bytes", "0")
    server = psutil.Process(procs.started[-1].pid)
    snail = never_reading_subscriber(zctx, f"tcp://127.0.0.1:{port_base + 1}")
    reader = zctx.socket(zmq.SUB)
    reader.rcvhwm = 0
    for prefix in (chp.HUGZ, b"/flood/last", b"/flood/probe"):
        reader.subscribe(prefix)
    reader.connect(f"tcp://127.0.0.1:{port_base + 1}")
    wait_for(lambda: reader.poll(100) and reader.recv_multipart()[0] == chp.HUGZ,
             "welcome HUGZ", 10)
    before = server.memory_info().rss
    writer = flood(zctx, f"tcp://127.0.0.1:{port_base + 2}", WRITES, VALUE,
                   lambda: reader.poll(10) and reader.recv_multipart()[0] == b"/flood/probe")
    wait_for(lambda: reader.poll(100) and reader.recv_multipart()[0] == b"/flood/last",
             "final write")
    after = server.memory_info().rss
    writer.close(0)
    # 40,000 x 8 KB queued for the snail: well over the 64 MiB budget plus the constant
    assert after - before > 64 * MiB + SLACK + 100 * MiB, (before, after)
    snail.close(0)


def test_a_frame_far_beyond_the_limits_disconnects_its_writer_before_it_is_buffered(
        procs, port_base, zctx):
    """ZMQ_MAXMSGSIZE on the collector (``collector_frame_limit``: 2 MiB + 64 KiB with
    the default 1 MiB value limit): a 64 MiB value frame disconnects the writer, the
    server does not grow by it, and the next writer's update is published."""
    start_server(procs, port_base)
    server = psutil.Process(procs.started[-1].pid)
    reader = zctx.socket(zmq.SUB)
    reader.subscribe(b"/after")
    reader.connect(f"tcp://127.0.0.1:{port_base + 1}")
    hostile = zctx.socket(zmq.PUB)
    hostile.sndhwm = 0
    monitor = zctx.socket(zmq.PAIR)
    hostile.monitor("inproc://hostile", zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    monitor.connect("inproc://hostile")
    hostile.connect(f"tcp://127.0.0.1:{port_base + 2}")
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
    before = server.memory_info().rss
    body = b"x" * (64 * MiB)
    # the PUB sends once the server's subscription arrived: repeat until disconnected
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        hostile.send_multipart(chp.kvset(b"/big", body))
        if monitor.poll(200):
            break
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    hostile.close(0)
    monitor.close(0)
    assert server.memory_info().rss - before < 16 * MiB
    writer = zctx.socket(zmq.PUB)
    writer.connect(f"tcp://127.0.0.1:{port_base + 2}")
    wait_for(lambda: writer.send_multipart(chp.kvset(b"/after", b"ok")) or (
        reader.poll(50) and reader.recv_multipart()[-1] == b"ok"), "a later update")
    writer.close(0)
