"""shards.common.zio over real sockets: whole messages, capped batches, timers not starved.
Every test runs on each frame path (``frame_path``: pure, and compiled where built)."""
import asyncio
import itertools

import pytest
import zmq

from conftest import free_port_base
from clonemap.shards.common import zio


@pytest.fixture(autouse=True)
def _each_path(frame_path):
    return frame_path


_INPROC = itertools.count()
"""Unique inproc endpoint names within this process."""


def run(coro):
    with asyncio.Runner() as runner:
        return runner.run(coro)


def pair(zctx, kind_a=zmq.PUSH, kind_b=zmq.PULL):
    b = zctx.socket(kind_b)
    port = free_port_base(1)  # below the ephemeral range
    b.bind(f"tcp://127.0.0.1:{port}")
    a = zctx.socket(kind_a)
    a.connect(f"tcp://127.0.0.1:{port}")
    return a, b


def test_recv_frames_keeps_messages_apart(zctx):
    a, b = pair(zctx)
    zio.send_frames(a, [b"one"], 0)
    zio.send_frames(a, [b"a", b"b", b"c"], 0)
    assert b.poll(5000)
    assert zio.recv_frames(b, 0) == [b"one"]
    assert zio.recv_frames(b, 0) == [b"a", b"b", b"c"]


def test_recv_frames_caps_huge_frame_counts(zctx):
    a, b = pair(zctx)
    zio.send_frames(a, [b"x"] * (zio.MAX_FRAMES + 50), 0)
    zio.send_frames(a, [b"next"], 0)
    assert b.poll(5000)
    assert len(zio.recv_frames(b, 0)) == zio.MAX_FRAMES + 1
    assert zio.recv_frames(b, 0) == [b"next"]


def test_async_socket_drains_in_batches_without_starving_timers(zctx):
    a, b = pair(zctx)
    a.sndhwm = 0
    b.rcvhwm = 0
    total = 5000

    async def main():
        loop = asyncio.get_running_loop()
        got = []
        done = loop.create_future()
        ticks = []

        def on_message(frames):
            got.append(frames)
            if len(got) == total:
                done.set_result(None)

        for i in range(total):
            zio.send_frames5(a, b"k%d" % i, b"\0" * 8, b"", b"", b"v", 0)
        reader = zio.AsyncSocket(b, on_message, batch=100)
        loop.call_soon(lambda: ticks.append(len(got)))
        await asyncio.wait_for(done, 20)
        reader.close()
        return got, ticks

    got, ticks = run(main())
    assert [f[0] for f in got] == [b"k%d" % i for i in range(total)]
    # the timer callback ran before the 5000 messages were all handled: batches yield
    assert ticks and ticks[0] < total


def test_handler_errors_are_counted_not_fatal(zctx):
    a, b = pair(zctx)

    async def main():
        loop = asyncio.get_running_loop()
        seen = []
        done = loop.create_future()

        def on_message(frames):
            if frames == [b"boom"]:
                raise RuntimeError("handler bug")
            seen.append(frames)
            done.set_result(None)

        reader = zio.AsyncSocket(b, on_message)
        zio.send_frames(a, [b"boom"], 0)
        zio.send_frames(a, [b"ok"], 0)
        await asyncio.wait_for(done, 10)
        reader.close()
        return seen, reader.errors

    seen, errors = run(main())
    assert seen == [[b"ok"]]
    assert errors == 1


def test_wait_writable_times_out_with_clonemap_timeout(zctx):
    from clonemap.shards.common.errors import Timeout

    dealer = zctx.socket(zmq.DEALER)  # never connected: never writable

    async def main():
        sock = zio.AsyncSocket(dealer, None)
        try:
            with pytest.raises(TimeoutError) as info:
                await sock.wait_writable(0.2)
            assert isinstance(info.value, Timeout)
        finally:
            sock.close()

    run(main())


