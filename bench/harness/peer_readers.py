"""The read-mostly workload of ``bench peers``: one writer process and reader processes,
each through its system's usual client, every read a local or remote read of one key.

    python -m bench.harness.peer_readers writer SYSTEM 'JSON OPTIONS'
    python -m bench.harness.peer_readers reader SYSTEM VARIANT 'JSON OPTIONS'

The map: ``keys`` keys of ``value_bytes``; the writer sets them first (``load``: the
first read path of a system) in the reader's form (Redis: string keys ``s:k<i>``, since a tracked
hash would be invalidated whole by every write to it), then, from ``t0`` (epoch s) to
``until``, changes ``rate`` random keys a second, each acknowledged before the next is
due (open loop). Every ``probe_every``-th write is to the probe key, its value the
write's number; the writer records when each probe write was acknowledged
(``CLOCK_MONOTONIC``, shared by every process of the host).

A reader reads random keys as fast as it can; every 16 reads it looks at the clock, and
if ``probe_us`` passed since its last look at the probe key, it reads the probe key
too. In the window ``[t0 + warmup, t0 + warmup + seconds)`` it counts its reads and its
CPU, records when it first saw each probe number and every probe read's (time, number).
From those and the writer's acknowledgements the orchestrator derives staleness (first
seen - acknowledged) and stale reads (a probe read that returned a number older than
one acknowledged more than 10 ms before the read began).

Variants (``VARIANTS``): clonemap ``get`` (``Clone.get`` on the reader's thread) and
``aget`` (``AsyncClone.get`` inside the event loop, yielding every 256 reads); redis
``get`` (a ``GET`` per read) and ``cache`` (client-side caching: ``CLIENT TRACKING ON
REDIRECT`` to a second connection subscribed to ``__redis__:invalidate``, read by a
thread that evicts; warmed with every key before the window, as the other copies hold
the whole map; a miss is a ``GET``); nats ``get`` (``kv.get``) and ``watch`` (a
local copy built by ``kv.watchall``); etcd ``get`` (a range read) and ``watch`` (a
range read, then a watch from the next revision).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import sys
import threading
import time

VARIANTS = {"clonemap": ("get", "aget", "dict"), "redis": ("get", "cache"),
            "nats": ("get", "watch"), "etcd": ("get", "watch")}
PROBE = "probe"
_clock = time.monotonic_ns
_NUM = struct.Struct(">Q")


def mark(word: str) -> None:
    print(word, flush=True)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """This process's resident set, bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class Footprint:
    """The memory workload: the RSS a copy of the map adds to a reader process. ``before``
    is taken with the client imported and connected, ``held(copy_len)`` once the copy is
    complete (after a collection: what the process keeps, not what it passed through)."""

    def __init__(self):
        self.rss0 = rss()

    def held(self, keys: int) -> dict:
        import gc

        gc.collect()
        grown = rss() - self.rss0
        return {"rss_before": self.rss0, "rss_grown": grown, "copy_keys": keys,
                "bytes_per_key": round(grown / max(keys, 1), 1)}


def value(size: int, n: int) -> bytes:
    head = _NUM.pack(n)
    return head + b"v" * max(0, size - len(head))


def number(blob) -> int:
    return _NUM.unpack_from(blob)[0] if blob is not None and len(blob) >= 8 else -1


def key_names(system: str, keys: int) -> list:
    """The map's keys in the form each client reads them, then the probe key last."""
    if system == "clonemap":
        return [f"/r/k{i}" for i in range(keys)] + [f"/r/{PROBE}"]
    if system == "redis":
        return [f"s:k{i}" for i in range(keys)] + [f"s:{PROBE}"]
    if system == "nats":
        return [f"r{i}" for i in range(keys)] + [PROBE]
    return [b"/r/k%d" % i for i in range(keys)] + [b"/r/" + PROBE.encode()]


# ---------------------------------------------------------------------------- readers

