"""clonemap against the stores users would otherwise pick, at everyday rates, same run
(``python -m bench peers``).

One durable standalone server per system, each in a directory of its own on loopback:
clonemap (``--fsync everysec``), Redis (AOF, ``appendfsync everysec``), NATS JetStream KV
(file storage, ``sync_interval: 1s``) and etcd (one member; it fsyncs every commit);
``--fsync always`` moves every system that has the choice to its strictest class. Every
client is Python on uvloop, one process per role (``bench.harness.peer_clients``):
clonemap's ``AsyncClone``, redis-py with hiredis, nats-py, aetcd. Values of
``--value-bytes`` (100), a map of ``--keys`` (100,000) keys, loaded once before the rounds.
Writes are spread over ``--writer-procs`` (5) processes, each waking for its own writes,
so that at a few thousand a second each write is its own batch, as in an application.
Writer n writes the keys whose index is n modulo the writers; a clonemap writer follows
only that subtree (``/p/w<n>/``: what a process that writes and does not read the whole
map would do; ``--clonemap-writers whole`` makes each one hold the whole map, and so apply
every other writer's updates too).

Workloads, per round, each system in turn (the order rotates each round):

* ``rate``: ``--rate`` (5,000) acknowledged writes/s, open loop: server CPU and client CPU
  per acknowledged write, and the acknowledgement's p50/p99 (from when each write was due);
* ``one``: one write in flight (closed loop): acknowledged writes/s;
* ``many``: ``--inflight`` (100) writes in flight: acknowledged writes/s;
* ``fanout``: ``--fanout-rate`` (2,000) writes/s to ``--watchers`` (16) watchers, each a
  client of its own, in ``--watcher-procs`` processes: server CPU per delivered update,
  write-to-watcher p50/p99, and whether every update reached every watcher (Redis: each
  write is ``MULTI HSET PUBLISH``);
* ``join``: a new client until it holds the whole map and follows it (Redis ``SUBSCRIBE``
  then ``HGETALL``; NATS a KV watch to its end-of-initial-values marker; etcd a range
  read then a watch from the next revision): its time and the server's CPU.

* ``read``: ``--readers`` (4) processes read random keys of the map as fast as they can
  while one writer changes ``--read-rate`` (1,000) keys/s, through each system's read
  paths (``bench.harness.peer_readers``): reads/s, CPU per read, staleness;
* ``reconnect``: one reader's copy of the map is cut off for ``--cut-s`` (5 s) by
  ``bench.harness.cutter`` while ``--changed`` (1%) of the keys change: the time from
  the heal until it is current, and the bytes that took against a full read;
* ``memory`` (once, after the rounds): the RSS each copy of the map adds to its process,
  per key, at each of ``--memory-keys`` (100,000 and 1,000,000).

A floor runs beside them (``forwarder``, in the default ``--systems``): not a store but
``bench.harness.forwarder --snapshots``, a bare Python loop on libzmq (SUB collector ->
dict -> PUB, no checks, no log, empty snapshots), driven by clonemap's own client. What it
costs per write is what libzmq and the thinnest Python loop cost on the Clone pattern's
path with nothing of a store on it; it has no join row (it never sends its map).

While one system is measured the other systems' servers are stopped (SIGSTOP, continued
after), so an idle server's timers are not noise in another's figures. Server CPU is
read from the server's PID (every thread) at the client's START and END lines, so
start-up and warm-up are not in it; for servers on libzmq, the part spent in
its I/O threads (``ZMQbg/IO/<n>``) is shown under it. A system this host cannot run is reported
as missing with its install command, never dropped from a table. What an
acknowledgement means for each system is printed with the record. Ratios to Redis are
taken per round (same conditions), then their median.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import peer_servers as servers
from bench.harness import record as rec
from bench.harness.procs import ROOT, bench_main, cpu_seconds, free_port_base
from bench.harness.traffic import percentiles_ms
from clonemap.shards.common.children import terminate

NAME = "peers"
WORKLOADS = ("rate", "one", "many", "fanout", "join", "read", "reconnect", "memory")
CLIENT = [sys.executable, "-m", "bench.harness.peer_clients"]
READER = [sys.executable, "-m", "bench.harness.peer_readers"]
STALE_AFTER_NS = 10_000_000
"""A read is stale when a newer value was acknowledged this long before it began."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench {NAME}",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(servers.SYSTEMS),
                    help="comma-separated, of: " + ", ".join(servers.SYSTEMS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--fsync", choices=("everysec", "always"), default="everysec")
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--writer-procs", type=int, default=5,
                    help="processes sharing --rate and --fanout-rate (each its own "
                         "connection, waking for its own writes)")
    ap.add_argument("--inflight", type=int, default=100)
    ap.add_argument("--clonemap-writers", choices=("subtree", "whole"), default="subtree",
                    help="a clonemap writer follows its own keys' subtree (/p/w<n>/, what "
                         "a process that only writes would do) or the whole map")
    ap.add_argument("--fanout-rate", type=int, default=2000)
    ap.add_argument("--watchers", type=int, default=16)
    ap.add_argument("--watcher-procs", type=int, default=2)
    ap.add_argument("--readers", type=int, default=4,
                    help="read: reader processes per system and variant")
    ap.add_argument("--read-rate", type=int, default=1000,
                    help="read: changes/s the writer makes while the readers read")
    ap.add_argument("--cut-s", type=float, default=5.0,
                    help="reconnect: how long a reader's link is down")
    ap.add_argument("--changed", type=float, default=0.01,
                    help="reconnect: the share of the map's keys changed while it is down")
    ap.add_argument("--memory-keys", default="100000,1000000",
                    help="memory: map sizes (keys, comma-separated) at which each copy's "
                         "RSS per key is measured")
    ap.add_argument("--client-sessions", choices=("own", "shared"), default="own",
                    help="each client process (writers, watchers, readers) in a session "
                         "of its own, as separate services are (own: with the kernel's "
                         "autogroup, a CPU group each), or all in this command's session, "
                         "each in its own process group, as one application's worker "
                         "processes are (shared: one CPU group) [default: own]")
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    args.system_list = [s for s in args.systems.split(",") if s]
    args.workload_list = [w for w in args.workloads.split(",") if w]
    try:
        args.memory_key_list = [int(n) for n in args.memory_keys.split(",") if n]
    except ValueError:
        ap.error(f"--memory-keys: numbers of keys, not {args.memory_keys!r}")
    for name in args.system_list:
        if name not in servers.SYSTEMS:
            ap.error(f"unknown system {name!r}")
    for name in args.workload_list:
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}")
    return args


