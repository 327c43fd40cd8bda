"""The load generator (``python -m bench load``), the same-run ceilings and the harness
pieces under them: key routing in the writer's schedule, per-shard sequence and gap
tracking in the subscriber, core planning. Smoke runs last a second or two each and
assert the record's figures, never timings."""
from __future__ import annotations

import struct

import pytest

from bench.harness.offer import core_plan, parse_core_list
from bench.harness.traffic import WriterConfig, key_index, routed_schedule
from bench.harness.traffic_reader import SourceState, blind_reader, drain
from clonemap.shards.common import zio
from conftest import bench_record, run_bench
from clonemap.shards.common.routing import ShardMap

SMOKE = ("--seconds", "1", "--warmup", "0.3", "--keys", "2000")


# ------------------------------------------------------------------ routing in the schedule

def test_routed_schedule_sends_every_key_to_its_owner():
    cfg = WriterConfig(collector="", collectors=("a", "b", "c"), keys=500, seed=2)
    sched = routed_schedule(cfg, length=1 << 12)
    owner = ShardMap(3).owner
    assert all(shard == owner(key) for key, _, shard in sched)
    assert {shard for _, _, shard in sched} == {0, 1, 2}  # 500 keys reach every shard


def test_routed_schedule_honours_pins_and_keeps_one_shard_simple():
    pinned = WriterConfig(collector="", collectors=("a", "b"), keys=100,
                          pins=(("/k0000001", 1),))
    sched = routed_schedule(pinned, length=1 << 12)
    owner = ShardMap(2, {1: ["/k0000001"]}).owner
    assert all(shard == owner(key) for key, _, shard in sched)
    pinned_keys = [(k, s) for k, _, s in sched if k.startswith(b"/k0000001")]
    assert pinned_keys and all(s == 1 for _, s in pinned_keys)
    single = routed_schedule(WriterConfig(collector="x", keys=50), length=1 << 10)
    assert {s for _, _, s in single} == {0}
    assert all(0 <= key_index(k) < 50 for k, _, _ in single)


def test_core_plan_puts_targets_first_and_the_harness_on_the_rest():
    assert core_plan(1, 3, [0, 1]) == ([0], [1, 1, 1])
    assert core_plan(2, 2, [0, 1]) == ([0, 1], [0, 1])       # no core left: share them all
    assert core_plan(4, 2, [0, 1, 2, 3, 4, 5, 6, 7]) == ([0, 1, 2, 3], [4, 5])
    # --cores 12-15 on a 16-core host: 3 writers and 1 subscriber, targets elsewhere
    assert core_plan(2, 4, list(range(16)), harness_cores=(12, 13, 14, 15)) == (
        [0, 1], [12, 13, 14, 15])


def test_core_lists_parse_ranges_and_refuse_the_rest():
    assert parse_core_list("12-15") == (12, 13, 14, 15)
    assert parse_core_list("0, 2-3,2") == (0, 2, 3)
    for bad in ("", "1x", "3-1", "-2", "1-"):
        with pytest.raises(ValueError):
            parse_core_list(bad)


# ------------------------------------------------------------------ per-shard gap tracking

class Again(Exception):
    pass


class FakeSocket:
    """Queued 5-frame messages; ``recv`` pops frames, raising Again when empty."""

    def __init__(self, messages):
        self.frames = [f for m in messages for f in m]
        self.extra_after: set[int] = set()

    @staticmethod
    def recv(sock, flags, copy):
        if not sock.frames:
            raise Again()
        return sock.frames.pop(0)

    @staticmethod
    def more(sock):
        return False


def kvpub(seq: int, value: bytes = b"v" * 8) -> list[bytes]:
    return [b"/k", struct.pack(">Q", seq), b"u" * 16, b"", value]


def drain_all(sock, st, budget=1000, every=1_000_000):
    samples: list[int] = []
    read = blind_reader(FakeSocket.recv, FakeSocket.more, Again, every)
    n = drain(read, sock, st, budget, every, samples, lambda: 0)
    return n, samples


