"""The client router against real server processes: several shards, one local map.

Checked: keys written by several clients spread over every shard, and every client
converges to the union of the shards' own maps (each read with a raw ICANHAZ), each
shard holding only keys it owns; a subtree client follows only the owning shards and
sees exactly its subtree; ``wait=True`` gives read-your-writes and times out on a frozen
shard; killing one shard's active stalls only that shard, whose clients fail over and
resync without ghosts while the other shard keeps taking writes. Pure parts (the
cluster description, the CLI's subtree choice) first.
"""
from __future__ import annotations

import asyncio
import signal
import time

import pytest
from hypothesis import given, strategies as st

from helpers import run_async as run, wait_stderr
from conftest import ROOT, free_port_base
from test_client_failover import Events, start_pair_server, start_standalone, wait_state
from test_client_server import fetch_map
from clonemap.client.api import AsyncClone, Clone
from clonemap.client.cli_target import subtree_of
from clonemap.client.router import Cluster
from clonemap.shards.common.errors import ConfigError, Timeout
from clonemap.shards.common.proto import bstar as wire
from clonemap.shards.common.routing import ShardMap

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_S = 0.2
DEADLINE_S = 10.0
SEGMENTS = [f"seg{i}" for i in range(16)]



def as_bytes_map(items) -> dict[bytes, bytes]:
    return {k.encode(): v for k, v in items}


async def until_map(client: AsyncClone, expected: dict[bytes, bytes],
                    timeout_s: float = DEADLINE_S) -> None:
    """Until the client's local map equals ``expected`` (woken by its watch)."""
    async with client.watch() as w:
        deadline = time.monotonic() + timeout_s
        while as_bytes_map(client.items()) != expected:
            remaining = deadline - time.monotonic()
            got = as_bytes_map(client.items())
            if remaining <= 0:
                raise AssertionError(
                    f"not converged within {timeout_s} s: missing "
                    f"{sorted(expected.keys() - got.keys())[:5]}, extra "
                    f"{sorted(got.keys() - expected.keys())[:5]}, differing "
                    f"{[k for k in expected.keys() & got.keys() if expected[k] != got[k]][:5]}")
            try:
                async with asyncio.timeout(remaining):
                    await w.__anext__()
            except TimeoutError:
                pass


def shard_maps(zctx, ports: list[int]) -> list[tuple[dict[bytes, bytes], int]]:
    return [fetch_map(zctx, port) for port in ports]


def start_shards(procs, n: int) -> list[int]:
    ports = [free_port_base(4) for _ in range(n)]
    for port in ports:
        start_standalone(procs, port)
    return ports


def addresses(ports: list[int]) -> list[str]:
    return [f"tcp://127.0.0.1:{p}" for p in ports]


# ------------------------------------------------------------------ pure parts

def test_cluster_from_the_4shard_config_matches_the_shard_map():
    cluster = Cluster.from_config(ROOT / "configs" / "4shard.yaml")
    assert [s.name for s in cluster.shards] == ["s0", "s1", "s2", "s3"]
    assert cluster.shard_map == ShardMap(4)
    assert [[a.port for a in s.servers] for s in cluster.shards] == [
        [6000, 6010], [6020, 6030], [6040, 6050], [6060, 6070]]
    assert cluster.heartbeat_s == 1.0 and cluster.silence_timeout_s == 3.0
    assert cluster.shard("s2") is cluster.shards[2] is cluster.shard("2")
    with pytest.raises(KeyError):
        cluster.shard("s9")
    assert [s.name for s in cluster.shards_for("")] == ["s0", "s1", "s2", "s3"]
    owner = cluster.shard_map.owner("/users/1")
    assert [s.index for s in cluster.shards_for("/users/")] == [owner]