# ---------------------------------------------------------------------------- clients

class Client:
    """A client process: its START/END lines, then its JSON result."""

    own_session = True
    """``--client-sessions``: each client process in a session of its own (True), or in
    this command's session, in a process group of its own (False: a terminal's Ctrl-C
    still does not reach it). Under the kernel's autogroup
    (``/proc/sys/kernel/sched_autogroup_enabled``) a session is a CPU group: see
    bench/README.md, *Reads of a live map*."""

    def __init__(self, system: str, workload: str, options: dict, stdin: bool = False,
                 command: list[str] | None = None):
        self.err = tempfile.TemporaryFile(mode="w+")
        fd, self.out = tempfile.mkstemp(prefix="peers-", suffix=".json")
        os.close(fd)
        options = {**options, "out": self.out}
        argv = (command or CLIENT + [system, workload]) + [json.dumps(options)]
        self.popen = subprocess.Popen(argv,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=self.err, text=True,
                                      cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                      start_new_session=self.own_session,
                                      process_group=None if self.own_session else 0)
        self.what = f"{system} {workload}"

    def line(self, want: str, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.popen.stdout.readline()
            if not text:
                break
            if text.startswith(want):
                return text.strip()
        self.popen.wait(10)
        raise RuntimeError(f"{self.what}: no {want!r} line (exit {self.popen.returncode}): "
                           + self.stderr_tail())

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return "\n".join(self.err.read().splitlines()[-6:])

    def result(self) -> dict:
        self.line("DONE")
        self.popen.wait(120)
        if self.popen.returncode != 0:
            raise RuntimeError(f"{self.what} failed ({self.popen.returncode}): "
                               + self.stderr_tail())
        with open(self.out) as f:
            return json.load(f)

    def stop(self) -> None:
        terminate(self.popen, 5.0)
        for pipe in (self.popen.stdout, self.popen.stdin):
            if pipe is not None:
                with contextlib.suppress(OSError):  # (a write to a gone reader's stdin)
                    pipe.close()
        self.err.close()
        Path(self.out).unlink(missing_ok=True)


def measured(server: servers.PeerServer, system: str, workload: str, options: dict,
             processes: int = 1, split: dict | None = None) -> tuple[list[dict], float]:
    """Run ``processes`` clients (the i-th is ``writer`` i: its own keys); their results,
    and the server's CPU seconds from the last START line to the last END line.
    ``split`` gets ``io_s``: the part of them spent in libzmq's I/O threads (None for a
    server that has none)."""
    clients = [Client(system, workload, {**options, "writer": i}) for i in range(processes)]
    try:
        for c in clients:
            c.line("START")
        before = cpu_seconds([server.pid])
        for c in clients:
            c.line("END")
        after = cpu_seconds([server.pid])
        cpu = after[server.pid] - before[server.pid]
        if split is not None:
            io = zmq_io_threads(server.pid)
            split["io_s"] = sum(after["threads"].get(t, 0.0) - before["threads"].get(t, 0.0)
                                for t in io) if io else None
        return [c.result() for c in clients], cpu
    finally:
        for c in clients:
            c.stop()


def zmq_io_threads(pid: int) -> set[int]:
    """The thread ids of ``pid`` that libzmq named ``ZMQbg/IO/<n>`` (its I/O threads)."""
    found = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/IO"):
                    found.add(int(tid))
        except OSError:
            continue
    return found


def merged(results: list[dict]) -> dict:
    """The writers' results as one: counts and CPU summed, latencies pooled."""
    out = {"acks": 0, "offered": 0, "error_count": 0, "client_cpu_s": 0.0, "lat_ns": []}
    for r in results:
        for k in ("acks", "offered", "error_count", "client_cpu_s"):
            out[k] += r.get(k, 0)
        for x in r.get("lat_ns", []):  # each sample stands for ``stride`` latencies
            out["lat_ns"].extend([x] * r.get("stride", 1))
    out["lat_ns"].sort()
    return out


def _lat(result: dict) -> dict:
    return percentiles_ms(result.get("lat_ns", []), (50, 99))


def one_run(args, server: servers.PeerServer, workload: str) -> dict:
    base = {"address": server.address, "keys": args.keys, "value_bytes": args.value_bytes,
            "seconds": args.seconds, "warmup": args.warmup,
            "writer_subtree": args.clonemap_writers == "subtree",
            "writers": args.writer_procs}
    system = server.system
    if workload == "rate":
        t0 = time.time() + 2.0  # every writer process has started by then
        split: dict = {}
        results, cpu = measured(server, system, "rate", {
            **base, "rate": args.rate / args.writer_procs, "t0": t0}, args.writer_procs,
            split)
        res = merged(results)
        acks = res["acks"] or 1
        lat = _lat(res)
        return {"acks": res["acks"], "offered": res["offered"],
                "errors": res["error_count"], "server_cpu_us": round(cpu / acks * 1e6, 1),
                "server_io_cpu_us": _per(split["io_s"], acks),
                "client_cpu_us": round(res["client_cpu_s"] / acks * 1e6, 1),
                "p50_ms": lat.get("p50", 0.0), "p99_ms": lat.get("p99", 0.0)}
    if workload in ("one", "many"):
        inflight = 1 if workload == "one" else args.inflight
        results, cpu = measured(server, system, "closed", {**base, "inflight": inflight})
        res = merged(results)
        acks = res["acks"] or 1
        lat = _lat(res)
        return {"acks_per_s": round(res["acks"] / args.seconds, 1),
                "p50_ms": lat.get("p50", 0.0), "p99_ms": lat.get("p99", 0.0),
                "errors": res["error_count"],
                "client_cpu_pct": round(100 * res["client_cpu_s"] / args.seconds, 1),
                "server_cpu_us": round(cpu / acks * 1e6, 1)}
    if workload == "fanout":
        return fanout_run(args, server, base)
    if workload == "read":
        raise ValueError("read rows come from read_runs")
    if workload == "join":
        (res,), cpu = measured(server, system, "join", base)
        return {"join_ms": round(res["join_s"] * 1e3, 1), "keys": res["keys"],
                "server_cpu_s": round(cpu, 3), "client_cpu_s": round(res["client_cpu_s"], 3)}
    raise ValueError(workload)


@contextlib.contextmanager
def paused(others: list[servers.PeerServer]):
    """The other systems' servers stopped (SIGSTOP, by the PIDs this run started) while
    one system is measured, and continued after: an idle server still ticks (etcd's Raft
    heartbeats, timers), and on a small host that is noise in the one measured."""
    stopped = []
    try:
        for server in others:
            try:
                os.kill(server.pid, signal.SIGSTOP)
                stopped.append(server.pid)
            except ProcessLookupError:
                pass
        for pid in stopped:  # the signal is delivered when the process next runs
            _wait_state(pid, "T", 2.0)
        yield
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _wait_state(pid: int, state: str, within_s: float) -> bool:
    """Until ``/proc/<pid>/stat`` shows ``state`` (True), or ``within_s`` passed or the
    process is gone (False)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == state:
                    return True
        except (OSError, IndexError):
            return False
        time.sleep(0.001)
    return False


def _per(seconds: float | None, count: int, digits: int = 1) -> float | None:
    return None if seconds is None else round(seconds / count * 1e6, digits)


def fanout_run(args, server: servers.PeerServer, base: dict) -> dict:
    system = server.system
    per = [args.watchers // args.watcher_procs + (i < args.watchers % args.watcher_procs)
           for i in range(args.watcher_procs)]
    watchers = [Client(system, "watch", {"address": server.address, "clients": n}, stdin=True)
                for n in per if n]
    try:
        for w in watchers:
            w.line("READY", 120)
        t0 = time.time() + 1.5  # every writer process has started by then
        lo, hi = t0 + args.warmup, t0 + args.warmup + args.seconds
        for w in watchers:  # the window, now that every watcher is ready
            w.popen.stdin.write(f"{lo} {hi} {hi + 2.0}\n")
            w.popen.stdin.flush()
        split: dict = {}
        results, cpu = measured(server, system, "rate", {
            **base, "rate": args.fanout_rate / args.writer_procs, "fanout": True,
            "t0": t0}, args.writer_procs, split)
        res = merged(results)
        seen = [w.result() for w in watchers]
    finally:
        for w in watchers:
            w.stop()
    delivered = sum(s["delivered"] for s in seen)
    samples = merged(seen)["lat_ns"]
    lat = percentiles_ms(samples, (50, 99))
    expected = res["acks"] * args.watchers
    return {"writes": res["acks"], "delivered": delivered, "expected": expected,
            "every_update_delivered": delivered >= expected and res["error_count"] == 0,
            "server_cpu_us": round(cpu / (delivered or 1) * 1e6, 2),
            "server_io_cpu_us": _per(split["io_s"], delivered or 1, 2),
            "p50_ms": lat.get("p50", 0.0), "p99_ms": lat.get("p99", 0.0),
            "watcher_cpu_pct": [round(100 * s["client_cpu_s"] / (hi + 2.0 - lo), 1)
                                for s in seen]}


def read_runs(args, server: servers.PeerServer) -> list[dict]:
    """The read-mostly workload, each of the system's read paths in turn
    (``bench.harness.peer_readers``): one writer changing ``--read-rate`` keys/s,
    ``--readers`` reader processes reading random keys as fast as they can."""
    from bench.harness.peer_readers import VARIANTS
    rows = []
    for variant in VARIANTS[server.system]:
        rows.append(read_run(args, server, variant, load=not server.read_map_loaded))
        server.read_map_loaded = True
    return rows


def read_run(args, server: servers.PeerServer, variant: str, load: bool = True) -> dict:
    system = server.system
    base = {"address": server.address, "keys": args.keys, "value_bytes": args.value_bytes,
            "warmup": args.warmup, "seconds": args.seconds, "probe_us": 200}
    writer = Client(system, "read", {**base, "rate": args.read_rate, "probe_every": 10,
                                     "load": load},
                    stdin=True, command=READER + ["writer", system])
    readers: list[Client] = []
    try:
        writer.line("LOADED", 600)
        readers = [Client(system, "read", base, stdin=True,
                          command=READER + ["reader", system, variant])
                   for _ in range(args.readers)]
        for r in readers:
            r.line("READY", 300)
        t0 = time.time() + 0.3
        until = t0 + args.warmup + args.seconds + 0.5
        writer.popen.stdin.write(f"{t0} {until}\n")
        writer.popen.stdin.flush()
        for r in readers:
            r.popen.stdin.write(f"{t0}\n")
            r.popen.stdin.flush()
        for r in readers:
            r.line("START")
        before = cpu_seconds([server.pid])
        for r in readers:
            r.line("END")
        after = cpu_seconds([server.pid])
        seen = [r.result() for r in readers]
        wrote = writer.result()
    finally:
        for c in [writer, *readers]:
            c.stop()
    return {"variant": variant, **read_figures(seen, wrote, after[server.pid]
                                               - before[server.pid])}


RECONNECT_VARIANTS = {"clonemap": ("get",), "redis": ("cache",), "nats": ("watch",),
                      "etcd": ("watch",)}
"""The read paths whose copy must be made current again after a broken link."""
CUTTER = [sys.executable, "-m", "bench.harness.cutter"]


def _routes(server: servers.PeerServer, base: int) -> tuple[list[str], str]:
    """The cutter's routes for ``server`` and the address a reader gives to reach it
    through them (clonemap: its three ports, P to P+2; the others: one)."""
    if server.system == "clonemap":
        port = int(server.address.rsplit(":", 1)[1])
        return ([f"127.0.0.1:{base + i}=127.0.0.1:{port + i}" for i in range(3)],
                f"tcp://127.0.0.1:{base}")
    return [f"127.0.0.1:{base}={server.address}"], f"127.0.0.1:{base}"


def reconnect_run(args, server: servers.PeerServer, variant: str, load: bool) -> dict:
    """One reader builds its copy through the cutter; its link is cut for ``--cut-s``
    while the writer changes ``--changed`` of the keys (each once), the probe key last;
    then the link heals. Figures: the time from the heal until the copy holds the last
    probe number, the bytes sent to the reader from the heal until then, against the
    bytes of the first copy (a full read), and whether every changed key is current."""
    system = server.system
    routes, address = _routes(server, free_port_base(3))
    cutter = subprocess.Popen(CUTTER + routes, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                              start_new_session=True)

    def ask(command: str) -> str:
        cutter.stdin.write(command + "\n")
        cutter.stdin.flush()
        return cutter.stdout.readline().strip()

    def sent() -> int:
        return int(ask("bytes").split()[1])

    base = {"keys": args.keys, "value_bytes": args.value_bytes}
    writer = Client(system, "reconnect", {**base, "address": server.address, "load": load,
                                          "changes": max(1, int(args.keys * args.changed))},
                    stdin=True, command=READER + ["changer", system])
    reader = None
    try:
        if cutter.stdout.readline().strip() != "READY":
            raise RuntimeError(f"{system}: the cutter did not start")
        writer.line("LOADED", 600)
        t_built = time.monotonic()
        reader = Client(system, "reconnect", {**base, "address": address, "reconnect": True},
                        stdin=True, command=READER + ["reader", system, variant])
        reader.line("BUILT", 600)
        build_s = time.monotonic() - t_built
        full_bytes = sent()
        ask("cut")
        cut_at = time.monotonic()
        writer.popen.stdin.write("go\n")
        writer.popen.stdin.flush()
        final, changed = json.loads(writer.line("CHANGED", 120).split(" ", 1)[1])
        time.sleep(max(0.0, cut_at + args.cut_s - time.monotonic()))
        healed_bytes = sent()
        ask("heal")
        healed_ns = time.monotonic_ns()
        reader.popen.stdin.write(f"FINAL {final}\n")
        reader.popen.stdin.flush()
        current = reader.line("CURRENT", 120).split()[1]
        resume_bytes = sent() - healed_bytes
        reader.popen.stdin.write(json.dumps([i for i, _ in changed]) + "\n")
        reader.popen.stdin.flush()
        got = reader.result()
    finally:
        for c in [writer, reader]:
            if c is not None:
                c.stop()
        terminate(cutter, 5.0)
    behind = sum(1 for (_, n), mine in zip(changed, got["changed_numbers"]) if mine < n)
    return {"variant": variant, "build_s": round(build_s, 3), "full_bytes": full_bytes,
            "current_s": (None if current == "never"
                          else round((int(current) - healed_ns) / 1e9, 4)),
            "resume_bytes": resume_bytes,
            "resume_share": round(resume_bytes / max(full_bytes, 1), 5),
            "changed_keys": len(changed), "changed_behind": behind,
            "resyncs": got.get("resyncs")}


MEMORY_VARIANTS = {"clonemap": ("get", "lean", "dict"), "redis": ("cache",),
                   "nats": ("watch",), "etcd": ("watch",)}
"""The read paths that hold a copy of the map (``aget`` holds the same map as ``get``);
clonemap ``lean``: a ``Clone`` with ``read_view=False``; and the floor: a plain dict of
the same keys and value sizes."""


def memory_runs(args, server: servers.PeerServer) -> list[dict]:
    """The memory workload: at each of ``--memory-keys``, the map loaded by the read
    workload's writer, then one process per copy-holding read path, which builds its copy
    and reports the RSS it added (``peer_readers.Footprint``)."""
    rows = []
    for keys in args.memory_key_list:
        base = {"address": server.address, "keys": keys, "value_bytes": args.value_bytes}
        writer = Client(server.system, "memory", {**base, "rate": 1, "probe_every": 1,
                                                  "warmup": 0, "seconds": 0},
                        stdin=True, command=READER + ["writer", server.system])
        try:
            writer.line("LOADED", 3600)
        finally:
            writer.stop()
        for variant in MEMORY_VARIANTS[server.system]:
            reader = Client(server.system, "memory", {**base, "memory": True},
                            command=READER + ["reader", server.system, variant])
            try:
                got = reader.result()
            finally:
                reader.stop()
            rows.append({"variant": variant, "keys": keys, **got})
    return rows


def read_figures(seen: list[dict], wrote: dict, server_cpu_s: float) -> dict:
    """Reads/s per reader, CPU per read, staleness (each probe number's first sight in
    each reader - its acknowledgement, counting a later number seen first) and stale
    reads (a probe read older than a number acknowledged ``STALE_AFTER_NS`` before)."""
    acks = sorted((ns, n) for n, ns in wrote["acks"])
    ack_ns = [ns for ns, _ in acks]
    ack_n = [n for _, n in acks]
    reads = sum(r["reads"] for r in seen) or 1
    per_reader = sorted(r["reads"] / max(r["elapsed_s"], 1e-9) for r in seen)
    lags: list[int] = []
    stale = probes = 0
    import bisect
    each: list[dict] = []
    for r in seen:
        probe_log = r["probes"]
        if not probe_log:
            continue
        lo, hi = probe_log[0][0], probe_log[-1][0]
        firsts = sorted((n, t) for n, t in r["first_seen"] if n >= 0)
        mine: list[int] = []
        for ns, n in acks:  # numbers acknowledged while this reader looked
            if not lo <= ns <= hi - 200_000_000:
                continue
            j = bisect.bisect_left(firsts, (n, -1))
            if j < len(firsts):
                mine.append(firsts[j][1] - ns)
        lags.extend(mine)
        mine.sort()
        # each reader apart: a tail that is one reader's (its process off the cores a
        # while) looks different from one all readers share; ``client``: what a clonemap
        # reader's client went through (snapshots, gaps, resyncs for lag)
        each.append({"p99_ms": percentiles_ms(mine, (99,)).get("p99", 0.0),
                     "max_ms": round(mine[-1] / 1e6, 3) if mine else 0.0,
                     **({"client": r["client"]} if "client" in r else {})})
        for t, v in probe_log:
            probes += 1
            k = bisect.bisect_left(ack_ns, t - STALE_AFTER_NS) - 1
            if k >= 0 and v < ack_n[k]:
                stale += 1
    lags.sort()
    lag = percentiles_ms(lags, (50, 99))
    return {"reads_per_s": round(per_reader[len(per_reader) // 2], 1),
            "reads_per_s_each": [round(x, 1) for x in per_reader],
            "client_cpu_us": round(sum(r["cpu_s"] for r in seen) / reads * 1e6, 3),
            "server_cpu_us": round(server_cpu_s / reads * 1e6, 3),
            "staleness_p50_ms": lag.get("p50", 0.0), "staleness_p99_ms": lag.get("p99", 0.0),
            "staleness_max_ms": round(lags[-1] / 1e6, 3) if lags else 0.0,
            "staleness_samples": len(lags), "staleness_each": each,
            "stale_reads": stale, "probe_reads": probes,
            "writes": wrote["writes"]}


# ---------------------------------------------------------------------------- the scenario

def autogroup() -> bool | None:
    """Whether the kernel groups the CPU time of each session (``sched_autogroup``), which
    ``--client-sessions`` makes count; None where it cannot be read."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def run(args: argparse.Namespace) -> rec.Record:
    config = {k: v for k, v in vars(args).items()
              if k not in ("results_dir", "system_list", "workload_list",
                           "memory_key_list")}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    record.data["acks"] = {s: servers.ACKS[s] for s in args.system_list}
    Client.own_session = args.client_sessions == "own"
    record.data["sched_autogroup"] = autogroup()
    missing, running, versions = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        try:
            for system in args.system_list:
                try:
                    running[system] = servers.start(system, Path(tmp), args.fsync)
                    versions[system] = running[system].version
                except servers.Missing as why:
                    missing[system] = str(why)
                    rec.log(f"{NAME}: {system} is missing: {why}")
            record.data["missing"] = missing
            record.data["versions"] = versions
            for system, server in running.items():
                (res,), cpu = measured(server, system, "preload", {
                    "address": server.address, "keys": args.keys,
                    "value_bytes": args.value_bytes, "writers": args.writer_procs})
                record.data.setdefault("preload_s", {})[system] = round(res["seconds"], 2)
            names = list(running)
            for rnd in range(args.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)] if names else []
                for workload in args.workload_list:
                    if workload == "memory":
                        continue  # (a footprint, not a rate: once, after the rounds)
                    for system in order:
                        if workload in ("join", "read", "reconnect", "memory") and \
                                system in servers.FLOORS:
                            continue  # (it never sends its map)
                        with paused([s for n, s in running.items() if n != system]):
                            if workload == "read":
                                rows = read_runs(args, running[system])
                            elif workload == "reconnect":
                                rows = [reconnect_run(args, running[system], v,
                                                      not running[system].read_map_loaded)
                                        for v in RECONNECT_VARIANTS[system]]
                                running[system].read_map_loaded = True
                            else:
                                rows = [one_run(args, running[system], workload)]
                        for row in rows:
                            record.add_run({"round": rnd, "workload": workload,
                                            "system": system, **row})
            if "memory" in args.workload_list:  # last: it leaves larger maps behind
                for system in names:
                    if system in servers.FLOORS:
                        continue
                    with paused([s for n, s in running.items() if n != system]):
                        for row in memory_runs(args, running[system]):
                            record.add_run({"round": 0, "workload": "memory",
                                            "system": system, **row})
        finally:
            for server in running.values():
                server.stop()
    record.finish()
    summarize(record, args)
    return record


