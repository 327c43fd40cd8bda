"""Per-prefix read and write rights, enforced by every server of a ``supervisor start``ed
CURVE cluster, tried by real clients of several identities and by raw ZeroMQ peers that
hold an identity's key and try every entrance outside its rights.

The cluster (two shards, each a Binary Star pair) names three identities::

    dashboard  reader   read "/", deny "/secrets/"
    orders     orders   read "/orders/" and "/config/", write "/orders/"
    ops        admin    read and write everything, admin

Every claim about data is checked by a fresh ``ops`` client (or the shared client pair)
reading back after the fact; every claim about what a peer received is checked against
a ledger of what it was sent.
"""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
import zmq

from clonemap.client.api import Clone, ReadRefused, WriteRefused
from clonemap.shards.common.errors import Exit
from clonemap.shards.common.proto import chp
from clonemap.shards.common.security import Security
from clonemap.supervisor.control import Control
from conftest import PYTHON, ROOT, Procs, wait_until
from test_supervisor_cli import cli, start, wait_status, write_config

pytestmark = pytest.mark.timeout(180)

SECURITY = {
    "curve": True,
    "clients": {"dashboard": {"role": "reader"}, "orders": {"role": "orders"},
                "ops": {"role": "admin"}},
    "roles": {"reader": {"read": ["/"], "deny": ["/secrets/"]},
              "orders": {"read": ["/orders/", "/config/"], "write": ["/orders/"]},
              "admin": {"read": [""], "write": [""], "admin": True}},
}
SEEDED = {"/orders/1": b"o1", "/config/limits": b"c1", "/users/ann": b"u1",
          "/secrets/root": b"s1", "/public/motd": b"p1"}
READABLE = {"dashboard": {k for k in SEEDED if not k.startswith("/secrets/")},
            "orders": {"/orders/1", "/config/limits"}}


class Cluster:
    def __init__(self, config, control, keys):
        self.config, self.keys = config, keys
        self.control = Control(control, Security.load(keys, "client"))

    def clone(self, identity: str | None = None, **kw) -> Clone:
        return Clone(config=str(self.config), identity=identity, codec="bytes", **kw)

    def rows(self, predicate=lambda rows: True, timeout_s: float = 30.0) -> dict:
        return wait_status(self.control, predicate, timeout_s=timeout_s)

    def servers(self) -> dict[str, tuple[str, int]]:
        return {name: (row["address"], row["port"]) for name, row in self.rows().items()}

    def security(self, identity: str) -> Security:
        return Security.load(self.keys, "client", identity)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("access")
    config, control = write_config(tmp, "2shard.yaml", security=SECURITY,
                                   relays={"per_shard": 1})
    assert cli("keygen", str(config)).returncode == 0
    procs = Procs()
    try:
        start(procs, config, tmp)
        made = Cluster(config, control, config.parent / "keys")
        made.rows(lambda r: all(x["state"] == "RUNNING" for x in r.values())
                  and sum(x["bstar"] == "ACTIVE" for x in r.values()) == 2)
        with made.clone("ops") as ops:
            for key, value in SEEDED.items():
                ops.set(key, value, wait=True)
        yield made
        assert cli("stop", str(config), "--identity", "ops").returncode == 0
    finally:
        procs.stop_all()


