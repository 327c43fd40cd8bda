"""A reader's get latency while its client applies a burst of updates (issue 44):
``python -m bench read_burst``.

One standalone shard server (no data directory) holds a map of ``--keys`` keys of
``--value-bytes`` bytes, loaded once. In this process a ``Clone`` (``bytes`` codec)
follows it, and a reader thread reads random keys of the map as fast as it can, timing
every read with ``time.perf_counter_ns`` (the timer's own ~0.1 us is in every figure).
Per round, for each mode (``get``: ``Clone.get``; ``dict``: a plain dict of the same keys
in the same process, the floor, while the same client applies the same updates):

1. **idle**: ``--idle-s`` with no writes;
2. **burst**: a writer process (``bench.harness.traffic``'s, flow mode) sends
   ``--burst`` updates to random keys of the map as fast as it can; the window ends when
   the client's map holds the burst's last update.

Reported per window: reads, reads/s, read latency p50 / p99 / p99.9 / max (µs), and
for a burst how long the client took to apply it. A read that waits while the client's
loop thread applies a batch of the burst shows here: the question the issue asks is
whether a get is held up by the updates (the GIL, a lock), and by how much more than a
plain dict read in the same process is.
"""
from __future__ import annotations

import argparse
import array
import random
import statistics
import threading
import time

from bench.harness import record as rec
from bench.harness.fleet import LoadRun
from bench.harness.procs import bench_main, server_argv, start_on_free_ports
from bench.harness.stats import percentile
from bench.harness.traffic import WriterConfig, key_of

