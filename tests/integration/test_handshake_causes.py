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
