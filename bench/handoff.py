"""Hand-off: a subscriber with a costly per-update callback, inline vs on a worker thread.

``python -m bench.handoff [--modes inline,thread] [--work cpu,nogil] [--cost-us 20]
[--rate 40000] [--seconds 3]``

The guide's Black Box pattern hands updates from the thread that reads the sockets to
workers. ``client.api.Clone(deliver=...)`` chooses where a watch callback runs:
``"inline"`` on the client's loop thread (the one that reads the SUB and applies
updates), ``"thread"`` on the watch's dispatcher thread (it also decodes the values).
For each mode and each kind of work, a fresh run:

* one standalone shard server (``python -m clonemap.shards``, ports from ``bench.harness.procs``);
* one subscriber process: a ``Clone`` with one watch on the whole map and a callback that
  does ``--cost-us`` of work per update: ``cpu`` is a pure-Python busy loop (it holds the
  GIL, like most Python callbacks), ``nogil`` is a SHA-256 of a buffer sized to take that
  long (hashlib releases the GIL for large buffers, like I/O or numpy work would). Its
  slow-subscriber check is off (``max_lag_s=None``) and its watch queue large, so
  nothing is dropped or resynced: the figure is what the callback sustains;
* one writer (``bench.harness.fleet.timed_writer``, the writer every scenario uses, open
  loop): ``rate x seconds`` new keys, the intended send time in each value.

Reported per run: sent/s, updates/s delivered to the callback (received / (last callback
- first send)), whether every update arrived, the subscriber's CPU (% of one core), the
largest lag of the client's loop behind the publisher (``max_lag_seen_s``: from the
server clock in HUGZ) and how long after the last send the last callback ran.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import threading
import time

from bench.harness import record as rec
from bench.fanout import _result_line
from bench.harness.fleet import timed_writer
from bench.harness.procs import (Target, bench_main, cpu_seconds, own_cpu_seconds, server_argv,
                                 start_on_free_ports)

NAME = "handoff"
MODES = ("inline", "thread", "workers")
WORKS = ("cpu", "nogil")
IDLE_S = 5.0
"""A subscriber that has heard nothing for this long after its first update stops."""
START_TIMEOUT_S = 60.0


def _list(choices):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in values if v not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(choices)}")
        return values
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="updates/s a subscriber with a costly "
                                             "callback sustains, inline vs handed off")
    ap.add_argument("--modes", type=_list(MODES), default=["inline", "thread"])
    ap.add_argument("--workers", default="1,2,4,8",
                    help="mode workers: worker process counts (client.workers), e.g. 1,2,4,8")
    ap.add_argument("--work", type=_list(WORKS), default=list(WORKS))
    ap.add_argument("--cost-us", "--work-us", type=float, default=20.0,
                    help="work per update in the callback (microseconds)")
    ap.add_argument("--rate", type=float, default=40000.0,
                    help="offered updates/s (open loop; above what the callback sustains)")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long the writer writes")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.cost_us < 0:
        ap.error("--rate and --seconds must be > 0, --cost-us >= 0")
    try:
        args.worker_counts = [int(x) for x in args.workers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--workers: comma-separated counts, got {args.workers!r}")
    if not args.worker_counts or min(args.worker_counts) < 1:
        ap.error("--workers: counts >= 1")
    return args


def canonical_command(args: argparse.Namespace) -> str:
    opts = {k: (",".join(map(str, v)) if isinstance(v, list) else v)
            for k, v in vars(args).items() if k not in ("results_dir", "worker_counts")}
    return rec.command_line(f"bench.{NAME}", opts)


# ================================================================ the work

def make_work(kind: str, cost_us: float):
    """A callable doing about ``cost_us`` of work: a busy loop (holds the GIL) or a
    SHA-256 of a buffer calibrated to that duration (releases the GIL)."""
    cost_ns = int(cost_us * 1000)
    if cost_ns <= 0:
        return lambda: None
    if kind == "cpu":
        clock = time.perf_counter_ns

        def burn() -> None:
            end = clock() + cost_ns
            while clock() < end:
                pass
        return burn
    size = 4096
    while True:  # grow the buffer until one hash takes cost_us (median of 50)
        buf = b"\0" * size
        samples = []
        for _ in range(50):
            t0 = time.perf_counter_ns()
            hashlib.sha256(buf).digest()
            samples.append(time.perf_counter_ns() - t0)
        took = sorted(samples)[25]
        if took >= cost_ns or size >= 1 << 26:
            break
        size = max(size + 4096, int(size * cost_ns / max(took, 1)))
    sha = hashlib.sha256
    return lambda: sha(buf).digest()


def calibrated(kind: str, cost_us: float):
    """(the work, what it measured per call in us, over 200 calls)."""
    work = make_work(kind, cost_us)
    t0 = time.perf_counter_ns()
    for _ in range(200):
        work()
    return work, (time.perf_counter_ns() - t0) / 200 / 1000


def worker_setup(work: str, cost_us: float):
    """Mode workers: what each worker process runs per change (client.workers)."""
    burn = make_work(work, cost_us)

    def handle(change) -> None:
        if change.kind == "put":
            burn()
    return handle


# ================================================================ the subscriber process

def subscriber_main(argv: list[str]) -> None:
    from clonemap.client.api import Clone

    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME} _subscriber")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--deliver", choices=MODES, required=True)
    ap.add_argument("--work", choices=WORKS, required=True)
    ap.add_argument("--cost-us", type=float, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args(argv)
    if args.deliver == "workers":
        return workers_subscriber(args)
    work, work_us = calibrated(args.work, args.cost_us)
    state = {"received": 0, "first_ns": 0, "last_ns": 0, "synced": False}
    done = threading.Event()
    synced = threading.Event()
    count = args.count

    def on_change(change) -> None:
        if change.kind == "synced":
            state["synced"] = True
            synced.set()
            return
        if not state["synced"] or change.kind != "put":
            return
        work()
        now_ns = time.monotonic_ns()  # the writer's clock (CLOCK_MONOTONIC, one host)
        if not state["received"]:
            state["first_ns"] = now_ns
        state["received"] += 1
        state["last_ns"] = now_ns
        if state["received"] >= count:
            done.set()

    with Clone(f"tcp://127.0.0.1:{args.port}", timeout_s=START_TIMEOUT_S,
               deliver=args.deliver, max_lag_s=None,
               watch_capacity=max(10_000, 2 * count)) as clone:
        watch = clone.watch("", callback=on_change)
        if not synced.wait(START_TIMEOUT_S):
            raise SystemExit("handoff subscriber: the watch never synced")
        print("READY subscriber", flush=True)
        heard = -1
        while not done.wait(IDLE_S if state["received"] else START_TIMEOUT_S):
            if state["received"] == heard:
                break  # nothing for IDLE_S: what is missing will not come
            heard = state["received"]
        stats = clone.stats()
        watch.close()
    shard = stats["shards"][0]
    print("RESULT " + json.dumps({
        "received": state["received"], "first_ns": state["first_ns"],
        "last_ns": state["last_ns"], "work_us": round(work_us, 2),
        "max_lag_seen_s": shard["max_lag_seen_s"], "applied": shard["applied"],
        "watch_error": str(watch.error) if watch.error else None,
        "cpu_s": own_cpu_seconds()}), flush=True)


def workers_subscriber(args: argparse.Namespace) -> None:
    """Mode workers: a ``Clone`` whose watch feeds ``--workers`` processes
    (``clonemap.client.workers.Workers``), each burning ``--cost-us`` per update."""
    from clonemap.client.api import Clone
    from clonemap.client.workers import Workers

    _, work_us = calibrated(args.work, args.cost_us)
    capacity = max(10_000, 2 * args.count)
    with Clone(f"tcp://127.0.0.1:{args.port}", timeout_s=START_TIMEOUT_S, max_lag_s=None,
               watch_capacity=capacity) as clone:
        with Workers(clone, "", f"bench.{NAME}:worker_setup", workers=args.workers,
                     args=(args.work, args.cost_us), capacity=capacity) as pool:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not pool.synced:   # the empty map's synced marker
                if time.monotonic() > deadline:
                    raise SystemExit("handoff subscriber: the watch never synced")
                time.sleep(0.01)
            print("READY subscriber", flush=True)
            heard, last_change = -1, time.monotonic()
            while sum(pool.handled) < args.count and pool.error is None:
                pool.wait_idle(0.2)
                done = sum(pool.handled)
                if done != heard:
                    heard, last_change = done, time.monotonic()
                elif time.monotonic() - last_change > (IDLE_S if done else START_TIMEOUT_S):
                    break
            stats = pool.stats()
        shard = clone.stats()["shards"][0]
    print("RESULT " + json.dumps({
        "received": sum(stats["handled"]), "first_ns": 0,
        "last_ns": max(stats["last_ns"]), "work_us": round(work_us, 2),
        "max_lag_seen_s": shard["max_lag_seen_s"], "applied": shard["applied"],
        "watch_error": stats["error"], "per_worker": stats["handled"],
        "worker_pids": stats["pids"], "cpu_s": own_cpu_seconds()}), flush=True)



# ================================================================ the benchmark

def run_one(mode: str, work: str, args: argparse.Namespace, workers: int = 0) -> dict:
    count = max(1, round(args.rate * args.seconds))
    me = [sys.executable, "-m", f"bench.{NAME}"]
    with contextlib.ExitStack() as stack:
        server, port = start_on_free_ports("shard", lambda b: server_argv(
            b, extra=("--log-level", "warning")))
        stack.enter_context(server)
        sub = stack.enter_context(Target("subscriber", [
            *me, "_subscriber", "--port", str(port), "--deliver", mode, "--work", work,
            "--cost-us", f"{args.cost_us:g}", "--count", str(count), "--workers",
            str(workers)], timeout_s=START_TIMEOUT_S))
        writer = stack.enter_context(timed_writer([port], rate=args.rate, count=count))
        t0, cpu0 = time.monotonic(), cpu_seconds([sub.pid, server.pid])
        window = writer.start(0.0, count / args.rate + 1.0)
        wrote = writer.collect(window, args.seconds * 3 + START_TIMEOUT_S).writers[0]
        got = _result_line(sub, args.seconds * 20 + IDLE_S + START_TIMEOUT_S)
        window_s = time.monotonic() - t0
        cpu1 = cpu_seconds([sub.pid, server.pid])
    first_send_ns = wrote["first_send_ns"]
    last_send_ns = first_send_ns + int(wrote["elapsed_s"] * 1e9)
    sent_per_s = (round(wrote["sent_total"] / wrote["elapsed_s"], 1)
                  if wrote["elapsed_s"] else None)
    span_s = (got["last_ns"] - first_send_ns) / 1e9 if got["last_ns"] else 0.0
    return {
        "mode": mode, "workers": workers or None, "per_worker": got.get("per_worker"),
        "work": work, "cost_us": args.cost_us, "work_us": got["work_us"],
        "offered_per_s": args.rate, "updates": count, "sent_per_s": sent_per_s,
        "received": got["received"], "complete": got["received"] == count,
        "delivered_per_s": round(got["received"] / span_s, 1) if span_s > 0 else 0.0,
        "applied": got["applied"],
        "max_lag_seen_s": got["max_lag_seen_s"],
        "done_after_last_send_s": round(max(0.0, (got["last_ns"] - last_send_ns) / 1e9), 3),
        "watch_error": got["watch_error"],
        "subscriber_cpu_pct": round(100 * (got["cpu_s"] - cpu0[sub.pid]) / window_s, 1),
        "server_cpu_pct": round(100 * (cpu1[server.pid] - cpu0[server.pid]) / window_s, 1),
        "window_s": round(window_s, 3),
    }


def run(args: argparse.Namespace) -> rec.Record:
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    record = rec.Record(NAME, canonical_command(args), config)
    for work in args.work:
        for mode in args.modes:
            for n in args.worker_counts if mode == "workers" else [0]:
                what = f"{n} worker process(es)" if n else f"deliver={mode}"
                rec.log(f"{NAME}: {what}, {work} work {args.cost_us:g} us/update, "
                        f"{args.rate:g} updates/s for {args.seconds:g} s")
                r = run_one(mode, work, args, n)
                rec.log(f"  delivered {r['delivered_per_s']:,.0f}/s, complete "
                        f"{r['complete']}, loop lag max {r['max_lag_seen_s']} s")
                record.add_run(r)
    runs = record.data["runs"]
    by = {(r["work"], r["mode"]): r for r in runs}
    ratios = {}
    for work in args.work:
        if (work, "inline") in by and (work, "thread") in by:
            base = by[(work, "inline")]["delivered_per_s"]
            ratios[work] = round(by[(work, "thread")]["delivered_per_s"] / base, 2) \
                if base else None
    label = lambda r: f"{r['work']}/{r['mode']}" + (  # noqa: E731
        f"/{r['workers']}" if r.get("workers") else "")
    scaling = {}
    for work in args.work:
        pool = {r["workers"]: r["delivered_per_s"] for r in runs
                if r["work"] == work and r.get("workers")}
        if 1 in pool and pool[1]:
            scaling[work] = {n: round(v / pool[1], 2) for n, v in sorted(pool.items())}
    record.data["summary"] = {
        "delivered_per_s": {label(r): r["delivered_per_s"] for r in runs},
        "thread_over_inline": ratios,
        "workers_over_one": scaling,
        "all_complete": all(r["complete"] for r in runs),
    }
    record.target("runs where the callback got every update",
                  sum(r["complete"] for r in runs), len(runs), "runs")
    for work, by_n in scaling.items():
        if 4 in by_n:
            record.target(f"worker hand-off ({work}, {args.cost_us:g} us): 4 workers / 1",
                          by_n[4], 3.0, "x")
    record.finish()
    return record


def report(record: rec.Record) -> None:
    rows = [[r["work"], r["mode"] + (f" x{r['workers']}" if r.get("workers") else ""),
             r["work_us"], r["offered_per_s"], r["sent_per_s"],
             r["delivered_per_s"], "yes" if r["complete"] else f"NO ({r['received']})",
             r["max_lag_seen_s"], r["done_after_last_send_s"], r["subscriber_cpu_pct"],
             r["server_cpu_pct"]] for r in record.data["runs"]]
    cfg = record.data["config"]
    rec.table(record, f"{NAME}: one subscriber, a {cfg['cost_us']:g} us callback per update "
                      f"({cfg['seconds']:g} s at {cfg['rate']:g} updates/s offered)",
              ["work", "deliver", "work us (measured)", "offered/s", "sent/s",
               "delivered/s", "every update", "loop lag max s", "done after last send s",
               "subscriber cpu%", "server cpu%"], rows,
              caption="delivered/s: callbacks run / (last callback - first send). loop lag: "
                      "how far the client's loop read behind the publisher (server clock in "
                      "HUGZ, max_lag_seen_s). cpu%: of one core over the run.")
    scaling = record.data["summary"].get("workers_over_one") or {}
    if scaling:
        rec.table(record, f"{NAME}: worker processes, delivered/s over 1 worker",
                  ["work", *[f"{n} workers" for n in next(iter(scaling.values()))]],
                  [[w, *by_n.values()] for w, by_n in scaling.items()])
    ratios = record.data["summary"]["thread_over_inline"]
    if ratios:
        rec.table(record, f"{NAME}: thread / inline, delivered/s",
                  ["work", "ratio"], [[w, v] for w, v in ratios.items()])
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_subscriber"]:
        return subscriber_main(argv[1:])
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
