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
from dataclasses import asdict

from bench.harness import record as rec
from bench.harness.offer import (Offer, Targets, add_offer_args, brief, check_offer_args,
                                 offer_from, run_offer)
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
    add_offer_args(ap)
    args = ap.parse_args(argv)
    check_offer_args(ap, args)
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
    from shards.common.config import load_config
    from shards.common.placement import load_plan
    from shards.common.endpoints import WILDCARDS

    try:
        plan = load_plan(path)
        return {"hosts": [sh.primary.address for sh in plan.shards],
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


def _targets(args: argparse.Namespace, offer: Offer) -> Targets:
    if args.start_shards:
        return Targets("server", args.start_shards, offer=offer)
    if args.cluster:
        c = args.cluster
        return Targets("external", offer=offer, ports=c["ports"], hosts=c["hosts"],
                       pins=tuple(tuple(p) for p in c["pins"]))
    return Targets("external", offer=offer, ports=[args.port], hosts=[args.host])


def run(args: argparse.Namespace) -> rec.Record:
    offer = offer_from(args, subscribers=args.subscribers, rate_per_s=args.rate,
                       mode=args.mode)
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    config["offer"] = asdict(offer)
    config["rate_meaning"] = "updates/s per writer (0: flat out)"
    command = rec.command_line(f"bench.{NAME}", {
        k: v for k, v in vars(args).items() if k not in ("results_dir", "cluster", "core_list")})
    record = rec.Record(NAME, command, config)
    with rec.Progress(NAME, total=args.rounds) as progress, _targets(args, offer) as targets:
        config["targets"] = targets.describe()
        for r in range(args.rounds):
            progress.step(f"round {r + 1}/{args.rounds}: {targets.shards} shard(s), "
                          f"{offer.writers} writer(s) "
                          + (f"at {offer.rate_per_s:,.0f}/s each" if offer.rate_per_s
                             else f"flat out ({offer.mode})"))
            fig = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                            progress=progress, seed=1 + 100 * r)
            fig["round"] = r + 1
            progress.note(brief(fig))
            record.add_run(fig)
        progress.finish_step()
    summarize(record)
    record.finish()
    return record


def summarize(record: rec.Record) -> None:
    runs = record.data["runs"]
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
    record.data["summary"] = summary
    record.target("updates lost (all windows)", summary["loss_window"], 1, "updates",
                  higher_is_better=False)
    if offer["rate_per_s"]:
        offered = offer["rate_per_s"] * offer["writers"]
        summary["offered_per_s"] = offered
        record.target("received / offered (median)",
                      round(summary["received_per_s"]["median"] / offered, 3), 0.99, "ratio")


def report(record: rec.Record) -> None:
    rows = []
    for r in record.data["runs"]:
        lat = r["latency_ms"]
        rows.append([r["round"], r["sent_per_s"], r["received_per_s"], r["loss_window"],
                     r["writer_drops"], lat.get("p50", "-"), lat.get("p99", "-"),
                     lat.get("p99.9", "-"), lat.get("max", "-"), r["cpu_pct"]["targets"],
                     r["cpu_pct"]["writers"], r["cpu_pct"]["subscribers"],
                     r["cpu_pct"]["others"]])
    cfg = record.data["config"]
    rec.table(record, f"{NAME}: {cfg['targets']['shards']} shard(s), {cfg['seconds']:g} s "
                      f"windows", ["round", "sent/s", "received/s", "lost", "writer drops",
                                   "p50 ms", "p99 ms", "p99.9 ms", "max ms", "targets cpu%",
                                   "writers cpu%", "subs cpu%", "others cpu%"], rows,
              caption="received/s: per subscriber (the first); cpu%: of one core over the "
                      "window; targets cpu% is 0 for servers this command did not start")
    per_shard = record.data["summary"]["per_shard_received_per_s"]
    if per_shard:
        rec.table(record, f"{NAME}: received/s per shard (last round)",
                  ["shard", "received/s"], [[i, v] for i, v in enumerate(per_shard)])
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    try:
        return bench_main(NAME, parse_args, run, report, argv)
    except (RuntimeError, TimeoutError) as exc:  # e.g. no server at the given ports
        raise SystemExit(f"{NAME}: {exc}") from None


if __name__ == "__main__":
    main()