METRICS = (  # (workload, field, label)
    ("rate", "server_cpu_us", "server CPU per acknowledged write (us)"),
    ("rate", "server_io_cpu_us", "  of which libzmq's I/O thread (us)"),
    ("rate", "client_cpu_us", "client CPU per acknowledged write (us)"),
    ("rate", "p50_ms", "ack p50 (ms)"),
    ("rate", "p99_ms", "ack p99 (ms)"),
    ("one", "acks_per_s", "acknowledged writes/s, one in flight"),
    ("many", "acks_per_s", "acknowledged writes/s, many in flight"),
    ("fanout", "server_cpu_us", "fan-out: server CPU per delivered update (us)"),
    ("fanout", "server_io_cpu_us", "  of which libzmq's I/O thread (us)"),
    ("fanout", "p50_ms", "fan-out: write-to-watcher p50 (ms)"),
    ("fanout", "p99_ms", "fan-out: write-to-watcher p99 (ms)"),
    ("join", "join_ms", "join the map (ms)"),
    ("join", "server_cpu_s", "server CPU per join (s)"),
)

TARGETS = {  # (workload, field): the most clonemap may be, as a multiple of Redis's
    ("rate", "server_cpu_us"): 1.7,
    ("rate", "client_cpu_us"): 1.2,
    ("rate", "p99_ms"): 1.2,
    ("join", "join_ms"): 1.3,
    ("fanout", "server_cpu_us"): 1.2,
}


