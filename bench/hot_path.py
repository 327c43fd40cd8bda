"""The hot path against the plain five-receive loop, same run (``python -m bench hot_path``).

Three targets take the same load (one writer, one subscriber, ``--keys`` random keys,
``--value-bytes`` values), each fresh:

* ``plain``: the plain loop (``bench.harness.forwarder --blind``): a blocking SUB -> dict
  -> PUB loop that reads every message as five copying receives, never looking at the
  MORE flag. It cannot be a server (one short message misaligns every later one), but it
  is the least Python can do per update: the ceiling the targets use.
* ``forwarder``: the project's ceiling, the same loop reading whole messages through
  ``clonemap.shards.common.zio.recv_frames`` (the frame path a server uses).
* ``server``: one shard server with ``--fsync`` (default ``everysec``, a fresh data
  directory per run), as users run it.

Per round, in this order:

1. **Flat out**: the writer in ``flow`` mode; received updates/s of each target, and the
   server's ratio to each ceiling in that round.
2. **Fixed rate** (``--rate``, default 50,000/s offered): the target process's CPU per
   update (CPU seconds / updates sequenced) for ``plain`` and ``server``.
3. **Latency at half load**: the plain loop and the server offered half of this round's
   flat-out server rate, unpinned and ``--pin`` (the target alone on core 0): p50 / p99
   end to end. The plain loop at the same rate says how much of the tail is the host's.

Targets (issue 18, medians over rounds of the per-round ratios): server / plain >= 0.8
flat out; server CPU per update <= 1.2 x plain at 50k/s; p99 < 5 ms at half load, pinned
and not. Memory per key is ``python -m bench snapshot``'s figure.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile

from bench.harness import record as rec
from bench.harness.ceilings import ceiling_target
from bench.harness.offer import Offer, Targets, run_offer
from bench.harness.procs import bench_main

NAME = "hot_path"
KINDS = ("plain", "forwarder", "server")
TARGET_RATIO = 0.8
TARGET_CPU_RATIO = 1.2
TARGET_P99_MS = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="one shard vs the plain five-receive loop and "
                                             "the project's forwarder, same run: flat out, "
                                             "CPU per update at a fixed rate, p99 at half "
                                             "load. Duration: smoke ~45 s, full (3 rounds "
                                             "of 3 s) ~2.5 min")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured window per run")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--rate", type=float, default=50_000.0,
                    help="offered updates/s of the CPU-per-update runs")
    ap.add_argument("--fsync", choices=("everysec", "always", "no", "off"), default="everysec",
                    help="the server's durability (off: memory only)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for the server (repeat: --server-arg "
                         "--collect-batch --server-arg 64)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1 or args.rate <= 0:
        ap.error("--seconds and --rate must be > 0, --rounds >= 1")
    return args


def one_run(kind: str, args, progress, *, rate: float = 0.0, pin: bool = False) -> dict:
    offer = Offer(keys=args.keys, value_bytes=args.value_bytes, rate_per_s=rate, pin=pin)
    data_dir = None
    if kind == "server":
        target, extra = "server", tuple(args.server_arg)
        if args.fsync != "off":
            data_dir = tempfile.mkdtemp(prefix="clonemap-hotpath-")
            extra += ("--data-dir", data_dir, "--fsync", args.fsync)
    else:
        target, extra = ceiling_target(kind)
    try:
        with Targets(target, offer=offer, extra=extra) as targets:
            figures = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                                progress=progress)
    finally:
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    cpu = figures["cpu_pct"]["targets"]
    seq = figures["sequenced_per_s"]
    lat = figures.get("latency_ms") or {}
    return {"kind": kind, "rate_offered": rate, "pin": pin,
            "received_per_s": figures["received_per_s"], "sequenced_per_s": seq,
            "loss_window": figures["loss_window"], "writer_drops": figures["writer_drops"],
            "target_cpu_pct": cpu, "others_cpu_pct": figures["cpu_pct"]["others"],
            "cpu_us_per_update": round(cpu / 100 / seq * 1e6, 2) if seq else None,
            "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99")}


def run(args: argparse.Namespace) -> rec.Record:
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    steps = args.rounds * (len(KINDS) + 2 + 4)
    with rec.Progress(NAME, total=steps) as progress:
        for r in range(args.rounds):
            flat = {}
            for kind in KINDS:
                progress.step(f"round {r + 1}/{args.rounds}: {kind} flat out")
                run_ = one_run(kind, args, progress)
                run_.update(round=r + 1, phase="flat")
                flat[kind] = run_["received_per_s"]
                progress.note(f"{kind}: {run_['received_per_s']:,.0f}/s, "
                              f"{run_['cpu_us_per_update']} us/update")
                record.add_run(run_)
            for kind in ("plain", "server"):
                progress.step(f"round {r + 1}/{args.rounds}: {kind} at {args.rate:,.0f}/s")
                run_ = one_run(kind, args, progress, rate=args.rate)
                run_.update(round=r + 1, phase="rate")
                progress.note(f"{kind}: {run_['cpu_us_per_update']} us/update at "
                              f"{run_['sequenced_per_s']:,.0f}/s")
                record.add_run(run_)
            half = flat["server"] / 2
            for pin in (False, True):
                for kind in ("plain", "server"):
                    progress.step(f"round {r + 1}/{args.rounds}: {kind} at half load "
                                  f"({half:,.0f}/s){' pinned' if pin else ''}")
                    run_ = one_run(kind, args, progress, rate=half, pin=pin)
                    run_.update(round=r + 1, phase="half_pinned" if pin else "half")
                    progress.note(f"{kind}: p50 {run_['p50_ms']} ms, p99 {run_['p99_ms']} ms")
                    record.add_run(run_)
        progress.finish_step()
    summarize(record)
    record.finish()
    return record


def _figure(runs, r, phase, kind, key):
    for run_ in runs:
        if run_["round"] == r and run_["phase"] == phase and run_["kind"] == kind:
            return run_.get(key)
    return None


def _ratios(runs, phase, key, num, den) -> list[float]:
    out = []
    for r in sorted({run_["round"] for run_ in runs}):
        a, b = _figure(runs, r, phase, num, key), _figure(runs, r, phase, den, key)
        if a and b:
            out.append(round(a / b, 3))
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(record: rec.Record) -> None:
    runs = record.data["runs"]
    flat = [r for r in runs if r["phase"] == "flat"]
    summary = {
        "received_per_s": {k: rec.spread([r["received_per_s"] for r in flat if r["kind"] == k])
                           for k in KINDS},
        "ratio_server_to_plain_per_round": _ratios(runs, "flat", "received_per_s",
                                                   "server", "plain"),
        "ratio_server_to_forwarder_per_round": _ratios(runs, "flat", "received_per_s",
                                                       "server", "forwarder"),
        "ratio_forwarder_to_plain_per_round": _ratios(runs, "flat", "received_per_s",
                                                      "forwarder", "plain"),
        "cpu_us_per_update_at_rate": {
            k: rec.spread([r["cpu_us_per_update"] for r in runs
                           if r["phase"] == "rate" and r["kind"] == k
                           and r["cpu_us_per_update"]], 2) for k in ("plain", "server")},
        "cpu_ratio_server_to_plain_per_round": _ratios(runs, "rate", "cpu_us_per_update",
                                                       "server", "plain"),
        "p99_ms_half_load": {p: rec.spread([r["p99_ms"] for r in runs if r["phase"] == p
                                            and r["kind"] == "server"
                                            and r["p99_ms"] is not None], 3)
                             for p in ("half", "half_pinned")},
        "plain_p99_ms_half_load": {p: rec.spread([r["p99_ms"] for r in runs
                                                  if r["phase"] == p and r["kind"] == "plain"
                                                  and r["p99_ms"] is not None], 3)
                                   for p in ("half", "half_pinned")},
        "p99_ms_at_rate": {k: rec.spread([r["p99_ms"] for r in runs if r["phase"] == "rate"
                                          and r["kind"] == k and r["p99_ms"] is not None], 3)
                           for k in ("plain", "server")},
    }
    for key in list(summary):
        if key.endswith("_per_round"):
            summary[key.replace("_per_round", "_median")] = _median(summary[key])
    record.data["summary"] = summary
    record.target("server / plain loop updates/s, fsync "
                  f"{record.data['config']['fsync']} (median per round)",
                  summary["ratio_server_to_plain_median"] or 0.0, TARGET_RATIO, "ratio")
    record.target(f"server / plain loop CPU per update at "
                  f"{record.data['config']['rate']:,.0f}/s (median per round)",
                  summary["cpu_ratio_server_to_plain_median"] or 0.0, TARGET_CPU_RATIO,
                  "ratio", higher_is_better=False)
    for phase, label in (("half", "unpinned"), ("half_pinned", "--pin")):
        p99 = summary["p99_ms_half_load"][phase].get("median")
        record.target(f"server p99 at half load, {label} (median)", p99 or 0.0,
                      TARGET_P99_MS, "ms", higher_is_better=False)


def report(record: rec.Record) -> None:
    rows = [[r["round"], r["phase"], r["kind"], r["rate_offered"] or "flat out",
             r["received_per_s"], r["cpu_us_per_update"], r["p50_ms"], r["p99_ms"],
             r["loss_window"], r["others_cpu_pct"]] for r in record.data["runs"]]
    s = record.data["summary"]
    rec.table(record, f"{NAME}: one shard (fsync {record.data['config']['fsync']}) vs the "
                      "plain five-receive loop and the project's forwarder",
              ["round", "phase", "target", "offered/s", "received/s", "CPU us/update",
               "p50 ms", "p99 ms", "lost", "others %"], rows,
              caption=f"server / plain per round {s['ratio_server_to_plain_per_round']}, "
                      f"server / forwarder {s['ratio_server_to_forwarder_per_round']}, "
                      f"forwarder / plain {s['ratio_forwarder_to_plain_per_round']}; CPU "
                      f"per update server / plain {s['cpu_ratio_server_to_plain_per_round']}")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
