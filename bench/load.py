"""``python -m bench load``: offer KVSET load to CHP shard servers and count what they publish.

Targets (one of):

* ``--port P`` - one running server (collector P+2, publisher P+1);
* ``--config configs/X.yaml`` - a running cluster: every shard's *primary* (its ports from
  the config), keys routed as a client routes them (shard count and pinned prefixes from
  the config). A shard whose backup has taken over is not followed: its writes time out
  (flow mode) or are dropped and counted (rate mode);
* ``--start-shards N`` - N standalone servers started here on free ports, each told the
  routing and its shard index (so it checks ownership as in a cluster), ended by PID.

Load: ``--writers W`` processes (``--pin``: one core each, targets first), each flat out
(``flow``: a full pipe blocks the writer, nothing is dropped) or at ``--rate R`` updates/s
*per writer* (open loop: latency counts from the intended send time; a full pipe drops
and counts). Keys ``--distribution uniform|zipf`` over ``--keys``, ``--value-bytes``,
``--ttl-fraction`` of the updates with ``ttl=--ttl-s``. ``--subscribers N`` processes each
read every shard's publisher, with a sequence and gap count per shard.

While it runs, a live line shows the received rate (``record.Progress``); at the end a
summary table and a JSON record (``bench/results/load-<UTC>.json``, host facts
included). Duration: ``--warmup`` + ``--seconds`` per round plus ~2 s of start-up
(smoke: ``--seconds 1 --warmup 0.3`` ~4 s; full: ``--seconds 10 --rounds 3`` ~40 s).

The harness it runs on (``Offer``, ``Targets``, ``run_offer``) is ``bench.harness.offer``.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, replace

from bench.harness import record as rec
from bench.harness.offer import (HarnessPlan, Offer, Targets, add_offer_args, brief,
                                 check_offer_args, harness_plan, offer_from, run_offer,
                                 usable_cores)
from bench.harness.procs import bench_main

NAME = "load"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench load",
        description="Offer KVSET load to CHP shard servers (a running server, a running "
                    "cluster's primaries, or N servers started here) and count what they "
                    "publish. Duration: rounds x (warmup + seconds) + ~2 s start-up; smoke "
                    "(--seconds 1 --warmup 0.3) ~4 s, full (--seconds 10 --rounds 3) ~40 s.")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="a running server's port base P")
    where.add_argument("--config", help="a running cluster's config (YAML): load every "
                                        "shard's primary, keys routed as a client does")
    where.add_argument("--start-shards", type=int, metavar="N",
                       help="start N standalone shard servers here (ended at exit)")
    ap.add_argument("--host", default="127.0.0.1", help="with --port: the server's address")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per round")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--subscribers", type=int, default=1,
                    help="subscriber processes, each reading every shard")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="open loop: updates/s offered PER WRITER (0: flat out)")
    ap.add_argument("--mode", choices=("flow", "drop"), default="flow",
                    help="flat out: flow (a full pipe blocks the writer) or drop (counts)")
    ap.add_argument("--split", action="store_true",
                    help="the subscribers split the shards between them (shard i to "
                         "subscriber i mod N) instead of each reading every shard")
    ap.add_argument("--harness", choices=("fixed", "auto"), default="fixed",
                    help="auto: writers and subscribers sized from the harness cores "
                         "(--cores, or the usable cores no server of --config is pinned "
                         "to), subscribers split the shards; the plan is printed first")
    ap.add_argument("--rates-of-max", default="",
                    help="after the flat-out rounds, one round at each of these fractions "
                         "of their median received rate (open loop, spread over the "
                         "writers), e.g. 0.25,0.5")
    add_offer_args(ap)
    args = ap.parse_args(argv)
    check_offer_args(ap, args)
    try:
        args.fractions = [float(x) for x in args.rates_of_max.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rates-of-max: comma-separated fractions, got {args.rates_of_max!r}")
    if any(not 0 < f <= 1 for f in args.fractions):
        ap.error("--rates-of-max: each fraction in (0, 1]")
    if args.fractions and args.rate:
        ap.error("--rates-of-max measures the maximum flat out first: leave --rate out")
    if args.subscribers < 1 or args.rate < 0:
        ap.error("--subscribers must be >= 1 and --rate >= 0")
    if args.start_shards is not None and not 1 <= args.start_shards <= 64:
        ap.error("--start-shards must be in 1..64")
    if args.port is not None and not 1 <= args.port <= 65533:
        ap.error("--port must be in 1..65533")
    args.cluster = None
    if args.config:
        args.cluster = _cluster_from(ap, args.config)
    return args


def _cluster_from(ap: argparse.ArgumentParser, path: str) -> dict:
    """Every shard's primary (address, port) and the routing's pins, from a config: planned
    on this host (NIC names resolved), or - when the plan does not fit this host, e.g. the
    cluster runs elsewhere - read as written (each primary then needs a ``host``)."""
    from clonemap.shards.common.config import load_config
    from clonemap.shards.common.placement import load_plan
    from clonemap.shards.common.endpoints import WILDCARDS

    try:
        plan = load_plan(path)
        return {"hosts": [sh.primary.address for sh in plan.shards],
                "server_cores": sorted({c for sh in plan.shards
                                        for srv in (sh.primary, sh.backup)
                                        for c in srv.cores}),
                "ports": [sh.primary.port for sh in plan.shards],
                "pins": sorted(plan.routing.pins().items()),
                "shards": [sh.name for sh in plan.shards], "planned_here": True}
    except Exception as exc:  # ConfigError, OSError, YAML errors
        planned_error = exc
    try:
        cfg = load_config(path)
    except Exception as exc:
        ap.error(f"--config {path}: {exc}")
    hosts = [sh.primary.host for sh in cfg.shards]
    if None in hosts or any(h in WILDCARDS for h in hosts):
        ap.error(f"--config {path}: it does not fit this host ({planned_error}), and not "
                 "every primary names an address (host:) to connect to")
    return {"hosts": hosts, "ports": [sh.primary.port for sh in cfg.shards],
            "pins": sorted((p, i) for i, sh in enumerate(cfg.shards) for p in sh.prefixes),
            "shards": [sh.name for sh in cfg.shards], "planned_here": False}


def _targets(args: argparse.Namespace, offer: Offer, server_pids=()) -> Targets:
    if args.start_shards:
        return Targets("server", args.start_shards, offer=offer)
    if args.cluster:
        c = args.cluster
        return Targets("external", offer=offer, ports=c["ports"], hosts=c["hosts"],
                       pins=tuple(tuple(p) for p in c["pins"]), pids=server_pids)
    return Targets("external", offer=offer, ports=[args.port], hosts=[args.host],
                   pids=server_pids)


def auto_plan(args: argparse.Namespace) -> HarnessPlan:
    """The harness for ``--harness auto``: servers started here get cores first; a
    running cluster's servers keep theirs, and the harness takes ``--cores`` or every
    usable core that no server of the config is pinned to."""
    if args.start_shards:
        return harness_plan(args.start_shards, harness_cores=args.core_list)
    shards = len(args.cluster["ports"]) if args.cluster else 1
    spare = list(args.core_list)
    if not spare:
        taken = set((args.cluster or {}).get("server_cores", ()))
        spare = [c for c in usable_cores() if c not in taken] or usable_cores()
    return harness_plan(shards, harness_cores=spare)


def run(args: argparse.Namespace, name: str = NAME, server_pids=(),
        before_rate=None) -> rec.Record:
    """``name``: the record's (``bench cluster`` saves its own); ``server_pids``: running
    servers whose CPU the record counts as the targets'; ``before_rate``: called before
    each fixed-rate window (``bench cluster``: wait for the compactions the flat-out
    rounds started), its dict kept as the window's ``before``."""
    offer = offer_from(args, subscribers=args.subscribers, rate_per_s=args.rate,
                       mode=args.mode, split=args.split)
    plan = None
    if args.harness == "auto":
        plan = auto_plan(args)
        offer = replace(offer, writers=plan.writers, subscribers=plan.subscribers,
                        split=True, cores=tuple(plan.harness_cores))
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    config["offer"] = asdict(offer)
    config["rate_meaning"] = "updates/s per writer (0: flat out)"
    command = rec.command_line(f"bench.{NAME}", {
        k: v for k, v in vars(args).items()
        if k not in ("results_dir", "cluster", "core_list", "fractions")})
    record = rec.Record(name, command, config)
    if plan is not None:
        config["plan"] = {"writers": plan.writers, "subscribers": plan.subscribers,
                          "harness_cores": plan.harness_cores, "why": plan.why}
    total = args.rounds + len(args.fractions)
    with (rec.Progress(name, total=total) as progress,
          _targets(args, offer, server_pids) as targets):
        config["targets"] = targets.describe()
        if plan is not None:
            for line in plan.lines("shard" if not args.start_shards else "server"):
                progress.note(line)
        for r in range(args.rounds):
            progress.step(f"round {r + 1}/{args.rounds}: {targets.shards} shard(s), "
                          f"{offer.writers} writer(s) "
                          + (f"at {offer.rate_per_s:,.0f}/s each" if offer.rate_per_s
                             else f"flat out ({offer.mode})"))
            fig = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                            progress=progress, seed=1 + 100 * r)
            fig["round"] = r + 1
            fig["phase"] = "rate" if offer.rate_per_s else "flat"
            progress.note(brief(fig))
            record.add_run(fig)
        flat = [r["received_per_s"] for r in record.data["runs"]]
        for j, frac in enumerate(args.fractions):
            per_writer = round(frac * statistics.median(flat) / offer.writers, 1)
            fixed = replace(offer, rate_per_s=per_writer)
            progress.step(f"{frac:.0%} of the flat-out median: {per_writer:,.0f}/s x "
                          f"{offer.writers} writer(s)")
            before = before_rate() if before_rate is not None else None
            if before:
                progress.note(f"before it: {before}")
            fig = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                            offer=fixed, progress=progress, seed=1000 + j)
            fig.update(round=args.rounds + j + 1, phase="rate", fraction_of_max=frac,
                       offered_per_s=round(per_writer * offer.writers, 1))
            if before:
                fig["before"] = before
            progress.note(brief(fig))
            record.add_run(fig)
        progress.finish_step()
    summarize(record)
    record.finish()
    return record


