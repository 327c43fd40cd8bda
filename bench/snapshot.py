"""Snapshot join time and server memory per key, against a bare PUB->SUB carrying as much.

``python -m bench.snapshot [--keys 1000000] [--repeats 3] [--value-bytes 100] [--ceiling-s 2]``
(also ``python -m bench snapshot ...``)

First the same-run ceilings (``bench.harness.ceilings.measure_ceilings``, flat out, the same
value size): a bare pyzmq PUB->SUB and the bare forwarding loop. Then for each map size
(``--keys`` takes a comma-separated list, e.g. ``10000,100000,1000000``):

1. start a fresh shard server and read its resident memory (RSS) idle;
2. load N distinct keys (``/k%08d``, one KVSET each, N-byte... ``--value-bytes`` values)
   with one load-generator writer in ``flow`` mode (nothing is dropped on the way in),
   and wait - on an event, with a deadline - for the KVPUB of the last key, whose
   sequence must be N;
3. read the RSS again: memory per key = (RSS loaded - RSS idle) / N, and "beyond key
   and value" subtracts the average key + value length;
4. ``--warmup-snapshots`` untimed snapshots, then ``--repeats`` times, a new raw client
   (a DEALER) sends ``ICANHAZ?`` for the whole map and is timed from the request to
   KTHXBAI; the snapshot must be whole: N KVSYNCs, every key exactly once, every value the
   right size, KTHXBAI's sequence N and subtree empty. The RSS after the snapshots and the peak RSS (VmHWM) are recorded too.

Each size is a point: join time (median and spread over the repeats), memory per key
(one load per size: n=1), and ``ceiling_pubsub_s`` = N / the bare PUB->SUB's received
rate, the time a bare PUB->SUB needs to carry N messages of the same shape; the ratio
``join_to_pubsub`` = join time / that says what the snapshot path costs beyond the wire.

Duration on a 2-core host: smoke (``--keys 2000 --repeats 1``) ~6 s; quick
(``10000,100000``, 3 repeats) ~15 s; full (``10000,100000,1000000``, 3 repeats, 1 warm-up
snapshot each, ``--ceiling-s 3``) ~1.5 min on a quiet host, up to ~4 min with
``--quiet-wait-s 20`` on a busy one (loading 1M keys takes ~15 s, a 1M snapshot ~3 s).

Targets: 1,000,000 keys whole in < 5 s; < 400 bytes per key beyond key and value.
"""
from __future__ import annotations

import argparse
import os
import statistics
import struct
import time
from pathlib import Path

from bench.harness import record as rec
from bench.harness.traffic import KEY_FORMAT, WriterConfig, key_index, key_of, recv5
from bench.harness.fleet import LoadRun, config_dict
from bench.harness.procs import (bench_main, cpu_seconds, server_argv, start_on_free_ports,
                          wait_for_quiet)

NAME = "snapshot"
DURATION = ("Duration (2 cores): smoke (--keys 2000 --repeats 1) ~5 s; quick "
            "(--keys 10000,100000) ~15 s; full (--keys 10000,100000,1000000 --repeats 3) "
            "~1.5 min, up to ~4 min with --quiet-wait-s 20 on a busy host.")
