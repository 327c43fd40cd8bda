"""``settle``: a measured window starts only once the servers have published the last
window's backlog. Real sockets: an XPUB stands in for a server's publisher and publishes
only after the settle's subscription reached it (no slow-joiner guess), HUGZ interleaved."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from bench.harness.traffic import key_of
from bench.harness.traffic_reader import settle


def _publisher(sock: zmq.Socket, backlog: int, done: threading.Event,
               forever: bool = False) -> None:
    """Wait for a subscription, publish ``backlog`` harness updates (or harness updates
    until ``done`` when ``forever``), then HUGZ until ``done``."""
    sock.recv()  # the subscription: from here on, nothing published is lost
    i = 0
    while not done.is_set():
        if forever or i < backlog:
            sock.send_multipart([key_of(i), i.to_bytes(8, "big"), b"", b"", b"v"])
            i += 1
        sock.send_multipart([b"HUGZ", i.to_bytes(8, "big"), b"", b"", b""])
        done.wait(0.001 if forever or i < backlog else 0.02)


def _run(backlog: int, forever: bool = False, **kw) -> dict:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=32000)
    done = threading.Event()
    thread = threading.Thread(target=_publisher, args=(pub, backlog, done, forever))
    thread.start()
    try:
        return settle([f"tcp://127.0.0.1:{port}"], **kw)
    finally:
        done.set()
        thread.join(10)
        pub.close(0)


def test_settle_reads_a_backlog_to_its_end_and_ignores_hugz():
    figures = _run(500)
    assert figures["settled"] is True
    assert figures["settle_updates"] == 500     # every harness update, no HUGZ


def test_settle_of_idle_servers_returns_at_once_with_nothing_drained():
    figures = _run(0, quiet_s=0.1)
    assert figures == {"settle_s": figures["settle_s"], "settle_updates": 0, "settled": True}


def test_settle_gives_up_at_its_deadline_and_says_so():
    figures = _run(0, forever=True, quiet_s=0.2, deadline_s=0.6)
    assert figures["settled"] is False and figures["settle_updates"] > 0
    assert figures["settle_s"] >= 0.6


def test_a_config_that_gives_a_shard_count_is_relocated_like_a_list(tmp_path):
    """``bench cluster --config configs/1shard.yaml`` (``shards: 1``, ``port_base``) failed
    with a TypeError: the relocated copy expands the count as the loader does."""
    from pathlib import Path

    from bench.harness.procs import ROOT, relocated_config
    from clonemap.shards.common.config import load_config

    path, control, data = relocated_config(Path(ROOT) / "configs" / "1shard.yaml", tmp_path)
    cluster = load_config(path)
    assert [s.name for s in cluster.shards] == ["s0"]
    assert "port_base" not in data and control != "tcp://127.0.0.1:5555"
    primary, backup = cluster.shards[0].primary.port, cluster.shards[0].backup.port
    assert primary == data["shards"][0]["primary"]["port"] and backup == primary + 10


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_subscriber_is_ready_only_once_its_handshake_is_done():
    """The harness's SUB reports ready after its ZMTP handshake, not after connect(): the
    publisher here binds only after a while, and ``_handshaken`` returns after that."""
    from bench.harness.traffic_reader import _MONITORS, _handshaken, _sub_socket

    ctx = zmq.Context.instance()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = _sub_socket(ctx, endpoint, b"", 0)
    bound = threading.Event()
    pub = ctx.socket(zmq.XPUB)
    pub.linger = 0

    def bind_late() -> None:
        time.sleep(0.3)  # (the delay is the point: connect() alone is not ready)
        bound.set()
        pub.bind(endpoint)

    thread = threading.Thread(target=bind_late)
    thread.start()
    try:
        _handshaken([sub], [endpoint], 10.0)
        assert bound.is_set() and sub not in _MONITORS
        assert pub.poll(5000) and pub.recv() == b"\x01"  # its subscription follows
    finally:
        thread.join(10)
        sub.close(0)
        pub.close(0)


def test_a_subscriber_without_a_publisher_names_it_at_the_deadline():
    from bench.harness.traffic_reader import _MONITORS, _handshaken, _sub_socket

    ctx = zmq.Context.instance()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = _sub_socket(ctx, endpoint, b"", 0)
    try:
        with pytest.raises(RuntimeError, match=f"no ZMTP handshake with {endpoint} in 0.5 s"):
            _handshaken([sub], [endpoint], 0.5)
        assert sub not in _MONITORS
    finally:
        sub.close(0)
