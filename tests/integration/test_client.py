"""The client against raw pyzmq sockets playing a CHP server, frame by frame.

``FakeServer`` binds what a shard server binds (ROUTER P, publisher P+1, SUB collector
P+2). Its publisher is an XPUB, so a test can wait for the client's subscription (an
event) before publishing, and check what was subscribed. Its methods block with
deadlines; asyncio tests call the blocking ones through ``asyncio.to_thread``. The
collector SUB is owned by a pump thread that keeps it serviced, as a server's reactor
does (a SUB that nobody polls never sends its subscription to a peer that connects).
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import msgpack
import pytest
import zmq

from helpers import run_async as run
from clonemap.shards.common.errors import SlowConsumer, Timeout
from clonemap.shards.common.proto import chp
from clonemap.client.api import AsyncClone, Clone
from clonemap.client.watch import DELETE, PUT, SYNCED

DEADLINE_S = 5.0



class FakeServer:
    def __init__(self, ctx: zmq.Context, base: int, bind_publisher: bool = True):
        self.base = base
        self.address = f"tcp://127.0.0.1:{base}"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.bind(f"tcp://127.0.0.1:{base}")
        self.xpub = ctx.socket(zmq.XPUB)
        self.xpub.linger = 0
        self.xpub.sndhwm = 0
        self.xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if bind_publisher:
            self.bind_publisher()
        self.kvsets: "queue.Queue[list[bytes]]" = queue.Queue()
        self._stop = threading.Event()
        collector = ctx.socket(zmq.SUB)
        collector.linger = 0
        collector.subscribe(b"")
        collector.bind(f"tcp://127.0.0.1:{base + 2}")
        self._pump = threading.Thread(target=self._collect, args=(collector,), daemon=True)
        self._pump.start()
        self.subscriptions: list[bytes] = []

    def _collect(self, collector: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if collector.poll(20):
                    self.kvsets.put(collector.recv_multipart())
        finally:
            collector.close(0)

    def bind_publisher(self) -> None:
        self.xpub.bind(f"tcp://127.0.0.1:{self.base + 1}")

    @staticmethod
    def _recv(sock: zmq.Socket, timeout_s: float, what: str) -> list[bytes]:
        if not sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no {what} within {timeout_s} s")
        return sock.recv_multipart()

    def wait_subscribed(self, timeout_s: float = DEADLINE_S) -> list[bytes]:
        """Until the client's SUB subscribed; returns every subscription seen so far."""
        while not any(s[:1] == b"\x01" for s in self.subscriptions) or self.xpub.poll(0):
            self.subscriptions.append(self._recv(self.xpub, timeout_s, "subscription")[0])
        return self.subscriptions

    def icanhaz(self, timeout_s: float = DEADLINE_S) -> tuple[bytes, list[bytes]]:
        frames = self._recv(self.router, timeout_s, "ICANHAZ")
        return frames[0], frames[1:]

    def snapshot(self, identity: bytes, items: dict[bytes, bytes], seq: int,
                 subtree: bytes = b"") -> None:
        for key, value in items.items():
            self.router.send_multipart([identity, *chp.kvsync(key, value, 0)])
        self.router.send_multipart([identity, *chp.kthxbai(seq, subtree)])

    def serve_snapshot(self, items: dict[bytes, bytes], seq: int, subtree: bytes = b"",
                       timeout_s: float = DEADLINE_S) -> list[bytes]:
        """Answer one ICANHAZ (after the subscription is live); returns its frames."""
        self.wait_subscribed(timeout_s)
        identity, request = self.icanhaz(timeout_s)
        self.snapshot(identity, items, seq, subtree)
        return request

    def publish(self, key: bytes, seq: int, value: bytes, uuid: bytes = b"",
                props: bytes = b"") -> None:
        self.xpub.send_multipart(chp.kvpub(key, seq, value, uuid, props))

    def kvset(self, timeout_s: float = DEADLINE_S) -> list[bytes]:
        try:
            return self.kvsets.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no KVSET within {timeout_s} s") from None

    def close(self) -> None:
        self._stop.set()
        self._pump.join(5)
        for sock in (self.router, self.xpub):
            sock.close(0)