def test_after_batch_runs_once_per_batch_that_read_something(zctx):
    a, b = pair(zctx)
    a.sndhwm = b.rcvhwm = 0

    async def main():
        loop = asyncio.get_running_loop()
        got, calls, done = [], [], loop.create_future()

        def on_message(frames):
            got.append(frames)

        def after():
            calls.append(len(got))
            if len(got) == 250 and not done.done():
                done.set_result(None)

        for i in range(250):
            zio.send_frames(a, [b"m%d" % i], 0)
        assert b.poll(5000)
        reader = zio.AsyncSocket(b, on_message, batch=100, after_batch=after)
        await asyncio.wait_for(done, 10)
        reader.close()
        return calls

    calls = run(main())
    # each call follows a batch that read at least one message, and sees it whole
    assert calls == sorted(set(calls)) and calls[-1] == 250 and calls[0] > 0
    assert all(b - a <= 100 for a, b in zip([0] + calls, calls))


def test_a_recv_only_reader_wakes_for_every_message_after_draining(zctx):
    """``recv_only`` skips the EVENTS query after a batch read until Again: the FD must
    still fire for a message that arrives afterwards. Each message is sent only once the
    one before it was handled (the reader idle, its socket drained), 300 times, with no
    kick and no timer to rescue a missed wake-up."""
    a, b = pair(zctx)

    async def main():
        loop = asyncio.get_running_loop()
        got: list = []
        arrived = asyncio.Event()

        def on_message(frames):
            got.append(frames)
            arrived.set()

        reader = zio.AsyncSocket(b, on_message, batch=64, recv_only=True)
        try:
            for i in range(300):
                arrived.clear()
                await loop.run_in_executor(None, zio.send_frames, a, [b"m%d" % i], 0)
                await asyncio.wait_for(arrived.wait(), 5)
                assert got[-1] == [b"m%d" % i]
            for i in range(1000):  # and bursts larger than a batch are all read
                zio.send_frames(a, [b"n%d" % i], 0)
            while len(got) < 1300:
                arrived.clear()
                await asyncio.wait_for(arrived.wait(), 5)
        finally:
            reader.close()
        return got

    got = run(main())
    assert len(got) == 1300 and got[-1] == [b"n999"]


def test_a_look_again_reads_a_message_whose_edge_a_send_took(zctx):
    """A send on a ROUTER outside its reader processes the socket's pending commands: a
    new peer's attach among them, that peer's first message then raises no edge on the
    FD (its pipe was never found empty, so libzmq does not say it has one). ``look_again``
    (each server beat) finds it waiting, reads it and counts the late read; with
    nothing waiting it does nothing. Forced in order over inproc (the attach is queued
    by ``connect`` itself, the message written by ``send``), the loop not running in
    between: the attach pending, a send to another peer, the new peer's message."""
    import select
    import time

    endpoint = f"inproc://look-again-{next(_INPROC)}"
    router = zctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    known, late = zctx.socket(zmq.DEALER), zctx.socket(zmq.DEALER)
    known.linger = late.linger = 0
    known.connect(endpoint)

    async def main():
        got: list = []
        reader = zio.AsyncSocket(router, got.append, name="router")
        try:
            known.send(b"hello")
            while not got:
                await asyncio.sleep(0.01)
            assert reader.look_again() is False and reader.late_reads == 0
            # no await from here: the loop (and the reader) do not run meanwhile
            late.connect(endpoint)
            assert select.select([router.FD], [], [], 0)[0], "the attach is not pending"
            # a send processes commands at most once per ~1 ms of CPU clock (libzmq's
            # throttle): past it, this one surely does, the attach among them
            time.sleep(0.01)
            zio.send_frames(router, [got[0][0], b"reply"], 0)
            late.send(b"first")
            assert not select.select([router.FD], [], [], 0)[0], "the FD announced it"
            assert reader.look_again() is True and reader.late_reads == 1
            while len(got) < 2:
                await asyncio.sleep(0.01)
            assert got[1][1:] == [b"first"] and reader.look_again() is False
            assert known.poll(5000) and known.recv() == b"reply"
        finally:
            reader.close()
            known.close(0)
            late.close(0)

    run(main())

