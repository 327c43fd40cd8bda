"""client.writes.ShardWrites alone, over real sockets: two raw collectors (SUBs bound on
P+2, as a pair's servers have) and no agent, only the three questions a ShardWrites asks
(which server the shard follows, the map's sequence, the outage epoch)."""
from __future__ import annotations

import asyncio
import logging

import zmq

from conftest import free_port_base
from clonemap.client.collector import parse_server
from clonemap.client.writes import ShardWrites
from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.proto import chp
from clonemap.shards.common.security import Security


def collectors(zctx) -> tuple[list, list]:
    """Two bound collector SUBs (subscribed to everything) and the pair's addresses."""
    socks, servers = [], []
    for _ in range(2):
        port = free_port_base(3)
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(f"tcp://127.0.0.1:{port + 2}")
        socks.append(sub)
        servers.append(parse_server(f"tcp://127.0.0.1:{port}"))
    return socks, servers


class Shard:
    """The agent's side of the questions: plain values the test sets."""

    def __init__(self):
        self.current, self.last_seq, self.epoch = 0, 0, 1


def writes_for(zctx, servers, shard: Shard, relays: bool = False) -> ShardWrites:
    return ShardWrites(zctx, servers, name="t", relays=relays, drops=DropCounter(logging.getLogger("test")),
                       queue_max=100, affinity=0, security=Security.off(),
                       current=lambda: shard.current, last_seq=lambda: shard.last_seq,
                       epoch=lambda: shard.epoch)


async def subscribed(writes: ShardWrites, socks: list) -> None:
    """Until both collectors' subscriptions reached the ShardWrites: a bound SUB attaches
    a new peer (and sends it its subscription) only when its owner calls into it, as a
    server's reader does on every turn."""
    for _ in range(500):
        for sock in socks:
            sock.getsockopt(zmq.EVENTS)
        if all(c.ready for c in writes.collectors):
            assert writes.connected.is_set()
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the collectors never subscribed")


def test_a_kvset_goes_to_both_servers_or_only_through_the_followed_relay(zctx):
    socks, servers = collectors(zctx)

    async def main():
        for relays, want in ((False, (True, True)), (True, (False, True))):
            shard = Shard()
            shard.current = 1
            writes = writes_for(zctx, servers, shard, relays)
            writes.start(asyncio.get_running_loop())
            await subscribed(writes, socks)
            frames = chp.kvset(b"/w/%d" % relays, b"v")
            writes.send_kvset(frames)
            for sock, expected in zip(socks, want):
                got = sock.poll(1000 if expected else 300)
                assert bool(got) == expected, (relays, want)
                if got:
                    assert sock.recv_multipart() == frames
            writes.close(0)

    with asyncio.Runner() as runner:
        runner.run(main())


def test_an_installed_map_confirms_what_it_holds_and_resends_the_rest_unless_closed(zctx):
    """``installed``: a write whose value the map holds is confirmed, another waits; after
    an outage to a server that decides writes (``cas``) the waiting ones go again with a
    reply asked, once the replies DEALER connects or after ``REPLY_CONNECT_S`` (no server
    answers here), unless the shard closed meanwhile (``epoch()`` None)."""
    socks, servers = collectors(zctx)

    async def main():
        for closed in (True, False):
            shard = Shard()
            writes = writes_for(zctx, servers, shard)
            writes.start(asyncio.get_running_loop())
            frames = chp.kvset(b"/j", b"v2", uuid=b"w" * 16)
            held = writes.expect(b"u" * 16, b"/k", b"v1")
            waiting = writes.expect(b"w" * 16, b"/j", b"v2", frames)
            writes.installed(False, False, {b"/k": b"v1", b"/j": b"old"}, 7)
            assert held.done() and not waiting.done()  # /j holds another value
            if closed:
                shard.epoch = None
            tasks = asyncio.all_tasks()
            writes.installed(True, True, {b"/j": b"old"}, 8)
            if closed:  # nothing scheduled to go later, nothing sent now
                assert asyncio.all_tasks() == tasks
                assert not socks[0].poll(0) and not socks[1].poll(0)
            else:
                got = await asyncio.get_running_loop().run_in_executor(
                    None, socks[0].poll, 10_000)
                assert got, "the waiting write was not sent again"
                again = socks[0].recv_multipart()
                assert again[0] == b"/j" and again[2] == b"w" * 16
                assert b"reply=" in again[3]
            writes.close(0)

    with asyncio.Runner() as runner:
        runner.run(main())


def test_a_resend_the_shard_outran_goes_with_the_next_install_whatever_made_it(zctx):
    """An outage's install schedules the resend of a write waiting for its answer; before
    it goes (the replies DEALER waits to connect), the shard asks its server again (a
    gap, a new generation: its epoch moves on) and the scheduled resend is dropped. The
    next install is no outage's, and sends the write all the same. (It sent nothing
    before: a conditional write across a kill waited out its timeout under load, its
    outcome unknown.)"""
    socks, servers = collectors(zctx)

    async def main():
        shard = Shard()
        writes = writes_for(zctx, servers, shard)
        writes.start(asyncio.get_running_loop())
        await subscribed(writes, socks)
        frames = chp.kvset(b"/c", b"v", uuid=b"c" * 16)
        frames[3] += writes.reply_props()
        answer = writes.conditional(frames)
        assert socks[0].poll(5000)
        assert socks[0].recv_multipart()[2] == b"c" * 16  # the first send
        before = asyncio.all_tasks()
        writes.installed(True, True, {}, 5)  # after an outage: scheduled
        (scheduled,) = asyncio.all_tasks() - before
        shard.epoch += 1  # asked again before it went
        loop = asyncio.get_running_loop()
        await scheduled  # (no server answers: its wait for the DEALER runs out)
        assert not socks[0].poll(0), "sent in a request that is gone"
        assert writes.resend_owed
        writes.installed(False, True, {}, 6)  # a gap's install: no outage
        got = await loop.run_in_executor(None, socks[0].poll, 10_000)
        assert got, "the owed resend never went"
        again = socks[0].recv_multipart()
        assert again[2] == b"c" * 16 and b"reply=" in again[3]
        assert not writes.resend_owed and not answer.done()
        answer.cancel()
        writes.close(0)

    with asyncio.Runner() as runner:
        runner.run(main())
