"""The load harness the throughput scenarios share: ``Offer`` (what load: writers,
subscribers, keys, values, rate), ``Targets`` (what receives it: shard servers, bare
forwarding loops, bare PUB->SUB, or running endpoints, started on planned cores) and
``run_offer`` (one measured window, with CPU per process group), plus the command-line
options that describe an offer.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

from bench.harness import record as rec
from bench.harness.fleet import LoadRun
from bench.harness.procs import (Target, cpu_pct_by_group, cpu_pct_each, cpu_seconds,
                                 forwarder_argv, free_port_base, server_argv,
                                 start_on_free_ports)
from bench.harness.traffic import RATE_TICK_S, SubscriberConfig, WriterConfig
from bench.harness.traffic_reader import settle

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
    keys_dir: str = ""             # CURVE: writers and subscribers present the client key
    identity: str = ""             # ... or this named identity's (access control)
    split: bool = False            # subscribers split the shards (each reads its own share)
                                   # instead of each reading every shard

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
    target_cores, spare = _split_cores(targets, cores, harness_cores)
    spare = spare or cores
    return target_cores, [spare[i % len(spare)] for i in range(harness)]


def _split_cores(targets: int, cores: list[int], harness_cores=()
                 ) -> tuple[list[int], list[int]]:
    """(a core for each of ``targets``, round robin; the harness's cores): given
    ``harness_cores``, those, and the targets on the others; else the cores the targets
    left (empty on a host with no core to spare)."""
    if harness_cores:
        rest = [c for c in cores if c not in harness_cores] or cores
        return [rest[i % len(rest)] for i in range(targets)], list(harness_cores)
    target_cores = [cores[i % len(cores)] for i in range(targets)]
    return target_cores, [c for c in cores if c not in target_cores]


def subscriber_shares(publishers: list[str], subscribers: int, split: bool
                      ) -> list[tuple[str, ...]]:
    """The publishers each subscriber process reads. Not split: every one reads all of
    them (a fan-out). Split: shard i goes to subscriber i mod n, as an application's
    processes each follow their own subtree; n is capped at the shard count (a subscriber
    with nothing to read would only idle)."""
    pubs = tuple(publishers)
    if not split:
        return [pubs] * subscribers
    n = max(1, min(subscribers, len(pubs)))
    return [pubs[j::n] for j in range(n)]


@dataclass(frozen=True)
class HarnessPlan:
    """How many load processes a run gets and where every process runs."""

    writers: int
    subscribers: int
    target_cores: list[int]
    harness_cores: list[int]
    why: str

    def lines(self, kind: str = "server") -> list[str]:
        """The plan as it is printed before a run: which process on which core."""
        out = [f"plan: {len(self.target_cores)} {kind} process(es), {self.writers} "
               f"writer(s), {self.subscribers} subscriber(s): {self.why}"]
        for i, c in enumerate(self.target_cores):
            out.append(f"  {kind}-{i:<3} core {c}")
        for i in range(self.writers):
            out.append(f"  writer-{i:<3} core {self.harness_cores[i]}")
        for j in range(self.subscribers):
            out.append(f"  subscr-{j:<3} core {self.harness_cores[self.writers + j]}")
        return out


WRITER_PER_SUBSCRIBER = 1.5
"""Cores of writers per core of subscribers when the harness cores are shared between
them: a flat-out writer process sends about 0.3M updates/s (traffic.py's batches), one
subscriber process reads about 0.9M/s (one core, measured on a 16-core host), so a
harness that keeps up needs more writers than subscribers."""


def harness_plan(targets: int, cores: list[int] | None = None, *,
                 harness_cores: list[int] | tuple[int, ...] = (), writers: int = 0,
                 subscribers: int = 0, split: bool = True) -> HarnessPlan:
    """Size the load to the cores at hand: ``targets`` processes get a core each first
    (round robin if there are fewer), the harness the cores left (or ``harness_cores``).
    ``writers``/``subscribers`` 0 mean "as many as fit": writers scale with the targets
    (at most one per target), subscribers with the shards they split (at most one per
    target when ``split``), and never more harness processes than harness cores, so no
    two load processes share a core where the host has enough of them."""
    cores = list(cores or usable_cores())
    tcores, spare = _split_cores(targets, cores, harness_cores)
    why = f"{len(cores)} usable cores, {targets} target(s)"
    if not spare:   # a small host: the harness shares the targets' cores
        spare = cores
        why += ", no core left for the harness (it shares theirs)"
    else:
        why += f", {len(spare)} harness core(s)"
    cap = max(1, targets)
    w, s = writers, subscribers
    if not w and not s:
        s = max(1, min(cap if split else 1, round(len(spare) / (1 + WRITER_PER_SUBSCRIBER))))
        w = max(1, min(cap, len(spare) - s))
    elif not w:
        w = max(1, min(cap, len(spare) - s))
    elif not s:
        s = max(1, min(cap if split else 1, len(spare) - w))
    if w + s > len(spare) and spare is not cores:
        why += f" (the {w + s} load processes share them)"
    hcores = [spare[i % len(spare)] for i in range(w + s)]
    return HarnessPlan(w, s, tcores, hcores, why)


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

    ``kind`` server: ``shards`` standalone ``python -m clonemap.shards`` processes, each given the
    routing of ``shards`` shards and its index; forwarder: ``shards`` bare forwarding
    loops (bench/harness/forwarder.py); pubsub: nothing in between - each writer binds its XPUB
    and the subscriber connects to every writer (one socket each); external: running
    servers at ``ports`` (``pins``: their routing's pinned prefixes).
    """

    def __init__(self, kind: str, shards: int = 1, *, offer: Offer, host: str = "127.0.0.1",
                 ports: list[int] | None = None, hosts: list[str] | None = None,
                 pins: tuple = (), extra: tuple = (), pids: tuple = ()):
        if kind not in (*KINDS, "external"):
            raise ValueError(f"unknown target kind {kind!r}")
        self.kind, self.shards, self.offer, self.host = kind, shards, offer, host
        self.pins = tuple(pins)
        self.external_pids = list(pids)    # running servers whose CPU counts as ours
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
            from clonemap.shards.common.routing import ShardMap

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
        return [p.pid for p in self.procs] + self.external_pids

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
                flush_s=o.flush_s, tick_s=o.tick_s, keys_dir=o.keys_dir,
                identity=o.identity))
        n_subs = 1 if self.kind == "pubsub" else o.subscribers
        subs = []
        for j, mine in enumerate(subscriber_shares(self.publishers(), n_subs, o.split)):
            subs.append(SubscriberConfig(endpoint=mine[0], endpoints=mine if len(mine) > 1
                                         else (), latency_every=o.latency_every,
                                         drain_s=o.drain_s, core=cores[o.writers + j],
                                         keys_dir=o.keys_dir, identity=o.identity))
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
    (all our processes' CPU seconds / window). First the targets' backlog from an earlier
    window drains (``settle``: a flat-out window leaves servers seconds of queued updates,
    which this window's subscribers would otherwise time as their own)."""
    writers, subs = targets.configs(offer, seed)
    settled = None
    if targets.kind != "pubsub":  # the last window's backlog is not this one's
        settled = settle(targets.publishers(), keys_dir=(offer or targets.offer).keys_dir)
    with LoadRun(writers, subs) as load:
        window = load.start(warmup, seconds)
        groups = {"targets": targets.pids, "writers": load.pids("writer"),
                  "subscribers": load.pids("subscriber")}
        all_pids = [p for pids in groups.values() for p in pids]
        wait = progress.wait_until if progress else _sleep_until
        early, t_early = cpu_seconds(all_pids), time.monotonic()  # (the fallback: below)
        wait(window.t_start, status=lambda: "warm-up, " + load.status())
        cpu0, t0 = cpu_seconds(all_pids), time.monotonic()
        wait(window.t_end, status=load.status)
        cpu1, t1 = cpu_seconds(all_pids), time.monotonic()
        result = load.collect(window)
        targets.check_alive()
    figures = result.figures(split=(offer or targets.offer).split)
    cpu0, span, cpu_late = cpu_span(window, (early, t_early), (cpu0, t0), t1)
    figures["cpu_pct"] = cpu_pct_by_group(groups, cpu0, cpu1, span)
    figures.update(charge(groups, cpu0, cpu1, span,
                          [s["gaps_window"] for s in result.subscribers]))
    if cpu_late:
        figures["harness_bound"] = "; ".join(filter(None, [figures["harness_bound"], cpu_late]))
    late = [f"subscriber {i} first ran {s['late_s']} s into the window"
            + (" and missed it" if not s["window_s"] else "")
            for i, s in enumerate(result.subscribers) if s.get("late_s", 0) > 0.1 * seconds]
    # a reader descheduled across the window's start or end (a host busier than the
    # plan: its loop took both snapshots in one turn) measured a shorter window, or none
    late += [f"subscriber {i} was not running for {seconds - s['window_s']:.2f} s of the "
             f"{seconds:g} s window"
             for i, s in enumerate(result.subscribers)
             if s.get("late_s", 0) <= 0.1 * seconds and s["window_s"] < 0.9 * seconds]
    if late:  # a harness process that did not run counted nothing: the harness's doing
        figures["harness_bound"] = "; ".join(filter(None, [figures["harness_bound"], *late]))
    figures["cpu_cores"] = round(figures["cpu_pct"]["ours"] / 100, 3)
    figures["writer_drops"] = sum(w["dropped_window"] for w in result.writers)
    figures["target"] = targets.kind
    if settled is not None:
        figures["settle"] = settled
    figures["shards"] = targets.shards
    figures["writers"] = result.writers
    figures["subscribers"] = result.subscribers
    return figures


def cpu_span(window, early: tuple[dict, float], start: tuple[dict, float],
             t1: float) -> tuple[dict, float, str]:
    """Which ``cpu_seconds`` sample a window's CPU figures start from, over how many
    seconds, and why they are not the window's own ("" when they are). The figures are
    what the processes used between two samples this process takes, over the part of the
    window between them (the load stops at its end): ``start`` at the window's start and
    the one at ``t1``, its end. On a host busier than the plan this process may itself
    run late: a start sample taken past the window's middle (once both came after its
    end, and 0.3 s of smoke load read as 0 % CPU) gives way to ``early``, taken as the
    load began, and the span takes in the warm-up."""
    (cpu0, t0), late = start, ""
    if t0 - window.t_start > 0.5 * window.seconds:
        late = (f"the CPU sample at the window's start came {t0 - window.t_start:.2f} s "
                f"late: the CPU figures span the warm-up too")
        cpu0, t0 = early
    return cpu0, max(min(t1, window.t_end) - t0, 1e-3), late


def charge(groups: dict[str, list[int]], before: dict, after: dict, seconds: float,
           gaps_each: list[int]) -> dict:
    """Each harness process's CPU (percent of one core), the ones over
    ``HARNESS_BOUND_PCT`` (``harness_bound``: why the harness, not the targets, set the
    figure), and each subscriber's lost updates charged to whoever lost them: a
    subscriber process that was saturated read too slowly, so the publisher dropped for
    it (``loss_harness``); one with CPU to spare saw what the targets failed to send
    (``loss_targets``)."""
    each = {role: cpu_pct_each(groups.get(role, []), before, after, seconds)
            for role in ("writers", "subscribers")}
    hot = [line for role, vals in each.items() for line in rec.saturated(role[:-1], vals)]
    loss_h = sum(g for g, v in zip(gaps_each, each["subscribers"])
                 if v > rec.HARNESS_BOUND_PCT)
    return {"harness_pct_each": each,
            "harness_max_pct": max([v for vals in each.values() for v in vals], default=0.0),
            "harness_bound": "; ".join(hot),
            "loss_harness": loss_h, "loss_targets": sum(gaps_each) - loss_h}


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
            f"cpu cores {fig['cpu_cores']} (others {fig['cpu_pct']['others']}%)"
            + _settle_note(fig.get("settle")))


def _settle_note(settled: dict | None) -> str:
    if not settled or not settled["settle_updates"]:
        return ""
    return (f"; {settled['settle_updates']:,} earlier updates drained first in "
            f"{settled['settle_s']} s" + ("" if settled["settled"] else " (still coming)"))


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
