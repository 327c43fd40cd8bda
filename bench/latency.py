"""Latency at fixed offered rates, open loop (``python -m bench latency``).

First, in the same run, the single-shard maximum: one standalone server, the writers
flat out (``flow``) for ``--max-seconds``; its received updates/s is the reference. Then
for every fraction in ``--fractions`` (0.5 is always included) and every target -
``server`` (one shard server), ``forwarder`` (the bare forwarding loop) and ``pubsub``
(bare PUB->SUB, nothing in between) - a fresh target under the same writers offering
``fraction x max`` updates/s *in total*, open loop: each update is due at a fixed time
and its latency stamp is that *intended* send time, so a stall shows as latency for
everything due during it (no coordinated omission); a full pipe drops the update at the
writer and counts it. One subscriber samples the end-to-end latency of one update in
``--latency-every``. Per point: received/s and p50/p90/p99/p99.9/max as median and
spread over ``--rounds``, sequence gaps (loss) and writer drops.

Target: server p99 < 5 ms at half the single-shard maximum.

``--pin`` puts the target alone on core 0 and the writers and subscriber on the other
cores. On the 2-core dev host it mattered more than anything else: the server's p99 at
half the maximum (~36,000/s) was 2-7 ms pinned against ~25-30 ms unpinned (dev runs,
quiet host), because unpinned the server's threads queue behind the harness's.

Duration: max run (warmup + max-seconds + ~2 s) plus rounds x fractions x targets runs of
warmup + seconds + ~1.5 s: smoke (``--fractions 0.25,0.5 --seconds 0.5 --warmup 0.2
--max-seconds 0.5 --rounds 1``) ~15 s; quick (``--fractions 0.25,0.5,0.9 --seconds 2``)
~45 s; full (``--fractions 0.1,0.25,0.5,0.75,0.9 --seconds 3 --warmup 1 --rounds 2``)
~3.5 min.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict

from bench.harness import record as rec
from bench.harness.ceilings import FIGURE_KEYS
from bench.harness.offer import Targets, add_offer_args, brief, check_offer_args, offer_from, run_offer
from bench.harness.procs import bench_main

NAME = "latency"
KINDS = ("server", "forwarder", "pubsub")
PERCENTILES = ("p50", "p90", "p99", "p99.9", "max")
TARGET_P99_MS = 5.0
MAX_WARMUP_S = 1.0
"""The flat-out max run warms up at least this long (its pipes fill first, see --hwm)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=f"python -m bench {NAME}",
        description="latency percentiles at fixed offered rates (open loop), as fractions "
                    "of the single-shard maximum measured first; server vs bare forwarding "
                    "loop vs bare PUB->SUB. Duration: smoke (--fractions 0.25,0.5 --seconds "
                    "0.5 --warmup 0.2 --max-seconds 0.5 --rounds 1) ~15 s, quick ~45 s, "
                    "full (--fractions 0.1,0.25,0.5,0.75,0.9 --seconds 3 --warmup 1 "
                    "--rounds 2) ~3.5 min")
    ap.add_argument("--fractions", default="0.25,0.5,0.9",
                    help="offered rates as fractions of the measured max (0.5 always added)")
    ap.add_argument("--targets", default=",".join(KINDS), help="server,forwarder,pubsub")
    ap.add_argument("--seconds", type=float, default=2.0, help="measured window per point")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-seconds", type=float, default=2.0,
                    help="window of the flat-out single-shard max run")
    ap.add_argument("--max-per-s", type=float, default=0.0,
                    help="use this single-shard max instead of measuring it (0: measure)")
    ap.add_argument("--hwm", type=int, default=10_000,
                    help="server's and forwarder's collector RCVHWM (small, so the flat-out "
                         "max run is past its pipe-filling transient within the warm-up; "
                         "below capacity no queue builds); their PUB keeps 100,000")
    add_offer_args(ap, writers=1)
    ap.set_defaults(latency_every=2)
    args = ap.parse_args(argv)
    check_offer_args(ap, args)
    try:
        fractions = {float(x) for x in args.fractions.split(",") if x.strip()}
    except ValueError:
        ap.error(f"--fractions: expected comma-separated numbers, got {args.fractions!r}")
    if any(not 0 < f <= 1.5 for f in fractions):
        ap.error("--fractions must be in (0, 1.5]")
    args.fraction_list = sorted(fractions | {0.5})
    args.kinds = [k.strip() for k in args.targets.split(",") if k.strip()]
    if not args.kinds or set(args.kinds) - set(KINDS):
        ap.error(f"--targets: any of {', '.join(KINDS)}")
    if args.max_seconds <= 0 or args.max_per_s < 0 or args.hwm < 1:
        ap.error("--max-seconds must be > 0, --max-per-s >= 0 and --hwm >= 1")
    return args


