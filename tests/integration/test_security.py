"""CURVE on every socket, as users run it: ``supervisor keygen``, then ``supervisor start``
of a config with ``security: {curve: true}``. Peers that are not us, made of raw pyzmq
sockets, and what each one gets:

* a plain (non-CURVE) SUB, DEALER, PUB and MDP client: nothing (their handshake fails,
  which the test awaits; then a real client's write goes through and they still have
  nothing, and the plain KVSET was never applied);
* a client presenting a key pair that is not the cluster's: its handshake is refused
  (ZAP), nothing else;
* ``Clone(config=...)`` and ``chp --config`` with the cluster's keys: work;
* an MDP worker with the client key offering ``shard.s0.primary``: disconnected; the
  status still comes from the real server;
* the bytes on loopback during a secure write do not contain the value (a raw AF_PACKET
  capture, checked against a plain server where the same capture does see it).
"""
from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import threading
import time

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from clonemap.client.api import AsyncClone
from conftest import PYTHON, ROOT, free_port_base
from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.proto import chp
from clonemap.shards.common.security import Security, create_keys
from test_server_conformance import start_server
from clonemap.supervisor.control import Control
from test_supervisor_cli import cli, start, status, wait_status, write_config

pytestmark = pytest.mark.timeout(120)
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def settled(rows: dict) -> bool:
    return all(r["bstar"] in ("ACTIVE", "PASSIVE") for r in rows.values())


@pytest.fixture
def cluster(procs, tmp_path):
    config, control = write_config(tmp_path, "1shard.yaml", security={"curve": True})
    out = cli("keygen", str(config))
    assert out.returncode == 0, out.stderr
    sup = start(procs, config, tmp_path)
    secure = Control(control, Security.load(config.parent / "keys", "client"))
    rows = wait_status(secure, settled)
    active = next(r for r in rows.values() if r["bstar"] == "ACTIVE")
    yield config, secure, active["port"]
    assert cli("stop", "--config", str(config)).returncode == 0
    sup.wait(30)


