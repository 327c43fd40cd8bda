"""Single-shard throughput: the real shard server against a bare forwarding loop and a bare
PUB->SUB (``python -m bench single``, or ``python -m bench.chp_throughput``).

``python -m bench.chp_throughput [--seconds 5] [--rounds 3] [--keys 100000] [--value-bytes 100]``

Duration: rounds x 3 runs x (warmup + seconds + ~2 s start-up and drain): smoke
(``--seconds 1 --warmup 0.3 --rounds 1``) ~12 s; quick (2 s, 2 rounds) ~30 s; full
(``--seconds 5 --warmup 1 --rounds 5``) ~2.5 min, more with ``--quiet-wait-s``.

Each round runs the *pubsub* ceiling (bench/harness/ceilings.py: the writer's XPUB straight to
the subscriber, nothing in between: what ZeroMQ and the harness alone can move), the
*ceiling* (bench/harness/forwarder.py: SUB -> dict -> PUB, same message
shape) and then the *server* (``python -m clonemap.shards``), each a fresh process on fresh ports,
fed by the same writer and counted by the same subscriber (bench/harness/traffic.py): one writer
process flat out (``flow`` mode by default: a full pipe blocks it, so nothing is lost
before the server and a waiting writer leaves the CPU to the others), random keys from
the key space, and one subscriber counting KVPUBs. After a warm-up, each side counts
over the same absolute window. Reported per run: updates sent (writer), sequenced (the
server's sequence advance, read from the KVPUBs) and received (subscriber) per second,
sequence gaps (loss), latency samples, and the CPU each process used in the window.

The headline is the subscriber's received rate (sequenced and republished), as median
and spread over rounds, and the ratios server / ceiling (the forwarding loop) and server /
pubsub. Targets: >= 100,000 updates/s, >= 85% of the ceiling, and >= 70% of
the ceiling (the forwarding-loop target). ``summary["ceilings"]`` holds both ceilings in the shape
``bench.harness.ceilings.measure_ceilings`` returns (medians over rounds).

Two ceilings run in every round. The project's ceiling reads whole messages exactly as
the server must (``zio.recv_frames``, MORE checked on every frame). The plain
five-receive loop (``ceiling_blind``: ``bench.harness.forwarder --blind``) reads five
frames without looking at MORE: unsafe for a server, but the least Python can do per
update, so ``ratio_server_to_plain_loop`` (target >= 0.8, issue 18) says what everything
else costs.
"""
from __future__ import annotations

import argparse
import statistics

from bench.harness import record as rec
from bench.harness.ceilings import FIGURE_KEYS
from bench.harness.offer import Offer, Targets, run_offer
from bench.harness.traffic import WriterConfig
from bench.harness.fleet import config_dict
from bench.harness.procs import bench_main, wait_for_quiet

