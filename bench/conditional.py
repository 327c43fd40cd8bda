"""Conditional writes against plain ``wait=True`` writes, same run
(``python -m bench conditional``).

A Binary Star pair (``fsync: no`` by default, ``--fsync`` to change it) started by hand as
``python -m clonemap.shards --primary/--backup``; ``--writers`` client processes, each one
``AsyncClone`` writing its own keys one after another (closed loop: the next write when
the last is acknowledged), for ``--seconds`` per mode after ``--warmup``:

* ``plain``: ``set(key, value, wait=True)``: acknowledged when its KVPUB is back;
* ``cas``: ``set(key, value, if_seq=S)`` with S the key's sequence from the writer's own
  last write: acknowledged by the KVREPLY and its KVPUB back (never a conflict: each
  writer owns its keys);
* ``contended``: every writer on one counter key, read-modify-write with ``if_seq``,
  retried on ``Conflict``: successful increments/s and the conflict rate.

Per mode and round: writes/s (all writers), p50/p99 of the acknowledgement latency, and
the shard server's CPU per write. Modes alternate within each round, so the ratios
(cas / plain) are measured in one run. Duration: smoke (``--seconds 0.5 --warmup 0.2
--rounds 1``) ~15 s; quick (``--seconds 2 --rounds 2``) ~40 s.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

import psutil

from bench.harness import record as rec
from bench.harness.procs import bench_main
from bench.harness.traffic import percentiles_ms

NAME = "conditional"
MODES = ("plain", "cas", "contended")

WRITER = textwrap.dedent("""
    import asyncio, json, sys, time
    sys.path.insert(0, {root!r})
    from clonemap.client.api import AsyncClone, Conflict

    async def main(servers, me, mode, seconds, warmup):
        async with AsyncClone(servers.split(","), timeout_s=10) as c:
            lat, conflicts, seqs, errors = [], 0, {{}}, []
            keys = [f"/bench/{{me}}/{{i}}" for i in range(16)]
            for k in keys:
                seqs[k] = await c.set(k, b"0", create=True) if c.meta(k) is None \\
                    else c.meta(k).seq
            t0 = time.monotonic()
            start, end = t0 + warmup, t0 + warmup + seconds
            i = 0
            while (now := time.monotonic()) < end:
                k = keys[i % len(keys)]
                i += 1
                t = time.perf_counter()
                try:
                    if mode == "plain":
                        await c.set(k, b"v%d" % i, wait=True)
                    elif mode == "cas":
                        seqs[k] = await c.set(k, b"v%d" % i, if_seq=seqs[k])
                    else:
                        m = c.meta("/bench/counter")
                        n = int(c.get("/bench/counter", b"0"))
                        if m is None:
                            await c.set("/bench/counter", b"1", create=True)
                        else:
                            await c.set("/bench/counter", b"%d" % (n + 1), if_seq=m.seq)
                except Conflict:
                    conflicts += 1
                    continue
                except Exception as exc:  # reported in the record, never hidden
                    errors.append(repr(exc)[:300])
                    continue
                if now >= start:
                    lat.append(time.perf_counter() - t)
            print(json.dumps({{"n": len(lat), "lat": lat, "conflicts": conflicts,
                              "errors": errors}}), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]),
                     float(sys.argv[5])))
""")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench {NAME}", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fsync", choices=("no", "everysec", "always"), default="no")
    ap.add_argument("--port", type=int, default=0, help="port base (0: a free one)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> rec.Record:
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    from bench.harness.procs import Target, free_port_base

    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", config), config)
    root = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "writer.py"
        script.write_text(WRITER.format(root=root))
        primary = args.port or free_port_base(4)
        backup = free_port_base(4) if not args.port else args.port + 10
        py = [sys.executable, "-m", "clonemap.shards", "--fsync", args.fsync]
        targets = []
        for role, port, peer in (("primary", primary, backup), ("backup", backup, primary)):
            targets.append(Target(role, py + [
                "--port", str(port), f"--{role}", "--peer", f"127.0.0.1:{peer}",
                "--data-dir", str(Path(tmp) / role)]))
        servers = f"tcp://127.0.0.1:{primary},tcp://127.0.0.1:{backup}"
        try:
            from clonemap.client.api import Clone

            with Clone(servers.split(","), timeout_s=30) as first:  # its vote: an active
                first.set("/bench/ready", b"1", wait=True)
            server = psutil.Process(targets[0].pid)
            for rnd in range(args.rounds):
                for mode in MODES:
                    cpu0 = sum(server.cpu_times()[:2])
                    t0 = time.monotonic()
                    procs = [subprocess.Popen(
                        [sys.executable, str(script), servers, f"w{i}", mode,
                         str(args.seconds), str(args.warmup)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) for i in range(args.writers)]
                    outs = []
                    for p in procs:
                        out, err = p.communicate(timeout=120)
                        if p.returncode != 0 or not out.strip():
                            raise RuntimeError(f"a {mode} writer failed ({p.returncode}): "
                                               + "\n".join(err.splitlines()[-3:]))
                        outs.append(json.loads(out.strip().splitlines()[-1]))
                    cpu = sum(server.cpu_times()[:2]) - cpu0
                    wall = time.monotonic() - t0
                    lat = percentiles_ms(sorted(int(x * 1e9) for o in outs
                                                for x in o["lat"]), (50, 99))
                    n = sum(o["n"] for o in outs)
                    record.add_run({
                        "round": rnd, "mode": mode, "writes": n,
                        "writes_per_s": round(n / args.seconds, 1),
                        "p50_ms": lat.get("p50", 0.0), "p99_ms": lat.get("p99", 0.0),
                        "conflicts": sum(o["conflicts"] for o in outs),
                        "errors": [e for o in outs for e in o["errors"]],
                        "server_cpu_s": round(cpu, 3), "wall_s": round(wall, 2)})
        finally:
            for target in reversed(targets):
                target.stop()
    record.finish()
    runs = record.data["runs"]
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: rec.spread([r[k] for r in mine], 3)
                         for k in ("writes_per_s", "p50_ms", "p99_ms")}
    ratios = [c["writes_per_s"] / p["writes_per_s"] for p, c in zip(
        [r for r in runs if r["mode"] == "plain"], [r for r in runs if r["mode"] == "cas"])
        if p["writes_per_s"]]
    summary["cas_over_plain_writes_per_s"] = rec.spread(ratios, 3)
    record.data["summary"] = summary
    return record


def report(record: rec.Record) -> None:
    rows = [[r["round"], r["mode"], r["writes_per_s"], r["p50_ms"], r["p99_ms"],
             r["conflicts"], len(r["errors"])] for r in record.data["runs"]]
    rec.table(record, f"{NAME}: closed-loop writers, one Binary Star pair",
              ["round", "mode", "writes/s", "p50 ms", "p99 ms", "conflicts", "errors"], rows,
              "plain: set(wait=True); cas: set(if_seq=S), no contention; contended: one "
              "counter, read-modify-write, retried on Conflict (writes/s = successes)")
    s = record.data["summary"]
    rec.log(f"{NAME}: cas / plain writes/s = {s['cas_over_plain_writes_per_s']}")
    for r in record.data["runs"]:
        for error in r["errors"][:3]:
            rec.log(f"{NAME}: round {r['round']} {r['mode']}: {error}")


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