def test_cluster_map_with_pins_and_a_wildcard_address():
    doc = {"routing": ShardMap(2, {1: ["/config/"]}).describe(),
           "heartbeat_s": 0.5,
           "shards": [{"index": 0, "name": "a", "primary": {"address": "0.0.0.0", "port": 7000},
                       "backup": {"address": "10.0.0.2", "port": 7010}},
                      {"index": 1, "name": "b", "primary": {"address": "*", "port": 7020},
                       "backup": {"address": "*", "port": 7030}}]}
    cluster = Cluster.from_map(doc, host="192.0.2.7")
    assert [str(a) for a in cluster.shards[0].servers] == ["tcp://192.0.2.7:7000",
                                                           "tcp://10.0.0.2:7010"]
    assert [s.name for s in cluster.shards_for("/config/")] == ["b"]
    assert cluster.heartbeat_s == 0.5 and cluster.silence_timeout_s is None
    with pytest.raises(ConfigError):
        Cluster.from_map({"routing": ShardMap(3).describe(), "shards": doc["shards"]})
    with pytest.raises(ConfigError):
        Cluster.from_map({"shards": []})


def test_exactly_one_way_to_name_the_cluster():
    with pytest.raises(ValueError, match="exactly one"):
        AsyncClone()
    with pytest.raises(ValueError, match="exactly one"):
        AsyncClone("tcp://127.0.0.1:7000", shards=["tcp://127.0.0.1:7020"])
    with pytest.raises(ValueError):
        AsyncClone(shards=[])


_segment = st.text(st.characters(blacklist_characters="/", blacklist_categories=("Cs",)),
                   min_size=1, max_size=6)


@given(st.lists(_segment, min_size=0, max_size=4), st.booleans(),
       st.lists(_segment, max_size=3))
def test_the_cli_subtree_holds_every_key_under_the_prefix(segments, trailing, more):
    prefix = "/" + "/".join(segments) + ("/" if trailing and segments else "")
    sub = subtree_of(prefix)
    assert prefix.startswith(sub)  # so every key under prefix is under sub
    key = prefix + "/".join(more)
    assert key.startswith(sub)
    if sub:
        assert sub.endswith("/") and "//" not in sub


# ------------------------------------------------------------------ real servers

def test_clients_converge_to_the_union_of_four_shards(procs, zctx):
    ports = start_shards(procs, 4)
    shards = addresses(ports)
    shard_map = ShardMap(4)

    async def main():
        clients = [AsyncClone(shards=shards, heartbeat_s=HEARTBEAT_S) for _ in range(3)]
        for c in clients:
            await c.start()
        try:
            assert all(c.shard_names == ["s0", "s1", "s2", "s3"] for c in clients)
            expected: dict[bytes, bytes] = {}
            for n, c in enumerate(clients):
                for i, seg in enumerate(SEGMENTS):
                    for k in ("k0", "k1", "k2"):  # raced by every client
                        await c.set(f"/{seg}/{k}", f"c{n}-{i}".encode())
                for i, seg in enumerate(SEGMENTS):  # one writer each
                    key = f"/{seg}/own{n}"
                    await c.set(key, b"\x00\xff" + bytes([n, i]))
                    expected[key.encode()] = b"\x00\xff" + bytes([n, i])
            # a last round with wait=True: each client's earlier KVSETs to a shard went
            # down the same connection, so they are all applied once its echo is back
            for n, c in enumerate(clients):
                for seg in SEGMENTS:
                    await c.set(f"/{seg}/k0", f"final-{n}".encode(), wait=True)
            for seg in SEGMENTS:
                for k in ("k1", "k2"):
                    await clients[0].delete(f"/{seg}/{k}", wait=True)
                expected[f"/{seg}/k0".encode()] = b"final-2"
            for c in clients:
                await until_map(c, expected)
            maps = shard_maps(zctx, ports)
            union: dict[bytes, bytes] = {}
            for index, (data, seq) in enumerate(maps):
                assert data, f"shard s{index} got no key"
                assert all(shard_map.owner(k) == index for k in data), index
                union.update(data)
            assert union == expected
            for c in clients:
                assert as_bytes_map(c.items()) == union
                assert len(c) == len(union)
                assert c.version_vector == {f"s{i}": seq for i, (_, seq) in enumerate(maps)}
                assert sorted(c.items("/seg3/")) == sorted(
                    (k.decode(), v) for k, v in union.items() if k.startswith(b"/seg3/"))
                assert c.get("/seg3/own1") == b"\x00\xff\x01\x03"
        finally:
            for c in clients:
                await c.close()

    run(main())


