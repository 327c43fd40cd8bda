"""Durability: what persisting costs, measured against memory-only in the same run
(``python -m bench durability``).

Three parts, each against fresh ``python -m clonemap.shards`` processes fed by the load harness
(bench/harness/offer.py: one writer flat out, one subscriber):

1. **Throughput and CPU per update**, per round, in this order: memory only, then
   ``--data-dir`` with ``--fsync everysec``, ``always`` and ``no`` (a fresh directory
   each). Reported: the subscriber's received updates/s, the server's CPU per sequenced
   update (us), and each policy's ratio to the memory-only run of the same round. Target:
   everysec >= 0.85 of memory-only (median of the per-round ratios).
2. **p99 latency with compaction running**: an open-loop fixed rate (``--rate``, per
   writer) with everysec twice: compaction off (a threshold the run never reaches) and
   compaction continuous (``--compact-min-bytes 1 MiB --compact-ratio 0.05``: a new
   snapshot of the whole map as soon as the last one is done). Target: p99 with
   compaction <= 1.5 x without (median over rounds of the per-round ratio).
3. **Recovery and disk**: ``--recovery-keys`` keys of ``--value-bytes`` written to a
   data directory (one record per 512 updates, as a busy server batches), then loaded
   by ``clonemap.shards.persist.recover`` in a fresh process, from the log alone and from the
   snapshot a compaction wrote. Reported: seconds and bytes per key for each form.
   Target: < 3 s from the snapshot for 1,000,000 keys of 100 B.
4. **The storage choice**: the same ``--recovery-keys`` updates, batched 512 per
   transaction, into our log and into SQLite in WAL mode (``synchronous=NORMAL``, one
   ``INSERT OR REPLACE`` per update, the stdlib module), both without fsync between
   batches; then each loaded into a dict in a fresh process. Reported: us per update
   written and seconds to load, same run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import record as rec
from bench.harness.offer import Offer, Targets, run_offer
from bench.harness.procs import bench_main

NAME = "durability"
POLICIES = ("memory", "everysec", "always", "no")
TARGET_EVERYSEC_RATIO = 0.85
TARGET_P99_RATIO = 1.5
TARGET_RECOVERY_S = 3.0
NO_COMPACTION = str(1 << 40)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="persisting vs memory only: throughput, CPU per "
                                             "update, p99 under compaction, recovery time "
                                             "and disk bytes per key. Duration: smoke ~25 s, "
                                             "quick ~2 min, full ~5 min")
    ap.add_argument("--seconds", type=float, default=4.0, help="measured window per run")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", type=int, default=100_000, help="key space of the load")
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--rate", type=float, default=20_000,
                    help="part 2: updates/s offered (open loop)")
    ap.add_argument("--recovery-keys", type=int, default=1_000_000)
    ap.add_argument("--skip", choices=("throughput", "compaction", "recovery", "storage"),
                    action="append", default=[])
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.recovery_keys < 1:
        ap.error("--seconds must be > 0, --rounds and --recovery-keys >= 1")
    return args


def server_args(policy: str, data_dir: Path, compaction: bool = False) -> tuple[str, ...]:
    if policy == "memory":
        return ()
    extra = ("--data-dir", str(data_dir), "--fsync", policy)
    if compaction:
        return extra + ("--compact-min-bytes", str(1 << 20), "--compact-ratio", "0.05")
    return extra + ("--compact-min-bytes", NO_COMPACTION)


def one_run(policy: str, offer: Offer, args, progress, compaction=None) -> dict:
    with tempfile.TemporaryDirectory(prefix="clonemap-bench-") as scratch:
        data_dir = Path(scratch) / "data"
        extra = server_args(policy, data_dir, bool(compaction))
        with Targets("server", offer=offer, extra=extra) as targets:
            figures = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                                progress=progress)
        disk = sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file()) \
            if data_dir.exists() else 0
    cpu = figures["cpu_pct"]["targets"]
    seq = figures["sequenced_per_s"]
    return {"policy": policy, "compaction": compaction,
            "received_per_s": figures["received_per_s"], "sequenced_per_s": seq,
            "sent_per_s": figures["sent_per_s"], "loss_window": figures["loss_window"],
            "server_cpu_pct": cpu,
            "cpu_us_per_update": round(cpu / 100 / seq * 1e6, 2) if seq else None,
            "latency_ms": figures["latency_ms"], "disk_bytes_after": disk,
            "others_cpu_pct": figures["cpu_pct"]["others"]}


def throughput(record, args, progress) -> None:
    offer = Offer(keys=args.keys, value_bytes=args.value_bytes)
    for r in range(args.rounds):
        for policy in POLICIES:
            progress.step(f"round {r + 1}/{args.rounds}: {policy} flat out")
            run = one_run(policy, offer, args, progress)
            run.update(part="throughput", round=r + 1)
            progress.note(f"{policy}: {run['received_per_s']:,.0f}/s, "
                          f"{run['cpu_us_per_update']} us CPU/update")
            record.add_run(run)


def compaction(record, args, progress) -> None:
    offer = Offer(keys=args.keys, value_bytes=args.value_bytes, rate_per_s=args.rate,
                  latency_every=8)
    for r in range(args.rounds):
        for on in (False, True):
            progress.step(f"round {r + 1}/{args.rounds}: everysec at {args.rate:,.0f}/s, "
                          f"compaction {'continuous' if on else 'off'}")
            run = one_run("everysec", offer, args, progress, compaction=on)
            run.update(part="compaction", round=r + 1)
            progress.note(f"p99 {run['latency_ms'].get('p99')} ms")
            record.add_run(run)


RECOVERY_CHILD = """
import json, sys, time
from clonemap.shards.persist import recover
t0 = time.perf_counter()
got = recover(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t0, "keys": len(got.store),
                  "seq": got.store.seq}))
