"""Binary Star pairs as real processes: start-up, votes, state exchange, the passive's
replica, empty UUIDs, the control service, --parent-pid and the command line.

Raw pyzmq sockets play the peers: a SUB on each server's P+3 reads its state messages
(``Watcher``), a DEALER sends ICANHAZ (the client's vote), an XPUB writes KVSETs to both
collectors, SUBs on both P+1 read KVPUBs. Every wait is for a message or a line, with a
deadline. The fault tests (kill -9, restart, SIGSTOP, TTL across failover) are in
test_pair_faults.py and use the helpers below.
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid as uuidlib

import pytest
import zmq

from conftest import free_port_base
from clonemap.shards.common.mdp.client import SyncMdpClient
from clonemap.shards.common.proto import bstar as wire
from clonemap.shards.common.proto import bstar_ttl
from clonemap.shards.common.proto import chp

HEARTBEAT_S = 0.2
DEADLINE_S = 10.0
ACTIVE, PASSIVE = wire.State.ACTIVE, wire.State.PASSIVE
PRIMARY, BACKUP = wire.State.PRIMARY, wire.State.BACKUP


# ============================================================================ helpers

def start_server(procs, port: int, role: str, peer: int, *extra: str, shard: str = "t"):
    """A pair server that also exits if this test process dies (``--parent-pid``: a
    killed test run leaves no server behind; a later ``--parent-pid`` in ``extra`` wins)."""
    proc = procs.python("-m", "clonemap.shards", "--port", str(port), f"--{role}", "--peer",
                        f"127.0.0.1:{peer}", "--shard", shard, "--heartbeat-s",
                        str(HEARTBEAT_S), "--log-level", "info", "--parent-pid",
                        str(os.getpid()), *extra, ready="READY")
    proc.port = port
    return proc


def two_bases(port_base: int) -> tuple[int, int]:
    return port_base, free_port_base(4)


def _ms(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))


class Watcher:
    """Reads one server's state messages from its P+3."""

    def __init__(self, zctx, port: int):
        self.port = port
        self.sock = zctx.socket(zmq.SUB)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port + 3}")
        self.last: wire.StateMessage | None = None

    def beats_from_now(self, count: int) -> None:
        """Read ``count`` state messages sent from now on: those queued already (sent
        while nobody read them) go first, unread, so that the ``count`` span about
        ``count - 1`` heartbeats of time from this call. (Read from the queue, seven beats
        could be taken in no time after a setup that had left them there.)"""
        while self.sock.poll(0):
            self.sock.recv_multipart()
        for _ in range(count):
            self.next()

    def next(self, timeout_s: float = DEADLINE_S) -> wire.StateMessage:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.sock.poll(_ms(deadline)):
                raise AssertionError(f"no state message from port {self.port} in "
                                     f"{timeout_s} s")
            frames = self.sock.recv_multipart()
            if not wire.is_confirmation(frames):  # a passive's BSTAR-HAVE: not a state
                self.last = wire.decode(frames)
                return self.last

    def wait(self, pred, timeout_s: float = DEADLINE_S, what: str = "") -> wire.StateMessage:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.next(max(0.0, deadline - time.monotonic()))
            except AssertionError:
                raise AssertionError(f"port {self.port}: no state message with {what} within "
                                     f"{timeout_s} s (last {self.last})") from None
            if pred(msg):
                return msg

    def wait_state(self, state: wire.State, timeout_s: float = DEADLINE_S):
        return self.wait(lambda m: m.state == state, timeout_s, f"state {state.name}")

    def wait_seq(self, seq: int, timeout_s: float = DEADLINE_S):
        return self.wait(lambda m: m.sequence >= seq, timeout_s, f"sequence >= {seq}")


def snapshot(zctx, port: int, timeout_s: float = DEADLINE_S
             ) -> tuple[dict[bytes, bytes], int] | None:
    """ICANHAZ on one DEALER; the map and KTHXBAI's sequence, or None if unanswered."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart(chp.icanhaz())
        deadline = time.monotonic() + timeout_s
        out: dict[bytes, bytes] = {}
        while True:
            if not dealer.poll(_ms(deadline)):
                return None
            reply = chp.decode_snapshot(dealer.recv_multipart())
            if isinstance(reply, chp.Kthxbai):
                return out, reply.seq
            out[reply.key] = reply.value
    finally:
        dealer.close(0)


def vote(zctx, port: int, timeout_s: float = DEADLINE_S) -> tuple[dict[bytes, bytes], int]:
    """Vote (ICANHAZ once per heartbeat, as a failing-over client) until answered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = snapshot(zctx, port, min(HEARTBEAT_S, max(0.01, deadline - time.monotonic())))
        if got is not None:
            return got
    raise AssertionError(f"port {port} answered no ICANHAZ within {timeout_s} s")


