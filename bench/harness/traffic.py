"""Load generator for 12/CHP servers: writer and subscriber processes, and one timed run.

A *writer* process sends KVSET commands (5 frames: key, 8 zero bytes, 16-byte UUID,
properties, value) to a collector endpoint (a server's P+2). A *subscriber* process
counts the KVPUBs arriving on a publisher endpoint (P+1), checks their sequences for gaps
and times them. ``bench.harness.fleet.LoadRun`` starts both kinds as child processes, lets them
warm up, measures one window and returns what each side saw; ``python -m bench load`` is
the command line.

Design decisions:

* **Processes, not threads**, started with ``multiprocessing`` "spawn" (no zmq state is
  ever inherited through fork). A process may be pinned to one core; the pin happens
  before its zmq Context exists, so the context's I/O thread is pinned too.
* **Frame I/O:** writers send through ``clonemap.shards.common.zio.send_frames5``. The subscriber
  reads each whole message in one C call on the compiled frame path
  (``zio.compiled_recv``: 0.60 us a message, every frame count checked). Without it, it
  reads with ``blind_reader``: five ``copy=True`` backend receives (0.91 us, against ~4.5
  us for a zmq.Frame per frame to read its MORE flag), trusting the server under test to
  send 5-frame messages and checking that on every ``latency_every``-th message (RCVMORE
  after the fifth frame). Either way a short sequence frame is ``malformed``. The harness
  must not be the bottleneck.
* **The writer socket is an XPUB with XPUB_NODROP.** It waits (with a deadline) until the
  server's collector SUB has subscribed, so no update is lost before the run, and at the
  high-water mark a send reports EAGAIN instead of dropping silently. Three modes:
  ``flow`` (flat out, a full pipe blocks the writer: offered load = what the server
  takes, and a writer waiting costs no CPU - the right mode on a 2-core machine),
  ``drop`` (flat out, never blocks: a full pipe drops the update and counts it), and a
  fixed offered ``rate_per_s`` (open loop: the latency stamp is the *intended* send time,
  so a stall cannot hide behind coordinated omission; a full pipe drops and counts).
* **Values carry a stamp:** the first 8 bytes of a value are the send time
  (``time.monotonic_ns``, CLOCK_MONOTONIC, which every process on one host shares), so a
  subscriber computes end-to-end latency. Values shorter than 8 bytes carry no stamp.
* **Keys** are drawn from a precomputed schedule (a power-of-two list cycled through), so
  choosing a key costs one list index: ``uniform`` or ``zipf`` over the key space, or
  ``sequential`` (key i for the i-th update: N updates load exactly N keys). A key is
  ``/k%08d``: its routing segment is the whole key, so keys spread over shards.
* **Windows are absolute CLOCK_MONOTONIC times** handed to every process: each counts
  what it did between ``t_start`` and ``t_end``, checking the clock once per batch, so no
  coordination is needed while the load runs.
* **Several shards:** a writer given several ``collectors`` opens one socket per shard
  and routes each key as a client would (``clonemap.shards.common.routing.ShardMap`` over that many
  shards, with ``pins``); the owner is computed once per schedule entry, so the hot loop
  still costs one list index. A subscriber given several ``endpoints`` reads them all,
  draining each in capped batches and polling only when all are empty, and tracks
  sequences and gaps per source (each shard has its own sequence).
* **Bare PUB->SUB** (the ``pubsub`` ceiling): there is no sequencer, so the writer puts
  its own counter of sent messages in the sequence frame (``seq_stamp``) and *binds* its
  XPUB (``bind``); the subscriber connects to every writer, one socket each, so each
  source has one sequence. (A SUB that binds, with the XPUB connecting, never passed its
  subscription on here: libzmq 4.3.5, checked with a two-socket script.)
* **Live figures:** every ``progress_s`` a subscriber sends its running totals to the
  parent (``LoadRun.progress()`` reads them without blocking).
"""
from __future__ import annotations

import bisect
import itertools
import os
import random
import struct
import time
from dataclasses import dataclass

from bench.harness.stats import percentile

KEY_FORMAT = "/k%08d"
STAMP_BYTES = 8
SCHEDULE_LEN = 1 << 18
CHECK_EVERY = 256
"""Messages between two clock reads in a writer or subscriber loop."""

