"""Fan-out: one writer, N subscribing clients, from a 1-shard and a 4-shard cluster.

``python -m bench.fanout [--shards 1,4] [--subscribers 1,4,16] [--rate 1000] [--seconds 5]
[--warmup 1] [--rounds 1] [--ceiling-s 2]`` (also ``python -m bench fanout ...``)

First the same-run ceilings at the same offered rate (``bench.harness.ceilings.measure_ceilings``,
open loop at ``--rate``): a bare pyzmq PUB->SUB and the bare forwarding loop, one writer
and one subscriber each. Then for each cluster size S and subscriber count N, ``--rounds``
fresh runs:

* S standalone shard servers (``python -m clonemap.shards``, ports from ``bench.harness.procs``), each
  given the S-shard routing (``--routing``/``--shard-index``: it drops keys it does not
  own, so a misrouted update would show up as missing);
* N subscribing clients (``clonemap.client.api.AsyncClone`` over every shard, each with one watch
  on the whole map), ``--clients-per-process`` of them per subprocess (a process per
  client would only measure the scheduler on a small host); each process prints READY
  once all its clients have their snapshot and their watch open;
* then one writer process, the one every scenario uses (``bench.harness.fleet.timed_writer``,
  the ``bench.harness.traffic`` writer): an XPUB per shard connected to the collectors (as
  a client does; it waits until every collector has subscribed), sending ``rate x
  seconds`` KVSETs **open loop**: update i is due at ``i / rate`` after the start and is
  sent then (or at once, if the writer is late), whatever the replies. Each key is new
  (``/k%08d``: each key its own routing segment, so the keys spread over the shards),
  routed as a client routes it; its value starts with the update's *intended* send time
  (CLOCK_MONOTONIC ns, 8 bytes), then padding up to ``--value-bytes``.

Each subscriber records, per update, the end-to-end latency (its ``time.monotonic_ns()``
when the watch yields the change minus the intended send time; one host, one clock: a
late writer shows as latency, as in the ceilings), and
counts updates received, missing and duplicated. Reported per run: the offered and sent
rates, updates/s delivered to each subscriber (timed updates received / (its last
arrival - the scheduled send of the first timed update: ``delivered_rate``), the lowest
of those and the sum over subscribers, whether every subscriber got
every update, and latency percentiles p50, p99, p99.9 and max over all deliveries.
The first ``rate x --warmup`` updates are a warm-up: they must arrive too, but are not
timed. Per (S, N): median and spread over the rounds, and ratios to the ceilings: lowest
delivered rate / the PUB->SUB's received rate, p50 and p99 / the PUB->SUB's (both count
latency from each update's intended send time).

``--security plain,curve,roles`` runs each (shards, subscribers) in each mode, in that
order, in the same run: ``curve`` is CURVE on every socket; ``roles`` adds access
control (``clonemap.shards.gate``): the servers get a rights file, and the writer and
every subscriber present the identity ``bench`` (read ``/``, write ``/k``, deny
``/secret/``: each write is checked, each subscription to everything is narrowed to
~2,000 prefixes). The summary gives the servers' CPU of roles over curve per point:
what checking rights costs (issue 42's target: at most 1.15).

Duration on a 2-core host: smoke (1,2 shards x 1,4 subscribers, 0.5 s at 200/s) ~8 s;
quick (1,4 x 1,4,16, 3 s at 1000/s) ~45 s; full (the same, 5 s after a 1 s warm-up,
2 rounds, ``--ceiling-s 3``) ~2.5 min.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import time
from struct import error as struct_error

from bench.harness import access
from bench.harness import record as rec
from bench.harness.fleet import timed_writer
from bench.harness.procs import (Target, bench_main, cpu_pct_each, cpu_seconds, own_cpu_seconds,
                                 server_argv, start_on_free_ports)
from bench.harness.stats import percentile
from bench.harness.traffic import STAMP_BYTES, key_index, stamp_of

NAME = "fanout"
DURATION = ("Duration (2 cores): smoke (--shards 1,2 --subscribers 1,4 --rate 200 --seconds "
            "0.5) ~8 s; quick (--seconds 3) ~45 s; full (--seconds 5 --warmup 1 --rounds 2) "
            "~2.5 min.")
MODES = access.MODES
BENCH_RIGHTS = {"read": ("/",), "write": ("/k",), "deny": ("/secret/",)}
"""The ``roles`` mode's one identity (``bench``): every write allowed, but checked."""
SUBSCRIBER_IDLE_S = 5.0
"""A subscriber that has heard nothing for this long after its first update stops."""
START_TIMEOUT_S = 60.0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1")
    return values