TARGET_SNAPSHOT_S = 5.0
TARGET_KEYS_FOR_TIME = 1_000_000
TARGET_BYTES_PER_KEY = 400.0
HEARTBEAT_S = 0.2
LOAD_RATE_FLOOR_PER_S = 5_000
"""Loading deadline: N / this + 30 s."""
IDLE_S = 30.0
"""A snapshot fails if no frame arrives for this long."""
DEALER_RCVHWM = 100_000
"""As the client library's DEALER: bounded, so the server's flow control (ROUTER_MANDATORY,
its own SNDHWM) is what keeps a million-key snapshot whole."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="snapshot join time and memory per key, against "
                                             "a bare PUB->SUB carrying N messages",
                                 epilog=DURATION)
    ap.add_argument("--keys", default="1000000",
                    help="map size, or a comma-separated list of sizes")
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="snapshots timed per size")
    ap.add_argument("--warmup-snapshots", type=int, default=1,
                    help="untimed snapshots per size before the timed ones")
    ap.add_argument("--ceiling-s", type=float, default=2.0,
                    help="measured window of each same-run ceiling (PUB->SUB, forwarder)")
    ap.add_argument("--quiet-wait-s", type=float, default=0.0,
                    help="before each timed snapshot, wait up to this long for the host's "
                         "busy CPU to fall to --quiet-pct (0: do not wait)")
    ap.add_argument("--quiet-pct", type=float, default=60.0,
                    help="host busy CPU (percent of one core) that counts as quiet")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    try:
        args.sizes = [int(x.replace("_", "")) for x in str(args.keys).split(",") if x]
    except ValueError:
        ap.error(f"--keys: {args.keys!r} is not a list of integers")
    if not args.sizes or min(args.sizes) < 1:
        ap.error("--keys: sizes must be >= 1")
    if args.repeats < 1 or args.warmup_snapshots < 0 or args.ceiling_s <= 0:
        ap.error("--repeats >= 1, --warmup-snapshots >= 0, --ceiling-s > 0")
    if args.value_bytes < 1:
        ap.error("--value-bytes must be >= 1")
    return args


def canonical_command(args: argparse.Namespace) -> str:
    opts = {"keys": args.keys, "value_bytes": args.value_bytes, "repeats": args.repeats,
            "warmup_snapshots": args.warmup_snapshots, "ceiling_s": args.ceiling_s}
    if args.quiet_wait_s > 0:
        opts.update(quiet_wait_s=args.quiet_wait_s, quiet_pct=args.quiet_pct)
    return rec.command_line(f"bench.{NAME}", opts)


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def peak_rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _wait_for_update(sub, key: bytes, deadline_s: float, zmq) -> int:
    """Wait for the KVPUB of ``key`` (the socket is subscribed to it and to HUGZ);
    returns its sequence (0 for a HUGZ)."""
    deadline = time.monotonic() + deadline_s
    while (remaining := deadline - time.monotonic()) > 0:
        if not sub.poll(min(remaining, 1.0) * 1000):
            continue
        frames = sub.recv_multipart()
        if len(frames) == 5 and frames[0] == key:
            return struct.unpack(">Q", frames[1])[0]
        if len(frames) == 5 and frames[0] == b"HUGZ" and key == b"HUGZ":
            return 0
    raise TimeoutError(f"no update for {key!r} within {deadline_s:g} s")


def take_snapshot(ctx, endpoint: str, n: int, value_bytes: int, zmq) -> dict:
    """One whole-map snapshot through a new DEALER, timed and checked."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvhwm = DEALER_RCVHWM
    dealer.rcvtimeo = int(IDLE_S * 1000)
    keys: list[bytes] = []
    append = keys.append
    bad_values = 0
    try:
        dealer.connect(endpoint)
        t0 = time.perf_counter()
        dealer.send_multipart([b"ICANHAZ?", b""])
        first_s = None
        while True:
            try:
                key, seq, f2, f3, value = recv5(dealer, 0)
            except zmq.Again:
                raise TimeoutError(f"snapshot: nothing for {IDLE_S:g} s after {len(keys)} "
                                   "KVSYNCs") from None
            if key == b"KTHXBAI":
                t1 = time.perf_counter()
                break
            if first_s is None:
                first_s = time.perf_counter() - t0
            append(key)
            if len(value) != value_bytes:
                bad_values += 1
        trailing = dealer.get(zmq.RCVMORE)
    finally:
        dealer.close(0)
    seen = bytearray(n)
    dupes = foreign = 0
    for k in keys:
        try:
            i = key_index(k)
        except ValueError:
            foreign += 1
            continue
        if 0 <= i < n and key_of(i) == k:
            if seen[i]:
                dupes += 1
            seen[i] = 1
        else:
            foreign += 1
    missing = n - sum(seen)
    kthxbai_seq = struct.unpack(">Q", seq)[0] if len(seq) == 8 else -1
    whole = (len(keys) == n and missing == 0 and dupes == 0 and foreign == 0
             and bad_values == 0 and kthxbai_seq == n and value == b"" and not trailing)
    return {"seconds": round(t1 - t0, 4), "first_kvsync_s": round(first_s or 0.0, 4),
            "kvsync": len(keys), "keys_per_s": round(len(keys) / (t1 - t0), 1),
            "missing": missing, "duplicates": dupes, "foreign_keys": foreign,
            "bad_values": bad_values, "kthxbai_seq": kthxbai_seq,
            "kthxbai_subtree": value.decode("utf-8", "replace"), "whole": whole}


def _cpu_pct(cpu0: dict, cpu1: dict, pids: list[int], seconds: float) -> dict:
    pct = {name: round(100 * (cpu1[pid] - cpu0[pid]) / seconds, 1)
           for name, pid in zip(("server", "client"), pids)}
    pct["host"] = round(100 * (cpu1["host_busy"] - cpu0["host_busy"]) / seconds, 1)
    pct["others"] = round(max(0.0, pct["host"] - pct["server"] - pct["client"]), 1)
    return pct


