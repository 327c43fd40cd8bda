"""The MDP echo benchmark runs end to end and saves a sane record (never asserts timings)."""
from __future__ import annotations

import json


def test_mdp_echo_bench_smoke(procs, tmp_path):
    proc = procs.python("-m", "bench.mdp_echo", "--seconds", "0.15", "--warmup", "0.05",
                        "--rounds", "1", "--clients", "2", "--results-dir", str(tmp_path))
    assert proc.wait(120) == 0, "\n".join(proc.stderr[-20:])
    proc.stop()  # joins the output readers
    latest = json.loads((tmp_path / "latest" / "mdp_echo.json").read_text())
    saved = list(tmp_path.glob("mdp_echo-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text()) == latest
    page = saved[0].with_suffix(".md").read_text()
    assert latest["command"] in page and "| inflight_w4 | 2 | 4 |" in page
    assert latest["benchmark"] == "mdp_echo"
    assert latest["command"].startswith("python -m bench.mdp_echo")
    assert latest["host"]["cores_logical"] >= 1 and "libzmq" in latest["host"]
    assert set(latest["summary"]) == {"sync_w1", "inflight_w1", "sync_w4", "inflight_w4"}
    for key, row in latest["summary"].items():
        assert row["ceiling_rps"] > 0 and row["relay_rps"] > 0 and row["broker_rps"] > 0, key
        assert row["ratio"] == round(row["broker_rps"] / row["ceiling_rps"], 3)
        assert row["ratio_relay"] == round(row["broker_rps"] / row["relay_rps"], 3)
    assert len(latest["runs"]) == 12 and all(r["requests"] > 0 for r in latest["runs"])
    assert {r["side"] for r in latest["runs"]} == {"ceiling", "relay", "broker"}
    assert all(len(r["loadavg"]) == 3 for r in latest["runs"])
    assert {t["name"] for t in latest["targets"]} == {
        f"broker/ceiling {k}" for k in latest["summary"]}
    counters = latest["broker_stats"]["counters"]
    assert counters["finals"] >= sum(r["requests"] for r in latest["runs"]
                                     if r["side"] == "broker")
    assert "broker/ceiling" in "\n".join(proc.stdout)