def _modes(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(v not in MODES for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(MODES)}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="one writer, N subscribing clients: delivered "
                                             "updates/s and end-to-end latency, against a "
                                             "bare PUB->SUB at the same offered rate",
                                 epilog=DURATION)
    ap.add_argument("--shards", type=_int_list, default=[1, 4],
                    help="cluster sizes, comma-separated")
    ap.add_argument("--subscribers", type=_int_list, default=[1, 4, 16],
                    help="subscriber counts, comma-separated")
    ap.add_argument("--rate", type=float, default=1000.0,
                    help="offered updates/s (open loop, the same for every run)")
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="how long the writer writes (timed updates)")
    ap.add_argument("--warmup", type=float, default=1.0,
                    help="seconds of untimed updates first (they must arrive too)")
    ap.add_argument("--rounds", type=int, default=1, help="fresh runs per (shards, subscribers)")
    ap.add_argument("--ceiling-s", type=float, default=2.0,
                    help="measured window of each same-run ceiling (PUB->SUB, forwarder)")
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--clients-per-process", default="4",
                    help="subscribing clients per subprocess, or auto: spread them over "
                         "the cores the servers and the writer leave (one process per "
                         "spare core)")
    ap.add_argument("--security", type=_modes, default=["plain"],
                    help="modes, comma-separated: plain, curve (CURVE on every socket), "
                         "roles (CURVE and access control); each point runs in each")
    ap.add_argument("--drain-s", type=float, default=30.0,
                    help="longest wait for the subscribers after the writer is done")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.clients_per_process != "auto":
        try:
            args.clients_per_process = int(args.clients_per_process)
        except ValueError:
            ap.error("--clients-per-process: a count or auto")
        if args.clients_per_process < 1:
            ap.error("--clients-per-process must be > 0")
    if args.rate <= 0 or args.seconds <= 0:
        ap.error("--rate and --seconds must be > 0")
    if args.warmup < 0 or args.rounds < 1 or args.ceiling_s <= 0:
        ap.error("--warmup >= 0, --rounds >= 1, --ceiling-s > 0")
    if args.value_bytes < STAMP_BYTES:
        ap.error(f"--value-bytes must be >= {STAMP_BYTES} (the timestamp)")
    return args


def canonical_command(args: argparse.Namespace) -> str:
    opts = {k: (",".join(map(str, v)) if isinstance(v, list) else v)
            for k, v in vars(args).items() if k != "results_dir"}
    return rec.command_line(f"bench.{NAME}", opts)


# ================================================================ the subscriber process

def delivered_rate(received: int, last_ns: int, first_send_ns: int, warm: int,
                   rate: float) -> float:
    """Timed updates one subscriber received per second of the timed span: from the
    scheduled send of the first timed update (the open-loop writer sends update ``i`` at
    ``first_send_ns + i / rate``; the first ``warm`` are the warm-up) to its last arrival.
    The span once began at the warm-up's first send while ``received`` counts timed
    updates only, which read 0.75 of the offered rate after a 1 s warm-up of 3 s."""
    if not last_ns:
        return 0.0
    span_s = (last_ns - first_send_ns) / 1e9 - warm / rate
    return round(received / span_s, 1) if span_s > 0 else 0.0