def summarize(record: rec.Record) -> None:
    every = record.data["runs"]
    runs = [r for r in every if "fraction_of_max" not in r]
    offer = record.data["config"]["offer"]
    lat = lambda p: rec.spread([r["latency_ms"][p] for r in runs if r["latency_ms"]], 3)  # noqa
    summary = {
        "received_per_s": rec.spread([r["received_per_s"] for r in runs]),
        "sent_per_s": rec.spread([r["sent_per_s"] for r in runs]),
        "sequenced_per_s": rec.spread([r["sequenced_per_s"] for r in runs]),
        "loss_window": sum(r["loss_window"] for r in runs),
        "writer_drops": sum(r["writer_drops"] for r in runs),
        "latency_ms": {p: lat(p) for p in ("p50", "p90", "p99", "p99.9", "max")},
        "cpu_cores": rec.spread([r["cpu_cores"] for r in runs]),
        "per_shard_received_per_s": [
            round(s["received_window"] / (r["window_s"] or 1e-9), 1)
            for r in runs[-1:] for s in r["per_source"]],
    }
    summary["loss_targets"] = sum(r.get("loss_targets", r["loss_window"]) for r in every)
    summary["loss_harness"] = sum(r.get("loss_harness", 0) for r in every)
    summary["harness_max_pct"] = max((r.get("harness_max_pct", 0.0) for r in every),
                                     default=0.0)
    summary["at_fractions"] = [
        {"fraction_of_max": r["fraction_of_max"], "offered_per_s": r["offered_per_s"],
         "received_per_s": r["received_per_s"], "loss": r["loss_window"],
         "latency_ms": r["latency_ms"], "harness_bound": r.get("harness_bound", "")}
        for r in every if "fraction_of_max" in r]
    record.data["summary"] = summary
    hot = "; ".join(r["harness_bound"] for r in every if r.get("harness_bound"))
    record.target("updates lost by the servers (all windows)", summary["loss_targets"], 1,
                  "updates", higher_is_better=False, harness_bound=hot)
    for point in summary["at_fractions"]:
        if point["fraction_of_max"] == 0.25 and point["latency_ms"]:
            record.target("p99 at 25% of the flat-out rate", point["latency_ms"]["p99"],
                          1.0, "ms", higher_is_better=False,
                          harness_bound=point["harness_bound"])
    if offer["rate_per_s"]:
        offered = offer["rate_per_s"] * offer["writers"]
        summary["offered_per_s"] = offered
        record.target("received / offered (median)",
                      round(summary["received_per_s"]["median"] / offered, 3), 0.99, "ratio")


