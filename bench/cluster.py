"""The cluster as users run it, flat out and at a fixed share of that (``python -m bench cluster``).

``supervisor start`` of a config (default ``configs/16core-cluster.yaml``; ports, control
endpoint and data directory moved to free ones and a temporary directory, so it never
meets a running cluster: durable, ``fsync: everysec`` unless the config says otherwise,
replicated) and, once every pair is ACTIVE/PASSIVE, ``bench load`` against its primaries
with ``--harness auto``: writers and subscribers sized from the cores no server of the
config is pinned to (or ``--cores``), subscribers splitting the shards, the plan printed
first. ``--rounds`` flat-out windows, then one window at each ``--rates-of-max`` fraction
of their median (open loop: latency from each update's intended send time). The servers'
CPU comes from their PIDs in the supervisor's status. Lost updates are charged to the
servers, or to the harness when the subscriber that missed them was over 90% of a core.

On a host with fewer cores than the config names, pass a config that fits (the smoke
profile uses ``configs/2shard.yaml``). Duration: start ~5 s, then (rounds + fractions) x
(warmup + seconds + ~1 s); smoke ~15 s, the 16-core profile ~30 s.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench import load
from bench.harness import record as rec
from bench.harness.procs import ROOT, Target, bench_main, relocated_config

NAME = "cluster"
DEADLINE_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=f"python -m bench {NAME}",
        description="supervisor start of a config, then bench load against its primaries "
                    "with a harness sized from the cores the servers leave: flat out, then "
                    "at fractions of that. Duration: smoke (configs/2shard.yaml, 1 s "
                    "windows) ~15 s; 16core (6 shards, 3 s windows) ~30 s; full ~1 min")
    ap.add_argument("--config", default="configs/16core-cluster.yaml")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rates-of-max", default="0.25")
    ap.add_argument("--cores", default="", help="the harness's cores (default: every usable "
                                                "core no server of the config is pinned to)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1:
        ap.error("--seconds and --rounds must be positive, --warmup >= 0")
    return args


def settled_pids(control: str, shards: int) -> list[int]:
    """Wait until every pair is ACTIVE/PASSIVE; the servers' PIDs."""
    from clonemap.supervisor.control import status_rows

    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            rows, _ = status_rows(control, timeout_s=5.0)
            servers = [r for r in rows if r.get("role") in ("primary", "backup")
                       or "/" in r.get("name", "")]
            states = {}
            for r in servers:
                states.setdefault(r["name"].split("/")[0], set()).add(r.get("bstar"))
            if len(states) == shards and all(s == {"ACTIVE", "PASSIVE"}
                                             for s in states.values()):
                return [r["pid"] for r in servers if r.get("pid")]
        except Exception:  # noqa: BLE001 - the control plane may be starting: ask again
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every pair ACTIVE/PASSIVE within {DEADLINE_S} s")
        time.sleep(0.1)


def compactions_done(control: str, deadline_s: float = DEADLINE_S) -> dict:
    """Wait until no server is compacting its data directory, as the supervisor's status
    says (each server's stats, fresh every ``STATS_INTERVAL_S``): two fresh readings in a
    row with no compaction. Flat-out rounds leave the logs long, and the compactions they
    start would otherwise fall into the next fixed-rate window, whose tail would then be
    theirs. Returns ``idle_s`` (the wait), ``compacting_seen`` (servers seen compacting)
    and ``idle`` (False: still compacting at the deadline)."""
    from clonemap.supervisor.control import status_rows
    from clonemap.supervisor.services import STATS_INTERVAL_S

    t0 = time.monotonic()
    seen: set[str] = set()
    quiet = 0
    last_read = 0.0
    while time.monotonic() - t0 < deadline_s:
        rows, _ = status_rows(control, timeout_s=5.0)
        busy = {r["name"] for r in rows
                if ((r.get("stats") or {}).get("persist") or {}).get("compacting")}
        seen |= busy
        stalest = max((r.get("stats_age_s") or 0.0) for r in rows) if rows else 0.0
        fresh = time.monotonic() - stalest > last_read  # every server read since our last
        if busy:
            quiet = 0
        elif fresh:
            quiet += 1
            if quiet >= 2:
                return {"idle_s": round(time.monotonic() - t0, 3),
                        "compacting_seen": sorted(seen), "idle": True}
        last_read = time.monotonic()
        time.sleep(STATS_INTERVAL_S / 2)
    return {"idle_s": round(time.monotonic() - t0, 3), "compacting_seen": sorted(seen),
            "idle": False}


def run(args: argparse.Namespace) -> rec.Record:
    source = Path(args.config)
    if not source.is_absolute():
        source = ROOT / source
    with tempfile.TemporaryDirectory(prefix="clonemap-bench-cluster-") as tmp_dir:
        tmp = Path(tmp_dir)
        config, control, data = relocated_config(source, tmp, data_dir=tmp / "data")
        shards = len(data["shards"])
        sup = Target("supervisor", [sys.executable, "-m", "clonemap.supervisor", "start", str(config),
                                    "--no-table", "--run-dir", str(tmp / "run")],
                     ready="READY supervisor", timeout_s=DEADLINE_S)
        try:
            pids = settled_pids(control, shards)
            argv = ["--config", str(config), "--harness", "auto", "--seconds",
                    str(args.seconds), "--warmup", str(args.warmup), "--rounds",
                    str(args.rounds), "--results-dir", args.results_dir]
            if args.rates_of_max:
                argv += ["--rates-of-max", args.rates_of_max]
            if args.cores:
                argv += ["--cores", args.cores]
            largs = load.parse_args(argv)
            record = load.run(largs, name=NAME, server_pids=pids,
                              before_rate=lambda: compactions_done(control))
        finally:
            sup.stop(grace_s=15)
    record.data["config"]["cluster_config"] = args.config
    record.data["config"]["servers"] = len(pids)
    record.data["command"] = rec.command_line(f"bench.{NAME}", {
        k: v for k, v in vars(args).items() if k != "results_dir"})
    return record


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, load.report, argv)


if __name__ == "__main__":
    main()
