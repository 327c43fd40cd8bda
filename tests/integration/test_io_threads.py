"""``--io-threads``: a server's libzmq context runs that many I/O threads and its
subscribers' connections are spread over them (a server that a thousand subscribers read
directly is otherwise bound by one thread's sends: bench/README, *On a 16-core host*).
Real processes and sockets: the threads are read from /proc (libzmq names them
``ZMQbg/IO/<n>``), and 60 raw SUBs each receive every update of a server with four."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from conftest import free_port_base

pytestmark = pytest.mark.timeout(90)

DEADLINE_S = 20.0
SUBSCRIBERS = 60
UPDATES = 20


def io_threads_of(pid: int) -> list[str]:
    names = []
    for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return sorted(n for n in names if n.startswith("ZMQbg/IO/"))


def start(procs, *extra: str):
    port = free_port_base(4)
    proc = procs.python("-m", "clonemap.shards", "--port", str(port), "--clock-s", "0.1", *extra,
                        ready="READY")
    return proc, port


def recv_until(sock: zmq.Socket, want, deadline: float) -> list[bytes]:
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not sock.poll(left_ms):
            raise AssertionError("no such message before the deadline")
        frames = sock.recv_multipart()
        if want(frames):
            return frames


def probe_seen(sub: zmq.Socket, wait_ms: int) -> bool:
    """Whether a ``/probe`` update is among what ``sub`` holds within ``wait_ms`` (HUGZ
    and earlier probes read and passed over)."""
    seen = False
    while sub.poll(wait_ms):
        seen |= sub.recv_multipart()[0] == b"/probe"
        wait_ms = 0
    return seen


def test_a_server_runs_the_io_threads_it_is_given(procs):
    one, _ = start(procs)
    four, _ = start(procs, "--io-threads", "4")
    assert io_threads_of(one.pid) == ["ZMQbg/IO/0"]
    assert io_threads_of(four.pid) == [f"ZMQbg/IO/{i}" for i in range(4)]



def test_every_subscriber_of_a_server_with_four_io_threads_gets_every_update(procs, zctx):
    _, port = start(procs, "--io-threads", "4")
    deadline = time.monotonic() + DEADLINE_S
    subs = []
    for _ in range(SUBSCRIBERS):
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port + 1}")
        subs.append(sub)
    for sub in subs:  # a clock HUGZ reached it: its subscription is in place
        recv_until(sub, lambda f: f[0] == b"HUGZ", deadline)
    writer = zctx.socket(zmq.PUB)  # the collector on P+2 is a SUB
    writer.connect(f"tcp://127.0.0.1:{port + 2}")
    probe = 0
    while True:  # until the collector's subscription reached the writer: a probe arrives
        writer.send_multipart([b"/probe", bytes(8), probe.to_bytes(16, "big"), b"", b"p"])
        probe += 1
        if probe_seen(subs[0], 50):
            break
        assert time.monotonic() < deadline, "no probe came back through the server"
    for i in range(UPDATES):
        writer.send_multipart([b"/io/%d" % i, bytes(8), (1000 + i).to_bytes(16, "big"), b"",
                               b"v%d" % i])
    for sub in subs:
        got = [recv_until(sub, lambda f: f[0].startswith(b"/io/"), deadline)
               for _ in range(UPDATES)]
        assert [(f[0], f[4]) for f in got] == [(b"/io/%d" % i, b"v%d" % i)
                                               for i in range(UPDATES)]
        seqs = [int.from_bytes(f[1], "big") for f in got]
        assert seqs == list(range(seqs[0], seqs[0] + UPDATES))


def test_io_threads_out_of_range_are_refused_with_a_clear_error(procs):
    for bad in ("0", "65", "many"):
        proc = procs.python("-m", "clonemap.shards", "--port", str(free_port_base(4)),
                            "--io-threads", bad)
        assert proc.wait(30) == 2
        assert any("--io-threads" in line for line in proc.stderr), proc.stderr
