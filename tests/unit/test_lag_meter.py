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
    assert meter.backlog(meter.lag_s) == 1200.0
    meter.observe(ts=10.9, now=13.1, seq=650)        # older than the last: no interval
    meter.observe(ts=11.5, now=13.5, seq=50)         # a sequence that went back: none
    assert meter.rate_per_s == 600.0
    meter.reset()
    assert meter.rate_per_s is None and meter.backlog(1.0) is None
