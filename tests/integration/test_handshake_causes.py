"""Telling a refused handshake from a dropped one (``clonemap.shards.common.handshake``), from
monitor messages as libzmq frames them."""
from __future__ import annotations

import struct

import zmq

from clonemap.shards.common.handshake import Refusals, cause_of


def event(kind: int, value: int = 0) -> list[bytes]:
    return [struct.pack("=HI", kind, value), b"tcp://127.0.0.1:5555"]


def test_an_unexplained_failure_is_a_refusal_only_when_it_repeats():
    watch = Refusals(curve=False)
    assert watch.cause(event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)) is None  # a drop?
    assert watch.cause(event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)) == "curve_required"
    watch = Refusals(curve=True)  # a CURVE client: another server key, or a drop
    assert watch.cause(event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)) is None
    assert watch.cause(event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)) == "wrong_server_key"


def test_every_other_cause_is_named_at_once():
    assert Refusals(curve=False).cause(event(zmq.EVENT_HANDSHAKE_FAILED_AUTH)) == "key_refused"
    assert Refusals(curve=True).cause(event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                            0x11000002)) == "curve_off"
    assert Refusals(curve=False).cause(event(zmq.EVENT_CONNECTED)) is None
    assert Refusals(curve=False).cause([b"not a monitor message"]) is None
    assert cause_of(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, False) is None


class _LateMonitorSocket(zmq.Socket):
    """A socket whose ``connect`` returns only once the server has failed the handshake:
    libzmq's I/O thread winning the race against whatever the caller does next. libzmq
    reports a failed handshake once and does not connect again."""

    server_failed = None  # the server socket's monitor, set by the test

    def connect(self, addr):
        result = super().connect(addr)
        if self.type != zmq.DEALER:  # (the monitors' own PAIR sockets)
            return result
        from zmq.utils.monitor import recv_monitor_message

        while True:  # (each message: the server's own account of the connection)
            got = recv_monitor_message(self.server_failed)
            if got["event"] & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                               | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                return result


class _LateMonitorContext(zmq.Context):
    _socket_class = _LateMonitorSocket


def test_the_mdp_client_sees_a_refusal_that_came_before_its_connect_returned():
    """A plain MDP client asks a CURVE broker, and the handshake fails before ``connect``
    returns. The client must still name the cause (``curve_required``) rather than wait
    out its deadline: it watches the socket before it connects. (It attached its monitor
    after the connect, and a loaded host lost the only event: ``chp`` said "requires
    CURVE" after 30 s, its first attempt's timeout.)"""
    import asyncio

    import pytest

    from clonemap.shards.common.errors import HandshakeRefused
    from clonemap.shards.common.mdp.client import MdpClient

    ctx = _LateMonitorContext()
    public, secret = zmq.curve_keypair()
    broker = ctx.socket(zmq.ROUTER)
    broker.linger = 0
    broker.curve_server, broker.curve_secretkey, broker.curve_publickey = True, secret, public
    _LateMonitorSocket.server_failed = broker.get_monitor_socket()
    port = broker.bind_to_random_port("tcp://127.0.0.1")

    async def ask():
        client = MdpClient(f"tcp://127.0.0.1:{port}", ctx=ctx, timeout_s=10, retries=0)
        try:
            with pytest.raises(HandshakeRefused) as refused:
                await client.request(b"echo", b"x")
            return refused.value.cause
        finally:
            await client.close()

    try:
        assert asyncio.run(ask()) == "curve_required"
    finally:
        _LateMonitorSocket.server_failed.close()
        broker.close()
        ctx.term()
