"""The client's parts alone, with fakes for what they are given (no sockets, no loop
running): ``Health`` (falling behind, failing), ``Incoming`` (the snapshot being
received: it returns the machine's event instead of stepping the agent) and the read
view's get."""
from __future__ import annotations

import asyncio
import logging

import pytest

from clonemap.client import shard_machine as sm
from clonemap.client.errors import SlowSubscriber
from clonemap.client.health import Health
from clonemap.client.incoming import Incoming
from clonemap.client.options import DIE, RESYNC
from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.proto import chp


class FakeLoop:
    def __init__(self):
        self.soon = []

    def call_soon(self, callback, *args):
        self.soon.append(callback)


class FakeAgent:
    """What the parts read of an agent (``clonemap.client.agent_view.AgentView``)."""

    def __init__(self, name="s0", subtree=b""):
        self.name = name
        self.server = "tcp://127.0.0.1:5556"
        self.loop = FakeLoop()
        self.subtree = subtree
        self.limits = chp.DEFAULT_LIMITS
        self.drops = DropCounter(logging.getLogger("test.client_parts"))
        self.state = sm.State(sm.Config(servers=1))

        class Link:
            generation = "g1"
            closed = 0

            def close_dealer(self):
                self.closed += 1

        self.link = Link()


def health(policy: str, on_slow=None):
    ended, closed = [], []
    h = Health(slow_policy=policy, max_lag_s=1.0, on_slow=on_slow,
               routing=lambda: (4, "configs/4shard.yaml"), end_watches=ended.append,
               close_agents=lambda: closed.append(True))
    return h, ended, closed


def test_resync_counts_a_gap_and_leaves_the_shard_to_resync():
    h, ended, _ = health(RESYNC)
    agent = FakeAgent()
    assert h.on_behind(agent, 5, 9) is False
    assert h.on_lag(agent, 2.5) is False
    assert h.fell_behind == 2 and h.failed is None and ended == []


def test_die_fails_the_client_once_ends_the_watches_and_closes_the_agents_later():
    slow = []
    h, ended, closed = health(DIE, on_slow=slow.append)
    agent = FakeAgent()

    async def main():
        failure = h.failure()
        assert h.on_behind(agent, 5, 9) is True
        assert failure.done()
        return failure

    asyncio.run(main())
    assert isinstance(h.failed, SlowSubscriber) and "expected sequence 5, got 9" in str(h.failed)
    assert ended == [h.failed] and slow == [h.failed]
    assert closed == []  # not inside the agent's batch: on the next loop turn
    for callback in agent.loop.soon:
        callback()
    assert closed == [True]
    assert h.on_lag(agent, 9.0) is True  # dead already: nothing more happens
    assert h.fell_behind == 1 and len(ended) == 1


def test_a_server_with_another_routing_fails_the_client_with_a_config_error():
    h, ended, _ = health(RESYNC)
    h.on_wrong_route(FakeAgent(), "2/8/abcd")
    assert isinstance(h.failed, ConfigError)
    text = str(h.failed)
    assert "4 shards (configs/4shard.yaml)" in text and "shard 2 of 8" in text
    assert ended == [h.failed]


def test_a_server_still_on_an_older_routing_epoch_is_no_wrong_config():
    """A client that follows epoch 2 hears a server of its cluster still on epoch 1 (a
    source not yet told at a change's flip, or a server restarted on the old routing
    meanwhile): that server takes the later routing shortly. A suite run under load
    failed a client there, its waiting writes cancelled. The same epoch with another
    route, or a server that names no epoch, is still a wrong config."""
    ended, closed, followed = [], [], []
    h = Health(slow_policy=RESYNC, max_lag_s=1.0, on_slow=None,
               routing=lambda: (2, "configs/2shard.yaml"), end_watches=ended.append,
               close_agents=lambda: closed.append(True),
               follow=lambda epoch: followed.append(epoch) or False, epoch=lambda: 2)
    h.on_wrong_route(FakeAgent(), "0/2/abcd", epoch=1)
    assert h.failed is None and h.servers_behind == 1 and ended == []
    assert followed == [1]  # asked first: not a later epoch, so not followed
    h.on_wrong_route(FakeAgent(), "0/2/abcd", epoch=2)
    assert isinstance(h.failed, ConfigError) and ended == [h.failed]


