"""The local read path (``Clone.get``) as an application uses it: a thread that reads as
fast as it can while writes flow, the active of the pair is killed and the client
installs its new active's snapshot. A get never returns a value older than one that
thread read before (the client keeps its map over a data loss: ``reset_policy="keep"``;
with the default "accept" a loss is told through ``on_reset``, and a value may then go
back), and every acknowledged write is there for a fresh client after the fault."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from clonemap.client.api import Clone
from clonemap.shards.common.proto import bstar as wire
from test_client_failover import start_pair, wait_state

KEY = "/live/counter"


def test_a_get_never_goes_back_across_a_failover_and_its_resync(procs, zctx):
    primary, backup = start_pair(procs, zctx)
    servers = [primary.address, backup.address]
    failovers: list = []
    installed = threading.Event()
    reads: list[int] = []
    backwards: list[tuple[int, int]] = []
    stop = threading.Event()

    def on_failover(info) -> None:
        failovers.append(info)
        if info.resumed:
            installed.set()

    with Clone(servers, reset_policy="keep", on_failover=on_failover, heartbeat_s=0.2,
               sync_timeout_s=0.5, connect_timeout_s=1.0) as reader, \
            Clone(servers, heartbeat_s=0.2, sync_timeout_s=0.5,
                  connect_timeout_s=1.0) as writer:
        acked = [0]

        def read_loop() -> None:
            last = 0
            get = reader.get
            while not stop.is_set():
                blob = get(KEY)
                if blob is None:
                    continue
                value = int(blob)
                if value < last:
                    backwards.append((last, value))
                if value != last:
                    reads.append(value)
                last = value

        thread = threading.Thread(target=read_loop, name="reader", daemon=True)
        thread.start()
        try:
            n = 0
            while n < 200:  # before the fault
                n += 1
                writer.set(KEY, b"%d" % n, wait=True)
                acked[0] = n
            os.kill(primary.pid, signal.SIGKILL)
            wait_state(zctx, backup.port, wire.State.ACTIVE)
            while not installed.is_set() or n < 500:  # 300 more once it resumed
                n += 1
                writer.set(KEY, b"%d" % n, wait=True, timeout_s=10)
                acked[0] = n
                if n > 5000:
                    raise AssertionError("the reader never resumed after the failover")
        finally:
            stop.set()
            thread.join(10)
        assert not thread.is_alive()
        assert backwards == [], f"a get went back: {backwards[:5]}"
        assert failovers and failovers[-1].resumed, failovers
        assert reads and reads[-1] <= acked[0]
        assert any(v > 200 for v in reads), "the reader saw nothing written after the kill"
        last = acked[0]
    with Clone(backup.address, heartbeat_s=0.2) as fresh:  # after the fault: the ledger
        assert fresh.get(KEY) == b"%d" % last



def test_the_flat_view_checks_keys_follows_deletes_and_empties_on_a_failure(procs,
                                                                           port_base):
    """``get`` of the ``bytes`` codec (the default) reads one flat view of the map: a
    key it holds is one lookup, and everything else goes the checked way (a key not a
    str, or outside the subtree, raises; an absent one gives the default). A delete
    leaves the view with the map. Another codec (msgpack) decodes on each get and keeps no view.
    A client that failed raises on every get, a key the view held included."""
    from clonemap.client.api import AsyncClone
    from clonemap.client.errors import SlowSubscriber
    from helpers import run_async
    from test_server_conformance import start_server

    start_server(procs, port_base)
    address = f"tcp://127.0.0.1:{port_base}"

    async def main():
        async with AsyncClone(address, subtree="/v/") as c:
            await c.set("/v/a", b"1", wait=True)
            await c.set("/v/b", b"\x81\xa1n\x02", wait=True)  # msgpack {"n": 2}
            decoded = AsyncClone(address, subtree="/v/", codec="msgpack")
            await decoded.start()  # (after the writes: its snapshot holds them)
            assert c.get("/v/a") == b"1" and c.get("/v/zz") is None
            assert c.get("/v/zz", b"d") == b"d"
            with pytest.raises(TypeError):
                c.get(b"/v/a")
            with pytest.raises(ValueError, match="outside this client's subtree"):
                c.get("/w/a")
            await c.delete("/v/a", wait=True)
            assert c.get("/v/a") is None and c.get("/v/a", 7) == 7
            try:
                assert decoded.get("/v/b") == {"n": 2}
                c.health.fail_now(SlowSubscriber("fell behind (this test)", shard="s0"))
                with pytest.raises(SlowSubscriber):
                    c.get("/v/b")  # held by the view until the failure emptied it
                assert decoded.get("/v/b") == {"n": 2}  # the other client is not touched
            finally:
                await decoded.close()

    run_async(main())


def test_a_value_reaches_the_view_before_its_sequence(zctx):
    """The order that keeps read-modify-write safe, forced: a spy view records the key's
    sequence at the moment the view takes each value. A KVPUB's value is in the map and
    the view while the key's sequence is still the old one (so ``meta()`` then ``get()``
    can pair a new value with the old sequence, which conflicts, never an old value with
    the new one, which would lose an update); a delete leaves the view first too. (The
    agent is fed its SUB's messages directly: no sockets are started.)"""
    from clonemap.client.agent import ShardAgent
    from clonemap.shards.common.proto import chp

    seen: list[tuple[str, str, int | None]] = []

    class SpyView(dict):
        def __setitem__(self, key, value):
            seen.append(("set", key, agent.seqs.get(key.encode())))
            assert agent.map[key.encode()] == value  # the map has it already
            super().__setitem__(key, value)

        def pop(self, key, *default):
            seen.append(("pop", key, agent.seqs.get(key.encode())))
            return super().pop(key, *default)

    view = SpyView()
    agent = ShardAgent(zctx, ["tcp://127.0.0.1:1"], name="s0", view=view)
    agent._apply(chp.kvpub(b"/k", 1, b"one"), replay=False)
    agent._apply(chp.kvpub(b"/k", 2, b"two"), replay=False)
    agent._apply(chp.kvpub(b"/k", 3, b""), replay=False)  # a delete
    assert seen == [("set", "/k", None), ("set", "/k", 1), ("pop", "/k", 2)]
    assert dict(view) == {} and agent.seqs == {} and agent.last_seq == 3
    agent.close()