def test_a_subtree_client_follows_only_the_owning_shard(procs, zctx):
    ports = start_shards(procs, 4)
    shards = addresses(ports)
    shard_map = ShardMap(4)
    owner = shard_map.owner("/seg5/x")

    async def main():
        async with AsyncClone(shards=shards, heartbeat_s=HEARTBEAT_S) as writer:
            for seg in SEGMENTS:
                await writer.set(f"/{seg}/a", seg.encode(), wait=True)
                await writer.set(f"/{seg}/deep/b", b"b", wait=True)
            async with AsyncClone(shards=shards, subtree="/seg5/",
                                  heartbeat_s=HEARTBEAT_S) as sub, \
                    AsyncClone(shards=shards, subtree="/seg5/deep/",
                               heartbeat_s=HEARTBEAT_S) as deeper:
                assert sub.shard_names == [f"s{owner}"] == deeper.shard_names
                assert list(sub.version_vector) == [f"s{owner}"]
                assert sorted(sub.items()) == [("/seg5/a", b"seg5"), ("/seg5/deep/b", b"b")]
                assert deeper.items() == [("/seg5/deep/b", b"b")]
                with pytest.raises(ValueError, match="outside"):
                    await sub.set("/seg6/a", b"no")
                # a write through the subtree client lands on the owner only
                await sub.set("/seg5/new", b"n", wait=True)
                assert sub.get("/seg5/new") == b"n"
                await until_map(writer, {**as_bytes_map(writer.items()), b"/seg5/new": b"n"})
                data, _ = fetch_map(zctx, ports[owner], b"/seg5/")
                assert data == as_bytes_map(sub.items())
                # the subtree client's watch: its items, synced, then only its subtree
                async with sub.watch() as w:
                    first = [await w.__anext__() for _ in range(4)]
                    assert first[-1].kind == "synced" and w.synced
                    assert sorted(c.key for c in first[:-1]) == ["/seg5/a", "/seg5/deep/b",
                                                                 "/seg5/new"]
                    await writer.set("/seg7/a", b"other", wait=True)
                    await writer.set("/seg5/a", b"mine", wait=True)
                    change = await asyncio.wait_for(w.__anext__(), DEADLINE_S)
                    assert (change.kind, change.key, change.value) == ("put", "/seg5/a",
                                                                       b"mine")

    run(main())


def test_wait_true_is_read_your_writes_and_times_out_on_a_frozen_shard(procs):
    ports = start_shards(procs, 2)
    shards = addresses(ports)
    shard_map = ShardMap(2)
    key_on = {shard_map.owner(f"/{seg}/k"): f"/{seg}/k" for seg in SEGMENTS}
    assert set(key_on) == {0, 1}

    async def main():
        async with AsyncClone(shards=shards, heartbeat_s=HEARTBEAT_S) as a:
            for i in range(50):
                key = f"/{SEGMENTS[i % 16]}/r{i}"
                await a.set(key, b"v%d" % i, wait=True)
                assert a.get(key) == b"v%d" % i  # no waiting: already applied locally
            await a.delete("/seg0/r0", wait=True)
            assert a.get("/seg0/r0") is None
            vv = a.version_vector
            procs.started[0].signal(signal.SIGSTOP)
            try:
                with pytest.raises(Timeout, match="did not publish"):
                    await a.set(key_on[0], b"frozen", wait=True, timeout_s=0.5)
                # the other shard is unaffected
                await a.set(key_on[1], b"fine", wait=True, timeout_s=DEADLINE_S)
                assert a.get(key_on[1]) == b"fine"
            finally:
                procs.started[0].signal(signal.SIGCONT)
            assert a.version_vector["s1"] > vv["s1"]

    run(main())
    # the synchronous client: the same, from a thread
    with Clone(shards=shards, heartbeat_s=HEARTBEAT_S) as c:
        for i in range(20):
            c.set(f"/{SEGMENTS[i % 16]}/s{i}", b"x%d" % i, wait=True)
            assert c.get(f"/{SEGMENTS[i % 16]}/s{i}") == b"x%d" % i
        c.delete("/seg1/s1", wait=True)
        assert c.get("/seg1/s1") is None
        assert set(c.version_vector) == {"s0", "s1"} and c.shard_names == ["s0", "s1"]


