"""Failover as users run it: a real ``supervisor start`` of ``configs/4shard.yaml`` (ports
moved to free ones; heartbeat 1 s, client silence 3 s, the supervisor's default restart
back-off), ``supervisor kill s0/<active>``, and the supervisor restarting the killed
server, which rejoins PASSIVE.

``python -m bench.failover_supervised [--kills 3]`` (also ``python -m bench.failover
--supervised`` and ``python -m bench failover_supervised``)

For each kill of s0's active server it measures:

* ``write_stall_s``: the longest ``set(..., wait=True)`` of a writer (``Clone(config=)``,
  one key on s0, back to back) across the kill and the restart;
* ``restarted_s``: kill to the killed server running again and PASSIVE (the supervisor's
  own status);
* ``new_clone_s``: then, how long a new ``Clone(config=...)`` over the whole cluster
  takes to start (the restarted server is listed first for s0 when it is the primary);
* ``chp_get_s``: then ``chp --config CONFIG get KEY`` with its default timeout, as a
  process: wall time to exit 0 (interpreter start included: ``python_start_s`` is a bare
  ``python -c "import client.cli"`` for comparison);
* ``passive_refused``: ICANHAZ the restarted (passive) server refused meanwhile: 0 means
  no client waited on it.

Targets (issue "failover that clients don't notice"): ``chp get`` < 1 s after its
interpreter has started, a new ``Clone`` < 1 s, a ``wait=True`` stall <= silence + 1 s.

Duration on a 2-core host: smoke (``--kills 1``) ~20 s; quick (``--kills 3``) ~45 s.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import record as rec
from bench.harness.procs import ROOT, Target, relocated_config

NAME = "failover_supervised"
DURATION = "Duration (2 cores): smoke (--kills 1) ~20 s; quick (--kills 3) ~45 s."
CONFIG = ROOT / "configs" / "4shard.yaml"
DEADLINE_S = 60.0
TARGET_CHP_S = 1.0
TARGET_CLONE_S = 1.0
STALL_SLACK_S = 1.0


def _rows(control: str) -> dict[str, dict]:
    from clonemap.supervisor.control import status_rows

    rows, _ = status_rows(control, timeout_s=5.0)
    return {row["name"]: row for row in rows}


def _wait_rows(control: str, pred, what: str) -> dict[str, dict]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            rows = _rows(control)
            if pred(rows):
                return rows
        except Exception:  # the control plane may be busy: ask again
            rows = {}
        if time.monotonic() > deadline:
            raise TimeoutError(f"supervised failover: {what} not seen within {DEADLINE_S} s")
        time.sleep(0.05)


def _settled(rows: dict[str, dict]) -> bool:
    return all({rows[f"s{i}/primary"]["bstar"], rows[f"s{i}/backup"]["bstar"]}
               == {"ACTIVE", "PASSIVE"} for i in range(4) if f"s{i}/primary" in rows)


class _Writer(threading.Thread):
    """``set(key, ..., wait=True)`` back to back; records (start, end) of each."""

    def __init__(self, clone, key: str):
        super().__init__(name="wait-writer", daemon=True)
        self.clone, self.key = clone, key
        self.spans: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                self.clone.set(self.key, b"w%d" % i, wait=True)
            except Exception as exc:  # a timeout is a finding, not a crash
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.spans.append((t0, time.monotonic()))
            i += 1


def _key_on(cluster, shard: str) -> str:
    index = [s.name for s in cluster.shards].index(shard)
    return next(f"/k{i}" for i in range(100_000)
                if cluster.shard_map.owner(f"/k{i}".encode()) == index)


def run_supervised(args, record: rec.Record, progress: rec.Progress) -> None:
    from clonemap.client.api import Clone

    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="clonemap-failover-") as tmp_dir:
        tmp = Path(tmp_dir)
        config, control, data = relocated_config(CONFIG, tmp)
        silence_s = float(data["silence_timeout_s"])
        record.data["config"].update({"cluster_config": "configs/4shard.yaml (free ports)",
                                      "heartbeat_s": data["heartbeat_s"],
                                      "client_silence_timeout_s": silence_s})
        progress.step("supervisor start (4 shards)")
        sup = Target("supervisor", [python, "-m", "clonemap.supervisor", "start", str(config),
                                    "--no-table", "--run-dir", str(tmp / "run")],
                     ready="READY supervisor", timeout_s=DEADLINE_S)
        writer = None
        try:
            _wait_rows(control, _settled, "every pair ACTIVE/PASSIVE")
            t0 = time.monotonic()
            subprocess.run([python, "-c", "import client.cli"], cwd=ROOT, check=True)
            python_start_s = time.monotonic() - t0
            with Clone(config=str(config)) as wclone:
                key = _key_on(wclone.cluster, "s0")
                wclone.set(key, b"seed", wait=True)
                writer = _Writer(wclone, key)
                writer.start()
                for k in range(args.kills):
                    rows = _wait_rows(control, _settled, "every pair ACTIVE/PASSIVE")
                    victim = next(r for r in ("s0/primary", "s0/backup")
                                  if rows[r]["bstar"] == "ACTIVE")
                    old_pid = rows[victim]["pid"]
                    progress.step(f"kill {k + 1}/{args.kills}: supervisor kill {victim}")
                    t_kill = time.monotonic()
                    subprocess.run([python, "-m", "clonemap.supervisor", "kill", victim, "--control",
                                    control], cwd=ROOT, check=True, capture_output=True)
                    rows = _wait_rows(control, lambda r: r[victim]["pid"] not in (None, old_pid)
                                      and r[victim]["bstar"] == "PASSIVE", f"{victim} PASSIVE")
                    restarted_s = time.monotonic() - t_kill
                    t0 = time.monotonic()
                    with Clone(config=str(config)) as fresh:
                        new_clone_s = time.monotonic() - t0
                        s0 = [a for a in fresh.stats()["shards"] if a["shard"] == "s0"][0]
                    t0 = time.monotonic()
                    out = subprocess.run([python, "-m", "clonemap.client.cli", "--config", str(config),
                                          "get", key], cwd=ROOT, capture_output=True,
                                         text=True, timeout=DEADLINE_S)
                    chp_get_s = time.monotonic() - t0
                    # one more settled write after the restart, then the stall across it
                    done = len(writer.spans)
                    deadline = time.monotonic() + DEADLINE_S
                    while len(writer.spans) < done + 3 and time.monotonic() < deadline:
                        time.sleep(0.02)
                    stall = max((end - start for start, end in list(writer.spans)
                                 if end >= t_kill), default=None)
                    # the restarted process's own counter (a new process starts at 0)
                    refused = _rows(control)[victim]["stats"]["snapshots_refused"]
                    run = {"kill": k + 1, "killed": victim,
                           "restarted_s": round(restarted_s, 3),
                           "write_stall_s": round(stall, 3) if stall is not None else None,
                           "new_clone_s": round(new_clone_s, 3),
                           "new_clone_s0_server": s0["server"],
                           "chp_get_s": round(chp_get_s, 3), "chp_exit": out.returncode,
                           "passive_refused": refused}
                    record.add_run(run)
                    progress.note(f"kill {k + 1} ({victim}): restarted PASSIVE after "
                                  f"{restarted_s:.2f} s; wait=True stall {run['write_stall_s']} s;"
                                  f" new Clone {new_clone_s:.2f} s; chp get {chp_get_s:.2f} s "
                                  f"(exit {out.returncode})")
                writer.stop_event.set()
                writer.join(DEADLINE_S)
        finally:
            if writer is not None:
                writer.stop_event.set()
            sup.stop(grace_s=15)
    runs = record.data["runs"]
    worst = lambda name: max((r[name] for r in runs if r[name] is not None),  # noqa: E731
                             default=None)
    record.data["summary"] = {
        "python_start_s": round(python_start_s, 3),
        "restarted_s": rec.spread([r["restarted_s"] for r in runs], 3),
        "write_stall_s": rec.spread([r["write_stall_s"] for r in runs], 3),
        "new_clone_s": rec.spread([r["new_clone_s"] for r in runs], 3),
        "chp_get_s": rec.spread([r["chp_get_s"] for r in runs], 3),
        "chp_failures": sum(r["chp_exit"] != 0 for r in runs),
        "passive_refused": sum(r["passive_refused"] for r in runs),
        "writer_errors": writer.errors if writer is not None else [],
        "client_silence_timeout_s": silence_s,
    }
    record.target("chp get after restart, minus interpreter start (max)",
                  round(worst("chp_get_s") - python_start_s, 3), TARGET_CHP_S, "s",
                  higher_is_better=False)
    record.target("new Clone over the cluster after restart (max)", worst("new_clone_s"),
                  TARGET_CLONE_S, "s", higher_is_better=False)
    record.target("wait=True stall across kill and restart (max)", worst("write_stall_s"),
                  silence_s + STALL_SLACK_S, "s", higher_is_better=False)
    record.target("ICANHAZ refused by the restarted passive", sum(
        r["passive_refused"] for r in runs), 0.5, "requests", higher_is_better=False)


def report_supervised(record: rec.Record) -> None:
    rows = [[r["kill"], r["killed"], r["restarted_s"], r["write_stall_s"], r["new_clone_s"],
             r["chp_get_s"], r["chp_exit"], r["passive_refused"]] for r in record.data["runs"]]
    s = record.data["summary"]
    rec.table(record, f"{NAME}: per kill (seconds)", [
        "kill", "killed", "restarted PASSIVE", "wait=True stall", "new Clone", "chp get",
        "chp exit", "refused by passive"], rows,
        caption=f"Supervisor restarting the killed server (default back-off); client silence "
                f"timeout {s['client_silence_timeout_s']:g} s; a bare interpreter start "
                f"importing client.cli took {s['python_start_s']} s (inside chp get's time). "
                f"Writer errors: {len(s['writer_errors'])}.")
    rec.print_targets(record)


def parse_args(argv: list[str] | None = None):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.failover_supervised",
                                 description=__doc__.split("\n")[0], epilog=DURATION)
    ap.add_argument("--kills", type=int, default=3, help="supervisor kill this many times")
    ap.add_argument("--supervised", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR))
    args = ap.parse_args(argv)
    if args.kills < 1:
        ap.error("--kills >= 1")
    return args


def main_supervised(args) -> rec.Record:
    record = rec.Record(NAME, rec.command_line(f"bench.{NAME}", {"kills": args.kills}),
                        {"kills": args.kills})
    with rec.Progress(NAME, 1 + args.kills) as progress:
        run_supervised(args, record, progress)
        progress.finish_step()
    record.finish()
    return record


def main(argv: list[str] | None = None) -> rec.Record:
    from bench.harness.procs import bench_main

    return bench_main(NAME, parse_args, main_supervised, report_supervised, argv)


if __name__ == "__main__":
    main()
