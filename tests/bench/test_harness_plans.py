"""The load harness's own logic, on any host: how it sizes itself from the cores it is
given, how subscribers split the shards, how figures of several subscriber processes are
merged, and to whom a lost update is charged. Pure functions fed with the figures the
16-core runs produced; the processes themselves are exercised by the smoke runs in
test_bench_scenarios.py and test_harness_processes.py.
"""
from __future__ import annotations

import pytest

from bench.harness import record as rec
from bench.harness.fleet import LoadResult, merged
from bench.harness.procs import cpu_pct_by_group
from bench.harness.offer import charge, cpu_span, harness_plan, subscriber_shares
from bench.harness.traffic import Window
from bench.harness.readers import subscriber_processes, weighted_percentiles

SIXTEEN = list(range(16))


def test_on_16_cores_every_process_gets_a_core_of_its_own():
    for shards in (1, 2, 4, 6):
        plan = harness_plan(shards, SIXTEEN)
        every = plan.target_cores + plan.harness_cores
        assert len(every) == len(set(every)), (shards, plan)   # no core shared
        assert plan.target_cores == list(range(shards))
        assert 1 <= plan.writers <= shards and 1 <= plan.subscribers <= shards
    six = harness_plan(6, SIXTEEN)
    assert (six.writers, six.subscribers) == (6, 4)
    assert six.harness_cores == list(range(6, 16))
    lines = six.lines()
    assert lines[0].startswith("plan: 6 server process(es), 6 writer(s), 4 subscriber(s)")
    assert "  server-5   core 5" in lines and "  subscr-3   core 15" in lines


def test_given_harness_cores_the_targets_take_the_others():
    """The supervised cluster's layout: servers pinned by the config on 0-8, the harness
    on the seven cores left; 4 writers and 3 subscribers (a writer is the slower side)."""
    plan = harness_plan(6, SIXTEEN, harness_cores=list(range(9, 16)))
    assert (plan.writers, plan.subscribers) == (4, 3)
    assert plan.harness_cores == list(range(9, 16))
    assert not set(plan.target_cores) & set(plan.harness_cores)


def test_on_2_cores_the_plan_says_the_harness_shares_the_targets_cores():
    plan = harness_plan(2, [0, 1])
    assert (plan.writers, plan.subscribers) == (1, 1)
    assert "no core left for the harness" in plan.why
    one = harness_plan(1, [0, 1])
    assert one.target_cores == [0] and one.harness_cores == [1, 1]
    assert "share them" in one.why


def test_fixed_counts_are_kept_and_capped_by_nothing_but_the_caller():
    plan = harness_plan(4, SIXTEEN, writers=3, subscribers=1)
    assert (plan.writers, plan.subscribers) == (3, 1)
    assert len(plan.harness_cores) == 4


def test_split_subscribers_read_disjoint_shards_covering_all():
    pubs = [f"tcp://127.0.0.1:{7001 + 20 * i}" for i in range(6)]
    shares = subscriber_shares(pubs, 4, split=True)
    assert [len(s) for s in shares] == [2, 2, 1, 1]
    assert sorted(p for s in shares for p in s) == sorted(pubs)
    assert subscriber_shares(pubs, 9, split=True) == [(p,) for p in pubs]  # capped at 6
    assert subscriber_shares(pubs, 2, split=False) == [tuple(pubs)] * 2


def sub(received, sequenced, gaps, samples, per_source=()):
    return {"received_window": received, "sequenced_window": sequenced, "gaps_window": gaps,
            "received_total": received, "gaps_total": gaps, "sequenced_total": sequenced,
            "malformed": 0, "latency_samples": len(samples), "latency_ns": samples,
            "window_s": 2.0, "first_seq": 1, "per_source": list(per_source),
            "endpoints": ["tcp://x:1"], "latency_ms": {}}


def test_subscribers_that_split_the_shards_add_up_and_share_one_latency_list():
    a = sub(300_000, 300_000, 0, [1_000_000] * 299 + [9_000_000])  # one in 1,000 sampled
    b = sub(100_000, 100_010, 10, [2_000_000] * 100)
    both = merged([a, b])
    assert both["received_window"] == 400_000 and both["gaps_window"] == 10
    assert both["latency_ms"]["p50"] == 1.0 and both["latency_ms"]["max"] == 9.0
    assert len(both["per_source"]) == 2
    writers = [{"window_s": 2.0, "sent_window": 800_000, "sent_total": 800_000,
                "dropped_total": 0}]
    figures = LoadResult(writers, [a, b]).figures(split=True)
    assert figures["received_per_s"] == 200_000.0 and figures["loss_window"] == 10
    alone = LoadResult(writers, [a, b]).figures(split=False)
    assert alone["received_per_s"] == 150_000.0   # a fan-out: the first subscriber's