def ready(o: dict) -> None:
    """Say READY, then take the window's start (``T0``, epoch s) from standard input."""
    mark("READY")
    o["t0"] = float(sys.stdin.readline())


class Window:
    """The reader's counters over its window, and its probe log."""

    def __init__(self, o: dict):
        now_epoch, now_ns = time.time(), _clock()
        self.start_ns = now_ns + int((o["t0"] + o["warmup"] - now_epoch) * 1e9)
        self.end_ns = self.start_ns + int(o["seconds"] * 1e9)
        self.probe_ns = int(o["probe_us"] * 1000)
        self.reads = 0
        self.cpu_s = 0.0
        self.first_seen: dict[int, int] = {}
        self.probes: list[tuple[int, int]] = []
        self.last_probe = 0
        self.cpu0 = 0.0

    @staticmethod
    def picks(keys: list) -> list:
        """65,536 random keys (the probe key, last, not among them), read in turn."""
        rnd = random.Random(os.getpid())
        return [keys[rnd.randrange(len(keys) - 1)] for _ in range(1 << 16)]

    def probe_due(self, now: int) -> bool:
        if now - self.last_probe < self.probe_ns:
            return False
        self.last_probe = now
        return True

    def probed(self, now: int, blob) -> None:
        """The probe key read at ``now`` returned ``blob``."""
        seen = number(blob)
        self.probes.append((now, seen))
        if seen not in self.first_seen:
            self.first_seen[seen] = now

    def closed(self, reads: int) -> dict:
        self.cpu_s = time.process_time() - self.cpu0
        self.reads = reads
        mark("END")
        return self.result()

    def opened(self) -> None:
        mark("START")
        self.opened_ns = _clock()
        self.cpu0 = time.process_time()

    def result(self) -> dict:
        return {"reads": self.reads, "cpu_s": self.cpu_s, "first_seen": self.first_seen,
                "probes": self.probes,
                "elapsed_s": (self.end_ns - max(self.start_ns, self.opened_ns)) / 1e9}


RECONNECT_WAIT_S = 60.0
"""How long a reader cut off may take to be current again before it is reported as not."""


def after_cut(get, keys: list, is_resynced=None) -> dict:
    """The reconnect workload, once the copy is built and the link has been cut: read
    ``FINAL n`` (the writer's last probe number, written while the link was down), look
    at the copy until it holds it (and ``is_resynced()``, where the copy must be rebuilt),
    say ``CURRENT``, then read the changed keys' indices (a JSON line) and return what
    the copy holds for each."""
    final = int(sys.stdin.readline().split()[1])
    deadline = time.monotonic() + RECONNECT_WAIT_S
    while number(get(keys[-1])) < final or (is_resynced is not None and not is_resynced()):
        if time.monotonic() > deadline:
            mark("CURRENT never")
            break
        time.sleep(0.0005)
    else:
        mark(f"CURRENT {_clock()}")
    changed = json.loads(sys.stdin.readline())
    return {"changed_numbers": [number(get(keys[i])) for i in changed]}


def run_sync_reader(o: dict, get, keys: list, probe_key, probe_get=None) -> dict:
    """The loop of a reader whose reads are plain calls on this thread (``probe_get``:
    another way to read the probe key)."""
    probe_get = probe_get or get
    w = Window(o)
    picks, mask = w.picks(keys), (1 << 16) - 1
    while _clock() < w.start_ns:  # the map is in; the writer's changes are flowing
        for k in picks[:256]:
            get(k)
    w.opened()
    i = n = 0
    end = w.end_ns
    while True:
        for _ in range(16):
            get(picks[i & mask])
            i += 1
        n += 16
        now = _clock()
        if now >= end:
            break
        if w.probe_due(now):
            w.probed(now, probe_get(probe_key))
            n += 1
    return w.closed(n)