def test_each_source_keeps_its_own_sequence_and_gaps():
    # two shards with independent sequences: interleaving them is not a gap
    s0 = FakeSocket([kvpub(q) for q in (1, 2, 3, 6, 7)])      # 4 and 5 lost
    s1 = FakeSocket([kvpub(q) for q in (1, 2, 3, 4)])
    st0, st1 = SourceState(), SourceState()
    assert drain_all(s0, st0)[0] == 5 and drain_all(s1, st1)[0] == 4
    assert (st0.received, st0.max_seq, st0.gaps, st0.first_seq) == (5, 7, 2, 1)
    assert (st1.received, st1.max_seq, st1.gaps) == (4, 4, 0)


def test_hugz_backwards_budget_and_malformed_are_counted():
    sock = FakeSocket([kvpub(5), kvpub(0), kvpub(4), kvpub(6), kvpub(8)])
    st = SourceState()
    n, _ = drain_all(sock, st, budget=3)              # capped batch: three messages
    assert n == 3 and (st.received, st.hugz, st.backwards, st.max_seq) == (2, 1, 1, 5)
    n, _ = drain_all(sock, st)
    assert n == 2 and (st.received, st.max_seq, st.gaps, st.last_seq) == (4, 8, 1, 8)
    short = FakeSocket([[b"/k", b"\x00\x01"] + [b"x"] * 3])  # a 2-byte sequence frame
    st = SourceState()
    drain_all(short, st)
    assert st.malformed == 1 and st.received == 0


def test_latency_is_sampled_from_the_value_stamp():
    stamp = struct.pack(">Q", 1_000)
    sock = FakeSocket([kvpub(q, stamp + b"pad") for q in (1, 2, 3, 4)])
    st = SourceState()
    samples: list[int] = []
    read = blind_reader(FakeSocket.recv, FakeSocket.more, Again, 2)
    drain(read, sock, st, 100, 2, samples, lambda: 3_500)
    assert samples == [2_500, 2_500]                   # every 2nd update: now - stamp


def test_latency_is_sampled_only_inside_the_window(zctx):
    """The subscriber's latency figures are those of the updates its window counts. Over
    a real XPUB->SUB: updates drained before the window starts and after it ends carry a
    stamp of 0 (a latency of the host's uptime); had either been sampled, the maximum
    would show it."""
    import threading
    import time

    import zmq

    from bench.harness.traffic import SubscriberConfig, Window
    from bench.harness.traffic_reader import _subscribe

    pub = zctx.socket(zmq.XPUB)
    pub.bind("inproc://window")
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://window")
    assert pub.recv() == b"\x01"                          # the subscription has arrived
    stale = struct.pack(">Q", 0)

    def send(seqs, stamp):
        for q in seqs:
            pub.send_multipart(kvpub(q, (stamp() if stamp else stale) + b"pad"))

    t0 = time.monotonic()
    window = Window(t_start=t0 + 1.0, t_end=t0 + 1.5)
    send(range(1, 5), None)                               # before the window
    # quiet_s well over the 0.5 s between the window's updates and the late ones: after
    # the window the subscriber stops once nothing came for quiet_s, and must not stop
    # before the late updates arrive
    cfg = SubscriberConfig(endpoint="inproc://window", latency_every=1, quiet_s=2.0,
                           drain_s=5.0, progress_s=0)
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(_subscribe([sub], cfg, window,
                                                                    None, zmq)))
    reader.start()
    time.sleep(window.t_start + 0.05 - time.monotonic())  # the window is a time
    send(range(5, 9), lambda: struct.pack(">Q", time.monotonic_ns()))
    time.sleep(window.t_end + 0.05 - time.monotonic())
    send(range(9, 13), None)                              # after it
    reader.join(10)
    assert not reader.is_alive()
    assert out["received_total"] == 12 and out["seq_at_window_start"] == 4
    assert out["received_window"] == 4 and out["latency_samples"] == 4
    assert out["latency_ms"]["max"] < 1_000              # a stale stamp reads ~uptime


@pytest.mark.skipif(not zio.COMPILED, reason="the subscriber reads whole messages only on "
                    "the compiled frame path (test_frame_paths checks it is built here)")
