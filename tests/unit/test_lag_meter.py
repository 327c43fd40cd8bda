"""The client's lag meter, pure (``clonemap.client.lag``): the offset absorbs the clocks'
difference and the network floor; the lag is how much later than usual a HUGZ is read."""
from __future__ import annotations

from clonemap.client.lag import LagMeter


def test_the_smallest_delay_is_the_floor_and_the_lag_is_measured_above_it():
    meter = LagMeter()
    # the server's clock runs 100 s behind ours; the network floor is 2 ms
    assert meter.observe(ts=1000.0, now=1100.002) == 0.0
    assert round(meter.offset_s, 6) == 100.002
    assert round(meter.observe(ts=1000.5, now=1100.752), 6) == 0.25  # read 0.25 s late
    assert round(meter.observe(ts=1001.0, now=1101.0015), 6) == 0.0   # a new floor
    assert round(meter.offset_s, 6) == 100.0015
    assert round(meter.max_lag_seen_s, 6) == 0.25
    assert round(meter.lag_s, 6) == 0.0


def test_another_server_means_another_clock():
    meter = LagMeter()
    meter.observe(ts=10.0, now=20.0)
    meter.observe(ts=11.0, now=23.0)
    assert meter.lag_s == 2.0
    meter.reset()
    assert meter.offset_s is None
    assert meter.observe(ts=500.0, now=20.5) == 0.0  # a clock ahead of ours: fine
    assert meter.offset_s == -479.5 and meter.max_lag_seen_s == 2.0


def test_the_publishers_rate_comes_from_two_clock_hugz_and_sizes_the_backlog():
    meter = LagMeter()
    meter.observe(ts=10.0, now=10.0, seq=100)
    assert meter.rate_per_s is None and meter.backlog(2.0) is None  # one HUGZ: no rate
    meter.observe(ts=10.5, now=10.5, seq=600)        # 1,000 updates/s
    assert meter.rate_per_s == 1000.0
    meter.observe(ts=11.0, now=13.0, seq=700)        # 200/s: half from the newest
    assert meter.rate_per_s == 600.0 and meter.lag_s == 2.0
    assert meter.backlog(meter.lag_s) == 400.0  # at the lower rate of the two
    meter.observe(ts=10.9, now=13.1, seq=650)        # older than the last: no interval
    meter.observe(ts=11.5, now=13.5, seq=50)         # a sequence that went back: none
    assert meter.rate_per_s == 600.0
    meter.reset()
    assert meter.rate_per_s is None and meter.backlog(1.0) is None


def test_a_burst_already_read_is_not_taken_for_the_rate_to_come():
    """A publisher at 5,000 updates/s publishes a burst of 168,000 between two clock
    HUGZ (a shard applying a shrink's keys at the flip). A client reads the HUGZ after
    the burst 5 s late: what it has yet to read is what came after that HUGZ, about 5 s
    at the rate kept up, not 5 s at the burst's rate (which made it resync for lag)."""
    meter = LagMeter()
    meter.observe(ts=100.0, now=100.0, seq=0)
    meter.observe(ts=100.5, now=100.5, seq=2_500)
    meter.observe(ts=102.5, now=107.5, seq=2_500 + 168_000 + 10_000)
    assert meter.lag_s == 5.0
    assert meter.backlog(meter.lag_s) == 25_000.0  # 5 s x 5,000/s
    assert meter.rate_per_s > 40_000  # (the average, as the stats show it, took it in)
    # a rate kept up in both intervals is the rate
    meter.observe(ts=103.0, now=103.1, seq=180_500 + 50_000)
    meter.observe(ts=103.5, now=103.6, seq=180_500 + 100_000)
    assert meter.backlog(1.0) == 100_000.0
