"""The pieces the benchmarks rest on: the load generator's key schedule (pure) and the bare
forwarding loop's wire behaviour. The scenarios themselves run for a second or two each in
tests/bench/test_bench_scenarios.py (``python -m bench all --smoke`` and three alone)."""
from __future__ import annotations

import struct
from collections import Counter

import pytest

from bench.harness.traffic import WriterConfig, key_index, key_of, key_schedule


# ------------------------------------------------------------------ pure pieces


def test_sequential_schedule_covers_every_key_once():
    cfg = WriterConfig(collector="", keys=1000, distribution="sequential", count=1000)
    sched = key_schedule(cfg)
    assert len(sched) & (len(sched) - 1) == 0  # a power of two, cycled with a mask
    assert [key_index(k) for k, _ in sched[:1000]] == list(range(1000))
    assert all(key_of(key_index(k)) == k for k, _ in sched[:10])


def test_uniform_and_zipf_schedules_stay_in_the_key_space():
    uni = key_schedule(WriterConfig(collector="", keys=100, seed=3), length=1 << 14)
    zipf = key_schedule(WriterConfig(collector="", keys=100, distribution="zipf", seed=3),
                        length=1 << 14)
    for sched in (uni, zipf):
        assert all(0 <= key_index(k) < 100 for k, _ in sched)
    top_uni = Counter(k for k, _ in uni).most_common(1)[0][1]
    top_zipf = Counter(k for k, _ in zipf).most_common(1)[0][1]
    assert top_zipf > 5 * top_uni  # zipf's head key is far hotter than any uniform key


def test_ttl_fraction_marks_that_share_of_updates():
    sched = key_schedule(WriterConfig(collector="", keys=50, ttl_fraction=0.25, ttl_s=2),
                         length=1 << 14)
    with_ttl = [p for _, p in sched if p]
    assert set(with_ttl) == {b"ttl=2\n"}
    assert 0.2 < len(with_ttl) / len(sched) < 0.3


def test_unknown_distribution_is_refused():
    with pytest.raises(ValueError):
        key_schedule(WriterConfig(collector="", keys=10, distribution="pareto"))


# ------------------------------------------------------------------ the ceiling

@pytest.mark.parametrize("blind", [False, True])
def test_forwarder_sequences_and_echoes_like_a_server(procs, port_base, zctx, blind):
    import zmq

    procs.python("-m", "bench.harness.forwarder", "--port", str(port_base),
                 *(["--blind"] if blind else []), ready="READY")
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port_base + 1}")
    pub = zctx.socket(zmq.XPUB)
    pub.connect(f"tcp://127.0.0.1:{port_base + 2}")
    assert pub.poll(10_000) and pub.recv() == b"\x01"  # the collector subscribed
    uuid = bytes(range(16))
    # The subscriber's own subscription may still be on its way: send until one arrives.
    got = None
    for attempt in range(200):
        pub.send_multipart([b"/probe", b"\0" * 8, uuid, b"", b"p"])
        if sub.poll(50):
            got = sub.recv_multipart()
            break
    assert got is not None and got[0] == b"/probe"
    first = struct.unpack(">Q", got[1])[0]
    while sub.poll(100):  # drain the probes still in flight
        first = struct.unpack(">Q", sub.recv_multipart()[1])[0]
    pub.send_multipart([b"a", b"\0" * 8, uuid, b"ttl=1\n", b"v1"])
    pub.send_multipart([b"a", b"\0" * 8, b"", b"", b""])
    assert sub.poll(5000)
    assert sub.recv_multipart() == [b"a", struct.pack(">Q", first + 1), uuid, b"ttl=1\n", b"v1"]
    assert sub.poll(5000)
    assert sub.recv_multipart() == [b"a", struct.pack(">Q", first + 2), b"", b"", b""]