def try_send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send if ZeroMQ takes it: a socket whose handshake failed may have no pipe at all
    (then there is nothing to deliver, which is the point)."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_keygen_writes_two_pairs_with_private_secrets_and_never_overwrites(tmp_path):
    config, _ = write_config(tmp_path, "1shard.yaml", security={"curve": True,
                                                                "keys_dir": "k"})
    out = cli("keygen", str(config))
    assert out.returncode == 0, out.stderr
    keys = tmp_path / "k"
    names = sorted(p.name for p in keys.iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    for name in ("client.key_secret", "server.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    before = (keys / "server.key").read_bytes()
    again = cli("keygen", str(config))
    assert again.returncode == 2 and "--force" in again.stderr
    assert (keys / "server.key").read_bytes() == before
    forced = cli("keygen", str(config), "--force")
    assert forced.returncode == 0 and (keys / "server.key").read_bytes() != before


def test_plain_peers_get_nothing_and_write_nothing(cluster, zctx):
    config, control, port = cluster
    sub = zctx.socket(zmq.SUB)
    sub.linger = 0
    sub.subscribe(b"")
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    pub = zctx.socket(zmq.PUB)
    pub.linger = 0
    for sock, offset in ((sub, 1), (dealer, 0), (pub, 2)):
        monitor = sock.get_monitor_socket(FAILED)
        sock.connect(f"tcp://127.0.0.1:{port + offset}")
        assert monitor.poll(10_000), f"no failed handshake on P+{offset}"
        sock.disable_monitor()
        monitor.close(0)
    try_send(dealer, chp.icanhaz(b""))
    try_send(pub, chp.kvset(b"/plain/forged", b"x"))

    async def secure():
        async with AsyncClone(config=str(config)) as clone:
            await clone.set("/secure/k", b"v", wait=True)
            return dict(clone.items())

    got = asyncio.run(secure())
    assert got.get("/secure/k") == b"v" and "/plain/forged" not in got
    assert not sub.poll(0) and not dealer.poll(0)
    # an MDP client without keys: no control reply
    mdp_client = zctx.socket(zmq.DEALER)
    mdp_client.linger = 0
    monitor = mdp_client.get_monitor_socket(FAILED)
    mdp_client.connect(str(control))
    assert monitor.poll(10_000), "no failed handshake at the broker"
    monitor.close(0)
    try_send(mdp_client, mdp.client_request(b"cluster.status"))
    assert not mdp_client.poll(500)
    plain_status = cli("status", "--control", str(control), "--timeout-s", "0.5")
    assert plain_status.returncode == 1  # told at once why nobody answers it
    assert "the cluster requires CURVE" in plain_status.stderr, plain_status.stderr


def test_a_key_that_is_not_the_clusters_is_refused(cluster, zctx, tmp_path):
    config, control, port = cluster
    stranger_dir = tmp_path / "stranger"
    create_keys(stranger_dir)
    theirs = Security.load(stranger_dir, "client")
    ours = Security.load(config.parent / "keys", "client")
    # the right server key, a client key the cluster never admitted
    forged = Security(True, None, "client", ours.server_public, None, theirs.public,
                      theirs.secret)
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    forged.connect_side(dealer)
    monitor = dealer.get_monitor_socket(FAILED)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    assert monitor.poll(10_000)
    event = parse_monitor_message(monitor.recv_multipart())["event"]
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    monitor.close(0)
    try_send(dealer, chp.icanhaz(b""))
    assert not dealer.poll(500)


def test_clients_with_the_keys_work_chp_too(cluster):
    config, control, port = cluster
    put = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--config", str(config), "set",
                          "/cli/k", "hello"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert put.returncode == 0, put.stderr
    got = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--config", str(config), "get",
                          "/cli/k"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == "hello", got.stderr
    keys = config.parent / "keys"
    by_control = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--control", str(control), "--keys",
                                 str(keys), "get", "/cli/k"], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
    assert by_control.returncode == 0 and by_control.stdout.strip() == "hello"
    by_config = cli("status", "--config", str(config))
    assert by_config.returncode == 0, by_config.stderr  # the control commands: the config's keys


def test_a_stats_worker_with_the_client_key_is_refused(cluster, zctx):
    config, control, port = cluster
    client_keys = Security.load(config.parent / "keys", "client")
    worker = zctx.socket(zmq.DEALER)
    worker.linger = 0
    client_keys.connect_side(worker)
    worker.connect(str(control))
    worker.send_multipart(mdp.ready(b"shard.s0.primary"))
    assert worker.poll(10_000), "no answer to the forged READY"
    assert worker.recv_multipart() == [mdp.MDPW, mdp.W_DISCONNECT]
    rows = status(control)
    assert rows["s0/primary"]["stats"]["pid"] == rows["s0/primary"]["pid"]


def test_a_request_sent_after_the_refusal_is_told_the_refusal_not_a_drop(zctx, caplog,
                                                                         tmp_path):
    """The CLI's old race: a control client's key refused before its REQUEST is sent.
    libzmq ends such a connection for good, so the send finds no pipe; that is the
    refusal's doing, not a full queue: one answer, the cause, and no drop logged. (A ZAP
    refusal, not a plain client: the server's ERROR reaches the client before the close,
    while a mechanism mismatch may look like a dropped connection and be retried.)"""
    from clonemap.shards.common.errors import HandshakeRefused
    from clonemap.shards.common.mdp.client import SyncMdpClient
    from clonemap.shards.common.security import Authenticator

    create_keys(tmp_path / "cluster")
    create_keys(tmp_path / "stranger")
    server_keys = Security.load(tmp_path / "cluster", "server")
    theirs = Security.load(tmp_path / "stranger", "client")
    # the right server key, a client key the cluster never admitted
    forged = Security(True, None, "client", server_keys.server_public, None, theirs.public,
                      theirs.secret)
    auth = Authenticator(zctx, server_keys)
    server = zctx.socket(zmq.ROUTER)
    server.linger = 0
    server_keys.bind_side(server)
    endpoint = f"tcp://127.0.0.1:{free_port_base(1)}"
    server.bind(endpoint)
    client = SyncMdpClient(endpoint, ctx=zctx, timeout_s=30, retries=1, security=forged)
    try:
        sock = client.open()
        # the order forced: the key is refused and the pipe is gone before the send
        # (libzmq signals no event when a pipe goes, so the socket's state is read)
        deadline = time.monotonic() + 30
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            assert time.monotonic() < deadline, "the refused pipe was never closed"
            sock.poll(5)
        with caplog.at_level("DEBUG"), pytest.raises(HandshakeRefused) as caught:
            client.request("mmi.service", b"cluster.status")
    finally:
        client.close()
        auth.stop()
    assert caught.value.cause == "key_refused", caught.value
    assert client.counters["unqueued"] == 1 and client.counters["attempts"] == 1
    assert client.counters["timeouts"] == 0  # told by the monitor, not by the deadline
    assert not client.drops.counts and "dropped" not in caplog.text, caplog.text


def _ports_filter(low: int, high: int) -> list[tuple[int, int, int, int]]:
    """A classic BPF program (``tcpdump -dd``'s form: code, jt, jf, k) that keeps the
    IPv4 TCP packets whose source or destination port is in ``low..high``."""
    ldh, ldb, ldxb_msh, ldh_ind, jeq, jge, jgt, jset, ret = (
        0x28, 0x30, 0xb1, 0x48, 0x15, 0x35, 0x25, 0x45, 0x06)
    keep, drop = 13, 14
    program = [  # (index: code, k, where to go if true, if false)
        (ldh, 12, None, None),               # 0: the ethertype
        (jeq, 0x0800, 2, drop),              # 1: IPv4
        (ldb, 23, None, None),               # 2: the protocol
        (jeq, 6, 4, drop),                   # 3: TCP
        (ldh, 20, None, None),               # 4: the fragment offset
        (jset, 0x1FFF, drop, 6),             # 5: not a later fragment
        (ldxb_msh, 14, None, None),          # 6: x = the IP header's length
        (ldh_ind, 14, None, None),           # 7: the source port
        (jge, low, 9, 10),                   # 8
        (jgt, high, 10, keep),               # 9
        (ldh_ind, 16, None, None),           # 10: the destination port
        (jge, low, 12, drop),                # 11
        (jgt, high, drop, keep),             # 12
        (ret, 0x40000, None, None),          # 13: keep the packet whole
        (ret, 0, None, None),                # 14: not this one
    ]
    return [(code, 0 if yes is None else yes - i - 1, 0 if no is None else no - i - 1, k)
            for i, (code, k, yes, no) in enumerate(program)]


class Capture:
    """Every byte of the TCP traffic to and from ``ports`` on the loopback interface while
    it runs (AF_PACKET, as root). The kernel filters the packets, so the rest of a busy
    host's loopback traffic cannot overflow the capture's buffer; a capture that still
    dropped packets says so instead of passing for one that saw everything."""

    def __init__(self, ports: range):
        import ctypes
        import struct

        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        code = _ports_filter(ports.start, ports.stop - 1)
        insns = (ctypes.c_uint64 * len(code))(*(
            int.from_bytes(struct.pack("=HBBI", *insn), "little") for insn in code))
        self.sock.setsockopt(socket.SOL_SOCKET, 26,  # SO_ATTACH_FILTER
                             struct.pack("HxxxxxxQ", len(code), ctypes.addressof(insns)))
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE (root)
        self.sock.bind(("lo", 0))
        self._drops()  # (reading the statistics resets them: count from here)
        self.sock.settimeout(0.05)
        self.data = bytearray()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                self.data += self.sock.recv(65535)
            except socket.timeout:
                continue

    def _drops(self) -> int:
        """Packets the kernel dropped for want of room since the last call."""
        import struct

        stats = self.sock.getsockopt(263, 6, 8)  # SOL_PACKET, PACKET_STATISTICS
        return struct.unpack("II", stats)[1]

    def close(self) -> bytes:
        self.stop.set()
        self.thread.join(5)
        # what the kernel queued that the thread has not read yet (a loaded host's thread
        # lags): every packet of a write was queued before its acknowledgement came back
        self.sock.setblocking(False)
        while True:
            try:
                self.data += self.sock.recv(65535)
            except BlockingIOError:
                break
        drops = self._drops()
        self.sock.close()
        assert drops == 0, f"the capture dropped {drops} packets: it saw only part"
        return bytes(self.data)


def _write_and_capture(address: str, value: bytes, keys=None) -> bytes:
    port = int(address.rsplit(":", 1)[1])
    capture = Capture(range(port, port + 4))
    try:
        async def write():
            async with AsyncClone(address, keys=keys) as clone:
                await clone.set("/secret/k", value, wait=True)
                assert clone.get("/secret/k") == value
        asyncio.run(write())
    finally:
        data = capture.close()
    return data


def test_values_do_not_travel_in_clear_text(procs, cluster_keys):
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003)).close()
    except PermissionError:
        pytest.fail("capturing loopback needs root (AF_PACKET)")
    value = b"clear-text-canary-" + os.urandom(8).hex().encode()
    plain_port, curve_port = free_port_base(4), free_port_base(4)
    start_server(procs, plain_port)
    start_server(procs, curve_port, "--keys-dir", str(cluster_keys))
    seen = _write_and_capture(f"tcp://127.0.0.1:{plain_port}", value)
    assert value in seen  # the capture works: plain TCP shows the value
    hidden = _write_and_capture(f"tcp://127.0.0.1:{curve_port}", value, keys=cluster_keys)
    assert len(hidden) > 1000 and value not in hidden


