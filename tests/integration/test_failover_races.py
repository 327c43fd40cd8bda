"""Two races around a restarted Binary Star server, forced in a fixed order by calling the
handlers in that order (the real classes, real sockets, no sleeps).

1. The client: a SUB's data and its monitor's handshake event arrive on two sockets, read
   in no fixed order. A server's welcome HUGZ saying ``serving=0`` can be read before the
   handshake event; the handshake must not then start the grace timer that asks the
   not-serving server for a snapshot anyway (seen under the supervisor: a 6 s stall on
   two refused requests).
2. The passive's replica: the restarted peer's welcome HUGZ (``serving=0``) must not count
   as the active's last message. It did, and KVSETs held pending since the kill looked
   stale at takeover and were dropped (seen under the supervisor: a write lost).
"""
from __future__ import annotations

import asyncio
import struct
from dataclasses import replace

import pytest
import zmq

from conftest import free_port_base
from clonemap.client import shard_machine as sm
from clonemap.client.agent import ShardAgent
from clonemap.shards import replica_machine as rm
from clonemap.shards.pair import pair_server
from clonemap.shards.common.proto import chp
from clonemap.shards.server_config import ServerConfig

pytestmark = pytest.mark.timeout(30)


def handshake_event(endpoint: str) -> list[bytes]:
    """A ZeroMQ monitor message: EVENT_HANDSHAKE_SUCCEEDED on ``endpoint``."""
    return [struct.pack("=hi", zmq.EVENT_HANDSHAKE_SUCCEEDED, 0), endpoint.encode()]