def test_whole_message_drain_counts_over_a_real_socket(zctx):
    """The subscriber's compiled-path drain, over inproc PUSH->PULL: every message's frame
    count is checked, a short or long one costs no valid one, and gaps, HUGZ, backwards
    steps and stamps are counted as ``drain`` counts them."""
    import time

    import zmq

    push, pull = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
    pull.bind("inproc://drain-whole")
    push.connect("inproc://drain-whole")
    stamp = struct.pack(">Q", 1_000)
    for msg in ([kvpub(1, stamp)], [kvpub(2, stamp)[:4]], [kvpub(3, stamp) + [b"x"] * 3],
                [kvpub(4, stamp)], [kvpub(0)], [kvpub(2, stamp)],
                [[b"/k", b"\x00\x01", b"u", b"", b"v"]], [kvpub(7, stamp)]):
        push.send_multipart(msg[0])
    assert pull.poll(5000)
    st, samples = SourceState(), []
    recv_message = zio.compiled_recv()
    n = drain(recv_message, pull.underlying, st, 3, 2, samples, lambda: 3_500)
    assert n == 3 and (st.received, st.malformed) == (1, 2)     # a capped batch
    n = drain(recv_message, pull.underlying, st, 100, 2, samples, lambda: 3_500)
    assert n == 5
    assert (st.received, st.malformed, st.hugz, st.backwards) == (4, 3, 1, 1)
    assert (st.max_seq, st.gaps, st.first_seq, st.last_seq) == (7, 4, 1, 7)
    assert samples == [2_500, 2_500]                   # every 2nd update: now - stamp
    assert drain(recv_message, pull.underlying, st, 100, 2, samples,
                 time.monotonic_ns) == 0        # nothing waiting: no block


# ------------------------------------------------------------------ smoke runs

def _load_figures(data, shards):
    (run,) = data["runs"]
    assert run["received_per_s"] > 0 and run["sent_per_s"] > 0 and run["loss_window"] == 0
    assert run["malformed"] == 0 and run["latency_ms"]["p50"] > 0
    assert run["shards"] == shards and run["cpu_cores"] > 0
    assert data["summary"]["loss_window"] == 0
    assert data["summary"]["received_per_s"]["median"] > 0
    return run


def test_load_starts_its_own_shards_and_routes_over_them(procs, tmp_path):
    """--harness auto: the plan printed first, two subscribers splitting the two shards
    (their figures summed), then one window at half the flat-out median."""
    proc = procs.python("-m", "bench.load", "--start-shards", "2", *SMOKE, "--ttl-fraction",
                        "0.2", "--distribution", "zipf", "--harness", "auto",
                        "--rates-of-max", "0.5", "--results-dir", str(tmp_path))
    assert proc.wait(120) == 0, list(proc.stderr)[-20:]
    data = bench_record(tmp_path, "load")
    text = "\n".join(proc.stderr)    # the progress notes: the plan before the first round
    assert text.index("plan: 2 server process(es), 1 writer(s), 1 subscriber(s)") < \
        text.index("round 1/1")
    assert "server-1   core 1" in text
    assert data["config"]["plan"]["why"].startswith("2 usable cores")
    flat, half = data["runs"]
    assert half["fraction_of_max"] == 0.5 and half["phase"] == "rate"
    assert half["offered_per_s"] == round(0.5 * flat["received_per_s"], 1)
    assert half["loss_targets"] == 0 and half["received_per_s"] > 0
    for r in (flat, half):   # every harness process's own CPU, and no loss to charge
        assert set(r["harness_pct_each"]) == {"writers", "subscribers"}
        assert r["loss_harness"] == 0 and r["loss_targets"] == 0
    data["runs"] = [flat]
    run = _load_figures(data, 2)
    assert [s["gaps_window"] for s in run["per_source"]] == [0, 0]
    assert all(s["received_window"] > 0 for s in run["per_source"])  # both shards served
    assert run["cpu_pct"]["targets"] > 0
    assert len(data["config"]["targets"]["commands"]) == 2
    assert all("--shard-index" in c for c in data["config"]["targets"]["commands"])