"""


def recovery(record, args, progress) -> None:
    from clonemap.shards.persist import DataDir
    from clonemap.shards.store import Store

    with tempfile.TemporaryDirectory(prefix="clonemap-bench-") as scratch:
        path = Path(scratch) / "data"
        progress.step(f"recovery: writing {args.recovery_keys:,} keys")
        store, writer = Store(), DataDir(path, "no", compact_min_bytes=1 << 40)
        writer.open("0123456789abcdef", 0)
        value = b"v" * args.value_bytes
        for i in range(args.recovery_keys):
            key = b"/bench/%012d" % i
            writer.append(store.apply(key, value), key, value, None)
            if i % 512 == 511:
                writer.flush()
        writer.flush()
        for form in ("log", "snapshot"):
            if form == "snapshot":
                job = writer.start_compaction(store)
                while not job.step(8192):
                    pass
                job.finish()
                writer.compacted(job)
                writer.flush()
            disk = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
            progress.step(f"recovery: loading {args.recovery_keys:,} keys from the {form}")
            copy = Path(scratch) / f"copy-{form}"
            shutil.copytree(path, copy)
            out = subprocess.run([sys.executable, "-c", RECOVERY_CHILD, str(copy)],
                                 capture_output=True, text=True, timeout=600, check=True)
            got = json.loads(out.stdout)
            assert got["keys"] == args.recovery_keys, got
            record.add_run({"part": "recovery", "form": form, "keys": got["keys"],
                            "value_bytes": args.value_bytes,
                            "seconds": round(got["seconds"], 3), "disk_bytes": disk,
                            "bytes_per_key": round(disk / args.recovery_keys, 1)})
            progress.note(f"{form}: {got['seconds']:.2f} s, "
                          f"{disk / args.recovery_keys:.1f} B/key on disk")
        writer.close()


SQLITE_LOAD_CHILD = """
import json, sqlite3, sys, time
t0 = time.perf_counter()
db = sqlite3.connect(sys.argv[1])
data = dict(db.execute("SELECT k, v FROM kv"))
print(json.dumps({"seconds": time.perf_counter() - t0, "keys": len(data)}))
"""
BATCH = 512


def storage(record, args, progress) -> None:
    """Our segment log against SQLite (WAL) for the same updates, same run."""
    import sqlite3

    from clonemap.shards.persist import DataDir
    from clonemap.shards.store import Store

    n, value = args.recovery_keys, b"v" * args.value_bytes
    keys = [b"/bench/%012d" % i for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="clonemap-bench-") as scratch:
        progress.step(f"storage: {n:,} updates into the log")
        path = Path(scratch) / "log"
        store, writer = Store(), DataDir(path, "no", compact_min_bytes=1 << 40)
        writer.open("0123456789abcdef", 0)
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            writer.append(store.apply(key, value), key, value, None)
            if i % BATCH == BATCH - 1:
                writer.flush()
        writer.flush()
        log_s = time.perf_counter() - t0
        writer.close()
        log_load = json.loads(subprocess.run(
            [sys.executable, "-c", RECOVERY_CHILD, str(path)], capture_output=True,
            text=True, timeout=600, check=True).stdout)
        progress.step(f"storage: {n:,} updates into SQLite (WAL)")
        db_path = Path(scratch) / "kv.sqlite"
        db = sqlite3.connect(db_path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE kv (k BLOB PRIMARY KEY, v BLOB, seq INTEGER, expires REAL)")
        t0 = time.perf_counter()
        for start in range(0, n, BATCH):
            db.execute("BEGIN")
            db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, NULL)",
                           [(k, value, start + j + 1)
                            for j, k in enumerate(keys[start:start + BATCH])])
            db.execute("COMMIT")
        sqlite_s = time.perf_counter() - t0
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
        sqlite_load = json.loads(subprocess.run(
            [sys.executable, "-c", SQLITE_LOAD_CHILD, str(db_path)], capture_output=True,
            text=True, timeout=600, check=True).stdout)
        sqlite_disk = sum(p.stat().st_size for p in Path(scratch).glob("kv.sqlite*"))
        log_disk = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    for name, write_s, load, disk in (("log", log_s, log_load, log_disk),
                                      ("sqlite-wal", sqlite_s, sqlite_load, sqlite_disk)):
        record.add_run({"part": "storage", "store": name, "updates": n,
                        "us_per_update": round(write_s / n * 1e6, 2),
                        "load_s": round(load["seconds"], 3), "disk_bytes": disk,
                        "bytes_per_key": round(disk / n, 1)})
        progress.note(f"{name}: {write_s / n * 1e6:.2f} us/update, load "
                      f"{load['seconds']:.2f} s")


def run(args: argparse.Namespace) -> rec.Record:
    config = {k: v for k, v in vars(args).items()
              if k != "results_dir" and not (k == "skip" and not v)}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    steps = ((0 if "throughput" in args.skip else args.rounds * len(POLICIES))
             + (0 if "compaction" in args.skip else 2 * args.rounds)
             + (0 if "recovery" in args.skip else 3)
             + (0 if "storage" in args.skip else 2))
    with rec.Progress(NAME, total=steps) as progress:
        if "throughput" not in args.skip:
            throughput(record, args, progress)
        if "compaction" not in args.skip:
            compaction(record, args, progress)
        if "recovery" not in args.skip:
            recovery(record, args, progress)
        if "storage" not in args.skip:
            storage(record, args, progress)
        progress.finish_step()
    summarize(record)
    record.finish()
    return record


def _ratios(runs, part, key, num, den, by="policy"):
    return rec.ratios_per_round([x for x in runs if x["part"] == part], key, num, den, by)


def summarize(record: rec.Record) -> None:
    runs = record.data["runs"]
    summary: dict = {}
    tp = [r for r in runs if r["part"] == "throughput"]
    if tp:
        summary["received_per_s"] = {p: rec.spread([r["received_per_s"] for r in tp
                                                    if r["policy"] == p]) for p in POLICIES}
        summary["cpu_us_per_update"] = {p: rec.spread([r["cpu_us_per_update"] for r in tp
                                                       if r["policy"] == p
                                                       and r["cpu_us_per_update"]], 2)
                                        for p in POLICIES}
        per_round = {p: _ratios(runs, "throughput", lambda x: x["received_per_s"], p,
                                "memory") for p in POLICIES[1:]}
        for p, values in per_round.items():
            summary[f"{p}_ratio_to_memory_per_round"] = values
        ratio = statistics.median(per_round["everysec"] or [0.0])
        record.target("everysec / memory-only updates/s (median per round)", ratio,
                      TARGET_EVERYSEC_RATIO, "ratio")
    comp = [r for r in runs if r["part"] == "compaction"]
    if comp:
        for r in comp:
            r["mode"] = "on" if r["compaction"] else "off"
        p99 = _ratios(runs, "compaction", lambda x: x["latency_ms"].get("p99"), "on", "off",
                      by="mode")
        summary["compaction_p99_ratio"] = p99
        record.target("p99 with compaction / without (median per round)",
                      statistics.median(p99 or [float("inf")]), TARGET_P99_RATIO, "ratio",
                      higher_is_better=False)
    st = {r["store"]: r for r in runs if r["part"] == "storage"}
    if st:
        summary["storage"] = st
    rv = {r["form"]: r for r in runs if r["part"] == "recovery"}
    if rv:
        summary["recovery"] = rv
        if "snapshot" in rv:
            record.target(f"recovery of {rv['snapshot']['keys']:,} keys from the snapshot",
                          rv["snapshot"]["seconds"], TARGET_RECOVERY_S, "s",
                          higher_is_better=False)
    record.data["summary"] = summary


def report(record: rec.Record) -> None:
    runs = record.data["runs"]
    rows = [[r["round"], r["policy"], r["received_per_s"], r["cpu_us_per_update"],
             r["server_cpu_pct"], r["latency_ms"].get("p50", "-"),
             r["latency_ms"].get("p99", "-"), r["loss_window"], r["others_cpu_pct"]]
            for r in runs if r["part"] == "throughput"]
    if rows:
        s = record.data["summary"]
        rec.table(record, f"{NAME}: flat out, per policy (one writer, one subscriber)",
                  ["round", "policy", "received/s", "CPU us/update", "server cpu%",
                   "p50 ms", "p99 ms", "lost", "others cpu%"], rows,
                  caption="ratios to memory-only per round: " + "; ".join(
                      f"{p} {s[f'{p}_ratio_to_memory_per_round']}" for p in POLICIES[1:]))
    rows = [[r["round"], r["mode"], r["received_per_s"], r["latency_ms"].get("p50", "-"),
             r["latency_ms"].get("p99", "-"), r["latency_ms"].get("max", "-"),
             r["disk_bytes_after"]] for r in runs if r["part"] == "compaction"]
    if rows:
        rec.table(record, f"{NAME}: everysec at a fixed rate, compaction off / continuous",
                  ["round", "compaction", "received/s", "p50 ms", "p99 ms", "max ms",
                   "disk bytes after"], rows,
                  caption=f"p99 ratio on/off per round: "
                          f"{record.data['summary'].get('compaction_p99_ratio')}")
    rows = [[r["form"], r["keys"], r["value_bytes"], r["seconds"], r["disk_bytes"],
             r["bytes_per_key"]] for r in runs if r["part"] == "recovery"]
    if rows:
        rec.table(record, f"{NAME}: recovery (shards.persist.recover in a fresh process)",
                  ["from", "keys", "value B", "seconds", "disk bytes", "bytes/key"], rows)
    rows = [[r["store"], r["updates"], r["us_per_update"], r["load_s"], r["disk_bytes"],
             r["bytes_per_key"]] for r in runs if r["part"] == "storage"]
    if rows:
        rec.table(record, f"{NAME}: the storage choice, same updates, same run",
                  ["store", "updates", "us/update written", "load s", "disk bytes",
                   "bytes/key"], rows,
                  caption=f"batches of {BATCH} updates; no fsync between batches")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