async def _consume(watch, count: int, warm: int, result: dict) -> None:
    """Take ``count`` puts from the watch; the first ``warm`` indices are not timed."""
    seen = bytearray(count)
    lat_us = result["lat_us"]
    received = duplicates = strays = 0
    it = watch.__aiter__()
    timeout_s = START_TIMEOUT_S
    while received < count:
        try:
            change = await asyncio.wait_for(it.__anext__(), timeout_s)
        except (asyncio.TimeoutError, StopAsyncIteration):
            break
        if change.kind != "put":
            continue
        now_ns = time.monotonic_ns()
        try:
            i = key_index(change.key)
            sent_ns = stamp_of(change.value)
        except (ValueError, TypeError, struct_error):
            strays += 1
            continue
        if not 0 <= i < count:
            strays += 1
            continue
        if seen[i]:
            duplicates += 1
            continue
        seen[i] = 1
        received += 1
        if i >= warm:
            lat_us.append((now_ns - sent_ns) // 1000)
        result["last_ns"] = now_ns
        timeout_s = SUBSCRIBER_IDLE_S
    result.update(received=received - sum(seen[:warm]), duplicates=duplicates,
                  strays=strays, missing=count - received)


async def subscriber_async(args: argparse.Namespace) -> None:
    from clonemap.client.api import AsyncClone

    shards = [f"tcp://127.0.0.1:{p}" for p in args.ports]
    clones = [AsyncClone(shards=shards, timeout_s=START_TIMEOUT_S,
                         watch_capacity=max(10_000, 2 * args.count), keys=args.keys,
                         identity=args.identity)
              for _ in range(args.clients)]
    try:
        await asyncio.gather(*(c.start() for c in clones))
        watches = [c.watch("").open() for c in clones]
        results = [{"lat_us": [], "last_ns": 0} for _ in clones]
        tasks = [asyncio.ensure_future(_consume(w, args.count, args.warm, r))
                 for w, r in zip(watches, results)]
        await asyncio.sleep(0)  # the watches' snapshot entries are queued already
        print("READY subscriber", flush=True)
        await asyncio.gather(*tasks)
        for w in watches:
            w.close()
        print("RESULT " + json.dumps({"clients": results, "cpu_s": own_cpu_seconds()}),
              flush=True)
    finally:
        for c in clones:
            await c.close()


def subscriber_main(argv: list[str]) -> None:
    import uvloop

    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME} _subscriber")
    ap.add_argument("--ports", type=_int_list, required=True)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--warm", type=int, default=0)
    ap.add_argument("--keys", default=None)
    ap.add_argument("--identity", default=None)
    args = ap.parse_args(argv)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(subscriber_async(args))


# ================================================================ the benchmark

def _result_line(target: Target, timeout_s: float) -> dict:
    line = target._wait_line("RESULT ", timeout_s)
    return json.loads(line[len("RESULT "):])


def clients_per_process(setting, subscribers: int, shards: int,
                        cores: int | None = None) -> int:
    """``setting`` clients per subprocess, or (``"auto"``) as few as spread the
    subscribers over one process per core left beside the servers and the writer."""
    if setting != "auto":
        return int(setting)
    cores = cores or len(os.sched_getaffinity(0))
    spare = max(1, cores - shards - 1)
    return max(1, math.ceil(subscribers / spare))


def mode_args(mode: str, keys_dir: str) -> tuple[tuple[str, ...], list[str], dict]:
    """The servers' extra arguments, the subscribers' and the writer's, for ``mode``
    (``bench.harness.access``)."""
    if mode == "plain":
        return (), [], {}
    who = access.identity(mode)
    return (access.server_args(mode, keys_dir),
            ["--keys", keys_dir, *(("--identity", who) if who else ())],
            {"keys_dir": keys_dir, "identity": who})


