"""``python -m bench.report``: REPORT.md and PNG plots from records written here.

Records are built with bench.harness.record.Record (real host facts) in the schemas of the issue-7
design (scaleout, latency and snapshot points, same-run ceilings), plus real records
copied from bench/results/latest; each test runs the report as a real process and reads
what it wrote. Values are chosen on both sides of every issue-7 target.
"""
from __future__ import annotations

import shutil

import pytest

from bench.harness.record import Record, spread
from conftest import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TITLES = ["Single-shard throughput", "Scale-out over 1, 2 and 4 shards",
          "Latency at fixed offered rates", "Snapshot join time and memory per key",
          "Fan-out to many subscribers", "Failover gap", "Load generator", "Callback hand-off"]
COPIED = ["failover", "handoff"]  # real records, as the benchmarks saved them


def fig(rate: float) -> dict:
    """A ceiling figure as bench.harness.ceilings returns it."""
    return {"received_per_s": rate, "sent_per_s": rate * 1.01, "loss_window": 0,
            "latency_ms": {"p50": 0.4, "p90": 0.6, "p99": 0.9, "p99.9": 1.5, "max": 3.0}}


CEILINGS = {"pubsub": fig(150_000.0), "forwarder": fig(100_000.0), "config": {"seconds": 2}}


def save(results_dir, name: str, summary: dict, command: str, runs=({"window_s": 1.0},)):
    record = Record(name, command, config={"rounds": 3})
    record.data["summary"] = summary
    for run in runs:
        record.add_run(run)
    record.target(f"{name} own target", 1.0, 2.0, "x", higher_is_better=False)
    record.finish()
    record.save(results_dir)


def write_records(results_dir, *, good: bool, snapshot: bool = True) -> dict[str, str]:
    """Records on the met (``good``) or NOT met side of each issue-7 target; their commands."""
    cmds = {n: f"python -m bench.{n} --rounds 3 --marker-{n}"
            for n in ("chp_throughput", "scaleout", "latency", "snapshot")}
    server = [80_000, 82_000, 78_000] if good else [50_000, 52_000, 48_000]  # 0.80 / 0.50
    save(results_dir, "chp_throughput", {"server": {"received_per_s": spread(server)},
                                         "ceilings": CEILINGS}, cmds["chp_throughput"])
    one, two, four = (50_000, 80_000, 85_000) if good else (50_000, 45_000, 40_000)
    points = []
    for target, k in (("server", 1.0), ("forwarder", 1.2)):
        for shards, agg in ((1, one), (2, two), (4, four)):
            points.append({"shards": shards, "target": target,
                           "received_per_s": spread([agg * k * 0.95, agg * k, agg * k * 1.05]),
                           "cpu_cores": spread([1.5, 1.6, 1.7]),
                           "per_core_per_s": spread([agg * k / 1.7, agg * k / 1.6]),
                           "efficiency": agg / (shards * one)})
    save(results_dir, "scaleout", {"points": points, "ceilings": CEILINGS,
                                   "contention": "two cores: contention from 2 shards",
                                   "estimate_16core": {"shards": 6, "updates_per_s": 400_000}},
         cmds["scaleout"])
    p99_half = 1.2 if good else 7.5
    points = []
    for target, k in (("server", 1.0), ("forwarder", 0.7), ("pubsub", 0.4)):
        for frac in (0.1, 0.5, 0.9):
            p99 = (p99_half if frac == 0.5 else frac * 10) * k
            points.append({"offered_per_s": 80_000 * frac, "fraction_of_max": frac,
                           "target": target, "received_per_s": spread([80_000 * frac] * 3),
                           "latency_ms": {"p50": spread([0.3 * k, 0.35 * k, 0.4 * k]),
                                          "p90": spread([p99 / 2] * 3),
                                          "p99": spread([p99 * 0.9, p99, p99 * 1.1]),
                                          "p99.9": spread([p99 * 2] * 3),
                                          "max": spread([p99 * 4] * 3)},
                           "loss": 0, "writer_drops": 0})
    save(results_dir, "latency", {"single_shard_max_per_s": 80_000.0, "points": points,
                                  "ceilings": CEILINGS}, cmds["latency"])
    if snapshot:
        points = [{"keys": n, "join_s": spread([n / 3e5, n / 2.9e5, n / 3.1e5]),
                   "bytes_per_key": spread([330.0, 333.0]), "ceiling_pubsub_s": n / 150_000}
                  for n in (10_000, 100_000, 1_000_000)]
        runs = [{"keys": n, "snapshots": [{"seconds": n / r} for r in (3e5, 2.9e5, 3.1e5)]}
                for n in (10_000, 100_000, 1_000_000)]
        save(results_dir, "snapshot", {"points": points, "ceilings": CEILINGS},
             cmds["snapshot"], runs)
    for name in COPIED:
        shutil.copy(ROOT / "bench" / "results" / "latest" / f"{name}.json",
                    results_dir / "latest" / f"{name}.json")
    return cmds