def summarize(record: rec.Record, args) -> None:
    runs = record.data["runs"]
    summary: dict = {}
    for workload, field, _ in METRICS:
        mine = [r for r in runs if r["workload"] == workload]
        if not mine:
            continue
        entry = {s: rec.spread([r[field] for r in mine
                                if r["system"] == s and r.get(field) is not None], 3)
                 for s in {r["system"] for r in mine}}
        for num, peer in (("clonemap", "redis"), ("clonemap", "nats"), ("clonemap", "etcd"),
                          ("clonemap", "forwarder"), ("forwarder", "redis")):
            ratios = rec.ratios_per_round(mine, lambda r: r.get(field), num, peer, "system")
            if ratios:
                entry[f"{num}/{peer}"] = rec.spread(ratios, 3)
        summary[f"{workload}.{field}"] = entry
    fan = [r for r in runs if r["workload"] == "fanout"]
    summary["fanout.every_update_delivered"] = {
        s: all(r["every_update_delivered"] for r in fan if r["system"] == s)
        for s in {r["system"] for r in fan}}
    summary["read"] = summarize_reads([r for r in runs if r["workload"] == "read"])
    summary["memory"] = summarize_memory([r for r in runs if r["workload"] == "memory"])
    summary["reconnect"] = summarize_reconnects(
        [r for r in runs if r["workload"] == "reconnect"])
    record.data["summary"] = summary
    for (workload, field), most in TARGETS.items():
        ratio = summary.get(f"{workload}.{field}", {}).get("clonemap/redis")
        if ratio:
            suffix = f" (fsync {args.fsync})" if workload == "rate" else ""
            record.target(f"{workload} {field}: clonemap / Redis{suffix}", ratio["median"],
                          most, "x", higher_is_better=False)
    reads = summary["read"]
    for name, most_or_least, higher in (("clonemap get / clonemap dict", 0.5, True),
                                        ("clonemap get / redis get", 20.0, True),
                                        ("clonemap get / redis cache", 1.0, True)):
        ratio = reads["ratios"].get(name)
        if ratio and ratio.get("n"):
            record.target(f"read: reads/s {name}", ratio["median"], most_or_least, "x",
                          higher_is_better=higher)
    mine = reads["paths"].get("clonemap get", {}).get("staleness_p99_ms")
    if mine and mine.get("n"):
        record.target("read: Clone.get staleness p99", mine["median"], 2.0, "ms",
                      higher_is_better=False)
        cached = reads["paths"].get("redis cache", {}).get("staleness_p99_ms")
        if cached and cached.get("n"):
            record.target("read: Clone.get staleness p99 / Redis cache's", round(
                mine["median"] / max(cached["median"], 1e-9), 3), 1.0, "x",
                higher_is_better=False)
    mine = summary["reconnect"].get("clonemap get")
    if mine and mine["resume_share"].get("n"):
        record.target("reconnect: bytes to be current / a full read (clonemap)",
                      mine["resume_share"]["median"], 0.05, "x", higher_is_better=False)
    if mine and mine["current_s"].get("n"):
        record.target("reconnect: current after the link returns (clonemap)",
                      mine["current_s"]["median"], 1.0, "s", higher_is_better=False)
    for keys, entry in summary["memory"].items():
        for path in ("clonemap get", "clonemap lean"):
            ratio = entry.get(f"{path} / redis cache")
            if ratio is not None:
                record.target(f"memory: bytes per key {path} / redis cache, {keys} keys",
                              ratio, 1.5, "x", higher_is_better=False)
    joins = summary.get("join.server_cpu_s", {}).get("clonemap")
    if joins and joins.get("n"):
        record.target("server CPU per join of the map", joins["median"], 0.2, "s",
                      higher_is_better=False)