def run_one(shards: int, subscribers: int, args: argparse.Namespace,
            progress: rec.Progress, mode: str = "plain", keys_dir: str = "") -> dict:
    """One fresh cluster, ``subscribers`` clients, one writer; returns the run's figures."""
    from clonemap.shards.common.routing import ShardMap

    timed = max(1, round(args.rate * args.seconds))
    warm = round(args.rate * args.warmup)
    count = warm + timed
    routing = json.dumps(ShardMap(shards).describe(), separators=(",", ":"))
    me = [sys.executable, "-m", f"bench.{NAME}"]
    server_extra, sub_extra, writer_extra = mode_args(mode, keys_dir)
    with contextlib.ExitStack() as stack:
        ports, servers = [], []
        for i in range(shards):
            target, base = start_on_free_ports(f"shard {i}", lambda b, i=i: server_argv(
                b, extra=("--routing", routing, "--shard-index", str(i),
                          "--log-level", "warning", *server_extra)))
            servers.append(stack.enter_context(target))
            ports.append(base)
        port_list = ",".join(map(str, ports))
        subs = []
        left = subscribers
        per = clients_per_process(args.clients_per_process, subscribers, shards)
        progress.note(f"plan: {shards} server(s), {subscribers} client(s) in "
                      f"{math.ceil(subscribers / per)} process(es) of up to {per}, one "
                      f"writer; {len(os.sched_getaffinity(0))} usable cores")
        while left:
            k = min(left, per)
            left -= k
            subs.append((stack.enter_context(Target(
                f"subscribers {len(subs)}",
                [*me, "_subscriber", "--ports", port_list, "--clients", str(k),
                 "--count", str(count), "--warm", str(warm), *sub_extra],
                timeout_s=START_TIMEOUT_S)), k))
        writer = stack.enter_context(timed_writer(ports, rate=args.rate, count=count,
                                                  value_bytes=args.value_bytes,
                                                  **writer_extra))
        groups = {"servers": [t.pid for t in servers], "subscribers": [t.pid for t, _ in subs],
                  "writer": writer.pids("writer")}
        pids = [p for g in groups.values() for p in g]
        t0, cpu0 = time.monotonic(), cpu_seconds(pids)
        window = writer.start(0.0, count / args.rate + 1.0)
        progress.wait_until(t0 + count / args.rate)
        wrote = writer.collect(window, args.seconds * 3 + START_TIMEOUT_S).writers[0]
        cpu_w = cpu_seconds(pids)
        clients = []
        own_cpu = {}  # a subscriber's CPU from its result line (it exits right after)
        for target, _ in subs:
            got = _result_line(target, args.drain_s + SUBSCRIBER_IDLE_S + 5)
            clients += got["clients"]
            own_cpu[target.pid] = got["cpu_s"]
        window_s = time.monotonic() - t0
        cpu1 = {**cpu_seconds(pids), **own_cpu}
    pct = lambda pid_list, c1: round(  # noqa: E731
        100 * sum(c1.get(p, 0.0) - cpu0.get(p, 0.0) for p in pid_list) / window_s, 1)
    cpu_pct = {"servers": pct(groups["servers"], cpu1),
               "subscribers": pct(groups["subscribers"], cpu1),
               "writer": pct(groups["writer"], cpu_w),
               "host": round(100 * (cpu1["host_busy"] - cpu0["host_busy"]) / window_s, 1)}
    cpu_pct["others"] = round(max(0.0, cpu_pct["host"] - cpu_pct["servers"]
                                  - cpu_pct["subscribers"] - cpu_pct["writer"]), 1)
    each = cpu_pct_each(groups["subscribers"], cpu0, cpu1, window_s)
    hot = rec.saturated("subscriber process", each)
    first_ns = wrote["first_send_ns"]
    sent_per_s = (round(wrote["sent_total"] / wrote["elapsed_s"], 1)
                  if wrote["elapsed_s"] else None)
    per_sub_rate = []
    lat_ms: list[float] = []
    for c in clients:
        per_sub_rate.append(delivered_rate(c["received"], c["last_ns"], first_ns, warm,
                                           args.rate))
        lat_ms.extend(us / 1000 for us in c.pop("lat_us"))
    lat_ms.sort()
    return {
        "security": mode,
        "shards": shards, "subscribers": subscribers, "processes": len(subs),
        "offered_per_s": args.rate, "updates": timed, "warmup_updates": warm,
        "sent_per_s": sent_per_s,
        "delivered_per_s_each": per_sub_rate,
        "delivered_per_s_min": min(per_sub_rate),
        "delivered_per_s_total": round(sum(per_sub_rate), 1),
        "received": [c["received"] for c in clients],
        "missing_total": sum(c["missing"] for c in clients),
        "duplicates_total": sum(c["duplicates"] for c in clients),
        "strays_total": sum(c["strays"] for c in clients),
        "complete": all(c["received"] == timed and c["missing"] == 0 for c in clients),
        "latency_ms": {"samples": len(lat_ms),
                       **{f"p{p:g}": round(percentile(lat_ms, p), 3) if lat_ms else None
                          for p in (50, 99, 99.9)},
                       "max": round(lat_ms[-1], 3) if lat_ms else None},
        "window_s": round(window_s, 3), "cpu_pct": cpu_pct,
        "subscriber_process_cpu_pct": each, "harness_bound": "; ".join(hot),
    }


