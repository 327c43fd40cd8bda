"""Scale-out: the same offered load over 1, 2 and 4 shards (``python -m bench scaleout``).

Every point is one fresh set of targets under the same harness: ``--writers`` writer
processes flat out (``flow``: a full pipe blocks the writer, nothing is dropped before a
target), each routing every key to its owning shard as a client does, and one subscriber
process reading every shard's publisher (sequence and gaps per shard). Targets:

* ``server``: N standalone ``python -m clonemap.shards`` processes, each started with the routing
  of N shards and its ``--shard-index`` (it drops keys it does not own, as in a cluster);
* ``forwarder``: N bare forwarding loops (bench/harness/forwarder.py) under the same harness,
  the ceiling for each N.

Plus the bare PUB->SUB ceiling (bench/harness/ceilings.py) with the same writers. Per run:
aggregate received updates/s, ``cpu_cores`` (CPU seconds of all our processes - targets,
writers, subscriber - over the window) and updates/s per busy core; per point the
median and spread over ``--rounds``, and ``efficiency`` = aggregate / (N x the 1-shard
median of the same target). ``contention`` says where the host runs out of cores;
``estimate_16core`` turns the measured CPU per update of server, writers and subscriber
into an estimated aggregate for a 16-core host (configs/16core-scale.yaml: 6 shards,
primaries on cores 0-5, backups on 6-11, 3 writers and 1 subscriber on 12-15), with its
inputs and formula.

Queues: the targets' collectors run with ``--hwm`` 10,000 (see ``HWM``) so that flat-out
writers reach a steady state (blocked on full pipes) within the warm-up; each run says
whether it did (``steady``). Their publishers keep the server's default 100,000
(``--pub-hwm``): a subscriber briefly starved of CPU then falls behind without losing
updates.

Duration: (rounds x len(shards) x 2 targets) runs of warmup + seconds + ~1.5 s start-up
and drain, plus one ceiling run: smoke (``--shards 1,2 --seconds 0.5 --warmup 0.2
--rounds 1``) ~15 s; quick (``--seconds 2 --rounds 2``) ~1.7 min; full (``--seconds 4
--warmup 1 --rounds 3``) ~4.5 min.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, replace

from bench.harness import record as rec
from bench.harness.ceilings import FIGURE_KEYS, measure_ceilings
from bench.harness.offer import (HarnessPlan, Offer, Targets, add_offer_args, brief,
                                 check_offer_args, harness_plan, offer_from, run_offer)
from bench.harness.procs import bench_main

NAME = "scaleout"
HWM = 10_000
"""Targets' collector queue limit. Flat out, the writers first fill every pipe (collector queue,
kernel socket buffers) and only then wait for the targets; with the servers' default
100,000 the pipes of 4 shards take seconds to fill, and while they fill the writers run
flat out and take CPU from the targets, so a short window measured that transient (4
shards looked slower than 1). At 10,000 the pipes are full within the 1 s warm-up: each
run records ``steady`` (sent within 10% of received over the window)."""
STEADY_RATIO = 0.10
SCALE_GOAL = 5 / 6
"""The aggregate at N shards should be at least this x N x one shard's (5x at 6 shards,
the 16-core target); a host with fewer cores than the servers and harness need misses
it, and says so."""
ESTIMATE_HOST = {"config": "configs/16core-scale.yaml", "cores": 16, "shards": 6,
                 "primary_cores": [0, 1, 2, 3, 4, 5], "backup_cores": [6, 7, 8, 9, 10, 11],
                 "harness_cores": [12, 13, 14, 15], "writers": 3, "subscribers": 1,
                 "harness_command": "python -m bench load --config configs/16core-scale.yaml "
                                    "--writers 3 --subscribers 1 --pin --cores 12-15"}

ESTIMATE_ASSUMPTIONS = (
    "the same CPU cost per update there as here (same CPU speed), no other load, loopback "
    "networking, backups on their own cores (a passive server's replication does not slow "
    "its primary), each primary alone on its core with its I/O thread, each harness "
    "process alone on a harness core, and keys spread evenly over the shards (uniform "
    "keys). Costs measured here under contention (processes sharing 2 cores) are a little "
    "higher than on idle cores, so the estimate leans low.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=f"python -m bench {NAME}",
        description="aggregate throughput over 1, 2 and 4 shard servers and as many bare "
                    "forwarding loops, same writers and subscriber. Duration: smoke "
                    "(--shards 1,2 --seconds 0.5 --warmup 0.2 --rounds 1) ~15 s, quick "
                    "(--seconds 2 --rounds 2) ~1.7 min, full (--seconds 4 --warmup 1 "
                    "--rounds 3) ~4.5 min")
    ap.add_argument("--shards", default="1,2,4", help="shard counts, e.g. 1,2,4")
    ap.add_argument("--targets", default="server,forwarder",
                    help="server and/or forwarder, comma-separated")
    ap.add_argument("--seconds", type=float, default=2.0, help="measured window per run")
    ap.add_argument("--warmup", type=float, default=1.0,
                    help="warm-up before each window: long enough for the writers to fill "
                         "the pipes and block (see --hwm)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hwm", type=int, default=HWM,
                    help="targets' collector RCVHWM (see the module doc)")
    ap.add_argument("--pub-hwm", type=int, default=100_000, help="targets' PUB SNDHWM")
    ap.add_argument("--harness", choices=("fixed", "auto"), default="fixed",
                    help="fixed: --writers writers and one subscriber reading every shard "
                         "at every point; auto: each point sized from the cores at hand "
                         "(--cores, or every usable core): writers scale with the shards, "
                         "subscribers split the shards between them, every process on a "
                         "core of its own where the host has enough (the plan is printed "
                         "before each point)")
    add_offer_args(ap, writers=2)
    args = ap.parse_args(argv)
    check_offer_args(ap, args)
    try:
        args.shard_counts = sorted({int(x) for x in args.shards.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--shards: expected comma-separated integers, got {args.shards!r}")
    if not args.shard_counts or args.shard_counts[0] < 1 or args.shard_counts[-1] > 16:
        ap.error("--shards: counts must be in 1..16")
    if 1 not in args.shard_counts:
        ap.error("--shards must include 1 (efficiency is against the 1-shard figure)")
    args.target_kinds = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not args.target_kinds or set(args.target_kinds) - {"server", "forwarder"}:
        ap.error("--targets: server and/or forwarder")
    if args.hwm < 1 or args.pub_hwm < 1:
        ap.error("--hwm and --pub-hwm must be >= 1")
    return args


def run(args: argparse.Namespace) -> rec.Record:
    offer = offer_from(args, subscribers=1)
    opts = {k: v for k, v in vars(args).items()
            if k not in ("results_dir", "shard_counts", "target_kinds", "core_list")}
    config = dict(opts, offer=asdict(offer))
    config["order"] = [f"{r + 1}:{n}:{k}" for r in range(args.rounds)
                       for n in args.shard_counts for k in args.target_kinds]
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", opts), config)
    extra = ("--pub-hwm", str(args.pub_hwm), "--collect-hwm", str(args.hwm))
    steps = 2 + len(config["order"])
    with rec.Progress(NAME, total=steps) as progress:
        ceilings = measure_ceilings(seconds=args.seconds, warmup=args.warmup, keys=args.keys,
                                    value_bytes=args.value_bytes, writers=args.writers,
                                    pin=args.pin, kinds=("pubsub", "plain"),
                                    progress=progress)
        for r in range(args.rounds):
            for n in args.shard_counts:
                for kind in args.target_kinds:
                    progress.step(f"round {r + 1}/{args.rounds}: {n} x {kind}")
                    mine, plan = point_offer(offer, n, args)
                    if plan is not None and r == 0:
                        for line in plan.lines(kind):
                            progress.note(line)
                    with Targets(kind, n, offer=mine, extra=extra) as targets:
                        fig = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                                        progress=progress, seed=1 + 100 * r)
                        fig["targets"] = targets.describe()
                    fig["round"] = r + 1
                    if plan is not None:
                        fig["plan"] = {"writers": plan.writers,
                                       "subscribers": plan.subscribers, "why": plan.why}
                    fig["per_core_per_s"] = round(fig["received_per_s"]
                                                  / (fig["cpu_cores"] or 1e-9), 1)
                    fig["steady"] = (abs(fig["sent_per_s"] - fig["received_per_s"])
                                     <= STEADY_RATIO * fig["received_per_s"])
                    progress.note(f"{n} x {kind}: {brief(fig)}")
                    record.add_run(fig)
        progress.finish_step()
    summarize(record, ceilings)
    record.finish()
    return record


def point_offer(offer: Offer, shards: int, args: argparse.Namespace
                ) -> tuple[Offer, HarnessPlan | None]:
    """The load of one point: the fixed offer, or (``--harness auto``) one sized from
    the cores for ``shards`` targets, its harness pinned where the plan puts it."""
    if args.harness != "auto":
        return offer, None
    plan = harness_plan(shards, harness_cores=args.core_list, split=True)
    return replace(offer, writers=plan.writers, subscribers=plan.subscribers, split=True,
                   cores=tuple(plan.harness_cores)), plan


def summarize(record: rec.Record, ceilings: dict) -> None:
    runs = record.data["runs"]
    cfg = record.data["config"]
    points = []
    base: dict[str, float] = {}
    for kind in [t.strip() for t in cfg["targets"].split(",") if t.strip()]:
        for n in sorted({r["shards"] for r in runs}):
            mine = [r for r in runs if r["target"] == kind and r["shards"] == n]
            if not mine:
                continue
            received = rec.spread([r["received_per_s"] for r in mine])
            if n == 1:
                base[kind] = received["median"]
            points.append({
                "shards": n, "target": kind, "received_per_s": received,
                "cpu_cores": rec.spread([r["cpu_cores"] for r in mine]),
                "per_core_per_s": rec.spread([r["per_core_per_s"] for r in mine]),
                "efficiency": round(received["median"] / (n * base[kind]), 3)
                if base.get(kind) else None,
                "loss": sum(r["loss_window"] for r in mine),
                "loss_targets": sum(r.get("loss_targets", r["loss_window"]) for r in mine),
                "loss_harness": sum(r.get("loss_harness", 0) for r in mine),
                "harness_max_pct": rec.spread([r.get("harness_max_pct", 0.0) for r in mine]),
                "writers": mine[0].get("plan", {}).get("writers", cfg["writers"]),
                "subscribers": mine[0].get("plan", {}).get("subscribers", 1),
                "steady_runs": sum(bool(r.get("steady")) for r in mine),
                "targets_cpu_pct": rec.spread([r["cpu_pct"]["targets"] for r in mine]),
                "target_us_per_update": rec.spread(
                    [1e4 * r["cpu_pct"]["targets"] / (r["received_per_s"] or 1e-9)
                     for r in mine]),
                "harness_cpu_pct": rec.spread([r["cpu_pct"]["writers"]
                                               + r["cpu_pct"]["subscribers"] for r in mine]),
                "others_cpu_pct": rec.spread([r["cpu_pct"]["others"] for r in mine]),
                "subscriber_cpu_pct": rec.spread([r["cpu_pct"]["subscribers"]
                                                  for r in mine]),
            })
            points[-1]["harness_bound"] = harness_bound(points[-1], mine)
    fwd1 = _median_run([r for r in runs if r["target"] == "forwarder" and r["shards"] == 1])
    if fwd1 is not None:
        ceilings["forwarder"] = {k: fwd1.get(k) for k in FIGURE_KEYS}
        ceilings["config"]["kinds"] = ["pubsub", "plain", "forwarder"]
        ceilings["forwarder_from"] = "the 1-shard forwarder point (median round)"
    pubsub = ceilings.get("pubsub", {}).get("received_per_s")
    plain = ceilings.get("plain", {}).get("received_per_s")
    by = {(p["target"], p["shards"]): p for p in points}
    for p in points:
        med = p["received_per_s"]["median"]
        fwd = by.get(("forwarder", p["shards"]))
        # (a forwarder that delivered nothing in its window, as once in a 0.3 s smoke
        # round on a loaded host, gives no ratio: "-" in the table)
        if p["target"] == "server" and fwd and fwd["received_per_s"]["median"] > 0:
            p["ratio_to_forwarder"] = round(med / fwd["received_per_s"]["median"], 3)
        if p["target"] == "server" and plain:  # the second ceiling: n plain loops' worth
            p["ratio_to_plain_loop"] = round(med / (p["shards"] * plain), 3)
        if pubsub:
            p["ratio_to_pubsub"] = round(med / pubsub, 3)
    summary = {"points": points, "ceilings": ceilings,
               "contention": contention(points, record.data["host"]),
               "estimate_16core": estimate_16core(runs, ceilings)}
    record.data["summary"] = summary
    top = max((p for p in points if p["target"] == "server"), key=lambda p: p["shards"],
              default=None)
    bound = "; ".join(f"{p['shards']} shards: {p['harness_bound']}" for p in points
                      if p["target"] == "server" and p["harness_bound"])
    if top is not None and top["shards"] > 1:
        one = by[("server", 1)]["received_per_s"]["median"]
        record.target(f"server aggregate, {top['shards']} shards / 1 shard (medians)",
                      round(top["received_per_s"]["median"] / one, 3) if one else 0.0,
                      round(SCALE_GOAL * top["shards"], 2), "ratio",
                      harness_bound=top["harness_bound"])
    record.target("updates lost by the servers (all server windows)",
                  sum(p["loss_targets"] for p in points if p["target"] == "server"), 1,
                  "updates", higher_is_better=False, harness_bound=bound)


def _median_run(runs: list[dict]) -> dict | None:
    if not runs:
        return None
    return sorted(runs, key=lambda r: r["received_per_s"])[(len(runs) - 1) // 2]


def contention(points: list[dict], host: dict) -> str:
    """One honest sentence: how many cores one shard plus the harness already use."""
    cores = host.get("cores_usable") or host.get("cores_logical")
    by = {(p["target"], p["shards"]): p for p in points}
    one = by.get(("server", 1))
    if one is None:
        return "no 1-shard server point was measured"
    most = max((p for p in points if p["target"] == "server"), key=lambda p: p["shards"])
    busy = one["cpu_cores"]["median"]
    server_cores = one["targets_cpu_pct"]["median"] / 100
    harness_cores = one["harness_cpu_pct"]["median"] / 100
    fits = shards_that_fit(cores, server_cores, harness_cores)
    text = (f"On this {cores}-core host one shard server plus the harness (writers and "
            f"subscriber) keeps {busy:.2f} cores busy (server "
            f"{one['targets_cpu_pct']['median']:.0f}%, harness "
            f"{one['harness_cpu_pct']['median']:.0f}% of a core, other processes "
            f"{one['others_cpu_pct']['median']:.0f}%), so ")
    if busy >= 0.8 * cores:
        text += "contention starts at the first shard: "
    elif fits < 2:
        text += "contention starts as soon as a second shard needs a core of its own: "
    else:
        text += (f"about {fits} shards fit on its cores before servers share them (the "
                 "harness scaling with them): ")
    text += (f"{most['shards']} shards gave {most['received_per_s']['median']:,.0f} "
             f"updates/s against {one['received_per_s']['median']:,.0f} for one "
             f"(efficiency {most['efficiency']}), with {most['cpu_cores']['median']:.2f} "
             "cores busy")
    if most["shards"] > max(1, fits):
        text += (f" - past {max(1, fits)}, more shards add processes, not cores; the "
                 f"servers' CPU per update went from "
                 f"{one['target_us_per_update']['median']:.1f} to "
                 f"{most['target_us_per_update']['median']:.1f} us as they shared the "
                 "cores.")
    else:
        text += "."
    return text


def harness_bound(point: dict, runs: list[dict] = ()) -> str:
    """Why the harness set this point's figure, or "": a harness process busier than
    ``HARNESS_BOUND_PCT`` of a core (each run's ``harness_bound``, from every writer's
    and subscriber's own CPU) sends or reads no faster, and what the servers sent beyond
    a saturated subscriber is dropped at their publisher for the harness, not lost by
    the servers. Records without per-process figures: the subscribers' group."""
    hot = [r["harness_bound"] for r in runs if r.get("harness_bound")]
    if hot:
        return f"{len(hot)}/{len(runs)} run(s): {hot[0]}"
    if runs and all("harness_bound" in r for r in runs):
        return ""
    pct = point["subscriber_cpu_pct"]["median"]
    if pct > rec.HARNESS_BOUND_PCT:
        return f"the subscriber process at {pct:.0f}% of a core"
    return ""


def shards_that_fit(cores: float, server_cores: float, harness_cores: float) -> int:
    """How many shards run without sharing cores on a host of ``cores``, when one
    server keeps ``server_cores`` busy and the harness ``harness_cores`` per shard (it
    scales with them): the host's real core count, not the 2 of the machine the prose
    was first written on."""
    per_shard = server_cores + harness_cores
    if per_shard <= 0:
        return int(cores)
    return max(0, int(cores // per_shard))


def estimate_16core(runs: list[dict], ceilings: dict) -> dict:
    """The aggregate a 16-core host would reach with ESTIMATE_HOST's layout, from CPU per
    update measured in this run:

        c_server = server CPU s / received update, 1-shard server runs (median): all its
                   threads, so one core per primary gives 1 / c_server per shard
        c_writer = writers' CPU s / sent update, c_sub = subscriber CPU s / received update,
                   from the bare PUB->SUB ceiling run, where writers and subscriber run
                   flat out (in the server runs they wait for the server, and a process
                   that waits spends more CPU per update on wake-ups than one that is busy)
        aggregate = min(shards / c_server, writers / c_writer, subscribers / c_sub)

    (each primary, writer and subscriber process on a core of its own: 6 primaries, 3
    writers, 1 subscriber reading all 6 shards). See ESTIMATE_ASSUMPTIONS."""
    one = [r for r in runs if r["target"] == "server" and r["shards"] == 1]
    if not one:
        return {"error": "no 1-shard server run"}
    med = lambda xs: statistics.median(xs)  # noqa: E731
    per = lambda cpu, rate: cpu / 100 / (rate or 1e-9)  # noqa: E731
    c_server = med([per(r["cpu_pct"]["targets"], r["received_per_s"]) for r in one])
    pubsub = ceilings.get("pubsub")
    source = "the bare PUB->SUB ceiling run (flat out)"
    if pubsub and pubsub.get("received_per_s"):
        c_writer = per(pubsub["cpu_pct"]["writers"], pubsub["sent_per_s"])
        c_sub = per(pubsub["cpu_pct"]["subscribers"], pubsub["received_per_s"])
    else:
        source = "the 1-shard server runs (median; no PUB->SUB ceiling run)"
        c_writer = med([per(r["cpu_pct"]["writers"], r["sent_per_s"]) for r in one])
        c_sub = med([per(r["cpu_pct"]["subscribers"], r["received_per_s"]) for r in one])
    host = ESTIMATE_HOST
    bound = lambda n, c: n / c if c else 0.0  # noqa: E731
    bounds = {"servers": bound(host["shards"], c_server),
              "writers": bound(host["writers"], c_writer),
              "subscriber": bound(host["subscribers"], c_sub)}
    limit = min(bounds, key=bounds.get)
    return {
        "host": host,
        "inputs": {"c_server_us": round(c_server * 1e6, 3),
                   "c_writer_us": round(c_writer * 1e6, 3),
                   "c_sub_us": round(c_sub * 1e6, 3),
                   "c_server_from": f"{len(one)} 1-shard server run(s), median",
                   "c_harness_from": source},
        "formula": "min(shards / c_server, writers / c_writer, subscribers / c_sub)",
        "server_bound_per_s": round(bounds["servers"], 0),
        "writer_bound_per_s": round(bounds["writers"], 0),
        "subscriber_bound_per_s": round(bounds["subscriber"], 0),
        "aggregate_per_s": round(bounds[limit], 0),
        "limited_by": limit,
        "assumptions": ESTIMATE_ASSUMPTIONS,
    }


def report(record: rec.Record) -> None:
    s = record.data["summary"]
    rows = []
    for p in s["points"]:
        rows.append([f"{p['shards']} x {p['target']}", p["received_per_s"]["median"],
                     p["received_per_s"]["spread_pct"], p["cpu_cores"]["median"],
                     p["per_core_per_s"]["median"], p["efficiency"],
                     p.get("ratio_to_forwarder", "-"), p.get("ratio_to_plain_loop", "-"),
                     p.get("ratio_to_pubsub", "-"),
                     p["target_us_per_update"]["median"],
                     f"{p.get('loss_targets', p['loss'])} / {p.get('loss_harness', 0)}",
                     f"{p.get('writers', '-')}w {p.get('subscribers', 1)}s "
                     f"{p.get('harness_max_pct', {}).get('median', '-')}%",
                     p["others_cpu_pct"]["median"],
                     f"{p['steady_runs']}/{p['received_per_s']['n']}"])
    pubsub = s["ceilings"].get("pubsub", {})
    rec.table(record, f"{NAME}: aggregate received updates/s (medians over "
                      f"{record.data['config']['rounds']} rounds)",
              ["point", "received/s", "spread %", "cpu cores", "per core/s", "efficiency",
               "/ forwarder", "/ plain loop", "/ pubsub", "target us/update",
               "lost: targets / harness", "harness (busiest %)", "others cpu%",
               "steady runs"], rows,
              caption=f"efficiency = aggregate / (N x 1-shard median of the same target); "
                      f"bare PUB->SUB ceiling {pubsub.get('received_per_s', 0):,.0f}/s with "
                      f"the same writers. {s['contention']}")
    e = s["estimate_16core"]
    if "inputs" in e:
        i = e["inputs"]
        rec.table(record, f"{NAME}: estimate for a 16-core host ({e['host']['config']})",
                  ["figure", "value"],
                  [["server CPU per update (us)", i["c_server_us"]],
                   ["writer CPU per update (us)", i["c_writer_us"]],
                   ["subscriber CPU per update (us)", i["c_sub_us"]],
                   ["server-bound (6 primaries)", e["server_bound_per_s"]],
                   ["writer-bound (3 writers)", e["writer_bound_per_s"]],
                   ["subscriber-bound (1 subscriber)", e["subscriber_bound_per_s"]],
                   ["estimated aggregate", e["aggregate_per_s"]],
                   ["limited by", e["limited_by"]]],
                  caption=f"{e['formula']}; {e['assumptions']}")
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