def run_chp(cluster: Cluster, identity: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CLONEMAP_IDENTITY"}
    return subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--config",
                           str(cluster.config), "--identity", identity, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


def access_counts(cluster: Cluster, identity: str, what: str) -> dict[str, int]:
    """Each server's count of ``what`` refused (or narrowed) for ``identity``."""
    return {name: ((row.get("stats") or {}).get("access") or {}).get(
        "by_identity", {}).get(identity, {}).get(what, 0)
        for name, row in cluster.rows().items()}


def fresh_map(cluster: Cluster) -> dict[str, bytes]:
    with cluster.clone("ops") as ops:
        return dict(ops.items())


# ------------------------------------------------------------------ writes

def test_a_reader_s_writes_are_refused_answered_and_applied_nowhere(cluster):
    shard = shard_of(cluster, "/public/motd")
    active, _, _ = _active(cluster, shard)
    passive = next(f"{shard}/{r}" for r in ("primary", "backup") if f"{shard}/{r}" != active)
    before = access_counts(cluster, "dashboard", "writes_refused")
    with cluster.clone("dashboard") as reader:
        with pytest.raises(WriteRefused) as refused:
            reader.set("/public/motd", b"defaced", wait=True)
        assert refused.value.forbidden and refused.value.exit_code == Exit.FORBIDDEN
        assert "identity 'dashboard' may not write '/public/motd'" in str(refused.value)
        assert "no write prefix covers it" in str(refused.value)
        with pytest.raises(WriteRefused, match="dashboard"):
            reader.set("/public/new", b"x", create=True)
        for i in range(50):  # fire-and-forget: dropped and counted, never answered
            reader.set(f"/public/ff{i}", b"x")
        reader.flush()
        # the active counts every one; the passive drops (and counts) what reaches it,
        # never holding one for a takeover (a client sends a passive its copy only
        # once that collector is subscribed)
        wait_until(lambda: (now := access_counts(cluster, "dashboard", "writes_refused"))[
            active] - before[active] >= 52 and now[passive] > before[passive],
                   "the refused writes counted by both servers of the pair")
    out = run_chp(cluster, "dashboard", "set", "/public/motd", "defaced")
    assert out.returncode == Exit.FORBIDDEN, (out.stdout, out.stderr)
    assert "may not write '/public/motd'" in out.stderr
    got = fresh_map(cluster)
    assert got["/public/motd"] == b"p1"
    assert not [k for k in got if k.startswith("/public/") and k != "/public/motd"]


def test_a_writer_of_orders_writes_orders_and_nothing_else(cluster):
    with cluster.clone("orders") as writer:
        writer.set("/orders/2", b"o2", wait=True)
        seq = writer.set("/orders/3", b"o3", create=True)
        assert seq > 0
        with pytest.raises(WriteRefused) as refused:
            writer.set("/users/ann", b"stolen", wait=True)
        assert "it may write '/orders/'" in str(refused.value)
        with pytest.raises(WriteRefused):
            writer.delete("/config/limits", wait=True)
    got = fresh_map(cluster)
    assert got["/orders/2"] == b"o2" and got["/orders/3"] == b"o3"
    assert got["/users/ann"] == b"u1" and got["/config/limits"] == b"c1"


# ------------------------------------------------------------------ reads

def test_snapshots_are_narrowed_to_each_identity_s_rights(cluster):
    for identity, readable in READABLE.items():
        with cluster.clone(identity) as clone:
            seeded = {k for k in clone.keys() if k in SEEDED}
            assert seeded == readable, identity
            assert all(k.startswith(("/orders/", "/config/")) for k in clone.keys()) \
                or identity != "orders"
            assert any(a.narrowed for a in clone._async.agents), identity
    with cluster.clone() as legacy:  # the shared client pair: every key, as before
        assert set(SEEDED) <= set(legacy.keys())


def test_a_subtree_wholly_outside_the_rights_is_refused_by_name(cluster):
    with pytest.raises(ReadRefused) as refused:
        with cluster.clone("orders", subtree="/users/"):
            pass
    assert refused.value.exit_code == Exit.FORBIDDEN
    assert "refused the snapshot of '/users/'" in str(refused.value)
    assert "may read nothing under it" in str(refused.value)
    out = run_chp(cluster, "orders", "get", "/users/ann")
    assert out.returncode == Exit.FORBIDDEN, (out.stdout, out.stderr)


def _raw_snapshot(ctx, cluster, identity, address, subtree=b"", since=None, gen=""):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    cluster.security(identity).connect_side(sock)
    sock.connect(f"tcp://{address[0]}:{address[1]}")
    try:
        sock.send_multipart(chp.icanhaz(subtree, since, gen) if since is not None
                            else chp.icanhaz(subtree))
        keys = []
        while True:
            assert sock.poll(10_000), "no KTHXBAI"
            frames = sock.recv_multipart()
            if frames[0] == chp.KTHXBAI:
                return keys, frames
            keys.append(frames[0].decode())
    finally:
        sock.close()


def _active(cluster, shard):
    rows = cluster.rows(lambda r: any(r[f"{shard}/{x}"]["bstar"] == "ACTIVE"
                                      for x in ("primary", "backup")))
    name = next(f"{shard}/{x}" for x in ("primary", "backup")
                if rows[f"{shard}/{x}"]["bstar"] == "ACTIVE")
    return name, (rows[name]["address"], rows[name]["port"]), rows[name]


def test_a_raw_peer_s_snapshot_and_resume_hold_only_readable_keys(cluster, zctx):
    for shard in ("s0", "s1"):
        _, address, row = _active(cluster, shard)
        keys, kthxbai = _raw_snapshot(zctx, cluster, "dashboard", address)
        assert not [k for k in keys if k.startswith("/secrets/")]
        assert set(keys) >= {k for k in READABLE["dashboard"]
                             if k in fresh_map(cluster) and shard_of(cluster, k) == shard}
        assert b"narrowed=1" in kthxbai[3]  # its rights reach only part of ""
        _, whole = _raw_snapshot(zctx, cluster, "dashboard", address, b"/public/")
        assert b"narrowed=1" not in whole[3]  # all of "/public/" is readable
        # a resume from sequence 0 of this map: every update since, narrowed the same way
        gen = row["stats"]["generation"]
        keys, kthxbai = _raw_snapshot(zctx, cluster, "dashboard", address, since=0, gen=gen)
        assert not [k for k in keys if k.startswith("/secrets/")]
        _, refused = _raw_snapshot(zctx, cluster, "orders", address, b"/users/")
        assert b"refused=read" in refused[3]


def _metrics(cluster) -> str:
    import urllib.request

    import yaml

    address = yaml.safe_load(cluster.config.read_text())["metrics"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return reply.read().decode()


def shard_of(cluster, key):
    with cluster.clone("ops") as ops:
        return f"s{ops._async.cluster.shard_map.owner(key.encode())}"


def test_a_raw_subscriber_receives_no_forbidden_key_over_a_burst(cluster, zctx):
    """A reader's raw SUB on every publisher subscribes to "" (everything) and to
    "/secrets/" (forbidden); ops then writes a burst over every prefix. Ledger: every
    update the SUBs received, by key."""
    subs = []
    for name, address in cluster.servers().items():
        sub = zctx.socket(zmq.SUB)
        sub.linger = 0
        cluster.security("dashboard").connect_side(sub)
        sub.subscribe(b"")
        sub.subscribe(b"/secrets/")
        sub.connect(f"tcp://{address[0]}:{address[1] + 1}")
        subs.append(sub)
    # a HUGZ reaches each: every subscription is applied (a reader may read something)
    for sub in subs:
        assert sub.poll(10_000), "no HUGZ to a reader's subscription"
    received: dict[str, int] = {}
    prefixes = ("/secrets/", "/public/", "/orders/", "/users/")
    written = 0
    with cluster.clone("ops") as ops:
        for i in range(200):
            for prefix in prefixes:
                ops.set(f"{prefix}burst{i}", b"v%d" % i)
                written += 1
        for prefix in prefixes:  # each shard applied the whole burst (in order)
            ops.set(f"{prefix}zz-end", b"end", wait=True)
    readable = ("/public/burst", "/orders/burst", "/users/burst")

    def allowed() -> list[str]:
        return [k for k in received if k.startswith(readable)]

    # each shard's publisher delivers in order, but the shards are independent: wait
    # for every readable update (or the deadline), not for the last write alone
    deadline = time.monotonic() + 20
    while len(allowed()) < 600 and time.monotonic() < deadline:
        for sub in subs:
            while sub.poll(10):
                key = sub.recv_multipart()[0].decode()
                received[key] = received.get(key, 0) + 1
    for sub in subs:
        while sub.poll(200):  # and whatever else comes, forbidden keys included
            key = sub.recv_multipart()[0].decode()
            received[key] = received.get(key, 0) + 1
        sub.close()
    forbidden = {k: n for k, n in received.items() if k.startswith("/secrets/")}
    assert forbidden == {}, forbidden
    assert len(allowed()) == 600, len(allowed())  # every readable update of the burst
    assert received.get("HUGZ", 0) >= 1
    assert sum(access_counts(cluster, "dashboard", "subscriptions_narrowed").values()) >= 4


def test_a_subscription_wholly_forbidden_is_refused_and_receives_nothing(cluster, zctx):
    name, address, _ = _active(cluster, "s0")
    before = access_counts(cluster, "orders", "subscriptions_refused")[name]
    sub = zctx.socket(zmq.SUB)
    sub.linger = 0
    cluster.security("orders").connect_side(sub)
    sub.subscribe(b"/users/")
    sub.connect(f"tcp://{address[0]}:{address[1] + 1}")
    wait_until(lambda: access_counts(cluster, "orders", "subscriptions_refused")[name]
               > before, "the subscription to /users/ refused")
    with cluster.clone("ops") as ops:
        for i in range(50):
            ops.set(f"/users/u{i}", b"x")
        ops.set("/users/end", b"x", wait=True)
    got = []
    while sub.poll(500):
        got.append(sub.recv_multipart()[0])
    sub.close()
    assert got == []


def test_the_hostile_peer_gets_nothing_outside_its_rights_at_any_entrance(cluster, zctx):
    """``orders`` with its valid key, raw: KVSETs to every collector outside its rights
    (plain, with a reply asked, conditional), snapshots and resumes of the whole map and
    of forbidden subtrees, subscriptions to "" and forbidden prefixes, and the control
    commands. Ledger: every key it received; every key it wrote, read back by ops."""
    security = cluster.security("orders")
    rows = cluster.rows()
    received: set[str] = set()
    for name, row in rows.items():
        host, port = row["address"], row["port"]
        pub = zctx.socket(zmq.XPUB)  # what a writer uses (clonemap.client.collector)
        pub.linger = 2000  # every hostile KVSET is delivered before the socket goes
        security.connect_side(pub)
        pub.connect(f"tcp://{host}:{port + 2}")
        assert pub.poll(10_000), "the collector never subscribed"
        pub.recv()
        for i, key in enumerate((b"/users/evil", b"/config/limits", b"/secrets/x",
                                 b"/ordersX", b"")):
            pub.send_multipart(chp.kvset(key, b"hostile"))
            pub.send_multipart(chp.kvset(key, b"hostile", chp.resendable_uuid(),
                                         chp.write_props(0, b"\x01\x02")))
        pub.close()
        # the pair's own command for its TTL tables (they name every key): dropped
        dealer = zctx.socket(zmq.DEALER)
        dealer.linger = 0
        security.connect_side(dealer)
        dealer.connect(f"tcp://{host}:{port}")
        dealer.send(b"BSTAR-TTL?")
        assert not dealer.poll(500), dealer.recv_multipart()
        dealer.close()
        for subtree in (b"", b"/users/", b"/secrets/", b"/config/") * (
                row["bstar"] == "ACTIVE"):  # (a passive answers no ICANHAZ at all)
            keys, _ = _raw_snapshot(zctx, cluster, "orders", (host, port), subtree)
            received.update(keys)
            keys, _ = _raw_snapshot(zctx, cluster, "orders", (host, port), subtree, since=0)
            received.update(keys)
        sub = zctx.socket(zmq.SUB)
        sub.linger = 0
        security.connect_side(sub)
        for topic in (b"", b"/", b"/users/", b"/secrets/", b"H"):
            sub.subscribe(topic)
        sub.connect(f"tcp://{host}:{port + 1}")
        with cluster.clone("ops") as ops:
            ops.set("/users/bait", b"b", wait=True)
            ops.set("/secrets/bait", b"b", wait=True)
            ops.set("/orders/bait", b"b", wait=True)
        while sub.poll(300):
            received.add(sub.recv_multipart()[0].decode())
        sub.close()
    assert sum(access_counts(cluster, "orders", "commands_refused").values()) >= 1
    # every reader subscribes to the HUGZ prefix: a key under it is refused to everyone
    with cluster.clone("ops") as ops:
        with pytest.raises(WriteRefused, match="starts with HUGZ"):
            ops.set("HUGZ/leak", b"x", wait=True)
    assert "HUGZ/leak" not in fresh_map(cluster)
    metrics = _metrics(cluster)  # the same counts, for Prometheus
    assert re.search(r'clonemap_access_refused_total\{[^}]*identity="orders"[^}]*'
                     r'what="writes_refused"[^}]*\} [1-9]', metrics), metrics[-3000:]
    for args in (("kill", "s0/primary"), ("restart", "s1/backup"), ("stop",)):
        out = cli(*args, str(cluster.config), "--identity", "orders")
        assert out.returncode == Exit.FORBIDDEN, (args, out.stderr)
    readable = {k for k in received if k.startswith(("/orders/", "/config/")) or k == "HUGZ"}
    assert received - readable == set(), sorted(received - readable)
    assert "/orders/bait" in received  # the subscriptions did deliver what it may read
    got = fresh_map(cluster)
    assert got["/config/limits"] == b"c1" and "/users/evil" not in got
    assert not [k for k, v in got.items() if v == b"hostile"]
    assert all(row["state"] == "RUNNING" for row in cluster.rows().values())


def test_after_a_failover_refused_writes_are_still_absent(cluster):
    """The passive dropped every refused write; after it takes over, a fresh client's
    map holds every acknowledged write (the ledger) and no refused one."""
    ledger = {}
    with cluster.clone("orders") as writer, cluster.clone("dashboard") as reader:
        for i in range(20):
            key = f"/orders/ledger{i}"
            writer.set(key, b"L%d" % i, wait=True)
            ledger[key] = b"L%d" % i
            reader.set(f"/orders/forged{i}", b"forged")
        reader.flush()
    name, _, row = _active(cluster, shard_of(cluster, "/orders/ledger0"))
    pid = row["pid"]
    assert cli("kill", name, str(cluster.config), "--identity", "ops").returncode == 0
    shard = name.split("/")[0]
    cluster.rows(lambda r: any(r[f"{shard}/{x}"]["bstar"] == "ACTIVE"
                               and r[f"{shard}/{x}"]["pid"] != pid
                               for x in ("primary", "backup")), timeout_s=60)
    got = fresh_map(cluster)
    assert {k: got.get(k) for k in ledger} == ledger
    assert not [k for k in got if k.startswith("/orders/forged")]
    cluster.rows(lambda r: all(x["state"] == "RUNNING" for x in r.values())
                 and all(x["bstar"] in ("ACTIVE", "PASSIVE") for n, x in r.items()
                         if "relay" not in n), timeout_s=60)


def test_relays_enforce_the_same_rights_for_their_own_clients(cluster, zctx):
    """Through the relays: a reader's map and raw subscription hold no forbidden key, a
    writer's forbidden writes are refused at the relay (never forwarded: the servers
    never count them) and its allowed ones arrive."""
    relays = {n: r for n, r in cluster.rows().items() if "relay" in n}
    assert len(relays) == 2, sorted(cluster.rows())
    before = access_counts(cluster, "orders", "writes_refused")
    subs = []
    for row in relays.values():
        sub = zctx.socket(zmq.SUB)
        sub.linger = 0
        cluster.security("dashboard").connect_side(sub)
        sub.subscribe(b"")
        sub.connect(f"tcp://{row['address']}:{row['port'] + 1}")
        assert sub.poll(10_000), "no HUGZ from a relay"
        subs.append(sub)
        keys, kthxbai = _raw_snapshot(zctx, cluster, "dashboard",
                                      (row["address"], row["port"]))
        assert not [k for k in keys if k.startswith("/secrets/")]
        assert b"narrowed=1" in kthxbai[3]
    with cluster.clone("dashboard", via="relays") as reader:
        assert not [k for k in reader.keys() if k.startswith("/secrets/")]
        assert "/public/motd" in reader.keys()
    with cluster.clone("orders", via="relays") as writer:
        writer.set("/orders/via-relay", b"r", wait=True)
        for i in range(20):
            writer.set(f"/users/via-relay{i}", b"forged")
        writer.flush()
        wait_until(lambda: sum(access_counts(cluster, "orders", "writes_refused")[n]
                               for n in relays) >= sum(before[n] for n in relays) + 20,
                   "the relay counting the refused writes")
    with cluster.clone("ops") as ops:
        ops.set("/secrets/relayed", b"s", wait=True)
        ops.set("/public/relayed", b"p", wait=True)
    received = set()
    for sub in subs:
        while sub.poll(500):
            received.add(sub.recv_multipart()[0].decode())
        sub.close()
    assert "/public/relayed" in received and "/secrets/relayed" not in received
    after = access_counts(cluster, "orders", "writes_refused")
    assert all(after[n] == before[n] for n in after if "relay" not in n), (before, after)
    got = fresh_map(cluster)
    assert got["/orders/via-relay"] == b"r"
    assert not [k for k in got if k.startswith("/users/via-relay")]


# ------------------------------------------------------------------ the identity's view

def test_each_identity_sees_its_own_rights(cluster):
    out = run_chp(cluster, "orders", "whoami")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "orders (role orders): read /orders/ /config/; write /orders/"
    with cluster.clone("dashboard") as reader:
        rights = reader.rights()
    assert rights["identity"] == "dashboard" and rights["role"] == "reader"
    assert rights["read"] == ["/"] and rights["deny"] == ["/secrets/"]
    assert rights["enforced"] is True and rights["admin"] is False
    with cluster.clone() as legacy:
        assert legacy.rights()["rights"] == "read (every key); write (every key); admin"


def test_a_server_s_own_control_service_takes_a_command_only_from_admin(cluster):
    """``peer-down`` tells a pair's server that its peer cannot serve: a reader may not
    send it (a bare stats request it may)."""
    from clonemap.shards.common.mdp.client import SyncMdpClient

    with SyncMdpClient(str(cluster.control), timeout_s=5.0, retries=0,
                       security=cluster.security("dashboard")) as reader:
        assert json_of(reader.request("shard.s0.primary")[-1])["role"] == "primary"
        refused = reader.request("shard.s0.primary", b"peer-down")
    assert refused[0] == b"403" and b"identity 'dashboard'" in refused[1], refused
    row = cluster.rows()["s0/primary"]
    assert row["stats"]["peer_reported_down"] is False


def json_of(body: bytes) -> dict:
    import json

    return json.loads(body)


def _sub_all_actives(cluster, zctx, identity: str, topic: bytes = b"") -> list:
    subs = []
    for shard in ("s0", "s1"):
        _, address, _ = _active(cluster, shard)
        sub = zctx.socket(zmq.SUB)
        sub.linger = 0
        sub.reconnect_ivl = 100
        cluster.security(identity).connect_side(sub)
        sub.subscribe(topic)
        sub.subscribe(chp.HUGZ)  # as a client does: HUGZ are outside any subtree
        sub.connect(f"tcp://{address[0]}:{address[1] + 1}")
        assert sub.poll(10_000), "no HUGZ"
        subs.append(sub)
    return subs


def _drain(subs, until: str | None = None, timeout_s: float = 10.0) -> set[str]:
    got: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (until is None or until not in got):
        for sub in subs:
            while sub.poll(20):
                got.add(sub.recv_multipart()[0].decode())
        if until is None:
            break
    return got


def test_zz_a_reload_takes_rights_away_from_live_subscriptions(cluster, zctx):
    """Last in the module: it changes the cluster's rights. A reader's live raw
    subscriptions to everything lose /public/ once ``supervisor reload`` applies a
    narrower role; an identity removed from the config is refused from then on; only
    admin may reload; a config that does not validate changes nothing."""
    import yaml

    subs = _sub_all_actives(cluster, zctx, "dashboard")
    revoked = _sub_all_actives(cluster, zctx, "orders", b"/orders/")
    with cluster.clone("ops") as ops:
        ops.set("/public/before", b"1", wait=True)
        ops.set("/orders/before", b"1", wait=True)
    assert {"/public/before", "/orders/before"} <= _drain(subs, "/orders/before")
    assert "/orders/before" in _drain(revoked, "/orders/before")
    data = yaml.safe_load(cluster.config.read_text())
    original = cluster.config.read_text()
    data["security"]["roles"]["reader"] = {"read": ["/orders/"]}
    del data["security"]["clients"]["orders"]
    cluster.config.write_text(yaml.safe_dump(data))
    denied = cli("reload", str(cluster.config), "--identity", "dashboard")
    assert denied.returncode == Exit.FORBIDDEN, denied.stderr
    out = cli("reload", str(cluster.config), "--identity", "ops")
    assert out.returncode == 0, out.stderr
    assert "rights version 2" in out.stdout and "changed: dashboard, orders" in out.stdout
    assert "applied by all 6 servers and relays within" in out.stdout
    print(out.stdout)  # the revocation's time to every server (figures, not asserted)
    got: set[str] = set()
    with cluster.clone("ops") as ops:  # after every server applied version 2
        # the closed connections reconnect (100 ms) and subscribe again: until then
        # nothing reaches them (a PUB drops for a peer that is not there)
        deadline = time.monotonic() + 10
        while not any(k.startswith("/orders/probe") for k in got):
            assert time.monotonic() < deadline, got
            ops.set(f"/orders/probe{len(got)}", b"p", wait=True)
            got |= _drain(subs)
        ops.set("/public/after", b"2", wait=True)
        ops.set("/orders/after", b"2", wait=True)
    got |= _drain(subs, "/orders/after")
    assert "/orders/after" in got, got  # reconnected, subscribed again, narrowed
    assert not [k for k in got if k.startswith("/public/")], got
    # the removed identity's live subscriptions were closed; its reconnections refused
    assert not [k for k in _drain(revoked, timeout_s=1.0) if k.startswith("/orders/")]
    for sub in revoked:
        sub.close()
    for sub in subs:
        sub.close()
    assert sum(r["stats"]["access"]["connections_closed"] for n, r in cluster.rows().items()
               if (r.get("stats") or {}).get("access")) >= 2
    with cluster.clone("dashboard") as reader:
        assert "/public/after" not in reader.keys() and "/orders/after" in reader.keys()
    gone = run_chp(cluster, "orders", "get", "/orders/1")
    assert gone.returncode != 0  # its key is no longer admitted
    cluster.config.write_text("security: [not, a, mapping")
    bad = cli("reload", str(cluster.config), "--identity", "ops")
    assert bad.returncode == 2, bad.stderr
    cluster.config.write_text(original)
    back = cli("reload", str(cluster.config), "--identity", "ops")
    assert back.returncode == 0 and "rights version 3" in back.stdout, back.stderr
    out = run_chp(cluster, "orders", "get", "/orders/1")
    assert (out.returncode, out.stdout.strip()) == (0, "o1"), out.stderr


def test_a_growth_keeps_each_identity_s_rights_on_the_added_shard(procs, tmp_path):
    """``supervisor reshard`` 2 -> 3 of a cluster with named identities (issue 41), run
    by ``ops``: ``orders`` writes its segments with ``wait=True`` through the change,
    and ``dashboard`` (everything but what starts ``/secret``) follows the whole map,
    once from the servers and once through the relays (a relay per shard: the added
    shard's starts once the change flipped).
    Keys are routed by their first segment, so each kind spans 60 segments, some of
    which move to the added shard. After it both clients follow the new routing with
    their own keys; the reader holds every readable key, the added shard's included,
    and not one secret; the writer's ledger reads back whole; the added shard refuses
    the reader's write."""
    import asyncio

    import yaml

    from test_routing_epoch import _grown

    security = {**SECURITY, "roles": {
        "reader": {"read": ["/"], "deny": ["/secret"]},
        "orders": {"read": ["/orders"], "write": ["/orders"]},
        "admin": {"read": [""], "write": [""], "admin": True}}}
    from conftest import free_port_base

    config, control = write_config(tmp_path, "2shard.yaml", heartbeat_s=0.3,
                                   security=security,
                                   relays={"per_shard": 1, "port_base": free_port_base(40)})
    assert cli("keygen", str(config)).returncode == 0
    start(procs, config, tmp_path)
    cluster = Cluster(config, control, config.parent / "keys")
    cluster.rows(lambda r: sum(x["bstar"] == "ACTIVE" for x in r.values()) == 2
                 and len(r) == 6 and all(x["state"] == "RUNNING" for x in r.values()))
    three = _grown(config, tmp_path / "three.yaml")
    assert yaml.safe_load(three.read_text())["security"]["roles"] == security["roles"]
    orders = {f"/orders{i}/k": b"o%d" % i for i in range(60)}
    secrets = {f"/secret{i}/k": b"s%d" % i for i in range(60)}
    public = {f"/pub{i}/k": b"p%d" % i for i in range(60)}
    with cluster.clone("ops") as ops:
        for key, value in {**orders, **secrets, **public}.items():
            ops.set(key, value)
        ops.set("/pub/last", b"x", wait=True)
    public["/pub/last"] = b"x"

    with cluster.clone("dashboard") as reader, cluster.clone("orders") as writer, \
            cluster.clone("dashboard", via="relays") as relayed:
        wait_until(lambda: reader.get("/pub/last") == b"x"
                   and relayed.get("/pub/last") == b"x", "the readers' copies")
        stop = False

        def write() -> None:
            n, started = 0, time.monotonic()
            while not stop:  # (250 a second: a steady load through the change)
                time.sleep(max(0.0, started + n / 250 - time.monotonic()))
                key = f"/orders{n % 60}/k"
                writer.set(key, b"w%d" % n, wait=True, timeout_s=10)
                orders[key] = b"w%d" % n
                n += 1

        async def during() -> subprocess.CompletedProcess:
            nonlocal stop
            task = asyncio.ensure_future(asyncio.to_thread(write))
            done = await asyncio.to_thread(cli, "reshard", str(config), "--to",
                                           str(three), "--yes", "--identity", "ops",
                                           timeout_s=120)
            stop = True
            await task
            return done

        done = asyncio.run(during())
        assert done.returncode == 0, done.stdout + done.stderr
        wait_until(lambda: reader.routing_epoch == 2 and writer.routing_epoch == 2
                   and relayed.routing_epoch == 2, "the clients follow epoch 2")
        routing = reader.cluster.shard_map
        moved = {kind: [k for k in keys if routing.owner(k) == 2] for kind, keys in
                 (("orders", orders), ("secrets", secrets), ("public", public))}
        assert all(moved.values()), moved  # each kind has keys on the added shard
        wait_until(lambda: all(reader.get(k) == v for k, v in orders.items()),
                   "the reader holds the last orders")
        # through the added shard's relay too (it starts once the change flipped)
        wait_until(lambda: all(relayed.get(k) == v for k, v in orders.items()),
                   "the relay reader holds the last orders")
        for copy in (reader, relayed):
            held = dict(copy.items())
            assert not [k for k in held if k.startswith("/secret")]
            assert {k: held.get(k) for k in public} == public
        with pytest.raises(WriteRefused, match="dashboard"):
            reader.set(moved["public"][0], b"defaced", wait=True)
    got = fresh_map(cluster)
    assert {k: got.get(k) for k in orders} == orders
    assert {k: got.get(k) for k in secrets} == secrets
    assert got[moved["public"][0]] == public[moved["public"][0]]
    assert cli("stop", str(config), "--identity", "ops").returncode == 0
