"""The benchmark scenarios through ``python -m bench``: snapshot, fan-out and failover for a
second or two each, and ``python -m bench all --smoke``, which runs every scenario and the
report. They assert what each record says happened (every key arrived, every subscriber got
every update, no write was lost, the same-run ceilings are there and positive) - never
timings. Each scenario ends every process it starts by PID, even on the SIGTERM the
``procs`` fixture sends at teardown.
"""
from __future__ import annotations

import os

import pytest

from test_bench_scale import check_latency_record, check_scaleout_record, check_single_record
from conftest import bench_record, run_bench

RECORDS = ["chp_throughput", "scaleout", "latency", "load", "snapshot", "fanout", "failover",
           "handoff", "durability", "curve", "slow_subscriber", "relays", "hot_path"]
"""What ``python -m bench all`` saves (the report reads these)."""


def check_ceilings(ceilings: dict, rate_per_s: float = 0.0) -> None:
    for kind in ("pubsub", "forwarder"):
        fig = ceilings[kind]
        assert fig["received_per_s"] > 0 and fig["sent_per_s"] > 0, (kind, fig)
        lat = fig["latency_ms"]
        assert 0 <= lat["p50"] <= lat["p99"] <= lat["max"], (kind, lat)
    assert ceilings["config"]["rate_per_s"] == rate_per_s


def check_snapshot(data: dict, keys: int, timed: int, warm: int) -> None:
    (run,) = data["runs"]
    assert run["keys"] == keys and run["load"]["last_seq"] == keys and run["all_whole"]
    snaps = run["snapshots"]
    assert [s["warmup"] for s in snaps] == [True] * warm + [False] * timed
    for snap in snaps:  # every key arrived, once, with its value; KTHXBAI says N
        assert snap["whole"] and snap["kvsync"] == keys and snap["kthxbai_seq"] == keys
        assert snap["missing"] == snap["duplicates"] == snap["bad_values"] == 0
        assert snap["seconds"] > 0
    assert run["bytes_per_key"] > 0
    summary = data["summary"]
    check_ceilings(summary["ceilings"])
    (point,) = summary["points"]
    assert point["keys"] == keys and point["whole"]
    assert point["join_s"]["n"] == timed and point["join_s"]["median"] > 0
    assert point["bytes_per_key"]["median"] == run["bytes_per_key"]
    pubsub_s = keys / summary["ceilings"]["pubsub"]["received_per_s"]
    assert abs(point["ceiling_pubsub_s"] - pubsub_s) <= 1e-4 + 1e-3 * pubsub_s
    assert point["join_to_pubsub"] > 0 and point["join_to_forwarder"] > 0