class Writer:
    """An XPUB connected to the collectors of both servers (as the client library)."""

    def __init__(self, zctx, ports: list[int], connected: int | None = None):
        self.sock = zctx.socket(zmq.XPUB)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.sndhwm = 0
        for port in ports:
            self.sock.connect(f"tcp://127.0.0.1:{port + 2}")
        deadline = time.monotonic() + DEADLINE_S
        for _ in range(len(ports) if connected is None else connected):
            # one subscription per collector: each is connected
            assert self.sock.poll(_ms(deadline)), "a collector did not subscribe"
            assert self.sock.recv() == b"\x01"
        self.sent: list[tuple[bytes, bytes, bytes]] = []

    def kvset(self, key: bytes, value: bytes, props: bytes = b"", uuid: bytes | None = None
              ) -> bytes:
        uuid = uuidlib.uuid4().bytes if uuid is None else uuid
        self.sock.send_multipart(chp.kvset(key, value, uuid, props))
        self.sent.append((uuid, key, value))
        return uuid


class Updates:
    """A SUB on one server's P+1: KVPUBs in arrival order (HUGZ skipped)."""

    def __init__(self, zctx, port: int):
        self.port = port
        self.sock = zctx.socket(zmq.SUB)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port + 1}")
        self.got: list[chp.Kvpub] = []

        self.hugz = 0
        self.top = -1
        """The highest sequence heard, in a KVPUB or in a HUGZ's clock."""

    def pump(self, timeout_s: float = 0.0) -> int:
        """Read what is there (waiting up to ``timeout_s`` for the first message)."""
        n = 0
        wait_ms = int(timeout_s * 1000)
        while self.sock.poll(wait_ms):
            wait_ms = 0
            msg = chp.decode_update(self.sock.recv_multipart())
            if isinstance(msg, chp.Kvpub):
                self.got.append(msg)
                self.top = max(self.top, msg.seq)
                n += 1
            else:
                self.hugz += 1
                self.top = max(self.top, chp.hugz_info(msg).seq)
        return n

    def connected(self, timeout_s: float = DEADLINE_S) -> None:
        """Wait for any message (an idle active sends HUGZ every heartbeat): from now on
        this SUB hears everything the server publishes."""
        deadline = time.monotonic() + timeout_s
        while not (self.got or self.hugz):
            assert time.monotonic() < deadline, f"port {self.port}: silent"
            self.pump(max(0.001, deadline - time.monotonic()))

    def wait_seq(self, seq: int, timeout_s: float = DEADLINE_S, what: str = "") -> None:
        """Until the server says it reached ``seq``, in a KVPUB or in the HUGZ it sends
        once a heartbeat passes with nothing published. A reader slower than a burst
        can miss KVPUBs (past the PUB's high-water mark, or, from a leased server, what
        was queued on a connection closed because its PONGs came late), never the HUGZ
        after it."""
        deadline = time.monotonic() + timeout_s
        while self.top < seq:
            if time.monotonic() >= deadline:
                raise AssertionError(f"port {self.port}: sequence {self.top}, not {seq}, "
                                     f"within {timeout_s} s {what}")
            self.pump(max(0.001, deadline - time.monotonic()))

    def wait(self, pred, timeout_s: float = DEADLINE_S, what: str = "") -> chp.Kvpub:
        deadline = time.monotonic() + timeout_s
        checked = 0
        while True:
            for msg in self.got[checked:]:
                checked += 1
                if pred(msg):
                    return msg
            if time.monotonic() >= deadline:
                raise AssertionError(f"port {self.port}: no KVPUB {what} within {timeout_s} s")
            self.pump(max(0.001, deadline - time.monotonic()))


