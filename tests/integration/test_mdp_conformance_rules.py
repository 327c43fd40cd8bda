"""More MDP/0.2 rules at the frame level, raw pyzmq DEALERs against a real broker process:
MDP/0.1 framing refused, replies routed to the right client, LRU with out-of-order
finishes, heartbeats both ways at the configured interval, a dead worker sent nothing
more, an invalid worker's request re-queued, expiry logged, a vanished client counted.

Heartbeat "intervals" are checked as upper bounds on counts over a window the test
measures itself (a loaded machine can only make heartbeats later, never more frequent).
"""
from __future__ import annotations

import asyncio
import time

import psutil
import zmq

from helpers import wait_stderr
from clonemap.shards.common.mdp.worker import MdpWorker
from clonemap.shards.common.mdp import codec as mdp
from test_mdp_conformance import (DISCONNECT, HEARTBEAT, Peer, first_request, start_broker,
                                  stats, wait_stats, worker)

HB_S = 0.2


def endpoint_of(port):
    return f"tcp://127.0.0.1:{port}"


def drain(sock, quiet_s=0.1):
    """Read and discard until nothing has arrived for ``quiet_s``."""
    while sock.poll(int(quiet_s * 1000)):
        sock.recv_multipart()


def nothing_arrives(peer, window_s):
    """True if no message at all reaches ``peer`` within ``window_s``."""
    return not peer.sock.poll(int(window_s * 1000))


# ------------------------------------------------------------------ framing