def report(record: rec.Record) -> None:
    rows = []
    for r in record.data["runs"]:
        lat = r["latency_ms"]
        rows.append([r["round"] if "fraction_of_max" not in r
                     else f"{r['fraction_of_max']:.0%} of max", r["sent_per_s"],
                     r["received_per_s"], f"{r.get('loss_targets', r['loss_window'])} / "
                     f"{r.get('loss_harness', 0)}",
                     r["writer_drops"], lat.get("p50", "-"), lat.get("p99", "-"),
                     lat.get("p99.9", "-"), lat.get("max", "-"), r["cpu_pct"]["targets"],
                     r["cpu_pct"]["writers"], r["cpu_pct"]["subscribers"],
                     r["cpu_pct"]["others"]])
    cfg = record.data["config"]
    rec.table(record, f"{record.data['benchmark']}: {cfg['targets']['shards']} shard(s), {cfg['seconds']:g} s "
                      f"windows", ["round", "sent/s", "received/s", "lost: servers / harness",
                                   "writer drops",
                                   "p50 ms", "p99 ms", "p99.9 ms", "max ms", "targets cpu%",
                                   "writers cpu%", "subs cpu%", "others cpu%"], rows,
              caption="received/s: per subscriber (the first), or the sum when the "
                      "subscribers split the shards; lost: charged to the servers, or to "
                      "the harness when the subscriber that missed updates was over 90% of "
                      "a core; cpu%: of one core over the window; targets cpu% is 0 for "
                      "servers this command did not start")
    per_shard = record.data["summary"]["per_shard_received_per_s"]
    if per_shard:
        rec.table(record, f"{record.data['benchmark']}: received/s per shard (last round)",
                  ["shard", "received/s"], [[i, v] for i, v in enumerate(per_shard)])
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    try:
        return bench_main(NAME, parse_args, run, report, argv)
    except (RuntimeError, TimeoutError) as exc:  # e.g. no server at the given ports
        raise SystemExit(f"{NAME}: {exc}") from None


if __name__ == "__main__":
    main()
