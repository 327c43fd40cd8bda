"""Binary Star state message: what a server publishes to its peer on P+3. Pure codec.

Each server of a pair publishes this on its P+3 PUB every heartbeat (and at once when its
state changes); its peer's SUB (subscribed to everything) feeds it to ``clonemap.shards.bstar``.

Frame table (network byte order)::

    frame  size      field
    f0     6         signature "BSTAR1" (protocol and version; anything else is refused)
    f1     22 + n    body:
             offset  size  field
             0       1     state         1 PRIMARY, 2 BACKUP, 3 ACTIVE, 4 PASSIVE
             1       1     role          1 primary, 2 backup: the sender's configured role
             2       4     heartbeat_ms  the sender's publishing interval, 1..3,600,000
             6       8     term          how many takeovers the sender knows of (see
                                         shards.bstar: decides which side of a dual
                                         active survives)
             14      8     sequence      the sender's current 12/CHP sequence (for
                                         status and lag; the state machine ignores it)
             22      n     shard         the shard's name, UTF-8, 0..255 bytes ("" when
                                         the server was started without one)

Rules this module enforces (``ProtocolError`` with ``protocol="bstar/1"`` and a reason):
exactly 2 frames (``frame_count``); the signature (``bad_signature``); a body of at least
22 bytes and at most 22 + 255 (``bad_size``); a known state and role, and a state that
agrees with the role (PRIMARY is only ever sent by the primary, BACKUP by the backup)
(``bad_state``, ``bad_role``); heartbeat_ms in range (``bad_heartbeat``); the shard name
UTF-8 (``bad_shard``).

A pair across hosts with synchronous replication (``clonemap.shards.pair``) also publishes its
passive's confirmations on P+3: 3 frames, ``BSTAR-HAVE``, the name of its link to the
active (1..255 bytes) and the sequence its replica holds (8 bytes); the same said again
with each heartbeat has a fourth, the active's term the replica follows (8 bytes), and
an active of another term ignores it. A reader of P+3 tells
them apart by the first frame (``is_confirmation``); the active's SUB reads them only
from its configured peer. ``BSTAR-FOLLOW`` (on P, with the sequence) and ``BSTAR-UPD``
(active -> passive on P, a KVPUB's 5 frames after it) complete that link.

Why these fields: the heartbeat lets a peer compute the sender's expiry from the rate it
actually publishes at (a pair with different heartbeats does not flap); the role catches
two servers both configured primary (or backup), which would otherwise sit in PRIMARY
forever refusing every client; the shard name catches a --peer pointing at another
shard's server; the term breaks dual-active ties without losing data (shards.bstar).
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple

FOLLOW = b"BSTAR-FOLLOW"
"""Passive -> active on P (its link DEALER, named by ``ROUTING_ID``), with its sequence:
send every batch here before publishing it. It says where batches go, nothing more."""
HAVE = b"BSTAR-HAVE"
"""Passive -> active on the passive's P+3, with the link's name and a sequence: the
replica holds every update up to it. Never taken from P: anyone who reaches P could
forge it."""
UPDATES = b"BSTAR-UPD"
"""Active -> passive on P: one KVPUB (its 5 frames follow) not yet published."""


def is_confirmation(frames: list[bytes]) -> bool:
    """Whether a P+3 message is a ``BSTAR-HAVE`` rather than a state message."""
    return bool(frames) and frames[0] == HAVE

from clonemap.shards.common.errors import ProtocolError

PROTOCOL = "bstar/1"
SIGNATURE = b"BSTAR1"
MAX_SHARD_NAME = 255
MAX_HEARTBEAT_MS = 3_600_000

_BODY = struct.Struct(">BBIQQ")
BODY_SIZE = _BODY.size  # 22


class State(enum.IntEnum):
    PRIMARY = 1
    BACKUP = 2
    ACTIVE = 3
    PASSIVE = 4


class Role(enum.IntEnum):
    PRIMARY = 1
    BACKUP = 2


class StateMessage(NamedTuple):
    state: State
    role: Role
    heartbeat_s: float
    term: int = 0
    sequence: int = 0
    shard: str = ""


def _fail(message: str, reason: str) -> ProtocolError:
    return ProtocolError(f"{PROTOCOL} state: {message}", protocol=PROTOCOL, command="STATE",
                         reason=reason)


def encode(msg: StateMessage) -> list[bytes]:
    """The two frames to publish. Raises ``ProtocolError`` if a field cannot be encoded."""
    state, role = State(msg.state), Role(msg.role)
    _check_state_role(state, role)
    heartbeat_ms = round(msg.heartbeat_s * 1000)
    if not 1 <= heartbeat_ms <= MAX_HEARTBEAT_MS:
        raise _fail(f"heartbeat {msg.heartbeat_s!r} s is out of range", "bad_heartbeat")
    shard = msg.shard.encode("utf-8")
    if len(shard) > MAX_SHARD_NAME:
        raise _fail(f"shard name is {len(shard)} bytes, limit {MAX_SHARD_NAME}", "bad_shard")
    if not (0 <= msg.term < 1 << 64 and 0 <= msg.sequence < 1 << 64):
        raise _fail("term and sequence must fit in 64 bits", "bad_size")
    return [SIGNATURE, _BODY.pack(state, role, heartbeat_ms, msg.term, msg.sequence) + shard]


def decode(frames: list[bytes]) -> StateMessage:
    """Parse and validate a received state message."""
    if len(frames) != 2:
        raise _fail(f"expected 2 frames, got {len(frames)}", "frame_count")
    if frames[0] != SIGNATURE:
        raise _fail(f"signature {bytes(frames[0][:16])!r} is not {SIGNATURE!r}",
                    "bad_signature")
    body = frames[1]
    if not BODY_SIZE <= len(body) <= BODY_SIZE + MAX_SHARD_NAME:
        raise _fail(f"body is {len(body)} bytes, expected {BODY_SIZE}.."
                    f"{BODY_SIZE + MAX_SHARD_NAME}", "bad_size")
    state_b, role_b, heartbeat_ms, term, sequence = _BODY.unpack_from(body)
    try:
        state = State(state_b)
    except ValueError:
        raise _fail(f"unknown state {state_b}", "bad_state") from None
    try:
        role = Role(role_b)
    except ValueError:
        raise _fail(f"unknown role {role_b}", "bad_role") from None
    _check_state_role(state, role)
    if not 1 <= heartbeat_ms <= MAX_HEARTBEAT_MS:
        raise _fail(f"heartbeat {heartbeat_ms} ms is out of range", "bad_heartbeat")
    try:
        shard = bytes(body[BODY_SIZE:]).decode("utf-8")
    except UnicodeDecodeError:
        raise _fail("shard name is not UTF-8", "bad_shard") from None
    return StateMessage(state, role, heartbeat_ms / 1000.0, term, sequence, shard)


def _check_state_role(state: State, role: Role) -> None:
    if (state is State.PRIMARY and role is not Role.PRIMARY) or (
            state is State.BACKUP and role is not Role.BACKUP):
        raise _fail(f"state {state.name} cannot come from a {role.name.lower()}", "bad_state")


PEER_DOWN = b"peer-down"
"""The body of a supervisor's stats request (MDP ``shard.<SHARD>.<ROLE>``) telling a server
that its peer is not running and will not come back by itself (it stopped on a disk
error, or is FAILED): ``clonemap.shards.bstar`` rule 9."""
