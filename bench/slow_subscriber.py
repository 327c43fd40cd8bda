"""What one subscriber that never reads costs a server, in bytes, and what it costs the
other subscribers (``python -m bench slow_subscriber``).

Per round, three runs, each with a fresh persisting server (``--fsync everysec``, as
users run it) and the same flood: ``--writes`` KVSETs of ``--value-bytes`` over 1,000
keys from one raw PUB, as fast as it sends.

The writer waits for the healthy reader after every ``--batch`` writes, so the server's
collector never holds a backlog: the growth is the map, the log's buffers and what the
subscribers pin, not a writer outrunning the server (that is the writer budget's part).

* ``baseline``: no never-reading subscriber, the byte budgets at their defaults;
* ``snail``: one SUB that reads its welcome HUGZ and nothing after it, budgets on;
* ``snail_off``: the same with ``--subscriber-held-bytes 0 --writer-held-bytes 0`` (the
  marks count messages only: the behaviour before the budgets).

A healthy raw SUB reads every update throughout. Figures: the server's RSS growth from
before the flood to the moment the healthy reader has the last update, and the time the
healthy reader took to get the whole flood. What the snail pins is ``snail - baseline``
in the same round; the documented worst case is the subscriber budget (64 MiB).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import psutil
import zmq

from bench.harness import record as rec
from bench.harness.procs import bench_main, server_argv, start_on_free_ports

NAME = "slow_subscriber"
MODES = ("baseline", "snail", "snail_off")
MiB = 1 << 20
BUDGET_MIB = 64
"""The default ``limits.subscriber_held_bytes``: the worst case one snail may pin."""
KEYS = 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="A never-reading subscriber: server RSS and "
                                             "the other subscribers' delivery time, with "
                                             "and without the byte budgets. Duration: "
                                             "smoke ~10 s, full ~1 min")
    ap.add_argument("--writes", type=int, default=40_000)
    ap.add_argument("--value-bytes", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1000,
                    help="writes sent before the writer waits for the healthy reader")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.writes < 1 or args.rounds < 1 or args.value_bytes < 1:
        ap.error("--writes, --rounds and --value-bytes must be >= 1")
    return args


def _recv_until(sock: zmq.Socket, seq: int, timeout_s: float = 60.0) -> int:
    """Read updates until one with sequence ``seq`` or later; returns how many."""
    deadline = time.monotonic() + timeout_s
    got = 0
    while time.monotonic() < deadline:
        if sock.poll(100):
            frames = sock.recv_multipart()
            got += 1
            if int.from_bytes(frames[1], "big") >= seq:
                return got
    raise RuntimeError(f"no update {seq} within {timeout_s} s")


def one_run(mode: str, args) -> dict:
    from clonemap.shards.common.proto import chp

    extra = ["--fsync", "everysec"]
    if mode == "snail_off":
        extra += ["--subscriber-held-bytes", "0", "--writer-held-bytes", "0"]
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="clonemap-bench-") as data:
        extra += ["--data-dir", data]
        target, port = start_on_free_ports(
            "server", lambda base: server_argv(base, extra=tuple(extra)))
        try:
            server = psutil.Process(target.pid)
            if mode != "baseline":
                snail = ctx.socket(zmq.SUB)
                snail.rcvhwm = 1
                snail.setsockopt(zmq.RCVBUF, 8192)
                snail.subscribe(b"")
                snail.connect(f"tcp://127.0.0.1:{port + 1}")
                if not snail.poll(10_000):
                    raise RuntimeError("the snail got no welcome HUGZ")
                snail.recv_multipart()  # and never reads again
            reader = zmq.Context().socket(zmq.SUB)  # its own I/O thread
            reader.rcvhwm = 0
            reader.subscribe(b"/")
            reader.connect(f"tcp://127.0.0.1:{port + 1}")
            writer = ctx.socket(zmq.PUB)
            writer.sndhwm = 0
            writer.connect(f"tcp://127.0.0.1:{port + 2}")
            deadline = time.monotonic() + 10
            while True:  # the PUB drops until the server's subscription arrives
                writer.send_multipart(chp.kvset(b"/probe", b"p"))
                if reader.poll(50) and (probe := reader.recv_multipart())[0] == b"/probe":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the server never published a probe")
            # one mark after the probes (a connection keeps order): the flood follows it
            writer.send_multipart(chp.kvset(b"/mark", b"m"))
            while (probe := reader.recv_multipart())[0] != b"/mark":
                pass
            first_seq = int.from_bytes(probe[1], "big")
            before = server.memory_info().rss
            value = b"v" * args.value_bytes
            t0 = time.perf_counter()
            received = 0
            for start in range(0, args.writes, args.batch):
                stop = min(args.writes, start + args.batch)
                for i in range(start, stop):
                    writer.send_multipart(chp.kvset(b"/flood/%d" % (i % KEYS), value))
                received += _recv_until(reader, first_seq + stop)
            seconds = time.perf_counter() - t0
            after = server.memory_info().rss
        finally:
            target.stop()
            reader.context.destroy(linger=0)
            ctx.destroy(linger=0)
    return {"mode": mode, "rss_before_mib": round(before / MiB, 1),
            "rss_growth_mib": round((after - before) / MiB, 1),
            "reader_received": received, "reader_seconds": round(seconds, 3)}


def run(args: argparse.Namespace) -> rec.Record:
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    with rec.Progress(NAME, total=args.rounds * len(MODES)) as progress:
        for r in range(args.rounds):
            for mode in MODES:
                progress.step(f"round {r + 1}/{args.rounds}: {mode}")
                run_ = {"round": r + 1, **one_run(mode, args)}
                progress.note(f"{mode}: RSS +{run_['rss_growth_mib']} MiB, reader "
                              f"{run_['reader_seconds']} s")
                record.add_run(run_)
        progress.finish_step()
    summarize(record)
    record.finish()
    return record


def _by_round(runs: list[dict], mode: str) -> dict[int, dict]:
    return {r["round"]: r for r in runs if r["mode"] == mode}


def summarize(record: rec.Record) -> None:
    runs = record.data["runs"]
    base, snail, off = (_by_round(runs, m) for m in MODES)
    pinned = [round(snail[r]["rss_growth_mib"] - base[r]["rss_growth_mib"], 1)
              for r in sorted(base) if r in snail]
    pinned_off = [round(off[r]["rss_growth_mib"] - base[r]["rss_growth_mib"], 1)
                  for r in sorted(base) if r in off]
    summary = {
        "rss_growth_mib": {m: rec.spread([r["rss_growth_mib"] for r in runs
                                          if r["mode"] == m]) for m in MODES},
        "reader_seconds": {m: rec.spread([r["reader_seconds"] for r in runs
                                          if r["mode"] == m], 3) for m in MODES},
        "snail_pinned_mib_per_round": pinned,
        "snail_pinned_budget_off_mib_per_round": pinned_off,
    }
    record.data["summary"] = summary
    worst = max(pinned) if pinned else float("inf")
    record.target(f"RSS a never-reading subscriber pins (snail - baseline, worst round), "
                  f"{args_value(record)} B values", worst, BUDGET_MIB, "MiB",
                  higher_is_better=False)
    if pinned_off:
        summary["snail_pinned_budget_off_mib_median"] = statistics.median(pinned_off)


def args_value(record: rec.Record) -> int:
    return record.data["config"]["value_bytes"]


def report(record: rec.Record) -> None:
    rows = [[r["round"], r["mode"], r["rss_before_mib"], r["rss_growth_mib"],
             r["reader_received"], r["reader_seconds"]] for r in record.data["runs"]]
    s = record.data["summary"]
    rec.table(record, f"{NAME}: one never-reading subscriber, "
                      f"{record.data['config']['writes']:,} writes of "
                      f"{args_value(record):,} B",
              ["round", "mode", "RSS before MiB", "RSS growth MiB", "reader updates",
               "reader s"], rows,
              caption=f"pinned by the snail per round (snail - baseline): budgets on "
                      f"{s['snail_pinned_mib_per_round']} MiB, off "
                      f"{s['snail_pinned_budget_off_mib_per_round']} MiB")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
