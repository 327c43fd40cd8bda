"""A durable cluster the way users run it: ``supervisor start`` with the default
``data_dir`` (``<run-dir>/data/<shard>-<role>/``), clients with their defaults, real
processes killed with SIGKILL. And a Binary Star pair whose roles crossed while it was
down, started from real data directories.

* ``supervisor stop`` then ``supervisor start`` on the same run directory: every key,
  value, deletion and TTL instant is back, each shard's generation and sequence go on,
  and a key whose instant passed while the cluster was down is gone.
* SIGKILL of both servers of a pair, with a client connected: no reset event, every
  acknowledged write is there, the sequence goes on.
* SIGKILL of every process, supervisor included, under ``fsync: everysec`` and
  ``always``: no acknowledged write is lost (a process crash leaves the page cache: what
  a KVPUB announced was written before it went out).
* Crossed roles: the server holding the later (term, sequence) becomes active; the other
  synchronises from it and keeps the updates it must drop in a ``dropped-*`` file.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time

import pytest
import zmq

from clonemap.client.api import AsyncClone
from conftest import PYTHON, free_port_base, wait_until
from clonemap.shards.common.proto import bstar_ttl
from clonemap.shards.persist import DataDir, recover
from clonemap.shards.persist.recovery import replay_records
from clonemap.shards.store import Store
from helpers import wait_stderr
from test_client_server import fetch_map
from test_failover_supervised import shard_keys
from test_pair import start_server
from test_server_hostile import stats_now
from test_supervisor_cli import cli, start, status, wait_gone, wait_status, write_config

pytestmark = pytest.mark.timeout(240)


def settled(rows: dict) -> bool:
    shards = {name.split("/")[0] for name in rows}
    return all({rows[f"{s}/primary"]["bstar"], rows[f"{s}/backup"]["bstar"]} ==
               {"ACTIVE", "PASSIVE"} for s in shards)


def actives(rows: dict) -> dict[str, dict]:
    """shard -> the status row of its active server."""
    return {name.split("/")[0]: row for name, row in rows.items() if row["bstar"] == "ACTIVE"}


def ttl_table(zctx, port: int) -> dict[bytes, float]:
    """The active's absolute expiry times, read as its passive does (BSTAR-TTL?)."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart(bstar_ttl.request())
    table: dict[bytes, float] = {}
    try:
        while True:
            assert dealer.poll(10_000), f"no BSTAR-TTL reply from {port}"
            chunk = bstar_ttl.decode_chunk(dealer.recv_multipart())
            table.update(chunk.table)
            if chunk.last:
                return table
    finally:
        dealer.close(0)


