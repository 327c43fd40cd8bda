"""Fan-out readers: SUB sockets spread over processes, so a fan-out figure is the
publisher's and the relays', not one reader process's (``bench.relays``' fan-out part).

``subscriber_processes`` plans how many sockets each reader process holds;
``python -m bench.harness.readers`` is one reader process (READY once every socket heard
its welcome HUGZ, then one JSON line: counts, and a strided sample of its latencies with
their count); ``weighted_percentiles`` merges the processes' samples.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import time

import zmq

from bench.harness.procs import own_cpu_seconds
from bench.harness.stats import percentile

STAMP = struct.Struct(">Q")
SAMPLE = 20_000
"""A fan-out subscriber process returns at most about this many of its latencies (an
even stride through the sorted list) with their count, not millions of them."""


def subscriber_processes(subscribers: int, relays: int, requested: int = 0,
                         cores: int | None = None) -> list[int]:
    """How many SUB sockets each fan-out subscriber process holds: ``requested``
    processes, or (0) one per core left after the pair, the relays and the writer, at
    most one per 10 sockets and at least one; the sockets split as evenly as they go."""
    if requested:
        n = requested
    else:
        cores = cores or len(os.sched_getaffinity(0))
        n = max(1, min(cores - (2 + relays + 1), subscribers // 10))
    n = max(1, min(n, subscribers))
    return [subscribers // n + (1 if i < subscribers % n else 0) for i in range(n)]


def weighted_percentiles(parts: list[dict], points=(0.50, 0.99)) -> dict:
    """Percentiles over every process's deliveries from each one's strided sample of its
    sorted latencies (``sample_ns``) and its count: each sample stands for count/len
    deliveries (``bench.harness.stats``, weighted). ``max`` is exact (each process's
    own)."""
    pairs = sorted((v, p["count"] / len(p["sample_ns"]))
                   for p in parts if p["sample_ns"] for v in p["sample_ns"])
    if not pairs:
        return {f"p{round(q * 100)}_ms": None for q in points} | {"max_ms": None}
    values, weights = [v for v, _ in pairs], [w for _, w in pairs]
    out: dict = {f"p{round(q * 100)}_ms": round(percentile(values, q * 100, weights) / 1e6, 3)
                 for q in points}
    out["max_ms"] = round(max(p["max_ns"] for p in parts if p["sample_ns"]) / 1e6, 3)
    return out


def whole_message_reader():
    """``recv(sock)``: one whole message without blocking, or None. On the compiled frame
    path one C call per message (``zio.compiled_recv``), else ``recv_multipart``: the
    readers must outrun the fan-out they measure."""
    from clonemap.shards.common import zio

    if zio.COMPILED:
        read = zio.compiled_recv()

        def recv(sock):
            return read(sock.underlying, 1, 5)   # 1 = NOBLOCK
        return recv

    def recv_pure(sock):
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
    return recv_pure


def reader_main(args) -> None:
    """``--subscribers`` SUBs round-robin over ``--endpoints``; READY once each heard its
    welcome HUGZ; then every ``/fan/`` update's latency until each has ``--expect``."""
    endpoints = args.endpoints.split(",")
    ctx = zmq.Context()
    socks = []
    for i in range(args.subscribers):
        s = ctx.socket(zmq.SUB)
        s.rcvhwm = 0
        s.subscribe(b"/fan/")
        s.subscribe(b"HUGZ")
        s.connect(endpoints[(args.first + i) % len(endpoints)])
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    live = set()
    counts = [0] * len(socks)
    lat: list[int] = []
    index = {s: i for i, s in enumerate(socks)}
    recv = whole_message_reader()
    stamp, now_ns, warm, expect = STAMP.unpack_from, time.monotonic_ns, args.warm, args.expect
    short = len(socks)          # sockets that have not yet had --expect updates
    deadline = time.monotonic() + 60
    ready = False
    while time.monotonic() < deadline:
        for s, _ in poller.poll(200):
            i = index[s]
            n = counts[i]
            while (frames := recv(s)) is not None:
                if frames[0] == b"HUGZ":
                    live.add(i)
                    continue
                if n >= warm:    # this socket's warm-up is not timed
                    lat.append(now_ns() - stamp(frames[4])[0])
                n += 1
                if n == expect:
                    short -= 1
            counts[i] = n
        if not ready and len(live) == len(socks):
            ready = True
            print("READY", flush=True)
        if ready and short <= 0:
            break
    lat.sort()
    print(json.dumps({"counts": [min(counts), max(counts)], "count": len(lat),
                      "sample_ns": lat[::max(1, len(lat) // SAMPLE)],
                      "max_ns": lat[-1] if lat else 0, "cpu_s": own_cpu_seconds()}),
          flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.harness.readers",
                                 description="one fan-out reader process")
    ap.add_argument("--subscribers", type=int, required=True, help="SUB sockets here")
    ap.add_argument("--endpoints", required=True, help="publishers, comma-separated")
    ap.add_argument("--first", type=int, default=0,
                    help="this process's first socket's place in the round robin")
    ap.add_argument("--expect", type=int, required=True, help="updates each socket gets")
    ap.add_argument("--warm", type=int, default=0, help="untimed updates first")
    return ap.parse_args(argv)


if __name__ == "__main__":
    reader_main(parse_args())