def run_size(n: int, args: argparse.Namespace, progress: rec.Progress) -> dict:
    import zmq

    last_key = key_of(n - 1)
    avg_kv = len(last_key) + args.value_bytes  # every key has the same length up to 1e8
    target, base = start_on_free_ports(
        "server", lambda b: server_argv(b, extra=("--heartbeat-s", str(HEARTBEAT_S))))
    argv = target.argv
    ctx = zmq.Context()
    try:
        with target as server:
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
            sub.setsockopt(zmq.SUBSCRIBE, last_key)
            sub.connect(f"tcp://127.0.0.1:{base + 1}")
            _wait_for_update(sub, b"HUGZ", 10 * HEARTBEAT_S + 10, zmq)  # subscribed
            rss_idle = rss_bytes(server.pid)
            writer = WriterConfig(collector=f"tcp://127.0.0.1:{base + 2}", keys=n,
                                  value_bytes=args.value_bytes, distribution="sequential",
                                  mode="flow", count=n, tail_s=0.0)
            load_deadline_s = n / LOAD_RATE_FLOOR_PER_S + 30
            progress.step(f"{n:,} keys: loading")
            t_load = time.perf_counter()
            with LoadRun([writer], []) as load:
                window = load.start(0.0, load_deadline_s)
                wrote = load.collect(window).writers[0]
            last_seq = _wait_for_update(sub, last_key, load_deadline_s, zmq)
            load_s = time.perf_counter() - t_load
            sub.close(0)
            rss_loaded = rss_bytes(server.pid)
            progress.note(f"loaded {n:,} keys in {load_s:.1f} s (last sequence {last_seq}); "
                          f"RSS {rss_idle / 2**20:.1f} -> {rss_loaded / 2**20:.1f} MiB")
            snaps = []
            pids = [server.pid, os.getpid()]
            for i in range(args.warmup_snapshots + args.repeats):
                warm = i < args.warmup_snapshots
                progress.step(f"{n:,} keys: " + (f"warm-up snapshot {i + 1}" if warm else
                              f"snapshot {i + 1 - args.warmup_snapshots}/{args.repeats}"))
                quiet = None
                if args.quiet_wait_s > 0 and not warm:
                    quiet = wait_for_quiet(args.quiet_pct, args.quiet_wait_s)
                cpu0 = cpu_seconds(pids)
                snap = take_snapshot(ctx, f"tcp://127.0.0.1:{base}", n, args.value_bytes, zmq)
                cpu1 = cpu_seconds(pids)
                snap["cpu_pct"] = _cpu_pct(cpu0, cpu1, pids, snap["seconds"])
                snap["host_before"] = quiet
                snap["warmup"] = warm
                progress.note(f"{snap['kvsync']:,} KVSYNC in {snap['seconds']:.3f} s, "
                              f"whole={snap['whole']}, cpu% {snap['cpu_pct']}"
                              + (f", host before {quiet}" if quiet else ""))
                snaps.append(snap)
            rss_after = rss_bytes(server.pid)
            peak = peak_rss_bytes(server.pid)
            if not server.alive():
                raise RuntimeError(f"server exited: {server.stderr_tail()}")
    finally:
        ctx.destroy(linger=0)
    per_key = (rss_loaded - rss_idle) / n
    timed = [s for s in snaps if not s["warmup"]]
    times = [s["seconds"] for s in timed]
    return {
        "keys": n, "value_bytes": args.value_bytes, "key_bytes": len(last_key),
        "target_command": " ".join(argv[1:]),
        "load": {"seconds": round(load_s, 3), "updates_per_s": round(n / load_s, 1),
                 "sent": wrote["sent_total"], "last_seq": last_seq},
        "rss_idle_bytes": rss_idle, "rss_loaded_bytes": rss_loaded,
        "rss_after_snapshots_bytes": rss_after, "peak_rss_bytes": peak,
        "bytes_per_key": round(per_key, 1),
        "bytes_per_key_beyond_kv": round(per_key - avg_kv, 1),
        "snapshots": snaps,
        "snapshot_s": {"median": round(statistics.median(times), 4), "min": min(times),
                       "max": max(times)},
        "all_whole": all(s["whole"] for s in snaps) and last_seq == n,
    }


