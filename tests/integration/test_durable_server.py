"""A standalone server with ``--data-dir``, as real processes: stopped and started again,
or killed with SIGKILL, it comes back with the same map, sequence, TTL instants and map
generation (clients see no data loss); a corrupt log is a clear error, never an empty map.
"""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from clonemap.client.api import AsyncClone
from conftest import free_port_base
from clonemap.shards.persist import format as fmt
from test_client_server import fetch_map

pytestmark = pytest.mark.timeout(90)


def start(procs, port: int, data_dir, *extra: str):
    return procs.python("-m", "clonemap.shards", "--port", str(port), "--data-dir", str(data_dir),
                        "--log-level", "info", *extra, ready="READY")


def write(port: int, ops) -> None:
    async def main():
        async with AsyncClone(f"tcp://127.0.0.1:{port}") as clone:
            for key, value, ttl in ops:
                if value is None:
                    await clone.delete(key, wait=True)
                else:
                    await clone.set(key, value, ttl, wait=True)
    asyncio.run(main())


def test_stop_and_start_keep_every_key_deletion_ttl_and_the_generation(procs, tmp_path, zctx):
    port = free_port_base(4)
    server = start(procs, port, tmp_path)
    write(port, [("/d/a", b"1", None), ("/d/b", b"2", None), ("/d/b", None, None),
                 ("/d/ttl", b"t", 600), ("/d/c", b"3", None)])
    before, seq = fetch_map(zctx, port)
    assert server.stop() == 0  # SIGTERM: flushed and fsynced
    resets = []

    server = start(procs, port, tmp_path)
    after, seq_after = fetch_map(zctx, port)
    assert after == before == {b"/d/a": b"1", b"/d/ttl": b"t", b"/d/c": b"3"}
    assert seq_after == seq == 5

    async def follow():
        async with AsyncClone(f"tcp://127.0.0.1:{port}", on_reset=resets.append) as clone:
            await clone.set("/d/e", b"5", wait=True)
            return clone.version_vector

    vv = asyncio.run(follow())
    assert vv == {"s0": 6}  # the sequence continues
    assert resets == []
    assert any("recovered 3 keys at sequence 5" in line for line in server.stderr)
    assert server.stop() == 0


def test_a_ttl_that_passed_while_the_server_was_down_is_gone(procs, tmp_path, zctx):
    port = free_port_base(4)
    server = start(procs, port, tmp_path)
    write(port, [("/t/short", b"x", 0.5), ("/t/long", b"y", 600)])
    server.stop()
    time.sleep(0.6)  # the TTL's instant passes while no server runs (what is tested)
    server = start(procs, port, tmp_path)
    deadline = time.monotonic() + 10
    while True:
        got, seq = fetch_map(zctx, port)
        if b"/t/short" not in got or time.monotonic() > deadline:
            break
    assert got == {b"/t/long": b"y"} and seq == 3  # the expiry is a logged delete
    server.stop()


def test_sigkill_loses_nothing_written_more_than_a_second_before(procs, tmp_path, zctx):
    port = free_port_base(4)
    server = start(procs, port, tmp_path)
    write(port, [(f"/k/{i}", b"v%d" % i, None) for i in range(200)])
    written, seq = fetch_map(zctx, port)
    # everysec: the log is fsynced within a second; wait until the server says so
    deadline = time.monotonic() + 10
    while True:
        server.signal(signal.SIGUSR1)
        stats_lines = [line for line in server.stderr if "stats {" in line]
        if stats_lines and '"fsyncs": 1,' not in stats_lines[-1] \
                and '"fsyncs": 0,' not in stats_lines[-1]:
            break
        assert time.monotonic() < deadline, "no fsync after the writes"
        time.sleep(0.2)
    server.signal(signal.SIGKILL)
    server.wait()
    server = start(procs, port, tmp_path)
    got, seq_after = fetch_map(zctx, port)
    assert got == written and seq_after == seq == 200
    server.stop()


def test_a_torn_last_record_is_truncated_and_counted(procs, tmp_path, zctx):
    port = free_port_base(4)
    server = start(procs, port, tmp_path)
    write(port, [("/w/a", b"1", None), ("/w/b", b"2", None)])
    server.stop()
    (log_path,) = sorted(tmp_path.glob("log-*.cml"))[-1:]
    with open(log_path, "ab") as f:
        f.write(fmt.record([3, b"/w/c", b"3", None])[:-4])  # a crash mid-write
    server = start(procs, port, tmp_path)
    got, seq = fetch_map(zctx, port)
    assert got == {b"/w/a": b"1", b"/w/b": b"2"} and seq == 2
    assert any("torn last record" in line for line in server.stderr)
    server.stop()