def test_a_loss_is_charged_to_the_harness_only_where_its_subscriber_was_saturated():
    groups = {"writers": [11, 12], "subscribers": [21, 22]}
    before = {11: 0.0, 12: 0.0, 21: 0.0, 22: 0.0}
    after = {11: 1.0, 12: 1.98, 21: 1.96, 22: 1.0}   # over 2 s: 50%, 99%, 98%, 50%
    out = charge(groups, before, after, 2.0, gaps_each=[500, 7])
    assert out["harness_pct_each"] == {"writers": [50.0, 99.0], "subscribers": [98.0, 50.0]}
    assert out["loss_harness"] == 500 and out["loss_targets"] == 7
    assert "writer 1 at 99% of a core" in out["harness_bound"]
    assert "subscriber 0 at 98% of a core" in out["harness_bound"]
    calm = charge(groups, before, {11: 1.0, 12: 1.0, 21: 1.0, 22: 1.0}, 2.0, [0, 3])
    assert calm["harness_bound"] == "" and calm["loss_targets"] == 3
    assert calm["harness_max_pct"] == 50.0


def test_a_late_cpu_sample_at_the_window_start_falls_back_to_the_one_taken_at_the_load_start():
    """The harness's own process may run late on a busy host (a smoke run in the suite
    read 0 % CPU: it took both samples after its 0.3 s window had ended). The window's
    CPU is then measured from the sample taken as the load began, and the figures say
    so."""
    window = Window(t_start=10.0, t_end=10.3)
    early, on_time, late = {"host_busy": 1.0}, {"host_busy": 2.0}, {"host_busy": 3.0}
    # on time: the window's own sample, over the window from it to its end
    cpu0, span, why = cpu_span(window, (early, 9.5), (on_time, 10.01), 10.31)
    assert cpu0 is on_time and span == pytest.approx(0.29) and why == ""
    # a second sample taken late does not stretch the span past the window's end
    assert cpu_span(window, (early, 9.5), (on_time, 10.01), 11.0)[1] == pytest.approx(0.29)
    # a start sample taken past the window's middle (here after its end): the early one
    cpu0, span, why = cpu_span(window, (early, 9.5), (late, 10.4), 10.41)
    assert cpu0 is early and span == pytest.approx(0.8)
    assert "came 0.40 s late" in why and "warm-up" in why
    figures = cpu_pct_by_group({"targets": [1]}, {1: 0.0, **early}, {1: 0.4, "host_busy": 1.8},
                               span)
    assert figures["targets"] == 50.0 and figures["host"] == 100.0


def test_a_target_the_saturated_harness_set_reads_harness_bound():
    record = rec.Record("cluster", "python -m bench.cluster", {})
    record.target("updates lost by the servers", 0, 1, "updates", higher_is_better=False,
                  harness_bound="writer 0 at 100% of a core")
    record.target("p99 at 25%", 0.65, 1.0, "ms", higher_is_better=False)
    record.target("p99 fan-out", 1354.0, 20.0, "ms", higher_is_better=False,
                  harness_bound="subscriber process 0 at 102% of a core")
    assert [rec.met_word(t) for t in record.data["targets"]] == ["yes", "yes",
                                                                  "harness-bound"]


def test_fanout_sockets_spread_over_the_cores_the_servers_leave():
    assert subscriber_processes(1000, 4, cores=16) == [112] * 1 + [111] * 8
    assert len(subscriber_processes(1000, 4, cores=2)) == 1
    assert subscriber_processes(20, 2, cores=16) == [10, 10]   # one per 10 sockets at most
    assert subscriber_processes(5, 2, requested=8) == [1] * 5


def test_percentiles_over_processes_weigh_each_sample_by_what_it_stands_for():
    """Process A timed 1,000 deliveries at 1 ms (a strided sample of 10), B 9,000 at
    10 ms (a sample of 10): the merged p50 is B's, not the midpoint of 20 samples."""
    a = {"count": 1000, "sample_ns": [1_000_000] * 10, "max_ns": 1_500_000}
    b = {"count": 9000, "sample_ns": [10_000_000] * 10, "max_ns": 12_000_000}
    got = weighted_percentiles([a, b])
    assert got["p50_ms"] == 10.0 and got["max_ms"] == 12.0
    assert weighted_percentiles([a])["p99_ms"] == 1.0
    assert weighted_percentiles([{"count": 0, "sample_ns": [], "max_ns": 0}])["p50_ms"] is None


