"""Servers drop and count KVSETs for keys they do not own (``--routing`` + ``--shard-index``).

Real ``python -m clonemap.shards`` processes, raw pyzmq sockets: a standalone server with a 4-shard
routing publishes only the keys its index owns (pinned, hashed, flat, with a TTL) and
counts the others ``not_owner``; a Binary Star passive does not hold a non-owned KVSET in
its pending table; bad ``--routing`` arguments exit 2; the supervisor passes every server
the plan's routing and its shard index. Counters are read from the SIGUSR1 ``stats``
line, as in test_server_hostile.py.
"""
from __future__ import annotations

import json
import time

import pytest

from clonemap.shards.common.routing import ShardMap
from test_pair import DEADLINE_S, Updates, Writer, start_pair, two_bases
from test_server_conformance import SEQ, Peer, start_server
from test_server_hostile import stats_now

INDEX = 2
SHARD_MAP = ShardMap(4, {INDEX: ["/probe/", "/mine/"], 1: ["/mine/other/"],
                         3: ["/theirs/"]})
ROUTING = json.dumps(SHARD_MAP.describe())


def keys_by_owner(owned: bool, count: int, form: str) -> list[bytes]:
    """``count`` hashed keys (``form`` % n) that shard INDEX owns, or does not."""
    out = []
    n = 0
    while len(out) < count:
        key = (form % n).encode()
        if (SHARD_MAP.owner(key) == INDEX) == owned:
            out.append(key)
        n += 1
    return out


OWNED = [b"/mine/a", b"/mine/other", b"/mine/otherx/1",
         *keys_by_owner(True, 6, "/seg%d/x"), *keys_by_owner(True, 6, "/k%08d"),
         *keys_by_owner(True, 2, "cfg%d/y")]
NOT_OWNED = [b"/mine/other/z", b"/theirs/a", *keys_by_owner(False, 6, "/seg%d/x"),
             *keys_by_owner(False, 6, "/k%08d"), *keys_by_owner(False, 2, "cfg%d/y")]


def test_owned_keys_are_published_others_dropped_and_counted(procs, port_base, zctx):
    server = start_server(procs, port_base, "--routing", ROUTING, "--shard-index", str(INDEX))
    peer = Peer(zctx, port_base)
    base = peer.sync()
    # interleaved, twice (the second time every routing slot is cached)
    for _ in range(2):
        for i in range(max(len(OWNED), len(NOT_OWNED))):
            if i < len(OWNED):
                peer.kvset(OWNED[i], b"v")
            if i < len(NOT_OWNED):
                peer.kvset(NOT_OWNED[i], b"v")
    # the slow path (properties) applies the same rule
    peer.kvset(b"/mine/ttl", b"t", b"U" * 16, b"ttl=60\n")
    peer.kvset(b"/theirs/ttl", b"t", b"V" * 16, b"ttl=60\n")
    got = [peer.recv_update() for _ in range(2 * len(OWNED) + 1)]
    assert [m[0] for m in got] == OWNED * 2 + [b"/mine/ttl"]
    assert [SEQ.unpack(m[1])[0] for m in got] == list(range(base + 1, base + len(got) + 1))
    items, seq, _ = peer.snapshot()
    assert seq == base + len(got)
    assert {k for k in items if not k.startswith(b"/probe/")} == {*OWNED, b"/mine/ttl"}
    stats = stats_now(server)
    assert stats["drops"] == {"not_owner": 2 * len(NOT_OWNED) + 1}
    assert stats["routing"]["shard_index"] == INDEX and stats["routing"]["shards"] == 4
    assert stats["handler_errors"] == 0
    assert any("dropped (not_owner)" in line for line in server.stderr)


def test_without_routing_the_server_owns_every_key(procs, port_base, zctx):
    server = start_server(procs, port_base)
    peer = Peer(zctx, port_base)
    base = peer.sync()
    for key in NOT_OWNED:
        peer.kvset(key, b"v")
    got = [peer.recv_update()[0] for _ in NOT_OWNED]
    assert got == NOT_OWNED
    stats = stats_now(server)
    assert stats["drops"] == {} and stats["routing"] is None
    assert stats["seq"] == base + len(NOT_OWNED)