def point(r: dict, ceilings: dict) -> dict:
    """One map size for the report: join time and memory, against the bare ceilings."""
    n = r["keys"]
    join = rec.spread([s["seconds"] for s in r["snapshots"] if not s["warmup"]], digits=4)
    out = {"keys": n, "join_s": join, "bytes_per_key": rec.spread([r["bytes_per_key"]]),
           "bytes_per_key_beyond_kv": r["bytes_per_key_beyond_kv"], "whole": r["all_whole"]}
    for kind in ("pubsub", "forwarder"):
        rate = ceilings.get(kind, {}).get("received_per_s") or 0.0
        ceiling_s = n / rate if rate > 0 else None
        out[f"ceiling_{kind}_s"] = round(ceiling_s, 4) if ceiling_s else None
        out[f"join_to_{kind}"] = round(join["median"] / ceiling_s, 2) if ceiling_s else None
    return out


def run(args: argparse.Namespace) -> rec.Record:
    from bench.harness.ceilings import measure_ceilings

    config = {"sizes": args.sizes, "value_bytes": args.value_bytes, "repeats": args.repeats,
              "warmup_snapshots": args.warmup_snapshots, "ceiling_s": args.ceiling_s,
              "key_format": KEY_FORMAT, "server_heartbeat_s": HEARTBEAT_S,
              "writer": config_dict(WriterConfig(collector="tcp://127.0.0.1:P+2",
                                                 distribution="sequential", mode="flow"))}
    record = rec.Record(NAME, canonical_command(args), config)
    steps = 2 + len(args.sizes) * (1 + args.warmup_snapshots + args.repeats)
    with rec.Progress(NAME, steps) as progress:
        ceilings = measure_ceilings(seconds=args.ceiling_s, warmup=min(1.0, args.ceiling_s / 2),
                                    keys=max(args.sizes), value_bytes=args.value_bytes,
                                    kinds=("pubsub", "forwarder"), progress=progress)
        for n in args.sizes:
            record.add_run(run_size(n, args, progress))
        progress.finish_step()
    runs = record.data["runs"]
    summary = {str(r["keys"]): {"snapshot_s_median": r["snapshot_s"]["median"],
                                "bytes_per_key_beyond_kv": r["bytes_per_key_beyond_kv"],
                                "whole": r["all_whole"]} for r in runs}
    summary["points"] = [point(r, ceilings) for r in runs]
    summary["ceilings"] = ceilings
    record.data["summary"] = summary
    for r in runs:
        if r["keys"] >= TARGET_KEYS_FOR_TIME:
            record.target(f"{r['keys']:,}-key snapshot, whole (median s)",
                          r["snapshot_s"]["median"] if r["all_whole"] else float("inf"),
                          TARGET_SNAPSHOT_S, "s", higher_is_better=False)
    biggest = max(runs, key=lambda r: r["keys"])
    record.target(f"memory beyond key+value at {biggest['keys']:,} keys",
                  biggest["bytes_per_key_beyond_kv"], TARGET_BYTES_PER_KEY, "bytes/key",
                  higher_is_better=False)
    record.finish()
    return record


def report(record: rec.Record) -> None:
    rows = []
    points = {p["keys"]: p for p in record.data["summary"]["points"]}
    for r in record.data["runs"]:
        s, p = r["snapshot_s"], points[r["keys"]]
        rows.append([r["keys"], r["load"]["updates_per_s"], s["median"], s["min"], s["max"],
                     round(r["keys"] / s["median"]), p["ceiling_pubsub_s"],
                     p["join_to_pubsub"], "yes" if r["all_whole"] else "NO",
                     round(r["rss_idle_bytes"] / 2**20, 1), round(r["rss_loaded_bytes"] / 2**20, 1),
                     r["bytes_per_key"], r["bytes_per_key_beyond_kv"]])
    c = record.data["summary"]["ceilings"]
    rec.table(record, f"{NAME}: join time and memory", [
        "keys", "load upd/s", "snapshot s (median)", "min s", "max s", "keys/s",
        "PUB->SUB s for N", "snapshot / PUB->SUB", "whole", "RSS idle MiB", "RSS loaded MiB",
        "bytes/key", "beyond k+v"], rows,
        caption=f"same-run ceilings (flat out, {record.data['config']['value_bytes']}-byte "
                f"values): bare PUB->SUB {c['pubsub']['received_per_s']:,.0f}/s, bare "
                f"forwarding loop {c['forwarder']['received_per_s']:,.0f}/s. PUB->SUB s for N "
                "= N / the PUB->SUB rate: the time the bare live path (a writer process "
                "-> a SUB process) needs for N messages of this shape; below 1, the "
                "snapshot (one ROUTER -> DEALER stream from a ready map) is faster.")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
