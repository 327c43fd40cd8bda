"""A/B of the join: servers of several checkouts side by side, and the client's two row
takers, joins alternating in one process (``python -m bench.join_ab``).

Each ``--server NAME=DIR`` starts ``python -m clonemap.shards`` from checkout ``DIR`` (its own
``shards`` package and compiled extension; ``.`` is this one), standalone with ``--fsync
everysec``, and loads the same ``--keys`` keys of ``--value-bytes`` into each. Then, per
round, a new ``AsyncClone`` (this checkout's client) joins each server in turn, until it
holds the whole map and follows it: the join's time, this process's CPU (the client) and
the server's CPU (every thread) from before the client was made to its ``start()``
returning, each once every server's CPU time has stood still for 50 ms. After them, the client's row takers against the first server, alternating:
``python`` (every KVSYNC through ``Incoming.on_message``) and ``compiled``
(``_zframes.take_rows``; skipped on the pure path).

To compare commits, check each out beside this one and build its extension in place:

    git worktree add /tmp/old <commit>
    (cd /tmp/old && gcc -shared -fPIC -O2 -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \\
        shards/common/_zframes.c -o shards/common/_zframes$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))'))
    python -m bench.join_ab --server new=. --server old=/tmp/old

Medians per server and taker, with min-max; one target, the issue's server CPU per join
(< 0.2 s) for the first server (the join's ratio to Redis is the peers scenario's).
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench.harness import record as rec
from bench.harness.procs import ROOT, bench_main, free_port_base
from clonemap.shards.common.children import terminate

NAME = "join_ab"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", default=[], metavar="NAME=DIR",
                    help="a server from checkout DIR (repeatable; default: this one, as 'this')")
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--joins", type=int, default=7, help="joins per server and per taker")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    servers = args.server or ["this=."]
    args.servers = {}
    for spec in servers:
        name, _, where = spec.partition("=")
        path = (ROOT / where).resolve() if where else None
        if not name or path is None or not (path / "shards" / "__main__.py").exists():
            ap.error(f"--server {spec!r}: NAME=DIR, DIR a checkout with shards/")
        args.servers[name] = path
    return args


async def _load(address: str, keys: int, value: bytes) -> None:
    from clonemap.client.api import AsyncClone

    clone = AsyncClone(address, codec="bytes", timeout_s=60)
    await clone.start()
    for base in range(0, keys, 1000):
        await asyncio.gather(*(clone.set(f"/j/k{i}", value, wait=True)
                               for i in range(base, min(keys, base + 1000))))
    await clone.close()


async def _settle(servers, quiet_s: float = 0.05, most_s: float = 3.0) -> None:
    """Until no server used CPU for ``quiet_s`` (a server that just streamed a snapshot
    gives its heap back after it: not while the next one is measured)."""
    deadline = time.monotonic() + most_s
    last = None
    while time.monotonic() < deadline:
        now = [sum(p.cpu_times()[:2]) for p in servers]
        if now == last:
            return
        last = now
        await asyncio.sleep(quiet_s)


async def _join(address: str, server: psutil.Process, keys: int, everyone) -> dict:
    from clonemap.client.api import AsyncClone

    await _settle(everyone)

    s0, c0, t0 = sum(server.cpu_times()[:2]), time.process_time(), time.perf_counter()
    clone = AsyncClone(address, codec="bytes", timeout_s=60)
    await clone.start()
    t1, c1, s1 = time.perf_counter(), time.process_time(), sum(server.cpu_times()[:2])
    held = len(clone)
    await clone.close()
    if held != keys:
        raise RuntimeError(f"{address}: joined {held} keys of {keys}")
    return {"join_ms": round((t1 - t0) * 1e3, 2), "client_cpu_s": round(c1 - c0, 4),
            "server_cpu_s": round(s1 - s0, 4)}


async def _measure(args, record: rec.Record, addresses: dict, procs: dict) -> None:
    from clonemap.client import incoming

    value = b"v" * args.value_bytes
    for address in addresses.values():
        await _load(address, args.keys, value)
    for rnd in range(args.joins):
        for name, address in addresses.items():
            record.add_run({"round": rnd, "kind": "server", "name": name,
                            **await _join(address, procs[name], args.keys, procs.values())})
    compiled = incoming._take_rows
    takers = {"python": None, "compiled": compiled} if compiled else {"python": None}
    first = next(iter(addresses))
    try:
        for rnd in range(args.joins):
            for name, taker in takers.items():
                incoming._take_rows = taker
                record.add_run({"round": rnd, "kind": "taker", "name": name,
                                **await _join(addresses[first], procs[first], args.keys,
                                              procs.values())})
    finally:
        incoming._take_rows = compiled


def run(args: argparse.Namespace) -> rec.Record:
    config = {"server": [f"{n}={p}" for n, p in args.servers.items()], "keys": args.keys,
              "value_bytes": args.value_bytes, "joins": args.joins}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    procs: dict[str, subprocess.Popen] = {}
    addresses: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="join-ab-") as tmp:
        try:
            for name, path in args.servers.items():
                port = free_port_base(3)
                popen = subprocess.Popen(
                    [sys.executable, "-m", "clonemap.shards", "--port", str(port), "--data-dir",
                     str(Path(tmp) / name), "--fsync", "everysec"], cwd=path,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
                procs[name] = popen
                if not (popen.stdout.readline() or b"").startswith(b"READY"):
                    raise RuntimeError(f"server {name} ({path}) did not start")
                addresses[name] = f"tcp://127.0.0.1:{port}"
            watched = {name: psutil.Process(p.pid) for name, p in procs.items()}
            try:
                from uvloop import run as run_loop
            except ImportError:
                run_loop = asyncio.run
            run_loop(_measure(args, record, addresses, watched))
        finally:
            for popen in procs.values():
                terminate(popen, 5.0)
    record.finish()
    summary = {}
    for kind, name in dict.fromkeys((r["kind"], r["name"]) for r in record.data["runs"]):
        mine = [r for r in record.data["runs"] if (r["kind"], r["name"]) == (kind, name)]
        summary[f"{kind} {name}"] = {f: rec.spread([r[f] for r in mine], 4)
                                     for f in ("join_ms", "client_cpu_s", "server_cpu_s")}
    record.data["summary"] = summary
    first = next(iter(args.servers))
    record.target(f"server CPU per join of the map ({first})",
                  summary[f"server {first}"]["server_cpu_s"]["median"], 0.2, "s",
                  higher_is_better=False)
    return record


def report(record: rec.Record) -> None:
    def cell(entry: dict) -> str:
        return f"{entry['median']:g} ({entry['min']:g}-{entry['max']:g})"

    rows = [[what, *(cell(fig[f]) for f in ("join_ms", "client_cpu_s", "server_cpu_s"))]
            for what, fig in record.data["summary"].items()]
    c = record.data["config"]
    rec.table(record, f"{NAME}: {c['keys']:,} keys of {c['value_bytes']} B, {c['joins']} "
              "joins each, alternating; median (min-max)",
              ["server / client taker", "join (ms)", "client CPU (s)", "server CPU (s)"], rows,
              "takers: against the first server; " + ", ".join(c["server"]))
    rec.print_targets(record)


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
