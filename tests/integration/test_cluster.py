"""The router against the real supervisor and the 4-shard config (ports made free, the
heartbeat shortened to 0.2 s): clients found the cluster through ``control=`` (MDP
``cluster.map``) or ``config=``, write keys spread over every shard, and converge to the
union of the four actives' maps; a watch across all shards gets one end-of-snapshot
marker; a subtree client follows one shard; ``cluster.kill`` of one shard's active
stalls only that shard, whose clients fail over and resync while the others keep
taking writes, and everyone ends equal to the union again (no ghosts, nothing lost).
"""
from __future__ import annotations

import asyncio
import json

import pytest

from test_client_failover import Events
from test_client_server import fetch_map
from test_router import DEADLINE_S, as_bytes_map, run, until_map
from test_supervisor_cli import start, wait_status, write_config
from clonemap.client.api import AsyncClone, Clone
from clonemap.shards.common.routing import ShardMap
from clonemap.supervisor.control import call

pytestmark = pytest.mark.timeout(150)

HEARTBEAT_S = 0.2
SEGMENTS = [f"seg{i}" for i in range(24)]


def actives(control: str) -> dict[str, dict]:
    """Shard name -> the status row of its ACTIVE server, once every pair has settled."""
    rows = wait_status(control, lambda r: all(
        {r[f"s{i}/{role}"]["bstar"] for role in ("primary", "backup")}
        == {"ACTIVE", "PASSIVE"} for i in range(4)), timeout_s=30)
    return {row["name"].split("/")[0]: row for row in rows.values()
            if row["bstar"] == "ACTIVE"}


def union_of(zctx, rows: dict[str, dict]) -> tuple[dict[bytes, bytes], dict[str, int]]:
    union: dict[bytes, bytes] = {}
    seqs = {}
    shard_map = ShardMap(4)
    for name, row in sorted(rows.items()):
        data, seq = fetch_map(zctx, row["port"])
        assert all(shard_map.owner(k) == int(name[1:]) for k in data), name
        union.update(data)
        seqs[name] = seq
    return union, seqs


def test_four_shard_cluster_converges_and_one_shard_fails_over_alone(procs, tmp_path, zctx):
    config, control = write_config(tmp_path, "4shard.yaml", heartbeat_s=HEARTBEAT_S,
                                   silence_timeout_s=3 * HEARTBEAT_S)
    start(procs, config, tmp_path, "--backoff-initial-s", "0.2")
    actives(control)  # every pair settled: one ACTIVE, one PASSIVE
    shard_map = ShardMap(4)
    on: dict[int, list[str]] = {i: [] for i in range(4)}
    for seg in SEGMENTS:
        on[shard_map.owner(f"/{seg}/")].append(seg)
    assert all(on.values()), on
    victim_shard = "s1"

    async def main():
        events = {n: Events(n) for n in ("c1", "c2", "f1")}
        kw = dict(sync_timeout_s=0.5, connect_timeout_s=1.0)
        clients = {"c1": AsyncClone(control=control, on_failover=events["c1"], **kw),
                   "c2": AsyncClone(control=control, on_failover=events["c2"], **kw),
                   "f1": AsyncClone(config=str(config), on_failover=events["f1"], **kw)}
        await asyncio.gather(*(c.start() for c in clients.values()))
        try:
            for c in clients.values():
                assert c.shard_names == ["s0", "s1", "s2", "s3"]
                assert c.silence_timeout_s == pytest.approx(3 * HEARTBEAT_S)
            # (blocking helpers run in a thread: a stalled loop would look like silence)
            # every client writes its own keys on every shard, and races on shared ones
            for name, c in clients.items():
                for i, seg in enumerate(SEGMENTS):
                    await c.set(f"/{seg}/{name}", f"{name}-{i}".encode())
                    await c.set(f"/{seg}/shared", name.encode())
                for seg in SEGMENTS:  # wait=True: everything before it is applied
                    await c.set(f"/{seg}/last", name.encode(), wait=True)
            union, seqs = await asyncio.to_thread(lambda: union_of(zctx, actives(control)))
            assert len(union) == len(SEGMENTS) * 5
            for c in clients.values():
                await until_map(c, union)
                assert c.version_vector == seqs
            # a fresh watch across all shards: the items, then ONE synced marker
            async with AsyncClone(control=control) as fresh:
                async with fresh.watch() as w:
                    changes = []
                    while not changes or changes[-1].kind != "synced":
                        changes.append(await asyncio.wait_for(w.__anext__(), DEADLINE_S))
                    assert [c.kind for c in changes].count("synced") == 1
                    assert {c.key.encode(): c.value for c in changes[:-1]} == union
                    assert {c.shard for c in changes[:-1]} == {"s0", "s1", "s2", "s3"}
            # a subtree client follows only its shard
            seg = on[2][0]
            async with AsyncClone(control=control, subtree=f"/{seg}/") as sub:
                assert sub.shard_names == ["s2"]
                assert as_bytes_map(sub.items()) == {k: v for k, v in union.items()
                                                     if k.startswith(f"/{seg}/".encode())}

            # kill shard s1's active: only s1 stalls
            victim = (await asyncio.to_thread(actives, control))[victim_shard]
            killed = json.loads(await asyncio.to_thread(
                call, control, "cluster.kill", victim["name"].encode(), retries=0))
            assert killed["pid"] == victim["pid"]
            others = [seg for i in (0, 2, 3) for seg in on[i]]
            n = 0
            while not all(e.resumed() for e in events.values()) and n < 5000:
                seg = others[n % len(others)]
                await clients["c2"].set(f"/{seg}/during", b"%d" % n, wait=True,
                                        timeout_s=DEADLINE_S)
                n += 1
            for name, e in events.items():
                info = await e.wait_resumed(1, timeout_s=20)
                assert info.shard == victim_shard, (name, info)
                assert not [i for i in e.infos if i.shard != victim_shard], name
            for seg in on[1]:
                await clients["c1"].set(f"/{seg}/after", b"A", wait=True, timeout_s=DEADLINE_S)
            union, seqs = await asyncio.to_thread(lambda: union_of(zctx, actives(control)))
            assert union[f"/{on[1][0]}/after".encode()] == b"A"
            assert union[f"/{others[0]}/during".encode()]
            for name, c in clients.items():
                await until_map(c, union)
                stats = {s["shard"]: s for s in c.stats()["shards"]}
                for shard in ("s0", "s2", "s3"):
                    assert stats[shard]["failovers"] == 0, (name, shard)
                    assert stats[shard]["snapshots"] == 1, (name, shard)
                    assert c.version_vector[shard] == seqs[shard]
                assert stats[victim_shard]["failovers"] >= 1
        finally:
            for c in clients.values():
                await c.close()

    run(main(), timeout_s=120)
    # the synchronous client finds the cluster the same way
    with Clone(control=control, timeout_s=DEADLINE_S) as c:
        assert c.shard_names == ["s0", "s1", "s2", "s3"]
        before = len(c)
        c.set(f"/{on[3][0]}/sync", b"S", wait=True)
        assert c.get(f"/{on[3][0]}/sync") == b"S" and len(c) == before + 1