READY_DEADLINE_S = 20.0
GO_DEADLINE_S = 60.0
SEND_TIMEOUT_MS = 200
RATE_TICK_S = 0.0002
"""At a fixed rate a writer sleeps at least this long (``WriterConfig.tick_s``) between
bursts of what is due (one wake-up per update costs more CPU than the update at tens of
thousands a second, in the writer and in the server it wakes); an update may so leave up
to ~tick + 0.05 ms after its intended time, counted in its latency. A 1 ms tick saved
~0.35 cores at 30,000/s here (server, writer and subscriber together) and added ~1 ms
to p50."""
FLUSH_S = 10.0
"""A writer that finished normally flushes its queue for up to this long before exiting."""

_U64 = struct.Struct(">Q")
_pack_u64 = _U64.pack
_unpack_u64 = _U64.unpack
_SEQ_ZERO = b"\x00" * 8


def recv5(sock, flags: int) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """Receive a 5-frame message as bytes without reading MORE flags (see the docstring).

    ``flags`` applies to the first frame; the other four are already queued (ZeroMQ
    delivers a multipart message whole), so a shorter message raises ``zmq.Again`` or
    borrows frames from the next one, which the periodic RCVMORE check reports.
    """
    from zmq.backend import Socket

    recv = Socket.recv
    f0 = recv(sock, flags, True)
    return (f0, recv(sock, 1, True), recv(sock, 1, True), recv(sock, 1, True),
            recv(sock, 1, True))


def key_of(i: int) -> bytes:
    return (KEY_FORMAT % i).encode()


def key_index(key: bytes | str) -> int:
    """The inverse of ``key_of``."""
    return int(key[2:])


def stamp_of(value: bytes) -> int:
    """The send time a writer put in the first 8 bytes of a value (CLOCK_MONOTONIC ns:
    compare with ``time.monotonic_ns()`` on the same host)."""
    return _U64.unpack_from(value)[0]


# ------------------------------------------------------------------------ configuration

@dataclass(frozen=True)
class WriterConfig:
    collector: str                 # e.g. "tcp://127.0.0.1:P+2"
    keys: int = 100_000
    value_bytes: int = 100
    distribution: str = "uniform"  # uniform | zipf | sequential
    zipf_s: float = 1.1
    mode: str = "flow"             # flow | drop | rate
    rate_per_s: float = 0.0        # mode "rate" only
    count: int = 0                 # stop after this many updates (0: at the window end)
    ttl_fraction: float = 0.0      # share of updates carrying "ttl=<ttl_s>"
    ttl_s: float = 5.0
    seed: int = 1
    core: int | None = None        # pin to this core before creating the zmq context
    writer_id: int = 0
    tail_s: float = 0.2            # keep sending this long after the window ends
    collectors: tuple[str, ...] = ()   # several shards: one socket each (overrides collector)
    pins: tuple[tuple[str, int], ...] = ()  # pinned (prefix, shard) of the shards' routing
    seq_stamp: bool = False        # sequence frame = this socket's sent counter (bare PUB->SUB)
    flush_s: float = FLUSH_S       # at exit, flush the queue for at most this long
    tick_s: float = RATE_TICK_S    # mode "rate": shortest sleep between bursts
    bind: bool = False             # bind the collector endpoints (bare PUB->SUB: the subscriber
                                   # connects, as to a server's publisher)
    keys_dir: str = ""             # CURVE: connect with the cluster's client key
    identity: str = ""             # ... or this named identity's (access control)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.collectors or (self.collector,)


@dataclass(frozen=True)
class SubscriberConfig:
    endpoint: str                  # e.g. "tcp://127.0.0.1:P+1"
    subscribe: bytes = b""         # prefix filter ("" = everything, HUGZ included)
    latency_every: int = 64        # sample the latency of one update in this many
    rcvhwm: int = 100_000
    quiet_s: float = 0.5           # after the window: stop after this long without data
    drain_s: float = 10.0          # after the window: stop after this long at most
    core: int | None = None
    endpoints: tuple[str, ...] = ()  # several publishers (shards): overrides endpoint
    bind: bool = False             # bind the endpoints (bare PUB->SUB: writers connect)
    progress_s: float = 0.5        # send running totals to the parent this often (0: never)
    keys_dir: str = ""             # CURVE: connect with the cluster's client key
    identity: str = ""             # ... or this named identity's (access control)

    @property
    def sources(self) -> tuple[str, ...]:
        return self.endpoints or (self.endpoint,)