async def run_async_reader(o: dict, get, keys: list, probe_key, yield_every: int = 256,
                           aget=None) -> dict:
    """The loop of a reader inside an event loop: a local ``get`` yields every
    ``yield_every`` reads (so that the client's updates get in); ``aget`` awaits each
    read (a round trip)."""
    w = Window(o)
    picks, mask = w.picks(keys), (1 << 16) - 1
    while _clock() < w.start_ns:
        if aget is not None:
            await aget(picks[0])
        else:
            for k in picks[:256]:
                get(k)
        await asyncio.sleep(0)
    w.opened()
    i = n = 0
    end = w.end_ns
    while True:
        if aget is not None:
            for _ in range(16):
                await aget(picks[i & mask])
                i += 1
        else:
            for _ in range(16):
                get(picks[i & mask])
                i += 1
            if i % yield_every == 0:
                await asyncio.sleep(0)
        n += 16
        now = _clock()
        if now >= end:
            break
        if w.probe_due(now):
            w.probed(now, await aget(probe_key) if aget is not None else get(probe_key))
            n += 1
    return w.closed(n)


async def read_followed_copy(o: dict, local: dict, keys: list, follow) -> dict:
    """Read ``local`` (a watch-built copy) while ``follow()`` keeps it current."""
    task = asyncio.ensure_future(follow())
    try:
        if o.get("reconnect"):
            mark("BUILT")
            # looked at from a thread while this loop's task keeps the copy current
            return await asyncio.get_running_loop().run_in_executor(
                None, after_cut, local.get, keys)
        ready(o)
        return await run_async_reader(o, local.get, keys, keys[-1])
    finally:
        task.cancel()


def followed(result: dict, clone) -> dict:
    """``result`` with what the reader's client went through while it read: snapshots
    taken (1 is the first), gaps, resyncs for lag, the largest lag it saw. A staleness
    tail with none of these is the host's scheduling, not the client's catching up."""
    shards = clone.stats()["shards"]
    result["client"] = {
        "snapshots": sum(s["snapshots"] for s in shards),
        "gaps": sum(s["gaps"] for s in shards),
        "lagged": sum(s["lagged"] for s in shards),
        "fell_behind": clone.stats()["fell_behind"],
        "max_lag_seen_s": max((s["max_lag_seen_s"] for s in shards), default=0.0)}
    return result


def clonemap_reader(variant: str, o: dict) -> dict:
    if o.get("memory"):  # the copy's footprint; no key list is made before the baseline
        import zmq  # (imported, and its context made, before the copy: not counted)

        from clonemap.client.api import Clone

        zmq.Context.instance()
        foot = Footprint()
        if variant == "dict":  # the floor: a dict of the same keys (made after the
            # baseline, as a copy from the wire makes its own) and value sizes
            plain = {k: value(o["value_bytes"], 0) for k in key_names("clonemap", o["keys"])}
            return foot.held(len(plain))
        with Clone(o["address"], codec="bytes", timeout_s=600, subtree="/r/",
                   read_view=variant != "lean") as c:
            return foot.held(len(c))
    keys = key_names("clonemap", o["keys"])
    if variant in ("get", "dict"):
        from clonemap.client.api import Clone

        with Clone(o["address"], codec="bytes", timeout_s=60, subtree="/r/") as c:
            if o.get("reconnect"):
                mark("BUILT")
                return after_cut(c.get, keys)
            ready(o)
            if variant == "get":
                return followed(run_sync_reader(o, c.get, keys, keys[-1]), c)
            # the floor: a plain dict of the same keys, read by the same loop in a process
            # whose client applies the same updates (its probe key is the client's)
            plain = {k: v for k, v in c.items()}
            return followed(run_sync_reader(o, plain.get, keys, keys[-1], probe_get=c.get), c)

    async def main():
        from clonemap.client.api import AsyncClone

        async with AsyncClone(o["address"], codec="bytes", timeout_s=60,
                              subtree="/r/") as c:
            ready(o)
            return await run_async_reader(o, c.get, keys, keys[-1])

    return asyncio.run(main())


