"""The MDP worker and client libraries: against a real broker process, and against a raw
ROUTER playing the broker (to see their exact frames, reconnects and fresh sockets)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import zmq

from clonemap.shards.common.errors import PortInUse, Timeout
from clonemap.shards.common.mdp.client import MdpClient, RequestTimeout, SyncMdpClient
from clonemap.shards.common.mdp.worker import MdpWorker
from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.mdp.broker import Broker
from clonemap.shards.common.mdp.broker_config import BrokerConfig
from conftest import keeping_context

HB_S = 0.2


def start_broker(procs, port, liveness=3):
    return procs.python("-m", "clonemap.supervisor", "broker", "--bind", f"tcp://127.0.0.1:{port}",
                        "--heartbeat-s", str(HB_S), "--liveness", str(liveness),
                        ready="READY broker")


@pytest.fixture
def broker(procs, port_base):
    start_broker(procs, port_base)
    return f"tcp://127.0.0.1:{port_base}"


def run(coro_fn, *args):
    """Run an async test body with its own zmq context (closed with linger 0)."""
    async def main():
        ctx = keeping_context()
        try:
            return await coro_fn(ctx, *args)
        finally:
            ctx.destroy(linger=0)
    return asyncio.run(main())


async def stats_handler(request):
    for i in range(5):
        await request.partial(b"figure", b"%d" % i)
    return [b"done", *request.body]


def echo(request):
    return request.body


# ------------------------------------------------------------------ against the broker

def test_stream_partials_then_final(broker):
    async def body(ctx):
        async with MdpWorker(broker, "stats", stats_handler, ctx=ctx, heartbeat_s=HB_S):
            async with MdpClient(broker, ctx=ctx, timeout_s=3) as client:
                async with client.stream("stats", b"s0") as replies:
                    parts = [part async for part in replies]
                assert parts == [[b"figure", b"%d" % i] for i in range(5)]
                assert replies.final == [b"done", b"s0"]
                # request() skips PARTIALs and returns the FINAL body
                assert await client.request("stats", b"s1") == [b"done", b"s1"]
                assert client.counters["partials"] == 10 and client.counters["sockets"] == 1
    run(body)


def test_sync_client_request_and_stream(broker):
    async def body(ctx):
        async with MdpWorker(broker, "stats", stats_handler, ctx=ctx, heartbeat_s=HB_S), \
                MdpWorker(broker, "echo", echo, ctx=ctx, heartbeat_s=HB_S):
            def sync():
                with SyncMdpClient(broker, ctx=ctx, timeout_s=3) as client:
                    assert client.request("echo", b"a", b"b") == [b"a", b"b"]
                    assert client.request("echo") == [b""]  # an empty body is one frame
                    stream = client.stream("stats", b"x")
                    assert len(list(stream)) == 5 and stream.final == [b"done", b"x"]
            await asyncio.to_thread(sync)
    run(body)


def test_many_clients_in_flight_share_workers(broker):
    async def body(ctx):
        async with MdpWorker(broker, "echo", echo, ctx=ctx, heartbeat_s=HB_S), \
                MdpWorker(broker, "echo", echo, ctx=ctx, heartbeat_s=HB_S) as w2:
            clients = [MdpClient(broker, ctx=ctx, timeout_s=3) for _ in range(6)]

            async def drive(i, client):
                for j in range(20):
                    assert await client.request("echo", b"%d-%d" % (i, j)) == [b"%d-%d" % (i, j)]
            await asyncio.gather(*(drive(i, c) for i, c in enumerate(clients)))
            assert w2.counters["requests"] > 0
            for c in clients:
                await c.close()
    run(body)


def test_timeout_names_service_endpoint_and_deadline(broker):
    async def body(ctx):
        client = MdpClient(broker, ctx=ctx)
        with pytest.raises(RequestTimeout) as info:
            await client.request("nobody", b"x", timeout_s=0.2, retries=1)
        exc = info.value
        assert isinstance(exc, Timeout) and isinstance(exc, TimeoutError)
        assert (exc.service, exc.endpoint, exc.deadline_s, exc.attempts) == (
            "nobody", broker, 0.2, 2)
        assert "'nobody'" in str(exc) and broker in str(exc) and "0.2 s" in str(exc)
        assert client.counters["sockets"] == 2  # the retry went out on a fresh socket
        await client.close()

        def sync():
            with SyncMdpClient(broker, ctx=ctx) as sc:
                with pytest.raises(RequestTimeout) as sinfo:
                    sc.request("nobody", b"x", timeout_s=0.2, retries=0)
                assert sinfo.value.attempts == 1 and sinfo.value.service == "nobody"
        await asyncio.to_thread(sync)
    run(body)


def test_handler_error_answers_500_and_the_worker_goes_on(broker):
    def flaky(request):
        if request.body == [b"boom"]:
            raise ValueError("boom")
        return b"ok"

    async def body(ctx):
        async with MdpWorker(broker, "flaky", flaky, ctx=ctx, heartbeat_s=HB_S) as w:
            async with MdpClient(broker, ctx=ctx, timeout_s=3) as client:
                assert await client.request("flaky", b"boom") == [b"500", b"ValueError: boom"]
                assert await client.request("flaky", b"fine") == [b"ok"]
                assert w.counters["handler_errors"] == 1
    run(body)


def test_worker_reregisters_after_disconnect_from_a_restarted_broker(procs, port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"
    first = start_broker(procs, port_base)

    async def body(ctx):
        # liveness 100: the worker would wait 20 s to notice silence, so the quick
        # recovery below can only come from a DISCONNECT: the stopping broker's, or the
        # new broker's answer to a peer it does not know (a READY that reached the old
        # broker while it was closing leaves the worker unknown to the new one: then both)
        async with MdpWorker(endpoint, "echo", echo, ctx=ctx, heartbeat_s=HB_S,
                             liveness=100) as w:
            async with MdpClient(endpoint, ctx=ctx, timeout_s=3) as client:
                assert await client.request("echo", b"1") == [b"1"]
                await asyncio.to_thread(first.stop)
                await asyncio.to_thread(start_broker, procs, port_base)
                assert await client.request("echo", b"2", timeout_s=0.5, retries=20) == [b"2"]
                assert w.counters["disconnects_received"] >= 1
                assert 2 <= w.counters["connects"] <= 3 and w.counters["broker_silent"] == 0
    run(body)


def test_embedded_broker_hosts_services_beside_a_worker_and_clients(port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def cluster_map(request):
        for shard in (b"s0", b"s1"):
            await request.partial(shard)
        return b"2 shards"

    def broken(request):
        raise RuntimeError("nope")

    async def body(ctx):
        broker = Broker([endpoint], BrokerConfig(heartbeat_s=HB_S), ctx=ctx)
        broker.register("cluster.map", cluster_map)
        broker.register("broken", broken)
        async with broker:  # broker, worker and client share one loop
            with pytest.raises(PortInUse) as info:
                await Broker(endpoint, ctx=ctx).start()
            assert info.value.endpoint == endpoint
            async with MdpClient(endpoint, ctx=ctx, timeout_s=3) as client, \
                    MdpWorker(endpoint, "echo", echo, ctx=ctx, heartbeat_s=HB_S):
                async with client.stream("cluster.map") as replies:
                    parts = [part async for part in replies]
                assert parts == [[b"s0"], [b"s1"]] and replies.final == [b"2 shards"]
                assert await client.request("broken") == [b"500", b"RuntimeError: nope"]
                assert await client.request("mmi.service", b"cluster.map") == [b"200"]
                assert await client.request("echo", b"x") == [b"x"]
            stats = broker.stats()
            assert stats["counters"]["internal_calls"] == 2 and stats["internal_errors"] == 1
            assert stats["endpoints"] == [endpoint] and stats["services"]["echo"]["workers"] <= 1
    run(body)


# ------------------------------------------------------------------ against a raw ROUTER

def recv(sock, timeout_s=5.0):
    assert sock.poll(int(timeout_s * 1000)), f"nothing within {timeout_s} s"
    return sock.recv_multipart()


def recv_not_heartbeat(sock, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        frames = recv(sock, max(0.01, deadline - time.monotonic()))
        if frames[1:] != [b"MDPW02", b"\x05"]:
            return frames


def fake_broker(ctx, port):
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(f"tcp://127.0.0.1:{port}")
    return router


def test_worker_frames_heartbeats_disconnect_and_fresh_socket(port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def body(ctx):
        router = fake_broker(ctx, port_base)
        w = MdpWorker(endpoint, "stats", stats_handler, ctx=ctx, heartbeat_s=HB_S,
                      liveness=50)
        await w.start()
        ident, *ready = await asyncio.to_thread(recv, router)
        assert ready == [b"MDPW02", b"\x01", b"stats"]
        for _ in range(2):  # heartbeats, exactly two frames
            assert await asyncio.to_thread(recv, router) == [ident, b"MDPW02", b"\x05"]
        router.send_multipart([ident, *mdp.worker_request(b"\x00cli", b"q")])
        got = [await asyncio.to_thread(recv_not_heartbeat, router) for _ in range(6)]
        assert got[:5] == [[ident, b"MDPW02", b"\x03", b"\x00cli", b"", b"figure", b"%d" % i]
                           for i in range(5)]
        assert got[5] == [ident, b"MDPW02", b"\x04", b"\x00cli", b"", b"done", b"q"]
        # DISCONNECT: a new READY from a fresh socket (a new identity)
        router.send_multipart([ident, *mdp.disconnect()])
        ident2, *ready2 = await asyncio.to_thread(recv_not_heartbeat, router)
        assert ready2 == [b"MDPW02", b"\x01", b"stats"] and ident2 != ident
        await w.stop()
        assert await asyncio.to_thread(recv_not_heartbeat, router) == [
            ident2, b"MDPW02", b"\x06"]
        assert w.counters["connects"] == 2 and w.counters["disconnects_received"] == 1
    run(body)


def test_worker_reconnects_when_the_broker_is_silent(port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def body(ctx):
        router = fake_broker(ctx, port_base)
        async with MdpWorker(endpoint, "echo", echo, ctx=ctx, heartbeat_s=0.1,
                             liveness=3) as w:
            identities = set()
            while len(identities) < 2:  # the router never speaks: the worker starts over
                frames = await asyncio.to_thread(recv_not_heartbeat, router)
                assert frames[1:] == [b"MDPW02", b"\x01", b"echo"]
                identities.add(frames[0])
            assert w.counters["broker_silent"] >= 1
    run(body)


def test_worker_cancels_a_running_handler_on_disconnect(port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def body(ctx):
        began = asyncio.Event()

        async def slow(request):
            began.set()
            await asyncio.sleep(30)
            return b"never"

        router = fake_broker(ctx, port_base)
        async with MdpWorker(endpoint, "slow", slow, ctx=ctx, heartbeat_s=HB_S,
                             liveness=50) as w:
            ident, *_ = await asyncio.to_thread(recv, router)
            router.send_multipart([ident, *mdp.worker_request(b"\x00cli", b"q")])
            await asyncio.wait_for(began.wait(), 5)
            router.send_multipart([ident, *mdp.disconnect()])
            ident2, *ready = await asyncio.to_thread(recv_not_heartbeat, router)
            assert ready == [b"MDPW02", b"\x01", b"slow"] and ident2 != ident
            assert w.counters["cancelled"] == 1 and w.counters["finals"] == 0
    run(body)


def test_client_retries_on_a_fresh_socket_and_checks_replies(port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def body(ctx):
        router = fake_broker(ctx, port_base)
        client = MdpClient(endpoint, ctx=ctx, timeout_s=0.3, retries=3)
        pending = asyncio.ensure_future(client.request("echo", b"q"))
        first = await asyncio.to_thread(recv, router)  # not answered: times out
        second = await asyncio.to_thread(recv, router)
        assert first[1:] == second[1:] == [b"MDPC02", b"\x01", b"echo", b"q"]
        assert first[0] != second[0]  # a fresh socket, a new identity
        router.send_multipart([second[0], *mdp.client_final(b"other", b"x")])  # dropped
        router.send_multipart([second[0], *mdp.client_request(b"echo", b"x")])  # dropped
        router.send_multipart([second[0], b"MDPC02", b"\x03"])  # invalid: dropped
        router.send_multipart([second[0], *mdp.client_partial(b"echo", b"p")])
        router.send_multipart([second[0], *mdp.client_final(b"echo", b"r")])
        assert await pending == [b"r"]
        assert client.drops.counts == {"wrong_service": 1, "wrong_direction": 1,
                                       "frame_count": 1}
        assert client.counters["sockets"] == 2 and client.counters["partials"] == 1
        await client.close()
    run(body)


def test_a_patient_request_waits_on_its_one_attempt_while_told_to(port_base):
    """``patient()`` (a supervisor asking a server it knows runs, starved at background
    priority): each deadline without a reply asks it; True waits again on the same socket,
    nothing sent again; False ends the request as before."""
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def body(ctx):
        router = fake_broker(ctx, port_base)
        client = MdpClient(endpoint, ctx=ctx, timeout_s=0.2, retries=2)
        asked: list[list[bytes]] = []
        looks: list[float] = []

        def patient() -> bool:
            looks.append(time.monotonic())
            if len(looks) == 3:  # the worker answers at last, on the first attempt
                router.send_multipart([asked[0][0], *mdp.client_final(b"stats", b"late")])
            return True

        began = time.monotonic()
        pending = asyncio.ensure_future(client.request("stats", b"q", patient=patient))
        asked.append(await asyncio.to_thread(recv, router))
        assert await pending == [b"late"]
        assert len(looks) == 3 and looks[0] - began >= 0.2
        assert client.counters["patient_waits"] == 3 and client.counters["timeouts"] == 0
        assert client.counters["attempts"] == 1 and client.counters["sockets"] == 1
        assert router.poll(0) == 0  # (nothing was sent again)
        # told not to wait: the deadline ends the attempt, and the retries go on as ever
        with pytest.raises(RequestTimeout):
            await client.request("stats", b"q2", retries=0, patient=lambda: False)
        assert client.counters["timeouts"] == 1 and client.counters["patient_waits"] == 3
        await client.close()
    run(body)


def test_abandoned_stream_closes_the_socket(port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def body(ctx):
        router = fake_broker(ctx, port_base)
        client = MdpClient(endpoint, ctx=ctx, timeout_s=2)
        async with client.stream("stats") as replies:
            task = asyncio.ensure_future(replies.__anext__())
            req = await asyncio.to_thread(recv, router)
            router.send_multipart([req[0], *mdp.client_partial(b"stats", b"p1")])
            assert await task == [b"p1"]
        # left before the FINAL: the next request goes out on a new socket
        pending = asyncio.ensure_future(client.request("stats", b"next"))
        req2 = await asyncio.to_thread(recv, router)
        assert req2[0] != req[0]
        router.send_multipart([req[0], *mdp.client_final(b"stats", b"late")])  # old socket
        router.send_multipart([req2[0], *mdp.client_final(b"stats", b"fresh")])
        assert await pending == [b"fresh"]
        await client.close()
    run(body)


def test_a_cancelled_request_closes_the_socket(port_base):
    endpoint = f"tcp://127.0.0.1:{port_base}"

    async def body(ctx):
        router = fake_broker(ctx, port_base)
        client = MdpClient(endpoint, ctx=ctx, timeout_s=5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.request("echo", b"1"), 0.3)
        req = await asyncio.to_thread(recv, router)
        pending = asyncio.ensure_future(client.request("echo", b"2"))
        req2 = await asyncio.to_thread(recv, router)
        assert req2[0] != req[0]  # a fresh socket: the late reply below cannot reach it
        router.send_multipart([req[0], *mdp.client_final(b"echo", b"late-for-1")])
        router.send_multipart([req2[0], *mdp.client_final(b"echo", b"for-2")])
        assert await pending == [b"for-2"]
        await client.close()
    run(body)


def test_a_stopped_worker_tells_the_broker_at_once(broker):
    async def body(ctx):
        async with MdpClient(broker, ctx=ctx, timeout_s=3) as client:
            async def echo_workers():
                stats = json.loads((await client.request("mmi.stats"))[0])
                return stats["services"].get("echo", {}).get("workers", 0), stats

            # without its DISCONNECT the broker would only notice the silence (0.6 s here),
            # and count the worker as expired, not disconnected
            w = MdpWorker(broker, "echo", echo, ctx=ctx, heartbeat_s=HB_S)
            await w.start()
            assert await client.request("echo", b"x") == [b"x"]
            await w.stop()
            deadline = time.monotonic() + 5
            while (await echo_workers())[0]:
                assert time.monotonic() < deadline, "the broker never heard the DISCONNECT"
                await asyncio.sleep(0.02)
            stats = (await echo_workers())[1]
            assert stats["counters"]["workers_disconnected"] == 1
            assert stats["counters"]["workers_expired"] == 0
    run(body)
