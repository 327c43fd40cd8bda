"""One client process of ``bench peers``: the same workload against clonemap, Redis, NATS
JetStream KV or etcd, each through its usual Python client on uvloop.

    python -m bench.harness.peer_clients SYSTEM WORKLOAD 'JSON OPTIONS'

It prints ``START`` when its measured window opens and ``END`` when it closes (the
orchestrator samples the server's CPU at both), then writes its results as JSON to the
file ``out`` names and prints ``DONE``. Latencies come back as at most ``SAMPLES`` of
them, evenly strided, with the stride. Workloads:

* ``rate``: writes at a fixed rate, open loop (each write's latency counts from when it
  was due, so a stall is not hidden by the writes it delayed);
* ``closed``: ``inflight`` writers, each the next write when its last is acknowledged;
* ``preload``: ``keys`` keys of the map written once (closed, 100 in flight);
* ``watch``: ``clients`` watchers of the map in this process; after ``READY`` it reads
  the writers' window from its standard input (``LO HI UNTIL``, epoch s) and counts each
  change written in it, with its latency from the time its value carries, until UNTIL;
* ``join``: a new client, until it holds the whole map and follows it.

Every value is ``value_bytes`` long and starts with when it was due (epoch ns, 8 bytes:
a write in a window, ``rate``'s ``t0``) or written, for the watchers' latency and window. Key i < ``keys`` is ``k<i>`` (Redis's hash field,
NATS's KV key), ``/p/k<i>`` (etcd) or ``/p/w<n>/k<i>`` with n = i mod ``writers``
(clonemap: writer n's subtree; ``key_index``). Clients: clonemap's ``AsyncClone``; redis-py with hiredis (the map is a
hash; a fan-out write is ``MULTI HSET PUBLISH EXEC``, a join ``SUBSCRIBE`` then
``HGETALL``); nats-py (a JetStream KV bucket); aetcd (gRPC). A library that is missing
makes the process exit 3 with one line saying which.
"""
from __future__ import annotations

import asyncio
import json
import struct
import sys
import time

_NS = struct.Struct(">Q")
SAMPLES = 5000