NAME = "chp_throughput"
TARGET_UPDATES_PER_S = 100_000
TARGET_RATIO = 0.85
TARGET_RATIO_ISSUE7 = 0.70
TARGETS = ("pubsub", "ceiling", "server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="single-shard CHP throughput vs a bare forwarding "
                                             "loop and a bare PUB->SUB. Duration: smoke "
                                             "(--seconds 1 --warmup 0.3 --rounds 1) ~12 s, "
                                             "quick (--seconds 2 --warmup 0.5 --rounds 2) "
                                             "~30 s, full (--seconds 5 --warmup 1 --rounds "
                                             "5) ~2.5 min, more with retries and "
                                             "--quiet-wait-s")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured window per run")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window (s)")
    ap.add_argument("--rounds", type=int, default=3, help="pubsub+ceiling+server triples")
    ap.add_argument("--keys", type=int, default=100_000, help="key space")
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--writer-mode", choices=("flow", "drop"), default="flow")
    ap.add_argument("--distribution", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--ttl-fraction", type=float, default=0.0)
    ap.add_argument("--latency-every", type=int, default=64)
    ap.add_argument("--hwm", type=int, default=100_000,
                    help="PUB SNDHWM and collector RCVHWM, the same for server and ceiling")
    ap.add_argument("--max-others-pct", type=float, default=60.0,
                    help="a run during which other processes used more than this share of "
                         "a core is kept in the record as discarded and run again (0: off)")
    ap.add_argument("--retries", type=int, default=2,
                    help="re-runs allowed per run for --max-others-pct")
    ap.add_argument("--quiet-wait-s", type=float, default=0.0,
                    help="before each run, wait up to this long for the host's busy CPU "
                         "to fall to --max-others-pct (0: do not wait)")
    ap.add_argument("--only", choices=TARGETS, default=None, help="run one target only")
    ap.add_argument("--blind-ceiling", action="store_true",
                    help="(kept for old command lines: the plain five-receive loop now "
                         "runs in every round)")
    ap.add_argument("--pin", action="store_true",
                    help="pin the target to core 0 and the writers and subscriber to the "
                         "other cores (all to core 0 on a 1-core host)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1 or args.writers < 1:
        ap.error("--seconds must be > 0, --warmup >= 0, --rounds and --writers >= 1")
    return args


def canonical_command(args: argparse.Namespace) -> str:
    opts = {k: v for k, v in vars(args).items() if k != "results_dir"}
    return rec.command_line(f"bench.{NAME}", opts)


def run_one(kind: str, args: argparse.Namespace, progress: rec.Progress) -> dict:
    """One fresh target (pubsub: none) under one load run; returns the run's figures.

    The targets and the load are ``bench.load``'s (``Targets``, ``run_offer``), as in
    every scenario; with ``--pin`` the target takes core 0 and the writers and the
    subscriber the other cores."""
    offer = Offer(writers=args.writers, keys=args.keys, value_bytes=args.value_bytes,
                  distribution=args.distribution, ttl_fraction=args.ttl_fraction,
                  mode=args.writer_mode, latency_every=args.latency_every, pin=args.pin)
    if kind == "pubsub":
        target_kind, extra = "pubsub", ()
    else:
        target_kind = "forwarder" if kind.startswith("ceiling") else "server"
        extra = ("--pub-hwm", str(args.hwm), "--collect-hwm", str(args.hwm),
                 *(("--blind",) if kind == "ceiling_blind" else ()))
    with Targets(target_kind, offer=offer, extra=extra) as targets:
        figures = run_offer(targets, warmup=args.warmup, seconds=args.seconds,
                            progress=progress)
        commands = targets.describe()["commands"]
    cpu = figures["cpu_pct"]
    cpu["target"] = cpu["targets"]
    threads = cpu.pop("first_pid_threads")  # pubsub: the first pid is a writer
    cpu["target_threads"] = threads if commands else []
    figures["target"] = kind
    figures["target_command"] = (commands[0] if commands
                                 else "(none: writer XPUB -> subscriber SUB)")
    figures["unsequenced_total"] = figures["sent_total"] - figures["sequenced_total"]
    return figures


def run(args: argparse.Namespace) -> rec.Record:
    kinds = [args.only] if args.only else list(TARGETS)
    if not args.only:  # the plain five-receive loop: the second ceiling, every round
        kinds.insert(kinds.index("ceiling") + 1, "ceiling_blind")
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    config["writer"] = config_dict(WriterConfig(collector="tcp://127.0.0.1:P+2", keys=args.keys,
                                                value_bytes=args.value_bytes,
                                                distribution=args.distribution,
                                                mode=args.writer_mode,
                                                ttl_fraction=args.ttl_fraction))
    config["order"] = [f"{r + 1}:{k}" for r in range(args.rounds) for k in kinds]
    record = rec.Record(NAME, canonical_command(args), config)
    discarded = record.data["discarded_runs"] = []
    with rec.Progress(NAME, total=args.rounds * len(kinds)) as progress:
        _rounds(record, args, kinds, discarded, progress)
        progress.finish_step()
    summarize(record, kinds)
    record.finish()
    return record


def _rounds(record: rec.Record, args: argparse.Namespace, kinds: list[str], discarded: list,
            progress: rec.Progress) -> None:
    for r in range(args.rounds):
        for kind in kinds:
            for attempt in range(1 + max(0, args.retries)):
                progress.step(f"round {r + 1}/{args.rounds} {kind} "
                              f"({args.warmup:g} s warm-up + {args.seconds:g} s)"
                              + (f", retry {attempt}" if attempt else ""))
                quiet = None
                if args.quiet_wait_s > 0:
                    quiet = wait_for_quiet(args.max_others_pct or 60.0, args.quiet_wait_s)
                    progress.note(f"host busy {quiet['host_busy_pct']}% of a core after "
                                  f"waiting {quiet['waited_s']} s")
                figures = run_one(kind, args, progress)
                figures["host_before"] = quiet
                figures["round"] = r + 1
                cpu = figures["cpu_pct"]
                progress.note(f"received {figures['received_per_s']:,.0f}/s, "
                              f"sequenced {figures['sequenced_per_s']:,.0f}/s, "
                              f"loss {figures['loss_window']}; cpu% target {cpu['target']} "
                              f"(threads {cpu['target_threads'][:2]}), writers "
                              f"{cpu['writers']}, subscriber {cpu['subscribers']}, others "
                              f"{cpu['others']}")
                busy = args.max_others_pct and cpu["others"] > args.max_others_pct
                if busy and attempt < args.retries:
                    figures["discarded"] = (f"others used {cpu['others']}% of a core "
                                            f"(> {args.max_others_pct}%)")
                    discarded.append(figures)
                    progress.note(f"discarded: {figures['discarded']}; running it again")
                    continue
                record.add_run(figures)
                break


def summarize(record: rec.Record, kinds: list[str]) -> None:
    runs = record.data["runs"]
    summary: dict = {}
    for kind in kinds:
        mine = [r for r in runs if r["target"] == kind]
        summary[kind] = {
            "received_per_s": rec.spread([r["received_per_s"] for r in mine]),
            "sequenced_per_s": rec.spread([r["sequenced_per_s"] for r in mine]),
            "sent_per_s": rec.spread([r["sent_per_s"] for r in mine]),
            "loss_window": sum(r["loss_window"] for r in mine),
            "target_cpu_pct": rec.spread([r["cpu_pct"]["target"] for r in mine]),
            "others_cpu_pct": rec.spread([r["cpu_pct"]["others"] for r in mine]),
        }
    if "server" in summary:
        server = summary["server"]["received_per_s"]["median"]
        record.target("server updates/s (received, median)", server, TARGET_UPDATES_PER_S,
                      "updates/s")
    if "ceiling_blind" in summary and "server" in summary:
        blind = summary["ceiling_blind"]["received_per_s"]["median"]
        summary["ratio_server_to_blind_ceiling"] = round(server / blind, 3) if blind else 0.0
        summary["ratio_server_to_plain_loop"] = summary["ratio_server_to_blind_ceiling"]
        record.target("server / plain five-receive loop (medians)",
                      summary["ratio_server_to_plain_loop"], 0.8, "ratio")
    if "ceiling" in summary and "server" in summary:
        ceiling = summary["ceiling"]["received_per_s"]["median"]
        ratio = server / ceiling if ceiling else 0.0
        pairs = [s["received_per_s"] / c["received_per_s"]
                 for c, s in zip([r for r in runs if r["target"] == "ceiling"],
                                 [r for r in runs if r["target"] == "server"])
                 if c["received_per_s"]]
        summary["ratio_server_to_ceiling"] = round(ratio, 3)
        summary["ratio_per_round"] = [round(p, 3) for p in pairs]
        summary["ratio_per_round_median"] = round(statistics.median(pairs), 3) if pairs else None
        record.target("server / ceiling (medians)", round(ratio, 3), TARGET_RATIO, "ratio")
        record.target("server / forwarding loop (medians)", round(ratio, 3),
                      TARGET_RATIO_ISSUE7, "ratio")
    if "pubsub" in summary and "server" in summary:
        pubsub = summary["pubsub"]["received_per_s"]["median"]
        summary["ratio_server_to_pubsub"] = round(server / pubsub, 3) if pubsub else 0.0
    summary["ceilings"] = ceilings_of(runs, record.data["config"])
    record.data["summary"] = summary


def ceilings_of(runs: list[dict], config: dict) -> dict:
    """``summary["ceilings"]`` in ``measure_ceilings``' shape: per kind, the figures of the
    round with the median received rate, and the spread over rounds."""
    out: dict = {"config": {k: config.get(k) for k in ("seconds", "warmup", "keys",
                                                         "value_bytes", "writers", "pin")}}
    out["config"].update(rate_per_s=0.0, writer_mode=config.get("writer_mode"),
                         kinds=["pubsub", "forwarder"])
    for kind, name in (("pubsub", "pubsub"), ("ceiling", "forwarder")):
        mine = sorted((r for r in runs if r["target"] == kind),
                      key=lambda r: r["received_per_s"])
        if not mine:
            continue
        mid = mine[(len(mine) - 1) // 2]
        out[name] = {k: mid.get(k) for k in FIGURE_KEYS}
        out[name]["writer_drops"] = mid.get("writer_drops", mid["dropped_at_writer_total"])
        out[name]["cpu_cores"] = mid.get("cpu_cores")
        out[name]["rounds"] = rec.spread([r["received_per_s"] for r in mine])
    return out


def report(record: rec.Record) -> None:
    rows = []
    for r in record.data["runs"]:
        lat = r["latency_ms"]
        rows.append([f"{r['round']} {r['target']}", r["sent_per_s"], r["sequenced_per_s"],
                     r["received_per_s"], r["loss_window"], r["dropped_at_writer_total"],
                     lat.get("p50", "-"), lat.get("p99", "-"), r["cpu_pct"]["target"],
                     r["cpu_pct"]["writers"], r["cpu_pct"]["subscribers"],
                     r["cpu_pct"]["others"]])
    rec.table(record, f"{NAME}: runs ({record.data['config']['seconds']:g} s windows)",
                    ["run", "sent/s", "sequenced/s", "received/s", "lost", "writer drops",
                     "p50 ms", "p99 ms", "target cpu%", "writer cpu%", "sub cpu%",
                     "others cpu%"], rows,
                    caption="cpu%: of one core, over the window; 'others' = the rest of the "
                            "host's busy time (other processes, kernel)")
    rows = []
    for kind, s in record.data["summary"].items():
        if isinstance(s, dict) and "received_per_s" in s:
            x = s["received_per_s"]
            rows.append([kind, x["median"], x["min"], x["max"], x["spread_pct"],
                         s["target_cpu_pct"]["median"]])
    summary = record.data["summary"]
    ratio = summary.get("ratio_server_to_ceiling")
    caption = (f"server / ceiling = {ratio} (medians); per round "
               f"{summary['ratio_per_round']}") if ratio is not None else ""
    if "ratio_server_to_pubsub" in summary:
        caption += f"; server / pubsub = {summary['ratio_server_to_pubsub']}"
    if "ratio_server_to_blind_ceiling" in summary:
        caption += (f"; server / plain five-receive loop = "
                    f"{summary['ratio_server_to_blind_ceiling']}")
    rec.table(record, f"{NAME}: received updates/s over rounds",
              ["target", "median", "min", "max", "spread %", "cpu% (median)"], rows,
              caption=caption)
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