def redis_reader(variant: str, o: dict) -> dict:
    import redis

    host, port = o["address"].rsplit(":", 1)
    # (memory: the cache's key strings are made after the baseline, as a copy from the
    # wire makes its own; none made before it, whose freed memory the cache would reuse)
    keys = key_names("redis", o["keys"]) if not o.get("memory") else []
    r = redis.Redis(host=host, port=int(port), protocol=2)
    if variant == "get":
        ready(o)
        try:
            return run_sync_reader(o, r.get, keys, keys[-1])
        finally:
            r.close()
    # client-side caching, default (tracking) mode, invalidations on a second connection;
    # one command connection (tracking is a connection's, so a pool would lose it)
    r.close()
    r = redis.Redis(host=host, port=int(port), protocol=2, single_connection_client=True)
    cache: dict = {}
    inval = redis.Connection(host=host, port=int(port), protocol=2)  # RESP2: pub/sub replies
    stop = threading.Event()
    warm = threading.Event()
    evicted = [0]
    resyncs = [0]

    def track() -> None:
        """(Re)connect the invalidation connection and turn tracking on for the command
        connection; until both work, try again every 50 ms (the link may be down)."""
        while not stop.is_set():
            try:
                inval.disconnect()
                inval.connect()
                inval.send_command("CLIENT", "ID")
                redirect = int(inval.read_response())
                inval.send_command("SUBSCRIBE", "__redis__:invalidate")
                inval.read_response()  # the subscription's confirmation
                r.execute_command("CLIENT", "TRACKING", "ON", "REDIRECT", redirect)
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.05)

    def fill() -> None:
        """Every key read once (MGET, tracked like GET), as a clonemap or watch-built copy
        holds the whole map before its first read."""
        for i in range(0, len(keys), 1000):
            chunk = keys[i:i + 1000]
            for key, blob in zip(chunk, r.mget(chunk)):
                cache[key] = blob
        warm.set()

    def invalidations():
        while not stop.is_set():
            try:
                if not inval.can_read(timeout=0.1):
                    continue
                msg = inval.read_response()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                # the invalidations are lost with the link: the whole cache is suspect
                # (the Redis docs: flush it on a reconnect), then it is filled again
                warm.clear()
                cache.clear()
                resyncs[0] += 1
                track()
                while not stop.is_set():
                    try:
                        fill()
                        break
                    except (redis.ConnectionError, redis.TimeoutError, OSError):
                        time.sleep(0.05)
                continue
            if not isinstance(msg, list) or len(msg) < 3 or msg[0] != b"message":
                continue
            data = msg[2]
            if data is None:  # a flush: the whole cache is stale
                cache.clear()
                continue
            for key in data:
                cache.pop(key.decode(), None)
                evicted[0] += 1

    track()
    thread = threading.Thread(target=invalidations, daemon=True)
    thread.start()
    fetch = r.get
    foot = Footprint()
    if o.get("memory"):
        keys = key_names("redis", o["keys"])
    fill()
    if o.get("memory"):
        keys.clear()  # (the list itself is not the cache's)

    def close():
        stop.set()
        thread.join(2)
        inval.disconnect()
        r.close()

    if o.get("memory"):
        try:
            return foot.held(len(cache))
        finally:
            close()
    pending = object()

    def get(key):
        blob = cache.get(key, pending)
        if blob is not pending:
            return blob
        # a miss: a placeholder first, and the reply cached only if no invalidation took
        # the placeholder meanwhile (else a value fetched before a write would stay cached
        # until the key's next write: Redis's documented race)
        token = object()
        cache[key] = token
        blob = fetch(key)
        if cache.get(key) is token:
            cache[key] = blob
        return blob

    try:
        if o.get("reconnect"):
            mark("BUILT")
            out = after_cut(cache.get, keys,
                                 is_resynced=lambda: resyncs[0] > 0 and warm.is_set())
            out["resyncs"] = resyncs[0]
            return out
        ready(o)
        out = run_sync_reader(o, get, keys, keys[-1])
        out["evicted"] = evicted[0]
        out["cached_keys"] = len(cache)
        return out
    finally:
        close()