def key_index(o: dict, j: int) -> int:
    """The j-th key writer ``writer`` of ``writers`` writes: those with index mod writers
    equal to its number, in turn (so that the map stays ``keys`` keys and each writer's
    keys are its own)."""
    writers = o.get("writers", 1)
    return o.get("writer", 0) + writers * (j % max(1, o["keys"] // writers))


def sample(lat: list[int]) -> dict:
    lat.sort()
    stride = max(1, len(lat) // SAMPLES)
    return {"lat_ns": lat[::stride], "stride": stride}


MISSING_EXIT = 3


def value_of(size: int, i: int, stamp_ns: int | None = None) -> bytes:
    """``size`` bytes that start with ``stamp_ns`` (now, epoch ns, if None)."""
    head = _NS.pack(time.time_ns() if stamp_ns is None else stamp_ns)
    body = b"%d" % i
    return head + body + b"x" * max(0, size - len(head) - len(body))


def sent_ns(value: bytes) -> int:
    return _NS.unpack_from(value)[0] if len(value) >= 8 else 0


# ---------------------------------------------------------------------------- systems

class Clonemap:
    """``subtree``: a writer that follows only its own keys (``/p/w<n>/``) instead of the
    whole map (a Clone client holds what it follows: a whole-map writer also applies
    every other writer's updates)."""

    def __init__(self, address: str, subtree: str = "", writers: int = 1):
        self.address = address
        self.subtree = subtree
        self.writers = writers
        self.clone = None

    async def open(self):
        from clonemap.client.api import AsyncClone

        self.clone = AsyncClone(self.address, codec="bytes", timeout_s=30,
                                subtree=self.subtree)
        await self.clone.start()

    async def close(self):
        if self.clone is not None:
            await self.clone.close()

    async def put(self, i: int, value: bytes):
        # key i belongs to writer i mod writers: /p/w<n>/ is that writer's subtree
        await self.clone.set(f"/p/w{i % self.writers}/k{i}", value, wait=True)

    fanout_put = put

    async def watch(self, on_value):
        async with self.clone.watch("/p/") as w:
            async for change in w:
                if change.value:
                    on_value(change.value)

    async def join(self) -> int:
        return len(self.clone)  # started: the whole map is in, and followed


class Redis:
    def __init__(self, address: str):
        self.address = address
        self.r = None

    async def open(self):
        import redis.asyncio as aioredis

        host, port = self.address.rsplit(":", 1)
        self.r = aioredis.Redis(host=host, port=int(port), max_connections=256)
        await self.r.ping()

    async def close(self):
        if self.r is not None:
            await self.r.aclose()

    async def put(self, i: int, value: bytes):
        await self.r.hset("p", f"k{i}", value)

    async def fanout_put(self, i: int, value: bytes):
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset("p", f"k{i}", value)
            pipe.publish("p", value)
            await pipe.execute()

    async def subscribe(self):
        pubsub = self.r.pubsub()
        await pubsub.subscribe("p")
        await pubsub.get_message(timeout=5)  # the subscription's confirmation
        return pubsub

    async def watch(self, on_value):
        pubsub = await self.subscribe()
        async for msg in pubsub.listen():
            if msg["type"] == "message":
                on_value(msg["data"])

    async def join(self) -> int:
        pubsub = await self.subscribe()  # following first: nothing between is missed
        data = await self.r.hgetall("p")
        self._joined = (pubsub, data)
        return len(data)


class Nats:
    def __init__(self, address: str):
        self.address = address
        self.nc = self.kv = None

    async def open(self):
        import nats

        self.nc = await nats.connect(f"nats://{self.address}")
        js = self.nc.jetstream()
        try:
            self.kv = await js.key_value("p")
        except Exception:
            from nats.js.api import KeyValueConfig, StorageType

            self.kv = await js.create_key_value(KeyValueConfig(bucket="p", history=1,
                                                               storage=StorageType.FILE))

    async def close(self):
        if self.nc is not None:
            await self.nc.close()

    async def put(self, i: int, value: bytes):
        await self.kv.put(f"k{i}", value)

    fanout_put = put

    async def watch(self, on_value):
        """New changes only (an ordered consumer from now on the bucket's subjects: what
        the Go client's ``UpdatesOnly`` does; nats-py's KV watch starts with every key)."""
        from nats.js.api import DeliverPolicy

        async def on_msg(msg):
            if msg.data:
                on_value(msg.data)

        sub = await self.nc.jetstream().subscribe("$KV.p.>", cb=on_msg, ordered_consumer=True,
                                                  deliver_policy=DeliverPolicy.NEW)
        try:
            await asyncio.Event().wait()
        finally:
            await sub.unsubscribe()

    async def join(self) -> int:
        watcher = await self.kv.watchall()  # every current value, then a None marker
        out = {}
        async for entry in watcher:
            if entry is None:
                break
            out[entry.key] = entry.value
        self._joined = (watcher, out)
        return len(out)


class Etcd:
    def __init__(self, address: str):
        self.address = address
        self.c = None

    async def open(self):
        import aetcd

        host, port = self.address.rsplit(":", 1)
        # a whole 100,000-key map in one range read is ~12 MB: over gRPC's 4 MiB default
        self.c = aetcd.Client(host=host, port=int(port),
                              options={"grpc.max_receive_message_length": 1 << 30})
        await self.c.connect()

    async def close(self):
        if self.c is not None:
            await self.c.close()

    async def put(self, i: int, value: bytes):
        await self.c.put(b"/p/k%d" % i, value)

    fanout_put = put

    async def watch(self, on_value):
        import aetcd

        async for event in await self.c.watch_prefix(b"/p/"):
            if event.kind == aetcd.EventKind.PUT:
                on_value(event.kv.value)

    async def join(self) -> int:
        result = await self.c.get_prefix(b"/p/")
        data = {kv.key: kv.value for kv in result.kvs}
        # following from the revision after the read: no change between is missed
        watch = await self.c.watch_prefix(b"/p/", start_revision=result.header.revision + 1)
        self._joined = (watch, data)
        return len(data)


SYSTEMS = {"clonemap": Clonemap, "redis": Redis, "nats": Nats, "etcd": Etcd,
           "forwarder": Clonemap}
LIBRARIES = {"clonemap": ("clonemap.client.api",), "redis": ("redis.asyncio",),
             "nats": ("nats", "nats.js.api"), "etcd": ("aetcd",), "forwarder": ("clonemap.client.api",)}
"""Imported before any measured window (a join would otherwise time the imports)."""


# ---------------------------------------------------------------------------- workloads

def mark(word: str) -> None:
    print(word, flush=True)


async def rate(system, o: dict) -> dict:
    """Open loop at ``rate`` writes/s for ``warmup`` + ``seconds`` (from ``t0``, epoch s,
    when given: the fan-out's watchers know the window in advance). The loop sleeps until
    the next write is due (at least 1 ms: the event loop's timer resolution) and sends
    every write due; latencies are taken on the monotonic clock."""
    per_s, warmup, seconds, size = o["rate"], o["warmup"], o["seconds"], o["value_bytes"]
    put = system.fanout_put if o.get("fanout") else system.put
    lat: list[int] = []
    errors: list[str] = []
    pending: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    clock = time.monotonic
    t0 = clock() + max(0.0, o.get("t0", 0.0) - time.time())
    start, end = t0 + warmup, t0 + warmup + seconds

    # with a window given (``t0``, epoch s: the fan-out's), each value carries when it
    # was due, in integer epoch ns from ``t0``, and a write counts when that stamp is in
    # [t0 + warmup, t0 + warmup + seconds): the watchers apply the same test to the same
    # integers, so both count the same writes even when a loaded host makes this loop late
    stamped = "t0" in o
    if stamped:
        base_ns = int(o["t0"] * 1e9)
        lo_ns = int((o["t0"] + warmup) * 1e9)
        hi_ns = int((o["t0"] + warmup + seconds) * 1e9)

    async def one(i: int, due: float, counted: bool, stamp_ns: int | None):
        try:
            await put(i, value_of(size, i, stamp_ns))
        except Exception as exc:  # reported, never hidden
            errors.append(repr(exc)[:200])
            return
        if counted:
            lat.append(int((clock() - due) * 1e9))

    await asyncio.sleep(max(0.0, t0 - clock()))
    sent = offered = 0
    opened = False
    cpu0 = time.process_time()
    while (now := clock()) < end:
        if not opened and now >= start:
            opened, cpu0 = True, time.process_time()
            mark("START")
        while t0 + sent / per_s <= now:
            due = t0 + sent / per_s
            stamp = base_ns + int(sent * 1e9 / per_s) if stamped else None
            counted = lo_ns <= stamp < hi_ns if stamp is not None else start <= due < end
            offered += counted
            task = loop.create_task(one(key_index(o, sent), due, counted, stamp))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        await asyncio.sleep(max(0.001, t0 + sent / per_s - clock()))
    if pending:
        await asyncio.wait(pending, timeout=30)
    cpu = time.process_time() - cpu0
    mark("END")
    return {"acks": len(lat), "offered": offered, **sample(lat),
            "client_cpu_s": cpu, "errors": errors[:5], "error_count": len(errors)}


async def closed(system, o: dict) -> dict:
    inflight, warmup, seconds, size = (o["inflight"], o["warmup"], o["seconds"],
                                       o["value_bytes"])
    clock = time.monotonic
    t0 = clock()
    start, end = t0 + warmup, t0 + warmup + seconds
    counts = [0]
    lat: list[int] = []
    errors: list[str] = []
    nxt = [0]

    async def writer():
        while (now := clock()) < end:
            i = nxt[0]
            nxt[0] += 1
            try:
                await system.put(key_index(o, i), value_of(size, i))
            except Exception as exc:
                errors.append(repr(exc)[:200])
                continue
            done = clock()
            if start <= now and done < end:
                counts[0] += 1
                lat.append(int((done - now) * 1e9))

    async def window():
        await asyncio.sleep(max(0.0, start - clock()))
        cpu0 = time.process_time()
        mark("START")
        await asyncio.sleep(max(0.0, end - clock()))
        mark("END")
        return time.process_time() - cpu0

    results = await asyncio.gather(window(), *(writer() for _ in range(inflight)))
    return {"acks": counts[0], "seconds": seconds, **sample(lat),
            "client_cpu_s": results[0], "errors": errors[:5], "error_count": len(errors)}


async def preload(system, o: dict) -> dict:
    keys, size = o["keys"], o["value_bytes"]
    queue = iter(range(keys))

    async def writer():
        for i in queue:
            await system.put(i, value_of(size, i))

    t0 = time.monotonic()
    mark("START")
    await asyncio.gather(*(writer() for _ in range(100)))
    mark("END")
    return {"keys": keys, "seconds": time.monotonic() - t0}


async def watch(make, o: dict) -> dict:
    """``clients`` watchers, each its own client (connection), until ``until``."""
    clients = []
    for _ in range(o["clients"]):
        c = make()
        await c.open()
        clients.append(c)
    lat: list[int] = []
    counts = [0]
    window = [1 << 62, 0]

    def on_value(value: bytes):
        sent = sent_ns(value)
        if window[0] <= sent < window[1]:
            counts[0] += 1
            lat.append(time.time_ns() - sent)

    tasks = [asyncio.ensure_future(c.watch(on_value)) for c in clients]
    await asyncio.sleep(0.5)  # the watches are established (each awaited its subscription)
    mark("READY")
    # the writers' window (epoch s), sent once every watcher is ready: "LO HI UNTIL"
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    lo, hi, until = map(float, line.split())
    window[:] = [int(lo * 1e9), int(hi * 1e9)]  # as the writers compute theirs
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, until - time.time()))
    cpu = time.process_time() - cpu0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in clients:
        await c.close()
    return {"delivered": counts[0], **sample(lat), "client_cpu_s": cpu}


async def join(system, o: dict) -> dict:
    mark("START")
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    await system.open()
    n = await system.join()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    mark("END")
    return {"keys": n, "join_s": elapsed, "client_cpu_s": cpu}


async def main(name: str, workload: str, options: dict) -> dict:
    cls = SYSTEMS[name]
    if workload == "watch":
        return await watch(lambda: cls(options["address"]), options)
    writers = options.get("writers", 1)
    if cls is not Clonemap:
        system = cls(options["address"])
    elif options.get("writer_subtree") and workload in ("rate", "closed"):
        system = cls(options["address"], f"/p/w{options.get('writer', 0)}/", writers)
    else:
        system = cls(options["address"], "", writers)
    try:
        if workload == "join":
            return await join(system, options)
        await system.open()
        return await {"rate": rate, "closed": closed, "preload": preload}[workload](
            system, options)
    finally:
        await system.close()  # (nothing to close if it never opened)


def run() -> None:
    name, workload, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    try:
        for module in LIBRARIES[name]:
            __import__(module)
    except ImportError as exc:
        print(f"MISSING {name}: {exc}", flush=True)
        sys.exit(MISSING_EXIT)
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    out = run_loop(main(name, workload, options))
    # to a file: a long line printed here came out cut at the end of a pipe's buffer
    with open(options["out"], "w") as f:
        json.dump(out, f)
    print("DONE", flush=True)


if __name__ == "__main__":
    run()
