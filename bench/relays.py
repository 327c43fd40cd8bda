"""Relays and resume: what they cost and what they save (``python -m bench relays``).

Every run starts a fresh memory-only Binary Star pair (``--heartbeat-s 0.5``) and, where
the mode says, relays of it (``python -m clonemap.shards.relay``). Three parts:

1. **Fan-out** (per round and size, mode ``direct`` then ``relays``): ``--subscribers``
   raw SUB sockets spread over reader processes (``bench.harness.readers``: one per core
   the pair, the relays and the writer leave, or ``--processes``), all on the active's
   P+1 (direct) or spread over the relays; one writer sends ``--rate`` stamped updates
   per second, open loop, for ``--warmup`` + ``--seconds`` (``--sizes`` runs several
   subscriber x rate sizes). Per update and subscriber: the latency from the update's
   intended send time. Reported: whether every subscriber got every update, p50/p99
   weighted over the readers, and the CPU of the server, each relay and each reader (a
   reader over 90% of a core makes the run harness-bound). The relay hop's added
   latency is relays minus direct, in the same round.
2. **Failover cost** (per round, mode ``direct, no resume``, ``direct, resume``,
   ``relays``): ``--clients`` clients (``AsyncClone``s on one loop in a child process)
   hold a ``--keys``-key map, directly or through the relays. The active is SIGKILLed,
   and ``--failover-writes`` updates are written meanwhile. Then every client has them.
   Counted where they are served (each server's and relay's own stats, SIGUSR1): snapshot
   KVSYNCs and resume updates, and their bytes (key + value + the 8-byte sequence), by
   the shard and by the relays.
3. **Memory per relay**: each relay's RSS and the active server's, holding the same map,
   from the ``relays`` failover runs.

On this 2-core host every process shares two cores: the readers, the relays and the
servers compete, so the relay hop's latency includes that contention (a relay on its
own core would add less).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import struct
import sys
import time

import psutil
import zmq

from bench.harness import record as rec
from bench.harness.procs import Target, bench_main, cpu_pct_each, cpu_seconds, free_port_base
from bench.harness.readers import subscriber_processes, weighted_percentiles
from clonemap.shards.common.endpoints import MAX_IO_THREADS

NAME = "relays"
STAMP = struct.Struct(">Q")
TARGET_SAVING = 10.0
"""The issue's target: failover transfers at least 10x less with resume or relays."""
FANOUT_P99_MS = 20.0
"""The 16-core target: 1,000 subscribers at 1,000 updates/s each, p99 under 20 ms
directly and through relays."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="Relays and resume: fan-out latency per relay "
                                             "hop, failover cost direct vs resume vs "
                                             "relays, memory per relay. Duration: smoke "
                                             "~30 s, full ~3 min")
    ap.add_argument("--subscribers", type=int, default=200)
    ap.add_argument("--relays", type=int, default=2)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--failover-writes", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="fanout,failover",
                    help="fanout and/or failover, comma-separated (memory per relay comes "
                         "with failover)")
    ap.add_argument("--processes", type=int, default=0,
                    help="subscriber processes the fan-out's SUB sockets are spread over "
                         "(0: one per core the servers, relays and writer leave, at most "
                         "one per 10 subscribers), so the figure is the relay hop's, not "
                         "one subscriber process's")
    ap.add_argument("--sizes", default="",
                    help="fan-out at several sizes, SUBSCRIBERSxRATE comma-separated (e.g. "
                         "250x1000,1000x200,1000x1000); overrides --subscribers and --rate "
                         "for the fan-out part")
    ap.add_argument("--io-threads", type=int, default=1,
                    help="libzmq I/O threads of the servers and relays (--io-threads): "
                         "direct fan-out to a thousand subscribers is bound by one")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    ap.add_argument("--child", choices=("clients",), help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    ap.add_argument("--via", default="servers", help=argparse.SUPPRESS)
    ap.add_argument("--resume", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.child and (args.subscribers < 1 or args.relays < 1 or args.clients < 1):
        ap.error("--subscribers, --relays and --clients must be >= 1")
    args.part_list = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.part_list or set(args.part_list) - {"fanout", "failover"}:
        ap.error("--parts: fanout and/or failover")
    if args.processes < 0:
        ap.error("--processes must be >= 0")
    if not 1 <= args.io_threads <= MAX_IO_THREADS:
        ap.error(f"--io-threads must be 1..{MAX_IO_THREADS}")
    try:
        args.size_list = [(int(n), float(r)) for n, _, r in
                          (x.strip().partition("x") for x in args.sizes.split(",")
                           if x.strip())]
    except ValueError:
        ap.error(f"--sizes: SUBSCRIBERSxRATE, comma-separated, got {args.sizes!r}")
    if any(n < 1 or r <= 0 for n, r in args.size_list):
        ap.error("--sizes: subscribers >= 1 and rate > 0")
    args.size_list = args.size_list or [(args.subscribers, args.rate)]
    return args


# ===================================================================== processes

class Cluster:
    """A memory-only pair, and relays of it."""

    def __init__(self, relays: int, io_threads: int = 1):
        self.targets: list[Target] = []
        self.primary = free_port_base(4)
        self.backup = free_port_base(4)
        io = ["--io-threads", str(io_threads)]
        py = [sys.executable, "-m", "clonemap.shards", "--heartbeat-s", "0.5", "--log-level", "info",
              *io]
        self.p = self._start("primary", py + ["--port", str(self.primary), "--primary",
                                              "--peer", f"127.0.0.1:{self.backup}"])
        self.b = self._start("backup", py + ["--port", str(self.backup), "--backup",
                                             "--peer", f"127.0.0.1:{self.primary}"])
        self.relays = []
        self.relay_ports = []
        for j in range(relays):
            port = free_port_base(4)
            self.relay_ports.append(port)
            self.relays.append(self._start(f"relay{j}", [
                sys.executable, "-m", "clonemap.shards.relay", "--port", str(port), "--heartbeat-s",
                "0.5", "--name", f"relay{j}", *io,
                "--upstream", f"127.0.0.1:{self.primary},127.0.0.1:{self.backup}"]))

    def _start(self, name: str, argv: list[str]) -> Target:
        target = Target(name, argv)
        self.targets.append(target)
        return target

    def endpoints(self, via: str) -> list[str]:
        if via == "relays":
            return [f"tcp://127.0.0.1:{p}" for p in self.relay_ports]
        return [f"tcp://127.0.0.1:{self.primary}", f"tcp://127.0.0.1:{self.backup}"]

    def close(self) -> None:
        for t in reversed(self.targets):
            t.stop()


def stats_of(target: Target, timeout_s: float = 10.0) -> dict:
    """SIGUSR1: the process logs ``stats {json}`` on stderr (its temp file)."""
    f = target._stderr
    f.seek(0, os.SEEK_END)
    start = f.tell()
    os.kill(target.pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        f.seek(start)
        for line in f.read().decode("utf-8", "replace").splitlines():
            if " stats {" in line:
                return json.loads(line.split(" stats ", 1)[1])
        time.sleep(0.05)
    raise RuntimeError(f"{target.name}: no stats line")


class Writer:
    """A raw PUB to both collectors (as a client sends), checked live through a SUB."""

    def __init__(self, ctx: zmq.Context, cluster: Cluster):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.sndhwm = 0
        for port in (cluster.primary, cluster.backup):
            self.pub.connect(f"tcp://127.0.0.1:{port + 2}")
        self.sub = ctx.socket(zmq.SUB)
        self.sub.subscribe(b"/probe")
        # before the probe: once a probe comes back, this subscription is in place too
        # (subscribing after the load raced the server publishing /m/loaded: a hang)
        self.sub.subscribe(b"/m/loaded")
        self.sub.connect(f"tcp://127.0.0.1:{cluster.primary + 1}")
        deadline = time.monotonic() + 15
        while True:
            self.pub.send_multipart([b"/probe", bytes(8), b"", b"", b"p"])
            if self.sub.poll(100):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the writer never reached the active")

    def send(self, key: bytes, value: bytes) -> None:
        self.pub.send_multipart([key, bytes(8), os.urandom(16), b"", value])


# ===================================================================== children

def child_clients(args) -> None:
    """``--clients`` AsyncClones on one loop; READY once all hold their snapshot; on
    SIGUSR1 a JSON line of their summed stats and how many hold ``/m/done``; SIGTERM
    ends it."""
    import uvloop

    from clonemap.client.api import AsyncClone

    async def main() -> None:
        servers = args.endpoints.split(",")
        ctx = zmq.Context()
        clones = [AsyncClone(servers, via=args.via, heartbeat_s=0.5, timeout_s=60,
                             resume=bool(args.resume), context=ctx)
                  for _ in range(args.clients)]
        for c in clones:
            await c.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def report() -> None:
            total: dict[str, int] = {}
            for c in clones:
                for name, value in c.stats()["shards"][0].items():
                    if isinstance(value, int) and not isinstance(value, bool):
                        total[name] = total.get(name, 0) + value
            total["have_key"] = sum(1 for c in clones if c.get("/m/done") is not None)
            print(json.dumps(total), flush=True)

        loop.add_signal_handler(signal.SIGUSR1, report)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        # READY only now: a SIGUSR1 before its handler is installed ends the process
        # (the default action), which made a failover round wait for clients gone
        print("READY", flush=True)
        await stop.wait()
        for c in clones:
            await c.close()
        ctx.destroy(linger=0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


# ===================================================================== parts

def fanout(mode: str, args) -> dict:
    cluster = Cluster(args.relays if mode == "relays" else 0, args.io_threads)
    ctx = zmq.Context()
    try:
        endpoints = (cluster.endpoints("relays") if mode == "relays"
                     else [f"tcp://127.0.0.1:{cluster.primary + 1}"])
        if mode == "relays":
            endpoints = [f"tcp://127.0.0.1:{p + 1}" for p in cluster.relay_ports]
        total = int(args.rate * (args.warmup + args.seconds))
        warm = int(args.rate * args.warmup)
        shares = subscriber_processes(args.subscribers, args.relays, args.processes)
        firsts = [sum(shares[:j]) for j in range(len(shares))]
        from concurrent.futures import ThreadPoolExecutor

        def start(j: int) -> Target:
            return Target(f"subscribers{j}", [
                sys.executable, "-m", "bench.harness.readers",
                "--subscribers", str(shares[j]), "--first", str(firsts[j]),
                "--endpoints", ",".join(endpoints), "--expect", str(total),
                "--warm", str(warm)], timeout_s=60)

        with ThreadPoolExecutor(len(shares)) as pool:
            futures = [pool.submit(start, j) for j in range(len(shares))]
        subs = []
        for f in futures:       # every one is kept (and ended) even if another failed
            if f.exception() is None:
                subs.append(f.result())
                cluster.targets.append(subs[-1])
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        writer = Writer(ctx, cluster)
        pad = b"x" * max(0, args.value_bytes - 8)
        who = {"server": [cluster.p.pid], "relays": [r.pid for r in cluster.relays],
               "subscribers": [s.pid for s in subs]}
        cpu0 = cpu_seconds([p for pids in who.values() for p in pids])
        t0 = time.monotonic()
        for i in range(total):
            due = t0 + i / args.rate
            while (now := time.monotonic()) < due:
                time.sleep(min(0.002, due - now))
            writer.send(b"/fan/%d" % i, STAMP.pack(int(due * 1e9)) + pad)
        parts = [json.loads(sub._stdout.wait_for(lambda text: text.startswith("{"), 90))
                 for sub in subs]
        took = time.monotonic() - t0
        cpu1 = cpu_seconds([p for pids in who.values() for p in pids])
        # a reader exits right after its line: its CPU comes with the line
        cpu1.update({sub.pid: part["cpu_s"] for sub, part in zip(subs, parts)})
        least = min(p["counts"][0] for p in parts)
        pct = {role: cpu_pct_each(pids, cpu0, cpu1, took) for role, pids in who.items()}
        threads = cpu1["threads"]   # the first pid's: the server's
        pct["server_threads"] = sorted(cpu_pct_each(list(threads), cpu0["threads"], threads,
                                                    took), reverse=True)[:3]
        hot = rec.saturated("subscriber process", pct["subscribers"])
        return {"part": "fanout", "mode": mode, "subscribers": args.subscribers,
                "rate": args.rate, "processes": len(shares), "updates": total,
                "min_received": least, "every_update": least >= total,
                **weighted_percentiles(parts), "cpu_pct": pct,
                "harness_bound": "; ".join(hot)}
    finally:
        ctx.destroy(linger=0)
        cluster.close()


def failover(mode: str, args) -> dict:
    via = "relays" if mode == "relays" else "servers"
    cluster = Cluster(args.relays if mode == "relays" else 0, args.io_threads)
    ctx = zmq.Context()
    try:
        writer = Writer(ctx, cluster)
        value = b"v" * args.value_bytes
        for i in range(args.keys):
            writer.send(b"/m/%07d" % i, value)
        writer.send(b"/m/loaded", b"1")
        sub = writer.sub
        deadline = time.monotonic() + 60
        while True:
            if not sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise RuntimeError("the map was not loaded within 60 s")
            if sub.recv_multipart()[0] == b"/m/loaded":
                break
        entry = len(b"/m/0000000") + args.value_bytes + 8
        clients = Target("clients", [sys.executable, "-m", "bench.relays", "--child",
                                     "clients", "--clients", str(args.clients), "--endpoints",
                                     ",".join(cluster.endpoints(via)), "--via", via,
                                     "--resume", "0" if mode == "direct_no_resume" else "1"],
                         timeout_s=300)
        cluster.targets.append(clients)
        served = lambda: {t.name: stats_of(t) for t in [cluster.b] + cluster.relays}  # noqa: E731
        before = served()
        rss = {"server": psutil.Process(cluster.p.pid).memory_info().rss,
               **{t.name: psutil.Process(t.pid).memory_info().rss for t in cluster.relays}}
        os.kill(cluster.p.pid, signal.SIGKILL)
        for i in range(args.failover_writes):
            writer.send(b"/m/%07d" % i, b"after")
        writer.send(b"/m/done", b"1")
        return {"part": "failover", "mode": mode, "clients": args.clients, "keys": args.keys,
                **_after_failover(cluster, clients, before, served, entry, args),
                "rss_mib": {k: round(v / (1 << 20), 1) for k, v in rss.items()}}
    finally:
        ctx.destroy(linger=0)
        cluster.close()


def _after_failover(cluster, clients, before, served, entry: int, args) -> dict:
    """Wait until every client holds ``/m/done``, then count what was served."""
    deadline = time.monotonic() + 120
    totals = {}
    while time.monotonic() < deadline:
        os.kill(clients.pid, signal.SIGUSR1)
        line = clients._stdout.wait_for(lambda text: text.startswith("{"), 30)
        if line is None:
            raise RuntimeError(f"the clients process exited: {clients.stderr_tail()}")
        totals = json.loads(line)
        if totals.get("have_key") == args.clients:
            break
        time.sleep(0.2)
    after = served()
    out = {"shard_kvsync": 0, "shard_resume": 0, "relay_kvsync": 0, "relay_resume": 0}
    for name, stats in after.items():
        side = "relay" if name.startswith("relay") else "shard"
        out[f"{side}_kvsync"] += stats["kvsync_sent"] - before[name]["kvsync_sent"]
        out[f"{side}_resume"] += stats["resume_sent"] - before[name]["resume_sent"]
    out["bytes"] = entry * sum(out.values())
    out["client_snapshots"] = totals.get("snapshots", 0) - args.clients
    out["client_resumes"] = totals.get("resumes", 0)
    out["all_clients_have_it"] = totals.get("have_key") == args.clients
    return out


# ===================================================================== run

def run(args: argparse.Namespace) -> rec.Record:
    config = {k: v for k, v in vars(args).items()
              if k not in ("results_dir", "child", "endpoints", "via", "resume",
                           "part_list", "size_list")}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    sizes = args.size_list if "fanout" in args.part_list else []
    modes = ("direct_no_resume", "direct_resume", "relays")
    steps = args.rounds * (2 * len(sizes) + 3 * ("failover" in args.part_list))
    with rec.Progress(NAME, total=steps) as progress:
        for n, _ in sizes:
            shares = subscriber_processes(n, args.relays, args.processes)
            progress.note(f"plan: {n} SUB sockets over {len(shares)} subscriber "
                          f"process(es) of {min(shares)}-{max(shares)}, on "
                          f"{len(os.sched_getaffinity(0))} usable cores; the pair, "
                          f"{args.relays} relays (relays mode) and the writer beside them")
        for r in range(args.rounds):
            for n, rate in sizes:
                sized = argparse.Namespace(**{**vars(args), "subscribers": n, "rate": rate})
                for mode in ("direct", "relays"):
                    progress.step(f"round {r + 1}: fan-out {mode}, {n} x {rate:g}/s")
                    run_ = {"round": r + 1, **fanout(mode, sized)}
                    progress.note(f"fan-out {mode} {n} x {rate:g}/s: p50 {run_['p50_ms']} "
                                  f"ms, p99 {run_['p99_ms']} ms, every update "
                                  f"{run_['every_update']}")
                    record.add_run(run_)
            for mode in modes if "failover" in args.part_list else ():
                progress.step(f"round {r + 1}: failover {mode}")
                run_ = {"round": r + 1, **failover(mode, args)}
                progress.note(f"failover {mode}: {run_['bytes'] / 1e6:.2f} MB served")
                record.add_run(run_)
        progress.finish_step()
    summarize(record)
    record.finish()
    return record


def summarize(record: rec.Record) -> None:
    runs = record.data["runs"]
    fan = {m: [r for r in runs if r["part"] == "fanout" and r["mode"] == m]
           for m in ("direct", "relays")}
    added = [round(b["p50_ms"] - a["p50_ms"], 3) for a, b in zip(fan["direct"], fan["relays"])]
    added99 = [round(b["p99_ms"] - a["p99_ms"], 3) for a, b in zip(fan["direct"], fan["relays"])]
    fo = {m: [r for r in runs if r["part"] == "failover" and r["mode"] == m]
          for m in ("direct_no_resume", "direct_resume", "relays")}
    bytes_ = {m: [r["bytes"] for r in rs] for m, rs in fo.items()}
    saving = {}
    for m in ("direct_resume", "relays"):
        ratios = [round(a / max(1, b), 1) for a, b in zip(bytes_["direct_no_resume"],
                                                          bytes_[m])]
        saving[m] = ratios
    summary = {
        "fanout_every_update": all(r["every_update"] for rs in fan.values() for r in rs),
        "fanout_p50_ms": {m: [r["p50_ms"] for r in rs] for m, rs in fan.items()},
        "fanout_p99_ms": {m: [r["p99_ms"] for r in rs] for m, rs in fan.items()},
        "relay_hop_added_p50_ms_per_round": added,
        "relay_hop_added_p99_ms_per_round": added99,
        "failover_bytes": bytes_,
        "failover_saving_vs_direct_no_resume": saving,
        "rss_mib": [r["rss_mib"] for r in fo["relays"]],
    }
    record.data["summary"] = summary
    for m, label in (("direct_resume", "resume"), ("relays", "relays")):
        if saving[m]:
            record.target(f"failover bytes: direct without resume / with {label} (worst round)",
                          min(saving[m]), TARGET_SAVING, "x")
    if fan["direct"] or fan["relays"]:
        record.target("fan-out: every update reached every subscriber",
                      1.0 if summary["fanout_every_update"] else 0.0, 1.0, "yes")
    for m, rs in fan.items():
        for n, rate in sorted({(r["subscribers"], r.get("rate")) for r in rs},
                              key=lambda x: (x[0], x[1] or 0)):
            mine = [r for r in rs if (r["subscribers"], r.get("rate")) == (n, rate)]
            if not all(r["p99_ms"] is not None for r in mine):
                continue
            size = f"{n} x {rate:g}/s" if rate else f"{n} subscribers"
            record.target(f"fan-out p99, {m}, {size} (worst round)",
                          max(r["p99_ms"] for r in mine), FANOUT_P99_MS, "ms",
                          higher_is_better=False,
                          harness_bound="; ".join(r["harness_bound"] for r in mine
                                                  if r.get("harness_bound")))


def report(record: rec.Record) -> None:
    runs = record.data["runs"]
    busiest = lambda r, role: max(r.get("cpu_pct", {}).get(role) or [0])  # noqa: E731
    rec.table(record, f"{NAME}: fan-out",
              ["round", "mode", "subscribers x rate", "updates", "min received", "p50 ms",
               "p99 ms", "max ms", "server cpu%", "busiest relay cpu%",
               "busiest subscriber process cpu%"],
              [[r["round"], r["mode"], f"{r['subscribers']} x {r.get('rate', 0):g}/s",
                r["updates"], r["min_received"], r["p50_ms"],
                r["p99_ms"], r["max_ms"], busiest(r, "server"), busiest(r, "relays"),
                busiest(r, "subscribers")] for r in runs if r["part"] == "fanout"],
              caption="relay hop added (relays - direct), per round: p50 "
                      f"{record.data['summary']['relay_hop_added_p50_ms_per_round']} ms, p99 "
                      f"{record.data['summary']['relay_hop_added_p99_ms_per_round']} ms")
    if not any(r["part"] == "failover" for r in runs):
        rec.print_targets(record)
        return
    rec.table(record, f"{NAME}: one failover, {record.data['config']['clients']} clients, "
                      f"{record.data['config']['keys']:,} keys",
              ["round", "mode", "shard KVSYNC", "shard resume", "relay KVSYNC",
               "relay resume", "MB served", "client snapshots", "client resumes"],
              [[r["round"], r["mode"], r["shard_kvsync"], r["shard_resume"],
                r["relay_kvsync"], r["relay_resume"], round(r["bytes"] / 1e6, 3),
                r["client_snapshots"], r["client_resumes"]]
               for r in runs if r["part"] == "failover"],
              caption="RSS MiB (server, relays) with the map: "
                      f"{record.data['summary']['rss_mib']}")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record | None:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    if args.child == "clients":
        child_clients(args)
        return None
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