def test_an_on_slow_that_raises_is_logged_not_raised(caplog):
    def boom(exc):
        raise RuntimeError("application bug")

    h, _, _ = health(DIE, on_slow=boom)
    assert h.on_behind(FakeAgent(), 1, 3) is True
    assert "on_slow callback failed" in caplog.text


def kvsync(key: bytes, value: bytes, seq: int) -> list[bytes]:
    return [key, chp.pack_seq(seq), b"", b"", value]


def test_incoming_returns_snapshot_done_at_kthxbai_and_fills_its_maps():
    agent = FakeAgent()
    inc = Incoming(agent)
    inc.begin()
    assert inc.on_message(kvsync(b"/a", b"1", 3)) is None
    assert inc.on_message(kvsync(b"/b", b"2", 4)) is None
    event = inc.on_message([chp.KTHXBAI, chp.pack_seq(4), b"", b"", b""])
    assert event == sm.SnapshotDone(4, "g1")
    assert inc.messages == 3
    data, _, seqs = inc.take()
    assert data == {b"/a": b"1", b"/b": b"2"} and seqs == {b"/a": 3, b"/b": 4}


def test_incoming_returns_snapshot_rejected_when_no_row_was_valid():
    agent = FakeAgent(subtree=b"/mine/")
    inc = Incoming(agent)
    inc.begin()
    assert inc.on_message(kvsync(b"/other/x", b"1", 1)) is None  # outside the subtree
    event = inc.on_message([chp.KTHXBAI, chp.pack_seq(1), b"", b"", b"/mine/"])
    assert isinstance(event, sm.SnapshotRejected) and "none valid" in event.reason
    assert agent.link.closed == 1 and inc.rejected == 1


def test_incoming_counts_a_message_outside_a_sync_as_a_drop():
    agent = FakeAgent()
    inc = Incoming(agent)
    assert inc.on_message(kvsync(b"/a", b"1", 1)) is None
    assert agent.drops.counts.get("unexpected_snapshot") == 1


def test_the_read_views_get_is_one_lookup_and_sends_everything_else_to_the_checked_path(
        monkeypatch):
    """``AsyncClone.get`` over the flat view, compiled (a builtin, where the extension is
    built) and pure (a closure), alike: a str key the view holds (a subclass too, and with
    a default by position or keyword) is the very value object; a key it does not hold,
    or one that is not a str, goes to the checked path with its default; no key is a
    TypeError; a key set in the view later is found (the get holds the view)."""
    import types

    from clonemap.client import clone as clone_module
    from clonemap.shards.common import zio

    compiled = zio.compiled_function("viewed_get")
    for path in ("compiled", "pure"):
        if path == "pure":
            monkeypatch.setattr(clone_module, "_C_VIEWED_GET", None)
        value = b"v" * 100
        view = {"/r/a": value}
        asked: list[tuple] = []

        def slow(key, default=None):
            asked.append((key, default))
            return default

        get = clone_module._viewed_get(view, slow)
        if path == "compiled" and compiled is not None:
            assert isinstance(get, types.BuiltinFunctionType), get
        else:
            assert isinstance(get, types.FunctionType), (path, get)

        class Text(str):
            pass

        for hit in (get("/r/a"), get("/r/a", 5), get("/r/a", default=5), get(Text("/r/a"))):
            assert hit is value, (path, hit)
        assert asked == []
        assert get("/r/b") is None and get("/r/b", 7) == 7 and get("/r/b", default=8) == 8
        assert get(b"/r/a", 9) == 9
        assert asked == [("/r/b", None), ("/r/b", 7), ("/r/b", 8), (b"/r/a", 9)], (path, asked)
        with pytest.raises(TypeError):
            get()
        view["/r/b"] = b"later"
        assert get("/r/b") == b"later"