def nats_reader(variant: str, o: dict) -> dict:
    async def main():
        import nats

        nc = await nats.connect(f"nats://{o['address']}")
        kv = await nc.jetstream().key_value("r")
        keys = key_names("nats", o["keys"])
        try:
            if variant == "get":
                async def aget(key):
                    try:
                        return (await kv.get(key)).value
                    except Exception:
                        return None
                ready(o)
                return await run_async_reader(o, None, keys, keys[-1], aget=aget)
            local: dict = {}
            foot = Footprint()
            watcher = await kv.watchall()
            async for entry in watcher:  # every current value, then a None marker
                if entry is None:
                    break
                local[entry.key] = entry.value
            if o.get("memory"):
                await watcher.stop()
                return foot.held(len(local))

            async def follow():
                async for entry in watcher:
                    if entry is None:
                        continue
                    if entry.value:
                        local[entry.key] = entry.value
                    else:
                        local.pop(entry.key, None)

            try:
                return await read_followed_copy(o, local, keys, follow)
            finally:
                await watcher.stop()
        finally:
            await nc.close()

    return asyncio.run(main())


def etcd_reader(variant: str, o: dict) -> dict:
    async def main():
        import aetcd

        host, port = o["address"].rsplit(":", 1)
        c = aetcd.Client(host=host, port=int(port),
                         options={"grpc.max_receive_message_length": 1 << 30})
        await c.connect()
        keys = key_names("etcd", o["keys"])
        try:
            if variant == "get":
                async def aget(key):
                    got = await c.get(key)
                    return got.value if got is not None else None
                ready(o)
                return await run_async_reader(o, None, keys, keys[-1], aget=aget)
            foot = Footprint()
            result = await c.get_prefix(b"/r/")
            local = {kv.key: kv.value for kv in result.kvs}
            if o.get("memory"):
                del result
                return foot.held(len(local))
            seen = [result.header.revision]

            async def follow():
                # a broken watch is resumed from the revision after the last one seen (the
                # informer pattern; a compacted revision would need a relist: not met here)
                while True:
                    try:
                        watch = await c.watch_prefix(b"/r/", start_revision=seen[0] + 1)
                        async for event in watch:
                            if event.kind == aetcd.EventKind.PUT:
                                local[event.kv.key] = event.kv.value
                            else:
                                local.pop(event.kv.key, None)
                            seen[0] = max(seen[0], event.kv.mod_revision)
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        await asyncio.sleep(0.05)

            return await read_followed_copy(o, local, keys, follow)
        finally:
            await c.close()

    return asyncio.run(main())


READERS = {"clonemap": clonemap_reader, "redis": redis_reader, "nats": nats_reader,
           "etcd": etcd_reader}


# ---------------------------------------------------------------------------- the writer

async def write_loop(put, o: dict, names: list) -> dict:
    """Set every key once, then ``rate`` random changes a second until ``until``."""
    size, keys = o["value_bytes"], o["keys"]
    sem = asyncio.Semaphore(100)

    async def one(k, n):
        async with sem:
            await put(k, value(size, n))

    if o.get("load", True):  # (the next read paths of a system read the same map)
        await asyncio.gather(*(one(names[i], 0) for i in range(keys)))
        await put(names[-1], value(size, 0))
    mark("LOADED")
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    o["t0"], o["until"] = map(float, line.split())
    clock = time.monotonic
    t0 = clock() + max(0.0, o["t0"] - time.time())
    until = clock() + max(0.0, o["until"] - time.time())
    per_s, every = o["rate"], o["probe_every"]
    acks: list[tuple[int, int]] = []
    rnd = random.Random(1)
    await asyncio.sleep(max(0.0, t0 - clock()))
    sent = 0
    pending: set = set()

    async def change(n: int):
        if n % every == 0:
            await put(names[-1], value(size, n))
            acks.append((n, _clock()))
        else:
            await put(names[rnd.randrange(keys)], value(size, n))

    while clock() < until:
        while t0 + sent / per_s <= clock():
            sent += 1
            task = asyncio.ensure_future(change(sent))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.sleep(max(0.001, t0 + sent / per_s - clock()))
    if pending:
        await asyncio.wait(pending, timeout=30)
    return {"writes": sent, "acks": acks}