def test_mdp01_leading_empty_frame_is_invalid_and_never_forwarded(zctx, procs, port_base):
    ep = endpoint_of(port_base)
    start_broker(procs, port_base)
    w = worker(zctx, ep)
    c = Peer(zctx, ep)
    c.send([b"", b"MDPC02", b"\x01", b"echo", b"v01-style"])  # an MDP/0.1 client framing
    c.send(mdp.client_request(b"echo", b"v02"))
    req = w.recv()  # the first request the worker sees is the valid one
    assert req == [b"MDPW02", b"\x02", req[2], b"", b"v02"]
    w.send(mdp.worker_final(req[2], b"r"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"r"]
    # a worker framed the MDP/0.1 way is not registered: its next command is refused
    w01 = Peer(zctx, ep)
    w01.send([b"", b"MDPW02", b"\x01", b"old"])
    s = wait_stats(zctx, ep, lambda s: s["drops"].get("leading_empty_frame") == 2)
    assert "old" not in s["services"]
    w01.send(mdp.heartbeat())
    assert w01.recv(skip_heartbeats=False) == DISCONNECT


# ------------------------------------------------------------------ routing

def test_partials_and_finals_reach_the_right_client_with_the_service_name(zctx, procs,
                                                                          port_base):
    ep = endpoint_of(port_base)
    start_broker(procs, port_base)
    wa, wb = worker(zctx, ep, b"alpha"), worker(zctx, ep, b"beta")
    c1, c2 = Peer(zctx, ep), Peer(zctx, ep)
    c1.send(mdp.client_request(b"alpha", b"from-1"))
    c2.send(mdp.client_request(b"beta", b"from-2"))
    ra, rb = wa.recv(), wb.recv()
    assert ra[4:] == [b"from-1"] and rb[4:] == [b"from-2"] and ra[2] != rb[2]
    # interleaved streams: each client gets only its own, tagged with its service
    wb.send(mdp.worker_partial(rb[2], b"b1"))
    wa.send(mdp.worker_partial(ra[2], b"a1"))
    wb.send(mdp.worker_partial(rb[2], b"b2"))
    wa.send(mdp.worker_final(ra[2], b"a-end"))
    wb.send(mdp.worker_final(rb[2], b"b-end"))
    assert [c1.recv() for _ in range(2)] == [[b"MDPC02", b"\x02", b"alpha", b"a1"],
                                             [b"MDPC02", b"\x03", b"alpha", b"a-end"]]
    assert [c2.recv() for _ in range(3)] == [[b"MDPC02", b"\x02", b"beta", b"b1"],
                                             [b"MDPC02", b"\x02", b"beta", b"b2"],
                                             [b"MDPC02", b"\x03", b"beta", b"b-end"]]
    # after FINAL nothing more reaches either client
    assert nothing_arrives(c1, 0.3) and nothing_arrives(c2, 0.01)


def test_lru_when_workers_finish_out_of_order(zctx, procs, port_base):
    ep = endpoint_of(port_base)
    start_broker(procs, port_base)
    workers = [worker(zctx, ep) for _ in range(3)]  # idle since: 0, 1, 2
    c1, c2 = Peer(zctx, ep), Peer(zctx, ep)
    c1.send(mdp.client_request(b"echo", b"a"))
    i, ra = first_request(workers)
    c2.send(mdp.client_request(b"echo", b"b"))
    j, rb = first_request(workers)
    assert (i, j) == (0, 1)
    workers[1].send(mdp.worker_final(rb[2], b"rb"))  # 1 finishes first, then 0
    assert c2.recv()[3:] == [b"rb"]
    workers[0].send(mdp.worker_final(ra[2], b"ra"))
    assert c1.recv()[3:] == [b"ra"]
    served = []
    for n in range(3):  # least recently used first: 2 (idle since READY), then 1, then 0
        c1.send(mdp.client_request(b"echo", b"%d" % n))
        k, req = first_request(workers)
        served.append(k)
        workers[k].send(mdp.worker_final(req[2], b"ok"))
        assert c1.recv()[3:] == [b"ok"]
    assert served == [2, 1, 0]


# ------------------------------------------------------------------ heartbeats

def test_broker_heartbeats_a_silent_worker_at_the_configured_interval(zctx, procs, port_base):
    ep = endpoint_of(port_base)
    start_broker(procs, port_base, liveness=25)  # the worker may stay silent for 5 s
    w = worker(zctx, ep)  # it now says nothing at all
    drain(w.sock, 0)
    t0 = time.monotonic()
    got = 0
    while got < 5:
        assert w.recv(5.0, skip_heartbeats=False) == HEARTBEAT  # exactly 2 frames, no more
        got += 1
    window_s = time.monotonic() - t0
    # never more often than every HB_S (one or two may have been in flight at t0)
    assert got <= window_s / HB_S + 2


def test_worker_library_heartbeats_at_its_interval_and_the_broker_keeps_it(zctx, port_base):
    ep = endpoint_of(port_base)
    hb_s = 0.1

    async def body():
        router = zctx.socket(zmq.ROUTER)
        router.linger = 0
        router.bind(ep)
        async with MdpWorker(ep, "echo", lambda r: r.body, ctx=zctx, heartbeat_s=hb_s,
                             liveness=50):
            def count():
                assert router.poll(5000)
                ident, *ready = router.recv_multipart()
                assert ready == [b"MDPW02", b"\x01", b"echo"]
                drain(router, 0)
                t0, n = time.monotonic(), 0
                while n < 6:
                    assert router.poll(5000), "the worker stopped heartbeating"
                    assert router.recv_multipart() == [ident, b"MDPW02", b"\x05"]
                    n += 1
                return n, time.monotonic() - t0
            n, window_s = await asyncio.to_thread(count)
        assert n <= window_s / hb_s + 2
    asyncio.run(body())


def test_a_dead_worker_is_sent_nothing_more_and_refused_if_it_speaks(zctx, procs, port_base):
    ep = endpoint_of(port_base)
    start_broker(procs, port_base, liveness=3)  # gone after 0.6 s of silence
    w = worker(zctx, ep)
    wait_stats(zctx, ep, lambda s: s["counters"]["workers_expired"] == 1 and s["workers"] == 0)
    drain(w.sock)  # heartbeats sent before it was declared gone
    assert nothing_arrives(w, 4 * HB_S)  # the spec: stop sending it anything
    w.send(mdp.heartbeat())
    assert w.recv(skip_heartbeats=False) == DISCONNECT  # an unknown peer now


# ------------------------------------------------------------------ invalid peers

def test_an_invalid_worker_mid_request_is_forgotten_and_its_request_requeued(zctx, procs,
                                                                            port_base):
    ep = endpoint_of(port_base)
    start_broker(procs, port_base)
    w1 = worker(zctx, ep)
    c = Peer(zctx, ep)
    c.send(mdp.client_request(b"echo", b"job"))
    req = w1.recv()
    w1.send([b"MDPW02", b"\x04", req[2], b"not-empty", b"x"])  # invalid: no delimiter
    wait_stats(zctx, ep, lambda s: s["counters"]["workers_invalid"] == 1
               and s["drops"].get("missing_delimiter") == 1)
    w1.send(mdp.worker_final(req[2], b"too late"))  # valid now, but it is forgotten
    assert w1.recv() == DISCONNECT
    w2 = Peer(zctx, ep)
    w2.send(mdp.ready(b"echo"))
    assert w2.recv() == req  # the same request, byte for byte
    w2.send(mdp.worker_final(req[2], b"done"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"done"]  # one FINAL, from w2
    assert nothing_arrives(c, 0.3)
    assert stats(zctx, ep)["counters"]["requeued"] == 1


def test_disconnect_before_ready_is_ignored(zctx, procs, port_base):
    ep = endpoint_of(port_base)
    start_broker(procs, port_base)
    w = Peer(zctx, ep)
    w.send(mdp.disconnect())  # allowed at any time, even before READY
    w.send(mdp.ready(b"echo"))  # and it may still register afterwards
    w.wait_heartbeat()
    s = stats(zctx, ep)
    assert s["services"]["echo"]["workers"] == 1 and s["counters"]["disconnects_sent"] == 0


# ------------------------------------------------------------------ expiry, vanished clients

def test_unknown_service_client_told_nothing_expiry_logged_and_counted(zctx, procs,
                                                                       port_base):
    ep = endpoint_of(port_base)
    proc = start_broker(procs, port_base, expiry_s=0.3)
    c = Peer(zctx, ep)
    c.send(mdp.client_request(b"mmi.service", b"nobody"))
    assert c.recv() == [b"MDPC02", b"\x03", b"mmi.service", b"404"]
    c.send(mdp.client_request(b"nobody", b"q1"))
    c.send(mdp.client_request(b"nobody", b"q2"))
    s = wait_stats(zctx, ep, lambda s: s["drops"].get("request_expired") == 2)
    assert s["queued"] == 0 and s["counters"]["queued"] == 2
    line = proc.stderr[wait_stderr(proc, "dropped (request_expired)", 5.0)]
    assert "'nobody'" in line and "0.3 s" in line
    assert nothing_arrives(c, 0.3)  # the client is told nothing


def _peer_ports(pid: int, port: int) -> set[int]:
    """The remote ports of process ``pid``'s TCP connections on its local ``port``."""
    return {c.raddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.raddr and c.laddr.port == port}


def test_a_reply_to_a_vanished_client_is_counted_and_the_worker_goes_on(zctx, procs,
                                                                       port_base):
    ep = endpoint_of(port_base)
    broker = start_broker(procs, port_base)
    w = worker(zctx, ep)
    # ZeroMQ discards a message to a peer whose pipe the broker's socket has not yet
    # seen end (no error to count): so the FINAL goes out only once the broker's I/O
    # thread has closed its end of the vanished client's connection (its fd gone from
    # the broker's process), then after a round trip through the broker. On a loaded
    # host that ordering could still lose by a hair, so a second client may be tried.
    for attempt in range(1, 4):
        before = _peer_ports(broker.pid, port_base)
        gone = Peer(zctx, ep)
        gone.send(mdp.client_request(b"echo", b"then leave"))
        req = w.recv()
        (gone_port,) = _peer_ports(broker.pid, port_base) - before
        gone.close()
        deadline = time.monotonic() + 10.0
        while gone_port in _peer_ports(broker.pid, port_base):
            assert time.monotonic() < deadline, "the broker never saw the client leave"
            time.sleep(0.01)
        stats(zctx, ep)
        w.send(mdp.worker_final(req[2], b"nobody hears this"))
        s = wait_stats(zctx, ep, lambda s: s["counters"]["finals"] == attempt)
        if s["unroutable"] >= 1:
            break
    assert s["unroutable"] == 1 and s["drops"]["unroutable"] == 1
    c = Peer(zctx, ep)
    c.send(mdp.client_request(b"echo", b"next"))
    req2 = w.recv()
    assert req2[4:] == [b"next"]
    w.send(mdp.worker_final(req2[2], b"fine"))
    assert c.recv() == [b"MDPC02", b"\x03", b"echo", b"fine"]


# ------------------------------------------------------------------ the command

def test_an_endpoint_that_cannot_be_bound_exits_2_with_one_line(procs):
    proc = procs.python("-m", "clonemap.supervisor", "broker", "--bind", "bogus://nowhere")
    assert proc.wait(15) == 2
    proc.stop()  # joins the output readers
    assert len(proc.stderr) == 1 and "cannot bind bogus://nowhere" in proc.stderr[0]
    assert proc.stdout == []