@pytest.fixture
def fake(zctx, port_base):
    server = FakeServer(zctx, port_base)
    try:
        yield server
    finally:
        server.close()


async def started(fake: FakeServer, clone: AsyncClone, items: dict[bytes, bytes],
                  seq: int, subtree: bytes = b"") -> list[bytes]:
    """Start ``clone`` while the fake answers its ICANHAZ; returns the request frames."""
    serve = asyncio.create_task(asyncio.to_thread(fake.serve_snapshot, items, seq, subtree))
    await clone.start()
    return await serve


async def next_change(watch, timeout_s: float = DEADLINE_S):
    return await asyncio.wait_for(watch.__anext__(), timeout_s)


async def changes_until(watch, pred, timeout_s: float = DEADLINE_S) -> list:
    """Changes from ``watch`` up to and including the first for which ``pred`` holds."""
    got = []
    while True:
        change = await next_change(watch, timeout_s)
        got.append(change)
        if pred(change):
            return got


# ----------------------------------------------------------------------------- sync

def test_icanhaz_follows_a_live_subscription_and_names_the_subtree(zctx, port_base):
    fake = FakeServer(zctx, port_base, bind_publisher=False)
    try:
        async def main():
            clone = AsyncClone(fake.address, subtree="/orders/", context=zctx)
            starting = asyncio.create_task(clone.start())
            # the publisher is unreachable: the client must not ask for a snapshot yet
            with pytest.raises(AssertionError, match="no ICANHAZ"):
                await asyncio.to_thread(fake.icanhaz, 0.5)
            fake.bind_publisher()
            subs = await asyncio.to_thread(fake.wait_subscribed)
            identity, request = await asyncio.to_thread(fake.icanhaz)
            assert request == [b"ICANHAZ?", b"/orders/"]
            fake.snapshot(identity, {b"/orders/1": b"one"}, 7, b"/orders/")
            await starting
            assert clone.get("/orders/1") == b"one"
            await clone.close()
            return subs

        subs = run(main())
        assert b"\x01/orders/" in subs and b"\x01HUGZ" in subs
    finally:
        fake.close()