def kill_all(pids: list[int]) -> None:
    """SIGKILL every pid at once, from another process (no handler runs anywhere)."""
    out = subprocess.run([PYTHON, "-c", "import os, signal, sys\n"
                          "for pid in sys.argv[1:]: os.kill(int(pid), signal.SIGKILL)",
                          *map(str, pids)], capture_output=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert wait_gone(pids) == []


def test_stop_and_start_keep_every_key_deletion_and_ttl_instant(procs, tmp_path, zctx):
    config, control = write_config(tmp_path, "2shard.yaml")
    sup = start(procs, config, tmp_path)
    rows = wait_status(control, settled)

    async def write():
        async with AsyncClone(config=str(config)) as clone:
            keys = shard_keys(clone, "s0", 4) + shard_keys(clone, "s1", 4)
            for i, key in enumerate(keys):
                await clone.set(key, f"v{i}".encode(), wait=True)
            await clone.delete(keys[1], wait=True)
            await clone.delete(keys[5], wait=True)
            await clone.set(keys[2], b"ttl", ttl=600, wait=True)
            await clone.set(keys[6], b"short", ttl=0.2, wait=True)
            return keys, dict(clone.items()), clone.version_vector

    keys, before, vv = asyncio.run(write())
    assert keys[1] not in before and keys[5] not in before
    rows = status(control)
    gens = {s: row["stats"]["generation"] for s, row in actives(rows).items()}
    ttls = {s: ttl_table(zctx, row["port"]) for s, row in actives(rows).items()}
    assert sorted(len(t) for t in ttls.values()) == [1, 1] or keys[6] not in before
    short_expiry = [t[keys[6].encode()] for t in ttls.values() if keys[6].encode() in t]
    assert cli("stop", "--control", control).returncode == 0
    assert sup.wait(30) == 0
    data = tmp_path / "run" / "data"
    assert sorted(p.name for p in data.iterdir()) == [
        "s0-backup", "s0-primary", "s1-backup", "s1-primary"]

    sup = start(procs, config, tmp_path)
    rows = wait_status(control, settled)
    assert not short_expiry or time.time() > short_expiry[0]  # it expired while down
    after_ttls = {s: ttl_table(zctx, row["port"]) for s, row in actives(rows).items()}
    long_key = keys[2].encode()
    assert [t[long_key] for t in after_ttls.values() if long_key in t] == \
        [t[long_key] for t in ttls.values() if long_key in t]  # the same instant
    assert {s: row["stats"]["generation"] for s, row in actives(rows).items()} == gens
    resets = []

    async def read():
        async with AsyncClone(config=str(config), on_reset=resets.append) as clone:
            got = dict(clone.items())
            await clone.set(keys[0], b"again", wait=True)
            return got, clone.version_vector

    expected = {k: v for k, v in before.items() if k != keys[6]}
    got, vv_after = asyncio.run(read())
    assert got == expected and resets == []
    for shard, seq in vv.items():
        assert vv_after[shard] >= seq  # the sequence went on (+ the expiry's delete)
    assert cli("stop", "--control", control).returncode == 0
    assert sup.wait(30) == 0


def test_both_servers_of_a_pair_killed_lose_nothing_and_no_reset(procs, tmp_path):
    config, control = write_config(tmp_path, "2shard.yaml")
    start(procs, config, tmp_path, "--backoff-initial-s", "0.2")
    wait_status(control, settled)
    resets = []

    async def main():
        async with AsyncClone(config=str(config), on_reset=resets.append) as clone:
            keys = shard_keys(clone, "s1", 20)
            for i, key in enumerate(keys):
                await clone.set(key, f"v{i}".encode(), wait=True)
            before = clone.version_vector["s1"]
            rows = status(control)
            kill_all([rows["s1/primary"]["pid"], rows["s1/backup"]["pid"]])
            # the supervisor restarts both; the client follows the pair back
            await clone.set(keys[0], b"after", wait=True, timeout_s=60)
            assert clone.version_vector["s1"] == before + 1  # no gap, no restart at 0
            for i, key in enumerate(keys[1:], start=1):
                assert clone.get(key) == f"v{i}".encode()
        async with AsyncClone(config=str(config)) as fresh:
            assert fresh.get(keys[0]) == b"after"
            assert len([k for k in fresh.keys() if k in keys]) == 20

    asyncio.run(main())
    assert resets == []


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_sigkill_of_every_process_loses_no_acknowledged_write(procs, tmp_path, fsync):
    config, control = write_config(tmp_path, "2shard.yaml", fsync=fsync)
    sup = start(procs, config, tmp_path)
    rows = wait_status(control, settled)
    acked: dict[str, bytes] = {}

    async def write():
        async with AsyncClone(config=str(config)) as clone:
            keys = shard_keys(clone, "s0", 50) + shard_keys(clone, "s1", 50)

            async def writer(part):
                for round_ in range(3):
                    for key in part:
                        value = f"{key}:{round_}".encode()
                        await clone.set(key, value, wait=True)
                        acked[key] = value

            await asyncio.gather(*(writer(keys[i::4]) for i in range(4)))

    asyncio.run(write())
    assert len(acked) == 100
    rows = status(control)
    kill_all([sup.pid] + [row["pid"] for row in rows.values()])
    sup = start(procs, config, tmp_path)
    wait_status(control, settled)

    async def read():
        async with AsyncClone(config=str(config)) as clone:
            return {k: clone.get(k) for k in acked}

    assert asyncio.run(read()) == acked
    assert cli("stop", "--control", control).returncode == 0
    assert sup.wait(30) == 0


# ------------------------------------------------------------------ crossed roles

def pair_dirs(tmp_path):
    return tmp_path / "p", tmp_path / "b"


def start_pair(procs, tmp_path, p_port, b_port):
    p_dir, b_dir = pair_dirs(tmp_path)
    p = start_server(procs, p_port, "primary", b_port, "--data-dir", str(p_dir))
    b = start_server(procs, b_port, "backup", p_port, "--data-dir", str(b_dir))
    return p, b


def test_crossed_roles_the_server_that_served_last_wins(procs, tmp_path, zctx):
    """The primary serves, is killed; the backup takes over and serves alone, is killed;
    both start again: the backup (a later term) goes active with every write.

    The primary is killed once the backup holds its write: a pair on one host replicates
    asynchronously, and a backup still synchronising when its active dies takes over
    without what it had not received (it says so: "taking over before the replica was
    complete"). Under a loaded disk that sync once took over 2 s, and the test lost
    /x/first when it did not wait for it."""
    p_port, b_port = free_port_base(4), free_port_base(4)
    p, b = start_pair(procs, tmp_path, p_port, b_port)
    servers = [f"tcp://127.0.0.1:{p_port}", f"tcp://127.0.0.1:{b_port}"]

    async def write(key, value):
        async with AsyncClone(servers) as clone:
            await clone.set(key, value, wait=True, timeout_s=30)

    asyncio.run(write("/x/first", b"1"))
    wait_stderr(b, "replica synchronised")
    wait_until(lambda: stats_now(b)["seq"] >= 1, "the backup's copy of /x/first")
    p.signal(9)
    p.wait()
    asyncio.run(write("/x/second", b"2"))  # the backup takes over on this client's vote
    b.signal(9)
    b.wait()
    p, b = start_pair(procs, tmp_path, p_port, b_port)
    wait_stderr(b, "backup is ACTIVE")
    got, seq = fetch_map(zctx, b_port)
    assert got == {b"/x/first": b"1", b"/x/second": b"2"} and seq == 2
    wait_stderr(p, "replica synchronised")
    assert not any("dropped" in line for line in p.stderr)


def test_crossed_roles_updates_the_winner_never_had_are_kept_aside(procs, tmp_path, zctx):
    """Data directories as a crash leaves them: the primary (term 1) logged 1..10; the
    backup had 1..7 when it took over (term 2 from sequence 8) and logged 8..12 alone.
    Started together, the backup goes active; the primary synchronises from it, and its
    8..10, which the backup never had, go to a dropped-* file with a log line."""
    p_dir, b_dir = pair_dirs(tmp_path)
    for path, term, history, ops in (
            (p_dir, 1, [(1, 1)], [(b"/k%d" % i, b"p") for i in range(10)]),
            (b_dir, 2, [(1, 1), (2, 8)], [(b"/k%d" % i, b"p") for i in range(7)] +
             [(b"/b%d" % i, b"b") for i in range(5)])):
        writer, store = DataDir(path, "no"), Store()
        writer.open("0123456789abcdef", 0)
        for key, value in ops:
            writer.append(store.apply(key, value), key, value, None)
        writer.save_terms(term, history)
        writer.close()
    p_port, b_port = free_port_base(4), free_port_base(4)
    p, b = start_pair(procs, tmp_path, p_port, b_port)
    line = p.stderr[wait_stderr(p, "were dropped")]
    assert "3 updates" in line and "sequence 8..10" in line
    got, seq = fetch_map(zctx, b_port)
    assert seq == 12 and got == {**{b"/k%d" % i: b"p" for i in range(7)},
                                 **{b"/b%d" % i: b"b" for i in range(5)}}
    (kept,) = p_dir.glob("dropped-*.cml")
    assert [(s, k) for s, k, _, _ in replay_records(kept)] == [
        (8, b"/k7"), (9, b"/k8"), (10, b"/k9")]
    p.stop()
    b.stop()
    assert recover(p_dir).store.data == got  # the primary's directory is the new map
    assert recover(p_dir).term == 3 and recover(b_dir).term == 3
    assert os.path.exists(kept)


# ------------------------------------------------------------------ backup and restore

def test_backup_of_a_live_cluster_restores_into_a_new_one(procs, tmp_path):
    """``python -m clonemap.shards.persist backup <run-dir>/data DEST`` while the cluster runs and
    a writer goes on; DEST copied into a new cluster's ``<run-dir>/data`` before its
    ``supervisor start``: it serves the backed-up map (every write acknowledged before
    the backup began, each key at least at that value)."""
    config, control = write_config(tmp_path, "2shard.yaml")
    sup = start(procs, config, tmp_path)
    wait_status(control, settled)
    dest = tmp_path / "backup"

    async def write_and_back_up():
        async with AsyncClone(config=str(config)) as clone:
            keys = shard_keys(clone, "s0", 30) + shard_keys(clone, "s1", 30)
            for key in keys:
                await clone.set(key, b"before", wait=True)
            during = asyncio.gather(*(clone.set(key, b"during", wait=True) for key in keys))
            out = await asyncio.to_thread(subprocess.run, [
                PYTHON, "-m", "clonemap.shards.persist", "backup", str(tmp_path / "run" / "data"),
                str(dest)], capture_output=True, text=True, timeout=60)
            await during
            return keys, out

    keys, out = asyncio.run(write_and_back_up())
    assert out.returncode == 0, out.stderr
    reports = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted(os.path.basename(r["dir"]) for r in reports) == [
        "s0-backup", "s0-primary", "s1-backup", "s1-primary"]
    assert cli("stop", "--control", control).returncode == 0
    assert sup.wait(30) == 0

    new_root = tmp_path / "restored"
    new_root.mkdir()
    config2, control2 = write_config(new_root, "2shard.yaml")
    shutil.copytree(dest, new_root / "run" / "data")
    sup = start(procs, config2, new_root)
    wait_status(control2, settled)

    async def read():
        async with AsyncClone(config=str(config2)) as clone:
            return {k: clone.get(k) for k in keys}

    got = asyncio.run(read())
    assert set(got) == set(keys) and set(got.values()) <= {b"before", b"during"}
    assert cli("stop", "--control", control2).returncode == 0
    assert sup.wait(30) == 0


def test_verify_names_a_corrupt_file_and_exits_1(tmp_path):
    writer, store = DataDir(tmp_path / "d", "no"), Store()
    writer.open("0123456789abcdef", 0)
    for i in range(3):
        writer.append(store.apply(b"/k%d" % i, b"v"), b"/k%d" % i, b"v", None)
        writer.flush()
    segment = writer.segment
    writer.close()
    ok = subprocess.run([PYTHON, "-m", "clonemap.shards.persist", "verify", str(tmp_path / "d")],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and json.loads(ok.stdout)["keys"] == 3
    data = bytearray(segment.read_bytes())
    data[40] ^= 0xFF
    segment.write_bytes(bytes(data))
    bad = subprocess.run([PYTHON, "-m", "clonemap.shards.persist", "verify", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and segment.name in bad.stderr and "offset" in bad.stderr
