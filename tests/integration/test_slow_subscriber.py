"""Slow subscribers (the guide's Suicidal Snail) detected by the server clock in HUGZ.

A real shard server (``--clock-s 0.2``: a HUGZ carrying ``ts``/``seq`` five times a
second, busy or not) and a writer thread that streams KVSETs into ``/snail/`` and
elsewhere at a paced rate. A SUBTREE client (sequence gaps are normal under its filter,
so only the clock can tell) has its loop deliberately blocked by a ``time.sleep`` on
that loop, the one sleep here; when the loop runs again, the HUGZ it reads are seconds
old: ``slow_policy="die"`` fails the client (``SlowSubscriber`` from every call and every
watch, ``on_slow`` called), ``"resync"`` takes a fresh snapshot and ends equal to the
server's map. A healthy subtree client under the same load is never flagged. Every wait
is for a state, with a deadline; no timing is asserted.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from helpers import run_async as run
from test_client_server import fetch_map
from clonemap.client.api import AsyncClone, Clone
from clonemap.client.errors import SlowSubscriber
from clonemap.shards.common.proto import chp

pytestmark = pytest.mark.timeout(90)

DEADLINE_S = 15.0
CLOCK_S = 0.2
MAX_LAG_S = 1.0
BLOCK_S = 2.5
"""How long the client's loop is blocked: well beyond max_lag_s."""
SUBTREE = "/snail/"



class Writer:
    """A thread streaming KVSETs to the server's collector, about ``rate`` per second:
    100 keys under /snail/ and 100 elsewhere, values numbered."""

    def __init__(self, zctx: zmq.Context, port: int, rate: int = 2000):
        self.pub = zctx.socket(zmq.PUB)
        self.pub.sndhwm = 0
        self.pub.connect(f"tcp://127.0.0.1:{port + 2}")
        self.rate = rate
        self.sent = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        batch = max(1, self.rate // 100)
        while not self.stop_event.is_set():
            for _ in range(batch):
                n = self.sent
                prefix = b"/snail/" if n % 2 else b"/other/"
                self.pub.send_multipart(chp.kvset(prefix + b"k%d" % (n % 100), b"v%d" % n))
                self.sent += 1
            self.stop_event.wait(0.01)  # pacing: ~rate/s, not a wait for a state

    def __enter__(self) -> "Writer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(5)
        self.pub.close(0)


@pytest.fixture
def server(procs, port_base):
    procs.python("-m", "clonemap.shards", "--port", str(port_base), "--heartbeat-s", "0.2",
                 "--clock-s", str(CLOCK_S), "--log-level", "info", ready="READY")
    return f"tcp://127.0.0.1:{port_base}"


async def until(cond, what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)  # yield the loop to the client's agents


async def clock_heard(client: AsyncClone) -> None:
    """Until the client has a clock offset from its server (it reads clock HUGZ)."""
    agent = client._agents[0]
    await until(lambda: agent.lag.offset_s is not None, "a clock HUGZ read")


def test_a_blocked_subtree_client_dies_loudly(server, port_base, zctx):
    seen: list[SlowSubscriber] = []

    async def main():
        client = AsyncClone(server, subtree=SUBTREE, slow_policy="die",
                            max_lag_s=MAX_LAG_S, on_slow=seen.append)
        async with client:
            with Writer(zctx, port_base):
                await clock_heard(client)
                async with client.watch(SUBTREE) as w:
                    time.sleep(BLOCK_S)  # the deliberate block of the client's loop
                    await until(lambda: client.failed is not None, "the client failed")
                    with pytest.raises(SlowSubscriber):
                        async for _ in w:
                            pass
            with pytest.raises(SlowSubscriber) as err:
                await client.set("/snail/after", b"x")
            with pytest.raises(SlowSubscriber):
                client.get("/snail/k1")
            assert err.value is client.failed
            return client.fell_behind, client.stats()

    fell_behind, stats = run(main())
    assert fell_behind == 1
    assert len(seen) == 1 and seen[0].shard == "s0"
    assert seen[0].lag_s is not None and seen[0].lag_s > MAX_LAG_S
    assert stats["shards"][0]["lagged"] >= 1
    assert "fell behind" in stats["failed"]


def test_a_blocked_subtree_client_resyncs_to_the_servers_map(server, port_base, zctx):
    async def main():
        client = AsyncClone(server, subtree=SUBTREE, slow_policy="resync",
                            max_lag_s=MAX_LAG_S)
        async with client:
            agent = client._agents[0]
            with Writer(zctx, port_base):
                await clock_heard(client)
                snapshots = agent.snapshots
                time.sleep(BLOCK_S)  # the deliberate block of the client's loop
                await until(lambda: client.fell_behind >= 1, "the lag was detected")
                await until(lambda: agent.snapshots > snapshots and agent.phase == "ACTIVE",
                            "a fresh snapshot installed")
            # writer stopped: a fence write, applied in sequence order after the rest
            await client.set("/snail/fence", b"end", wait=True, timeout_s=DEADLINE_S)
            server_map, seq = fetch_map(zctx, port_base, SUBTREE.encode())
            await until(lambda: agent.last_seq >= seq, "caught up with the snapshot")
            local = {k.encode(): v for k, v in client.items()}
            assert client.failed is None
            return local, server_map, client.fell_behind, agent.stats()

    local, server_map, fell_behind, stats = run(main())
    assert fell_behind >= 1 and stats["lagged"] >= 1 and stats["snapshots"] >= 2
    assert local == server_map
    assert b"/snail/fence" in local and len(local) > 1
    assert all(k.startswith(b"/snail/") for k in local)


def test_a_healthy_subtree_client_under_the_same_load_is_never_flagged(server, port_base,
                                                                       zctx):
    with Clone(server, subtree=SUBTREE, slow_policy="die", max_lag_s=MAX_LAG_S) as client:
        with Writer(zctx, port_base) as writer:
            deadline = time.monotonic() + DEADLINE_S
            # as long as the blocked clients above were blocked, and more
            while writer.sent < 2000 * (BLOCK_S + 1):
                assert time.monotonic() < deadline, "the writer did not get going"
                writer.stop_event.wait(0.05)
                assert client._async.failed is None
        client.set("/snail/fence", b"end", wait=True, timeout_s=DEADLINE_S)
        stats = client.stats()
        server_map, _ = fetch_map(zctx, port_base, SUBTREE.encode())
        local = {k.encode(): v for k, v in client.items()}
    assert stats["fell_behind"] == 0 and stats["failed"] is None
    shard = stats["shards"][0]
    assert shard["lagged"] == 0 and shard["snapshots"] == 1
    assert shard["max_lag_seen_s"] <= MAX_LAG_S
    assert local == server_map


def test_the_machine_resyncs_on_fell_behind_only_when_active():
    """The pure part: ``FellBehind`` asks the same server for a fresh snapshot when
    ACTIVE, and is ignored while a snapshot is on its way (the lag is then stale)."""
    from clonemap.client import shard_machine as sm

    state = sm.State(sm.Config(contiguous=False))
    for event in (sm.Start(), sm.SubscriberLive(), sm.SnapshotDone(10)):
        state, _ = sm.step(state, event, 0.0)
    assert state.phase == sm.ACTIVE
    syncing, effects = sm.step(state, sm.FellBehind(2.5), 1.0)
    assert syncing.phase == sm.SYNCING and syncing.server == 0
    assert effects == [sm.RequestSnapshot(0, "fell behind the publisher by 2.50 s")]
    assert sm.step(syncing, sm.FellBehind(3.0), 1.1) == (syncing, [])
