"""A move's copy (``clonemap.shards.migrate.Import``) against a raw pyzmq source: its
deadline is on progress, not on the whole copy. A source that sends its snapshot slower
than the copy's ``timeout_s`` in all, but some of it within every ``timeout_s``, is
copied whole (a copy under idle priority on a busy host is slower than its rate: on a
2-core host 168,768 of 336,160 keys came in 30 s, and the growth failed on the whole
copy's deadline). A source that stops sending fails the copy one ``timeout_s`` after its
last message, and says how far it got."""
from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from clonemap.shards import migrate
from clonemap.shards.common.proto import bstar_ttl, chp
from conftest import free_port_base

TIMEOUT_S = 0.6
"""The copy's deadline without progress, in these tests."""
GAP_S = 0.25
"""Between two snapshot messages of the slow source: well within ``TIMEOUT_S``."""


async def _source(ctx: zmq.asyncio.Context, port: int, keys: int, stop_after: int | None):
    """A source active at ``port`` (P, and its publisher at P+1): HUGZ every 0.1 s, the
    TTL table asked on P, then a snapshot of ``keys`` KVSYNCs under /m/, one every
    ``GAP_S``, and KTHXBAI; with ``stop_after``, silent after that many KVSYNCs."""
    router = ctx.socket(zmq.ROUTER)
    pub = ctx.socket(zmq.PUB)
    router.bind(f"tcp://127.0.0.1:{port}")
    pub.bind(f"tcp://127.0.0.1:{port + 1}")

    async def beat():
        while True:
            await pub.send_multipart(chp.hugz(time.time(), 5, term=1))
            await asyncio.sleep(0.1)

    beating = asyncio.ensure_future(beat())
    asked = []
    try:
        while True:
            peer, *frames = await router.recv_multipart()
            asked.append(frames[0])
            if frames[0] == bstar_ttl.REQUEST:
                await router.send_multipart([peer, *bstar_ttl.encode_chunk(5, [], True)])
            elif frames[0] == chp.ICANHAZ:
                for i in range(keys):
                    if stop_after is not None and i == stop_after:
                        await asyncio.sleep(3600)  # (cancelled at the test's end)
                    await asyncio.sleep(GAP_S)
                    await router.send_multipart([peer, *chp.kvsync(b"/m/%d" % i, b"v", 5)])
                await router.send_multipart([peer, *chp.kthxbai(5, b"/m/")])
    finally:
        beating.cancel()
        router.close(linger=0)
        pub.close(linger=0)


async def _copy(keys: int, stop_after: int | None) -> tuple[migrate.Import, list, float]:
    ctx = zmq.asyncio.Context()
    sync_ctx = zmq.Context()
    port = free_port_base(2)
    source = asyncio.ensure_future(_source(ctx, port, keys, stop_after))
    staged: list[bytes] = []

    def connect(kind, endpoint, options):
        sock = sync_ctx.socket(kind)
        for option, value in options:
            sock.setsockopt(option, value)
        sock.connect(endpoint)
        return sock

    loop = asyncio.get_running_loop()
    imp = migrate.Import(connect, loop, f"tcp://127.0.0.1:{port}", b"/m/",
                         chp.DEFAULT_LIMITS, stage=lambda k, v, e: staged.append(k),
                         flush=lambda: None, timeout_s=TIMEOUT_S)
    began = time.monotonic()
    imp.start()
    try:
        while not imp.copied and not imp.error and time.monotonic() - began < 30:
            await asyncio.sleep(0.02)
        return imp, staged, time.monotonic() - began
    finally:
        imp.close()
        source.cancel()
        await asyncio.gather(source, return_exceptions=True)
        ctx.term()
        sync_ctx.term()


def test_a_copy_slower_than_its_deadline_in_all_but_never_stalled_completes():
    keys = 8  # (8 x 0.25 s: past the 0.6 s deadline three times over)
    imp, staged, took = asyncio.run(_copy(keys, None))
    assert imp.error == "" and imp.copied, imp.error
    assert staged == [b"/m/%d" % i for i in range(keys)]
    assert took > 3 * TIMEOUT_S  # (the old deadline, on the whole copy, failed it)


def test_a_source_that_stops_sending_fails_the_copy_a_deadline_after_its_last_word():
    imp, staged, took = asyncio.run(_copy(8, stop_after=3))
    assert not imp.copied and staged == [b"/m/0", b"/m/1", b"/m/2"]
    assert imp.error.startswith(f"no progress of the copy in {TIMEOUT_S:g} s"), imp.error
    assert "3 keys" in imp.error and "snapshot asked" in imp.error, imp.error
    # (the last KVSYNC came ~3 x GAP_S in: failed within two deadlines after it)
    assert 3 * GAP_S + TIMEOUT_S <= took <= 3 * GAP_S + 2 * TIMEOUT_S + 1.0, took