def test_a_corrupt_log_stops_the_server_with_the_file_and_offset(procs, tmp_path):
    port = free_port_base(4)
    server = start(procs, port, tmp_path)
    write(port, [("/x/a", b"1", None), ("/x/b", b"2", None), ("/x/c", b"3", None)])
    server.stop()
    log_path = tmp_path / fmt.seq_name("log-", 1, ".cml")
    data = bytearray(log_path.read_bytes())
    header = len(fmt.header(fmt.LOG_MAGIC, "0" * 16))
    assert len(data) > header + 40  # more than one record follows
    data[header + 12] ^= 0xFF  # inside the first record's payload
    log_path.write_bytes(bytes(data))
    proc = procs.python("-m", "clonemap.shards", "--port", str(port), "--data-dir", str(tmp_path))
    assert proc.wait(30) == 1
    err = "\n".join(proc.stderr)
    assert "cannot recover the map" in err and str(log_path) in err
    assert f"offset {header}" in err


def test_fsync_always_acknowledges_only_what_is_on_disk(procs, tmp_path, zctx):
    """``--fsync always``: a batch's KVPUBs go out after its fsync, so every write a
    client saw acknowledged (``wait=True``) was fsynced first: 20 writes one at a time
    cost at least 20 fsyncs, and a SIGKILL right after the last acknowledgement loses
    none of them. An unfiltered client sees no gap (HUGZ announce only published
    sequences)."""
    port = free_port_base(4)
    server = start(procs, port, tmp_path, "--fsync", "always")

    async def main():
        async with AsyncClone(f"tcp://127.0.0.1:{port}") as clone:
            for i in range(20):
                await clone.set(f"/s/{i}", b"v%d" % i, wait=True)
            return clone.stats()["shards"][0]

    stats = asyncio.run(main())
    assert stats["gaps"] == 0 and stats["applied"] == 20
    server.signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not any("stats {" in line for line in server.stderr):
        assert time.monotonic() < deadline, "no stats line"
        time.sleep(0.05)
    line = next(line for line in server.stderr if "stats {" in line)
    fsyncs = int(line.split('"fsyncs": ')[1].split(",")[0])
    assert fsyncs >= 21  # the header, then one per acknowledged batch at least
    server.signal(signal.SIGKILL)
    server.wait()
    server = start(procs, port, tmp_path, "--fsync", "always")
    got, seq = fetch_map(zctx, port)
    assert got == {f"/s/{i}".encode(): b"v%d" % i for i in range(20)} and seq == 20
    server.stop()


def test_a_compaction_asked_on_the_control_service_snapshots_the_map_now(procs, tmp_path,
                                                                         zctx):
    """``[compact]`` (an operator's, after a bulk load): the server writes its snapshot
    at once, far below the log size that starts one by itself; a second ask while it
    runs, or one to a server without a data directory, is refused with the reason. The
    map comes back whole from that snapshot after a restart."""
    import json

    from clonemap.shards.common.mdp.client import SyncMdpClient

    port, other = free_port_base(4), free_port_base(4)
    control = f"tcp://127.0.0.1:{free_port_base(1)}"
    procs.python("-m", "clonemap.supervisor", "broker", "--bind", control, ready="READY broker")
    server = start(procs, port, tmp_path, "--shard", "s0", "--control", control)
    procs.python("-m", "clonemap.shards", "--port", str(other), "--shard", "s1", "--control",
                 control, ready="READY")
    write(port, [(f"/c/{i}", b"v%d" % i, None) for i in range(300)])
    before, seq = fetch_map(zctx, port)
    with SyncMdpClient(control, ctx=zctx, timeout_s=5.0, retries=2) as client:
        ask = lambda service, *body: json.loads(client.request(service, *body)[0])  # noqa: E731
        assert ask("shard.s0.standalone")["persist"]["compactions"] == 0
        said = ask("shard.s0.standalone", b"compact")
        assert said["compact_refused"] == ""
        again = ask("shard.s0.standalone", b"compact")["compact_refused"]
        assert again in ("a compaction is running", "")  # ("" once the first one ended)
        deadline = time.monotonic() + 10
        while True:
            persist = ask("shard.s0.standalone")["persist"]
            if persist["compacting"] is None and persist["compactions"] >= 1:
                break
            assert time.monotonic() < deadline, f"no compaction ended: {persist}"
            time.sleep(0.05)
        assert persist["snapshot_bytes"] > 0 and persist["log_bytes"] < 64 << 20
        refused = ask("shard.s1.standalone", b"compact")["compact_refused"]
        assert refused == "this server keeps no data directory"
    assert any("compaction (asked): writing the snapshot at sequence "
               f"{seq} (300 keys)" in line for line in server.stderr)
    assert server.stop() == 0
    server = start(procs, port, tmp_path, "--shard", "s0")
    after, seq_after = fetch_map(zctx, port)
    assert after == before and seq_after == seq
    recovered = [line for line in server.stderr if "recovered 300 keys" in line]
    assert recovered and "(snapshot None" not in recovered[0]  # read from the snapshot
    server.stop()
