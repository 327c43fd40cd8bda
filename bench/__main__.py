"""``python -m bench``: the benchmark scenarios, one command each, and all of them in a row.

    python -m bench <scenario> [options]       # one scenario; options go to its module
    python -m bench all [--smoke|--full] [--only NAME ...]   # every scenario, then the report
    python -m bench [--smoke|--full] [--only NAME ...]       # the same as ``all``

Profiles (``--smoke``, quick by default, ``--full``, ``--profile 16core``) are defined once,
in ``PROFILES``: each one's sizes for every scenario and what it is for, which ``python -m
bench --help`` prints.
Each scenario prints its tables and saves a JSON record under ``--results-dir`` (default
bench/results/, newest copy in bench/results/latest/<record>.json); ``all`` ends with the
report (Markdown + PNG plots from the latest records) and a table of what ran. A scenario
that fails does not stop the others; ``all`` then exits with status 1.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from dataclasses import dataclass

from bench.harness import record as rec


@dataclass(frozen=True)
class Scenario:
    module: str
    record: str | None
    """The record it saves (``bench/results/latest/<record>.json``); None for the report."""
    about: str
    duration: dict
    """Expected wall time per profile on this 2-core host."""


SCENARIOS = {
    "single": Scenario("bench.chp_throughput", "chp_throughput",
                       "single-shard throughput: server vs bare forwarding loop vs bare "
                       "PUB->SUB", {"smoke": "~12 s", "quick": "~30 s", "full": "~3.5 min"}),
    "scaleout": Scenario("bench.scaleout", "scaleout",
                         "the same load over 1, 2, 4 shards: aggregate updates/s, per-core "
                         "efficiency", {"smoke": "~15 s", "quick": "~1.7 min", "full": "~4.5 min"}),
    "latency": Scenario("bench.latency", "latency",
                        "open-loop fixed rates (% of the single-shard max): p50..p99.9, max",
                        {"smoke": "~10 s", "quick": "~45 s", "full": "~3.5 min"}),
    "load": Scenario("bench.load", "load",
                     "the load generator (pinned writers, fixed rate or flat out, uniform/zipf, "
                     "TTL mix) and timing subscribers", {"smoke": "~4 s", "quick": "~10 s",
                                                         "full": "~40 s"}),
    "snapshot": Scenario("bench.snapshot", "snapshot",
                         "snapshot join time and memory per key (10k, 100k, 1M keys) vs a bare "
                         "PUB->SUB carrying N messages", {"smoke": "~6 s", "quick": "~15 s",
                                                          "full": "~1.5-4 min"}),
    "fanout": Scenario("bench.fanout", "fanout",
                       "one writer, N subscribing clients, 1 and 4 shards: delivered/s and "
                       "latency vs PUB->SUB at the same rate",
                       {"smoke": "~8 s", "quick": "~45 s", "full": "~2.5 min"}),
    "failover": Scenario("bench.failover", "failover",
                         "Binary Star kill -9: gap, client resume vs its silence timeout, "
                         "lost writes", {"smoke": "~8 s", "quick": "~20 s", "full": "~1 min"}),
    "failover_supervised": Scenario(
        "bench.failover_supervised", "failover_supervised",
        "the cluster as users run it: supervisor kill of s0's active, restarted PASSIVE by "
        "the supervisor: wait=True stall, new Clone, chp get", {"smoke": "~20 s",
                                                               "quick": "~45 s",
                                                               "full": "~45 s"}),
    "handoff": Scenario("bench.handoff", "handoff",
                        "watch callbacks run inline vs handed off to a thread",
                        {"smoke": "~5 s", "quick": "~15 s", "full": "~20 s"}),
    "durability": Scenario("bench.durability", "durability",
                           "persisting vs memory only: updates/s and CPU per update per fsync "
                           "policy, p99 under compaction, recovery of 1M keys, disk bytes "
                           "per key", {"smoke": "~25 s", "quick": "~2 min", "full": "~5 min"}),
    "curve": Scenario("bench.curve", "curve",
                      "CURVE on every socket vs plain TCP, same run: single-shard updates/s, "
                      "CPU per update, snapshot time", {"smoke": "~15 s", "quick": "~1 min",
                                                        "full": "~2 min"}),
    "slow_subscriber": Scenario(
        "bench.slow_subscriber", "slow_subscriber",
        "one never-reading subscriber and 8 KB values: server RSS and the other "
        "subscribers' delivery time, byte budgets on and off",
        {"smoke": "~10 s", "quick": "~30 s", "full": "~1 min"}),
    "relays": Scenario(
        "bench.relays", "relays",
        "relays and resume: fan-out latency per relay hop, failover cost direct vs "
        "resume vs relays, memory per relay", {"smoke": "~30 s", "quick": "~1.5 min",
                                               "full": "~5.5 min"}),
    "hot_path": Scenario(
        "bench.hot_path", "hot_path",
        "one shard (fsync everysec) vs the plain five-receive loop and the project's "
        "forwarder, same run: flat out, CPU per update at 50k/s, p99 at half load "
        "pinned and not", {"smoke": "~45 s", "quick": "~2 min", "full": "~2.5 min"}),
    "conditional": Scenario(
        "bench.conditional", "conditional",
        "compare-and-set writes vs plain wait=True writes, same run: writes/s, p50/p99 "
        "ack latency, and one contended counter", {"smoke": "~15 s", "quick": "~40 s",
                                                    "full": "~1.5 min"}),
    "cluster": Scenario(
        "bench.cluster", "cluster",
        "supervisor start of a durable, replicated config, then load with a harness sized "
        "from the cores the servers leave: flat out and at 25% of that",
        {"smoke": "~15 s", "quick": "~25 s", "full": "~1 min"}),
    "hosts": Scenario(
        "bench.hosts", "hosts",
        "a pair across hosts (network namespaces, a real etcd): wait=True writes/s and "
        "ack p50/p99 on one host, across hosts acknowledged by both and by the active "
        "alone, and the takeover when the active's host dies (needs root)",
        {"smoke": "~30 s", "quick": "~1.5 min", "full": "~4 min"}),
    "peers": Scenario(
        "bench.peers", "peers",
        "clonemap against Redis, NATS JetStream KV and etcd at everyday rates, same run: "
        "CPU and latency per acknowledged write at 5,000/s, writes/s with 1 and 100 in "
        "flight, fan-out to 16 watchers, joining a 100,000-key map, and reads of the live "
        "map by 4 processes through each system's read paths (reads/s, staleness), a copy "
        "of the map cut off for 5 s (time and bytes to be current) and its memory per key "
        "(a peer this host lacks is reported missing)",
        {"smoke": "~1.5 min", "quick": "~16 min", "full": "~28 min"}),
    "reshard": Scenario(
        "bench.reshard", "reshard",
        "2 -> 3 shards under supervisor start while wait=True writes run: the change's "
        "time, the writes' waits, the follower's bytes", {"smoke": "~30 s", "quick": "~50 s",
                                                          "full": "~2 min"}),
    "read_burst": Scenario(
        "bench.read_burst", "read_burst",
        "a reader's get latency (p50/p99/max) while its client applies a burst of "
        "100,000 updates, against a plain dict in the same process",
        {"smoke": "~10 s", "quick": "~25 s", "full": "~40 s"}),
    "report": Scenario("bench.report", None,
                       "Markdown report + PNG plots from the latest records",
                       {"smoke": "~5 s", "quick": "~5 s", "full": "~5 s"}),
}
ALIASES = {"chp_throughput": "single"}
ALL_DURATION = {"smoke": "~2.5 min", "quick": "~8.5 min", "full": "~25 min"}
ORDER = ["single", "scaleout", "latency", "load", "snapshot", "fanout", "failover", "handoff",
         "durability", "curve", "slow_subscriber", "relays", "hot_path"]
"""What ``all`` runs, in this order, then ``report`` (``failover_supervised`` runs alone:
it starts a whole 8-server cluster; ``conditional`` too: it measures the client API;
``peers`` runs other projects' servers, installed apart; ``read_burst`` measures a
client's reads, the peers' read workload's companion; ``reshard`` starts a whole
cluster and changes it;
``cluster`` belongs to the 16core profile, sized for a many-core host; ``hosts`` needs
root, for its network namespaces)."""

ONLY_ORDER = [*ORDER, *(n for n in SCENARIOS if n not in ORDER and n != "report"),
              "report"]
"""Every scenario ``--only`` takes, in the order they run (``failover_supervised`` too)."""

@dataclass(frozen=True)
class Profile:
    """One set of sizes for ``all``: what it is for (the help says it), each scenario's
    options, and the scenarios it runs in order (None: ``ORDER``, then the report)."""

    about: str
    args: dict[str, list[str]]
    order: list[str] | None = None


PROFILES: dict[str, Profile] = {
    "smoke": Profile("tiny sizes, seconds each: checks that nothing rotted", {
        "single": ["--seconds", "0.5", "--warmup", "0.2", "--rounds", "1", "--keys", "2000",
                   "--retries", "0"],
        "scaleout": ["--shards", "1,2", "--seconds", "0.3", "--warmup", "0.1", "--rounds", "1",
                     "--harness", "auto"],
        "latency": ["--fractions", "0.5", "--seconds", "0.3", "--warmup", "0.1",
                    "--max-seconds", "0.5", "--rounds", "1"],
        "load": ["--start-shards", "2", "--writers", "2", "--rate", "1000",
                 "--distribution", "zipf", "--ttl-fraction", "0.1", "--ttl-s", "5",
                 "--seconds", "0.5", "--warmup", "0.2", "--rounds", "1"],
        "snapshot": ["--keys", "2000", "--repeats", "1", "--warmup-snapshots", "0",
                     "--ceiling-s", "0.3"],
        "fanout": ["--shards", "1,2", "--subscribers", "1,4", "--rate", "200",
                   "--seconds", "0.5", "--warmup", "0", "--ceiling-s", "0.3"],
        "failover": ["--kills", "2", "--rate", "200", "--steady-s", "0.3",
                     "--ceiling-s", "0.3"],
        "failover_supervised": ["--kills", "1"],
        "hosts": ["--seconds", "0.5", "--rounds", "1", "--in-flight", "1", "--takeovers", "1"],
        "cluster": ["--config", "configs/2shard.yaml", "--seconds", "0.5", "--warmup",
                    "0.2", "--rounds", "1"],
        "read_burst": ["--keys", "2000", "--burst", "5000", "--idle-s", "0.3", "--rounds", "1"],
        "reshard": ["--keys", "20000", "--segments", "2000", "--rate", "1000", "--before-s",
                    "1", "--after-s", "1"],
        "conditional": ["--seconds", "0.5", "--warmup", "0.2", "--rounds", "1",
                        "--writers", "2"],
        "handoff": ["--modes", "inline,thread,workers", "--workers", "1,2", "--work", "cpu",
                    "--rate", "300", "--seconds", "0.5"],
        "durability": ["--seconds", "0.3", "--warmup", "0.1", "--rounds", "1", "--keys",
                       "2000", "--rate", "1000", "--recovery-keys", "5000"],
        "curve": ["--seconds", "0.3", "--warmup", "0.1", "--rounds", "1", "--keys", "2000",
                  "--snapshot-keys", "2000"],
        "slow_subscriber": ["--writes", "3000", "--rounds", "1"],
        "relays": ["--subscribers", "20", "--clients", "10", "--keys", "2000", "--rounds",
                   "1", "--seconds", "0.3", "--warmup", "0.1", "--processes", "2"],
        "hot_path": ["--seconds", "0.3", "--warmup", "0.1", "--rounds", "1", "--keys", "2000",
                     "--rate", "5000"],
        "peers": ["--keys", "2000", "--rounds", "1", "--seconds", "0.5", "--warmup", "0.2",
                  "--rate", "500", "--fanout-rate", "200", "--watchers", "4",
                  "--cut-s", "0.5", "--memory-keys", "2000"],
        "report": [],
    }),
    "quick": Profile("the default: a few minutes in all", {
        "single": ["--seconds", "2", "--warmup", "0.5", "--rounds", "2"],
        "scaleout": ["--shards", "1,2,4", "--seconds", "2", "--warmup", "1", "--rounds", "2"],
        "latency": ["--fractions", "0.25,0.5,0.9", "--seconds", "2", "--warmup", "0.5",
                    "--rounds", "1", "--pin"],
        "load": ["--start-shards", "2", "--writers", "2", "--rate", "5000",
                 "--distribution", "zipf", "--ttl-fraction", "0.1", "--ttl-s", "5",
                 "--seconds", "3", "--warmup", "0.5", "--rounds", "2"],
        "snapshot": ["--keys", "10000,100000", "--repeats", "3", "--ceiling-s", "1"],
        "fanout": ["--shards", "1,4", "--subscribers", "1,4,16", "--rate", "1000",
                   "--seconds", "3", "--warmup", "0.5", "--ceiling-s", "1"],
        "failover": ["--kills", "3", "--rate", "500", "--steady-s", "1", "--ceiling-s", "1"],
        "failover_supervised": ["--kills", "3"],
        "hosts": [],
        "cluster": ["--config", "configs/2shard.yaml", "--seconds", "2", "--warmup", "0.5",
                    "--rounds", "2"],
        "read_burst": ["--rounds", "2", "--idle-s", "0.5"],
        "reshard": ["--keys", "300000", "--segments", "30000"],
        "conditional": ["--seconds", "2", "--warmup", "0.5", "--rounds", "2"],
        "handoff": ["--rate", "40000", "--seconds", "2"],
        "durability": ["--seconds", "2", "--warmup", "0.5", "--rounds", "2",
                       "--recovery-keys", "200000"],
        "curve": ["--seconds", "2", "--warmup", "0.5", "--rounds", "2"],
        "slow_subscriber": ["--writes", "20000", "--rounds", "2"],
        "relays": ["--subscribers", "100", "--clients", "50", "--keys", "10000",
                   "--rounds", "1"],
        "hot_path": ["--seconds", "2", "--warmup", "0.5", "--rounds", "2"],
        "peers": ["--rounds", "3", "--seconds", "3", "--warmup", "1",
                  "--memory-keys", "100000"],
        "report": [],
    }),
    "full": Profile("the figures the committed report quotes", {
        "single": ["--seconds", "5", "--warmup", "1", "--rounds", "5",
                   "--quiet-wait-s", "15"],
        "scaleout": ["--shards", "1,2,4", "--seconds", "4", "--warmup", "1", "--rounds", "3"],
        "latency": ["--fractions", "0.1,0.25,0.5,0.75,0.9", "--seconds", "3", "--warmup", "1",
                    "--rounds", "2", "--pin"],
        "load": ["--start-shards", "2", "--writers", "2", "--rate", "5000",
                 "--distribution", "zipf", "--ttl-fraction", "0.1", "--ttl-s", "5",
                 "--seconds", "10", "--warmup", "1", "--rounds", "3"],
        "snapshot": ["--keys", "10000,100000,1000000", "--repeats", "3",
                     "--quiet-wait-s", "20", "--ceiling-s", "3"],
        "fanout": ["--shards", "1,4", "--subscribers", "1,4,16", "--rate", "1000",
                   "--seconds", "5", "--warmup", "1", "--rounds", "2", "--ceiling-s", "3"],
        "failover": ["--kills", "10", "--rate", "500", "--steady-s", "2", "--ceiling-s", "3"],
        "failover_supervised": ["--kills", "5"],
        "hosts": ["--seconds", "8", "--rounds", "3", "--takeovers", "3"],
        "cluster": ["--config", "configs/2shard.yaml", "--seconds", "4", "--warmup", "1",
                    "--rounds", "3"],
        "read_burst": ["--rounds", "3"],
        "reshard": [],
        "conditional": ["--seconds", "4", "--warmup", "1", "--rounds", "3"],
        "handoff": ["--rate", "40000", "--seconds", "3"],
        "durability": ["--seconds", "4", "--warmup", "1", "--rounds", "3"],
        "curve": ["--seconds", "4", "--warmup", "1", "--rounds", "3"],
        "slow_subscriber": ["--writes", "40000", "--rounds", "3"],
        "relays": ["--subscribers", "200", "--clients", "100", "--keys", "100000",
                   "--rounds", "1"],
        "hot_path": ["--seconds", "3", "--warmup", "1", "--rounds", "3"],
        "peers": ["--rounds", "5", "--seconds", "4", "--warmup", "1"],
        "report": [],
    }),
    # Every scenario sizes its harness from the cores (plans printed first).
    "16core": Profile(
        "a many-core host (16 cores): scale-out to 6 shards, the supervised cluster flat "
        "out and at 25%/50%, 1,000 subscribers direct and through relays, failover, "
        "worker hand-off; ~6 min", {
        "scaleout": ["--shards", "1,2,4,6", "--seconds", "3", "--warmup", "1", "--rounds",
                     "1", "--pin", "--harness", "auto"],
        "cluster": ["--config", "configs/16core-cluster.yaml", "--seconds", "3", "--warmup",
                    "1", "--rounds", "2", "--rates-of-max", "0.25,0.5"],
        # four I/O threads: direct fan-out to 1,000 subscribers is bound by one
        "relays": ["--parts", "fanout", "--sizes", "250x1000,1000x200,1000x1000",
                   "--relays", "4", "--io-threads", "4", "--seconds", "3", "--warmup", "1",
                   "--rounds", "1"],
        "failover": ["--kills", "3", "--rate", "500", "--steady-s", "1", "--ceiling-s", "1"],
        "handoff": ["--modes", "inline,thread,workers", "--work", "cpu", "--work-us", "50",
                    "--workers", "1,2,4,8", "--rate", "100000", "--seconds", "1"],
        "report": [],
    }, order=["scaleout", "cluster", "relays", "failover", "handoff", "report"]),
}


def _epilog() -> str:
    lines = ["scenarios (python -m bench <name> --help for each one's options):"]
    for name, sc in SCENARIOS.items():
        d = sc.duration
        lines.append(f"  {name:9} {sc.about}")
        lines.append(f"  {'':9}   [{sc.module}; smoke {d['smoke']}, quick {d['quick']}, "
                     f"full {d['full']}]")
    lines.append("  all       every scenario above in a profile, the report last "
                 f"[smoke {ALL_DURATION['smoke']}, quick {ALL_DURATION['quick']}, "
                 f"full {ALL_DURATION['full']}]")
    return "\n".join(lines)


def _load(name: str):
    """The scenario's ``main``, imported now (a module not written yet fails only here)."""
    module = SCENARIOS[name].module
    try:
        return importlib.import_module(module).main
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise LookupError(f"scenario {name!r}: {module} does not exist (yet)") from None


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, usage=f"{prog} [<scenario> [options] | all] [--smoke|--full] [--only NAME]",
        description="The benchmark scenarios, one command each (python -m bench <scenario> "
                    "[options]), and all of them in a row (python -m bench all [options], "
                    "or no scenario): every scenario in a profile, then the report. A "
                    "scenario that fails does not stop the others; the exit status is then 1.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog())
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true",
                      help="--profile full: " + PROFILES["full"].about)
    size.add_argument("--smoke", action="store_true",
                      help="--profile smoke: " + PROFILES["smoke"].about)
    size.add_argument("--profile", choices=sorted(PROFILES),
                      help="a named profile (quick by default): " + "; ".join(
                          f"{name}: {p.about}" for name, p in PROFILES.items()
                      ).replace("%", "%%"))
    ap.add_argument("--only", action="append", metavar="NAME",
                    choices=[*SCENARIOS, *ALIASES],
                    help=f"run only this scenario (repeatable): {', '.join(ONLY_ORDER)} "
                         "(without --only: all of them but failover_supervised, then "
                         "report)")
    ap.add_argument("--results-dir", default=None,
                    help=f"where records go (default {rec.RESULTS_DIR}; with --smoke "
                         f"{rec.SCRATCH_DIR}, so smoke figures never replace the committed "
                         "ones)")
    return ap