def point(runs: list[dict], ceilings: dict) -> dict:
    """One (shards, subscribers) over its rounds, against the PUB->SUB at the same rate."""
    lat = {p: rec.spread([r["latency_ms"][p] for r in runs
                          if r["latency_ms"][p] is not None and r["latency_ms"]["samples"]],
                         digits=3)
           for p in ("p50", "p99", "p99.9", "max")}
    delivered = rec.spread([r["delivered_per_s_min"] for r in runs])
    pubsub = ceilings.get("pubsub", {})
    ratio = lambda a, b: round(a / b, 2) if a is not None and b else None  # noqa: E731
    ceiling_lat = pubsub.get("latency_ms", {})
    return {"security": runs[0].get("security", "plain"),
            "shards": runs[0]["shards"], "subscribers": runs[0]["subscribers"],
            "offered_per_s": runs[0]["offered_per_s"], "rounds": len(runs),
            "complete": all(r["complete"] for r in runs),
            "delivered_per_s_min": delivered, "latency_ms": lat,
            "delivered_to_pubsub": ratio(delivered["median"], pubsub.get("received_per_s")),
            "p50_to_pubsub": ratio(lat["p50"].get("median"), ceiling_lat.get("p50")),
            "p99_to_pubsub": ratio(lat["p99"].get("median"), ceiling_lat.get("p99"))}


def run(args: argparse.Namespace) -> rec.Record:
    from bench.harness.ceilings import measure_ceilings

    import tempfile

    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    modes = args.security
    # a record of its own for other modes (latest/fanout-curve-roles.md), beside plain's
    name = NAME if modes == ["plain"] else f"{NAME}-{'-'.join(modes)}"
    record = rec.Record(name, canonical_command(args), config)
    combos = [(s, n) for s in args.shards for n in args.subscribers]
    keys = tempfile.TemporaryDirectory(prefix="clonemap-fanout-keys-")
    if modes != ["plain"]:
        access.make_keys(keys.name, BENCH_RIGHTS)
    with keys, rec.Progress(NAME, 2 + len(combos) * len(modes) * args.rounds) as progress:
        ceilings = measure_ceilings(seconds=args.ceiling_s, warmup=min(1.0, args.ceiling_s / 2),
                                    value_bytes=args.value_bytes, rate_per_s=args.rate,
                                    kinds=("pubsub", "forwarder"), progress=progress)
        for shards, n in combos:
            for rnd in range(args.rounds):
                for mode in modes:  # each mode of a point, back to back
                    progress.step(f"{shards} shard(s), {n} subscriber(s), {mode}, round "
                                  f"{rnd + 1}/{args.rounds}: {args.rate:g} updates/s for "
                                  f"{args.warmup:g} + {args.seconds:g} s")
                    figures = run_one(shards, n, args, progress, mode, keys.name)
                    figures["round"] = rnd + 1
                    lat = figures["latency_ms"]
                    progress.note(f"delivered {figures['delivered_per_s_min']:,.0f}/s to each "
                                  f"(lowest), complete {figures['complete']}, latency p50 "
                                  f"{lat['p50']} ms p99 {lat['p99']} ms p99.9 {lat['p99.9']} ms")
                    record.add_run(figures)
        progress.finish_step()
    runs = record.data["runs"]
    points = [point([r for r in runs if (r["security"], r["shards"], r["subscribers"])
                     == (m, *c)], ceilings) for c in combos for m in modes]
    label = lambda p: (f"{p['shards']}x{p['subscribers']}" if p["security"] == "plain"  # noqa: E731
                       else f"{p['security']} {p['shards']}x{p['subscribers']}")
    record.data["summary"] = {
        "all_complete": all(r["complete"] for r in runs),
        "server_cpu_ratio_roles_to_curve": _roles_cost(runs, combos) if {
            "curve", "roles"} <= set(modes) else None,
        "by_run": {label(p): {
            "delivered_per_s_min": p["delivered_per_s_min"]["median"],
            "p50_ms": p["latency_ms"]["p50"].get("median"),
            "p99_ms": p["latency_ms"]["p99"].get("median"),
            "p99.9_ms": p["latency_ms"]["p99.9"].get("median")} for p in points},
        "p99_ms_median": _median_or_none([r["latency_ms"]["p99"] for r in runs]),
        "points": points, "ceilings": ceilings,
    }
    record.target("runs where every subscriber got every update",
                  sum(r["complete"] for r in runs), len(runs), "runs",
                  harness_bound="; ".join(f"{r['shards']} shard(s), {r['subscribers']} "
                                          f"clients: {r['harness_bound']}" for r in runs
                                          if r.get("harness_bound") and not r["complete"]))
    record.finish()
    return record


