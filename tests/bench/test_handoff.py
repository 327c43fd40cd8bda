"""Where a watch callback runs (``Clone(deliver=...)``), and bench.handoff's smoke run.

``deliver="inline"``: on the client's loop thread, values decoded; ``"thread"`` (the
default): on the watch's own dispatcher thread. Both against a real server, both see the
items, the ``synced`` marker and live changes in order. Then ``python -m bench --smoke
--only handoff`` (so the profile is registered too) for a couple of seconds: the record's
shape, and the callback got every update in both modes.
"""
from __future__ import annotations

import queue
import threading

import pytest

from client.api import Clone
from conftest import bench_record, run_bench

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 10.0


@pytest.fixture
def server(procs, port_base):
    procs.python("-m", "shards", "--port", str(port_base), "--heartbeat-s", "0.2",
                 "--log-level", "info", ready="READY")
    return f"tcp://127.0.0.1:{port_base}"


@pytest.mark.parametrize("deliver, thread_prefix", [("inline", "clonemap-client"),
                                                    ("thread", "clonemap-watch")])
def test_a_callback_runs_where_deliver_says(server, deliver, thread_prefix):
    got: "queue.Queue[tuple[str, str, object, str]]" = queue.Queue()

    def on_change(change) -> None:
        got.put((change.kind, change.key, change.value, threading.current_thread().name))

    with Clone(server, subtree="/h/", codec="msgpack", deliver=deliver) as clone:
        clone.set("/h/a", {"n": 1}, wait=True)
        with clone.watch("/h/", callback=on_change) as w:
            assert w.deliver == deliver
            clone.set("/h/b", [1, 2], wait=True)
            clone.delete("/h/a", wait=True)
            seen = [got.get(timeout=DEADLINE_S) for _ in range(4)]
    assert [s[:3] for s in seen] == [("put", "/h/a", {"n": 1}), ("synced", "/h/", None),
                                     ("put", "/h/b", [1, 2]), ("delete", "/h/a", None)]
    assert all(s[3].startswith(thread_prefix) for s in seen), seen


def test_deliver_is_checked(server):
    with pytest.raises(ValueError, match="deliver"):
        Clone(server, deliver="process")
    with Clone(server) as clone:
        with pytest.raises(ValueError, match="needs a callback"):
            clone.watch("", deliver="inline")


def test_handoff_smoke_record(procs, tmp_path):
    out = tmp_path / "results"
    run_bench(procs, out, "bench", "--smoke", "--only", "handoff")
    record = bench_record(out, "handoff")
    assert record["command"].startswith(
        "python -m bench.handoff --modes inline,thread,workers --workers 1,2 ")
    assert record["invoked_as"].startswith("python -m bench --smoke")
    assert "| work | deliver |" in (out / "latest" / "handoff.md").read_text()
    runs = record["runs"]
    assert [(r["work"], r["mode"], r["workers"]) for r in runs] == [
        ("cpu", "inline", None), ("cpu", "thread", None), ("cpu", "workers", 1),
        ("cpu", "workers", 2)]
    assert sum(runs[3]["per_worker"]) == 150 and all(runs[3]["per_worker"])
    for r in runs:
        assert r["updates"] == 150
        assert r["received"] == 150 and r["complete"], r
        assert r["delivered_per_s"] > 0 and r["work_us"] > 0
        assert isinstance(r["max_lag_seen_s"], float) and r["watch_error"] is None
        assert r["subscriber_cpu_pct"] > 0
    summary = record["summary"]
    assert summary["all_complete"] is True
    assert set(summary["delivered_per_s"]) == {"cpu/inline", "cpu/thread", "cpu/workers/1",
                                               "cpu/workers/2"}
    assert summary["workers_over_one"]["cpu"]["1"] == 1.0
    assert summary["thread_over_inline"]["cpu"] > 0
    assert record["targets"][0]["met"] is True
