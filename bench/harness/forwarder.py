"""The ceiling: a bare Python forwarding loop with a CHP server's message shape.

``python -m bench.harness.forwarder --port P [--host H]`` binds a SUB collector on P+2 and a PUB
on P+1 (P itself is left alone: no snapshots), prints ``READY ...`` and then, for every
5-frame KVSET it receives: stores the value in a dict (an empty value deletes), and
publishes a 5-frame KVPUB with the next sequence, echoing UUID and properties. No
validation, no heartbeats, no TTLs, no event loop: a blocking loop over the same
shards.common.zio calls a real server uses, so "server / forwarder" says what everything a
server does beyond forwarding costs. A malformed message (not 5 frames) is skipped.

``--snapshots`` also binds a ROUTER on P that answers every ICANHAZ at once with a
KTHXBAI at the current sequence (no KVSYNC: the dict is never sent), and publishes a HUGZ
each second: enough for a clonemap client to start, write and follow, so ``bench peers``
can run its own client against it (the ``forwarder`` row: what the bare libzmq and
Python path of an acknowledged write costs, a floor under any Python server on libzmq).

SIGTERM ends it at once (the default action); SIGINT ends it cleanly.

``--blind`` reads every message as exactly five frames without looking at the MORE flags
(five copying receives, ~0.7 us a message here, against ~3.2 us for ``zio.recv_frames``).
No server can do that safely - one short message from anyone misaligns every later
one - so it is not the ceiling the targets use; the benchmark can run it beside the
real ceiling (``--blind-ceiling``) to show what reading whole messages costs.
"""
from __future__ import annotations

import argparse
import struct
import sys
import time

HWM = 100_000
"""Default SNDHWM of the PUB and RCVHWM of the collector: the shard server's defaults."""


def serve(host: str, port: int, core: int | None = None, pub_hwm: int = HWM,
          collect_hwm: int = HWM, blind: bool = False, snapshots: bool = False) -> None:
    if core is not None:
        import psutil

        psutil.Process().cpu_affinity([core])
    import zmq

    from clonemap.shards.common.zio import recv_frames, send_frames5

    if blind:
        from bench.harness.traffic import recv5

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    pub = ctx.socket(zmq.PUB)
    router = ctx.socket(zmq.ROUTER) if snapshots else None
    for s in (sub, pub, router):
        if s is not None:
            s.linger = 0
    sub.rcvhwm = collect_hwm
    pub.sndhwm = pub_hwm
    try:
        try:
            pub.bind(f"tcp://{host}:{port + 1}")
            sub.bind(f"tcp://{host}:{port + 2}")
            if router is not None:
                router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            sys.exit(f"forwarder: cannot bind {host}:{port}-{port + 2}: {exc}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        print(f"READY forwarder collector=tcp://{host}:{port + 2} "
              f"publisher=tcp://{host}:{port + 1}", flush=True)
        store: dict[bytes, bytes] = {}
        pack = struct.Struct(">Q").pack
        seq = 0
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        again = zmq.Again
        noblock = zmq.NOBLOCK
        next_hugz = time.monotonic() + 1.0
        while True:
            try:
                if blind:
                    frames = recv5(sub, noblock)
                else:
                    frames = recv_frames(sub)   # non-blocking: drain while there is input
            except again:
                if router is None:
                    poller.poll()               # nothing queued: wait for input
                    continue
                now = time.monotonic()
                if now >= next_hugz:
                    send_frames5(pub, b"HUGZ", pack(seq), b"", b"", b"")
                    next_hugz = now + 1.0
                ready = dict(poller.poll(max(1, int((next_hugz - now) * 1e3) + 1)))
                if router in ready:
                    answer_snapshots(router, pack(seq))
                continue
            if len(frames) != 5:
                continue
            key, _, uuid, props, value = frames
            if value:
                store[key] = value
            else:
                store.pop(key, None)
            seq += 1
            send_frames5(pub, key, pack(seq), uuid, props, value)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close(0)
        pub.close(0)
        ctx.term()


def answer_snapshots(router, seq_frame: bytes) -> None:
    """Every waiting ICANHAZ (``[identity, "ICANHAZ?", subtree, ...]``) answered with a
    KTHXBAI at ``seq_frame`` for its subtree; anything else is skipped."""
    import zmq

    from clonemap.shards.common.zio import recv_frames

    while True:
        try:
            frames = recv_frames(router)
        except zmq.Again:
            return
        if len(frames) >= 3 and frames[1] == b"ICANHAZ?":
            router.send_multipart([frames[0], b"KTHXBAI", seq_frame, b"", b"", frames[2]])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.harness.forwarder", description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--core", type=int, default=None, help="pin to this core")
    ap.add_argument("--pub-hwm", type=int, default=HWM)
    ap.add_argument("--collect-hwm", type=int, default=HWM)
    ap.add_argument("--snapshots", action="store_true",
                    help="answer ICANHAZ on P with an empty snapshot and publish HUGZ, so "
                         "a clonemap client can use it")
    ap.add_argument("--blind", action="store_true",
                    help="read five frames a message without checking MORE (unsafe; "
                         "for comparison only)")
    args = ap.parse_args(argv)
    serve(args.host, args.port, args.core, args.pub_hwm, args.collect_hwm, args.blind,
          args.snapshots)


if __name__ == "__main__":
    main()