NAME = "read_burst"
MODES = ("get", "dict")
MAX_SAMPLES = 30_000_000
"""Reads timed per window at most (8 bytes each)."""
APPLY_TIMEOUT_S = 60.0
TARGET_BURST_RATIO = 1.5
"""Our goal (issue 44 asks for the figure): during a burst, a get's p99 at most 1.5x a
plain dict read's in the same process (the GIL and the host are the floor's too)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="get latency while the client applies a "
                                             "burst of updates, against a plain dict in "
                                             "the same process. Duration: smoke ~10 s, "
                                             "full (3 rounds) ~40 s")
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--burst", type=int, default=100_000, help="updates in each burst")
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.keys < 1 or args.burst < 1 or args.idle_s <= 0 or args.rounds < 1:
        ap.error("--keys, --burst and --rounds >= 1, --idle-s > 0")
    return args


class Reader:
    """A thread that reads random keys through ``get`` and times each read."""

    def __init__(self, keys: list[str]):
        rnd = random.Random(3)
        self.picks = [keys[rnd.randrange(len(keys))] for _ in range(1 << 16)]
        self.get = None
        self.samples = array.array("q")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, get) -> None:
        self.get, self.samples = get, array.array("q")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        get, picks, out = self.get, self.picks, self.samples
        clock, add, stopped = time.perf_counter_ns, out.append, self._stop.is_set
        mask, i = (1 << 16) - 1, 0
        while not stopped() and len(out) < MAX_SAMPLES:
            for _ in range(64):
                key = picks[i & mask]
                i += 1
                t0 = clock()
                get(key)
                add(clock() - t0)

    def stop(self) -> array.array:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        return self.samples


def figures(samples: array.array, seconds: float) -> dict:
    ordered = sorted(samples)
    us = lambda ns: round(ns / 1000, 3) if ns is not None else None  # noqa: E731
    return {"reads": len(ordered), "reads_per_s": round(len(ordered) / seconds)
            if seconds > 0 else None,
            "p50_us": us(percentile(ordered, 50)), "p99_us": us(percentile(ordered, 99)),
            "p999_us": us(percentile(ordered, 99.9)),
            "max_us": us(ordered[-1] if ordered else None)}


def _applied(clone) -> int:
    return sum(clone.version_vector.values())


def burst_window(clone, reader: Reader, get, port: int, args, seed: int) -> dict:
    """The reader reads while a writer sends ``--burst`` updates; until the client has
    applied the last one (its sequence moved by as many as the server sequenced)."""
    before = _applied(clone)
    cfg = WriterConfig(collector=f"tcp://127.0.0.1:{port + 2}", keys=args.keys,
                       value_bytes=args.value_bytes, mode="flow", count=args.burst,
                       tail_s=0.0, seed=seed)
    with LoadRun([cfg], []) as load:
        reader.start(get)
        t0 = time.monotonic()
        window = load.start(0.0, APPLY_TIMEOUT_S)
        sent = load.collect(window, APPLY_TIMEOUT_S).writers[0]["sent_total"]
    deadline = time.monotonic() + APPLY_TIMEOUT_S
    while _applied(clone) < before + sent and time.monotonic() < deadline:
        time.sleep(0.001)
    applied_s = time.monotonic() - t0
    samples = reader.stop()
    return {"window": "burst", "sent": sent, "applied": _applied(clone) - before,
            "burst_applied_s": round(applied_s, 3), **figures(samples, applied_s)}


def idle_window(reader: Reader, get, args) -> dict:
    reader.start(get)
    t0 = time.monotonic()
    time.sleep(args.idle_s)
    samples = reader.stop()
    return {"window": "idle", **figures(samples, time.monotonic() - t0)}


def run(args: argparse.Namespace) -> rec.Record:
    from clonemap.client.api import Clone

    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    keys = [key_of(i).decode() for i in range(args.keys)]
    target, port = start_on_free_ports("server", lambda b: server_argv(
        b, extra=("--log-level", "warning")))
    with target, rec.Progress(NAME, args.rounds * len(MODES) * 2 + 1) as progress:
        progress.step(f"loading {args.keys:,} keys")
        with Clone(f"tcp://127.0.0.1:{port}", codec="bytes", timeout_s=60) as clone:
            value = b"v" * args.value_bytes
            for key in keys:
                clone.set(key, value)
            clone.set(keys[-1], value, wait=True, timeout_s=60)
            reader = Reader(keys)
            for r in range(args.rounds):
                for mode in MODES:
                    get = clone.get if mode == "get" else dict(clone.items()).get
                    progress.step(f"round {r + 1}/{args.rounds}: {mode}, idle")
                    idle = idle_window(reader, get, args)
                    progress.step(f"round {r + 1}/{args.rounds}: {mode}, a burst of "
                                  f"{args.burst:,}")
                    burst = burst_window(clone, reader, get, port, args, seed=r * 2 + 1)
                    for row in (idle, burst):
                        row.update(round=r + 1, mode=mode)
                        record.add_run(row)
                    progress.note(f"{mode}: idle p99 {idle['p99_us']} us, burst p99 "
                                  f"{burst['p99_us']} us, max {burst['max_us']} us "
                                  f"({burst['burst_applied_s']} s to apply)")
        progress.finish_step()
    summarize(record)
    record.finish()
    return record


def summarize(record: rec.Record) -> None:
    runs = record.data["runs"]

    def pick(mode, window, key):
        return [r[key] for r in runs if r["mode"] == mode and r["window"] == window
                and r[key] is not None]

    summary = {f"{mode}_{window}": {key: rec.spread(pick(mode, window, key), 3)
                                    for key in ("reads_per_s", "p50_us", "p99_us",
                                                "p999_us", "max_us")}
               for mode in MODES for window in ("idle", "burst")}
    ratios = []
    for r in sorted({run["round"] for run in runs}):
        get = [x["p99_us"] for x in runs if x["round"] == r and x["mode"] == "get"
               and x["window"] == "burst"]
        floor = [x["p99_us"] for x in runs if x["round"] == r and x["mode"] == "dict"
                 and x["window"] == "burst"]
        if get and floor and floor[0]:
            ratios.append(round(get[0] / floor[0], 3))
    summary["burst_p99_get_to_dict_per_round"] = ratios
    summary["burst_p99_get_to_dict_median"] = (round(statistics.median(ratios), 3)
                                               if ratios else None)
    record.data["summary"] = summary
    record.target("get / dict read p99 during a burst (median per round; our goal)",
                  summary["burst_p99_get_to_dict_median"] or 0.0, TARGET_BURST_RATIO,
                  "ratio", higher_is_better=False)


def report(record: rec.Record) -> None:
    rows = [[r["round"], r["mode"], r["window"], r["reads"], r["reads_per_s"], r["p50_us"],
             r["p99_us"], r["p999_us"], r["max_us"], r.get("burst_applied_s", "-")]
            for r in record.data["runs"]]
    cfg = record.data["config"]
    s = record.data["summary"]
    rec.table(record, f"{NAME}: reads of a {cfg['keys']:,}-key map, idle and during a "
                      f"burst of {cfg['burst']:,} updates",
              ["round", "mode", "window", "reads", "reads/s", "p50 us", "p99 us",
               "p99.9 us", "max us", "burst applied s"], rows,
              caption=f"get / dict p99 during the burst, per round: "
                      f"{s['burst_p99_get_to_dict_per_round']}")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
