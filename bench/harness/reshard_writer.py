"""The writer and follower of ``bench reshard``: ``wait=True`` writes at a fixed rate to
random keys of the loaded map, each timed from the call to its acknowledgement, while
its client follows the whole map.

    python -m bench.harness.reshard_writer CONFIG --keys N --segments S --rate R
        --moves NEW_CONFIG
    python -m bench.harness.reshard_writer --valkey PORT --moving-slots LO-HI,... ...

Prints ``READY`` once the client holds the map. Reads commands on standard input:
``MARK name`` records the time, this process's CPU time (``cpu_s``) and the client's
counters by shard under ``name`` (``t0``: when the writes began); ``STOP`` ends
the writes and prints one JSON line: ``{"t0", "writes": [[start, latency or -1,
moving]], "stalls": [[when, how late, the loop thread's CPU meanwhile]] (the loop's turns
that came ``STALL_S`` or more late: when the CPU is as long, the client's own work made
every write wait; when it is short, the process waited for a core), "collections":
[[when, generation, wall s, the loop thread's CPU s]] (every full garbage collection, and
any other of 5 ms or more), "marks": {name: {"t", "shards": {shard: {"applied",
"snapshots", "staged", "resumes", "resume_updates", "keys", "bytes" (the end mark
only)}}}}, "errors"}``. A write's
key ``moves`` when NEW_CONFIG's routing gives it to another shard than CONFIG's.
"""
from __future__ import annotations

import argparse
import array
import asyncio
import gc
import json
import random
import sys
import time

TICK_S = 0.005
"""The loop-lag probe's period: a sleep this long that wakes later than it should says
the loop was busy (or the process not scheduled) meanwhile."""
STALL_S = 0.01
"""A probe this late or more is recorded (``stalls``)."""


def key_of(i: int, segments: int) -> str:
    return f"/s{i % segments}/k{i}"


def counters(clone, with_bytes: bool = False) -> dict:
    """What the client received so far, by shard: updates applied, and the keys its part
    holds; ``with_bytes``: and their bytes (key + value), one pass over the map (~0.4 s
    at 1M keys on the client's loop: only once the writes are over)."""
    return {"t": time.monotonic(), "cpu_s": time.process_time(), "shards": {
        agent.name: {"applied": agent.applied, "snapshots": agent.snapshots,
                     "staged": agent.staged,
                     "adoptions": agent.incoming.adoptions,
                     "adoption_rows": agent.incoming.adoption_rows,
                     "adoptions_refused": agent.incoming.adoptions_refused,
                     "resumes": agent.incoming.resumes,
                     "resume_updates": agent.incoming.resume_updates,
                     "keys": len(agent.map),
                     **({"bytes": sum(len(k) + len(v) for k, v in agent.map.items())}
                        if with_bytes else {})}
        for agent in clone.agents}}


class ValkeyTarget:
    """The same writes to a Valkey cluster (``--valkey PORT``): our pipelined RESP client
    (``bench.harness.resp``), one connection a node, MOVED and ASK followed. redis-py's
    clients measured themselves here: its blocking one in a pool of threads cost more
    than 200 us of this host's CPU a write (2,815 writes/s of 5,000 sent), and its asyncio
    one failed under the migration (at 1M keys: 12,569 writes timed out after 30 s and 76
    failed inside it, ``'NoneType' object has no attribute 'writelines'``)."""

    def __init__(self, port: int, moving: str):
        import redis
        from redis.crc import key_slot

        from bench.harness.resp import RespCluster, slot_table

        node = redis.Redis(host="127.0.0.1", port=port)
        try:
            table = slot_table(node.execute_command("CLUSTER", "SLOTS"))
        finally:
            node.close()
        self.client = RespCluster(table, key_slot)
        self._key_slot = key_slot
        self.ranges = [tuple(map(int, r.split("-"))) for r in moving.split(",") if r]
        self.agents = ()

    def moves(self, key: str) -> int:
        slot = self._key_slot(key.encode())
        return int(any(lo <= slot <= hi for lo, hi in self.ranges))

    async def set(self, key: str, value: bytes, wait: bool, timeout_s: float) -> None:
        await asyncio.wait_for(self.client.set(key.encode(), value), timeout_s)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.client.close()