READ_FIELDS = (  # (field, label)
    ("reads_per_s", "reads/s per reader process"),
    ("client_cpu_us", "reader CPU per read (us)"),
    ("server_cpu_us", "server CPU per read (us)"),
    ("staleness_p50_ms", "staleness p50 (ms)"),
    ("staleness_p99_ms", "staleness p99 (ms)"),
    ("staleness_max_ms", "staleness max (ms)"),
    ("staleness_p99_mid_ms", "staleness p99 of the middle reader (ms)"),
    ("stale_share", "stale reads (share of probe reads)"),
)
READ_RATIOS = (("clonemap get", "clonemap dict"), ("clonemap get", "redis get"),
               ("clonemap get", "redis cache"), ("clonemap get", "nats watch"),
               ("clonemap get", "etcd watch"))
"""Read rates compared per round: Clone.get against a plain dict in the same kind of
process, against Redis GET, Redis's client-side cache and the watch-built copies."""


def summarize_reads(runs: list[dict]) -> dict:
    for r in runs:
        r["path"] = f"{r['system']} {r['variant']}"
        r["stale_share"] = round(r["stale_reads"] / r["probe_reads"], 6) if r.get(
            "probe_reads") else None
        each = sorted(e["p99_ms"] for e in r.get("staleness_each", ()))
        # the readers' own p99s, the middle one (the upper median): a tail of one reader
        # whose process was off the cores a while does not make the row's
        r["staleness_p99_mid_ms"] = each[len(each) // 2] if each else None
    out: dict = {"paths": {}, "ratios": {}}
    for path in sorted({r["path"] for r in runs}):
        mine = [r for r in runs if r["path"] == path]
        out["paths"][path] = {f: rec.spread([r[f] for r in mine if r.get(f) is not None], 3)
                              for f, _ in READ_FIELDS}
    for num, den in READ_RATIOS:
        ratios = rec.ratios_per_round(runs, lambda r: r.get("reads_per_s"), num, den, "path")
        if ratios:
            out["ratios"][f"{num} / {den}"] = rec.spread(ratios, 3)
    return out


RECONNECT_FIELDS = (  # (field, label)
    ("current_s", "current after the link returns (s)"),
    ("resume_bytes", "bytes received to be current"),
    ("full_bytes", "bytes of the first, full read"),
    ("resume_share", "bytes to be current / full read"),
    ("changed_behind", "changed keys still behind once current"),
    ("build_s", "first copy built in (s)"),
)


def summarize_reconnects(runs: list[dict]) -> dict:
    """Per read path, each reconnect figure's spread over the rounds; a run whose copy
    never became current counts as missing from ``current_s`` and is counted in
    ``never_current``."""
    out: dict = {}
    for path in sorted({f"{r['system']} {r['variant']}" for r in runs}):
        mine = [r for r in runs if f"{r['system']} {r['variant']}" == path]
        out[path] = {f: rec.spread([r[f] for r in mine if r.get(f) is not None], 4)
                     for f, _ in RECONNECT_FIELDS}
        out[path]["never_current"] = sum(1 for r in mine if r.get("current_s") is None)
    return out


MEMORY_RATIOS = (("clonemap get", "redis cache"), ("clonemap lean", "redis cache"),
                 ("clonemap get", "clonemap dict"),
                 ("clonemap get", "nats watch"), ("clonemap get", "etcd watch"))


def summarize_memory(runs: list[dict]) -> dict:
    """``{keys: {path: bytes per key, "a / b": ratio}}``: one process per path and size."""
    out: dict = {}
    for r in runs:
        out.setdefault(str(r["keys"]), {})[f"{r['system']} {r['variant']}"] = \
            r["bytes_per_key"]
    for entry in out.values():
        for num, den in MEMORY_RATIOS:
            if entry.get(num) and entry.get(den):
                entry[f"{num} / {den}"] = round(entry[num] / entry[den], 3)
    return out


def _cell(entry: dict | None) -> str:
    if not entry or not entry.get("n"):
        return "-"
    return rec._fmt(entry["median"])


def report(record: rec.Record) -> None:
    d = record.data
    systems = [s for s in d["config"]["systems"].split(",") if s]
    present = [s for s in systems if s not in d.get("missing", {})]
    rows = []
    for workload, field, label in METRICS:
        entry = d["summary"].get(f"{workload}.{field}")
        if entry is None:
            continue
        floor = ([_cell(entry.get("forwarder/redis"))] if "forwarder" in present else [])
        rows.append([label, *[_cell(entry.get(s)) if s in present else "missing"
                              for s in systems],
                     _cell(entry.get("clonemap/redis")), *floor])
    c = d["config"]
    rec.table(record, f"{NAME}: medians of {c['rounds']} rounds, {c['keys']:,} keys of "
              f"{c['value_bytes']} B, fsync {c['fsync']}",
              ["workload", *systems, "clonemap / Redis",
               *(["forwarder / Redis"] if "forwarder" in present else [])], rows,
              f"rate: {c['rate']:,}/s open loop; many: {c['inflight']} in flight; fan-out: "
              f"{c['fanout_rate']:,}/s to {c['watchers']} watchers; ratios are per round, "
              "then the median")
    reads = d["summary"].get("read") or {}
    if reads.get("paths"):
        paths = list(reads["paths"])
        group = {True: "autogroup on", False: "autogroup off"}.get(
            d.get("sched_autogroup"), "autogroup unknown")
        rec.table(record, f"{NAME} read: medians of {c['rounds']} rounds, {c['readers']} "
                  f"readers, {c['read_rate']:,} changes/s, client sessions "
                  f"{c.get('client_sessions', 'own')} ({group})", ["", *paths],
                  [[label, *[_cell(reads["paths"][p].get(f)) for p in paths]]
                   for f, label in READ_FIELDS],
                  "staleness: a change's acknowledgement to its first sight in each reader; "
                  "stale: a read older than a value acknowledged 10 ms before it began")
        for name, entry in reads.get("ratios", {}).items():
            rec.log(f"{NAME} read: reads/s {name}: {_cell(entry)} (per round, median)")
    again = d["summary"].get("reconnect") or {}
    if again:
        paths = list(again)
        rec.table(record, f"{NAME} reconnect: medians of {c['rounds']} rounds, link down "
                  f"{c['cut_s']} s while {c['changed']:.0%} of {c['keys']:,} keys changed",
                  ["", *paths], [[label, *[_cell(again[p].get(f)) for p in paths]]
                                 for f, label in RECONNECT_FIELDS]
                  + [["runs never current", *[str(again[p]["never_current"])
                                              for p in paths]]],
                  "bytes: what the reader's connections received through the cutter "
                  "(bench/harness/cutter.py), from the heal until its copy held the last "
                  "change")
    memory = d["summary"].get("memory") or {}
    if memory:
        paths = sorted({p for e in memory.values() for p in e if " / " not in p})
        ratios = [f"{a} / {b}" for a, b in MEMORY_RATIOS
                  if any(f"{a} / {b}" in e for e in memory.values())]
        rec.table(record, f"{NAME} memory: RSS a copy of the map adds, bytes per key "
                  f"({c['value_bytes']} B values)", ["keys", *paths, *ratios],
                  [[f"{int(k):,}", *[rec._fmt(e[p]) if p in e else "-" for p in paths],
                    *[rec._fmt(e[r]) if r in e else "-" for r in ratios]]
                   for k, e in sorted(memory.items(), key=lambda kv: int(kv[0]))],
                  "one reader process per path and size: its RSS with the client "
                  "connected, then with the copy complete; dict: a plain dict of the same "
                  "keys and values")
    delivered = d["summary"].get("fanout.every_update_delivered", {})
    for system in systems:
        if system in d.get("missing", {}):
            rec.log(f"{NAME}: {system}: missing ({d['missing'][system]})")
        else:
            rec.log(f"{NAME}: {system} {d.get('versions', {}).get(system, '')}: an "
                    f"acknowledgement means: {d['acks'][system]}")
            if system in delivered and not delivered[system]:
                rec.log(f"{NAME}: {system}: NOT every fan-out update reached every watcher")
    errors = sum(r.get("errors", 0) for r in d["runs"])
    if errors:
        rec.log(f"{NAME}: {errors} writes failed (counted in the runs)")
    if d["targets"]:
        rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