def test_a_curve_cluster_grows_a_shard_under_its_keys_and_strangers_reach_none_of_it(
        procs, tmp_path, zctx):
    """``supervisor reshard`` of a CURVE cluster (issue 41), as its operator runs it:
    the added shard's pair starts with the cluster's keys, its copy goes over CURVE
    links, a ``wait=True`` writer running through the change keeps a ledger that a fresh
    client reads back whole, and a plain peer gets nothing from the added shard. The
    command-line client given the old config reads a key the added shard holds, and a
    shrink back to two shards brings every key home."""
    import yaml

    from clonemap.shards.common.routing import ShardMap
    from test_routing_epoch import _grown, _write_until, at_epoch

    config, control = write_config(tmp_path, "2shard.yaml", heartbeat_s=0.3,
                                   security={"curve": True})
    assert cli("keygen", str(config)).returncode == 0
    sup = start(procs, config, tmp_path)
    secure = Control(control, Security.load(config.parent / "keys", "client"))
    wait_status(secure, settled)
    three = _grown(config, tmp_path / "three.yaml")
    assert yaml.safe_load(three.read_text())["security"] == {"curve": True}

    ledger = {f"/seg{i}/k": b"v%d" % i for i in range(300)}

    async def grow() -> None:
        async with AsyncClone(config=str(config)) as clone:
            await asyncio.gather(*(clone.set(k, v, wait=True) for k, v in ledger.items()))
            stop = asyncio.Event()
            task = asyncio.ensure_future(_write_until(clone, list(ledger), ledger, stop))
            done = await asyncio.to_thread(cli, "reshard", str(config), "--to", str(three),
                                           "--yes", timeout_s=120)
            stop.set()
            await task
            assert done.returncode == 0, done.stdout + done.stderr
            deadline = time.monotonic() + 10
            while clone.routing_epoch != 2:
                assert time.monotonic() < deadline, "the client never followed epoch 2"
                await asyncio.sleep(0.05)
        async with AsyncClone(config=str(three)) as fresh:
            assert {k: fresh.get(k) for k in ledger} == ledger

    asyncio.run(grow())
    rows = wait_status(secure, lambda r: len(r) == 6 and settled(r) and at_epoch(2)(r))
    added = next(r for r in rows.values() if r["shard"] == "s2" and r["bstar"] == "ACTIVE")
    plain = zctx.socket(zmq.DEALER)
    plain.linger = 0
    plain.connect(f"tcp://127.0.0.1:{added['port']}")
    try_send(plain, chp.icanhaz())
    assert not plain.poll(1000), "a plain peer was answered by the added shard"
    # the command-line client given the first config follows the grown cluster with the
    # config's keys: it reads a key the added shard holds now
    on_added = next(k for k in ledger if ShardMap(3).owner(k) == 2)
    got = subprocess.run([PYTHON, "-m", "clonemap.client.cli", "--config", str(config), "get",
                          on_added], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == ledger[on_added].decode(), got.stderr
    # and back to two shards: the removed shard's keys go home over CURVE links too
    shrunk = cli("reshard", str(three), "--to", str(config), "--yes", timeout_s=120)
    assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr

    async def read_back() -> None:
        async with AsyncClone(config=str(config)) as fresh:
            # (epoch 3 routes as epoch 1 did, which the config names: nothing to follow)
            assert fresh.cluster.shard_map.shards == 2
            assert {k: fresh.get(k) for k in ledger} == ledger

    asyncio.run(read_back())
    assert cli("stop", "--config", str(config)).returncode == 0
    sup.wait(30)
