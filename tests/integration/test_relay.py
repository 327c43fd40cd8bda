"""Relays as users run them: clients through relays converge with direct clients under
writes; a failover of the shard under a relay costs its clients no snapshot (the relay
resumes upstream once); a relay killed sends its clients to the other relay; under
``supervisor start`` the cluster map lists relays and ``Clone(control=..., via="relays")``
uses them. Snapshots are counted where they are served (the servers' and the relays' own
stats), never inferred.
"""
from __future__ import annotations

import json
import signal
import subprocess

import pytest
import yaml

from conftest import wait_until as wait_for
from clonemap.client.api import Clone
from conftest import PYTHON, ROOT, free_port_base
from clonemap.shards.common.mdp.client import SyncMdpClient
from test_pair import ACTIVE, PASSIVE, Watcher
from test_pair import start_server as start_pair_server
from test_supervisor_cli import start, status, wait_status, write_config

pytestmark = pytest.mark.timeout(180)
DEADLINE_S = 30.0
CLIENTS = 12




def stats_of(proc) -> dict:
    """A server's or relay's stats: SIGUSR1 makes it log ``stats {json}``."""
    mark = len(proc.stderr)
    proc.signal(signal.SIGUSR1)
    line = wait_for(lambda: next((x for x in proc.stderr[mark:] if " stats {" in x), None),
                    "stats line")
    return json.loads(line.split(" stats ", 1)[1])


@pytest.fixture
def pair(procs, zctx):
    primary, backup = free_port_base(4), free_port_base(4)
    procs_ = (start_pair_server(procs, primary, "primary", backup),
              start_pair_server(procs, backup, "backup", primary))
    Watcher(zctx, primary).wait_state(ACTIVE)
    Watcher(zctx, backup).wait_state(PASSIVE)
    return procs_, [f"tcp://127.0.0.1:{primary}", f"tcp://127.0.0.1:{backup}"]


def start_relay(procs, servers: list[str], *extra: str):
    port = free_port_base(4)
    upstream = ",".join(s.removeprefix("tcp://") for s in servers)
    proc = procs.python("-m", "clonemap.shards.relay", "--port", str(port), "--heartbeat-s", "0.2",
                        "--upstream", upstream, *extra, ready="READY")
    proc.address = f"tcp://127.0.0.1:{port}"
    return proc


def test_clients_through_relays_converge_with_direct_clients_under_writes(procs, pair):
    (_, _), servers = pair
    relays = [start_relay(procs, servers), start_relay(procs, servers)]
    with Clone(servers, heartbeat_s=0.2, codec="bytes") as direct, \
            Clone([r.address for r in relays], via="relays", heartbeat_s=0.2,
                  codec="bytes") as via:
        for i in range(3000):  # through both: half the writes enter at a relay
            (via if i % 2 else direct).set(f"/c/{i % 500}", b"%d" % i, wait=(i % 500 == 0))
        direct.set("/c/end", b"end", wait=True)
        via.set("/c/end2", b"end2", wait=True)
        wait_for(lambda: via.get("/c/end") == b"end" and direct.get("/c/end2") == b"end2",
                 "both ends")
        assert dict(via.items()) == dict(direct.items())
        assert len(direct) == 502


def test_a_shard_failover_under_a_relay_costs_its_clients_no_snapshot(procs, pair):
    (primary, backup), servers = pair
    relay = start_relay(procs, servers)
    clients = [Clone(relay.address, heartbeat_s=0.2, codec="bytes") for _ in range(CLIENTS)]
    try:
        with Clone(servers, heartbeat_s=0.2, codec="bytes") as writer:
            for i in range(200):
                writer.set(f"/f/{i}", b"before", wait=(i == 199))
            wait_for(lambda: all(c.get("/f/199") == b"before" for c in clients), "copies")
            before = stats_of(relay)
            served_before = before["snapshots_served"]
            primary.popen.kill()  # the active dies; the writer votes at the backup
            for i in range(50):
                writer.set(f"/f/{i}", b"after", wait=True)
            wait_for(lambda: all(c.get("/f/49") == b"after" for c in clients),
                     "the writes after the failover at every relay client")
            for c in clients:
                shard = c.stats()["shards"][0]
                assert (shard["snapshots"], shard["failovers"], shard["resets"]) == (1, 0, 0)
                assert dict(c.items()) == dict(writer.items())
        relay_stats = stats_of(relay)
        backup_stats = stats_of(backup)
        assert relay_stats["snapshots_served"] == served_before  # no client asked again
        assert relay_stats["upstream_switches"] == 1
        assert relay_stats["replica"]["resumes"] == 1  # the relay resumed, once
        # ... into the backup's term: its clients of either term may resume at the relay
        assert relay_stats["terms"] == [before["upstream_term"], relay_stats["upstream_term"]]
        assert relay_stats["upstream_term"] > before["upstream_term"] > 0
        assert relay_stats["full_syncs"] == 1  # its first copy only
        # the shard's backup served the relay's one resume, and nothing to its clients
        assert backup_stats["snapshots_served"] <= 2
    finally:
        for c in clients:
            c.close()


