"""18/MDP (Majordomo Protocol) version 0.2 wire codec: pure functions, no sockets.

Frame table (a ROUTER's peer-identity frame is not shown; the caller strips/prepends it).
MDP/0.2 has NO empty delimiter frame at the start of a command (MDP/0.1 had one)::

    sub-protocol  command     f0        f1    f2               f3        f4+
    MDP/Client    REQUEST     "MDPC02"  0x01  service          body...   (C -> B)
    MDP/Client    PARTIAL     "MDPC02"  0x02  service          body...   (B -> C)
    MDP/Client    FINAL       "MDPC02"  0x03  service          body...   (B -> C)
    MDP/Worker    READY       "MDPW02"  0x01  service          -         (W -> B)
    MDP/Worker    REQUEST     "MDPW02"  0x02  client address   ""        body... (B -> W)
    MDP/Worker    PARTIAL     "MDPW02"  0x03  client address   ""        body... (W -> B)
    MDP/Worker    FINAL       "MDPW02"  0x04  client address   ""        body... (W -> B)
    MDP/Worker    HEARTBEAT   "MDPW02"  0x05  -                          (both ways)
    MDP/Worker    DISCONNECT  "MDPW02"  0x06  -                          (both ways)

Rules this module enforces (each violation raises ``ProtocolError`` with
``protocol="18/MDP"``, the command if recognised, and a ``reason`` tag):

* f0 is exactly "MDPC02" or "MDPW02" (``bad_header``; a message whose first frame is
  empty is reported as ``leading_empty_frame``: that is an MDP/0.1 peer);
* f1 is exactly one byte and a command of that sub-protocol (``bad_command``);
* the frame count: client commands 4 or more (at least one body frame), READY exactly 3,
  worker REQUEST/PARTIAL/FINAL 5 or more (one address frame, one empty frame, at least
  one body frame), HEARTBEAT and DISCONNECT exactly 2 (``frame_count``);
* a service name is 1..``Limits.max_service`` bytes of UTF-8 text that is printable
  (``str.isprintable``: no control characters) (``bad_service``);
* a client address is 1..``Limits.max_address`` bytes and is followed by an empty frame
  (``bad_address``, ``missing_delimiter``);
* a body has at most ``Limits.max_body_frames`` frames and ``Limits.max_body_bytes``
  bytes in all (``oversize_body``).

A command with no body frame. The spec says "4 or more frames" (client) and "5 or more"
(worker REQUEST/PARTIAL/FINAL): a body has at least one frame. Decoders reject a message
without one (``frame_count``); builders never produce one: an empty body is sent as one
empty frame. So ``client_request("echo")`` puts ``["MDPC02", 0x01, "echo", ""]`` on the
wire, and a peer always gets at least one body frame back.

Direction. ``decode_client`` / ``decode_worker`` accept every command of their
sub-protocol; which commands may travel which way (REQUEST only towards the broker on
MDP/Client, READY never towards a worker...) is the caller's business, since the same
decoders serve the broker, the client and the worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from clonemap.shards.common.errors import ProtocolError

PROTOCOL = "18/MDP"

MDPC = b"MDPC02"
MDPW = b"MDPW02"

# MDP/Client command bytes
C_REQUEST = b"\x01"
C_PARTIAL = b"\x02"
C_FINAL = b"\x03"
# MDP/Worker command bytes
W_READY = b"\x01"
W_REQUEST = b"\x02"
W_PARTIAL = b"\x03"
W_FINAL = b"\x04"
W_HEARTBEAT = b"\x05"
W_DISCONNECT = b"\x06"

CLIENT_COMMANDS = {C_REQUEST: "REQUEST", C_PARTIAL: "PARTIAL", C_FINAL: "FINAL"}
WORKER_COMMANDS = {W_READY: "READY", W_REQUEST: "REQUEST", W_PARTIAL: "PARTIAL",
                   W_FINAL: "FINAL", W_HEARTBEAT: "HEARTBEAT", W_DISCONNECT: "DISCONNECT"}

EMPTY_BODY = (b"",)


@dataclass(frozen=True, slots=True)
class Limits:
    """Size bounds applied when decoding. Out-of-bounds input raises ``ProtocolError``."""

    max_service: int = 255
    max_address: int = 255
    max_body_frames: int = 56
    max_body_bytes: int = 64 << 20


DEFAULT_LIMITS = Limits()


class ClientMessage(NamedTuple):
    """An MDP/Client command: ``command`` is ``C_REQUEST``, ``C_PARTIAL`` or ``C_FINAL``."""

    command: bytes
    service: bytes
    body: list[bytes]


class WorkerMessage(NamedTuple):
    """An MDP/Worker command. ``service`` is set for READY only; ``client`` and ``body``
    for REQUEST, PARTIAL and FINAL only (empty otherwise)."""

    command: bytes
    service: bytes = b""
    client: bytes = b""
    body: Sequence[bytes] = ()


def _fail(message: str, command: str, reason: str) -> ProtocolError:
    return ProtocolError(f"18/MDP {command or 'message'}: {message}",
                         protocol=PROTOCOL, command=command, reason=reason)


def command_name(header: bytes, command: bytes) -> str:
    """``"REQUEST"``, ``"READY"``... for a header and command byte, ``""`` if unknown."""
    table = CLIENT_COMMANDS if header == MDPC else WORKER_COMMANDS if header == MDPW else {}
    return table.get(command, "")


# ----------------------------------------------------------------------------- checks

_SERVICE_OK: set[bytes] = set()
_SERVICE_CACHE_MAX = 4096


def check_service(service: bytes, command: str = "", limits: Limits = DEFAULT_LIMITS) -> bytes:
    """A service name: 1..max_service bytes of printable UTF-8 text. Returns it."""
    if service in _SERVICE_OK and len(service) <= limits.max_service:
        return service
    if not service:
        raise _fail("service name is empty", command, "bad_service")
    if len(service) > limits.max_service:
        raise _fail(f"service name is {len(service)} bytes, limit {limits.max_service}",
                    command, "bad_service")
    try:
        text = service.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(f"service name is not UTF-8 ({exc.reason} at byte {exc.start})",
                    command, "bad_service") from None
    if not text.isprintable():
        raise _fail(f"service name {service[:64]!r} is not printable", command, "bad_service")
    if len(_SERVICE_OK) >= _SERVICE_CACHE_MAX:
        _SERVICE_OK.clear()
    _SERVICE_OK.add(service)
    return service


def _check_body(body: list[bytes], command: str, limits: Limits) -> list[bytes]:
    if len(body) > limits.max_body_frames:
        raise _fail(f"body has {len(body)} frames, limit {limits.max_body_frames}", command,
                    "oversize_body")
    size = 0
    for frame in body:
        size += len(frame)
    if size > limits.max_body_bytes:
        raise _fail(f"body is {size} bytes, limit {limits.max_body_bytes}", command,
                    "oversize_body")
    return body


def _check_header(frames: Sequence[bytes], header: bytes) -> None:
    if not frames:
        raise _fail("no frames", "", "frame_count")
    head = frames[0]
    if head != header:
        if not head and len(frames) > 1 and frames[1] in (MDPC, MDPW, b"MDPC01", b"MDPW01"):
            raise _fail("leading empty frame (MDP/0.2 has none; an MDP/0.1 peer?)", "",
                        "leading_empty_frame")
        raise _fail(f"header {head[:16]!r} is not {header.decode()}", "", "bad_header")


def _command(frames: Sequence[bytes], table: dict[bytes, str]) -> str:
    if len(frames) < 2:
        raise _fail("no command frame", "", "frame_count")
    name = table.get(frames[1])
    if name is None:
        raise _fail(f"unknown command {frames[1][:8]!r}", "", "bad_command")
    return name


# ---------------------------------------------------------------------------- decoders

def decode_client(frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> ClientMessage:
    """Decode an MDP/Client command (REQUEST, PARTIAL or FINAL)."""
    _check_header(frames, MDPC)
    name = _command(frames, CLIENT_COMMANDS)
    if len(frames) < 4:
        raise _fail(f"expected 4 or more frames, got {len(frames)}", name, "frame_count")
    service = check_service(frames[2], name, limits)
    return ClientMessage(frames[1], service, _check_body(list(frames[3:]), name, limits))


def decode_worker(frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> WorkerMessage:
    """Decode an MDP/Worker command (READY ... DISCONNECT)."""
    _check_header(frames, MDPW)
    name = _command(frames, WORKER_COMMANDS)
    command = frames[1]
    n = len(frames)
    if command == W_HEARTBEAT or command == W_DISCONNECT:
        if n != 2:
            raise _fail(f"expected 2 frames, got {n}", name, "frame_count")
        return WorkerMessage(command)
    if command == W_READY:
        if n != 3:
            raise _fail(f"expected 3 frames, got {n}", name, "frame_count")
        return WorkerMessage(command, check_service(frames[2], name, limits))
    if n < 5:
        raise _fail(f"expected 5 or more frames, got {n}", name, "frame_count")
    client = frames[2]
    if not client or len(client) > limits.max_address:
        raise _fail(f"client address is {len(client)} bytes (1..{limits.max_address})", name,
                    "bad_address")
    if frames[3]:
        raise _fail(f"frame 3 must be empty (envelope delimiter), got {len(frames[3])} bytes",
                    name, "missing_delimiter")
    return WorkerMessage(command, b"", client, _check_body(list(frames[4:]), name, limits))


def decode(frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS) -> ClientMessage | WorkerMessage:
    """Decode any MDP/0.2 command, choosing the sub-protocol by the header frame."""
    if frames and frames[0] == MDPW:
        return decode_worker(frames, limits)
    return decode_client(frames, limits)


# ---------------------------------------------------------------------------- builders

def _body(body: Sequence[bytes]) -> Sequence[bytes]:
    return body if body else EMPTY_BODY


def client_request(service: bytes, *body: bytes) -> list[bytes]:
    return [MDPC, C_REQUEST, service, *_body(body)]


def client_partial(service: bytes, *body: bytes) -> list[bytes]:
    return [MDPC, C_PARTIAL, service, *_body(body)]


def client_final(service: bytes, *body: bytes) -> list[bytes]:
    return [MDPC, C_FINAL, service, *_body(body)]


def ready(service: bytes) -> list[bytes]:
    return [MDPW, W_READY, service]


def worker_request(client: bytes, *body: bytes) -> list[bytes]:
    return [MDPW, W_REQUEST, client, b"", *_body(body)]


def worker_partial(client: bytes, *body: bytes) -> list[bytes]:
    return [MDPW, W_PARTIAL, client, b"", *_body(body)]


def worker_final(client: bytes, *body: bytes) -> list[bytes]:
    return [MDPW, W_FINAL, client, b"", *_body(body)]


def heartbeat() -> list[bytes]:
    return [MDPW, W_HEARTBEAT]


def disconnect() -> list[bytes]:
    return [MDPW, W_DISCONNECT]


def encode(message: ClientMessage | WorkerMessage) -> list[bytes]:
    """The inverse of ``decode`` (for round trips and tests)."""
    if isinstance(message, ClientMessage):
        return [MDPC, message.command, message.service, *_body(message.body)]
    command = message.command
    if command == W_READY:
        return ready(message.service)
    if command in (W_HEARTBEAT, W_DISCONNECT):
        return [MDPW, command]
    return [MDPW, command, message.client, b"", *_body(message.body)]