async def change_loop(put, o: dict, names: list) -> dict:
    """The reconnect workload's writer: the map (if ``load``), ``LOADED``, then on ``go``
    ``changes`` distinct random keys changed once each, 100 in flight, the probe key
    last; ``CHANGED [final, [[index, number], ...]]``. Numbers start above any earlier
    run's (microseconds since the epoch), so a copy that missed a change shows it."""
    size, keys = o["value_bytes"], o["keys"]
    sem = asyncio.Semaphore(100)

    async def one(k, n):
        async with sem:
            await put(k, value(size, n))

    if o.get("load", True):
        await asyncio.gather(*(one(names[i], 0) for i in range(keys)))
        await put(names[-1], value(size, 0))
    mark("LOADED")
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    first = time.time_ns() // 1000
    picked = random.Random(2).sample(range(keys), min(o["changes"], keys))
    changed = [(i, first + j) for j, i in enumerate(picked)]
    await asyncio.gather(*(one(names[i], n) for i, n in changed))
    final = first + len(changed)
    await put(names[-1], value(size, final))
    mark("CHANGED " + json.dumps([final, changed]))
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return {"changes": len(changed)}


async def writer(system: str, o: dict) -> dict:
    names = key_names(system, o["keys"])
    write_loop_now = change_loop if o.get("changes") else write_loop
    if system == "clonemap":
        from clonemap.client.api import AsyncClone

        async with AsyncClone(o["address"], codec="bytes", timeout_s=60,
                              subtree="/r/") as c:
            async def put(k, v):
                await c.set(k, v, wait=True)
            return await write_loop_now(put, o, names)
    if system == "redis":
        import redis.asyncio as aioredis

        host, port = o["address"].rsplit(":", 1)
        r = aioredis.Redis(host=host, port=int(port), max_connections=256)
        try:
            return await write_loop_now(r.set, o, names)
        finally:
            await r.aclose()
    if system == "nats":
        import nats
        from nats.js.api import KeyValueConfig, StorageType

        nc = await nats.connect(f"nats://{o['address']}")
        try:
            js = nc.jetstream()
            try:
                kv = await js.key_value("r")
            except Exception:
                kv = await js.create_key_value(KeyValueConfig(bucket="r", history=1,
                                                              storage=StorageType.FILE))
            return await write_loop_now(kv.put, o, names)
        finally:
            await nc.close()
    import aetcd

    host, port = o["address"].rsplit(":", 1)
    c = aetcd.Client(host=host, port=int(port))
    await c.connect()
    try:
        return await write_loop_now(c.put, o, names)
    finally:
        await c.close()


def run() -> None:
    role, system = sys.argv[1], sys.argv[2]
    if role in ("writer", "changer"):
        o = json.loads(sys.argv[3])
        try:
            from uvloop import run as run_loop
        except ImportError:
            run_loop = asyncio.run
        out = run_loop(writer(system, o))
    else:
        variant, o = sys.argv[3], json.loads(sys.argv[4])
        out = READERS[system](variant, o)
        if "first_seen" in out:
            out["first_seen"] = list(out["first_seen"].items())
    with open(o["out"], "w") as f:
        json.dump(out, f)
    print("DONE", flush=True)


if __name__ == "__main__":
    run()