def run_report(procs, results_dir):
    proc = procs.python("-m", "bench.report", "--results-dir", str(results_dir))
    assert proc.wait(60) == 0, "\n".join(proc.stderr[-30:])
    proc.stop()  # joins the output pumps
    assert not any("Traceback" in line for line in proc.stderr), "\n".join(proc.stderr)
    return (results_dir / "REPORT.md").read_text(), proc.stderr


def glance(report: str) -> dict[str, str]:
    """Issue 7's rows of the at-a-glance table: scenario -> met column."""
    rows = {}
    for line in report.split("## Method")[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ("single", "scaleout", "latency"):
            rows.setdefault(cells[0], cells[4])  # the first row: the issue-7 target
    return rows


def check_png(path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500, (path, pixels.shape)
    assert pixels.std() > 0.05, f"{path} looks blank"


def test_report_from_records_meeting_the_targets(procs, tmp_path):
    cmds = write_records(tmp_path, good=True)
    shutil.copy(ROOT / "bench" / "results" / "latest" / "fanout.json", tmp_path / "latest")
    report, _ = run_report(procs, tmp_path)
    for title in ["Targets at a glance", "Method", "How to reproduce", "MDP/0.2 broker",
                  *TITLES]:
        assert f"## {title}" in report, title
    assert glance(report) == {"single": "met", "scaleout": "met", "latency": "met"}
    assert "| single | one shard / bare forwarding loop (medians) | 0.800 | >= 0.70 | met |" \
        in report
    for command in cmds.values():
        assert f"`{command}`" in report
    for name in ["fanout", *COPIED]:
        assert f"`python -m bench.{name} " in report  # the copied records' own commands
    assert "Not run yet: `python -m bench load`" in report
    assert "80,000 (78,000-82,000, 5.0%) | 3 |" in report  # median (min-max, spread) runs
    assert "| forwarder | 100,000 | 101,000 |" in report  # same-run ceilings
    assert "server / forwarder ceiling (medians): 0.800" in report
    assert "| chp_throughput own target | 1 x | < 2 | met |" in report
    assert "load average [" in report and " -> [" in report and "libzmq" in report
    assert "Contention: two cores: contention from 2 shards" in report
    # a 10k-key join (0.033 s) that record.spread rounded to 0.0 s, taken from the runs
    assert "| 10,000 | 0.0333 (0.0323-0.0345, 6.7%) |" in report
    for name in ("scaleout", "latency", "snapshot", "fanout"):
        check_png(tmp_path / "plots" / f"{name}.png")
        assert f"![{name}](plots/{name}.png)" in report


def test_report_says_not_met_not_run_and_unreadable(procs, tmp_path):
    write_records(tmp_path, good=False, snapshot=False)
    (tmp_path / "latest" / "fanout.json").write_text('{"benchmark": "fanout", ')  # cut short
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "snapshot.png").write_bytes(b"an old picture")
    report, stderr = run_report(procs, tmp_path)
    assert glance(report) == {"single": "NOT met", "scaleout": "NOT met",
                              "latency": "NOT met"}
    assert "7.5 ms at 50% of max" in report
    assert "Not run yet: `python -m bench snapshot`" in report
    assert "**Record unreadable**" in report and "fanout.json" in report
    assert any("warning" in line and "fanout.json" in line for line in stderr)
    assert not (tmp_path / "plots" / "snapshot.png").exists()  # no stale picture linked
    assert not (tmp_path / "plots" / "fanout.png").exists()
    check_png(tmp_path / "plots" / "scaleout.png")


def test_a_results_dir_that_does_not_exist_is_a_usage_error(tmp_path, capsys):
    from bench.report import main

    with pytest.raises(SystemExit) as exc:
        main(["--results-dir", str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    assert "no such directory" in capsys.readouterr().err


def test_odd_or_partial_records_give_dashes_not_errors(tmp_path):
    """Keys a producer left out or filled with the wrong type: "-" cells, no exception;
    fan-out points (the newer schema) are drawn with their spreads."""
    from bench import report, report_plots

    odd = {
        "chp_throughput": {"benchmark": "chp_throughput", "summary": [], "targets": "x"},
        "scaleout": {"benchmark": "scaleout", "summary": {"points": [
            {"shards": 1, "target": "server"}, {"shards": "two"}, "not a point",
            {"shards": 2, "target": "server", "received_per_s": spread([5.0, 6.0])},
            {"shards": 2, "target": "server", "received_per_s": spread([7.0, 8.0])}]}},
        "latency": {"benchmark": "latency", "host": None, "summary": {
            "single_shard_max_per_s": "fast", "points": [
                {"target": "server", "fraction_of_max": 0.5, "latency_ms": {"p99": None}}]}},
        "snapshot": {"benchmark": "snapshot", "runs": [{"keys": 10, "snapshots": [{}]}],
                     "summary": {"ceilings": {"pubsub": "fast"}}},
        "fanout": {"benchmark": "fanout", "started_at": "2026-11-21T22:00:00+00:00",
                   "summary": {"by_run": {"1x1": {"p99_ms": 0.9}}, "points": [
                       {"shards": s, "subscribers": n, "delivered_per_s_min": spread([999, 1000]),
                        "latency_ms": {"p99": spread([0.5 * n, 0.6 * n])}, "p99_to_pubsub": 2.0}
                       for s in (1, 4) for n in (1, 4, 16)]}},
    }
    text = report.render(tmp_path, tmp_path, odd, {})
    rows = {r[0]: r for r in report.glance_rows(odd)}
    assert rows["single"][4] == rows["scaleout"][4] == rows["latency"][4] == "-"
    assert "| shards | subscribers | delivered/s (lowest sub) | p99 ms | p99 / pubsub | runs |" \
        in text
    assert "| 4 | 16 | 999.5 (999-1,000, 0.1%) | 8.8 (8-9.6, 18.2%) | 2 | 2 |" in text
    assert "**by_run**" not in text  # the same medians as the points: shown once
    drawn = report_plots.draw_all(odd, tmp_path / "plots")
    assert set(drawn) == {"fanout", "scaleout"}
    check_png(drawn["fanout"])


def test_the_fanout_rate_counts_the_timed_span_only():
    """3 s of timed updates at 2,000/s after a 1 s warm-up, the last one arriving 2 ms
    after it was sent: 2,000/s delivered, not 6,000 / 4 s = 1,500/s (0.75 of the rate)."""
    from bench.fanout import delivered_rate

    first_send = 10 * 10**9
    warm, timed, rate = 2000, 6000, 2000.0
    last_arrival = first_send + int((warm + timed - 1) / rate * 1e9) + 2_000_000
    got = delivered_rate(timed, last_arrival, first_send, warm, rate)
    assert 1995 <= got <= 2001, got
    assert delivered_rate(0, 0, first_send, warm, rate) == 0.0


def test_the_scaleout_prose_follows_the_hosts_cores():
    """On 2 cores one shard and its harness fill the host; on 16 the same figures leave
    room for several shards, and the sentence says so instead of the 2-core one."""
    from bench.scaleout import contention, shards_that_fit

    def point(shards, received, busy, server_pct, harness_pct, us):
        med = lambda v: {"median": v}  # noqa: E731
        return {"target": "server", "shards": shards, "received_per_s": med(received),
                "cpu_cores": med(busy), "targets_cpu_pct": med(server_pct),
                "harness_cpu_pct": med(harness_pct), "others_cpu_pct": med(0),
                "target_us_per_update": med(us), "efficiency": 1.0}

    points = [point(1, 200_000, 2.0, 100, 100, 5.0), point(4, 700_000, 8.0, 400, 400, 5.2)]
    two = contention(points, {"cores_usable": 2})
    sixteen = contention(points, {"cores_usable": 16})
    assert "contention starts at the first shard" in two
    assert "about 8 shards fit on its cores" in sixteen and "2-core" not in sixteen
    assert "add processes, not cores" not in sixteen  # 4 shards are within the 8 that fit
    assert shards_that_fit(16, 1.0, 1.0) == 8 and shards_that_fit(2, 1.0, 1.0) == 1


def test_a_saturated_harness_reads_harness_bound_not_no():
    """The 16-core run's scale-out record said "NO" (4.65M updates "lost") while its one
    subscriber process sat at 100% of a core: the harness set the figure."""
    from bench.harness import record as rec
    from bench.scaleout import harness_bound

    busy = {"subscriber_cpu_pct": {"median": 99.0}}
    idle = {"subscriber_cpu_pct": {"median": 40.0}}
    assert "subscriber process at 99%" in harness_bound(busy) and harness_bound(idle) == ""
    record = rec.Record("scaleout", "python -m bench.scaleout", {})
    record.target("updates lost", 4_650_000, 1, "updates", higher_is_better=False,
                  harness_bound=harness_bound(busy))
    record.target("aggregate", 0.5, 1.0, "ratio")
    words = [rec.met_word(t) for t in record.data["targets"]]
    assert words == ["harness-bound", "NO"]


def test_the_resharding_and_live_map_records_have_sections_and_targets(tmp_path):
    """A resharding record that ran clonemap and Valkey in one run shows them side by side
    (odd figures as dashes), and a live-map record (its tables the scenario's own) is linked,
    with its targets in the section and at a glance."""
    from bench import report

    systems = {"clonemap": {"total_s": 14.6, "moved_keys": 336160,
                            "before": {"p99_ms": 5.37},
                            "during_staying": {"p99_ms": 54.5, "max_ms": 188.2}},
               "valkey": {"total_s": 0.83, "moved_keys": "many", "before": None}}
    target = {"name": "p99 of writes to staying keys, during / before", "value": 10.2,
              "target": 2.0, "unit": "x", "higher_is_better": False, "met": False}
    memory = {"name": "memory: bytes per key clonemap get / redis cache", "value": 2.36,
              "target": 1.5, "unit": "x", "higher_is_better": False, "met": False}
    records = {"reshard": {"benchmark": "reshard", "summary": {}, "systems": systems,
                           "targets": [target]},
               "peers-memory": {"benchmark": "peers", "summary": {"memory": {}},
                                "targets": [memory]}}
    text = report.render(tmp_path, tmp_path, records, {})
    assert "| figure | clonemap | valkey |" in text
    assert "| the change (s) | 14.6 | 0.83 |" in text
    assert "| keys moved | 336,160 | - |" in text
    assert "| staying keys: p99 / longest (ms) | 54.5 / 188.2 | - / - |" in text
    assert "Tables: [latest/peers-memory.md](latest/peers-memory.md)." in text
    rows = [r for r in report.glance_rows(records) if r[0] in ("reshard", "peers-memory")]
    assert rows == [["peers-memory", memory["name"], "2.36 x", "< 1.5", "NOT met"],
                    ["reshard", target["name"], "10.2 x", "< 2", "NOT met"]]
    assert "## Resharding a running cluster: a shrink, 3 -> 2 shards (`reshard-shrink`)" in text
    assert "Not run yet: `python -m bench reshard --change shrink`" in text
