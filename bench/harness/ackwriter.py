"""A writer process for the pair benchmarks: ``wait=True`` writes, ``--in-flight`` at a
time, each timed from the call to its acknowledgement (the active's KVPUB back here).

    python -m bench.harness.ackwriter SERVERS --seconds S [--in-flight K] [--prefix P]

SERVERS: one shard's pair, ``tcp://A:P,tcp://B:P``. Prints ``READY`` once the client has
its map, then (at the end, or at SIGTERM) one JSON line: ``{"t0", "writes": [[start,
latency or -1, ...]], "errors"}``, start times relative to ``t0`` (CLOCK_MONOTONIC, the
same in every network namespace of a host), a failed write's latency -1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time


async def main(args) -> int:
    from clonemap.client.api import AsyncClone, ClonemapError

    servers = args.servers.split(",")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    writes: list[tuple[float, float]] = []
    errors: dict[str, int] = {}
    async with AsyncClone(servers, timeout_s=30, heartbeat_s=args.heartbeat_s,
                          silence_timeout_s=3 * args.heartbeat_s) as clone:
        print("READY", flush=True)
        t0 = time.monotonic()
        end = t0 + args.seconds
        counter = iter(range(1 << 62))

        async def one_lane(lane: int) -> None:
            while not stop.is_set() and time.monotonic() < end:
                n = next(counter)
                start = time.monotonic()
                try:
                    await clone.set(f"{args.prefix}{n}", b"x" * args.value_bytes, wait=True,
                                    timeout_s=args.write_timeout_s)
                    writes.append((round(start - t0, 6), round(time.monotonic() - start, 6)))
                except ClonemapError as exc:
                    writes.append((round(start - t0, 6), -1.0))
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

        await asyncio.gather(*(one_lane(i) for i in range(args.in_flight)))
    print(json.dumps({"t0": t0, "writes": writes, "errors": errors}), flush=True)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.harness.ackwriter")
    ap.add_argument("servers")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--in-flight", type=int, default=1)
    ap.add_argument("--prefix", default="/ack/")
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--heartbeat-s", type=float, default=0.2)
    ap.add_argument("--write-timeout-s", type=float, default=2.0)
    import uvloop

    sys.exit(uvloop.run(main(ap.parse_args())))
