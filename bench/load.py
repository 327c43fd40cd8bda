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
from dataclasses import asdict, dataclass, replace

from bench import record as rec
from bench.loadgen import LoadRun, SubscriberConfig, WriterConfig
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

    @property
    def writer_mode(self) -> str:
        return "rate" if self.rate_per_s > 0 else self.mode


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def core_plan(targets: int, harness: int, cores: list[int] | None = None
              ) -> tuple[list[int], list[int]]:
    """Cores for ``targets`` target processes and ``harness`` load processes: targets
    take the first cores (round robin), the harness the cores left (all of them, round
    robin, if none is left)."""
    cores = cores or usable_cores()
    target_cores = [cores[i % len(cores)] for i in range(targets)]
    rest = [c for c in cores if c not in target_cores] or cores
    return target_cores, [rest[i % len(rest)] for i in range(harness)]


class Targets:
    """What receives the load, ended by PID on exit.

    ``kind`` server: ``shards`` standalone ``python -m shards`` processes, each given the
    routing of ``shards`` shards and its index; forwarder: ``shards`` bare forwarding
    loops (bench/forwarder.py); pubsub: nothing in between - each writer binds its XPUB
    and the subscriber connects to every writer (one socket each); external: running
    servers at ``ports`` (``pins``: their routing's pinned prefixes).
    """

    def __init__(self, kind: str, shards: int = 1, *, offer: Offer, host: str = "127.0.0.1",
                 ports: list[int] | None = None, pins: tuple = (), extra: tuple = ()):
        if kind not in (*KINDS, "external"):
            raise ValueError(f"unknown target kind {kind!r}")
        self.kind, self.shards, self.offer, self.host = kind, shards, offer, host
        self.pins = tuple(pins)
        self.procs: list[Target] = []
        self.extra = tuple(extra)
        self.ports = list(ports or [])
        if kind == "pubsub":
            self.shards = offer.writers
        elif kind == "external":
            self.shards = len(self.ports)
        n_targets = self.shards if kind in ("server", "forwarder") else 0
        self.target_cores, self.harness_cores = core_plan(
            n_targets, offer.writers + offer.subscribers)

    def __enter__(self) -> "Targets":
        try:
            if self.kind in ("server", "forwarder"):
                for i in range(self.shards):
                    self._start(i)
            elif self.kind == "pubsub":
                base = free_port_base(self.shards)
                self.ports = [base + i for i in range(self.shards)]
        except BaseException:
            self.close()
            raise
        return self

    def _start(self, index: int) -> None:
        extra = list(self.extra)
        if self.kind == "server":
            from shards.routing import ShardMap

            pins: dict[int, list[str]] = {}
            for prefix, shard in self.pins:
                pins.setdefault(shard, []).append(prefix)
            routing = json.dumps(ShardMap(self.shards, pins).describe(), separators=(",", ":"))
            extra += ["--routing", routing, "--shard-index", str(index)]
            if self.offer.pin:
                extra += ["--cpus", str(self.target_cores[index])]
            argv_for = lambda b: server_argv(b, self.host, tuple(extra))  # noqa: E731
        else:
            if self.offer.pin:
                extra += ["--core", str(self.target_cores[index])]
            argv_for = lambda b: forwarder_argv(b, self.host, tuple(extra))  # noqa: E731
        proc, base = start_on_free_ports(f"{self.kind}-{index}", argv_for)
        self.procs.append(proc)
        self.ports.append(base)

    def close(self) -> None:
        for proc in self.procs:
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
            return [f"tcp://{self.host}:{p}" for p in self.ports]
        return [f"tcp://{self.host}:{p + 2}" for p in self.ports]

    def publishers(self) -> list[str]:
        if self.kind == "pubsub":
            return self.collectors()
        return [f"tcp://{self.host}:{p + 1}" for p in self.ports]

    def configs(self, offer: Offer | None = None, seed: int = 1
                ) -> tuple[list[WriterConfig], list[SubscriberConfig]]:
        """Writer and subscriber configs of ``offer`` (default: the one given) for these
        targets: writers route keys over every shard (pubsub: writer i to socket i)."""
        o = offer or self.offer
        cores = self.harness_cores if o.pin else [None] * (o.writers + o.subscribers)
        collectors = tuple(self.collectors())
        writers = []
        for i in range(o.writers):
            mine = (collectors[i],) if self.kind == "pubsub" else collectors
            writers.append(WriterConfig(
                collector=mine[0], collectors=mine if len(mine) > 1 else (),
                pins=self.pins, keys=o.keys, value_bytes=o.value_bytes,
                distribution=o.distribution, mode=o.writer_mode, rate_per_s=o.rate_per_s,
                ttl_fraction=o.ttl_fraction, ttl_s=o.ttl_s, seed=seed + i, writer_id=i,
                core=cores[i], seq_stamp=self.kind == "pubsub", bind=self.kind == "pubsub"))
        pubs = tuple(self.publishers())
        subs = [SubscriberConfig(endpoint=pubs[0], endpoints=pubs if len(pubs) > 1 else (),
                                 latency_every=o.latency_every,
                                 core=cores[o.writers + j])
                for j in range(1 if self.kind == "pubsub" else o.subscribers)]
        return writers, subs

    def describe(self) -> dict:
        return {"kind": self.kind, "shards": self.shards, "ports": self.ports,
                "commands": [" ".join(p.argv[1:]) for p in self.procs],
                "target_cores": self.target_cores if self.offer.pin else None,
                "harness_cores": self.harness_cores if self.offer.pin else None}


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
