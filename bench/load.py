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

The module also holds the harness the other scenarios share: ``Offer`` (what load),
``Targets`` (what receives it: servers, bare forwarders, bare PUB->SUB, or running
endpoints) and ``run_offer`` (one measured window with CPU per process group).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

from bench import record as rec
from bench.loadgen import RATE_TICK_S, SubscriberConfig, WriterConfig
from bench.loadrun import LoadRun
from bench.runner import (Target, bench_main, cpu_pct_by_group, cpu_seconds, forwarder_argv,
                          free_port_base, server_argv, start_on_free_ports)

NAME = "load"
KINDS = ("server", "forwarder", "pubsub")


@dataclass(frozen=True)
class Offer:
    """The load: writers, subscribers, keys and values (the same for every target)."""

    writers: int = 1
    subscribers: int = 1
    keys: int = 100_000
    value_bytes: int = 100
    distribution: str = "uniform"
    ttl_fraction: float = 0.0
    ttl_s: float = 5.0
    rate_per_s: float = 0.0        # per writer; 0 = flat out
    mode: str = "flow"             # flat out: flow (block) or drop
    latency_every: int = 64
    pin: bool = False
    cores: tuple[int, ...] = ()    # the harness's cores (implies pinning the harness)
    drain_s: float = 2.0           # subscriber: read at most this long after the window
    flush_s: float = 1.0           # writer: flush its queue at most this long at exit
    tick_s: float = RATE_TICK_S    # fixed rate: a writer's shortest sleep between bursts

    @property
    def writer_mode(self) -> str:
        return "rate" if self.rate_per_s > 0 else self.mode


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def core_plan(targets: int, harness: int, cores: list[int] | None = None,
              harness_cores: list[int] | tuple[int, ...] = ()
              ) -> tuple[list[int], list[int]]:
    """Cores for ``targets`` target processes and ``harness`` load processes: targets
    take the first cores (round robin), the harness the cores left (all of them, round
    robin, if none is left). Given ``harness_cores``, the harness takes those (round
    robin) and the targets the other cores."""
    cores = cores or usable_cores()
    if harness_cores:
        rest = [c for c in cores if c not in harness_cores] or cores
        return ([rest[i % len(rest)] for i in range(targets)],
                [harness_cores[i % len(harness_cores)] for i in range(harness)])
    target_cores = [cores[i % len(cores)] for i in range(targets)]
    rest = [c for c in cores if c not in target_cores] or cores
    return target_cores, [rest[i % len(rest)] for i in range(harness)]


