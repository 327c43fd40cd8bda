"""Telling why a ZeroMQ security handshake failed, from the connecting socket's monitor.

A plain client that connects to a CURVE server (or the reverse) is never answered: it
reconnects and fails again, every 100 ms, and without a monitor all it sees is silence
until its deadline (7.8 s for ``chp``, reported as "is the supervisor up?"). libzmq says
why on the socket's monitor at the first try; ``cause_of`` turns that event into one of
``errors.HANDSHAKE_CAUSES``, which every connecting client reports as
``errors.HandshakeRefused`` at once.
"""
from __future__ import annotations

import zmq

FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                 | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""The monitor events a connecting socket watches for (plus whatever else it wants)."""

_MECHANISM_MISMATCH = getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002)


def monitor_event(frames: list[bytes]) -> tuple[int, int] | None:
    """(event, value) of a socket monitor's message, or None if it is not one."""
    from zmq.utils.monitor import parse_monitor_message

    try:
        parsed = parse_monitor_message(frames)
    except Exception:  # not a monitor message: nothing to tell
        return None
    return int(parsed["event"]), int(parsed["value"])


def refused(frames: list[bytes], curve: bool) -> str | None:
    """The cause a monitor message says a handshake failed for (``cause_of``), or None:
    what a client that only watches for refusals needs."""
    event = monitor_event(frames)
    return cause_of(*event, curve) if event is not None else None


def cause_of(event: int, value: int, curve: bool) -> str | None:
    """The cause (a key of ``HANDSHAKE_CAUSES``) of a handshake-failure monitor event,
    seen by a client that offered CURVE (``curve``) or not; None for other events."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "key_refused"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
        return "curve_off" if curve else "curve_required"
    if event & FAILED_EVENTS:
        return "wrong_server_key" if curve else "curve_required"
    return None