def test_a_not_serving_hugz_read_before_the_handshake_event_asks_for_nothing(zctx):
    a, b = free_port_base(4), free_port_base(4)

    async def main():
        agent = ShardAgent(zctx, [f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}"])
        agent.start()
        try:
            passive = chp.hugz(1.0, 5, serving=False, generation="ab")
            agent._on_update(passive)  # server a: not serving -> move to b
            assert agent.state.server == 1 and agent.state.standby_streak == 1
            agent._on_update(passive)  # b too (read before b's handshake event)
            assert agent.state.holding and agent.state.phase == sm.INITIAL
            assert agent.state.not_serving
            agent.link._on_monitor(handshake_event(f"tcp://127.0.0.1:{b + 1}"))
            assert agent.link._timer is None  # no grace timer armed ...
            agent._on_link_event(sm.LiveProven())  # ... and were one to end: nothing sent
            assert agent.link.dealer is None and agent.state.phase == sm.INITIAL
            # b becomes active: its HUGZ no longer says serving=0 -> ask it
            agent._on_update(chp.hugz(1.1, 5, generation="ab"))
            assert agent.state.phase == sm.SYNCING and agent.link.dealer is not None
            assert not agent.state.not_serving
        finally:
            agent.close()

    asyncio.run(main())


def test_a_restarted_peers_welcome_hugz_is_not_the_actives_last_word():
    port, peer = free_port_base(4), free_port_base(4)
    server = pair_server(ServerConfig(port=port), role="backup", peer=("127.0.0.1", peer))
    loop = asyncio.new_event_loop()
    try:
        server.loop = loop
        follower = server.role.follower
        follower.state = replace(follower.state, phase=rm.LIVE)
        follower.on_update(chp.hugz(1.0, 0, generation="aa"))  # the active, alive
        heard = follower.last_heard
        assert heard > 0
        # the active dies; it restarts and its welcome HUGZ reaches this follower
        follower.on_update(chp.hugz(2.0, 0, serving=False, generation="bb"))
        assert follower.last_heard == heard
        assert follower.counters["hugz_not_serving"] == 1
    finally:
        loop.close()


def test_a_vote_after_a_stall_hears_the_peers_queued_state_first(zctx):
    """3. The vote: a passive whose loop stalled past its peer's expiry has the active's
    state messages queued, unread, when a client's ICANHAZ is handled. It must read them
    before it decides, or it wins a vote against a live active (two actives). Forced:
    the peer's expiry is put in the past, a fresh state message is queued on the
    server's real SUB, then the vote is handled."""
    from clonemap.shards import bstar
    from clonemap.shards.common.proto import bstar as wire

    port, peer = free_port_base(4), free_port_base(4)
    server = pair_server(ServerConfig(port=port, heartbeat_s=0.2), role="backup",
                         peer=("127.0.0.1", peer))
    pair = server.role
    loop = asyncio.new_event_loop()
    active_peer = zctx.socket(zmq.PUB)
    active_peer.linger = 0
    active_peer.bind(f"tcp://127.0.0.1:{peer + 3}")
    try:
        server.bind()
        server.loop = loop
        now = loop.time()
        pair.machine = replace(bstar.new_machine(wire.Role.BACKUP, now, heartbeat_s=0.2,
                                                   shard="0"),
                                 state=wire.State.PASSIVE, peer_expiry=now - 1.0)
        alive = wire.encode(wire.StateMessage(wire.State.ACTIVE, wire.Role.PRIMARY, 0.2,
                                              1, 5, "0"))
        while not pair._state_sub_sock.poll(100):  # the SUB joins: resend until queued
            active_peer.send_multipart(alive)
        assert not pair.admit_snapshot_request(), "won a vote against a live active"
        assert pair.machine.state is wire.State.PASSIVE
        assert pair.machine.peer_expiry > loop.time()  # it heard the peer
    finally:
        active_peer.close(0)
        server.close()
        loop.close()


def test_a_tick_already_due_is_armed_again_without_failing_under_uvloop():
    """4. After a stall (a frozen process, a loaded host) the machine's next wake-up is
    already past when a step arms the tick. uvloop's ``call_at`` for a past time returns
    a plain Handle, without ``when()``: the next step asked it, raised, and every later
    step of the Binary Star machine failed the same way (seen in a suite run under load:
    all four servers of a cluster, their pairs stuck). Forced: a machine due 10 s ago,
    then two steps before the loop runs."""
    import uvloop

    from clonemap.shards import bstar
    from clonemap.shards.common.proto import bstar as wire

    port, peer = free_port_base(4), free_port_base(4)
    server = pair_server(ServerConfig(port=port, heartbeat_s=0.2), role="primary",
                         peer=("127.0.0.1", peer))
    pair = server.role
    loop = uvloop.new_event_loop()
    try:
        server.loop = loop
        pair.machine = bstar.new_machine(wire.Role.PRIMARY, loop.time() - 10.0,
                                         heartbeat_s=0.2, shard="0")
        assert bstar.next_wakeup(pair.machine) < loop.time()
        pair._arm_tick()
        first = pair._tick_handle
        assert first is not None and not hasattr(first, "when")  # the plain Handle
        pair._arm_tick()  # raised AttributeError before
        assert pair._tick_handle is first  # already due sooner than asked: kept
    finally:
        loop.close()


def test_a_client_still_behind_after_its_resync_for_lag_takes_no_second_one(zctx):
    """5. A client short of CPU reads its shard late, resyncs (slow-subscriber policy),
    and, with the new snapshot installed, still reads it late: it is not behind on a
    backlog that another snapshot would skip, so it takes none (``lag_resyncs_spared``)
    until a HUGZ read in time ends the episode. Forced: HUGZ stamped in time, then 3 s
    late, the machine put back to ACTIVE as an install would, 3 s late again, in time,
    late. (``bench reshard`` saw 8 snapshots of 330,000-key shards in 10 s without it.)"""
    import time

    from clonemap.client.options import AgentOptions

    a = free_port_base(4)

    async def main():
        agent = ShardAgent(zctx, [f"tcp://127.0.0.1:{a}"], AgentOptions(max_lag_s=1.0))
        agent.start()
        asked = []
        step = agent._dispatch
        agent._dispatch = lambda ev: (asked.append(type(ev).__name__), step(ev))[1]
        try:
            def hugz(late_s: float) -> None:
                agent.state = replace(agent.state, phase=sm.ACTIVE, live=False)
                msg = chp.decode_update(chp.hugz(time.time() - late_s, 0))
                agent._on_hugz(msg)

            hugz(0.0)  # in time: the clock offset's floor
            hugz(3.0)
            assert asked.count("FellBehind") == 1 and agent.lagged == 1
            hugz(3.0)  # installed, still late: no second snapshot
            assert asked.count("FellBehind") == 1 and agent.lag_resyncs_spared == 1
            hugz(0.0)  # caught up: the episode ends
            hugz(3.0)  # a new one: a resync again
            assert asked.count("FellBehind") == 2 and agent.lagged == 3
        finally:
            agent.close()

    asyncio.run(main())


def test_a_client_lagging_behind_fewer_updates_than_it_holds_reads_on(zctx, monkeypatch):
    """5b. A resync for lag sends every key the client holds; it skips only the updates
    the client is behind on. A client that lags 3 s behind a publisher of 100 updates/s
    (300 to read) while it holds 1,000 keys reads on (``lag_resyncs_spared``), and so
    after one interval of 20,000/s (a burst, read by then); the same lag behind 20,000
    updates/s kept up over two intervals (60,000 to read) resyncs. ``bench reshard`` saw a writer
    that lagged 1.1 s behind 2,500 updates/s take snapshots of its two 500,000-key shards,
    and its writes wait 17 s for them. Forced: clock HUGZ stamped 0.5 s apart with their
    sequences, read at the times this test sets (the agent's wall clock), a map of 1,000
    keys."""
    import time
    import types

    from clonemap.client import agent as agent_module
    from clonemap.client.options import AgentOptions

    a = free_port_base(4)
    now = [1000.0]
    monkeypatch.setattr(agent_module, "time", types.SimpleNamespace(
        time=lambda: now[0], monotonic=time.monotonic))

    async def main():
        agent = ShardAgent(zctx, [f"tcp://127.0.0.1:{a}"], AgentOptions(max_lag_s=1.0),
                           subtree=b"/t/")
        agent.start()
        asked = []
        step = agent._dispatch
        agent._dispatch = lambda ev: (asked.append(type(ev).__name__), step(ev))[1]
        agent.map.update({b"/t/k%d" % i: b"v" for i in range(1000)})
        try:
            def hugz(ts: float, seq: int, read_at: float) -> None:
                agent.state = replace(agent.state, phase=sm.ACTIVE, live=False)
                now[0] = read_at
                agent._on_hugz(chp.decode_update(chp.hugz(ts, seq)))

            hugz(1000.0, 1000, 1000.0)  # in time: the clock's floor
            hugz(1000.5, 1050, 1000.5)  # 100 updates/s
            assert agent.lag.rate_per_s == pytest.approx(100.0)
            hugz(1001.0, 1100, 1004.0)  # read 3 s late: ~300 updates behind, 1,000 held
            assert agent.lagged == 1 and agent.lag_resyncs_spared == 1
            assert "FellBehind" not in asked
            hugz(1001.5, 11100, 1004.5)  # 10,000 in one interval: a burst, read already
            assert agent.lag.backlog(3.0) == pytest.approx(300.0)  # at the rate kept up
            assert "FellBehind" not in asked and agent.lag_resyncs_spared == 2
            hugz(1002.0, 21100, 1005.0)  # 20,000/s kept up: ~60,000 behind
            assert agent.lag.backlog(3.0) > len(agent.map)
            assert asked.count("FellBehind") == 1 and agent.lagged == 3
        finally:
            agent.close()

    asyncio.run(main())


def test_a_resume_from_a_source_forgetting_its_moved_keys_is_not_said_narrowed():
    """6. After a flip a source forgets the keys that moved a chunk per loop turn, and
    meanwhile its snapshots and resumes leave them out (``forgetting``). That is not the
    requester's rights narrowing what it reads: a resume then must not say ``narrowed=1``
    (it did, since any filter set the flag), while the moved key is still left out.
    Forced: a server in process, a key of its own and one it no longer owns, the
    forgetting filter set, a resume asked."""
    from clonemap.shards.server import ShardServer

    async def main():
        server = ShardServer(ServerConfig(port=free_port_base(4)))
        server.bind()
        server.start()
        try:
            server.apply_copied(b"/mine", b"1", None)
            server.apply_copied(b"/moved", b"2", None)
            server.flush()
            server.forgetting = lambda key: key != b"/moved"
            server.snapshots.on_request([b"peer", *chp.icanhaz(
                b"", since=0, generation=server.generation)])
            stream = server.snapshots.pump.active[b"peer"].stream
            assert chp.RESUMED in stream.props and chp.NARROWED not in stream.props
            assert [entry[1] for entry in stream.entries] == [b"/mine"]
        finally:
            server.close()

    asyncio.run(main())


def test_a_reply_sent_outside_the_snapshot_reader_leaves_that_reader_awake(zctx):
    """7. KVREPLYs go out on P's ROUTER from the publish path (a flush, a batch the
    passive confirmed), not from P's reader. libzmq's send processes the socket's pending
    commands, among them a new peer's attach; that takes the edge of the FD the reader
    waits on, and the peer's first message, on a pipe nobody has looked at, raises none:
    its ICANHAZ waited, unanswered, until something else woke the reader (seen across
    hosts: an active silent to a reader for 20 s after a resharding test's writers
    stopped, and a passive's sync restarting after 2 s of silence). Forced: a writer's
    reply made to go out, synchronously, between a new peer's connection reaching the
    server and its ICANHAZ."""
    import select
    import time

    from clonemap.shards.server import ShardServer

    async def main():
        loop = asyncio.get_running_loop()
        port = free_port_base(4)
        server = ShardServer(ServerConfig(port=port))
        server.bind()
        server.start()
        writer, collector, reader = (zctx.socket(kind) for kind in
                                     (zmq.DEALER, zmq.PUB, zmq.DEALER))
        try:
            for sock in (writer, collector, reader):
                sock.linger = 0
            async def answer(sock: zmq.Socket) -> list[bytes]:
                deadline = loop.time() + 5
                while not sock.poll(0):  # the server's loop runs meanwhile
                    assert loop.time() < deadline, "no answer on P"
                    await asyncio.sleep(0.01)
                return sock.recv_multipart()

            writer.routing_id = b"writer"
            writer.connect(f"tcp://127.0.0.1:{port}")
            writer.send_multipart(chp.icanhaz(b""))  # known on P: replies can reach it
            assert (await answer(writer))[0] == chp.KTHXBAI
            collector.connect(f"tcp://127.0.0.1:{port + 2}")
            props = chp.write_props(reply_to=b"writer")
            deadline = loop.time() + 5
            while not writer.poll(0):  # sent again until the collector's SUB has joined
                assert loop.time() < deadline, "the first write was never answered"
                collector.send_multipart(chp.kvset(b"/a", b"1", b"u" * 16, props))
                await asyncio.sleep(0.05)
            assert writer.recv_multipart()[0] == chp.KVREPLY
            while writer.poll(100):  # (the resends' answers: duplicate)
                writer.recv_multipart()

            fd = server.router_socket.getsockopt(zmq.FD)
            reader.connect(f"tcp://127.0.0.1:{port}")
            # the reader's connection reaches the server: its attach is pending (the FD
            # readable), and the loop does not run until the next await
            assert select.select([fd], [], [], 5)[0], "the connection never arrived"
            # a send processes commands at most once per ~1 ms of CPU clock (libzmq's
            # throttle): past it, the reply's send surely does, the attach among them
            time.sleep(0.01)
            server.on_collect(chp.kvset(b"/b", b"2", b"v" * 16, props))
            server.flush()  # its reply goes out here, outside P's reader
            assert writer.poll(5000) and writer.recv_multipart()[0] == chp.KVREPLY
            reader.send_multipart(chp.icanhaz(b""))
            frames = [await answer(reader) for _ in range(3)]
            assert frames[-1][0] == chp.KTHXBAI and {f[0] for f in frames[:2]} == {b"/a", b"/b"}
            assert server.late_reads() == 0  # the kick read it, not a beat's look
        finally:
            for sock in (writer, collector, reader):
                sock.close(0)
            server.close()

    asyncio.run(main())


def test_the_passive_of_a_moves_source_keeps_its_held_writes_to_moving_keys_at_takeover():
    """8. A move's source holds its writes to the moving keys from the hold to the flip,
    and its pair's passive is told to hold too. A write the passive heard from a client
    (its pending table) and the dying active never published is applied by the passive
    when it takes over. For a moving key it was applied, and acknowledged, after the
    target's copy, then forgotten at the flip: an acknowledged write lost (seen across
    hosts, the source's active killed at the seal). It must wait with the hold, as a
    write the new active had heard itself. Forced in process: the passive holds a
    write to a moving key and one to a staying key, the move's hold begins on it as the
    peer, and it takes over."""
    from clonemap.shards import bstar
    from clonemap.shards.common.proto import bstar as wire
    from clonemap.shards.common.routing import ShardMap

    before = ShardMap(2)
    prefix = next(f"/t{i}/" for i in range(100) if before.owner(f"/t{i}/x") == 0)
    staying = next(f"/s{i}" for i in range(100) if before.owner(f"/s{i}") == 0)
    after = ShardMap(2, {1: [prefix]}, epoch=2)
    port, peer = free_port_base(4), free_port_base(4)
    server = pair_server(ServerConfig(port=port, shard_map=before, shard_index=0),
                         role="backup", peer=("127.0.0.1", peer))
    pair = server.role
    loop = asyncio.new_event_loop()
    try:
        server.bind()
        server.loop = loop
        moving_write = chp.kvset(f"{prefix}x".encode(), b"1", b"m" * 16,
                                 chp.write_props(reply_to=b"writer"))
        pair.held.hold(moving_write)
        pair.held.hold(chp.kvset(staying.encode(), b"2", b"s" * 16))
        assert server.begin_hold(after, peer=True) == ""
        pair.on_become_active(bstar.BecameActive(wire.State.PASSIVE, "a test", 2),
                              loop.time())
        assert server.active
        assert server.hold.frames == [moving_write]  # kept, with its reply= term
        assert server.store.get(f"{prefix}x".encode()) is None
        assert server.store.get(staying.encode()) is not None  # applied as before
        assert server.release_hold() == 1  # rolled back: applied here, once
        assert server.store.get(f"{prefix}x".encode()) is not None
    finally:
        server.close()
        loop.close()
