"""MDP/0.2 echo through the broker, beside a bare ROUTER that answers directly (the ceiling).

``python -m bench.mdp_echo [--seconds 3] [--warmup 0.5] [--rounds 2] [--clients 8]
[--body-bytes 32]``

Scenarios: one worker and four workers (each a ``shards.mdp.worker.MdpWorker`` process
with a plain echo handler), each driven two ways: ``sync`` (one ``SyncMdpClient``, one
request at a time) and ``inflight`` (``--clients`` ``MdpClient`` objects on one uvloop,
each with its one request in flight, as MDP/Client allows). Each scenario runs the SAME
clients against the bare ROUTER (``--role bare``: reads MDPC02 REQUEST, sends MDPC02 FINAL
back with the same body, through the same ``shards.zio`` calls the broker uses) and
against the real broker (``python -m supervisor broker``), alternating, ``--rounds``
times; the headline per scenario is the best round of each side and their ratio.

Target: the broker path reaches >= 70% of the ceiling. The broker path has twice the
hops of the ceiling (client -> broker -> worker -> broker -> client) on a machine whose
cores are shared by every process of the run, so the sync figures are bound by latency.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from bench import record as rec

NAME = "mdp_echo"
TARGET_RATIO = 0.70


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="MDP echo req/s: broker vs a bare ROUTER")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured window per run")
    ap.add_argument("--warmup", type=float, default=0.5, help="warm-up before each window")
    ap.add_argument("--rounds", type=int, default=2, help="ceiling+broker pairs per scenario")
    ap.add_argument("--clients", type=int, default=8, help="clients in the inflight mode")
    ap.add_argument("--body-bytes", type=int, default=32)
    ap.add_argument("--workers", default="1,4", help="worker counts to run (comma list)")
    ap.add_argument("--modes", default="sync,inflight", help="client modes (comma list)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    # process roles used by the benchmark itself
    ap.add_argument("--role", choices=("bench", "bare", "worker"), default="bench",
                    help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ===================================================================== server roles

def _run(coro) -> None:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


async def _until_signal() -> None:
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def bare_router(endpoint: str) -> None:
    """The ceiling: a ROUTER answering each MDPC02 REQUEST itself, with the same body."""
    import zmq

    from shards.proto.mdp import C_FINAL, C_REQUEST, MDPC
    from shards.zio import AsyncSocket, send_frames

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(endpoint)

    def on_message(frames: list[bytes]) -> None:
        if len(frames) >= 5 and frames[1] == MDPC and frames[2] == C_REQUEST:
            send_frames(sock, [frames[0], MDPC, C_FINAL, frames[3], *frames[4:]])

    asock = AsyncSocket(sock, on_message, name="bare-router")
    print(f"READY bare-router bind={endpoint}", flush=True)
    await _until_signal()
    asock.close()
    ctx.term()


async def echo_worker(endpoint: str) -> None:
    from shards.mdp.worker import MdpWorker

    def echo(request):
        return request.body

    async with MdpWorker(endpoint, "echo", echo, heartbeat_s=2.5):
        print(f"READY echo-worker connect={endpoint}", flush=True)
        await _until_signal()


# ===================================================================== clients

def drive_sync(endpoint: str, body: bytes, warmup_s: float, seconds: float) -> dict:
    from shards.mdp.client import SyncMdpClient

    with SyncMdpClient(endpoint, timeout_s=5, retries=0) as client:
        end_warmup = time.monotonic() + warmup_s
        while time.monotonic() < end_warmup:
            client.request("echo", body)
        n = 0
        t0 = time.monotonic()
        end = t0 + seconds
        while True:
            reply = client.request("echo", body)
            n += 1
            if n & 63 == 0 and time.monotonic() >= end:
                break
        elapsed = time.monotonic() - t0
        assert reply == [body]
    return {"requests": n, "elapsed_s": round(elapsed, 4), "rps": round(n / elapsed, 1)}


async def _drive_inflight(endpoint: str, body: bytes, clients: int, warmup_s: float,
                          seconds: float) -> dict:
    from shards.mdp.client import MdpClient

    counts = [0] * clients
    stop = False

    async def one(i: int, client: MdpClient) -> None:
        while not stop:
            reply = await client.request("echo", body)
            counts[i] += 1
        assert reply == [body]

    pool = [MdpClient(endpoint, timeout_s=5, retries=0) for _ in range(clients)]
    tasks = [asyncio.ensure_future(one(i, c)) for i, c in enumerate(pool)]
    await asyncio.sleep(warmup_s)
    start = sum(counts)
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    n = sum(counts) - start
    elapsed = time.monotonic() - t0
    stop = True
    await asyncio.gather(*tasks)
    for c in pool:
        await c.close()
    return {"requests": n, "elapsed_s": round(elapsed, 4), "rps": round(n / elapsed, 1)}


def drive_inflight(endpoint: str, body: bytes, clients: int, warmup_s: float,
                   seconds: float) -> dict:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_drive_inflight(endpoint, body, clients, warmup_s, seconds))


# ===================================================================== the benchmark

def canonical_command(args: argparse.Namespace) -> str:
    opts = {k: v for k, v in vars(args).items() if k not in ("results_dir", "role", "endpoint")}
    return rec.command_line(f"bench.{NAME}", opts)


def run_bench(args: argparse.Namespace) -> rec.Record:
    from bench.runner import Target, exit_on_sigterm, free_port_base

    exit_on_sigterm()
    worker_counts = [int(x) for x in args.workers.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    body = b"x" * args.body_bytes
    config = {k: v for k, v in vars(args).items() if k not in ("role", "endpoint")}
    record = rec.Record(NAME, canonical_command(args), config)
    record.data["host"]["uvloop"] = __import__("uvloop").__version__
    base = free_port_base(2)
    bare_ep = f"tcp://127.0.0.1:{base}"
    broker_ep = f"tcp://127.0.0.1:{base + 1}"
    py = sys.executable
    me = [py, "-m", f"bench.{NAME}"]
    targets: list[Target] = []
    rows = []
    try:
        targets.append(Target("bare-router", [*me, "--role", "bare", "--endpoint", bare_ep]))
        targets.append(Target("broker", [py, "-m", "supervisor", "broker", "--bind", broker_ep,
                                         "--log-level", "WARNING"]))
        workers = 0
        for wanted in worker_counts:
            while workers < wanted:
                targets.append(Target(f"worker{workers}", [*me, "--role", "worker",
                                                           "--endpoint", broker_ep]))
                workers += 1
            _wait_workers(broker_ep, wanted)
            for mode in modes:
                clients = 1 if mode == "sync" else args.clients
                best = {"ceiling": 0.0, "broker": 0.0}
                for rnd in range(args.rounds):
                    for side, ep in (("ceiling", bare_ep), ("broker", broker_ep)):
                        rec.log(f"{mode} workers={wanted} clients={clients} round {rnd + 1} "
                                f"{side}")
                        if mode == "sync":
                            fig = drive_sync(ep, body, args.warmup, args.seconds)
                        else:
                            fig = drive_inflight(ep, body, clients, args.warmup, args.seconds)
                        fig.update(mode=mode, workers=wanted, clients=clients, side=side,
                                   round=rnd + 1, loadavg=[round(x, 2) for x in os.getloadavg()])
                        record.add_run(fig)
                        best[side] = max(best[side], fig["rps"])
                ratio = best["broker"] / best["ceiling"] if best["ceiling"] else 0.0
                key = f"{mode}_w{wanted}"
                record.data["summary"][key] = {
                    "mode": mode, "workers": wanted, "clients": clients,
                    "ceiling_rps": best["ceiling"], "broker_rps": best["broker"],
                    "ratio": round(ratio, 3)}
                record.target(f"broker/ceiling {key}", round(ratio, 3), TARGET_RATIO, "ratio")
                rows.append([key, clients, wanted, best["ceiling"], best["broker"],
                             round(ratio, 3)])
        broker_stats = _broker_stats(broker_ep)
        record.data["broker_stats"] = {k: broker_stats.get(k) for k in
                                       ("counters", "drops", "unroutable", "handler_errors")}
    finally:
        for t in reversed(targets):
            t.stop()
    record.finish()
    rec.print_table(f"{NAME}: echo requests/s (best of {args.rounds} rounds)",
                    ["scenario", "clients", "workers", "ceiling req/s", "broker req/s",
                     "broker/ceiling"], rows, caption=record.data["command"])
    rec.print_targets(record)
    path = record.save(args.results_dir)
    rec.log(f"saved {path}")
    return record


def _wait_workers(endpoint: str, count: int, timeout_s: float = 20.0) -> None:
    """Until the broker reports ``count`` echo workers (mmi.stats)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = _broker_stats(endpoint)
        if s.get("services", {}).get("echo", {}).get("workers", 0) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"broker {endpoint} has not {count} echo workers: {s}")
        time.sleep(0.05)


def _broker_stats(endpoint: str) -> dict:
    import json

    from shards.mdp.client import SyncMdpClient

    with SyncMdpClient(endpoint, timeout_s=5, retries=0) as client:
        return json.loads(client.request("mmi.stats")[0])


def main(argv: list[str] | None = None) -> rec.Record | None:
    args = parse_args(argv)
    if args.role == "bare":
        _run(bare_router(args.endpoint))
        return None
    if args.role == "worker":
        _run(echo_worker(args.endpoint))
        return None
    return run_bench(args)


if __name__ == "__main__":
    main()