def test_snapshot_is_applied_and_kthxbai_sequence_becomes_the_last_applied(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        request = await started(fake, clone, {b"a": b"1", b"b/c": b"2", b"d": b"x" * 1000}, 42)
        assert request == [b"ICANHAZ?", b""]
        assert clone.synced
        assert clone.get("a") == b"1" and clone.get("b/c") == b"2"
        assert clone.get("d") == b"x" * 1000 and clone.get("nope", 5) == 5
        assert len(clone) == 3 and "a" in clone and "zz" not in clone
        assert sorted(clone.keys()) == ["a", "b/c", "d"]
        assert sorted(clone.items("b/")) == [("b/c", b"2")]
        assert clone.version_vector == {"s0": 42}
        await clone.close()

    run(main())


def test_start_times_out_with_a_clear_error_when_nobody_answers(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx, timeout_s=0.5)
        with pytest.raises(Timeout, match="not ready within 0.5 s.*SYNCING") as info:
            await clone.start()
        assert isinstance(info.value, TimeoutError)
        await clone.close()

    run(main())


def test_updates_buffered_during_sync_apply_in_order_after_kthxbai(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        w = clone.watch("")
        w.open()
        starting = asyncio.create_task(clone.start())
        await asyncio.to_thread(fake.wait_subscribed)
        identity, _ = await asyncio.to_thread(fake.icanhaz)
        # published while the snapshot is being prepared: 9 and 10 are in the snapshot
        fake.publish(b"k", 9, b"old-9")
        fake.publish(b"k", 10, b"snap")
        fake.publish(b"k", 11, b"v11")
        fake.publish(b"j", 12, b"v12")
        fake.publish(b"k", 13, b"v13")
        # the snapshot arrives after the updates were published (the client buffers them)
        fake.snapshot(identity, {b"k": b"snap", b"j": b"j0"}, 10)
        await starting
        got = await changes_until(w, lambda c: c.seq == 13)
        await clone.close()
        return clone, got

    clone, got = run(main())
    assert clone._agents[0].last_seq == 13
    snapshot = [c for c in got if c.kind == PUT and c.seq == 10]
    assert sorted((c.key, c.value) for c in snapshot) == [("j", b"j0"), ("k", b"snap")]
    assert [c.kind for c in got].index(SYNCED) == 2
    live = [(c.key, c.value, c.seq) for c in got[3:]]
    assert live == [("k", b"v11", 11), ("j", b"v12", 12), ("k", b"v13", 13)]
    assert clone._agents[0].skipped == 2  # 9 and 10: not greater than KTHXBAI's 10


def test_kvpub_not_greater_than_last_is_discarded_and_a_backwards_stream_resyncs(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        await started(fake, clone, {b"a": b"0"}, 5)
        w = clone.watch("")
        w.open()
        await changes_until(w, lambda c: c.kind == SYNCED)
        fake.publish(b"a", 6, b"six")
        assert (await next_change(w)).value == b"six"
        fake.publish(b"a", 6, b"dup")       # equal: discarded
        # a stream going backwards means a restarted server: the client asks again
        identity, request = await asyncio.to_thread(fake.icanhaz)
        assert request == [b"ICANHAZ?", b""]
        assert clone.get("a") == b"six"
        fake.publish(b"a", 4, b"old")       # lower than the last applied 6: buffered...
        fake.snapshot(identity, {b"a": b"fresh"}, 4)   # ...and not greater than KTHXBAI's
        changes = [await next_change(w), await next_change(w)]
        fake.publish(b"a", 5, b"five")
        changes.append(await next_change(w))
        stats = clone.stats()["shards"][0]
        await clone.close()
        return clone, changes, stats

    clone, changes, stats = run(main())
    # the server's sequence went backwards (6 -> 4): its map is not the one this client
    # had, a data loss: one reset marker, then the new map, then the live stream
    reset = changes[0]
    assert (reset.kind, reset.key, reset.seq, reset.shard) == ("reset", "", 4, "s0")
    assert (reset.value.old_seq, reset.value.new_seq, reset.value.keys_lost) == (6, 4, 0)
    assert [(c.kind, c.key, c.value, c.seq) for c in changes[1:]] == [
        (PUT, "a", b"fresh", 4), (PUT, "a", b"five", 5)]
    assert stats["stale"] == 1 and stats["skipped"] == 1 and stats["resets"] == 1
    assert stats["last_seq"] == 5 and stats["snapshots"] == 2


def test_gap_on_unfiltered_subscription_resyncs_and_replaces_the_map(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        await started(fake, clone, {b"keep": b"1", b"ghost": b"2", b"change": b"3"}, 100)
        w = clone.watch("")
        w.open()
        await changes_until(w, lambda c: c.kind == SYNCED)
        fake.publish(b"new", 101, b"n")
        assert (await next_change(w)).key == "new"
        fake.publish(b"lost", 103, b"x")  # 102 never arrived: a gap
        identity, _ = await asyncio.to_thread(fake.icanhaz)
        assert clone.get("lost") is None
        fake.snapshot(identity, {b"keep": b"1", b"change": b"33", b"new": b"n",
                                 b"lost": b"x"}, 103)
        got = [await next_change(w) for _ in range(3)]
        stats = clone.stats()["shards"][0]
        keys = sorted(clone.keys())
        await clone.close()
        return got, stats, keys

    got, stats, keys = run(main())
    assert stats["gaps"] == 1 and stats["snapshots"] == 2 and stats["last_seq"] == 103
    assert keys == ["change", "keep", "lost", "new"]  # "ghost" is gone
    assert sorted((c.kind, c.key, c.value) for c in got) == [
        (DELETE, "ghost", None), (PUT, "change", b"33"), (PUT, "lost", b"x")]


def test_a_clock_hugz_ahead_of_the_last_update_is_a_gap_when_unfiltered(fake, zctx):
    """The lost updates were the last ones published: no later KVPUB shows the gap, but
    the clock HUGZ's sequence does (it follows them on the same ordered stream)."""
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        await started(fake, clone, {b"a": b"1"}, 7)
        w = clone.watch("")
        w.open()
        await changes_until(w, lambda c: c.kind == SYNCED)
        fake.xpub.send_multipart(chp.hugz(time.time(), 7))   # in step: nothing happens
        fake.publish(b"b", 8, b"2")
        assert (await next_change(w)).key == "b"
        fake.xpub.send_multipart(chp.hugz(time.time(), 10))  # 9 and 10 never arrived
        identity, _ = await asyncio.to_thread(fake.icanhaz)
        fake.snapshot(identity, {b"a": b"1", b"b": b"2", b"c": b"3"}, 10)
        assert (await next_change(w)).key == "c"
        stats = clone.stats()["shards"][0]
        await clone.close()
        return stats

    stats = run(main())
    assert stats["gaps"] == 1 and stats["snapshots"] == 2 and stats["last_seq"] == 10


def test_subtree_client_accepts_sequence_jumps_and_drops_foreign_keys(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, subtree="/a/", context=zctx)
        await started(fake, clone, {b"/a/1": b"x"}, 10, b"/a/")
        w = clone.watch("/a/")
        w.open()
        await changes_until(w, lambda c: c.kind == SYNCED)
        fake.publish(b"/a/2", 15, b"y")          # 11..14 were other subtrees: normal
        fake.publish(b"HUGZY", 16, b"z")         # reaches us through the HUGZ prefix
        fake.publish(b"/a/3", 20, b"w")
        got = await changes_until(w, lambda c: c.seq == 20)
        stats = clone.stats()["shards"][0]
        await clone.close()
        return got, stats

    got, stats = run(main())
    assert [(c.key, c.seq) for c in got] == [("/a/2", 15), ("/a/3", 20)]
    assert stats["gaps"] == 0 and stats["snapshots"] == 1
    assert stats["drops"] == {"outside_subtree": 1}


def test_malformed_updates_are_counted_and_dropped(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        await started(fake, clone, {}, 0)
        w = clone.watch("")
        w.open()
        await changes_until(w, lambda c: c.kind == SYNCED)
        fake.xpub.send_multipart([b"k", b"\x00" * 7, b"", b"", b"v"])         # short sequence
        fake.xpub.send_multipart([b"k", chp.pack_seq(1), b"u" * 15, b"", b"v"])  # 15-byte UUID
        fake.xpub.send_multipart([b"k", chp.pack_seq(1)])                    # 2 frames
        fake.xpub.send_multipart([b"\xff\xfe", chp.pack_seq(1), b"", b"", b"v"])  # not UTF-8
        fake.publish(b"k", 1, b"good")
        change = await next_change(w)
        stats = clone.stats()["shards"][0]
        await clone.close()
        return change, stats

    change, stats = run(main())
    assert (change.key, change.value, change.seq) == ("k", b"good", 1)
    assert stats["drops"] == {"bad_sequence": 1, "bad_uuid": 1, "frame_count": 1,
                              "bad_key": 1}
    assert stats["gaps"] == 0


def test_sync_buffer_overflow_requests_a_new_snapshot(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx, sync_buffer_max=6)
        starting = asyncio.create_task(clone.start())
        await asyncio.to_thread(fake.wait_subscribed)
        first, _ = await asyncio.to_thread(fake.icanhaz)
        for seq in range(1, 11):
            fake.publish(b"k", seq, b"v%d" % seq)
        # 1..6 filled the buffer, 7 overflowed it (8..10 are buffered again): a new request comes from a fresh DEALER
        second, request = await asyncio.to_thread(fake.icanhaz)
        assert request == [b"ICANHAZ?", b""] and second != first
        fake.snapshot(first, {b"k": b"stale"}, 1)  # the abandoned request: never applied
        fake.snapshot(second, {b"k": b"v10"}, 10)
        await starting
        value, stats = clone.get("k"), clone.stats()["shards"][0]
        await clone.close()
        return value, stats

    value, stats = run(main())
    assert value == b"v10"
    assert stats["overflows"] == 1 and stats["last_seq"] == 10 and stats["snapshots"] == 1


# ----------------------------------------------------------------------------- writes

def test_set_and_delete_send_kvsets_with_fresh_uuids_and_ttl(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, subtree="/s/", context=zctx)
        await started(fake, clone, {}, 0, b"/s/")
        u1 = await clone.set("/s/a", b"value", ttl=5)
        u2 = await clone.set("/s/b", b"v2", ttl=0.25)
        u3 = await clone.delete("/s/a")
        frames = [await asyncio.to_thread(fake.kvset) for _ in range(3)]
        with pytest.raises(ValueError, match="outside this client's subtree"):
            await clone.set("/other/a", b"x")
        with pytest.raises(ValueError, match="empty value means delete"):
            await clone.set("/s/a", b"")
        with pytest.raises(TypeError):
            await clone.set("/s/a", "text is not bytes")
        with pytest.raises(ValueError):
            await clone.set("/s/a", b"x", ttl=-1)
        await clone.close()
        return (u1, u2, u3), frames

    (u1, u2, u3), frames = run(main())
    assert len({u1, u2, u3}) == 3 and all(len(u) == 16 for u in (u1, u2, u3))
    assert frames[0] == [b"/s/a", b"\x00" * 8, u1, b"ttl=5\n", b"value"]
    assert frames[1] == [b"/s/b", b"\x00" * 8, u2, b"ttl=0.25\n", b"v2"]
    assert frames[2] == [b"/s/a", b"\x00" * 8, u3, b"", b""]
    for f in frames:
        chp.decode_kvset(f)  # valid 12/CHP


def test_msgpack_codec_round_trips_python_values(fake, zctx):
    value = {"name": "ada", "tags": ["x", 1, 2.5, None, True], "raw": b"\x00\xff"}

    async def main():
        clone = AsyncClone(fake.address, context=zctx, codec="msgpack")
        await started(fake, clone, {b"pre": msgpack.packb([1, 2])}, 1)
        w = clone.watch("")
        w.open()
        await changes_until(w, lambda c: c.kind == SYNCED)
        uuid = await clone.set("doc", value)
        frames = await asyncio.to_thread(fake.kvset)
        kv = chp.decode_kvset(frames)
        fake.publish(kv.key, 2, kv.value, kv.uuid, kv.props)  # the server's echo
        change = await next_change(w)
        got, pre = clone.get("doc"), clone.get("pre")
        await clone.close()
        return uuid, kv, change, got, pre

    uuid, kv, change, got, pre = run(main())
    assert kv.uuid == uuid and msgpack.unpackb(kv.value) == value
    assert got == value and change.value == value and pre == [1, 2]


# ----------------------------------------------------------------------------- watches

def test_watch_opened_before_start_gets_snapshot_then_synced_then_live(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        async with clone.watch("/o/") as w:
            assert not w.synced
            await started(fake, clone, {b"/o/1": b"a", b"/o/2": b"b", b"/x": b"c"}, 3)
            first = [await next_change(w) for _ in range(3)]
            assert w.synced
            fake.publish(b"/x", 4, b"ignored")
            fake.publish(b"/o/1", 5, b"")
            live = await next_change(w)
        after = [c async for c in w]  # closed: the iterator ends
        await clone.close()
        return first, live, after

    first, live, after = run(main())
    assert sorted((c.kind, c.key, c.value) for c in first[:2]) == [
        (PUT, "/o/1", b"a"), (PUT, "/o/2", b"b")]
    assert first[2].kind == SYNCED and first[2].key == "/o/" and first[2].seq == 3
    assert (live.kind, live.key, live.value, live.seq) == (DELETE, "/o/1", None, 5)
    assert after == []


def test_slow_watch_raises_slow_consumer_with_counts(fake, zctx):
    async def main():
        clone = AsyncClone(fake.address, context=zctx)
        await started(fake, clone, {b"a": b"0"}, 0)
        slow = clone.watch("", capacity=5)
        fast = clone.watch("")
        slow.open()
        fast.open()
        await changes_until(fast, lambda c: c.kind == SYNCED)
        for seq in range(1, 21):
            fake.publish(b"k%d" % seq, seq, b"v")
        await changes_until(fast, lambda c: c.seq == 20)
        got = []
        with pytest.raises(SlowConsumer) as info:
            async for change in slow:
                got.append(change)
        stats = clone.stats()
        await clone.close()
        return got, info.value, stats

    got, exc, stats = run(main())
    # queued: the snapshot chunk (1 key), the marker, 3 updates; the 4th overflows
    assert got == []  # a failed watch raises at once rather than serving a broken prefix
    assert exc.dropped == 1 + 1 + 3 + 1 and exc.delivered == 0
    assert "queue of 5 entries was full" in str(exc)
    assert stats["watches"] == 1  # the failed watch was removed; the fast one remains


# ----------------------------------------------------------------------------- threads

def test_sync_clone_works_from_plain_threads(fake):
    server = threading.Thread(target=fake.serve_snapshot, args=({b"/t/a": b"1"}, 1, b"/t/"))
    server.start()
    clone = Clone(fake.address, subtree="/t/", timeout_s=DEADLINE_S)
    try:
        server.join(DEADLINE_S)
        assert clone.get("/t/a") == b"1" and len(clone) == 1
        seen: list = []
        done = threading.Event()

        def on_change(change):
            seen.append(change)
            if change.seq == 4:
                done.set()

        watch = clone.watch("/t/", on_change)
        uuids = []
        errors = []

        def writer(n):
            try:
                uuids.append(clone.set(f"/t/w{n}", b"x%d" % n, ttl=1))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        writers = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
        for t in writers:
            t.start()
        for t in writers:
            t.join(DEADLINE_S)
        sets = [chp.decode_kvset(fake.kvset()) for _ in range(3)]
        for seq, kv in enumerate(sorted(sets), start=2):
            fake.publish(kv.key, seq, kv.value, kv.uuid, kv.props)
        assert done.wait(DEADLINE_S)
        items = dict(clone.items())
        watch.close()
        assert not errors
        assert sorted(kv.uuid for kv in sets) == sorted(uuids)
        assert {kv.props for kv in sets} == {b"ttl=1\n"}
        assert items == {"/t/a": b"1", "/t/w0": b"x0", "/t/w1": b"x1", "/t/w2": b"x2"}
        assert [c.kind for c in seen[:2]] == [PUT, SYNCED]
        assert [(c.key, c.seq) for c in seen[2:]] == [("/t/w0", 2), ("/t/w1", 3), ("/t/w2", 4)]
        with pytest.raises(ValueError):
            clone.set("/elsewhere", b"x")
    finally:
        clone.close()
    assert not clone._thread.is_alive()


def test_sync_clone_start_deadline(fake):
    with pytest.raises(Timeout, match="not ready within"):
        Clone(fake.address, timeout_s=0.5)


def test_sync_watch_iterator_raises_slow_consumer(fake):
    server = threading.Thread(target=fake.serve_snapshot, args=({}, 0))
    server.start()
    with Clone(fake.address, timeout_s=DEADLINE_S) as clone:
        server.join(DEADLINE_S)
        with clone.watch("", capacity=3) as w:
            assert w.get(DEADLINE_S).kind == SYNCED
            with clone.watch("") as marker:
                assert marker.get(DEADLINE_S).kind == SYNCED
                for seq in range(1, 6):
                    fake.publish(b"k", seq, b"v")
                while marker.get(DEADLINE_S).seq != 5:
                    pass
            with pytest.raises(SlowConsumer):
                w.get(DEADLINE_S)


@pytest.mark.parametrize("taker", ["compiled", "python"])
def test_a_snapshot_s_every_kind_of_row_is_installed_or_dropped_as_the_decoder_says(
        fake, zctx, monkeypatch, taker):
    """The client takes our servers' common KVSYNC without a decoder call (on the
    compiled path in C, ``_zframes.take_rows``, many per call; else in Python, one per
    message); every other row still goes through ``chp.decode_snapshot``. Both ways in one
    snapshot, interleaved: plain ASCII keys, a UTF-8 key, the reference C server's row
    (UUID and properties), an empty value (not a key), and rows that are dropped and
    counted: bad UTF-8, a command word as key, a key outside the subtree, a 7-byte
    sequence, an oversize key or value, a row of 6 frames and one of 4."""
    from clonemap.client import incoming

    if taker == "python":
        monkeypatch.setattr(incoming, "_take_rows", None)
    else:
        assert incoming._take_rows is not None, "the compiled extension is not built"
    handled = []  # the messages that reached Python's on_message
    on_message = incoming.Incoming.on_message
    monkeypatch.setattr(incoming.Incoming, "on_message",
                        lambda self, frames: (handled.append(frames[0]),
                                             on_message(self, frames))[1])
    rows = [
        [b"/a/plain", chp.pack_seq(3), b"", b"", b"v1"],
        [b"/a/caf\xc3\xa9", chp.pack_seq(4), b"", b"", b"utf8"],
        [b"/a/c-dialect", chp.pack_seq(5), b"U" * 16, b"ttl=0\n", b"c"],
        [b"/a/empty", chp.pack_seq(6), b"", b"", b""],
        [b"/a/\xff\xfe", chp.pack_seq(7), b"", b"", b"bad utf-8"],
        [b"HUGZ", chp.pack_seq(8), b"", b"", b"reserved"],
        [b"/b/other", chp.pack_seq(9), b"", b"", b"outside"],
        [b"/a/short-seq", b"\0" * 7, b"", b"", b"x"],
        [b"/a/" + b"k" * 2000, chp.pack_seq(10), b"", b"", b"oversize key"],
        [b"/a/big", chp.pack_seq(10), b"", b"", b"v" * (chp.Limits().max_value + 1)],
        [b"/a/six", chp.pack_seq(10), b"", b"", b"x", b"extra frame"],
        [b"/a/four", chp.pack_seq(10), b"", b""],
        [b"/a/last", chp.pack_seq(11), b"", b"", b"v2"],
        *([b"/a/n%d" % i, chp.pack_seq(12 + i), b"", b"", b"n"] for i in range(500)),
    ]

    async def main():
        clone = AsyncClone(fake.address, subtree="/a/", context=zctx, codec="bytes")

        def serve():
            fake.wait_subscribed()
            identity, _ = fake.icanhaz()
            for frames in rows:
                fake.router.send_multipart([identity, *frames])
            fake.router.send_multipart([identity, *chp.kthxbai(20, b"/a/")])

        served = asyncio.create_task(asyncio.to_thread(serve))
        await clone.start()
        await served
        got = dict(clone.items())
        stats = clone.stats()["shards"][0]
        await clone.close()
        return got, stats

    got, stats = run(main())
    assert got == {"/a/plain": b"v1", "/a/café": b"utf8", "/a/c-dialect": b"c",
                   "/a/last": b"v2", **{"/a/n%d" % i: b"n" for i in range(500)}}
    assert stats["drops"] == {"bad_key": 2, "outside_subtree": 1, "bad_sequence": 1,
                              "oversize_key": 1, "oversize_value": 1, "frame_count": 2,
                              }, stats["drops"]
    assert stats["snapshots"] == 1 and stats["last_seq"] == 20
    plain = [r[0] for r in rows if len(r) == 5 and r[2:4] == [b"", b""] and len(r[1]) == 8
             and r[0].isascii() and r[0].startswith(b"/a/") and len(r[0]) < 1000
             and len(r[4]) < 1000]
    assert len(plain) == 500 + 3  # the /a/n rows, /a/plain, /a/empty and /a/last
    others = [r[0] for r in rows if r[0] not in plain] + [chp.KTHXBAI]
    # every row went through Python one by one, or only those the C taker leaves to it
    assert handled == ([r[0] for r in rows] + [chp.KTHXBAI] if taker == "python" else others)


# ----------------------------------------------------------------------------- resharding

def test_a_late_update_from_a_key_s_old_shard_does_not_undo_its_new_shard_s_write(zctx):
    """A key moves from s0 to s1 (a pin, epoch 2). The client follows the new routing,
    and s1's part applies a write s1 made to the key after the flip. Only then does s0's
    part read an update s0 published before the flip (the client read s0's stream late).
    That update is older: the key stays at s1's value, in s1's part, with no event for
    it, and the part counts it ``superseded``. (Before, s0's part took the key back at
    the older value, and kept it.) Two ``FakeServer`` shards and an in-process MDP broker
    serving ``cluster.map``; every step is one message, in this order."""
    from clonemap.shards.common.mdp.broker import Broker
    from clonemap.shards.common.routing import ShardMap
    from conftest import free_port_base

    first = ShardMap(2)
    tenant = next(f"/t{i}/" for i in range(100) if first.owner(f"/t{i}/k".encode()) == 0)
    key = f"{tenant}k".encode()
    later = ShardMap(2, {1: [tenant]}, epoch=2)
    shards = [FakeServer(zctx, free_port_base(4)), FakeServer(zctx, free_port_base(4))]
    control = f"tcp://127.0.0.1:{free_port_base(1)}"
    routing = [first]

    def cluster_map(_request) -> list[bytes]:
        return [b"200", json.dumps({"routing": routing[0].describe(), "shards": [
            {"name": f"s{i}", "index": i, "primary": {"address": "127.0.0.1",
                                                      "port": s.base}}
            for i, s in enumerate(shards)]}).encode()]

    def hugz(server: FakeServer, index: int, epoch_map: ShardMap) -> None:
        props = (f"route={epoch_map.route_of(index)}\nepoch={epoch_map.epoch}\n").encode()
        server.xpub.send_multipart([chp.HUGZ, chp.SEQ_ZERO, b"", props, b""])

    async def main():
        broker = Broker(control)
        broker.register("cluster.map", cluster_map)
        await broker.start()
        clone = AsyncClone(control=control, context=zctx)
        try:
            serving = [asyncio.create_task(asyncio.to_thread(s.serve_snapshot, items, seq))
                       for s, items, seq in ((shards[0], {key: b"v0"}, 1),
                                             (shards[1], {}, 0))]
            await clone.start()
            await asyncio.gather(*serving)
            watch = clone.watch("")
            watch.open()
            await changes_until(watch, lambda c: c.kind == SYNCED)
            # the flip: s1 says the new routing, and the client follows it
            routing[0] = later
            hugz(shards[1], 1, later)
            deadline = time.monotonic() + DEADLINE_S
            while clone.routing_epoch != 2:
                assert time.monotonic() < deadline, "the client did not follow epoch 2"
                await asyncio.sleep(0.01)
            shards[1].publish(key, 1, b"v2")  # a write s1 applied after the flip
            change = await next_change(watch)
            assert (change.key, change.value, change.shard) == (key.decode(), b"v2", "s1")
            shards[0].publish(key, 2, b"v1")  # published by s0 before the flip, read now
            hugz(shards[0], 0, later)  # (then s0's stream reaches the new routing)
            parts = {a.name: a for a in clone.agents}
            deadline = time.monotonic() + DEADLINE_S
            while parts["s0"].epoch_seen < 2 or parts["s0"].last_seq < 2:
                assert time.monotonic() < deadline, "s0's part did not read its stream"
                await asyncio.sleep(0.01)
            got = clone.get(key.decode())
            stats = {a.name: a.stats() for a in clone.agents}
            with pytest.raises(asyncio.TimeoutError):
                await next_change(watch, 0.3)  # no event for the older value
            return got, stats
        finally:
            await clone.close()
            await broker.stop()

    try:
        got, stats = run(main())
    finally:
        for s in shards:
            s.close()
    assert got == b"v2"
    assert stats["s0"]["superseded"] == 1 and stats["s0"]["keys"] == 0
    assert stats["s1"]["keys"] == 1
