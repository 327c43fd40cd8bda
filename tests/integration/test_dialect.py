"""The client and ``chp`` against a foreign CHP server: ``tests/chp_dialect_peer.py``
speaks the reference C server's dialect frame by frame (KVSYNC with UUID and properties,
an empty KTHXBAI subtree, HUGZ with the sequence, ``ttl`` kept in properties, no flow
control, no clock, no serving hint, no generation). Every test runs the peer as a real
process on real sockets; the client is the one users embed.
"""
from __future__ import annotations

import asyncio
import subprocess

import time

import pytest
import zmq

from conftest import PYTHON, ROOT, free_port_base
from clonemap.client.api import AsyncClone
from clonemap.shards.common.errors import Timeout
from clonemap.shards.common.proto import chp

pytestmark = pytest.mark.timeout(90)

PEER = str(ROOT / "tests" / "chp_dialect_peer.py")


def start_peer(procs, port: int, *extra: str):
    return procs.python(PEER, "--port", str(port), *extra, ready="READY dialect-peer")


class Seeder:
    """A raw PUB on a peer's collector, writing C-client style KVSETs (``ttl=0``)."""

    def __init__(self, ctx, *ports: int):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.linger = 0
        for port in ports:
            self.sock.connect(f"tcp://127.0.0.1:{port + 2}")
        self.sub = ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.subscribe(b"")
        self.sub.connect(f"tcp://127.0.0.1:{ports[0] + 1}")

    def write(self, items: dict[bytes, bytes], props: bytes = b"ttl=0\n") -> None:
        """Write ``items``; return once the peer has published the last one back. The
        first is repeated until it comes back (a PUB's connection joins late), then the
        rest go once."""
        first, *rest = items.items()
        self._send_until_echoed([first], props)
        if rest:
            self._send_until_echoed(rest, props, repeat=False)

    def _send_until_echoed(self, pairs, props: bytes, repeat: bool = True) -> None:
        last_key = pairs[-1][0]
        deadline = time.monotonic() + 15
        sent = False
        while True:
            if repeat or not sent:
                for key, value in pairs:
                    self.sock.send_multipart(chp.kvset(key, value, b"U" * 16, props))
                sent = True
            while self.sub.poll(200):
                if self.sub.recv_multipart()[0] == last_key:
                    return
            assert time.monotonic() < deadline, "the peer published nothing back"


def run(coro):
    return asyncio.run(coro)


def test_sync_from_the_dialect_server_holds_every_key(procs, zctx):
    port = free_port_base(4)
    start_peer(procs, port)
    items = {b"/a/%d" % i: b"v%d" % i for i in range(300)}
    items.update({b"/b/x": b"bx", b"plain": b"p"})
    Seeder(zctx, port).write(items)

    async def main():
        async with AsyncClone(f"tcp://127.0.0.1:{port}", timeout_s=10) as clone:
            got = {k.encode(): v for k, v in clone.items()}
            stats = clone.stats()["shards"][0]
            props = clone.properties("/a/1")
        return got, stats, props

    got, stats, props = run(main())
    assert got == items
    assert stats["snapshots"] == 1 and stats["snapshots_rejected"] == 0
    assert stats["drops"] == {}  # nothing of the dialect was dropped
    assert props == {"ttl": "0"}  # the KVSYNC's properties are kept


def test_subtree_sync_with_an_empty_kthxbai_subtree(procs, zctx):
    port = free_port_base(4)
    start_peer(procs, port)
    Seeder(zctx, port).write({b"/a/1": b"1", b"/a/2": b"2", b"/b/1": b"x"})

    async def main():
        async with AsyncClone(f"tcp://127.0.0.1:{port}", subtree="/a/", timeout_s=10) as c:
            return dict(c.items()), c.stats()["shards"][0]

    got, stats = run(main())
    assert got == {"/a/1": b"1", "/a/2": b"2"}
    assert "wrong_subtree" not in stats["drops"]


def test_writes_with_wait_and_the_hugz_sequence_keep_the_client_live(procs, zctx):
    port = free_port_base(4)
    start_peer(procs, port, "--heartbeat-s", "0.2")
    Seeder(zctx, port).write({b"/w/seed": b"s"})

    async def main():
        async with AsyncClone(f"tcp://127.0.0.1:{port}", timeout_s=10,
                              silence_timeout_s=1.0) as clone:
            for i in range(20):
                await clone.set(f"/w/{i}", b"x%d" % i, wait=True, timeout_s=5)
            await clone.set("/w/ttl0", b"t", ttl=0, wait=True)  # the C client's ttl=0
            await clone.delete("/w/seed", wait=True)
            # HUGZ with a sequence are the peer's heartbeat: no gap, no silence
            await asyncio.sleep(1.5)
            return dict(clone.items()), clone.stats()["shards"][0]

    got, stats = run(main())
    assert got == {**{f"/w/{i}": b"x%d" % i for i in range(20)}, "/w/ttl0": b"t"}
    assert stats["gaps"] == 0 and stats["failovers"] == 0 and stats["snapshots"] == 1
    assert stats["drops"] == {}


