"""What a write that timed out says of its shard's servers (``client.outages``): a
passive's answer is named within the window, even after a later move for silence."""
from __future__ import annotations

from clonemap.client import shard_machine as sm
from clonemap.client.outages import Outages


class Agent:
    """The part of an agent ``Outages`` reads: its name, servers, clock, snapshots."""

    def __init__(self):
        self.name = "s0"
        self.servers = ["tcp://a:1", "tcp://b:1"]
        self.server = self.servers[0]
        self.snapshots = 1
        self.now = 100.0

    def clock(self) -> float:
        return self.now


def after_a_passive_answer() -> tuple[Agent, Outages]:
    """An agent whose client left server b (1) for a (0) because b said it is passive."""
    agent = Agent()
    outages = Outages(agent, None, None)
    outages.failed_over(sm.Failover(1, 0, "server not serving (passive)", 0.0, passive=True))
    return agent, outages


def test_a_passive_answer_is_named_after_a_later_move_for_silence():
    agent, outages = after_a_passive_answer()
    agent.now += 1.0
    outages.failed_over(sm.Failover(0, 1, "server silent", 0.6))
    agent.now += 1.0
    outages.failed_over(sm.Failover(1, 0, "server silent", 0.6))  # b: silent, this time
    text = outages.unavailable(10.0)
    assert "tcp://b:1: server silent" in text and "cut off from the active" in text


def test_no_passive_answer_within_the_window_names_none():
    agent, outages = after_a_passive_answer()
    agent.now += 20.0
    outages.failed_over(sm.Failover(0, 1, "server silent", 0.6))
    text = outages.unavailable(10.0)
    assert "tcp://a:1: server silent" in text and "cut off" not in text
    assert outages.unavailable(10.0) and Outages(agent, None, None).unavailable(10.0) == ""