def _secure(sock, keys_dir: str, identity: str = "") -> None:
    """CURVE client with the cluster's client key when ``keys_dir`` is set (the named
    ``identity``'s pair when one is given)."""
    if keys_dir:
        from clonemap.shards.common.security import Security

        Security.load(keys_dir, "client", identity or None).connect_side(sock)


@dataclass(frozen=True)
class Window:
    """Absolute ``time.monotonic()`` times shared by every process of a run."""

    t_start: float
    t_end: float

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


# ------------------------------------------------------------------------------- keys

def key_schedule(cfg: WriterConfig, length: int = SCHEDULE_LEN) -> list[tuple[bytes, bytes]]:
    """``length`` (key, properties) pairs to cycle through (``length`` a power of two)."""
    rng = random.Random(cfg.seed * 7919 + cfg.writer_id)
    n = cfg.keys
    if cfg.distribution == "sequential":
        if cfg.count and cfg.count > n:
            raise ValueError("sequential: count exceeds the key space")
        length = 1 << max(0, (n - 1).bit_length())
        indices = [i % n for i in range(length)]
    elif cfg.distribution == "uniform":
        indices = [rng.randrange(n) for _ in range(length)]
    elif cfg.distribution == "zipf":
        weights = list(itertools.accumulate(1.0 / (r ** cfg.zipf_s) for r in range(1, n + 1)))
        total = weights[-1]
        ranks = [bisect.bisect_left(weights, rng.random() * total) for _ in range(length)]
        perm = list(range(n))
        rng.shuffle(perm)  # rank 1 is a random key, not key 0
        indices = [perm[min(r, n - 1)] for r in ranks]
    else:
        raise ValueError(f"unknown distribution {cfg.distribution!r}")
    ttl_props = f"ttl={cfg.ttl_s:g}\n".encode()
    keys = [key_of(i) for i in range(n)] if n <= 4 * length else None
    out = []
    for i in indices:
        props = ttl_props if cfg.ttl_fraction and rng.random() < cfg.ttl_fraction else b""
        out.append((keys[i] if keys is not None else key_of(i), props))
    return out


def routed_schedule(cfg: WriterConfig,
                    length: int = SCHEDULE_LEN) -> list[tuple[bytes, bytes, int]]:
    """``key_schedule`` with each entry's owning shard (an index into ``cfg.endpoints``),
    routed with the clients' function over ``len(cfg.endpoints)`` shards and ``cfg.pins``."""
    sched = key_schedule(cfg, length)
    shards = len(cfg.endpoints)
    if shards == 1:
        return [(k, p, 0) for k, p in sched]
    from clonemap.shards.common.routing import ShardMap

    pins: dict[int, list[str]] = {}
    for prefix, shard in cfg.pins:
        pins.setdefault(shard, []).append(prefix)
    owner = ShardMap(shards, pins).owner
    owners: dict[bytes, int] = {}
    out = []
    for k, p in sched:
        shard = owners.get(k)
        if shard is None:
            shard = owners[k] = owner(k)
        out.append((k, p, shard))
    return out


# ----------------------------------------------------------------------------- writer

def _pin(core: int | None) -> None:
    if core is not None:
        import psutil

        psutil.Process().cpu_affinity([core])


def writer_main(cfg: WriterConfig, conn) -> None:
    """Child process: connect, report ready, wait for a Window, send, report figures."""
    _pin(cfg.core)
    import zmq

    from clonemap.shards.common.zio import send_frames5

    ctx = zmq.Context()
    socks = []
    result: dict = {"role": "writer", "writer_id": cfg.writer_id, "pid": os.getpid()}
    try:
        for endpoint in cfg.endpoints:
            sock = ctx.socket(zmq.XPUB)
            socks.append(sock)
            sock.linger = 0
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            sock.sndtimeo = SEND_TIMEOUT_MS
            if cfg.bind:
                sock.bind(endpoint)
            else:
                _secure(sock, cfg.keys_dir, cfg.identity)
                sock.connect(endpoint)
        schedule = routed_schedule(cfg)
        deadline = time.monotonic() + READY_DEADLINE_S
        for endpoint, sock in zip(cfg.endpoints, socks):
            # the collector's subscription: it is connected and listening
            if not sock.poll(max(0, int(1000 * (deadline - time.monotonic())))):
                result["error"] = f"no subscription from {endpoint} in {READY_DEADLINE_S} s"
                conn.send(result)
                return
            sock.recv()
        conn.send({"ready": True})
        if not conn.poll(GO_DEADLINE_S):
            return
        window: Window = conn.recv()
        result.update(_write(socks, cfg, schedule, window, send_frames5, zmq))
        for sock in socks:
            sock.linger = int(cfg.flush_s * 1000)  # what was sent must reach the server
        conn.send(result)
    except KeyboardInterrupt:
        pass
    except zmq.ZMQError as exc:
        result["error"] = f"writer on {cfg.endpoints}: {exc}"
        conn.send(result)
    finally:
        for sock in socks:
            sock.close()
        ctx.term()