def parse_core_list(text: str) -> tuple[int, ...]:
    """``"12-15"``, ``"0,2-3"`` -> sorted distinct cores; ValueError on anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a core list: {text!r} (e.g. 12-15 or 0,2-3)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"not a core list: {text!r} ({part}: the range is backwards)")
        cores.update(range(a, b + 1))
    return tuple(sorted(cores))


class Targets:
    """What receives the load, ended by PID on exit.

    ``kind`` server: ``shards`` standalone ``python -m shards`` processes, each given the
    routing of ``shards`` shards and its index; forwarder: ``shards`` bare forwarding
    loops (bench/forwarder.py); pubsub: nothing in between - each writer binds its XPUB
    and the subscriber connects to every writer (one socket each); external: running
    servers at ``ports`` (``pins``: their routing's pinned prefixes).
    """

    def __init__(self, kind: str, shards: int = 1, *, offer: Offer, host: str = "127.0.0.1",
                 ports: list[int] | None = None, hosts: list[str] | None = None,
                 pins: tuple = (), extra: tuple = ()):
        if kind not in (*KINDS, "external"):
            raise ValueError(f"unknown target kind {kind!r}")
        self.kind, self.shards, self.offer, self.host = kind, shards, offer, host
        self.pins = tuple(pins)
        self.procs: list[Target] = []
        self.extra = tuple(extra)
        self.ports = list(ports or [])
        self.hosts = list(hosts or [])   # external: one address per port (default: host)
        if kind == "pubsub":
            self.shards = offer.writers
        elif kind == "external":
            self.shards = len(self.ports)
        n_targets = self.shards if kind in ("server", "forwarder") else 0
        self.target_cores, self.harness_cores = core_plan(
            n_targets, offer.writers + offer.subscribers, harness_cores=offer.cores)

    def __enter__(self) -> "Targets":
        try:
            if self.kind in ("server", "forwarder"):
                # start them side by side (each waits ~1 s for its READY line)
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(self.shards) as pool:
                    started = list(pool.map(self._start, range(self.shards)))
                for proc, base in started:
                    self.procs.append(proc)
                    self.ports.append(base)
                for proc, _ in started:
                    if isinstance(proc, BaseException):
                        raise proc
            elif self.kind == "pubsub":
                base = free_port_base(self.shards)
                self.ports = [base + i for i in range(self.shards)]
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, index: int):
        """(Target, port base), or (the exception, None) if it could not start."""
        try:
            return start_on_free_ports(f"{self.kind}-{index}", self._argv_for(index))
        except BaseException as exc:  # re-raised by __enter__ once every start is done
            return exc, None

    def _argv_for(self, index: int):
        extra = list(self.extra)
        if self.kind == "server":
            from shards.common.routing import ShardMap

            pins: dict[int, list[str]] = {}
            for prefix, shard in self.pins:
                pins.setdefault(shard, []).append(prefix)
            routing = json.dumps(ShardMap(self.shards, pins).describe(), separators=(",", ":"))
            extra += ["--routing", routing, "--shard-index", str(index),
                      "--parent-pid", str(os.getpid())]
            if self.offer.pin:
                extra += ["--cpus", str(self.target_cores[index])]
            return lambda b: server_argv(b, self.host, tuple(extra))
        if self.offer.pin:
            extra += ["--core", str(self.target_cores[index])]
        return lambda b: forwarder_argv(b, self.host, tuple(extra))

    def close(self) -> None:
        for proc in self.procs:
            if isinstance(proc, Target):
                proc.stop()
        self.procs.clear()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        for proc in self.procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during the run: {proc.stderr_tail()}")

    def collectors(self) -> list[str]:
        if self.kind == "pubsub":    # the writer binds, the subscriber connects
            return self._endpoints(0)
        return self._endpoints(2)

    def publishers(self) -> list[str]:
        return self._endpoints(0 if self.kind == "pubsub" else 1)

    def _endpoints(self, offset: int) -> list[str]:
        hosts = self.hosts or [self.host] * len(self.ports)
        return [f"tcp://{h}:{p + offset}" for h, p in zip(hosts, self.ports)]

    def configs(self, offer: Offer | None = None, seed: int = 1
                ) -> tuple[list[WriterConfig], list[SubscriberConfig]]:
        """Writer and subscriber configs of ``offer`` (default: the one given) for these
        targets: writers route keys over every shard (pubsub: writer i to socket i)."""
        o = offer or self.offer
        cores = (self.harness_cores if o.pin or o.cores
                 else [None] * (o.writers + o.subscribers))
        collectors = tuple(self.collectors())
        writers = []
        for i in range(o.writers):
            mine = (collectors[i],) if self.kind == "pubsub" else collectors
            writers.append(WriterConfig(
                collector=mine[0], collectors=mine if len(mine) > 1 else (),
                pins=self.pins, keys=o.keys, value_bytes=o.value_bytes,
                distribution=o.distribution, mode=o.writer_mode, rate_per_s=o.rate_per_s,
                ttl_fraction=o.ttl_fraction, ttl_s=o.ttl_s, seed=seed + i, writer_id=i,
                core=cores[i], seq_stamp=self.kind == "pubsub", bind=self.kind == "pubsub",
                flush_s=o.flush_s, tick_s=o.tick_s))
        pubs = tuple(self.publishers())
        subs = [SubscriberConfig(endpoint=pubs[0], endpoints=pubs if len(pubs) > 1 else (),
                                 latency_every=o.latency_every, drain_s=o.drain_s,
                                 core=cores[o.writers + j])
                for j in range(1 if self.kind == "pubsub" else o.subscribers)]
        return writers, subs

    def describe(self) -> dict:
        return {"kind": self.kind, "shards": self.shards, "ports": self.ports,
                "commands": [" ".join(p.argv[1:]) for p in self.procs],
                "target_cores": self.target_cores if self.offer.pin else None,
                "harness_cores": (self.harness_cores if self.offer.pin or self.offer.cores
                                  else None)}


def run_offer(targets: Targets, *, warmup: float, seconds: float, offer: Offer | None = None,
              progress: "rec.Progress | None" = None, seed: int = 1) -> dict:
    """One measured window of ``offer`` against ``targets`` (already started): the load
    figures (``LoadResult.figures``), CPU per process group in percent of one core
    (``cpu_pct``: targets, writers, subscribers, ours, host, others) and ``cpu_cores``
    (all our processes' CPU seconds / window)."""
    writers, subs = targets.configs(offer, seed)
    with LoadRun(writers, subs) as load:
        window = load.start(warmup, seconds)
        groups = {"targets": targets.pids, "writers": load.pids("writer"),
                  "subscribers": load.pids("subscriber")}
        all_pids = [p for pids in groups.values() for p in pids]
        wait = progress.wait_until if progress else _sleep_until
        wait(window.t_start, status=lambda: "warm-up, " + load.status())
        cpu0 = cpu_seconds(all_pids)
        wait(window.t_end, status=load.status)
        cpu1 = cpu_seconds(all_pids)
        result = load.collect(window)
        targets.check_alive()
    figures = result.figures()
    figures["cpu_pct"] = cpu_pct_by_group(groups, cpu0, cpu1, window.seconds)
    figures["cpu_cores"] = round(figures["cpu_pct"]["ours"] / 100, 3)
    figures["writer_drops"] = sum(w["dropped_window"] for w in result.writers)
    figures["target"] = targets.kind
    figures["shards"] = targets.shards
    figures["writers"] = result.writers
    figures["subscribers"] = result.subscribers
    return figures


def _sleep_until(t: float, status=None) -> None:
    import time

    while (delay := t - time.monotonic()) > 0:
        time.sleep(min(delay, 0.25))


def brief(fig: dict) -> str:
    """One line of a run's figures for progress notes."""
    lat = fig.get("latency_ms") or {}
    return (f"received {fig['received_per_s']:,.0f}/s (sent {fig['sent_per_s']:,.0f}/s), "
            f"loss {fig['loss_window']}, writer drops {fig.get('writer_drops', 0)}, "
            f"p50 {lat.get('p50', '-')} ms p99 {lat.get('p99', '-')} ms, "
            f"cpu cores {fig['cpu_cores']} (others {fig['cpu_pct']['others']}%)")


# ---------------------------------------------------------------------- the command

def add_offer_args(ap: argparse.ArgumentParser, writers: int = 1) -> None:
    """The load options every scenario shares."""
    ap.add_argument("--writers", type=int, default=writers, help="writer processes")
    ap.add_argument("--keys", type=int, default=100_000, help="key space")
    ap.add_argument("--value-bytes", type=int, default=100,
                    help="value size (>= 8 carries the latency stamp)")
    ap.add_argument("--distribution", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--ttl-fraction", type=float, default=0.0,
                    help="share of updates carrying ttl=--ttl-s")
    ap.add_argument("--ttl-s", type=float, default=5.0)
    ap.add_argument("--latency-every", type=int, default=64,
                    help="sample the latency of one update in this many")
    ap.add_argument("--pin", action="store_true",
                    help="pin every process to one core: targets first, then writers and "
                         "subscribers on the cores left")
    ap.add_argument("--cores", default="",
                    help="pin the writers and subscribers round robin to these cores, e.g. "
                         "12-15 (targets started here take the other cores with --pin)")
    ap.add_argument("--tick-ms", type=float, default=RATE_TICK_S * 1000,
                    help="fixed rate: a writer's shortest sleep between bursts of due "
                         "updates (longer: less CPU, up to this much added latency)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))


def check_offer_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.writers < 1 or args.keys < 1 or args.value_bytes < 0:
        ap.error("--writers and --keys must be >= 1, --value-bytes >= 0")
    if not 0 <= args.ttl_fraction <= 1 or args.ttl_s <= 0 or args.latency_every < 1:
        ap.error("--ttl-fraction must be in 0..1, --ttl-s > 0, --latency-every >= 1")
    if not 0 <= args.tick_ms <= 100:
        ap.error("--tick-ms must be in 0..100")
    args.core_list = ()
    if args.cores:
        try:
            args.core_list = parse_core_list(args.cores)
        except ValueError as exc:
            ap.error(f"--cores: {exc}")
        missing = sorted(set(args.core_list) - set(usable_cores()))
        if missing:
            ap.error(f"--cores: {missing} not usable on this host (usable: "
                     f"{usable_cores()})")
    for name in ("seconds", "warmup", "rounds"):
        if name in args and getattr(args, name) <= (0 if name != "warmup" else -1e-9):
            ap.error(f"--{name} must be positive")


def offer_from(args: argparse.Namespace, **over) -> Offer:
    fields = {f: getattr(args, f) for f in ("writers", "keys", "value_bytes", "distribution",
                                             "ttl_fraction", "ttl_s", "latency_every", "pin")
              if f in args}
    if "tick_ms" in args:
        fields["tick_s"] = args.tick_ms / 1000
    if getattr(args, "core_list", ()):
        fields["cores"] = tuple(args.core_list)
    fields.update(over)
    return Offer(**fields)


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
