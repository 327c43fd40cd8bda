"""Telling why a ZeroMQ security handshake failed, from the connecting socket's monitor.

A plain client that connects to a CURVE server (or the reverse) is never answered: it
reconnects and fails again, every 100 ms, and without a monitor all it sees is silence
until its deadline (7.8 s for ``chp``, reported as "is the supervisor up?"). libzmq says
why on the socket's monitor at the first try; ``cause_of`` turns that event into one of
``errors.HANDSHAKE_CAUSES``, which every connecting client reports as
``errors.HandshakeRefused`` at once.

Attach the monitor before ``connect``: libzmq reports a refused handshake once (a
mechanism mismatch, measured with libzmq 4.3.5: one ``HANDSHAKE_FAILED_PROTOCOL`` and
no new connection after it), so an event from before the monitor is lost, and the
client waits out its deadline (``test_handshake_causes.py`` forces it).
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


class Refusals:
    """``refused`` for one connecting socket, without the false alarm: a plain client
    that connects to a CURVE server sees a handshake fail with no detail, and so does a
    CURVE client given another cluster's server key, but so does any client whose
    connection dropped mid-handshake (measured: ``supervisor stop`` said "the cluster
    requires CURVE" of a plain cluster busy restarting a server, and "its server.key
    differs" of a CURVE supervisor closing its broker while ``stop`` waited for it to
    go). A refused client fails again at each reconnection (every 100 ms), so that
    ambiguous failure names a cause only the second time in a row; every other cause at
    once."""

    AMBIGUOUS_REPEATS = 2

    def __init__(self, curve: bool):
        self.curve = curve
        self.ambiguous = 0

    def cause(self, frames: list[bytes]) -> str | None:
        event = monitor_event(frames)
        if event is None:
            return None
        if event[0] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.ambiguous += 1
            if self.ambiguous < self.AMBIGUOUS_REPEATS:
                return None
        return cause_of(*event, self.curve)


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
