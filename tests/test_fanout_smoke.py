"""bench.fanout for a few seconds, through ``python -m bench --smoke --only fanout`` (so
the profile is registered too): the record's shape, and every subscriber got every update
(one writer, 1 and 4 subscribing clients, a 1-shard and a 2-shard cluster of real
``python -m shards`` servers, each dropping keys its shard does not own)."""
from __future__ import annotations

from conftest import bench_record, run_bench


def test_fanout_smoke_record(procs, tmp_path):
    out = tmp_path / "results"
    # bench.fanout ends every process it starts by PID (bench.runner.Target), even on
    # SIGTERM, which the procs fixture sends it at teardown
    stdout = run_bench(procs, out, "bench", "--smoke", "--only", "fanout")
    record = bench_record(out, "fanout")
    assert record["command"].startswith("python -m bench.fanout --shards 1,2 ")
    assert record["invoked_as"].startswith("python -m bench --smoke")
    assert "| shards | subscribers |" in (out / "latest" / "fanout.md").read_text()
    runs = record["runs"]
    assert [(r["shards"], r["subscribers"]) for r in runs] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for r in runs:
        assert r["updates"] == 100
        assert r["received"] == [100] * r["subscribers"], r
        assert r["complete"] and r["missing_total"] == 0 and r["duplicates_total"] == 0
        assert r["strays_total"] == 0
        lat = r["latency_ms"]
        assert lat["samples"] == 100 * r["subscribers"]
        assert 0 <= lat["p50"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
        assert len(r["delivered_per_s_each"]) == r["subscribers"]
        assert r["delivered_per_s_min"] > 0
        assert set(r["cpu_pct"]) == {"servers", "subscribers", "writer", "host", "others"}
        assert r["cpu_pct"]["subscribers"] > 0
    assert record["summary"]["all_complete"] is True
    assert record["targets"][0]["met"] is True
    assert "every update" in "\n".join(stdout)