def test_a_passive_does_not_hold_keys_its_shard_does_not_own(procs, port_base, zctx):
    p, b = two_bases(port_base)
    routing = ("--routing", ROUTING, "--shard-index", str(INDEX))
    primary, backup, watch = start_pair(procs, zctx, p, b, *routing)
    updates = Updates(zctx, p)
    updates.connected()
    writer = Writer(zctx, [p, b])
    foreign = writer.kvset(b"/theirs/x", b"no")
    mine = writer.kvset(b"/mine/x", b"yes")
    msg = updates.wait(lambda m: m.uuid == mine, what="(owned key)")
    assert msg.key == b"/mine/x"
    assert all(m.uuid != foreign for m in updates.got)
    watch[b].wait_seq(msg.seq)  # the passive's replica has the owned update
    # The passive heard both KVSETs: the owned one is matched by the active's KVPUB, the
    # other is never held (without the rule it would wait in pending for its max age).
    deadline = time.monotonic() + DEADLINE_S
    while True:
        backup_stats = stats_now(backup)
        if backup_stats["drops"].get("not_owner") == 1 and backup_stats["pending"] == 0:
            break
        assert time.monotonic() < deadline, backup_stats
    assert stats_now(primary)["drops"] == {"not_owner": 1}


@pytest.mark.parametrize("args, message", [
    (["--routing", ROUTING], "go together"),
    (["--shard-index", "1"], "go together"),
    (["--routing", "{nope", "--shard-index", "0"], "not JSON"),
    (["--routing", json.dumps({**SHARD_MAP.describe(), "version": 9}), "--shard-index", "0"],
     "version"),
    (["--routing", ROUTING, "--shard-index", "4"], "not a shard"),
    (["--routing", "@/nonexistent/routing.json", "--shard-index", "0"], "cannot read"),
])
def test_bad_routing_arguments_exit_2(procs, port_base, args, message):
    proc = procs.python("-m", "clonemap.shards", "--port", str(port_base), *args)
    assert proc.wait(15) == 2
    assert message in "\n".join(proc.stderr)


def test_routing_from_a_file_and_a_whole_cluster_map(procs, port_base, zctx, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"cluster": "t", "routing": SHARD_MAP.describe()}))
    server = start_server(procs, port_base, "--routing", f"@{path}", "--shard-index",
                          str(INDEX))
    peer = Peer(zctx, port_base)
    peer.sync()
    peer.kvset(b"/theirs/y", b"v")
    peer.kvset(b"/mine/y", b"v")
    assert peer.recv_update()[0] == b"/mine/y"
    assert stats_now(server)["drops"] == {"not_owner": 1}


def test_the_supervisor_passes_each_server_the_plan_routing_and_its_index(tmp_path):
    from clonemap.shards.common.hostfacts import load_host_facts
    from clonemap.shards.common.placement import load_plan
    from clonemap.supervisor.runner import Runner, ServerArgs
    from conftest import ROOT as root

    plan = load_plan(root / "configs" / "16core-2nic.yaml",
                     load_host_facts(root / "configs" / "hosts" / "16core-2nic.yaml"))
    runner = Runner(plan, tmp_path, ServerArgs(control="tcp://127.0.0.1:5555",
                                               heartbeat_s=0.5, parent_pid=42))
    pins = {i: list(sh.prefixes) for i, sh in enumerate(plan.shards) if sh.prefixes}
    want = ShardMap(len(plan.shards), pins)
    assert len(runner.servers) == 2 * len(plan.shards)
    for proc in runner.servers.values():
        argv = proc.argv
        routing = ShardMap.from_description(json.loads(argv[argv.index("--routing") + 1]))
        assert routing == want
        assert argv[argv.index("--shard-index") + 1] == str(proc.plan.index)