def start_pair(procs, zctx, primary_port: int, backup_port: int, *extra: str,
               backup_first: bool = False):
    """Start both servers; return (primary, backup, watchers) once primary is ACTIVE and
    backup PASSIVE."""
    if backup_first:
        backup = start_server(procs, backup_port, "backup", primary_port, *extra)
        primary = start_server(procs, primary_port, "primary", backup_port, *extra)
    else:
        primary = start_server(procs, primary_port, "primary", backup_port, *extra)
        backup = start_server(procs, backup_port, "backup", primary_port, *extra)
    watch = {primary_port: Watcher(zctx, primary_port), backup_port: Watcher(zctx, backup_port)}
    watch[primary_port].wait_state(ACTIVE)
    watch[backup_port].wait_state(PASSIVE)
    return primary, backup, watch


def settle(writer: Writer, active: Updates, passive_watch: Watcher, key=b"/probe/") -> int:
    """Write a probe through the active and wait until the passive's replica holds it."""
    active.connected()
    uuid = writer.kvset(key, b"probe")
    seq = active.wait(lambda m: m.uuid == uuid, what="(probe)").seq
    passive_watch.wait_seq(seq)
    return seq


def stderr_text(proc) -> str:
    return "\n".join(proc.stderr)


# ============================================================================ start-up

def test_primary_first_waits_then_pairs_with_the_backup(procs, zctx, port_base):
    p, b = two_bases(port_base)
    start_server(procs, p, "primary", b)
    wp = Watcher(zctx, p)
    msg = wp.wait_state(PRIMARY)
    assert (msg.role, msg.shard, msg.heartbeat_s) == (wire.Role.PRIMARY, "t", HEARTBEAT_S)
    start_server(procs, b, "backup", p)
    wb = Watcher(zctx, b)
    assert wp.wait_state(ACTIVE).term == 1
    assert wb.wait_state(PASSIVE).role == wire.Role.BACKUP
    got = snapshot(zctx, p)
    assert got == ({}, 0)


def test_backup_first_refuses_clients_until_the_primary_comes(procs, zctx, port_base):
    p, b = two_bases(port_base)
    start_server(procs, b, "backup", p)
    wb = Watcher(zctx, b)
    wb.wait_state(BACKUP)
    assert snapshot(zctx, b, timeout_s=4 * HEARTBEAT_S) is None  # a backup never takes a vote
    start_server(procs, p, "primary", b)
    wp = Watcher(zctx, p)
    wp.wait_state(ACTIVE)
    wb.wait_state(PASSIVE)
    assert snapshot(zctx, p) == ({}, 0)


def test_a_lone_primary_takes_a_client_vote_after_peer_expiry(procs, zctx, port_base):
    p, b = two_bases(port_base)
    start_server(procs, p, "primary", b)
    wp = Watcher(zctx, p)
    assert vote(zctx, p) == ({}, 0)
    wp.wait_state(ACTIVE)
    start_server(procs, b, "backup", p)
    Watcher(zctx, b).wait_state(PASSIVE)


def test_only_the_active_answers_icanhaz_and_the_passive_replicates(procs, zctx, port_base):
    p, b = two_bases(port_base)
    primary, backup, watch = start_pair(procs, zctx, p, b)
    writer = Writer(zctx, [p, b])
    updates = Updates(zctx, p)
    settle(writer, updates, watch[b])
    uuids = [writer.kvset(b"/k/%d" % i, b"v%d" % i) for i in range(200)]
    last = updates.wait(lambda m: m.uuid == uuids[-1], what="(last write)")
    watch[b].wait_seq(last.seq)
    assert snapshot(zctx, b, timeout_s=4 * HEARTBEAT_S) is None
    snap, seq = snapshot(zctx, p)
    assert seq == last.seq and len(snap) == 201
    assert primary.alive() and backup.alive()
    assert backup.stop() == 0 and primary.stop() == 0  # SIGTERM: a clean exit, both roles


def welcome_hugz(zctx, port: int) -> dict[str, str]:
    """Subscribe a raw SUB to ``port``'s P+1 and return the properties of the HUGZ that
    answers the subscription (frame by frame)."""
    sub = zctx.socket(zmq.SUB)
    sub.linger = 0
    sub.subscribe(b"HUGZ")
    sub.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        assert sub.poll(int(DEADLINE_S * 1000)), f"no HUGZ from port {port + 1}"
        frames = sub.recv_multipart()
    finally:
        sub.close(0)
    assert frames[:3] == [b"HUGZ", b"\0" * 8, b""] and frames[4] == b"", frames
    return chp.parse_props(frames[3])


