"""The client against a real ``python -m clonemap.shards`` process, and the ``make run`` demo.

Every wait is for an event (a watch change, a stdout line, a snapshot) with a deadline.
The server's own map is read with a raw DEALER (``fetch_map``: ICANHAZ -> KVSYNC* KTHXBAI),
never through the client under test.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import msgpack
import pytest
import zmq

from helpers import run_async as run, watch_until as until
from clonemap.client import shard_machine as sm
from clonemap.client.api import AsyncClone, Clone
from clonemap.client.watch import DELETE, PUT, SYNCED

HEARTBEAT_S = 0.2
DEADLINE_S = 10.0



def start_server(procs, port: int):
    return procs.python("-m", "clonemap.shards", "--port", str(port), "--heartbeat-s", str(HEARTBEAT_S),
                        "--log-level", "warning", ready="READY")


@pytest.fixture
def server(procs, port_base):
    proc = start_server(procs, port_base)
    proc.port = port_base
    proc.address = f"tcp://127.0.0.1:{port_base}"
    return proc


def fetch_map(ctx: zmq.Context, port: int, subtree: bytes = b"",
              timeout_s: float = DEADLINE_S) -> tuple[dict[bytes, bytes], int]:
    """The server's map under ``subtree`` and its KTHXBAI sequence, by a raw ICANHAZ."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"ICANHAZ?", subtree])
        out: dict[bytes, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not dealer.poll(remaining_ms):
                raise AssertionError(f"no KTHXBAI from port {port} within {timeout_s} s")
            frames = dealer.recv_multipart()
            assert len(frames) == 5, frames
            if frames[0] == b"KTHXBAI":
                assert frames[4] == subtree
                return out, int.from_bytes(frames[1], "big")
            out[frames[0]] = frames[4]
    finally:
        dealer.close(0)


def as_bytes_map(items) -> dict[bytes, bytes]:
    return {k.encode(): v for k, v in items}


def sync_until(watch, pred, timeout_s: float = DEADLINE_S) -> list:
    seen = []
    deadline = time.monotonic() + timeout_s
    while True:
        change = watch.get(timeout_s=max(deadline - time.monotonic(), 0.001))
        assert change is not None, "watch closed"
        seen.append(change)
        if pred(change):
            return seen


def is_(kind, key):
    return lambda c: c.kind == kind and c.key == key


# ------------------------------------------------------------------ the demo

def test_demo_runs_to_completion_and_leaves_no_server(procs):
    demo = procs.python("-m", "clonemap.client.demo")
    ready = demo.wait_line("READY shard", timeout_s=15)
    server_pid = int(re.search(r"pid=(\d+)", ready).group(1))
    for line in ("reader watch synced", "reader watch put    /demo/greeting = 'hello'",
                 "reader watch delete /demo/greeting", "ttl expired /demo/session",
                 "maps converged 1 key", "demo done"):
        demo.wait_line(line, timeout_s=15)
    assert demo.wait(15) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)  # ended and reaped by the demo


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_interrupted_stops_its_server(procs, sig):
    # --hold: the demo waits for the signal after its last step (without it, a test
    # process slowed by a busy host could send the signal after the demo had finished)
    demo = procs.python("-m", "clonemap.client.demo", "--hold")
    server_pid = int(re.search(r"pid=(\d+)", demo.wait_line("READY shard")).group(1))
    demo.wait_line("holding: server at")
    demo.signal(sig)
    assert demo.wait(15) == 130
    assert any("interrupted" in line for line in demo.stdout)
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


# ------------------------------------------------------------------ async API