async def main(args) -> int:
    if args.valkey:
        return await run(args, ValkeyTarget(args.valkey, args.moving_slots), None)
    from clonemap.client.api import AsyncClone
    from clonemap.shards.common.placement import load_plan

    before = load_plan(args.config).routing.shard_map()
    after = load_plan(args.moves).routing.shard_map()
    return await run(args, AsyncClone(config=args.config, timeout_s=600),
                     lambda key: int(before.owner(key) != after.owner(key)))


async def run(args, target, moves) -> int:
    from clonemap.shards.common.errors import ClonemapError

    moves = moves if moves is not None else target.moves
    failures = (ClonemapError, OSError, asyncio.TimeoutError, Exception)
    rnd = random.Random(7)
    # each write's start, wait (-1: failed) and whether its key moves, in flat arrays
    # until the end, not a tuple per write in a list that the collector walks (100,000
    # by the change's end): the garbage collections of this process are the client's
    # (``collections``). Its full collections took 22-65 ms of the loop's CPU either way.
    starts, waits, moving_of = array.array("d"), array.array("d"), array.array("b")
    stalls: list[tuple[float, float, float]] = []
    collections: list[tuple[float, int, float, float]] = []  # (when, generation, wall, CPU)
    began: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[:] = [time.monotonic(), time.thread_time()]
        elif began:
            took = time.monotonic() - began[0]
            if info["generation"] == 2 or took >= 0.005:
                collections.append((round(began[0] - t0, 4), info["generation"],
                                    round(took, 4), round(time.thread_time() - began[1], 4)))

    marks: dict[str, dict] = {}
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    value = b"w" * args.value_bytes
    async with target as clone:
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                     sys.stdin)
        t0 = time.monotonic()
        gc.callbacks.append(on_gc)
        marks["t0"] = {"t": t0, "cpu_s": time.process_time(), "shards": {}}
        tasks: set[asyncio.Task] = set()

        async def one(key: str, moving: int) -> None:
            start = time.monotonic()
            try:
                await clone.set(key, value, wait=True, timeout_s=args.write_timeout_s)
                wait = time.monotonic() - start
            except failures as exc:  # noqa: BLE001 - a failed write is a figure
                wait = -1.0
                name = type(exc).__name__
                errors[name] = errors.get(name, 0) + 1
                examples.setdefault(name, str(exc)[:300])
            starts.append(start - t0)
            waits.append(wait)
            moving_of.append(moving)

        async def paced() -> None:
            period = 1.0 / args.rate
            due = time.monotonic()
            while not stop.is_set():
                due += period
                i = rnd.randrange(args.keys)
                key = key_of(i, args.segments)
                moving = moves(key)
                task = asyncio.ensure_future(one(key, moving))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

        async def probe() -> None:
            while not stop.is_set():
                asked, cpu = time.monotonic(), time.thread_time()
                await asyncio.sleep(TICK_S)
                late = time.monotonic() - asked - TICK_S
                if late >= STALL_S:
                    stalls.append((round(asked - t0, 4), round(late, 4),
                                   round(time.thread_time() - cpu, 4)))

        async def commands() -> None:
            while True:
                line = (await reader.readline()).decode().split()
                if not line or line[0] == "STOP":
                    stop.set()
                    return
                if line[0] == "MARK":
                    marks[line[1]] = counters(clone)
                    print(f"MARKED {line[1]}", flush=True)

        await asyncio.gather(paced(), commands(), probe())
        await asyncio.gather(*tasks, return_exceptions=True)
        marks["end"] = counters(clone, with_bytes=True)
    writes = [[round(a, 6), round(b, 6), c] for a, b, c in zip(starts, waits, moving_of)]
    print(json.dumps({"t0": t0, "writes": writes, "stalls": stalls,
                      "collections": collections, "marks": marks, "errors": errors,
                      "error_examples": examples,
                      "redirects": dict(getattr(getattr(target, "client", None),
                                                "redirects", {}))}), flush=True)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.harness.reshard_writer")
    ap.add_argument("config", nargs="?")
    ap.add_argument("--moves")
    ap.add_argument("--valkey", type=int, default=None, metavar="PORT",
                    help="write to the Valkey cluster with a node at PORT instead")
    ap.add_argument("--moving-slots", default="", help="with --valkey: LO-HI,... slots "
                                                       "that move")
    ap.add_argument("--keys", type=int, required=True)
    ap.add_argument("--segments", type=int, required=True)
    ap.add_argument("--rate", type=float, default=5000.0)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--write-timeout-s", type=float, default=30.0)
    sys.exit(asyncio.run(main(ap.parse_args())))