def _write(socks, cfg: WriterConfig, schedule, window: Window, send5, zmq) -> dict:
    mask = len(schedule) - 1
    seq_stamp = cfg.seq_stamp
    counts = [0] * len(socks)      # sent per socket (seq_stamp's sequence)
    seq_frame = _SEQ_ZERO
    pad = bytes(max(0, cfg.value_bytes - STAMP_BYTES))
    stamped = cfg.value_bytes >= STAMP_BYTES
    plain = bytes(cfg.value_bytes)
    uuid_prefix = os.urandom(8)
    pack = _pack_u64
    now_ns = time.monotonic_ns
    clock = time.monotonic
    again = zmq.Again
    noblock = zmq.NOBLOCK
    stop_at = window.t_end + cfg.tail_s
    limit = cfg.count or (1 << 62)
    rate = cfg.rate_per_s if cfg.mode == "rate" else 0.0
    tick_s = cfg.tick_s
    flags = 0 if cfg.mode == "flow" else noblock
    sent = dropped = blocked = 0
    at_start = at_end = None   # (time, sent, dropped) at the window's edges
    t_begin = clock()
    t0_ns = now_ns()
    period_ns = int(1e9 / rate) if rate else 0
    i = 0
    while i < limit:
        now = clock()
        if at_start is None and now >= window.t_start:
            at_start = (now, sent, dropped)
        if at_end is None and now >= window.t_end:
            at_end = (now, sent, dropped)
        if now >= stop_at:
            break
        if rate:
            due = min(limit, int((now_ns() - t0_ns) // period_ns))
            if i >= due:
                time.sleep(max(tick_s, min(0.001, period_ns * (due + 1 - i) / 1e9)))
                continue
            burst = min(due - i, CHECK_EVERY)
        else:
            burst = min(limit - i, CHECK_EVERY)
        for _ in range(burst):
            key, props, shard = schedule[i & mask]
            if stamped:
                value = pack(t0_ns + i * period_ns if rate else now_ns()) + pad
            else:
                value = plain
            if seq_stamp:
                seq_frame = pack(counts[shard] + 1)
            try:
                send5(socks[shard], key, seq_frame, uuid_prefix + pack(i), props, value,
                      flags)
                sent += 1
                i += 1
                if seq_stamp:
                    counts[shard] += 1
            except again:
                if flags:          # drop / rate: counted and skipped
                    dropped += 1
                    i += 1
                else:              # flow: the send timed out; re-check the clock
                    blocked += 1
                    break
    now = clock()
    if at_start is None:
        at_start = (now, sent, dropped)
    if at_end is None:
        at_end = (now, sent, dropped)
    return {
        "sent_total": sent, "dropped_total": dropped, "blocked_timeouts": blocked,
        "elapsed_s": now - t_begin, "first_send_ns": t0_ns,
        "window_s": at_end[0] - at_start[0],
        "sent_window": at_end[1] - at_start[1],
        "dropped_window": at_end[2] - at_start[2],
        "sent_per_shard": counts if seq_stamp else None,
    }


# ------------------------------------------------------------------------- subscriber

MERGE_SAMPLES = 100_000
"""At most about this many latency samples go back to the parent (evenly strided from
the sorted list) for a merge across subscribers; a run's sampling (one update in
``latency_every``) rarely collects more."""


def percentiles_ms(sorted_ns: list[int], points=(50, 90, 99, 99.9)) -> dict[str, float]:
    """``{"p50": ms, ..., "max": ms}`` of sorted nanoseconds (``bench.harness.stats``)."""
    if not sorted_ns:
        return {}
    out = {f"p{p:g}": round(percentile(sorted_ns, p) / 1e6, 3) for p in points}
    out["max"] = round(sorted_ns[-1] / 1e6, 3)
    return out