def _roles_cost(runs: list[dict], combos) -> dict[str, float | None]:
    """Per point: the servers' CPU with roles over with CURVE alone (medians over rounds;
    the same offered rate, so CPU per update in the same ratio)."""
    out = {}
    for s, n in combos:
        cpu = {m: [r["cpu_pct"]["servers"] for r in runs if r["security"] == m
                   and (r["shards"], r["subscribers"]) == (s, n)] for m in ("curve", "roles")}
        curve, roles = (statistics.median(cpu[m]) if cpu[m] else None for m in cpu)
        out[f"{s}x{n}"] = round(roles / curve, 3) if curve and roles is not None else None
    return out


def report(record: rec.Record) -> None:
    rows = []
    for r in record.data["runs"]:
        lat = r["latency_ms"]
        rows.append([r.get("security", "plain"), r["shards"], r["subscribers"],
                     r.get("round", 1), r["offered_per_s"],
                     r["sent_per_s"], r["delivered_per_s_min"], r["delivered_per_s_total"],
                     "yes" if r["complete"] else f"NO ({r['missing_total']} missing)",
                     lat["p50"], lat["p99"], lat["p99.9"], lat["max"],
                     r["cpu_pct"]["servers"],
                     r["cpu_pct"]["subscribers"], r["cpu_pct"]["others"]])
    cfg = record.data["config"]
    rec.table(record, f"{NAME}: one writer, N subscribers ({cfg['seconds']:g} s at "
                      f"{cfg['rate']:g} updates/s after {cfg.get('warmup', 0):g} s warm-up, "
                      "open loop)",
              ["security", "shards", "subscribers", "round", "offered/s", "sent/s",
               "delivered/s each (min)", "delivered/s all", "every update", "p50 ms",
               "p99 ms", "p99.9 ms", "max ms", "servers cpu%",
               "subscribers cpu%", "others cpu%"],
              rows,
              caption="delivered/s each: updates received by one subscriber / (its last "
                      "arrival - the first timed send), the lowest subscriber; all: the sum. "
                      "Latency: the update's intended send time (in the value) to the "
                      "subscriber's watch yielding it, over every timed delivery. cpu%: of one core, from the "
                      "writer's start to the last subscriber's result; others: the rest of "
                      "the host's busy time.")
    summary = record.data["summary"]
    c = summary["ceilings"]
    rows = []
    for p in summary["points"]:
        d, lat = p["delivered_per_s_min"], p["latency_ms"]
        rows.append([p["shards"], p["subscribers"], p["rounds"], d["median"], d["spread_pct"],
                     p["delivered_to_pubsub"], lat["p50"].get("median"), p["p50_to_pubsub"],
                     lat["p99"].get("median"), lat["p99"].get("spread_pct"),
                     p["p99_to_pubsub"], lat["p99.9"].get("median")])
    ps, fw = c["pubsub"], c["forwarder"]
    rec.table(record, f"{NAME}: medians over rounds, against the same-run ceilings",
              ["shards", "subscribers", "rounds", "delivered/s min", "spread %",
               "/ PUB->SUB", "p50 ms", "/ PUB->SUB", "p99 ms", "spread %", "/ PUB->SUB",
               "p99.9 ms"], rows,
              caption=f"ceilings at the same offered rate ({cfg['rate']:g}/s, open loop, one "
                      f"subscriber): bare PUB->SUB {ps['received_per_s']:,.0f}/s received, "
                      f"p50 {_ceiling_ms(ps, 'p50')} ms, p99 {_ceiling_ms(ps, 'p99')} ms; "
                      f"bare forwarding loop {fw['received_per_s']:,.0f}/s, p50 "
                      f"{_ceiling_ms(fw, 'p50')} ms, p99 {_ceiling_ms(fw, 'p99')} ms (all "
                      "latency counts from the intended send time).")
    rec.print_targets(record)


def _median_or_none(values: list):
    """The median of the figures there are (a run whose subscribers timed nothing has
    none), or None."""
    there = [v for v in values if v is not None]
    return statistics.median(there) if there else None


def _ceiling_ms(figures: dict, quantile: str):
    """A ceiling's latency quantile, or "-" where its subscriber timed no update in the
    window (a starved host: the forwarding loop's ceiling once received 28 of the 203
    updates/s sent, and the report failed on the missing figure)."""
    return (figures.get("latency_ms") or {}).get(quantile, "-")


def main(argv: list[str] | None = None) -> rec.Record | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_subscriber"]:
        return subscriber_main(argv[1:])
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