def test_a_snapshot_nothing_of_which_applies_is_not_a_success(procs, zctx):
    port = free_port_base(4)
    start_peer(procs, port, "--mangle-kvsync")
    Seeder(zctx, port).write({b"/m/1": b"1", b"/m/2": b"2"})

    async def main():
        clone = AsyncClone(f"tcp://127.0.0.1:{port}", timeout_s=2.5)
        try:
            with pytest.raises(Timeout) as info:
                await clone.start()
            return info.value, clone.stats()["shards"][0]
        finally:
            await clone.close()

    exc, stats = run(main())
    assert stats["snapshots"] == 0 and stats["snapshots_rejected"] >= 1
    assert stats["phase"] == "SYNCING" and "SYNCING" in str(exc)


def test_failover_between_two_dialect_servers(procs, zctx):
    a, b = free_port_base(4), free_port_base(4)
    active = start_peer(procs, a, "--peer", str(b), "--active", "--heartbeat-s", "0.2")
    start_peer(procs, b, "--peer", str(a), "--passive", "--heartbeat-s", "0.2")
    seeder = Seeder(zctx, a, b)
    seeder.write({b"/f/%d" % i: b"v" for i in range(50)})

    async def main():
        events = []
        async with AsyncClone([f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}"],
                              timeout_s=10, silence_timeout_s=0.6,
                              on_failover=events.append) as clone:
            await clone.set("/f/before", b"1", wait=True)
            active.signal(9)
            active.wait()
            # the client hears silence, moves, votes; the passive takes over
            await clone.set("/f/after", b"2", wait=True, timeout_s=10)
            stats = clone.stats()["shards"][0]
            return dict(clone.items()), stats, events

    got, stats, events = run(main())
    assert got["/f/before"] == b"1" and got["/f/after"] == b"2"
    assert len([k for k in got if k.startswith("/f/") and k[3:].isdigit()]) == 50
    assert stats["server"] == f"tcp://127.0.0.1:{b}" and stats["failovers"] >= 1
    assert [e.resumed for e in events][-1] is True
    assert stats["resets"] == 0  # the replica had every update: nothing lost


def test_chp_gets_sets_and_dumps_against_the_dialect_server(procs, zctx):
    port = free_port_base(4)
    start_peer(procs, port)
    Seeder(zctx, port).write({b"/c/1": b"one", b"/c/2": b"two"})
    base = [PYTHON, "-m", "clonemap.client.cli", "--servers", f"tcp://127.0.0.1:{port}"]

    def chp_run(*args):
        return subprocess.run([*base, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)

    out = chp_run("get", "/c/1")
    assert out.returncode == 0 and out.stdout == "one\n", out.stderr
    out = chp_run("set", "/c/3", "three")
    assert out.returncode == 0, out.stderr
    out = chp_run("dump", "/c/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["/c/1\tone", "/c/2\ttwo", "/c/3\tthree"]


def test_a_conditional_write_is_refused_before_it_reaches_a_strict_server(procs, zctx):
    """The guide's dialect ignores ``if-seq`` (it stores properties as they come) and
    would apply the write unconditionally: shown by sending one raw. So our client
    refuses a conditional write to a server that does not say ``cas=1``, at once
    (``NotSupported``), and nothing reaches the server; plain writes go on working."""
    from clonemap.client.errors import NotSupported

    port = free_port_base(4)
    start_peer(procs, port)
    seeder = Seeder(zctx, port)
    seeder.write({b"/c/k": b"first"})
    seeder.write({b"/c/k": b"raw"}, props=chp.write_props(if_seq=999))  # applied anyway

    async def main():
        async with AsyncClone(f"tcp://127.0.0.1:{port}", timeout_s=10) as clone:
            assert clone.get("/c/k") == b"raw"
            assert clone.meta("/c/k").seq > 0  # the dialect's KVSYNC sequence
            with pytest.raises(NotSupported, match="cas=1"):
                await clone.set("/c/k", b"mine", if_seq=clone.meta("/c/k").seq)
            with pytest.raises(NotSupported):
                await clone.set("/c/new", b"x", create=True)
            await clone.set("/c/k", b"plain", wait=True)
            assert clone.get("/c/k") == b"plain"
    run(main())