def test_the_passive_says_it_is_not_serving_and_both_announce_one_generation(
        procs, zctx, port_base):
    """A passive server's welcome HUGZ says ``serving=0`` (a client asks the other server
    at once); the active's does not. The passive's replica took over the active's map
    generation. After the active is killed and the passive takes over on a client's
    vote, it serves, with the same generation: the map lives on."""
    p, b = two_bases(port_base)
    primary, backup, watch = start_pair(procs, zctx, p, b)
    writer = Writer(zctx, [p, b])
    settle(writer, Updates(zctx, p), watch[b])
    on_active, on_passive = welcome_hugz(zctx, p), welcome_hugz(zctx, b)
    assert "serving" not in on_active and on_passive["serving"] == "0"
    assert len(on_active["gen"]) == 16 and on_passive["gen"] == on_active["gen"]
    assert int(on_passive["seq"]) == int(on_active["seq"]) >= 1
    primary.signal(signal.SIGKILL)
    primary.wait()
    vote(zctx, b)  # the passive takes the vote once the primary has expired
    after = welcome_hugz(zctx, b)
    assert "serving" not in after and after["gen"] == on_active["gen"]


def test_a_restarted_primary_is_not_serving_until_it_may_win_a_vote(procs, zctx, port_base):
    """A primary restarted next to a live active backup: its welcome HUGZ says
    ``serving=0`` (it would refuse the vote: the peer is alive), and it becomes the
    passive with the backup's generation."""
    p, b = two_bases(port_base)
    primary, backup, watch = start_pair(procs, zctx, p, b)
    writer = Writer(zctx, [p, b])
    settle(writer, Updates(zctx, p), watch[b])
    primary.signal(signal.SIGKILL)
    primary.wait()
    vote(zctx, b)
    generation = welcome_hugz(zctx, b)["gen"]
    start_server(procs, p, "primary", b)
    assert welcome_hugz(zctx, p).get("serving") == "0"
    watch[p].wait_state(PASSIVE)
    settle(writer, Updates(zctx, b), watch[p])
    again = welcome_hugz(zctx, p)
    assert again.get("serving") == "0" and again["gen"] == generation


def test_a_server_that_starts_after_writes_gets_the_whole_map_with_its_ttls(
        procs, zctx, port_base):
    p, b = two_bases(port_base)
    start_server(procs, p, "primary", b)
    wp = Watcher(zctx, p)
    vote(zctx, p)
    writer = Writer(zctx, [p])
    updates = Updates(zctx, p)
    settle(writer, updates, wp)
    writer.kvset(b"/ttl/a", b"x", b"ttl=600\n")
    uuid = writer.kvset(b"/plain", b"y")
    updates.wait(lambda m: m.uuid == uuid)
    start_server(procs, b, "backup", p)
    wb = Watcher(zctx, b)
    wb.wait_state(PASSIVE)
    wb.wait_seq(updates.got[-1].seq)
    stats = stats_on_sigusr1(procs.started[-1], wb)
    assert stats["keys"] == 3 and stats["ttl_keys"] == 1
    assert stats["replica"]["phase"] == "live" and stats["replica"]["syncs_done"] == 1


def stats_on_sigusr1(server, watch: Watcher) -> dict:
    """A passive's replica is only visible through its stats: it logs them on SIGUSR1."""
    seen = len(server.stderr)
    server.signal(signal.SIGUSR1)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for line in list(server.stderr)[seen:]:
            if " stats {" in line:
                return json.loads(line.split(" stats ", 1)[1])
        watch.next()  # a heartbeat passes
    raise AssertionError("no stats line after SIGUSR1")