def test_async_client_syncs_then_set_get_delete_ttl_items(server, zctx):
    async def main():
        clone = AsyncClone(server.address, subtree="/t/", silence_timeout_s=3 * HEARTBEAT_S)
        agent = clone._agents[0]
        assert agent.phase == sm.INITIAL
        async with clone:
            assert [p for _, p in agent.phase_log] == [sm.INITIAL, sm.SYNCING, sm.ACTIVE]
            assert clone.synced and clone.version_vector == {"s0": 0}
            async with clone.watch("/t/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                uuid = await clone.set("/t/a", b"1")
                assert len(uuid) == 16
                await clone.set("/t/b", b"2")
                await clone.set("/t/sub/c", b"3")
                await until(w, is_(PUT, "/t/sub/c"))
                assert clone.get("/t/a") == b"1" and "/t/b" in clone
                assert sorted(clone.items()) == [("/t/a", b"1"), ("/t/b", b"2"),
                                                 ("/t/sub/c", b"3")]
                assert clone.items("/t/sub/") == [("/t/sub/c", b"3")]
                assert sorted(clone.keys()) == ["/t/a", "/t/b", "/t/sub/c"]
                await clone.delete("/t/a")
                await until(w, is_(DELETE, "/t/a"))
                assert clone.get("/t/a") is None and clone.get("/t/a", b"x") == b"x"
                set_s = time.monotonic()
                await clone.set("/t/ttl", b"brief", ttl=0.5)
                await until(w, is_(PUT, "/t/ttl"))
                await until(w, is_(DELETE, "/t/ttl"))
                lived_s = time.monotonic() - set_s
                assert "/t/ttl" not in clone
            assert lived_s >= 0.4, lived_s  # not expired early (a ttl is a lower bound)
            server_map, seq = fetch_map(zctx, server.port, b"/t/")
            assert as_bytes_map(clone.items()) == server_map
            assert clone.version_vector == {"s0": seq}
            with pytest.raises(ValueError):
                await clone.set("/other/x", b"1")  # outside the subtree
            with pytest.raises(ValueError):
                await clone.set("/t/empty", b"")  # empty means delete: refused on set
    run(main())


# ------------------------------------------------------------------ sync API

def test_sync_client_set_get_delete_ttl_items_and_callback_watch(server, zctx):
    got = []
    with Clone(server.address, subtree="/s/", silence_timeout_s=3 * HEARTBEAT_S) as clone:
        assert clone._async._agents[0].phase == sm.ACTIVE
        cb = clone.watch("/s/", callback=got.append)
        with clone.watch("/s/") as w:
            sync_until(w, lambda c: c.kind == SYNCED)
            clone.set("/s/x", b"10")
            clone.set("/s/y", b"20", ttl=0.4)
            sync_until(w, is_(PUT, "/s/y"))
            assert clone.get("/s/x") == b"10" and clone.get("/s/y") == b"20"
            assert sorted(clone.items()) == [("/s/x", b"10"), ("/s/y", b"20")]
            clone.delete("/s/x")
            sync_until(w, is_(DELETE, "/s/x"))
            sync_until(w, is_(DELETE, "/s/y"))  # expired by the server
            assert clone.items() == [] and len(clone) == 0
        cb.close()
        server_map, seq = fetch_map(zctx, server.port, b"/s/")
        assert server_map == {} and clone.version_vector == {"s0": seq}
    assert [(c.kind, c.key) for c in got] == [
        (SYNCED, "/s/"), (PUT, "/s/x"), (PUT, "/s/y"), (DELETE, "/s/x"), (DELETE, "/s/y")]


# ------------------------------------------------------------------ subtrees, codecs

def test_subtree_client_sees_only_its_subtree(server, zctx):
    async def main():
        async with AsyncClone(server.address) as writer, \
                AsyncClone(server.address, subtree="/a/") as live:
            async with live.watch("/a/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                for key in ("/ab/1", "/b/1", "x", "/a/1", "/a/deep/2"):
                    await writer.set(key, key.encode())
                # one server, one order: once /a/deep/2 is in, the others were published
                seen = await until(w, is_(PUT, "/a/deep/2"))
            assert [c.key for c in seen if c.kind == PUT] == ["/a/1", "/a/deep/2"]
            assert sorted(live.keys()) == ["/a/1", "/a/deep/2"]
            assert live.stats()["shards"][0]["drops"] == {}
            async with AsyncClone(server.address, subtree="/a/") as late:
                assert sorted(late.keys()) == ["/a/1", "/a/deep/2"]
            whole, _ = fetch_map(zctx, server.port)
            assert set(whole) == {b"/ab/1", b"/b/1", b"x", b"/a/1", b"/a/deep/2"}
    run(main())


MSGPACK_VALUES = {
    "/m/dict": {"a": [1, 2.5, "x", b"\x00\xff"], "n": None, "nested": {"t": True}},
    "/m/zero": 0,
    "/m/false": False,
    "/m/empty_str": "",
    "/m/empty_list": [],
    "/m/big": 2 ** 63,
    "/m/neg": -7,
    "/m/float": 1e-300,
    "/m/unicode": "ключ ✓",
    "/m/bytes": b"\x00\x01",
    "/m/int_keys": {1: "one", 2: "two"},
}


def test_msgpack_codec_round_trips_through_the_server(server, zctx):
    async def main():
        async with AsyncClone(server.address, subtree="/m/", codec="msgpack") as a, \
                AsyncClone(server.address, subtree="/m/", codec="msgpack") as b:
            async with b.watch("/m/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                for key, value in MSGPACK_VALUES.items():
                    await a.set(key, value)
                await a.set("/m/tuple", (1, 2))
                seen = await until(w, is_(PUT, "/m/tuple"))
            assert {c.key: c.value for c in seen if c.kind == PUT} == {
                **MSGPACK_VALUES, "/m/tuple": [1, 2]}
            for key, value in MSGPACK_VALUES.items():
                assert b.get(key) == value, key
            assert b.get("/m/tuple") == [1, 2]  # tuples come back as lists
            server_map, _ = fetch_map(zctx, server.port, b"/m/")
            assert msgpack.unpackb(server_map[b"/m/dict"], raw=False) == MSGPACK_VALUES["/m/dict"]
            with pytest.raises(TypeError):
                await a.set("/m/bad", object())
    run(main())


BINARY_VALUES = {
    "/bin/all": bytes(range(256)),
    "/bin/nul": b"\x00",
    "/bin/trailing": b"abc\x00\x00",
    "/bin/big": os.urandom(200_000),
    "/bin/not_utf8": b"\xff\xfe\xc3\x28",
}


def test_binary_values_round_trip_byte_exact(server, zctx):
    async def main():
        async with AsyncClone(server.address, subtree="/bin/") as a:
            async with a.watch("/bin/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                for key, value in BINARY_VALUES.items():
                    await a.set(key, bytearray(value))  # bytearray accepted, sent as bytes
                await until(w, is_(PUT, "/bin/not_utf8"))
            for key, value in BINARY_VALUES.items():
                assert a.get(key) == value, key
            async with AsyncClone(server.address, subtree="/bin/") as late:
                assert dict(late.items()) == BINARY_VALUES
            server_map, _ = fetch_map(zctx, server.port, b"/bin/")
            assert server_map == {k.encode(): v for k, v in BINARY_VALUES.items()}
    run(main())


# ------------------------------------------------------------------ convergence

def test_second_client_converges_to_the_first_while_writes_continue(server, zctx):
    async def main():
        async with AsyncClone(server.address, subtree="/c/") as first:
            async with first.watch("/c/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                await first.set("/c/gone", b"soon deleted")
                for i in range(300):
                    await first.set(f"/c/k{i % 120}", f"v{i}".encode())
                # a second client joins while the first keeps writing
                second = AsyncClone(server.address, subtree="/c/")
                start = asyncio.create_task(second.start())
                for i in range(300, 900):
                    await first.set(f"/c/k{i % 120}", f"v{i}".encode())
                    if i % 50 == 0:
                        await asyncio.sleep(0)
                    if i == 600:
                        await first.delete("/c/gone")
                await first.set("/c/end", b"1")
                await until(w, is_(PUT, "/c/end"))
                await start
                try:
                    async with second.watch("/c/end") as w2:
                        await until(w2, is_(PUT, "/c/end"))
                    server_map, seq = fetch_map(zctx, server.port, b"/c/")
                    assert as_bytes_map(first.items()) == server_map
                    assert as_bytes_map(second.items()) == server_map
                    assert first.version_vector == second.version_vector == {"s0": seq}
                    assert "/c/gone" not in second and len(second) == 121
                    stats = second.stats()["shards"][0]
                    assert stats["gaps"] == 0 and stats["stale"] == 0
                finally:
                    await second.close()
    run(main())


def test_restarted_server_is_noticed_and_the_map_replaced(procs, port_base, zctx):
    """A standalone server killed and restarted on the same port comes back empty, with
    its sequence at 1 again and a new map generation. The client's SUB reconnects by
    itself; the agent notices the disconnection, resyncs, and reports a data loss: one
    ``on_reset`` with the old and new sequence and the keys lost, one ``reset`` change to
    the watch (not a delete per key), and the map replaced, even with the silence
    timeout off."""
    first = start_server(procs, port_base)
    address = f"tcp://127.0.0.1:{port_base}"
    resets = []

    async def main():
        async with AsyncClone(address, subtree="/r/", silence_timeout_s=None,
                              on_reset=resets.append) as clone:
            async with clone.watch("/r/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                for i in range(5):
                    await clone.set(f"/r/old{i}", b"x")
                await until(w, is_(PUT, "/r/old4"))
                assert clone.version_vector == {"s0": 5}
                assert clone.get("/r/old0") == b"x"  # (the flat read view holds it)
                first.signal(signal.SIGKILL)
                first.wait()
                start_server(procs, port_base)
                change = (await until(w, lambda c: True))[0]
                assert change.kind == "reset" and change.shard == "s0", change
                assert clone.items() == []
                # the snapshot that replaced the map replaced the flat view's keys too
                assert [clone.get(f"/r/old{i}") for i in range(5)] == [None] * 5
                async with AsyncClone(address, subtree="/r/") as writer:
                    await writer.set("/r/new", b"y")  # sequence 1 on the new server
                    # no delete of the lost keys comes before it: the reset said it all
                    change = (await until(w, lambda c: True))[0]
                    assert (change.kind, change.key) == (PUT, "/r/new"), change
                    assert clone.get("/r/new") == b"y"
            stats = clone.stats()["shards"][0]
            # two whole maps installed: the first, and the new server's (it refused the
            # resume). The reconnection may add a resume of the new map: the restarted
            # server's first HUGZ (a new generation) can be read before the SUB's
            # handshake event is, and each of them asks for the map again
            assert stats["disconnects"] >= 1 and stats["resumes_refused"] >= 1
            assert stats["snapshots"] - stats["resumes"] == 2 and stats["resumes"] <= 1
            assert stats["resets"] == 1 and stats["last_reset"]["keys_lost"] == 5
            assert len(resets) == 1
            info = resets[0]
            assert (info.shard, info.old_seq, info.new_seq) == ("s0", 5, 0)
            assert (info.keys_before, info.keys_after, info.keys_lost) == (5, 0, 5)
            assert info.old_generation and info.new_generation
            assert info.old_generation != info.new_generation and info.policy == "accept"
            server_map, seq = fetch_map(zctx, port_base, b"/r/")
            assert server_map == {b"/r/new": b"y"}
            assert as_bytes_map(clone.items()) == server_map
            assert clone.version_vector == {"s0": seq}
    run(main())


def test_kvpubs_already_in_the_snapshot_are_discarded(server, zctx):
    """Clients join while a raw writer streams KVSETs: updates published between the
    subscription and the snapshot point arrive twice (in the SUB buffer and in the
    snapshot); the buffered copies are discarded (sequence not greater than KTHXBAI's) and
    every client ends equal to the server."""
    pub = zctx.socket(zmq.XPUB)
    pub.linger = 0
    pub.connect(f"tcp://127.0.0.1:{server.port + 2}")
    assert pub.poll(int(DEADLINE_S * 1000)) and pub.recv()[:1] == b"\x01"
    stop = threading.Event()
    sent = [0]

    def write():
        i = 0
        while not stop.is_set():
            pub.send_multipart([f"/d/k{i % 500}".encode(), bytes(8), os.urandom(16), b"",
                                str(i).encode()])
            i += 1
            if i % 200 == 0:
                time.sleep(0.001)  # keep the server's collector ahead of us
        sent[0] = i

    async def main():
        clients = []
        try:
            skipped = 0
            for _ in range(10):
                clone = AsyncClone(server.address, subtree="/d/")
                clients.append(clone)
                await clone.start()
                skipped += clone.stats()["shards"][0]["skipped"]
                if skipped:
                    break
            assert skipped > 0, "no client saw an update both buffered and in its snapshot"
            stop.set()
            thread.join(5)
            pub.send_multipart([b"/d/end", bytes(8), b"", b"", b"1"])
            for clone in clients:  # the end marker: every earlier KVSET is in
                async with clone.watch("/d/end") as w:
                    await until(w, is_(PUT, "/d/end"))
            server_map, seq = fetch_map(zctx, server.port, b"/d/")
            for clone in clients:
                assert as_bytes_map(clone.items()) == server_map
                assert clone.version_vector == {"s0": seq}
                stats = clone.stats()["shards"][0]
                assert stats["gaps"] == 0 and stats["stale"] == 0
        finally:
            for clone in clients:
                await clone.close()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        run(main())
    finally:
        stop.set()
        thread.join(5)
    assert sent[0] > 0


# ------------------------------------------------------------------ watches

def test_watch_gets_current_items_then_synced_then_changes_in_order(server):
    async def main():
        async with AsyncClone(server.address, subtree="/w/") as clone:
            async with clone.watch("/w/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                for i in range(3):
                    await clone.set(f"/w/{i}", str(i).encode())
                await clone.set("/w/other/skip", b"-")
                await until(w, is_(PUT, "/w/other/skip"))
            # a watch opened now: current items, synced, then live changes in order
            async with clone.watch("/w/") as w, clone.watch("/w/other/") as narrow:
                snapshot = await until(w, lambda c: c.kind == SYNCED)
                assert snapshot[-1].kind == SYNCED and w.synced
                assert {(c.kind, c.key, c.value) for c in snapshot[:-1]} == {
                    (PUT, "/w/0", b"0"), (PUT, "/w/1", b"1"), (PUT, "/w/2", b"2"),
                    (PUT, "/w/other/skip", b"-")}
                await clone.set("/w/1", b"one")
                await clone.delete("/w/0")
                await clone.set("/w/3", b"3")
                live = await until(w, is_(PUT, "/w/3"))
                assert [(c.kind, c.key, c.value) for c in live] == [
                    (PUT, "/w/1", b"one"), (DELETE, "/w/0", None), (PUT, "/w/3", b"3")]
                assert [c.seq for c in live] == sorted(c.seq for c in live)
                narrow_seen = await until(narrow, lambda c: c.kind == SYNCED)
                assert [(c.kind, c.key) for c in narrow_seen] == [
                    (PUT, "/w/other/skip"), (SYNCED, "/w/other/")]
                await clone.delete("/w/other/skip")
                assert [(c.kind, c.key) for c in await until(narrow, is_(DELETE, "/w/other/skip"))] \
                    == [(DELETE, "/w/other/skip")]
    run(main())


def test_reset_policy_keep_holds_the_old_copy_read_only(procs, port_base):
    """``reset_policy="keep"``: after the server comes back with another map, the client
    keeps its copy of the shard (reads work), refuses writes to it with ``ShardReset``
    naming the loss, and stops following the shard."""
    from clonemap.client.errors import ShardReset

    first = start_server(procs, port_base)
    address = f"tcp://127.0.0.1:{port_base}"
    resets = []

    async def main():
        async with AsyncClone(address, subtree="/p/", silence_timeout_s=None,
                              reset_policy="keep", on_reset=resets.append) as clone:
            async with clone.watch("/p/") as w:
                await until(w, lambda c: c.kind == SYNCED)
                await clone.set("/p/a", b"1", wait=True)
                await clone.set("/p/b", b"2", wait=True)
                first.signal(signal.SIGKILL)
                first.wait()
                start_server(procs, port_base)
                change = (await until(w, lambda c: c.kind == "reset"))[-1]
            assert change.value.policy == "keep" and change.value.keys_lost == 2
            assert dict(clone.items()) == {"/p/a": b"1", "/p/b": b"2"}
            with pytest.raises(ShardReset, match="read-only") as info:
                await clone.set("/p/c", b"3")
            assert info.value.shard == "s0" and info.value.info is resets[0]
            stats = clone.stats()["shards"][0]
            assert stats["phase"] == "KEPT" and stats["resets"] == 1
    run(main())
    assert len(resets) == 1