def test_killing_one_shards_active_stalls_only_that_shard(procs, zctx):
    """Two shards, each a Binary Star pair. kill -9 shard s0's primary: s1 keeps taking
    writes (wait=True) throughout; both clients fail s0 over to its backup, resync it
    alone, and end equal to the union of the two actives' maps."""
    pairs = []
    for _ in range(2):
        pa, pb = free_port_base(4), free_port_base(4)
        primary = start_pair_server(procs, pa, "primary", pb)
        backup = start_pair_server(procs, pb, "backup", pa)
        pairs.append((primary, backup))
    for primary, backup in pairs:
        wait_state(zctx, primary.port, wire.State.ACTIVE)
        wait_stderr(backup, "replica synchronised")
    shards = [[p.address, b.address] for p, b in pairs]
    shard_map = ShardMap(2)
    on = {0: [], 1: []}
    for seg in SEGMENTS:
        on[shard_map.owner(f"/{seg}/")].append(seg)

    async def main():
        events = {n: Events(n) for n in ("a", "b")}
        clients = {n: AsyncClone(shards=shards, heartbeat_s=HEARTBEAT_S, sync_timeout_s=0.5,
                                 connect_timeout_s=1.0, on_failover=events[n])
                   for n in ("a", "b")}
        for c in clients.values():
            await c.start()
        try:
            a, b = clients["a"], clients["b"]
            for seg in SEGMENTS:
                await a.set(f"/{seg}/k", b"before", wait=True)
            await until_map(b, as_bytes_map(a.items()))
            pairs[0][0].signal(signal.SIGKILL)
            # s1 takes writes while s0 is stalled
            n = 0
            while not all(e.resumed() for e in events.values()):
                seg = on[1][n % len(on[1])]
                await b.set(f"/{seg}/during", b"%d" % n, wait=True, timeout_s=DEADLINE_S)
                n += 1
                if n > 2000:
                    break
            for e in events.values():
                info = await e.wait_resumed(1)
                assert info.shard == "s0" and info.new == a.cluster.shards[0].servers[1]
                assert not [i for i in e.infos if i.shard != "s0"]
            assert n >= 1
            for seg in on[0]:
                await a.set(f"/{seg}/k", b"after", wait=True, timeout_s=DEADLINE_S)
            maps = [fetch_map(zctx, pairs[0][1].port), fetch_map(zctx, pairs[1][0].port)]
            union = {**maps[0][0], **maps[1][0]}
            for c in clients.values():
                await until_map(c, union)
                stats = {s["shard"]: s for s in c.stats()["shards"]}
                assert stats["s0"]["failovers"] >= 1 and stats["s1"]["failovers"] == 0
                assert stats["s1"]["snapshots"] == 1  # s1 never resynchronised
                assert c.version_vector["s1"] == maps[1][1]
            assert all(union[f"/{seg}/k".encode()] == b"after" for seg in on[0])
        finally:
            for c in clients.values():
                await c.close()

    run(main())


def test_one_io_thread_per_shard_black_box(procs):
    ports = start_shards(procs, 4)
    shards = addresses(ports)
    with pytest.raises(ValueError, match="io_threads"):
        AsyncClone(shards=shards, io_threads=0)

    async def main():
        async with AsyncClone(shards=shards, io_threads="per_shard",
                              heartbeat_s=HEARTBEAT_S) as c, \
                AsyncClone(shards=shards, io_threads=2, heartbeat_s=HEARTBEAT_S) as two:
            assert c._ctx.io_threads == 4 and two._ctx.io_threads == 2
            masks = [{a.link.sub.sock.affinity, *(col.io.sock.affinity for col in a.writes.collectors)}
                     for a in c._agents]
            assert masks == [{1}, {2}, {4}, {8}]
            assert [a.link.sub.sock.affinity for a in two._agents] == [1, 2, 1, 2]
            for i, seg in enumerate(SEGMENTS):
                await c.set(f"/{seg}/bb", b"%d" % i, wait=True)
            await until_map(two, as_bytes_map(c.items()))
            assert len(two) == len(SEGMENTS)

    run(main())