def wait_stats(server, watch, what: str, ok) -> dict:
    """The server's stats (SIGUSR1), asked once per heartbeat until ``ok(stats)``."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        stats = stats_on_sigusr1(server, watch)
        if ok(stats):
            return stats
        assert time.monotonic() < deadline, f"{what}: never so; last stats {stats}"


def test_a_large_ttl_table_streams_in_chunks_and_the_backup_keeps_every_ttl(
        procs, zctx, port_base):
    p, b = two_bases(port_base)
    start_server(procs, p, "primary", b)
    vote(zctx, p)
    writer = Writer(zctx, [p])
    updates = Updates(zctx, p)
    updates.connected()
    n = 2 * bstar_ttl.CHUNK_ENTRIES + 100  # three chunks
    for i in range(n):
        writer.kvset(b"/ttl/%06d" % i, b"v", b"ttl=600\n")
    last = writer.kvset(b"/plain", b"p", uuid=chp.resendable_uuid())  # as wait=True
    seq = updates.wait(lambda m: m.uuid == last, what="(the last write)").seq
    written_at = time.time()
    # the frames on the wire, read by a raw DEALER playing the passive
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{p}")
    dealer.send_multipart(bstar_ttl.request())
    chunks = []
    while not chunks or not chunks[-1].last:
        assert dealer.poll(DEADLINE_S * 1000), f"no chunk after {len(chunks)}"
        frames = dealer.recv_multipart()
        assert frames[0] == b"BSTAR-TTL"
        chunks.append(bstar_ttl.decode_chunk(frames))
        # 6 frames; the last chunk 7, with the applied UUIDs
        assert len(frames) == (7 if chunks[-1].last else 6)
    dealer.close(0)
    assert [c.last for c in chunks] == [False, False, True]
    generations = {c.generation for c in chunks}  # the active's map generation
    assert len(generations) == 1 and len(generations.pop()) == 16
    # the term history: the primary took over once, its term 1 began at sequence 1
    assert {c.history for c in chunks} == {((1, 1),)}
    assert [len(c.table) for c in chunks] == [bstar_ttl.CHUNK_ENTRIES] * 2 + [100]
    assert {c.seq for c in chunks} == {seq}
    # the applied UUIDs: only writes that may be sent again (the last one) are kept
    assert chunks[-1].uuids == [last, seq]
    table = {k: v for c in chunks for k, v in c.table.items()}
    assert set(table) == {b"/ttl/%06d" % i for i in range(n)}
    assert all(written_at + 590 < expiry <= written_at + 601 for expiry in table.values())
    # and a backup started now replicates all of them, TTLs included
    start_server(procs, b, "backup", p)
    wb = Watcher(zctx, b)
    wb.wait_state(PASSIVE)
    wb.wait_seq(seq)
    stats = stats_on_sigusr1(procs.started[-1], wb)
    assert stats["keys"] == n + 1 and stats["ttl_keys"] == n
    assert stats["replica"]["ttl_chunks"] == 3 and stats["replica"]["syncs_done"] == 1
    # the replica took over the active's generation: one map, one generation
    assert stats["generation"] == chunks[0].generation


# ============================================================================ robustness

def test_empty_uuid_kvsets_on_both_servers_are_accepted(procs, zctx, port_base):
    p, b = two_bases(port_base)
    primary, backup, watch = start_pair(procs, zctx, p, b)
    writer = Writer(zctx, [p, b])
    updates = Updates(zctx, p)
    settle(writer, updates, watch[b])
    writer.kvset(b"/e/1", b"one", uuid=b"")
    writer.kvset(b"/e/2", b"two", b"ttl=30\n", uuid=b"")
    writer.kvset(b"/e/1", b"", uuid=b"")
    last = updates.wait(lambda m: m.key == b"/e/1" and m.value == b"")
    assert [m.uuid for m in updates.got[-3:]] == [b"", b"", b""]
    watch[b].wait_seq(last.seq)
    watch[p].wait_seq(last.seq)
    assert primary.alive() and backup.alive()
    snap, seq = snapshot(zctx, p)
    assert snap.get(b"/e/2") == b"two" and b"/e/1" not in snap and seq == last.seq


def test_garbage_on_p3_and_the_collector_is_dropped(procs, zctx, port_base):
    p, b = two_bases(port_base)
    primary, backup, watch = start_pair(procs, zctx, p, b)
    # a stranger connects to the backup's collector and sends garbage
    junk = zctx.socket(zmq.PUB)
    junk.linger = 0
    junk.connect(f"tcp://127.0.0.1:{b + 2}")
    writer = Writer(zctx, [p, b])
    updates = Updates(zctx, p)
    settle(writer, updates, watch[b])
    for frames in ([b"x"], [b"k", b"short", b"", b"", b"v"], [b"k", b"\0" * 8, b"bad", b"", b"v"]):
        junk.send_multipart(frames)
        writer.sock.send_multipart(frames)
    seq = settle(writer, updates, watch[b], key=b"/probe/2")
    assert seq >= 2 and primary.alive() and backup.alive()


def test_two_primaries_both_exit_with_a_clear_message(procs, zctx, port_base):
    p, b = two_bases(port_base)
    one = start_server(procs, p, "primary", b)
    two = start_server(procs, b, "primary", p)
    assert one.wait(DEADLINE_S) == 1 and two.wait(DEADLINE_S) == 1
    assert "dual primary" in stderr_text(one) and "dual primary" in stderr_text(two)


# ============================================================================ control, CLI

def test_control_stats_service_over_mdp(procs, zctx, port_base):
    p, b = two_bases(port_base)
    broker_port = free_port_base(1)
    control = f"tcp://127.0.0.1:{broker_port}"
    procs.python("-m", "clonemap.supervisor", "broker", "--bind", control, "--heartbeat-s", "0.5",
                 ready="READY broker")
    primary, backup, watch = start_pair(procs, zctx, p, b, "--control", control)
    with SyncMdpClient(control, ctx=zctx, timeout_s=3.0, retries=2) as client:
        ps = json.loads(client.request("shard.t.primary")[0])
        bs = json.loads(client.request("shard.t.backup")[0])
    assert (ps["shard"], ps["role"], ps["bstar_state"], ps["pid"]) == (
        "t", "primary", "ACTIVE", primary.pid)
    assert (bs["shard"], bs["role"], bs["bstar_state"], bs["pid"]) == (
        "t", "backup", "PASSIVE", backup.pid)
    assert ps["peer"] == f"127.0.0.1:{b}" and bs["peer"] == f"127.0.0.1:{p}"
    assert ps["active"] is True and bs["active"] is False


def test_control_stats_of_a_standalone_server(procs, zctx, port_base):
    broker_port = free_port_base(1)
    control = f"tcp://127.0.0.1:{broker_port}"
    procs.python("-m", "clonemap.supervisor", "broker", "--bind", control, ready="READY broker")
    server = procs.python("-m", "clonemap.shards", "--port", str(port_base), "--shard", "s9",
                          "--control", control, ready="READY")
    assert server.stdout[0].endswith(" role=standalone")
    with SyncMdpClient(control, ctx=zctx, timeout_s=3.0, retries=2) as client:
        stats = json.loads(client.request("shard.s9.standalone")[0])
    assert (stats["shard"], stats["role"], stats["bstar_state"], stats["peer"]) == (
        "s9", "standalone", None, None)
    assert stats["pid"] == server.pid and stats["active"] is True


def test_parent_pid_gone_exits_0(procs, zctx, port_base):
    p, b = two_bases(port_base)
    parent = procs.python("-c", "import sys; print('READY parent', flush=True); "
                                "sys.stdin.read()", ready="READY parent")
    server = start_server(procs, p, "primary", b, "--parent-pid", str(parent.pid))
    parent.signal(signal.SIGKILL)
    assert server.wait(DEADLINE_S) == 0
    assert any(f"parent process {parent.pid} is gone" in line for line in server.stderr)


@pytest.mark.parametrize("args, message", [
    (["--primary"], "--primary needs --peer"),
    (["--peer", "127.0.0.1:5000"], "--peer needs --primary or --backup"),
    (["--backup", "--peer", "nohost"], "is not HOST:PORT"),
    (["--backup", "--peer", "h:x"], "is not a number"),
    (["--shard", "a b"], "1..64 characters"),
])
def test_bad_pair_arguments_exit_2(procs, port_base, args, message):
    proc = procs.python("-m", "clonemap.shards", "--port", str(port_base), *args)
    assert proc.wait(DEADLINE_S) == 2
    assert message in stderr_text(proc)


def test_state_port_in_use_exits_3(procs, zctx, port_base):
    p, b = two_bases(port_base)
    blocker = zctx.socket(zmq.PUB)
    blocker.bind(f"tcp://127.0.0.1:{p + 3}")
    proc = procs.python("-m", "clonemap.shards", "--port", str(p), "--primary", "--peer",
                        f"127.0.0.1:{b}")
    assert proc.wait(DEADLINE_S) == 3
    assert f"tcp://127.0.0.1:{p + 3}" in stderr_text(proc)