def test_load_against_a_running_server_at_a_fixed_rate(procs, tmp_path, port_base):
    procs.python("-m", "clonemap.shards", "--port", str(port_base), ready="READY")
    run_bench(procs, tmp_path, "bench.load", "--port", str(port_base), *SMOKE,
              "--rate", "2000", "--subscribers", "2")
    data = bench_record(tmp_path, "load")
    run = _load_figures(data, 1)
    assert run["writer_drops"] == 0 and len(run["received_per_s_each"]) == 2
    assert data["summary"]["offered_per_s"] == 2000
    assert {t["name"] for t in data["targets"]} == {
        "updates lost by the servers (all windows)", "received / offered (median)"}


def test_the_cluster_as_users_run_it_under_supervisor_start(procs, tmp_path):
    """bench cluster: supervisor start of configs/2shard.yaml (moved to free ports and a
    temporary data directory), load with the harness sized from the cores, flat out and
    at 25%; the servers' CPU from the supervisor's PIDs; nothing left running."""
    import psutil

    run_bench(procs, tmp_path, "bench.cluster", "--config", "configs/2shard.yaml",
              "--seconds", "0.5", "--warmup", "0.5", "--rounds", "1")
    data = bench_record(tmp_path, "cluster")
    assert data["config"]["cluster_config"] == "configs/2shard.yaml"
    assert data["config"]["servers"] == 4
    flat, quarter = data["runs"]
    assert quarter["fraction_of_max"] == 0.25
    # the fixed-rate window began with no compaction running and no backlog left
    assert quarter["before"]["idle"] is True and quarter["settle"]["settled"] is True
    for r in (flat, quarter):
        assert all(s["late_s"] < 0.5 for s in r["subscribers"]), r["harness_bound"]
        if any(s["window_s"] < 0.45 for s in r["subscribers"]):
            # its reader was descheduled through the window (a loaded host): the run
            # says so instead of charging the servers with its zero
            assert "was not running for" in r["harness_bound"], r
        else:
            assert r["received_per_s"] > 0
        assert r["loss_targets"] == 0
        assert r["cpu_pct"]["targets"] > 0          # the supervised servers' own CPU
        assert len(r["per_source"]) == 2 and all(s["gaps_window"] == 0
                                                 for s in r["per_source"])
    assert max(flat["received_per_s"], quarter["received_per_s"]) > 0  # the shards served
    names = {t["name"] for t in data["targets"]}
    assert {"updates lost by the servers (all windows)",
            "p99 at 25% of the flat-out rate"} <= names
    mine = [p for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not mine


@pytest.mark.parametrize("bad", [["--start-shards", "0"], ["--port", "1", "--rate", "-1"],
                                 ["--config", "/nonexistent.yaml"],
                                 ["--port", "1", "--distribution", "pareto"]])
def test_load_refuses_bad_input_with_exit_code_2(procs, bad):
    proc = procs.python("-m", "bench.load", *bad)
    assert proc.wait(30) == 2
    assert any("error" in line for line in proc.stderr)
    assert not any("Traceback" in line for line in proc.stderr)


def test_ceilings_are_measured_with_the_traffic_harness():
    from bench.harness.ceilings import measure_ceilings

    c = measure_ceilings(seconds=0.5, warmup=0.2, keys=2000)
    assert set(c) == {"pubsub", "forwarder", "config"}
    for kind in ("pubsub", "forwarder"):
        fig = c[kind]
        assert fig["received_per_s"] > 0 and fig["sent_per_s"] > 0
        assert fig["writer_drops"] == 0
        # flat out, a bare loop's PUB may drop when the subscriber falls behind (counted)
        assert fig["loss_window"] == 0 or kind == "forwarder"
        assert set(fig["latency_ms"]) == {"p50", "p90", "p99", "p99.9", "max"}
        assert fig["cpu_pct"]["writers"] > 0 and fig["cpu_pct"]["subscribers"] > 0
    assert c["forwarder"]["cpu_pct"]["targets"] > 0
    assert c["pubsub"]["cpu_pct"]["targets"] == 0      # nothing in between
    open_loop = measure_ceilings(seconds=0.5, warmup=0.2, keys=2000, rate_per_s=1000,
                                 kinds=("pubsub",))
    assert open_loop["config"]["writer_mode"] == "rate"
    assert open_loop["pubsub"]["sent_per_s"] > 0 and open_loop["pubsub"]["loss_window"] == 0
