"""``python -m bench all --smoke``: every scenario once, then the report (in a file of its
own: the suite's longest test, and the parallel workers balance by file)."""
from __future__ import annotations

import pytest

from conftest import bench_record, run_bench
from test_bench_scale import check_latency_record, check_scaleout_record, check_single_record
from test_bench_scenarios import (RECORDS, check_curve, check_durability, check_failover,
                                  check_fanout, check_handoff, check_hot_path, check_points,
                                  check_relays, check_single, check_slow_subscriber,
                                  check_snapshot)


@pytest.mark.timeout(480)
def test_bench_all_smoke_runs_every_scenario_and_the_report(procs, tmp_path):
    """Every scenario's smoke profile, once (~105 s on a quiet host; the deadline allows a
    shared, noisy one)."""
    stdout = run_bench(procs, tmp_path, "bench", "all", "--smoke", timeout_s=420)
    records = {name: bench_record(tmp_path, name) for name in RECORDS}
    for data in records.values():
        assert data["invoked_as"].startswith("python -m bench all --smoke")
    check_snapshot(records["snapshot"], keys=2000, timed=1, warm=0)
    check_fanout(records["fanout"], [(1, 1), (1, 4), (2, 1), (2, 4)], rounds=1, updates=100)
    check_failover(records["failover"], kills=2)
    check_single(records["chp_throughput"])
    check_single_record(records["chp_throughput"])
    check_points(records["scaleout"], {"shards", "target", "received_per_s", "efficiency"})
    check_scaleout_record(records["scaleout"])
    for run in records["scaleout"]["runs"]:   # the smoke profile's --harness auto
        assert run["plan"]["writers"] >= 1 and run["plan"]["subscribers"] >= 1, run["plan"]
        assert set(run["harness_pct_each"]) == {"writers", "subscribers"}
        assert run["loss_targets"] + run["loss_harness"] == run["loss_window"]
    check_points(records["latency"], {"offered_per_s", "target", "latency_ms"})
    check_latency_record(records["latency"])
    assert records["load"]["runs"] and records["load"]["summary"]
    check_durability(records["durability"], keys=5000)
    check_curve(records["curve"])
    check_slow_subscriber(records["slow_subscriber"])
    check_relays(records["relays"])
    check_hot_path(records["hot_path"])
    check_handoff(records["handoff"], tmp_path)
    assert (tmp_path / "REPORT.md").exists() and list((tmp_path / "plots").glob("*.png"))
    table = "\n".join(stdout)
    assert "python -m bench all (smoke)" in table and "FAILED" not in table
