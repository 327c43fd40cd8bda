"""Pairs across hosts: what an acknowledgement that both servers hold costs, and how long a
shard waits when the host of its active dies.

``python -m bench.hosts [--seconds 4] [--rounds 2] [--in-flight 1,16] [--lease-s 2]
[--heartbeat-s 0.2] [--takeovers 2]`` (also ``python -m bench hosts ...``)

Hosts are network namespaces joined by a bridge (``bench.harness.netns``; needs root and
iproute2): a and b hold the pair, c the writer, e a real etcd. Three modes, interleaved in
every round:

* ``one host``: primary and backup both on host a, Binary Star alone (no lease): today's
  pair, whose acknowledgement means the active holds the write;
* ``across, sync``: primary on a, backup on b, ``--coordination`` etcd on e and
  ``--replication sync`` (the default there): acknowledged once both servers hold it;
* ``across, async``: the same with ``--replication async``: the lease, but acknowledged
  by the active alone.

Every server persists (``--data-dir``, ``fsync: everysec``). The writer
(``bench.harness.ackwriter``, a real client on uvloop) keeps ``--in-flight`` writes of 100
bytes with ``wait=True`` outstanding for ``--seconds``; per mode: acknowledged writes/s,
p50/p99/max from the call to the acknowledgement, and the CPU of each server per
acknowledged write. Ratios to ``one host`` are taken within each round.

Takeover (``across, sync``, ``--takeovers`` times): the writer runs; every process of
host a (the active) is killed at once; the figure is the time from the kill to the first
write acknowledged again (through b), with the writes that failed meanwhile. It is
bounded by the lease (the dead active's must expire) plus the client's silence timeout
and one acquire retry (0.5 s at most).

Where this process may not make namespaces, the scenario says why and exits 1: no mode
is dropped silently. The figures are this host's: namespaces share its cores and its
kernel, so "across hosts" here measures the protocol's round trips and CPU, not a
network's latency (add the link's round trip per acknowledgement for a real one).

Duration on a 2-core host: smoke (``--seconds 1 --rounds 1 --in-flight 1 --takeovers 1``)
~30 s; quick (defaults) ~1.5 min; full (``--seconds 8 --rounds 3 --takeovers 3``) ~4 min.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.harness import record as rec
from bench.harness.procs import Target, bench_main, cpu_seconds
from bench.harness.stats import percentile

NAME = "hosts"
MODES = ("one host", "across, sync", "across, async")
REPLICATION = {"across, sync": "sync", "across, async": "async"}
"""``--replication`` of the modes across hosts (a pair on one host has no lease)."""
PORT = 6000
ETCD_PORT = 12379
DURATION = ("Duration (2 cores): smoke (--seconds 1 --rounds 1 --in-flight 1 --takeovers 1) "
            "~30 s; quick ~1.5 min; full (--seconds 8 --rounds 3 --takeovers 3) ~4 min.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.hosts",
                                 description=__doc__.split("\n")[0], epilog=DURATION)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured window per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--in-flight", default="1,16",
                    help="comma-separated counts of writes outstanding at once")
    ap.add_argument("--lease-s", type=float, default=2.0)
    ap.add_argument("--heartbeat-s", type=float, default=0.2)
    ap.add_argument("--takeovers", type=int, default=2)
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    args.in_flight = [int(x) for x in str(args.in_flight).split(",") if x]
    if (args.seconds <= 0 or args.rounds < 1 or not args.in_flight
            or min(args.in_flight) < 1 or args.lease_s < 2 or args.takeovers < 0):
        ap.error("--seconds > 0, --rounds >= 1, --in-flight >= 1, --lease-s >= 2, "
                 "--takeovers >= 0")
    return args


def canonical_command(args: argparse.Namespace) -> str:
    return rec.command_line("bench.hosts", {
        "seconds": args.seconds, "rounds": args.rounds,
        "in_flight": ",".join(map(str, args.in_flight)), "lease_s": args.lease_s,
        "heartbeat_s": args.heartbeat_s, "takeovers": args.takeovers})


class Setup:
    """The hosts, etcd on e, and the pair of one run (``start(mode)``)."""

    def __init__(self, hosts, tmp: Path, args):
        from bench.harness.etcd import Etcd

        self.hosts, self.tmp, self.args = hosts, tmp, args
        self.etcd = Etcd(tmp / "etcd", ETCD_PORT, hosts.address["e"], hosts.prefix("e"))
        self.servers: list[Target] = []

    def start(self, mode: str) -> str:
        """Start the pair for ``mode``; its SERVERS argument for a client."""
        h, args = self.hosts, self.args
        where = {"primary": "a", "backup": "a" if mode == "one host" else "b"}
        ports = {"primary": PORT, "backup": PORT + 10 if mode == "one host" else PORT}
        run = uuid.uuid4().hex[:8]
        extra: list[str] = []
        if mode != "one host":
            extra = ["--coordination", self.etcd.url, "--lease-s", str(args.lease_s),
                     "--lease-name", f"bench-{run}", "--replication", REPLICATION[mode]]
        self.servers = []
        for role, peer in (("primary", "backup"), ("backup", "primary")):
            argv = [*h.prefix(where[role]), sys.executable, "-m", "clonemap.shards",
                    "--port", str(ports[role]), "--host", h.address[where[role]],
                    f"--{role}", "--peer", f"{h.address[where[peer]]}:{ports[peer]}",
                    "--shard", "s0", "--heartbeat-s", str(args.heartbeat_s),
                    "--data-dir", str(self.tmp / f"{run}-{role}"), "--log-level", "warning",
                    *extra]
            self.servers.append(Target(f"{mode} {role}", argv))
        return ",".join(f"tcp://{h.address[where[r]]}:{ports[r]}" for r in ("primary",
                                                                            "backup"))

    def stop_pair(self) -> None:
        for target in self.servers:
            target.stop()
        self.servers = []

    def close(self) -> None:
        self.stop_pair()
        self.etcd.stop()


def writer(setup: Setup, servers: str, seconds: float, in_flight: int) -> Target:
    h = setup.hosts
    return Target("writer", [*h.prefix("c"), sys.executable, "-m", "bench.harness.ackwriter",
                             servers, "--seconds", str(seconds), "--in-flight", str(in_flight),
                             "--heartbeat-s", str(setup.args.heartbeat_s)], timeout_s=60)


def result_of(target: Target, timeout_s: float) -> dict:
    line = target._stdout.wait_for(lambda text: text.startswith("{"), timeout_s)
    if line is None:
        raise RuntimeError(f"the writer exited without its figures: {target.stderr_tail()}")
    target.stop()
    return json.loads(line)


def measure(setup: Setup, mode: str, in_flight: int, rnd: int) -> dict:
    args = setup.args
    servers = setup.start(mode)
    try:
        w = writer(setup, servers, args.seconds, in_flight)
        pids = [t.pid for t in setup.servers]
        before, t_before = cpu_seconds(pids), time.monotonic()
        got = result_of(w, args.seconds + 60)
        after, elapsed = cpu_seconds(pids), time.monotonic() - t_before
    finally:
        setup.stop_pair()
    lat = sorted(x[1] for x in got["writes"] if x[1] >= 0)
    acked = len(lat)
    cpu = [after.get(p, 0.0) - before.get(p, 0.0) for p in pids]

    def pct(q: float) -> float | None:
        value = percentile(lat, q * 100)
        return round(1000 * value, 3) if value is not None else None

    return {"round": rnd, "mode": mode, "in_flight": in_flight, "acked": acked,
            "failed": len(got["writes"]) - acked, "errors": got["errors"],
            "acks_per_s": round(acked / args.seconds, 1),
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": pct(1.0),
            "cpu_us_per_ack": [round(1e6 * c / acked, 1) if acked else None for c in cpu],
            "elapsed_s": round(elapsed, 2)}


def takeover(setup: Setup, mode: str) -> dict:
    """Kill every process of host a (the active's) while the writer runs."""
    servers = setup.start(mode)
    try:
        w = writer(setup, servers, 1.0 + setup.args.lease_s + 3.0, 1)
        time.sleep(1.0)  # steady writes before the kill: the schedule, not a wait
        killed_at = time.monotonic()
        killed = setup.hosts.kill("a")
        got = result_of(w, setup.args.lease_s + 60)
    finally:
        setup.stop_pair()
    kill = killed_at - got["t0"]
    done = sorted(start + lat for start, lat in got["writes"] if lat >= 0)
    # the outage: the longest pause between two acknowledgements after the kill (the
    # ones just after it were in flight before, already acknowledged by the dead active)
    after = [t for t in done if t > kill]
    back, pause = None, 0.0
    for prev, t in zip([kill] + after, after):
        if t - prev > pause:
            back, pause = t, t - prev
    failed = sum(1 for start, lat in got["writes"] if lat < 0 and start >= kill - 2.0)
    return {"mode": mode, "killed": killed,
            "takeover_s": round(back - kill, 3) if back is not None else None,
            "longest_pause_s": round(pause, 3), "failed_writes": failed,
            "acks_after": len(after)}


def run(args: argparse.Namespace) -> rec.Record:
    from bench.harness.netns import Hosts, available

    record = rec.Record(NAME, canonical_command(args), {
        "seconds": args.seconds, "rounds": args.rounds, "in_flight": args.in_flight,
        "lease_s": args.lease_s, "heartbeat_s": args.heartbeat_s, "modes": list(MODES),
        "value_bytes": 100, "fsync": "everysec"})
    why = available()
    if why:
        raise SystemExit(f"bench hosts: {why}: the hosts are network namespaces")
    hosts = Hosts(["a", "b", "c", "e"])
    tmp = tempfile.TemporaryDirectory(prefix="bench-hosts-")
    try:
        setup = Setup(hosts, Path(tmp.name), args)
        try:
            for rnd in range(args.rounds):
                for k in args.in_flight:
                    for mode in MODES:
                        rec.log(f"round {rnd}: {mode}, {k} in flight")
                        record.add_run(measure(setup, mode, k, rnd))
            takeovers = []
            for i in range(args.takeovers):
                rec.log(f"takeover {i}: host a killed")
                takeovers.append(takeover(setup, "across, sync"))
            record.data["takeovers"] = takeovers
        finally:
            setup.close()
    finally:
        hosts.close()
        tmp.cleanup()
    summarize(record, args)
    record.finish()
    return record


def summarize(record: rec.Record, args) -> None:
    runs = record.data["runs"]
    summary = {}
    for k in args.in_flight:
        for mode in MODES:
            mine = [r for r in runs if r["mode"] == mode and r["in_flight"] == k]
            summary[f"{mode} x{k}"] = {
                "acks_per_s": rec.spread([r["acks_per_s"] for r in mine]),
                "p50_ms": rec.spread([r["p50_ms"] for r in mine if r["p50_ms"]], 3),
                "p99_ms": rec.spread([r["p99_ms"] for r in mine if r["p99_ms"]], 3),
                "active_cpu_us": rec.spread([r["cpu_us_per_ack"][0] for r in mine
                                             if r["cpu_us_per_ack"][0]], 1),
                "passive_cpu_us": rec.spread([r["cpu_us_per_ack"][1] for r in mine
                                              if r["cpu_us_per_ack"][1]], 1)}
            if mode != "one host":
                ratio = [x for x in (_ratio(runs, mode, k, rnd) for rnd in
                                     range(args.rounds)) if x]
                summary[f"{mode} x{k}"]["throughput_vs_one_host"] = rec.spread(ratio, 3)
    takes = [t["takeover_s"] for t in record.data.get("takeovers", []) if t["takeover_s"]]
    summary["takeover_s"] = rec.spread(takes, 3)
    record.data["summary"] = summary
    if takes:
        record.target("takeover after the active's host dies (median)",
                      statistics.median(takes), args.lease_s + 1.0 + 3 * args.heartbeat_s,
                      "s", higher_is_better=False)


def _ratio(runs, mode: str, k: int, rnd: int) -> float | None:
    row = {r["mode"]: r for r in runs if r["in_flight"] == k and r["round"] == rnd}
    a, b = row.get(mode), row.get("one host")
    if a and b and a["acks_per_s"] and b["acks_per_s"]:
        return round(a["acks_per_s"] / b["acks_per_s"], 3)
    return None


def report(record: rec.Record) -> None:
    s = record.data["summary"]
    rows = []
    for key, v in s.items():
        if key == "takeover_s":
            continue
        rows.append([key, v["acks_per_s"].get("median"), v.get("throughput_vs_one_host",
                                                               {}).get("median", "-"),
                     v["p50_ms"].get("median"), v["p99_ms"].get("median"),
                     v["active_cpu_us"].get("median"), v["passive_cpu_us"].get("median")])
    rec.table(record, "wait=True writes: a pair on one host and across hosts",
              ["mode x in flight", "acks/s", "vs one host", "p50 ms", "p99 ms",
               "active CPU us/ack", "passive CPU us/ack"], rows,
              "medians over rounds; 'vs one host': acks/s ratio within each round; hosts "
              "are network namespaces of one machine (no network latency added)")
    takes = record.data.get("takeovers", [])
    if takes:
        rec.table(record, "takeover when the active's host dies (across, sync)",
                  ["kill", "processes killed", "first ack again s", "writes failed",
                   "acks after"],
                  [[i, t["killed"], t["takeover_s"], t["failed_writes"], t["acks_after"]]
                   for i, t in enumerate(takes)],
                  f"lease {record.data['config']['lease_s']} s, heartbeat "
                  f"{record.data['config']['heartbeat_s']} s")
    rec.print_targets(record)


def main(argv: list[str] | None = None):
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
