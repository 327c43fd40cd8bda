"""``bench peers --workloads reconnect,memory`` at smoke size (a file of its own: the
parallel workers balance by file)."""
from __future__ import annotations

import pytest

from conftest import bench_record, run_bench


@pytest.mark.timeout(300)
def test_reconnect_and_memory_workloads_measure_every_copy_of_every_present_system(
        procs, tmp_path):
    """Each present system's copy of the map (Clone; Redis's client-side cache; the NATS
    and etcd watch-built copies) is cut off through the cutter while 10% of its keys
    change, then heals: each row says when it was current again, the bytes that took
    against its first full read, and that no changed key was left behind. The memory
    rows: every copy's RSS per key at two sizes, and the plain-dict floor."""
    from bench.peers import MEMORY_VARIANTS, RECONNECT_VARIANTS

    run_bench(procs, tmp_path, "bench", "peers", "--keys", "2000", "--rounds", "1",
              "--workloads", "reconnect,memory", "--cut-s", "0.5", "--changed", "0.1",
              "--memory-keys", "2000,6000")
    data = bench_record(tmp_path, "peers")
    present = [s for s in ("clonemap", "redis", "nats", "etcd") if s not in data["missing"]]
    assert "clonemap" in present
    again = [r for r in data["runs"] if r["workload"] == "reconnect"]
    assert sorted((r["system"], r["variant"]) for r in again) == sorted(
        (s, v) for s in present for v in RECONNECT_VARIANTS[s])
    for r in again:
        assert r["current_s"] is not None and r["current_s"] >= 0, r
        assert r["changed_keys"] == 200 and r["changed_behind"] == 0, r
        assert r["full_bytes"] > 2000 * 100, r  # the first copy read every value
        assert r["resume_bytes"] > 0, r
    mine = next(r for r in again if r["system"] == "clonemap")
    assert mine["resume_bytes"] < mine["full_bytes"], mine  # resumed, not read again
    memory = [r for r in data["runs"] if r["workload"] == "memory"]
    assert sorted((r["system"], r["variant"], r["keys"]) for r in memory) == sorted(
        (s, v, k) for s in present for v in MEMORY_VARIANTS[s] for k in (2000, 6000))
    for r in memory:
        assert r["copy_keys"] >= r["keys"], r
    per_key = data["summary"]["memory"]["6000"]
    assert per_key["clonemap dict"] > 100, per_key  # at least the values themselves
    table = (tmp_path / "latest" / "peers.md").read_text()
    assert "peers reconnect" in table and "peers memory" in table


def test_the_memory_floor_counts_the_key_strings_a_copy_makes(tmp_path):
    """The memory workload's RSS baseline is taken before any key string exists: a copy
    from the wire makes its own keys, so they count. The plain-dict floor, in a process
    of its own, adds at least its values' and keys' objects per key (with the key list
    made before the baseline, as it was, it added about the values alone). The same
    holds for Redis's cache: its keys were made twice, and the first ones, freed after
    the baseline, left room that hid about 77 B a key of the cache."""
    import json
    import subprocess
    import sys

    from bench.harness.peer_readers import key_names, value

    out = tmp_path / "floor.json"
    options = {"memory": True, "keys": 50_000, "value_bytes": 100, "out": str(out)}
    subprocess.run([sys.executable, "-m", "bench.harness.peer_readers", "reader", "clonemap",
                    "dict", json.dumps(options)], check=True, timeout=60,
                   capture_output=True)
    got = json.loads(out.read_text())
    objects = sys.getsizeof(value(100, 0)) + sys.getsizeof(key_names("clonemap", 1)[0])
    assert got["copy_keys"] == 50_001 and got["bytes_per_key"] > objects, (got, objects)


@pytest.mark.parametrize("own", [True, False])
def test_client_sessions_place_each_client_process_as_asked(monkeypatch, own):
    """``bench peers --client-sessions``: ``own`` starts each client process in a session
    of its own (a CPU group of its own under the kernel's autogroup); ``shared`` keeps it
    in this session, in a process group of its own (a terminal's Ctrl-C does not reach
    it, and it shares this session's CPU group)."""
    import json
    import os
    import sys

    from bench.peers import Client

    monkeypatch.setattr(Client, "own_session", own)
    tell = ("import json, os, sys; o = json.loads(sys.argv[1]); "
            "json.dump({'sid': os.getsid(0), 'pgid': os.getpgid(0), 'pid': os.getpid()}, "
            "open(o['out'], 'w')); print('DONE', flush=True)")
    client = Client("none", "none", {}, command=[sys.executable, "-c", tell])
    try:
        got = client.result()
    finally:
        client.stop()
    assert got["pgid"] == got["pid"], got
    if own:
        assert got["sid"] == got["pid"], got
    else:
        assert got["sid"] == os.getsid(0) != got["pid"], got
