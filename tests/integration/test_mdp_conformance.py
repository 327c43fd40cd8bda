"""MDP/0.2 conformance at the frame level: raw pyzmq DEALERs play client and worker
against a real broker process (``python -m clonemap.supervisor broker``).

Waits are for messages and lines, each with a deadline. A raw worker is known to the
broker once the broker has sent it a HEARTBEAT (READY has no reply).
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import pytest
import zmq

from clonemap.shards.common.mdp.client import MdpClient
from clonemap.shards.common.mdp.worker import MdpWorker
from clonemap.shards.common.mdp import codec as mdp

HB_S = 0.2
HEARTBEAT = [b"MDPW02", b"\x05"]
DISCONNECT = [b"MDPW02", b"\x06"]


def start_broker(procs, port, *, liveness=25, expiry_s=10.0, heartbeat_s=HB_S):
    return procs.python("-m", "clonemap.supervisor", "broker", "--bind", f"tcp://127.0.0.1:{port}",
                        "--heartbeat-s", str(heartbeat_s), "--liveness", str(liveness),
                        "--request-expiry-s", str(expiry_s), ready="READY broker")


class Peer:
    """A raw DEALER playing a client or a worker."""

    def __init__(self, zctx, endpoint):
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)

    def send(self, frames):
        self.sock.send_multipart(frames)

    def recv(self, timeout_s=5.0, skip_heartbeats=True):
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            assert remaining_ms > 0 and self.sock.poll(remaining_ms), \
                f"no message within {timeout_s} s"
            frames = self.sock.recv_multipart()
            if skip_heartbeats and frames == HEARTBEAT:
                continue
            return frames

    def wait_heartbeat(self, timeout_s=5.0):
        assert self.recv(timeout_s, skip_heartbeats=False) == HEARTBEAT

    def close(self):
        self.sock.close(0)


@pytest.fixture
def broker(procs, port_base):
    start_broker(procs, port_base)
    return f"tcp://127.0.0.1:{port_base}"


def worker(zctx, endpoint, service=b"echo"):
    """A raw worker that the broker has registered (it got a HEARTBEAT)."""
    w = Peer(zctx, endpoint)
    w.send(mdp.ready(service))
    w.wait_heartbeat()
    return w


def first_request(workers, timeout_s=5.0):
    """(index, frames) of the first non-HEARTBEAT message any of ``workers`` receives."""
    poller = zmq.Poller()
    for w in workers:
        poller.register(w.sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        assert remaining_ms > 0, "no worker got a request"
        for sock, _ in poller.poll(remaining_ms):
            frames = sock.recv_multipart()
            if frames != HEARTBEAT:
                return [w.sock for w in workers].index(sock), frames


def stats(zctx, endpoint):
    c = Peer(zctx, endpoint)
    c.send(mdp.client_request(b"mmi.stats"))
    reply = c.recv()
    c.close()
    assert reply[:3] == [b"MDPC02", b"\x03", b"mmi.stats"]
    return json.loads(reply[3])


def wait_stats(zctx, endpoint, predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(zctx, endpoint)
        if predicate(s):
            return s
        assert time.monotonic() < deadline, f"stats never matched: {s}"
        time.sleep(0.02)


# ------------------------------------------------------------------ the request path

def test_request_partials_final_exact_frames(zctx, broker):
    w = worker(zctx, broker)
    c = Peer(zctx, broker)
    c.send([b"MDPC02", b"\x01", b"echo", b"a", b"b"])
    req = w.recv()
    assert req[:2] == [b"MDPW02", b"\x02"] and req[3:] == [b"", b"a", b"b"]
    address = req[2]
    assert address and len(req) == 6
    w.send([b"MDPW02", b"\x03", address, b"", b"p1"])
    w.send([b"MDPW02", b"\x03", address, b"", b"p2", b"p2b"])
    w.send([b"MDPW02", b"\x04", address, b"", b"f"])
    assert c.recv() == [b"MDPC02", b"\x02", b"echo", b"p1"]
    assert c.recv() == [b"MDPC02", b"\x02", b"echo", b"p2", b"p2b"]
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"f"]
    # the worker is free again: a second request from the same client reaches it
    c.send(mdp.client_request(b"echo", b"again"))
    assert w.recv() == [b"MDPW02", b"\x02", address, b"", b"again"]
    w.send(mdp.worker_final(address, b"done"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"done"]


def test_workers_are_chosen_least_recently_used(zctx, broker):
    workers = [worker(zctx, broker) for _ in range(3)]  # registered in this order
    c = Peer(zctx, broker)
    served = []
    for i in range(5):
        c.send(mdp.client_request(b"echo", b"%d" % i))
        index, req = first_request(workers)
        assert req[4:] == [b"%d" % i]
        served.append(index)
        workers[index].send(mdp.worker_final(req[2], b"r%d" % i))
        assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"r%d" % i]
    assert served == [0, 1, 2, 0, 1]


def test_queued_request_is_served_when_a_worker_arrives(zctx, broker):
    c = Peer(zctx, broker)
    c.send(mdp.client_request(b"late", b"q"))
    wait_stats(zctx, broker, lambda s: s["queued"] == 1)
    w = Peer(zctx, broker)
    w.send(mdp.ready(b"late"))
    req = w.recv()
    assert req[:2] == [b"MDPW02", b"\x02"] and req[3:] == [b"", b"q"]
    w.send(mdp.worker_final(req[2], b"a"))
    assert c.recv() == [b"MDPC02", b"\x03", b"late", b"a"]


def test_queued_requests_expire_silently_and_are_counted(zctx, procs, port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"
    start_broker(procs, port_base, expiry_s=0.3)
    c = Peer(zctx, endpoint)
    c.send(mdp.client_request(b"ghost", b"old"))
    s = wait_stats(zctx, endpoint, lambda s: s["drops"].get("request_expired") == 1)
    assert s["queued"] == 0
    # a worker arriving now gets the NEXT request, never the expired one...
    w = worker(zctx, endpoint, b"ghost")
    c.send(mdp.client_request(b"ghost", b"new"))
    req = w.recv()
    assert req[3:] == [b"", b"new"]
    w.send(mdp.worker_final(req[2], b"for-new"))
    # ...and the client's first message ever is the reply to the new one
    assert c.recv() == [b"MDPC02", b"\x03", b"ghost", b"for-new"]


def test_mmi_service(zctx, broker):
    worker(zctx, broker, b"present")
    c = Peer(zctx, broker)
    for name, status in ((b"present", b"200"), (b"absent", b"404"), (b"mmi.stats", b"200")):
        c.send(mdp.client_request(b"mmi.service", name))
        assert c.recv() == [b"MDPC02", b"\x03", b"mmi.service", status]
    c.send(mdp.client_request(b"mmi.unknown", b"x"))
    assert c.recv() == [b"MDPC02", b"\x03", b"mmi.unknown", b"501"]


# ------------------------------------------------------------------ DISCONNECT rules

def test_duplicate_ready_gets_disconnect(zctx, broker):
    w = worker(zctx, broker)
    w.send(mdp.ready(b"echo"))
    assert w.recv() == DISCONNECT
    s = wait_stats(zctx, broker, lambda s: s["workers"] == 0)
    assert s["counters"]["disconnect.duplicate_ready"] == 1


def test_reply_with_no_request_gets_disconnect(zctx, broker):
    w = worker(zctx, broker)
    w.send(mdp.worker_final(b"\x00nobody", b"x"))
    assert w.recv() == DISCONNECT
    w2 = worker(zctx, broker)
    w2.send(mdp.worker_partial(b"\x00nobody", b"x"))
    assert w2.recv() == DISCONNECT


def test_reply_for_another_client_gets_disconnect(zctx, broker):
    w = worker(zctx, broker)
    c = Peer(zctx, broker)
    c.send(mdp.client_request(b"echo", b"q"))
    req = w.recv()
    w.send(mdp.worker_final(req[2] + b"x", b"wrong"))
    assert w.recv() == DISCONNECT
    # the request was re-queued: a new worker serves it and the client gets one FINAL
    w2 = Peer(zctx, broker)
    w2.send(mdp.ready(b"echo"))
    req2 = w2.recv()
    assert req2 == req
    w2.send(mdp.worker_final(req2[2], b"right"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"right"]


def test_unknown_peer_heartbeat_gets_disconnect(zctx, broker):
    w = Peer(zctx, broker)
    w.send(mdp.heartbeat())
    assert w.recv(skip_heartbeats=False) == DISCONNECT


def test_worker_disconnect_mid_request_requeues(zctx, broker):
    w1 = worker(zctx, broker)
    c = Peer(zctx, broker)
    c.send(mdp.client_request(b"echo", b"q"))
    req = w1.recv()
    w1.send(mdp.disconnect())
    w2 = Peer(zctx, broker)
    w2.send(mdp.ready(b"echo"))
    assert w2.recv() == req
    w2.send(mdp.worker_final(req[2], b"r"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"r"]
    s = stats(zctx, broker)
    assert s["counters"]["requeued"] == 1 and s["counters"]["workers_disconnected"] == 1


# ------------------------------------------------------------------ heartbeats

def test_broker_heartbeats_arrive(zctx, broker):
    w = worker(zctx, broker)
    for _ in range(3):
        w.send(mdp.heartbeat())
        assert w.recv(skip_heartbeats=False) == HEARTBEAT  # exactly two frames


def test_silent_worker_is_gone_and_its_request_goes_to_another(zctx, procs, port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"
    start_broker(procs, port_base, liveness=3)  # gone after 0.6 s of silence
    w1 = worker(zctx, endpoint)
    c = Peer(zctx, endpoint)
    c.send(mdp.client_request(b"echo", b"work"))
    req = w1.recv()
    w2 = Peer(zctx, endpoint)
    w2.send(mdp.ready(b"echo"))
    # w1 dies (says nothing more); w2 stays alive by heartbeating until it gets the request
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, "the request never moved to the live worker"
        if w2.sock.poll(int(HB_S * 1000)):
            frames = w2.sock.recv_multipart()
            if frames != HEARTBEAT:
                break
        w2.send(mdp.heartbeat())
    assert frames == req
    w2.send(mdp.worker_final(req[2], b"done"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"done"]
    s = stats(zctx, endpoint)
    assert s["counters"]["workers_expired"] >= 1 and s["counters"]["requeued"] == 1
    assert s["services"]["echo"]["workers"] == 1


# ------------------------------------------------------------------ bad input

def garbage(rng):
    """Messages the broker must drop, each counted exactly once."""
    msgs = []
    for _ in range(150):  # random frame counts of random bytes
        msgs.append([bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 12)))
                     + b"?" for _ in range(rng.randrange(1, 70))])
    for _ in range(50):  # bad headers
        msgs.append([rng.choice([b"MDPC01", b"MDPW01", b"MDP", b"mdpc02", b"MDPC02 "]),
                     b"\x01", b"echo", b"x"])
    for _ in range(50):  # bad command bytes
        msgs.append([b"MDPC02", bytes([rng.choice([0, 4, 5, 255])]), b"echo", b"x"])
        msgs.append([b"MDPW02", bytes([rng.choice([0, 7, 8, 200])]), b"echo"])
        msgs.append([b"MDPW02", b"\x05\x05"])
    msgs += [[b""]] * 20  # empty messages (one empty frame)
    msgs += [[b"", b"MDPC01", b"echo", b"x"]] * 5  # MDP/0.1 style
    msgs += [[b"MDPC02", b"\x01", b"echo"]] * 5  # no body frame
    msgs += [[b"MDPC02", b"\x01", b"echo", *[b"x"] * 80]] * 3  # too many frames
    msgs += [[b"MDPC02", b"\x01", b"bad\nname", b"x"]] * 3
    msgs += [[b"MDPW02", b"\x05", b"extra"]] * 3
    msgs += [[b"J" * (4 << 20)], [b"MDPC02", b"\x09", b"Z" * (4 << 20)],
             [b"MDPC02", b"\x01", b"s" * (1 << 20), b"x"]]  # huge frames
    rng.shuffle(msgs)
    return msgs


def test_a_burst_of_garbage_leaves_the_broker_serving(zctx, broker):
    rng = random.Random(18)
    msgs = garbage(rng)
    g = Peer(zctx, broker)
    for frames in msgs:
        g.send(frames)
    s = wait_stats(zctx, broker, lambda s: sum(s["drops"].values()) >= len(msgs), 15)
    assert sum(s["drops"].values()) == len(msgs)
    assert {"bad_header", "bad_command", "frame_count", "leading_empty_frame",
            "bad_service", "oversize_body"} <= set(s["drops"])
    # the broker serves the next valid client
    w = worker(zctx, broker)
    c = Peer(zctx, broker)
    c.send(mdp.client_request(b"echo", b"still"))
    req = w.recv()
    w.send(mdp.worker_final(req[2], b"alive"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"alive"]


def test_an_invalid_worker_is_forgotten(zctx, broker):
    w = worker(zctx, broker)
    w.send([b"MDPW02", b"\x04", b"\x00addr", b"not-empty", b"x"])  # missing delimiter
    wait_stats(zctx, broker, lambda s: s["workers"] == 0 and s["drops"])
    w.send(mdp.heartbeat())  # unknown now: DISCONNECT
    assert w.recv() == DISCONNECT


# ------------------------------------------------------------------ restart recovery

def test_recovery_when_the_broker_restarts(procs, port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"
    first = start_broker(procs, port_base, liveness=3)

    def echo(request):
        return [b"echo", *request.body]

    async def main():
        ctx = zmq.Context()
        try:
            async with MdpWorker(endpoint, "echo", echo, ctx=ctx, heartbeat_s=HB_S,
                                 liveness=3) as w:
                client = MdpClient(endpoint, ctx=ctx, timeout_s=1.0, retries=2)
                assert await client.request("echo", b"1") == [b"echo", b"1"]
                await asyncio.to_thread(first.stop)
                # a request while no broker runs: attempts time out, each on a new socket
                pending = asyncio.ensure_future(
                    client.request("echo", b"2", timeout_s=0.4, retries=40))
                while client.counters["attempts"] < 3:
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(start_broker, procs, port_base, liveness=3)
                assert await pending == [b"echo", b"2"]
                assert client.counters["sockets"] >= 2 and client.counters["timeouts"] >= 1
                assert w.counters["connects"] >= 2  # re-registered with the new broker
                assert await client.request("echo", b"3") == [b"echo", b"3"]
                await client.close()
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())


# ------------------------------------------------------------------ the command

def test_port_in_use_exits_3(procs, port_base):
    start_broker(procs, port_base)
    second = procs.python("-m", "clonemap.supervisor", "broker", "--bind",
                          f"tcp://127.0.0.1:{port_base}")
    assert second.wait(15) == 3
    second.stop()  # joins the output readers
    assert len(second.stderr) == 1 and "address already in use" in second.stderr[0]
    assert not any(line.startswith("READY") for line in second.stdout)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_stop_cleanly(procs, port_base, sig):
    proc = start_broker(procs, port_base)
    proc.signal(sig)
    assert proc.wait(10) == 0


def test_a_stopping_broker_disconnects_every_worker(zctx, procs, port_base):
    """A broker that stops sends each worker DISCONNECT (allowed by the spec), so workers
    start over at once instead of waiting out ``liveness`` heartbeats of silence."""
    proc = start_broker(procs, port_base)
    endpoint = f"tcp://127.0.0.1:{port_base}"
    workers = [worker(zctx, endpoint, b"echo"), worker(zctx, endpoint, b"other")]
    proc.signal(signal.SIGTERM)
    for w in workers:
        assert w.recv() == DISCONNECT
    assert proc.wait(10) == 0