@pytest.mark.parametrize("bad", ["--profile", "nosuch"])
def test_the_16core_profile_is_named_and_complete(bad):
    from bench.__main__ import PROFILES, build_parser, parse_all

    args = parse_all(["--profile", "16core"], "python -m bench")
    assert args.names == PROFILES["16core"].order
    assert args.results_dir.endswith("bench/results/16core")
    assert set(PROFILES["16core"].order) <= set(PROFILES["16core"].args)
    helps = " ".join(" ".join(build_parser("python -m bench").format_help().split()).split())
    for name, profile in PROFILES.items():  # each profile is said once, where it is defined
        assert f"{name}: {' '.join(profile.about.split())}" in helps
    with pytest.raises(SystemExit):
        parse_all([bad] if bad == "--profile" else ["--profile", bad], "python -m bench")


def test_fanout_clients_spread_over_the_spare_cores_when_asked():
    from bench.fanout import clients_per_process

    assert clients_per_process(4, 16, 1, cores=16) == 4          # a count is kept
    assert clients_per_process("auto", 256, 4, cores=16) == 24    # 11 spare cores
    assert clients_per_process("auto", 16, 1, cores=2) == 16      # none spare: one process
    assert clients_per_process("auto", 3, 1, cores=16) == 1


def test_fanout_sizes_parse_and_default_to_the_single_size():
    from bench.relays import parse_args

    assert parse_args(["--sizes", "250x1000, 1000x200"]).size_list == [(250, 1000.0),
                                                                        (1000, 200.0)]
    assert parse_args(["--subscribers", "40", "--rate", "50"]).size_list == [(40, 50.0)]
    for bad in ("1000", "0x100", "10xfast"):
        with pytest.raises(SystemExit):
            parse_args(["--sizes", bad])


def test_read_figures_time_each_change_to_its_first_sight_and_count_stale_reads():
    """``bench peers``' read figures from a made-up writer and reader: a change counts as
    seen when any number at least as new is first read (20 was read before 10 would be
    skipped); a probe read is stale when a newer number was acknowledged 10 ms before."""
    from bench.peers import read_figures

    ms = 1_000_000
    wrote = {"writes": 30, "acks": [[10, 1000 * ms], [20, 2000 * ms]]}
    reader = {"reads": 600, "cpu_s": 0.003, "elapsed_s": 2.0,
              "first_seen": [[0, 900 * ms], [10, 1020 * ms], [20, 2600 * ms]],
              "probes": [[900 * ms, 0], [1005 * ms, 0], [1015 * ms, 0], [1020 * ms, 10],
                         [2500 * ms, 10], [2600 * ms, 20]]}
    got = read_figures([reader], wrote, server_cpu_s=0.0)
    assert got["staleness_samples"] == 2  # 10 seen 20 ms after its ack, 20 600 ms after
    assert (got["staleness_p50_ms"], got["staleness_max_ms"]) == (20.0, 600.0)
    assert (got["stale_reads"], got["probe_reads"]) == (2, 6)  # at 1015 ms and 2500 ms
    assert got["reads_per_s"] == 300.0 and got["client_cpu_us"] == 5.0


def test_the_ports_env_narrows_where_a_benchmark_takes_its_ports(monkeypatch):
    """``CLONEMAP_BENCH_PORTS`` (the suite sets each worker's slice of ``PORT_RANGE``):
    every base comes from it; a malformed or outside range is refused, saying why."""
    from bench.harness import procs

    monkeypatch.setenv(procs.PORTS_ENV, "15000-15100")
    assert procs.port_range() == (15000, 15100)
    assert all(15000 <= procs.free_port_base(20) <= 15080 for _ in range(20))
    for bad, said in (("15000", "expected LO-HI"), ("9000-12000", "is not inside"),
                      ("15100-15000", "is not inside")):
        monkeypatch.setenv(procs.PORTS_ENV, bad)
        with pytest.raises(SystemExit, match=said):
            procs.port_range()
    monkeypatch.delenv(procs.PORTS_ENV)
    assert procs.port_range() == procs.PORT_RANGE
