"""12/CHP conformance of the shard server, at the frame level.

Raw pyzmq sockets play a strict CHP client (``Peer``: a DEALER to P, a SUB to P+1, a PUB
to P+2) against a real ``python -m clonemap.shards`` process, command by command, and check the
exact frames. Every wait is a poll with a deadline on a message; nothing sleeps and no
timing is asserted.

PUB/SUB joins slowly: before anything is asserted, ``Peer.sync`` proves that both the
collector (our PUB -> the server's SUB) and the subscriber (the server's PUB -> our SUB)
carry messages, by sending probe KVSETs until one comes back, then a fence KVSET whose
KVPUB marks the end of the probes. Probes are deletes of keys that never existed (an
empty value): they are sequenced and published like any update but leave the map as it
was, so snapshots hold only what a test wrote.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import struct
import time

import pytest
import zmq

from clonemap.shards.common.proto import chp

DEADLINE_S = 10.0
SEQ = struct.Struct(">Q")


def seq_of(frame: bytes) -> int:
    assert len(frame) == 8, f"sequence frame of {len(frame)} bytes"
    return SEQ.unpack(frame)[0]


CLOCK_PROPS_RE = re.compile(
    rb"ts=(\d+\.\d{6})\nseq=(\d+)\ngen=[0-9a-f]{16}\n(?:term=[1-9]\d*\n)?(?:cas=1\n)?\Z")


def check_hugz(frames: list[bytes]) -> tuple[float, int] | None:
    """A HUGZ, frame by frame: key "HUGZ", sequence 0, frames 2 and 4 empty, and frame 3
    empty (12/CHP) or exactly ``ts=<epoch s, 6 decimals>\\nseq=<current sequence>\\n``
    (our clock) then ``gen=<16 hex digits>\\n`` (the map's generation), ``term=<T>\\n``
    (a pair's Binary Star term, a standalone process's own, a relay's upstream's); a standalone
    server always serves, so never ``serving=0``. Returns (ts, seq) of a clock HUGZ, None
    for a plain one."""
    assert frames[:3] == [b"HUGZ", b"\0" * 8, b""] and frames[4] == b"", frames
    if not frames[3]:
        return None
    m = CLOCK_PROPS_RE.match(frames[3])
    assert m, f"HUGZ properties {frames[3]!r}"
    return float(m.group(1)), int(m.group(2))


def start_server(procs, port: int, *extra: str):
    proc = procs.python("-m", "clonemap.shards", "--port", str(port), "--heartbeat-s", "0.2",
                        "--log-level", "info", *extra, ready="READY")
    return proc


class Peer:
    """A strict CHP client of raw sockets. ``subscribe`` lists the SUB's prefixes;
    probes (for ``sync``) use keys under ``probe_prefix``, which must be subscribed."""

    def __init__(self, zctx, port: int, subscribe=(b"",), probe_prefix: bytes = b"/probe/",
                 security=None):
        """``security``: a ``clonemap.shards.common.security.Security`` for a CURVE server."""
        secure = security.connect_side if security is not None else (lambda sock: None)
        self.port = port
        self.dealer = zctx.socket(zmq.DEALER)
        secure(self.dealer)
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.sub = zctx.socket(zmq.SUB)
        self.sub.rcvhwm = 0
        for prefix in subscribe:
            self.sub.setsockopt(zmq.SUBSCRIBE, prefix)
        secure(self.sub)
        self.sub.connect(f"tcp://127.0.0.1:{port + 1}")
        self.pub = zctx.socket(zmq.PUB)
        self.pub.sndhwm = 0  # never drop what a test sends
        secure(self.pub)
        self.pub.connect(f"tcp://127.0.0.1:{port + 2}")
        self.probe_prefix = probe_prefix
        self._probes = 0

    # ------------------------------------------------------------------ collector
    def kvset(self, key: bytes, value: bytes, uuid: bytes = b"", props: bytes = b"") -> None:
        self.pub.send_multipart(chp.kvset(key, value, uuid, props))

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    # ------------------------------------------------------------------ subscriber
    def recv_update(self, timeout_s: float = DEADLINE_S, skip_hugz: bool = True) -> list[bytes]:
        """The next message on the SUB (5 frames checked), HUGZ skipped unless asked."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.sub.poll(remaining * 1000):
                break
            frames = self.sub.recv_multipart()
            assert len(frames) == 5, f"a {len(frames)}-frame message on the publisher"
            if skip_hugz and frames[0] == b"HUGZ":
                check_hugz(frames)
                continue
            return frames
        raise AssertionError(f"no update within {timeout_s} s")

    def sync(self) -> int:
        """Prove both PUB/SUB paths are live; return the sequence of the fence KVPUB."""
        deadline = time.monotonic() + DEADLINE_S
        live = False
        while not live:
            assert time.monotonic() < deadline, "collector/subscriber never became live"
            self._probes += 1
            self.kvset(self.probe_prefix + b"p%d" % self._probes, b"")
            if self.sub.poll(50):
                while self.sub.poll(0):
                    frames = self.sub.recv_multipart()
                    live = live or frames[0].startswith(self.probe_prefix)
        self._probes += 1
        fence = self.probe_prefix + b"fence%d" % self._probes
        self.kvset(fence, b"")
        while True:  # probes still in flight arrive before the fence (one ordered path)
            frames = self.recv_update()
            if frames[0] == fence:
                assert frames[2:] == [b"", b"", b""]
                return seq_of(frames[1])
            assert frames[0].startswith(self.probe_prefix), frames

    # ------------------------------------------------------------------ snapshot
    def snapshot(self, subtree: bytes = b"", timeout_s: float = DEADLINE_S,
                 send: bool = True) -> tuple[dict[bytes, bytes], int, list[int]]:
        """ICANHAZ? -> (map, KTHXBAI sequence, KVSYNC sequences), checking every frame."""
        if send:
            self.dealer.send_multipart(chp.icanhaz(subtree))
        items: dict[bytes, bytes] = {}
        kvsync_seqs: list[int] = []
        while True:
            assert self.dealer.poll(timeout_s * 1000), (
                f"snapshot stalled after {len(items)} KVSYNC")
            frames = self.dealer.recv_multipart()
            assert len(frames) == 5, frames
            if frames[0] == b"KTHXBAI":
                assert frames[2] == b"" and frames[3] == b""
                assert frames[4] == subtree, "KTHXBAI must carry the requested subtree"
                return items, seq_of(frames[1]), kvsync_seqs
            key, seq, f2, f3, value = frames
            assert f2 == b"" and f3 == b"", "KVSYNC frames 2 and 3 are empty"
            assert key.startswith(subtree), f"{key!r} is outside {subtree!r}"
            assert key not in items, f"{key!r} sent twice"
            assert value, "a deleted key is never in a snapshot"
            items[key] = value
            kvsync_seqs.append(seq_of(seq))


@pytest.fixture
def server(procs, port_base):
    return start_server(procs, port_base)


# ====================================================================== start-up

def test_ready_line_names_host_port_and_pid(server, port_base):
    (line,) = [x for x in server.stdout if x.startswith("READY")]
    fields = line.split()
    assert fields[:5] == ["READY", "shard", "host=127.0.0.1", f"port={port_base}",
                          f"pid={server.pid}"]


def test_a_new_server_has_an_empty_snapshot_at_sequence_zero(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    items, seq, kvsync_seqs = peer.snapshot()
    assert items == {} and seq == 0 and kvsync_seqs == []


# ====================================================================== updates

def test_each_kvset_becomes_a_kvpub_with_the_next_sequence_echoing_uuid_and_properties(
        server, port_base, zctx):
    peer = Peer(zctx, port_base)
    base = peer.sync()
    sent = []
    for i in range(200):
        key = b"/u/%d" % (i % 37)
        uuid = bytes([i % 256]) * 16 if i % 3 else b""
        props = [b"", b"owner=ann=b\n", b"a=1\nb=x=y==\n", b"empty=\n"][i % 4]
        value = b"v%d-" % i + bytes(i % 50)
        frames = chp.kvset(key, value, uuid, props)
        frames[1] = SEQ.pack(10_000 + i)  # a client's sequence has no significance
        peer.send_raw(frames)
        sent.append((key, uuid, props, value))
    for i, (key, uuid, props, value) in enumerate(sent):
        assert peer.recv_update() == [key, SEQ.pack(base + 1 + i), uuid, props, value]


def test_a_non_ascii_key_and_a_large_value_are_republished_unchanged(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    base = peer.sync()
    key = "/ключ/ü".encode()
    value = os.urandom(512 * 1024)
    peer.kvset(key, value, b"U" * 16, b"k=v\n")
    assert peer.recv_update() == [key, SEQ.pack(base + 1), b"U" * 16, b"k=v\n", value]
    items, seq, _ = peer.snapshot("/ключ/".encode())
    assert items == {key: value} and seq == base + 1


def test_an_empty_value_deletes_the_key_and_is_published(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    base = peer.sync()
    peer.kvset(b"/d/a", b"1")
    peer.kvset(b"/d/b", b"2")
    peer.kvset(b"/d/a", b"", b"D" * 16, b"why=gone\n")
    assert peer.recv_update()[:2] == [b"/d/a", SEQ.pack(base + 1)]
    assert peer.recv_update()[:2] == [b"/d/b", SEQ.pack(base + 2)]
    assert peer.recv_update() == [b"/d/a", SEQ.pack(base + 3), b"D" * 16, b"why=gone\n", b""]
    items, seq, _ = peer.snapshot(b"/d/")
    assert items == {b"/d/b": b"2"} and seq == base + 3


# ====================================================================== snapshots

def _fill(peer: Peer) -> tuple[dict[bytes, bytes], int]:
    base = peer.sync()
    data = {}
    for i in range(30):
        for key in (b"/a/%d" % i, b"/a/x/%d" % i, b"/ab/%d" % i, b"/b/%d" % i, b"plain%d" % i):
            data[key] = b"v" + key
            peer.kvset(key, data[key])
    peer.kvset(b"/a/0", b"rewritten")
    data[b"/a/0"] = b"rewritten"
    peer.kvset(b"/b/0", b"")
    del data[b"/b/0"]
    n = 30 * 5 + 2
    for _ in range(n - 1):
        peer.recv_update()
    last = peer.recv_update()
    assert last[:2] == [b"/b/0", SEQ.pack(base + n)]
    return data, base + n


def test_snapshot_of_the_whole_map(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    data, last = _fill(peer)
    items, seq, kvsync_seqs = peer.snapshot()
    assert items == data
    assert seq == last, "KTHXBAI carries the highest sequence"
    # Our choice: every KVSYNC carries the sequence that last changed its key (12/CHP
    # gives KVSYNC's no meaning; a conditional write compares it), KTHXBAI the snapshot's.
    base = last - (30 * 5 + 2)
    order = [k for i in range(30)
             for k in (b"/a/%d" % i, b"/a/x/%d" % i, b"/ab/%d" % i, b"/b/%d" % i, b"plain%d" % i)]
    expected = {key: base + 1 + j for j, key in enumerate(order)}
    expected[b"/a/0"] = last - 1
    del expected[b"/b/0"]
    assert dict(zip(items, kvsync_seqs)) == expected


@pytest.mark.parametrize("subtree", [b"/a/", b"/a/x/", b"/b/", b"/none/"])
def test_snapshot_of_a_subtree_holds_only_its_keys(server, port_base, zctx, subtree):
    peer = Peer(zctx, port_base)
    data, last = _fill(peer)
    items, seq, _ = peer.snapshot(subtree)
    assert items == {k: v for k, v in data.items() if k.startswith(subtree)}
    assert seq == last


def test_two_requests_on_one_connection_are_answered_in_order(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    data, last = _fill(peer)
    peer.dealer.send_multipart(chp.icanhaz(b"/b/"))
    peer.dealer.send_multipart(chp.icanhaz(b"/a/"))
    first, seq1, _ = peer.snapshot(b"/b/", send=False)
    second, seq2, _ = peer.snapshot(b"/a/", send=False)
    assert first == {k: v for k, v in data.items() if k.startswith(b"/b/")}
    assert second == {k: v for k, v in data.items() if k.startswith(b"/a/")}
    assert seq1 == seq2 == last


def test_snapshot_plus_later_kvpubs_rebuild_the_map_while_updates_keep_arriving(
        server, port_base, zctx):
    """The snapshot is point-in-time: it equals the map at KTHXBAI's sequence, and
    applying the KVPUBs above that sequence gives the server's final map."""
    peer = Peer(zctx, port_base)
    peer.dealer.rcvhwm = 100  # read slowly: the server must stream it in pieces
    base = peer.sync()
    n = 20_000
    history: dict[int, tuple[bytes, bytes]] = {}
    for i in range(n):
        peer.kvset(b"/s/%06d" % i, b"a%d" % i)
    for _ in range(n):  # all applied (the collector and the ROUTER are not ordered)
        key, seq, _, _, value = peer.recv_update()
        history[seq_of(seq)] = (key, value)
    peer.dealer.send_multipart(chp.icanhaz(b""))
    assert peer.dealer.poll(DEADLINE_S * 1000)  # the cursor is open: later writes are "after"
    for i in range(0, n, 3):                    # change, delete and create while it streams
        peer.kvset(b"/s/%06d" % i, b"b%d" % i if i % 2 else b"")
        peer.kvset(b"/s/new%06d" % i, b"c%d" % i)
    updates = n + 2 * len(range(0, n, 3))
    items, snap_seq, _ = peer.snapshot(send=False)
    for _ in range(updates - n):
        key, seq, _, _, value = peer.recv_update()
        history[seq_of(seq)] = (key, value)
    assert sorted(history) == list(range(base + 1, base + updates + 1)), "gap or duplicate"
    assert base + n <= snap_seq <= base + updates
    at_snapshot: dict[bytes, bytes] = {}
    final: dict[bytes, bytes] = {}
    for seq in sorted(history):
        key, value = history[seq]
        for m in ((at_snapshot, final) if seq <= snap_seq else (final,)):
            if value:
                m[key] = value
            else:
                m.pop(key, None)
    assert items == at_snapshot
    rebuilt = dict(items)
    for seq in sorted(s for s in history if s > snap_seq):  # the client rule: only > S
        key, value = history[seq]
        if value:
            rebuilt[key] = value
        else:
            rebuilt.pop(key, None)
    assert rebuilt == final
    assert peer.snapshot(b"/s/")[0] == final


def test_a_50k_key_snapshot_arrives_whole(server, port_base, zctx):
    peer = Peer(zctx, port_base, subscribe=(b"/probe/", b"/big/last"))
    base = peer.sync()
    n = 50_000
    value = bytes(range(100))
    for i in range(n - 1):
        peer.kvset(b"/big/%07d" % i, value)
    peer.kvset(b"/big/last", value)
    assert peer.recv_update()[:2] == [b"/big/last", SEQ.pack(base + n)]
    items, seq, kvsync_seqs = peer.snapshot(timeout_s=30)
    assert len(items) == n and seq == base + n
    assert items.keys() == {b"/big/%07d" % i for i in range(n - 1)} | {b"/big/last"}
    assert all(v == value for v in items.values())
    assert len(kvsync_seqs) == n


def test_a_blocked_snapshot_does_not_stall_publishing(server, port_base, zctx):
    peer = Peer(zctx, port_base, subscribe=(b"/probe/", b"/live/"))
    peer.dealer.rcvhwm = 10
    base = peer.sync()
    n = 30_000
    value = bytes(1000)  # 30 MB: more than the pipes and socket buffers hold
    for i in range(n):
        peer.kvset(b"/big/%06d" % i, value)
    fence = peer.sync()
    assert fence > base + n  # every key is in (the probes come after)
    peer.dealer.send_multipart(chp.icanhaz(b""))
    assert peer.dealer.poll(DEADLINE_S * 1000)  # streaming; we read nothing more for now
    for i in range(100):  # the server keeps sequencing and publishing meanwhile
        peer.kvset(b"/live/%d" % i, b"x")
        assert peer.recv_update()[:2] == [b"/live/%d" % i, SEQ.pack(fence + 1 + i)]
    items, seq, _ = peer.snapshot(send=False, timeout_s=30)
    assert seq == fence and len(items) == n
    assert all(v == value for v in items.values())


def test_many_clients_snapshot_at_once(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    data, last = _fill(peer)
    others = [Peer(zctx, port_base) for _ in range(20)]
    for i, other in enumerate(others):
        other.dealer.send_multipart(chp.icanhaz(b"/a/" if i % 2 else b""))
    for i, other in enumerate(others):
        subtree = b"/a/" if i % 2 else b""
        items, seq, _ = other.snapshot(subtree, send=False)
        assert items == {k: v for k, v in data.items() if k.startswith(subtree)}
        assert seq == last


# ====================================================================== TTL

def test_ttl_expiry_deletes_the_key_and_publishes_an_empty_kvpub(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    base = peer.sync()
    before = time.time()
    peer.kvset(b"/t/eph", b"soon gone", b"T" * 16, b"owner=x=y\nttl=0.3\n")
    key, seq, uuid, props, value = peer.recv_update()
    after = time.time()
    assert (key, seq_of(seq), uuid, value) == (b"/t/eph", base + 1, b"T" * 16, b"soon gone")
    # The KVPUB carries the absolute expiry too, so a replica can honour the same instant.
    head, _, expires = props.rstrip(b"\n").rpartition(b"expires=")
    assert head == b"owner=x=y\nttl=0.3\n"
    assert before + 0.3 - 0.002 <= float(expires) <= after + 0.3 + 0.002
    assert peer.recv_update() == [b"/t/eph", SEQ.pack(base + 2), b"", b"", b""]
    items, seq, _ = peer.snapshot(b"/t/")
    assert items == {} and seq == base + 2


def test_an_absolute_expires_property_is_honoured(server, port_base, zctx):
    peer = Peer(zctx, port_base)
    base = peer.sync()
    props = b"expires=%.3f\n" % (time.time() + 0.2)
    peer.kvset(b"/t/abs", b"v", b"", props)
    assert peer.recv_update() == [b"/t/abs", SEQ.pack(base + 1), b"", props, b"v"]
    assert peer.recv_update() == [b"/t/abs", SEQ.pack(base + 2), b"", b"", b""]


def test_rewriting_without_ttl_cancels_the_expiry_and_expiries_come_in_order(
        server, port_base, zctx):
    peer = Peer(zctx, port_base)
    base = peer.sync()
    peer.kvset(b"/t/kept", b"1", b"", b"ttl=0.1\n")
    peer.kvset(b"/t/kept", b"2")                      # no ttl: lives on
    peer.kvset(b"/t/later", b"x", b"", b"ttl=0.5\n")
    peer.kvset(b"/t/sooner", b"x", b"", b"ttl=0.25\n")
    for i in range(4):
        assert seq_of(peer.recv_update()[1]) == base + 1 + i
    # Had /t/kept still expired (at 0.1 s), its delete would come before these two.
    assert peer.recv_update() == [b"/t/sooner", SEQ.pack(base + 5), b"", b"", b""]
    assert peer.recv_update() == [b"/t/later", SEQ.pack(base + 6), b"", b"", b""]
    items, _, _ = peer.snapshot(b"/t/")
    assert items == {b"/t/kept": b"2"}


# ====================================================================== HUGZ, subtrees

def test_hugz_when_idle_carries_the_server_clock(server, port_base, zctx):
    peer = Peer(zctx, port_base, subscribe=(b"HUGZ",))
    stamps = []
    for _ in range(3):
        frames = peer.recv_update(skip_hugz=False)
        clock = check_hugz(frames)
        assert clock is not None, "the default server sends its clock"
        # a shard server decides conditional writes; a relay does not (it forwards them)
        assert frames[3].endswith(b"cas=1\n") == ("clonemap.shards.relay" not in server.args)
        ts, seq = clock
        assert abs(ts - time.time()) < 60 and seq == 0  # same host; nothing published
        stamps.append(ts)
    assert stamps == sorted(stamps)


def test_hugz_when_idle_without_the_clock_is_plain_chp(procs, port_base, zctx):
    start_server(procs, port_base, "--clock-s", "0")
    peer = Peer(zctx, port_base, subscribe=(b"HUGZ",))
    for _ in range(2):
        assert peer.recv_update(skip_hugz=False) == [b"HUGZ", b"\0" * 8, b"", b"", b""]


def test_the_clock_hugz_is_sent_while_busy_with_the_current_sequence(procs, port_base,
                                                                      zctx):
    """Under a continuous stream of KVSETs (the idle heartbeat never fires) a clock HUGZ
    still arrives, and its seq is exactly that of the KVPUB just before it on the same
    publisher: the sequence at the moment it was sent."""
    start_server(procs, port_base, "--heartbeat-s", "3600", "--clock-s", "0.1")
    peer = Peer(zctx, port_base, subscribe=(b"/probe/", b"/busy/", b"HUGZ"))
    last = peer.sync()
    busy_hugz = []
    n = 0
    deadline = time.monotonic() + DEADLINE_S
    while len(busy_hugz) < 3:
        assert time.monotonic() < deadline, f"only {len(busy_hugz)} clock HUGZ while busy"
        for _ in range(50):
            n += 1
            peer.kvset(b"/busy/%d" % (n % 100), b"v%d" % n)
        while peer.sub.poll(5):
            frames = peer.sub.recv_multipart()
            if frames[0] == b"HUGZ":
                clock = check_hugz(frames)
                assert clock is not None
                assert clock[1] == last, (clock, last)
                if last > 0:
                    busy_hugz.append(clock)
            else:
                seq = seq_of(frames[1])
                assert seq == last + 1
                last = seq
    assert [s for _, s in busy_hugz] == sorted(s for _, s in busy_hugz)
    assert busy_hugz[0][1] < busy_hugz[-1][1], "updates were published between them"


def test_each_new_subscription_is_answered_with_a_hugz_at_once(procs, port_base, zctx):
    """With a heartbeat far beyond the test's deadline, a HUGZ can only be the
    publisher's answer to a new subscription: the proof a client waits for before it
    asks for a snapshot (a handshake alone does not mean the subscription is applied)."""
    server = start_server(procs, port_base, "--heartbeat-s", "3600", "--clock-s", "0")
    for _ in range(2):  # a second subscriber of the same topic is answered too
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"/x/")
        sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        sub.connect(f"tcp://127.0.0.1:{port_base + 1}")
        assert sub.poll(10_000), "no HUGZ for a new subscription"
        assert sub.recv_multipart() == [b"HUGZ", b"\0" * 8, b"", b"", b""]
        sub.close()
    assert server.popen.poll() is None


def test_hugz_does_not_consume_a_sequence(server, port_base, zctx):
    peer = Peer(zctx, port_base, subscribe=(b"/probe/", b"/h/", b"HUGZ"))
    base = peer.sync()
    assert peer.recv_update(skip_hugz=False)[0] == b"HUGZ"
    peer.kvset(b"/h/1", b"x")
    assert peer.recv_update()[:2] == [b"/h/1", SEQ.pack(base + 1)]


def test_a_subscriber_hears_nothing_about_keys_outside_its_subtree(server, port_base, zctx):
    peer = Peer(zctx, port_base, subscribe=(b"/a/",), probe_prefix=b"/a/probe/")
    base = peer.sync()
    for key in (b"/b/1", b"/ab/1", b"/x/a/1", b"a/1", b"plain"):
        peer.kvset(key, b"outside")
    peer.kvset(b"/a/1", b"inside")
    # The first thing it hears is /a/1, five sequences later: the others were sequenced
    # and published, but never sent to this subscriber.
    assert peer.recv_update() == [b"/a/1", SEQ.pack(base + 6), b"", b"", b"inside"]
    items, seq, _ = peer.snapshot(b"/a/")
    assert items == {b"/a/1": b"inside"} and seq == base + 6


# ====================================================================== process

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_with_exit_code_0(server, port_base, zctx, sig):
    peer = Peer(zctx, port_base)
    peer.sync()
    server.signal(sig)
    assert server.wait(10) == 0
    server.stop()  # joins the output readers
    assert any("stopped: seq " in line for line in server.stderr)


def test_a_port_in_use_exits_3_naming_the_endpoint(procs, port_base):
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        blocker.bind(("127.0.0.1", port_base + 2))
        blocker.listen(1)
        proc = procs.python("-m", "clonemap.shards", "--port", str(port_base))
        assert proc.wait(15) == 3
        proc.stop()
    finally:
        blocker.close()
    assert not any(line.startswith("READY") for line in proc.stdout)
    errors = [line for line in proc.stderr if "in use" in line]
    assert len(errors) == 1 and f"tcp://127.0.0.1:{port_base + 2}" in errors[0]


def test_a_second_server_on_the_same_ports_exits_3(server, procs, port_base):
    proc = procs.python("-m", "clonemap.shards", "--port", str(port_base))
    assert proc.wait(15) == 3
    proc.stop()
    assert any(f"tcp://127.0.0.1:{port_base} is already in use" in line
               for line in proc.stderr)
    assert server.alive()