def test_a_relay_killed_sends_its_clients_to_the_other_relay(procs, pair):
    (_, _), servers = pair
    relays = [start_relay(procs, servers), start_relay(procs, servers)]
    order = [r.address for r in relays]
    with Clone(order, via="relays", heartbeat_s=0.2, codec="bytes") as reader, \
            Clone(servers, heartbeat_s=0.2, codec="bytes") as writer:
        writer.set("/k/a", b"1", wait=True)
        wait_for(lambda: reader.get("/k/a") == b"1", "the first copy")
        followed = reader.stats()["shards"][0]["server"]
        victim = relays[order.index(followed)]
        victim.popen.kill()
        for i in range(30):
            writer.set(f"/k/{i}", b"after", wait=True)
        reader.set("/k/from-reader", b"r", wait=True)  # writes go on through the other
        wait_for(lambda: reader.get("/k/29") == b"after", "the other relay's updates")
        # the reader's wait=True saw its own echo (through the relay); the writer's copy
        # gets the same KVPUB on its own subscription, in its own time
        wait_for(lambda: writer.get("/k/from-reader") == b"r", "the writer's copy of it")
        shard = reader.stats()["shards"][0]
        assert shard["failovers"] == 1 and shard["server"] != followed
        assert dict(reader.items()) == dict(writer.items())


def test_relays_under_the_supervisor_are_in_the_map_and_used_via_relays(procs, tmp_path):
    config, control = write_config(tmp_path, "2shard.yaml", relays={"per_shard": 2})
    data = yaml.safe_load(config.read_text())
    data["relays"]["port_base"] = free_port_base(20)
    config.write_text(yaml.safe_dump(data))
    start(procs, config, tmp_path)
    rows = wait_status(control, lambda rows: all(
        rows[f"s{i}/relay{j}"]["bstar"] == "RELAY" for i in range(2) for j in range(2)))
    assert len(rows) == 8
    with SyncMdpClient(control, timeout_s=5) as mdp:
        doc = json.loads(mdp.request("cluster.map")[-1])
    assert [len(sh["relays"]) for sh in doc["shards"]] == [2, 2]
    with Clone(control=control, via="relays", codec="bytes") as via, \
            Clone(control=control, codec="bytes") as direct:
        for i in range(40):
            via.set(f"/s{i}/k", b"v", wait=True)
        relay_ports = {r["port"] for sh in doc["shards"] for r in sh["relays"]}
        assert {int(s["server"].rsplit(":", 1)[1]) for s in via.stats()["shards"]} <= \
            relay_ports
        wait_for(lambda: len(direct) == 40, "the writes at a direct client")
    # chp --via relays: the same map, read through the relays (which names the server)
    out = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--control", control, "--via",
                          "relays", "which", "/s7/k", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert int(json.loads(out.stdout)["active"].rsplit(":", 1)[1]) in relay_ports
    out = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--control", control, "--via",
                          "relays", "keys"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 40, out
    rows = status(control)
    assert all(rows[f"s{i}/relay{j}"]["keys"] is not None for i in range(2) for j in range(2))


def test_metadata_through_a_relay_and_conditional_writes_refused_there(procs, pair):
    """A relay re-serves each key's own sequence (its KVSYNCs and KVPUBs carry the
    shard's), so ``meta`` through it equals ``meta`` direct; a conditional write through
    it is refused before it leaves (a relay does not decide writes: no ``cas=1``)."""
    from clonemap.client.errors import NotSupported

    (_, _), servers = pair
    relay = start_relay(procs, servers)
    with Clone(servers, heartbeat_s=0.2, codec="bytes") as direct:
        first = direct.set("/m/a", b"1", create=True)
        for i in range(20):
            direct.set(f"/m/{i}", b"x", wait=(i == 19))
        second = direct.set("/m/a", b"2", if_seq=first)
        with Clone(relay.address, via="relays", heartbeat_s=0.2, codec="bytes") as via:
            wait_for(lambda: via.get("/m/a") == b"2", "the relay's copy")
            assert via.meta("/m/a").seq == second == direct.meta("/m/a").seq
            assert via.meta("/m/7").seq == direct.meta("/m/7").seq
            with pytest.raises(NotSupported, match="cas=1"):
                via.set("/m/a", b"3", if_seq=second)
            assert direct.get("/m/a") == b"2"


def test_a_relay_runs_the_io_threads_it_is_given(procs, pair):
    """``--io-threads``: the relay's clients' connections spread over that many libzmq
    I/O threads, read from /proc as for a server (test_io_threads.py)."""
    from test_io_threads import io_threads_of

    _, servers = pair
    relay = start_relay(procs, servers, "--io-threads", "2")
    assert io_threads_of(relay.pid) == ["ZMQbg/IO/0", "ZMQbg/IO/1"]
