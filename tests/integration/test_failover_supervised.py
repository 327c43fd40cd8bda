"""Failover the way users run it: ``supervisor start configs/4shard.yaml`` (heartbeat 1 s,
silence 3 s), ``supervisor kill s0/primary``, and the supervisor restarting the killed
server, which comes back PASSIVE. Clients use the defaults the README gives them.

What is asserted is behaviour, not time (the times are the failover benchmark's
``--supervised`` mode): after the restart, a client's first snapshot request for s0 goes
to the active backup, never to the passive primary (whose refused-vote counter stays at
0), because the primary's welcome HUGZ says ``serving=0``; a writer with ``wait=True``
across the kill never times out and never waits on a refused snapshot; ``chp get``
answers with its default timeout. And the data-loss event of a memory-only cluster
(``data_dir: null``): both servers of s1 killed together come back with an empty map,
and a connected client hears it once (a durable cluster loses nothing:
``test_durable_cluster``).
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time

import pytest

from conftest import PYTHON, ROOT
from test_supervisor_cli import cli, start, status, wait_status, write_config

pytestmark = pytest.mark.timeout(180)

def shard_keys(clone, shard: str, count: int = 1) -> list[str]:
    """``count`` keys (each its own routing segment) the cluster routes to ``shard``."""
    shard_map = clone.cluster.shard_map
    index = [s.name for s in clone.cluster.shards].index(shard)
    keys = [f"/k{i}" for i in range(10_000) if shard_map.owner(f"/k{i}".encode()) == index]
    assert len(keys) >= count, f"no {count} keys for {shard}"
    return keys[:count]


def shard_key(clone, shard: str) -> str:
    return shard_keys(clone, shard)[0]


def refused(control: str, server: str) -> int:
    return status(control)[server]["stats"]["snapshots_refused"]


def test_supervised_kill_restart_clients_find_the_active_at_once(procs, tmp_path, caplog):
    from clonemap.client.api import Clone

    config, control = write_config(tmp_path, "4shard.yaml")
    sup = start(procs, config, tmp_path, "--backoff-initial-s", "0.2")
    rows = wait_status(control, lambda r: all(
        {r[f"s{i}/primary"]["bstar"], r[f"s{i}/backup"]["bstar"]} == {"ACTIVE", "PASSIVE"}
        for i in range(4)))
    assert rows["s0/primary"]["bstar"] == "ACTIVE"

    failovers = []
    with Clone(config=str(config), on_failover=failovers.append) as writer:
        key = shard_key(writer, "s0")
        writer.set(key, b"before", wait=True)
        errors: list[BaseException] = []
        written = []
        stop = threading.Event()

        def write_loop():
            i = 0
            while not stop.is_set():
                try:
                    writer.set(key, f"w{i}".encode(), wait=True)
                    written.append(i)
                except BaseException as exc:  # reported below
                    errors.append(exc)
                    return
                i += 1

        thread = threading.Thread(target=write_loop)
        thread.start()
        try:
            victim = rows["s0/primary"]["pid"]
            assert cli("kill", "s0/primary", "--control", control).returncode == 0
            sup.wait_line(f"EVENT s0/primary pid {victim} killed by SIGKILL")
            sup.wait_line("EVENT s0/primary ready")
            rows = wait_status(control, lambda r: r["s0/backup"]["bstar"] == "ACTIVE"
                               and r["s0/primary"]["bstar"] == "PASSIVE")
            done_before = len(written)
            # the writer goes on: wait until it has written through the new active
            deadline = time.monotonic() + 30
            while len(written) < done_before + 20 and not errors:
                assert time.monotonic() < deadline, "the writer did not resume"
                time.sleep(0.05)
        finally:
            stop.set()
            thread.join(30)
        assert errors == []
        s0 = writer.stats()["shards"][[a["shard"] for a in writer.stats()["shards"]]
                                        .index("s0")]
        assert s0["server"].endswith(f":{rows['s0/backup']['port']}")
        # never a wait on a refused snapshot: the switch was for silence, or because the
        # restarted primary (and, for a moment, the backup not yet active) said it was
        # not serving
        reasons = {f.reason for f in failovers if not f.resumed}
        assert reasons and reasons <= {"silent", "server not serving (passive)",
                                       "every server not serving (passive)"}, reasons
        assert refused(control, "s0/primary") == 0

    # a new client over the whole cluster, primary listed first: its s0 snapshot comes
    # from the backup, and the passive primary is never asked; finding the active this
    # way is no failover (nothing was interrupted): logged at INFO, no callback
    moved = []
    caplog.clear()  # the writer's failover above was a real one, and said so
    with caplog.at_level(logging.INFO, logger="clonemap.client"):
        with Clone(config=str(config), on_failover=moved.append) as fresh:
            assert fresh.get(key) is not None
            s0 = [a for a in fresh.stats()["shards"] if a["shard"] == "s0"][0]
            assert s0["server"].endswith(f":{rows['s0/backup']['port']}")
            assert s0["snapshots"] == 1 and s0["failovers"] == 0
    assert moved == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records
            if r.getMessage().startswith("shard s0: server not serving")] == [
        ("INFO", f"shard s0: server not serving (passive); trying "
                 f"tcp://127.0.0.1:{rows['s0/backup']['port']}")]
    assert refused(control, "s0/primary") == 0

    # chp get with its default timeout answers
    out = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--config", str(config), "get", key],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("w")
    assert refused(control, "s0/primary") == 0


def test_both_servers_of_a_memory_only_shard_lost_is_one_data_loss_event(procs, tmp_path):
    from clonemap.client.api import AsyncClone

    config, control = write_config(tmp_path, "4shard.yaml", data_dir=None)
    start(procs, config, tmp_path, "--backoff-initial-s", "0.2")
    wait_status(control, lambda r: all(
        {r[f"s{i}/primary"]["bstar"], r[f"s{i}/backup"]["bstar"]} == {"ACTIVE", "PASSIVE"}
        for i in range(4)))
    resets = []

    async def main():
        async with AsyncClone(config=str(config), on_reset=resets.append) as clone:
            keys = shard_keys(clone, "s1", 3)
            for key in keys:
                await clone.set(key, b"v", wait=True)
            other = shard_key(clone, "s2")
            await clone.set(other, b"kept", wait=True)
            before = clone.version_vector["s1"]
            async with clone.watch("") as w:
                async for change in w:
                    if change.kind == "synced":
                        break
                rows = status(control)
                pids = [rows["s1/primary"]["pid"], rows["s1/backup"]["pid"]]
                out = subprocess.run([PYTHON, "-c", (
                    "import os, signal, sys\n"
                    "for pid in sys.argv[1:]: os.kill(int(pid), signal.SIGKILL)")]
                    + [str(p) for p in pids], capture_output=True, timeout=10)
                assert out.returncode == 0
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                seen = []
                while not resets:
                    assert loop.time() < deadline, f"no reset event; saw {seen}"
                    try:
                        async with asyncio.timeout(1):
                            seen.append(await w.__anext__())
                    except TimeoutError:
                        pass
                reset_changes = [c for c in seen if c.kind == "reset"]
                deletes = [c for c in seen if c.kind == "delete"]
            # settle: the pair rejoined, the client follows it; still one event
            await clone.set(keys[0], b"again", wait=True, timeout_s=30)
            assert len(resets) == 1
            info = resets[0]
            assert info.shard == "s1" and info.old_seq == before
            assert info.keys_lost == 3 and info.keys_after == 0
            assert info.new_generation != info.old_generation
            assert len(reset_changes) == 1 and reset_changes[0].shard == "s1"
            assert deletes == []
            assert clone.get(other) == b"kept"  # other shards are untouched
            stats = clone.stats()
            assert stats["resets"] == 1

    asyncio.run(main())