def _status(result) -> int:
    """A scenario's ``main`` returns its record (success) or, like the report, an exit
    status."""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def parse_all(argv: list[str], prog: str) -> argparse.Namespace:
    args = build_parser(prog).parse_args(argv)
    if args.full:
        args.profile = "full"
    elif args.smoke:
        args.profile = "smoke"
    args.profile = args.profile or "quick"
    if args.results_dir is None:
        args.results_dir = str(rec.SCRATCH_DIR if args.profile == "smoke"
                               else rec.PROFILE_DIRS.get(args.profile, rec.RESULTS_DIR))
    profile = PROFILES[args.profile]
    args.names = ([ALIASES.get(n, n) for n in args.only] if args.only
                  else profile.order or [*ORDER, "report"])
    missing = [n for n in args.names if n not in profile.args]
    if missing:
        build_parser(prog).error(f"profile {args.profile} has no sizes for {missing}")
    return args


def run_all(args: argparse.Namespace) -> int:
    from bench.harness.procs import exit_on_sigterm

    exit_on_sigterm()
    profile = PROFILES[args.profile].args
    names = sorted(set(args.names), key=ONLY_ORDER.index)
    rows, failed = [], 0
    t_all = time.monotonic()
    for i, name in enumerate(names):
        argv = [*profile[name], "--results-dir", args.results_dir]
        rec.log(f"bench all ({args.profile}) [{i + 1}/{len(names)}]: python -m bench {name} "
                + " ".join(argv))
        t0 = time.monotonic()
        try:
            code = _status(_load(name)(argv))
            status = "ok" if code == 0 else f"FAILED: exit status {code}"
        except SystemExit as exc:  # argparse's 2, or a signal (128 + n): stop there
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            if code >= 128:
                raise
            status = "ok" if code == 0 else f"FAILED: exit status {code}"
        except Exception as exc:  # noqa: BLE001 - reported, and the others still run
            traceback.print_exc()
            status = f"FAILED: {type(exc).__name__}: {exc}"[:200]
        if status != "ok":
            rec.log(f"bench all: {name} {status}")
        failed += status != "ok"
        rows.append([name, SCENARIOS[name].module, status, round(time.monotonic() - t0, 1),
                     SCENARIOS[name].duration.get(args.profile, "-")])
    rec.print_table(f"python -m bench all ({args.profile}): "
                    f"{time.monotonic() - t_all:.0f} s in all",
                    ["scenario", "module", "status", "seconds", "expected"], rows,
                    caption=f"records in {args.results_dir}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SCENARIOS or argv and argv[0] in ALIASES:
        name = ALIASES.get(argv[0], argv[0])
        try:
            scenario_main = _load(name)
        except LookupError as exc:
            print(f"python -m bench: {exc}", file=sys.stderr)
            return 2
        return _status(scenario_main(argv[1:]))
    if argv and argv[0] == "all":
        return run_all(parse_all(argv[1:], "python -m bench all"))
    if argv and not argv[0].startswith("-"):
        build_parser("python -m bench").error(
            f"unknown scenario {argv[0]!r}: choose from {', '.join([*SCENARIOS, 'all'])}")
    return run_all(parse_all(argv, "python -m bench"))


if __name__ == "__main__":
    sys.exit(main())