def run(args: argparse.Namespace) -> rec.Record:
    opts = {k: v for k, v in vars(args).items()
            if k not in ("results_dir", "fraction_list", "kinds", "core_list")}
    flat = offer_from(args, latency_every=64)
    config = dict(opts, fractions_run=args.fraction_list, offer=asdict(flat),
                  rate_meaning="offered updates/s in total, split evenly over the writers")
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", opts), config)
    steps = (0 if args.max_per_s else 1) + args.rounds * len(args.fraction_list) * len(args.kinds)
    with rec.Progress(NAME, total=steps) as progress:
        if args.max_per_s:
            top = args.max_per_s
            record.data["max_run"] = {"given": top}
        else:
            progress.step("single-shard max: 1 server, writers flat out")
            with Targets("server", 1, offer=flat, extra=_hwm(args)) as targets:
                fig = run_offer(targets, warmup=max(args.warmup, MAX_WARMUP_S),
                                seconds=args.max_seconds, progress=progress)
            progress.note(f"max: {brief(fig)}")
            record.data["max_run"] = fig
            top = fig["received_per_s"]
        record.data["config"]["single_shard_max_per_s"] = top
        for r in range(args.rounds):
            for fraction in args.fraction_list:
                offered = round(fraction * top, 1)
                offer = offer_from(args, rate_per_s=offered / args.writers)
                for kind in args.kinds:
                    progress.step(f"round {r + 1}/{args.rounds}: {kind} at {offered:,.0f}/s "
                                  f"({fraction:g} of max)")
                    with Targets(kind, 1, offer=offer, extra=_hwm(args)) as targets:
                        fig = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                                        progress=progress, seed=1 + 100 * r)
                    fig.update(round=r + 1, fraction_of_max=fraction, offered_per_s=offered)
                    progress.note(f"{kind}: {brief(fig)}")
                    record.add_run(fig)
        progress.finish_step()
    summarize(record, top)
    record.finish()
    return record


def _hwm(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--collect-hwm", str(args.hwm))


def summarize(record: rec.Record, top: float) -> None:
    runs = record.data["runs"]
    points = []
    for fraction in record.data["config"]["fractions_run"]:
        for kind in KINDS:
            mine = [r for r in runs if r["target"] == kind and r["fraction_of_max"] == fraction]
            if not mine:
                continue
            points.append({
                "offered_per_s": mine[0]["offered_per_s"], "fraction_of_max": fraction,
                "target": kind,
                "received_per_s": rec.spread([r["received_per_s"] for r in mine]),
                "latency_ms": {p: rec.spread([r["latency_ms"][p] for r in mine
                                              if r["latency_ms"]], digits=3)
                               for p in PERCENTILES},
                "loss": sum(r["loss_window"] for r in mine),
                "writer_drops": sum(r["writer_drops"] for r in mine),
                "latency_samples": sum(r["subscribers"][0]["latency_samples"]
                                       for r in mine) if "subscribers" in mine[0] else None,
            })
    half = {p["target"]: p for p in points if p["fraction_of_max"] == 0.5}
    ceilings: dict = {"config": {"rate_per_s": round(0.5 * top, 1), "writer_mode": "rate",
                                 "kinds": [k for k in ("pubsub", "forwarder") if
                                           (k if k == "pubsub" else "forwarder") in half],
                                 "from": "the runs at half the single-shard max (median)"}}
    for kind in ("pubsub", "forwarder"):
        mine = sorted((r for r in runs if r["target"] == kind and r["fraction_of_max"] == 0.5),
                      key=lambda r: r["received_per_s"])
        if mine:
            mid = mine[(len(mine) - 1) // 2]
            ceilings[kind] = {k: mid.get(k) for k in FIGURE_KEYS}
    record.data["summary"] = {"single_shard_max_per_s": top, "points": points,
                              "ceilings": ceilings}
    server = half.get("server")
    if server is not None and server["latency_ms"]["p99"].get("n"):
        record.target("server p99 at half the single-shard max (median)",
                      server["latency_ms"]["p99"]["median"], TARGET_P99_MS, "ms",
                      higher_is_better=False)
    record.target("server updates lost (all windows)",
                  sum(p["loss"] for p in points if p["target"] == "server"), 1, "updates",
                  higher_is_better=False)


def report(record: rec.Record) -> None:
    s = record.data["summary"]
    rows = []
    for p in s["points"]:
        lat = p["latency_ms"]
        med = lambda k: lat[k].get("median", "-")  # noqa: E731
        rows.append([f"{p['fraction_of_max']:g} {p['target']}", p["offered_per_s"],
                     p["received_per_s"]["median"], med("p50"), med("p90"), med("p99"),
                     med("p99.9"), med("max"), p["loss"], p["writer_drops"]])
    rec.table(record, f"{NAME}: open loop, single-shard max "
                      f"{s['single_shard_max_per_s']:,.0f}/s (same run)",
              ["fraction target", "offered/s", "received/s", "p50 ms", "p90 ms", "p99 ms",
               "p99.9 ms", "max ms", "lost", "writer drops"], rows,
              caption="medians over rounds; latency from each update's intended send time "
                      "to its arrival at the subscriber")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