# ------------------------------------------------------------------ slow subscribers

SLOW_WRITES = 20_000
SLOW_VALUE = b"v" * 1000


def stall_while_a_writer_floods(zctx, port: int, address: str) -> None:
    """Block the calling loop (a deliberately slow subscriber) while another client
    writes ~20 MB, until the server has published all of it: more than the publisher's
    and the subscriber's high-water marks plus the kernel's buffers, so the publisher
    drops updates for this subscriber."""
    with Clone(address, heartbeat_s=HEARTBEAT_S) as writer:
        for i in range(SLOW_WRITES):
            writer.set(f"/flood/k{i % 500}", SLOW_VALUE + b"%d" % i)
        writer.flush(30)
        writer.close(linger_s=10)  # let what ZeroMQ holds out before the sockets close
    deadline = time.monotonic() + 30
    while fetch_map(zctx, port, b"/nothing/")[1] < SLOW_WRITES:
        assert time.monotonic() < deadline, "the server did not publish the flood"
        time.sleep(0.05)


def start_small_hwm_server(procs) -> int:
    port = free_port_base(4)
    procs.python("-m", "clonemap.shards", "--port", str(port), "--heartbeat-s", str(HEARTBEAT_S),
                 "--pub-hwm", "100", ready="READY")
    return port


@pytest.mark.parametrize("policy", ["resync", "die"])
def test_a_slow_subscriber_is_detected_and_handled_by_its_policy(procs, zctx, policy):
    from clonemap.client.errors import SlowSubscriber

    port = start_small_hwm_server(procs)
    address = f"tcp://127.0.0.1:{port}"

    async def main():
        died = asyncio.Event()
        reports: list[SlowSubscriber] = []

        def on_slow(exc):
            reports.append(exc)
            died.set()

        async with AsyncClone(address, slow_policy=policy, on_slow=on_slow, sub_rcvhwm=100,
                              silence_timeout_s=None) as slow:
            await slow.set("/flood/k0", b"first", wait=True)
            w = slow.watch("/flood/")
            await w.__aenter__()
            assert (await w.__anext__()).kind == "put"
            assert (await w.__anext__()).kind == "synced"
            stall_while_a_writer_floods(zctx, port, address)  # blocks this loop
            if policy == "resync":
                expected, _ = await asyncio.to_thread(fetch_map, zctx, port)
                await until_map(slow, expected, timeout_s=20)
                stats = slow.stats()
                assert slow.fell_behind >= 1 and stats["fell_behind"] == slow.fell_behind
                assert stats["shards"][0]["gaps"] >= 1
                assert stats["shards"][0]["snapshots"] >= 2
                assert slow.failed is None
                w.close()
            else:
                async with asyncio.timeout(DEADLINE_S):
                    await died.wait()
                exc = reports[0]
                assert isinstance(exc, SlowSubscriber) and exc.shard == "s0"
                assert exc.got > exc.expected and exc.dropped == exc.got - exc.expected
                assert slow.failed is exc and slow.fell_behind == 1
                for call in (lambda: slow.get("/flood/k1"), lambda: len(slow),
                             lambda: slow.items()):
                    with pytest.raises(SlowSubscriber):
                        call()
                with pytest.raises(SlowSubscriber):
                    await slow.set("/flood/x", b"no")
                with pytest.raises(SlowSubscriber):
                    while True:
                        await asyncio.wait_for(w.__anext__(), DEADLINE_S)

    run(main())


def test_a_control_client_needs_start_before_routing():
    from clonemap.client.errors import NotRunning

    async def main():
        c = AsyncClone(control="tcp://127.0.0.1:1", control_timeout_s=0.2, timeout_s=0.3)
        assert not c.synced and c.cluster is None and c.shard_names == []
        with pytest.raises(NotRunning):
            c.get("/a/b")
        with pytest.raises(NotRunning):
            async with c.watch():
                pass
        with pytest.raises(Timeout):
            await c.start()
        await c.close()

    run(main())