def check_fanout(data: dict, combos: list[tuple[int, int]], rounds: int, updates: int) -> None:
    runs = data["runs"]
    assert [(r["shards"], r["subscribers"]) for r in runs] == [
        c for c in combos for _ in range(rounds)]
    for r in runs:  # every subscriber got every update, once
        assert r["updates"] == updates
        assert r["received"] == [updates] * r["subscribers"], r
        assert r["complete"] and r["missing_total"] == r["duplicates_total"] == 0
        assert r["strays_total"] == 0
        lat = r["latency_ms"]
        assert lat["samples"] == updates * r["subscribers"]
        assert 0 <= lat["p50"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
        assert r["delivered_per_s_min"] > 0
        # CPU is read in 10 ms clock ticks: 100 updates can cost a subscriber none of them
        assert set(r["cpu_pct"]) >= {"servers", "subscribers", "writer", "host", "others"}
        assert all(v >= 0 for v in r["cpu_pct"].values()), r["cpu_pct"]
    summary = data["summary"]
    assert summary["all_complete"] is True and data["targets"][0]["met"] is True
    check_ceilings(summary["ceilings"], data["config"]["rate"])
    assert [(p["shards"], p["subscribers"]) for p in summary["points"]] == combos
    for p in summary["points"]:
        assert p["rounds"] == rounds and p["complete"]
        assert p["delivered_per_s_min"]["n"] == rounds
        assert p["delivered_to_pubsub"] > 0 and p["p99_to_pubsub"] > 0
        assert p["latency_ms"]["p99"]["median"] >= p["latency_ms"]["p50"]["median"] >= 0


def check_failover(data: dict, kills: int) -> None:
    runs = data["runs"]
    assert [r["kill"] for r in runs] == list(range(1, kills + 1))
    # the active is killed each time: the primary first, then the backup that took over
    assert [r["killed"] for r in runs] == ["primary", "backup"][:kills]
    for r in runs:  # the new active published, the client switched and resumed
        assert r["first_kvpub_s"] > 0 and r["client_resume_s"] > 0
        assert r["client_resumed_s"] is not None
    s = data["summary"]
    assert s["written"] > 0 and s["lost"] == 0 and s["reader_converged"] is True
    assert s["missed_measurements"] == 0
    check_ceilings(s["ceilings"])
    gap = s["gap"]
    assert gap["client_silence_timeout_s"] == pytest.approx(3 * data["config"]["heartbeat_s"])
    assert gap["client_resume_to_silence"] > 0 and gap["pubsub_updates_in_median_gap"] > 0
    assert {t["name"]: t["met"] for t in data["targets"]}["updates lost"] is True


def check_single(data: dict) -> None:
    runs = data["runs"]
    assert [r["target"] for r in runs] == ["pubsub", "ceiling", "ceiling_blind", "server"]
    for run in runs:
        assert run["received_per_s"] > 0 and run["sequenced_per_s"] > 0, run["target"]
        assert run["sent_per_s"] > 0 and run["sent_total"] > 0
        assert run["received_total"] > 0 and run["sequenced_total"] >= run["received_total"]
        assert isinstance(run["loss_total"], int) and run["latency_ms"]["p50"] > 0
        assert run["malformed"] == 0
    for run in runs[1:]:  # the forwarding loop and the server: their own process
        assert run["subscribers"][0]["malformed"] == 0 and run["cpu_pct"]["target"] > 0
    s = data["summary"]
    assert s["ratio_server_to_ceiling"] > 0 and s["ratio_server_to_pubsub"] > 0
    assert s["ratio_server_to_plain_loop"] > 0  # both ceilings, every record
    assert {"server updates/s (received, median)", "server / ceiling (medians)"} <= {
        t["name"] for t in data["targets"]}


def check_points(data: dict, keys: set[str]) -> None:
    """The summary points the report plots, each with a positive
    received rate."""
    points = data["summary"]["points"]
    assert points
    for p in points:
        assert keys <= set(p), (data["benchmark"], p)
        assert p["received_per_s"]["median"] > 0, (data["benchmark"], p)


def test_snapshot_scenario_gets_the_whole_map_against_the_ceilings(procs, tmp_path):
    run_bench(procs, tmp_path, "bench", "snapshot", "--keys", "3000", "--repeats", "2",
              "--warmup-snapshots", "1", "--ceiling-s", "0.5")
    data = bench_record(tmp_path, "snapshot")
    assert data["invoked_as"].startswith("python -m bench snapshot --keys 3000")
    check_snapshot(data, keys=3000, timed=2, warm=1)
    assert "snapshot / PUB->SUB" in (tmp_path / "latest" / "snapshot.md").read_text()


def test_fanout_scenario_delivers_every_update_to_every_subscriber(procs, tmp_path):
    run_bench(procs, tmp_path, "bench", "fanout", "--shards", "2", "--subscribers", "1,3",
              "--rate", "200", "--seconds", "0.5", "--warmup", "0.2", "--ceiling-s", "0.5")
    data = bench_record(tmp_path, "fanout")
    assert data["runs"][0]["warmup_updates"] == 40
    check_fanout(data, [(2, 1), (2, 3)], rounds=1, updates=100)

    # the same record, as a starved host made it once: the forwarding loop's subscriber
    # timed no update in its window, so its ceiling has no latency figures. The report
    # says "-" where it failed on the missing figure
    from bench import fanout
    from bench.harness import record as rec

    starved = rec.Record("fanout", data["command"], data["config"])
    starved.data.update(data)
    starved.data["summary"]["ceilings"]["forwarder"]["latency_ms"] = {"samples": 0}
    fanout.report(starved)
    caption = next(c for title, _, _, c in starved.tables if "ceilings" in title)
    assert "bare forwarding loop" in caption and "p50 - ms, p99 - ms" in caption, caption


def check_durability(data: dict, keys: int) -> None:
    runs = data["runs"]
    policies = [r["policy"] for r in runs if r["part"] == "throughput"]
    assert policies == ["memory", "everysec", "always", "no"]
    for r in runs:
        if r["part"] in ("throughput", "compaction"):  # nothing lost on the way
            assert r["loss_window"] == 0 and r["received_per_s"] > 0, r
    assert [r["mode"] for r in runs if r["part"] == "compaction"] == ["off", "on"]
    recovery = {r["form"]: r for r in runs if r["part"] == "recovery"}
    assert set(recovery) == {"log", "snapshot"}
    assert all(r["keys"] == keys and r["bytes_per_key"] > 100 for r in recovery.values())
    stores = {r["store"] for r in runs if r["part"] == "storage"}
    assert stores == {"log", "sqlite-wal"}
    names = {t["name"] for t in data["targets"]}
    assert any("everysec" in n for n in names) and any("compaction" in n for n in names)


def check_curve(data: dict) -> None:
    runs = data["runs"]
    assert [r["mode"] for r in runs] == ["plain", "curve", "roles"]
    for r in runs:  # each carried the load and served a whole snapshot
        assert r["received_per_s"] > 0 and r["loss_window"] == 0, r
        assert r["snapshot_keys"] > 0 and r["snapshot_s"] > 0
    assert data["summary"]["updates_ratio_curve_to_plain_per_round"]
    # with roles, every key the load writes is allowed and readable: nothing lost
    assert data["summary"]["cpu_ratio_roles_to_curve_per_round"]


def check_slow_subscriber(data: dict) -> None:
    runs = data["runs"]
    assert [r["mode"] for r in runs] == ["baseline", "snail", "snail_off"]
    for r in runs:  # the healthy reader got the whole flood every time
        assert r["reader_received"] >= 3000 and r["reader_seconds"] > 0, r
    assert len(data["summary"]["snail_pinned_mib_per_round"]) == 1
    assert any("never-reading" in t["name"] for t in data["targets"])


def check_relays(data: dict) -> None:
    runs = data["runs"]
    assert [r["mode"] for r in runs] == ["direct", "relays", "direct_no_resume",
                                         "direct_resume", "relays"]
    for r in runs:
        if r["part"] == "fanout":   # 20 sockets over the smoke profile's 2 processes
            assert r["every_update"] and r["p50_ms"] is not None, r
            assert r["processes"] == 2 and len(r["cpu_pct"]["subscribers"]) == 2, r
            assert len(r["cpu_pct"]["server"]) == 1 and "harness_bound" in r
            # each reader's CPU comes with its line (it exits right after): never < 0
            assert all(v >= 0 for pcts in r["cpu_pct"].values() for v in pcts), r
        else:
            assert r["all_clients_have_it"], r
    by = {r["mode"]: r for r in runs if r["part"] == "failover"}
    assert by["direct_no_resume"]["shard_kvsync"] >= 10 * 2000  # every client, whole map
    assert by["direct_resume"]["shard_kvsync"] == 0 and by["direct_resume"]["client_resumes"]
    assert by["relays"]["client_snapshots"] == 0


def check_handoff(record: dict, results_dir) -> None:
    """Every mode of the smoke profile, worker processes included: each callback got
    every update, the record's shape."""
    assert record["command"].startswith(
        "python -m bench.handoff --modes inline,thread,workers --workers 1,2 ")
    assert "| work | deliver |" in (results_dir / "latest" / "handoff.md").read_text()
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


LOSSY_FLAT_OUT = {("flat", "plain"), ("flat", "forwarder")}


def check_hot_path(data: dict) -> None:
    runs = data["runs"]
    assert [(r["phase"], r["kind"]) for r in runs] == [
        ("flat", "plain"), ("flat", "forwarder"), ("flat", "server"), ("rate", "plain"),
        ("rate", "server"), ("half", "plain"), ("half", "server"), ("half_pinned", "plain"),
        ("half_pinned", "server")]
    for r in runs:  # every target carried the load, nothing lost (flat out, a bare loop's
        assert r["received_per_s"] > 0, r  # PUB may drop when the subscriber falls behind)
        assert r["loss_window"] == 0 or (r["phase"], r["kind"]) in LOSSY_FLAT_OUT, r
    s = data["summary"]
    assert len(s["ratio_server_to_plain_per_round"]) == 1
    assert len(s["cpu_ratio_server_to_plain_per_round"]) == 1
    assert any("plain loop" in t["name"] for t in data["targets"])


def test_bench_refuses_an_unknown_scenario_and_lists_them_all(procs):
    bad = procs.python("-m", "bench", "nosuch")
    assert bad.wait(30) == 2
    assert any("unknown scenario 'nosuch'" in line for line in bad.stderr)
    helped = procs.python("-m", "bench", "--help")
    assert helped.wait(30) == 0
    text = "\n".join(helped.stdout)
    for name in ("single", "scaleout", "latency", "load", "snapshot", "fanout", "failover",
                 "report", "all"):
        assert f"\n  {name} " in text, name
    assert text.count("smoke ~") >= 10


def test_a_scenario_help_states_its_durations(procs):
    for name in ("snapshot", "fanout", "failover"):
        helped = procs.python("-m", "bench", name, "--help")
        assert helped.wait(30) == 0
        text = " ".join(" ".join(helped.stdout).split())
        assert "smoke" in text and "full" in text and "min" in text, (name, text)


def test_the_records_checked_here_are_every_scenario_all_runs():
    from bench.__main__ import ORDER, SCENARIOS

    assert sorted(SCENARIOS[n].record for n in ORDER) == sorted(RECORDS)


def test_supervised_failover_scenario_under_a_real_supervisor(procs, tmp_path):
    """``python -m bench failover_supervised --kills 1``: a real ``supervisor start`` of the
    4-shard config, one ``supervisor kill`` of s0's active, the server restarted PASSIVE;
    the writer never failed, chp answered, and no client waited on the passive."""
    run_bench(procs, tmp_path, "bench", "failover_supervised", "--kills", "1")
    data = bench_record(tmp_path, "failover_supervised")
    (run,) = data["runs"]
    assert run["killed"] in ("s0/primary", "s0/backup")
    assert run["chp_exit"] == 0 and run["passive_refused"] == 0
    assert run["write_stall_s"] is not None and run["new_clone_s"] > 0
    assert data["summary"]["writer_errors"] == []
    names = {t["name"] for t in data["targets"]}
    assert "wait=True stall across kill and restart (max)" in names


def test_hosts_scenario_measures_one_host_and_across_hosts_and_a_takeover(procs, tmp_path):
    """``python -m bench hosts`` at smoke size: network namespaces as hosts, a real etcd;
    every mode acknowledged writes, the takeover after a host's processes were killed is
    measured, and the record says what the cost is relative to one host."""
    from bench.harness.netns import available

    if available():
        pytest.skip(f"bench hosts: {available()}")
    run_bench(procs, tmp_path, "bench", "hosts", "--seconds", "0.3", "--rounds", "1",
              "--in-flight", "1", "--takeovers", "1")
    data = bench_record(tmp_path, "hosts")
    assert {r["mode"] for r in data["runs"]} == {"one host", "across, sync",
                                                 "across, async"}
    assert all(r["acked"] > 0 and r["p99_ms"] > 0 for r in data["runs"])
    (take,) = data["takeovers"]
    assert take["killed"] >= 1 and take["takeover_s"] > 0 and take["acks_after"] > 0
    assert data["summary"]["across, sync x1"]["throughput_vs_one_host"]["n"] == 1


def test_peers_scenario_measures_every_present_system_and_names_the_missing(procs, tmp_path):
    """``python -m bench peers`` at smoke size against every system: each one this host can
    run has every workload in the record (each write acknowledged, every fan-out update at
    every watcher, the whole map joined); each one it cannot is in ``missing`` with its
    install command and in the table as "missing", never dropped. The floor (the bare
    forwarder, driven by clonemap's client) runs every workload but the join, and the
    libzmq servers' I/O-thread CPU is split out."""
    run_bench(procs, tmp_path, "bench", "peers", "--keys", "500", "--rounds", "1",
              "--seconds", "0.5", "--warmup", "0.2", "--rate", "300", "--fanout-rate", "100",
              "--watchers", "2", "--writer-procs", "2",
              "--workloads", "rate,one,many,fanout,join")
    data = bench_record(tmp_path, "peers")
    missing = data["missing"]
    present = [s for s in ("clonemap", "redis", "nats", "etcd", "forwarder")
               if s not in missing]
    assert "clonemap" in present and "forwarder" in present
    for system, why in missing.items():
        assert "install" in why or "pip" in why, (system, why)
    runs = data["runs"]
    assert sorted({(r["system"], r["workload"]) for r in runs}) == sorted(
        (s, w) for s in present for w in ("rate", "one", "many", "fanout", "join")
        if (s, w) != ("forwarder", "join"))
    for r in runs:
        assert r.get("errors", 0) == 0, r
        if r["workload"] in ("rate", "fanout"):  # libzmq's I/O threads: ours only
            zmq_server = r["system"] in ("clonemap", "forwarder")
            assert (r["server_io_cpu_us"] is not None) == zmq_server, r
            # both are 10 ms clock ticks, read a moment apart (the process's, then its
            # threads'): at smoke size one tick is a lot per write
            tick_us = 2 * 10_000 / max(1, r.get("acks") or r.get("delivered") or 1)
            assert not zmq_server or (
                0 <= r["server_io_cpu_us"] <= r["server_cpu_us"] + tick_us), r
        if r["workload"] == "rate":
            assert r["acks"] == r["offered"] > 0 and r["p50_ms"] <= r["p99_ms"], r
        elif r["workload"] in ("one", "many"):
            assert r["acks_per_s"] > 0, r
        elif r["workload"] == "fanout":
            assert r["every_update_delivered"] and r["writes"] > 0, r
            assert r["delivered"] == r["expected"] == r["writes"] * 2, r
        else:
            assert r["keys"] == 500 and r["join_ms"] > 0, r
    table = (tmp_path / "latest" / "peers.md").read_text()
    assert "clonemap / Redis" in table
    for system in missing:
        assert "| missing |" in table or "| missing" in table, system
    assert set(data["acks"]) == {"clonemap", "redis", "nats", "etcd", "forwarder"}
    assert "forwarder / Redis" in table or "redis" in missing


def test_peers_read_workload_measures_every_read_path_of_every_present_system(procs,
                                                                            tmp_path):
    """``bench peers --workloads read`` at smoke size: each present system's read paths
    (clonemap's Clone.get, AsyncClone.get and the plain-dict floor; Redis GET and its
    client-side cache; NATS and etcd, a get and a watch-built copy) have a row with reads,
    staleness samples from every reader and counted probe reads; the forwarder has none
    (it serves no map)."""
    from bench.harness.peer_readers import VARIANTS

    run_bench(procs, tmp_path, "bench", "peers", "--keys", "300", "--rounds", "1",
              "--seconds", "0.4", "--warmup", "0.2", "--readers", "2", "--read-rate", "300",
              "--workloads", "read")
    data = bench_record(tmp_path, "peers")
    present = [s for s in ("clonemap", "redis", "nats", "etcd") if s not in data["missing"]]
    assert "clonemap" in present
    runs = data["runs"]
    assert sorted((r["system"], r["variant"]) for r in runs) == sorted(
        (s, v) for s in present for v in VARIANTS[s])
    for r in runs:
        assert r["workload"] == "read" and r["writes"] > 0, r
        assert len(r["reads_per_s_each"]) == 2 and min(r["reads_per_s_each"]) > 0, r
        assert 0 < r["probe_reads"] and 0 <= r["stale_reads"] <= r["probe_reads"], r
        assert r["staleness_samples"] > 0, r
        assert r["staleness_p50_ms"] <= r["staleness_p99_ms"] <= r["staleness_max_ms"], r
    paths = data["summary"]["read"]["paths"]
    assert set(paths) == {f"{r['system']} {r['variant']}" for r in runs}
    assert "clonemap get / clonemap dict" in data["summary"]["read"]["ratios"]


def test_read_burst_times_reads_idle_and_through_a_whole_burst(procs, tmp_path):
    """``bench read_burst`` at smoke size: each mode (Clone.get, the plain-dict floor)
    has an idle and a burst window per round; the burst's every update reached the
    client before its window closed, and the latencies are ordered."""
    run_bench(procs, tmp_path, "bench", "read_burst", "--keys", "1000", "--burst", "3000",
              "--idle-s", "0.2", "--rounds", "1")
    data = bench_record(tmp_path, "read_burst")
    runs = data["runs"]
    assert [(r["mode"], r["window"]) for r in runs] == [
        ("get", "idle"), ("get", "burst"), ("dict", "idle"), ("dict", "burst")]
    for r in runs:
        assert r["reads"] > 0 and r["reads_per_s"] > 0, r
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"] <= r["max_us"], r
        if r["window"] == "burst":
            assert r["sent"] == 3000 and r["applied"] >= r["sent"], r
    assert len(data["summary"]["burst_p99_get_to_dict_per_round"]) == 1
    assert "during a burst of 3,000 updates" in (
        tmp_path / "latest" / "read_burst.md").read_text()


def test_join_ab_joins_every_server_and_both_takers_in_turn(procs, tmp_path):
    """``python -m bench.join_ab`` at smoke size, two servers from this checkout: every
    join of every server and of each client row taker holds the whole map (a join that
    does not is an error), the takers are the Python path and, when the extension is
    built, the compiled one; the table names each."""
    from clonemap.shards.common import zio

    run_bench(procs, tmp_path, "bench.join_ab", "--server", "a=.", "--server", "b=.",
              "--keys", "3000", "--joins", "2")
    data = bench_record(tmp_path, "join_ab")
    takers = ["python", "compiled"] if zio.COMPILED else ["python"]
    seen = [(r["round"], r["kind"], r["name"]) for r in data["runs"]]
    assert seen == [(0, "server", "a"), (0, "server", "b"), (1, "server", "a"),
                    (1, "server", "b"),
                    *[(rnd, "taker", t) for rnd in (0, 1) for t in takers]]
    for r in data["runs"]:
        assert r["join_ms"] > 0 and r["client_cpu_s"] >= 0 and r["server_cpu_s"] >= 0, r
    assert set(data["summary"]) == {"server a", "server b", *(f"taker {t}" for t in takers)}
    table = (tmp_path / "latest" / "join_ab.md").read_text()
    assert "taker python" in table and "server b" in table


def test_peers_stops_the_other_servers_while_one_is_measured_and_continues_them(procs):
    """``bench.peers.paused``: every other system's server is stopped (SIGSTOP) for the
    measured one's turn and continued after, also when the turn fails; a server that is
    gone is skipped."""
    import psutil

    from bench.harness.peer_servers import PeerServer
    from bench.peers import paused

    ready = "import sys, time; print('READY', flush=True); time.sleep(60)"
    others = [procs.python("-c", ready, ready="READY") for _ in range(2)]
    gone = procs.python("-c", "print('READY', flush=True)", ready="READY")
    gone.popen.wait(10)
    servers = [PeerServer(f"s{i}", "", p.pid, lambda: None) for i, p in enumerate(others)]
    servers.append(PeerServer("gone", "", gone.pid, lambda: None))

    def states() -> list[str]:
        return [psutil.Process(p.pid).status() for p in others]

    with paused(servers):
        assert states() == [psutil.STATUS_STOPPED] * 2
    assert psutil.STATUS_STOPPED not in states()
    with pytest.raises(RuntimeError):
        with paused(servers):
            raise RuntimeError("the measured turn failed")
    assert psutil.STATUS_STOPPED not in states()


def test_reshard_grows_the_cluster_under_writes_and_loses_none(procs, tmp_path):
    """``bench reshard`` at smoke size: ``supervisor reshard`` takes a written 2-shard
    cluster to 3 shards; it moves exactly the keys the routing gives the new shard, no
    write fails, and the follower's client took at most the moved keys' bytes: it
    adopted the new shard's keys from the parts it held (only the updates after the
    copy came), or, when its parts were still behind the copy after ``ADOPT_WAIT_S``
    (a loaded host), the new shard's snapshot; no resync either way."""
    from bench.harness.reshard_writer import key_of
    from clonemap.shards.common.routing import ShardMap

    run_bench(procs, tmp_path, "bench", "reshard", "--keys", "3000", "--segments", "300",
              "--rate", "300", "--before-s", "0.5", "--after-s", "0.5")
    summary = bench_record(tmp_path, "reshard")["summary"]
    two, three = ShardMap(2), ShardMap(3)
    moving = sum(1 for i in range(3000) if three.owner(key_of(i, 300)) == 2
                 and two.owner(key_of(i, 300)) != 2)
    assert summary["moved_keys"] == moving > 0
    assert summary["failed_writes"] == 0 and summary["errors"] == {}
    assert summary["before"]["n"] > 0 and summary["during_moving"]["n"] > 0
    assert summary["follower_adopted"] in (["s2"], []), summary
    assert summary["follower_resyncs"] == {"s0": 0, "s1": 0}, summary
    if summary["follower_adopted"]:
        assert 0 <= summary["follower_bytes_ratio"] < 0.9, summary
    else:
        assert 0.9 <= summary["follower_bytes_ratio"] <= 1.2, summary
    assert "one more shard while written" in (tmp_path / "latest" / "reshard.md").read_text()


def test_reshard_shrinks_the_cluster_under_writes_and_loses_none(procs, tmp_path):
    """``bench reshard --change shrink`` at smoke size: the written 3-shard cluster goes
    to 2; exactly the removed shard's keys move, to the two shards that serve already
    (each stages its copy under a prefix no client receives), no write
    fails, and the follower's client received none of the moved keys again: it skipped
    the staged sequences (at least one per key moved) and took the keys from the part
    that held them (no resync)."""
    from bench.harness.reshard_writer import key_of
    from clonemap.shards.common.routing import ShardMap

    run_bench(procs, tmp_path, "bench", "reshard", "--change", "shrink", "--keys", "3000",
              "--segments", "300", "--rate", "300", "--before-s", "0.5", "--after-s", "0.5")
    summary = bench_record(tmp_path, "reshard-shrink")["summary"]
    moving = sum(1 for i in range(3000) if ShardMap(3).owner(key_of(i, 300)) == 2)
    assert summary["moved_keys"] == moving > 0
    assert summary["failed_writes"] == 0 and summary["errors"] == {}
    assert summary["before"]["n"] > 0 and summary["during_moving"]["n"] > 0
    assert summary["follower_resyncs"] == {"s0": 0, "s1": 0}, summary  # (s2 retired)
    assert summary["follower_staged_skipped"] >= moving, summary
    assert 0 <= summary["follower_bytes_ratio"] < 0.2, summary
    assert "one shard fewer while written" in (
        tmp_path / "latest" / "reshard-shrink.md").read_text()


def test_reshard_floor_runs_background_work_and_moves_nothing(procs, tmp_path):
    """``bench reshard --change floor-copy`` at smoke size: no change, two processes
    that went to the background as an added shard's servers do (``SCHED_IDLE``, each its
    own session at autogroup nice 19, as root runs the suite) work while the writes run;
    every write is a staying key's, none fails, and the report names the floor."""
    run_bench(procs, tmp_path, "bench", "reshard", "--change", "floor-copy", "--floor-s",
              "1", "--keys", "3000", "--segments", "300", "--rate", "300", "--before-s",
              "0.5", "--after-s", "0.5")
    summary = bench_record(tmp_path, "reshard-floor-copy")["summary"]
    assert summary["moved_keys"] == 0 and summary["during_moving"] == {"n": 0}, summary
    assert summary["during_staying"]["n"] > 0 and summary["failed_writes"] == 0, summary
    load = summary["idle_load"]
    assert load["work"] == "copy" and load["seconds"] >= 1 and len(load["procs"]) == 2
    for proc in load["procs"]:
        assert proc["idle"] and proc["done"] > 0, load
        assert proc["autogroup_19"] is os.path.exists("/proc/self/autogroup"), load
    assert "the floor, no change, copy at background priority" in (
        tmp_path / "latest" / "reshard-floor-copy.md").read_text()


def test_reshard_without_the_anchor_says_so_before_it_runs(monkeypatch, capsys):
    """``bench reshard --systems clonemap,valkey`` on a host without the anchor's wheel
    (or redis-py) stops at its arguments with the install command, instead of failing
    after clonemap's minutes-long run."""
    from bench import reshard
    from bench.harness import valkey_cluster

    monkeypatch.setattr(valkey_cluster, "server_path", lambda: None)
    with pytest.raises(SystemExit) as exited:
        reshard.parse_args(["--systems", "clonemap,valkey"])
    assert exited.value.code == 2
    assert "--systems valkey: no valkey-server: pip install 'clonemap[peers]'" in (
        capsys.readouterr().err)
    assert reshard.parse_args(["--systems", "clonemap"]).systems == "clonemap"
