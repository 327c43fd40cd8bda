"""DropCounter: counts every drop, logs at most once per interval per reason."""
import logging

from clonemap.shards.common.drops import DropCounter


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_counts_every_drop_and_rate_limits_the_log(caplog):
    clock = FakeClock()
    drops = DropCounter(logging.getLogger("t"), interval_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(100):
            drops.drop("bad_uuid", "15-byte UUID")
        drops.drop("frame_count", "3 frames")
        clock.now = 6.0
        drops.drop("bad_uuid", "again")
    assert drops.counts == {"bad_uuid": 101, "frame_count": 1}
    assert drops.total == 102
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert "(+99 more since last report)" in messages[-1]
