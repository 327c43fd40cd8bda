"""12/CHP (Clustered Hashmap Protocol) wire codec: pure functions, no sockets.

Frame table (ROUTER identity frames are not shown; the caller strips/prepends them)::

    command   channel                 f0            f1 (8 B, network order)  f2 (0|16 B)  f3          f4
    ICANHAZ   client DEALER -> P      "ICANHAZ?"    subtree                  -            -           -
    KVSYNC    P -> client DEALER      key           sequence (may be 0)      <empty>      <empty>     value
    KTHXBAI   P -> client DEALER      "KTHXBAI"     sequence (highest sent)  <empty>      <empty>     subtree
    KVPUB     P+1 PUB -> client SUB   key           sequence (strictly +1)   UUID         properties  value
    HUGZ      P+1 PUB -> client SUB   "HUGZ"        00000000                 <empty>      clock (*)   <empty>
    KVSET     client PUB -> P+2 SUB   key           sequence (ignored, 0)    UUID         properties  value

Rules this module enforces (each violation raises ``ProtocolError`` naming it):

* a message has exactly the frame count above (ICANHAZ 2, the rest 5);
* a sequence is exactly 8 bytes; a UUID is empty or exactly 16 bytes;
* a key is non-empty UTF-8 text, at most ``Limits.max_key`` bytes, and is not one of the
  command words ("ICANHAZ?", "KTHXBAI", "HUGZ"), which would make messages ambiguous;
* a subtree is empty, or "/" followed by one or more segments each ending in "/";
* properties are zero or more ``name=value\\n`` lines; a name is non-empty and holds no
  "=", a value may hold "=" (the guide's Python kvmsg drops such properties; we do not);
* key, value and properties sizes are bounded by ``Limits`` (configurable).

A HUGZ is recognised by its key "HUGZ" *and* sequence 0 (KVPUB sequences start at 1).
(*) Deviation from 12/CHP (frame 3 empty): our servers put properties in a HUGZ: the
clock (``ts=``, ``seq=``: ``hugz_clock``), the map's generation (``gen=``) and term (``term=``), ``serving=0``,
``route=`` with the routing's ``epoch=``, and ``cas=1`` (``hugz_info``); strict CHP clients key on "HUGZ" and ignore the
rest. What each means, and why, is in shards/README.md, *Protocol decisions*. Values are
opaque bytes; an empty value means delete.

Liberal reading (``strict=False``, what a client uses) tolerates the guide's reference C
server (clonesrv6): a KVSYNC with UUID and properties (``Kvsync.uuid``/``props``), a
KTHXBAI with an empty subtree, a HUGZ with a sequence (``Hugz.seq``); ``strict=True``
(the default: our conformance tests) refuses all three. Properties stay raw bytes in the
message tuples (cheap on the hot path): ``parse_props`` / ``format_props`` convert.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import NamedTuple

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto.props import (  # noqa: F401 (part of this module's interface)
    ADOPTED, FULL_AFTER_RESUME, NARROWED, REFUSED_READ, RESUMED, STAGED, KthxbaiInfo, drop_props,
    format_props, in_subtree, kthxbai_info, kthxbai_props, parse_props)

PROTOCOL = "12/CHP"

ICANHAZ = b"ICANHAZ?"
KTHXBAI = b"KTHXBAI"
HUGZ = b"HUGZ"
RESERVED_KEYS = frozenset({ICANHAZ, KTHXBAI, HUGZ})

SEQ_ZERO = b"\x00" * 8
UUID_SIZE = 16

_SEQ = struct.Struct(">Q")
pack_seq = _SEQ.pack
unpack_seq = _SEQ.unpack
_SUBTREE_RE = re.compile(rb"(?:/(?:[^/]+/)+)?\Z")


@dataclass(frozen=True, slots=True)
class Limits:
    """Size bounds applied when decoding. Oversized input raises ``ProtocolError``."""

    max_key: int = 1024
    max_value: int = 1 << 20
    max_props: int = 4096
    max_subtree: int = 1024


DEFAULT_LIMITS = Limits()


class Icanhaz(NamedTuple):
    subtree: bytes
    since: int | None = None
    """Our resume extension: the client holds the map up to this sequence."""
    generation: str = ""
    """... of this generation (a resume is only served against the same map)."""
    meta: bool = False
    """``meta=1``: each KVSYNC of a key with a TTL carries ``expires=<epoch s>`` in frame 3
    (asked only of servers that announce ``cas=1``)."""
    term: int | None = None
    """... whose last update came from a server in this Binary Star term (``term=``; None:
    not said, an older client). See ``kthxbai_props``."""
    move: int | None = None
    """``move=<shard index>`` (a move's copy, ``clonemap.shards.migrate``): only the keys
    that the routing the server exports gives that shard."""
    pace: int | None = None
    """With ``move=``, ``pace=<bytes per second>``: the copy's rate; the server sends the
    snapshot no faster (keys and values), so that it does not fill the pipe's high-water
    mark at full speed at the start (None: as fast as the pipe takes it)."""
    adopt: dict[str, tuple[int, int]] | None = None
    """``adopt=<gen>:<seq>:<epoch>,...``: the requester holds each of these maps (by
    generation) up to that sequence, whole as its server sent it under that routing
    epoch, and asks a shard that a routing change added to resume it from the end of
    its copy of them (``clonemap.shards.snapshots``)."""


class Kvsync(NamedTuple):
    key: bytes
    seq: int
    value: bytes
    uuid: bytes = b""
    props: bytes = b""
    """Empty from a 12/CHP server; the reference C server sends the stored ones."""


class Kthxbai(NamedTuple):
    seq: int
    subtree: bytes
    props: bytes = b""
    """Empty (12/CHP); ``resume=1``/``resume=0`` in reply to a resume request."""


class Kvpub(NamedTuple):
    key: bytes
    seq: int
    uuid: bytes
    props: bytes
    value: bytes


class Kvset(NamedTuple):
    key: bytes
    uuid: bytes
    props: bytes
    value: bytes


class Hugz(NamedTuple):
    props: bytes = b""
    """Empty, or the server clock ``ts=...\nseq=...\n`` (see ``hugz_clock``)."""
    seq: int = 0
    """0 by 12/CHP; the reference C server sends its current sequence."""


_HUGZ = Hugz()


class HugzInfo(NamedTuple):
    """What a HUGZ's properties say (``hugz_info``)."""
    ts: float | None
    """The server clock (epoch s), or None."""
    seq: int
    """The server's sequence (-1 if not given)."""
    serving: bool
    """False: the server says it will not answer an ICANHAZ now (``serving=0``)."""
    generation: str
    """The map's generation token ("" if not given)."""
    route: str = ""
    """``I/N/DIGEST``: the server is shard I of N under the routing DIGEST ("" if not
    given: a standalone or foreign server)."""
    cas: bool = False
    """``cas=1``: the server decides conditional writes and answers ``reply=`` (see
    ``write_props``)."""
    term: int = 0
    """``term=``: the Binary Star term of the server's map (0 if not given)."""
    epoch: int = 0
    """``epoch=`` (with ``route=``): the epoch of the routing the server follows (0 if not
    given); of two routings of one cluster, the larger epoch is the newer."""


_PLAIN_HUGZ_INFO = HugzInfo(None, -1, True, "")


def _fail(message: str, command: str, reason: str) -> ProtocolError:
    return ProtocolError(f"12/CHP {command or 'message'}: {message}",
                         protocol=PROTOCOL, command=command, reason=reason)


# ----------------------------------------------------------------------------- checks

def _check_count(frames: list[bytes], want: int, command: str) -> None:
    if len(frames) != want:
        raise _fail(f"expected {want} frames, got {len(frames)}", command, "frame_count")


def _seq(frame: bytes, command: str) -> int:
    if len(frame) != 8:
        raise _fail(f"sequence must be 8 bytes, got {len(frame)}", command, "bad_sequence")
    return unpack_seq(frame)[0]


MAX_TTL_S = 10 * 365 * 86400.0
"""Longest ``ttl`` our servers accept (and furthest ``expires``): ten years. Beyond it a
KVSET is dropped, counted ``bad_ttl``; clients check it before sending."""


def check_key(key: bytes, command: str = "", limits: Limits = DEFAULT_LIMITS) -> bytes:
    if not key:
        raise _fail("key is empty", command, "bad_key")
    if len(key) > limits.max_key:
        raise _fail(f"key is {len(key)} bytes, limit {limits.max_key}", command, "oversize_key")
    if key in RESERVED_KEYS:
        raise _fail(f"key {key!r} is a reserved command word", command, "bad_key")
    try:
        key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(f"key is not UTF-8 ({exc.reason} at byte {exc.start})", command,
                    "bad_key") from None
    return key


def check_subtree(subtree: bytes, command: str = "",
                  limits: Limits = DEFAULT_LIMITS) -> bytes:
    if len(subtree) > limits.max_subtree:
        raise _fail(f"subtree is {len(subtree)} bytes, limit {limits.max_subtree}", command,
                    "bad_subtree")
    if not _SUBTREE_RE.match(subtree):
        raise _fail(f"subtree {subtree[:80]!r} is not empty nor '/seg/.../'", command,
                    "bad_subtree")
    try:
        subtree.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail("subtree is not UTF-8", command, "bad_subtree") from None
    return subtree


def _uuid(frame: bytes, command: str) -> bytes:
    if frame and len(frame) != UUID_SIZE:
        raise _fail(f"UUID must be empty or {UUID_SIZE} bytes, got {len(frame)}", command,
                    "bad_uuid")
    return frame


def check_props(props: bytes, command: str = "", limits: Limits = DEFAULT_LIMITS) -> bytes:
    if not props:
        return props
    if len(props) > limits.max_props:
        raise _fail(f"properties are {len(props)} bytes, limit {limits.max_props}", command,
                    "oversize_props")
    if not props.endswith(b"\n"):
        raise _fail("properties must end with a newline", command, "bad_props")
    for line in props[:-1].split(b"\n"):
        name, eq, _ = line.partition(b"=")
        if not eq or not name:
            raise _fail(f"property line {line[:80]!r} is not name=value", command, "bad_props")
    try:
        props.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail("properties are not UTF-8", command, "bad_props") from None
    return props


def _value(frame: bytes, command: str, limits: Limits) -> bytes:
    if len(frame) > limits.max_value:
        raise _fail(f"value is {len(frame)} bytes, limit {limits.max_value}", command,
                    "oversize_value")
    return frame


def _empty(frame: bytes, index: int, command: str) -> None:
    if frame:
        raise _fail(f"frame {index} must be empty, got {len(frame)} bytes", command,
                    "nonempty_frame")


# ---------------------------------------------------------------------------- decoders

def decode_icanhaz(frames: list[bytes], limits: Limits = DEFAULT_LIMITS) -> Icanhaz:
    """Decode a request on the snapshot ROUTER (identity frame already removed)."""
    if not frames or frames[0] != ICANHAZ:
        head = frames[0][:16] if frames else b""
        raise _fail(f"unknown command {head!r} on the snapshot port", "", "unknown_command")
    if len(frames) == 3 and frames[2]:  # our extensions (see ``icanhaz``)
        subtree = check_subtree(frames[1], "ICANHAZ", limits)
        fields = parse_props(check_props(frames[2], "ICANHAZ", limits))
        meta = fields.get("meta") == "1"
        if "move" in fields and "since" not in fields:
            move = _count_prop(fields, "move", "move= is not a shard index", "bad_move")
            pace = (_count_prop(fields, "pace", "pace= is not bytes per second", "bad_move")
                    if "pace" in fields else None)
            return Icanhaz(subtree, meta=meta, move=move, pace=pace or None)
        if "adopt" in fields and "since" not in fields:
            return Icanhaz(subtree, meta=meta, adopt=_adopt_claim(fields["adopt"]))
        if "since" not in fields and meta:
            return Icanhaz(subtree, meta=True)
        since = _count_prop(fields, "since", "a resume needs since=<sequence>", "bad_resume")
        term = (_count_prop(fields, "term", "term= is not a number", "bad_resume")
                if "term" in fields else None)
        return Icanhaz(subtree, since, fields.get("gen", ""), meta, term)
    _check_count(frames, 2, "ICANHAZ")
    return Icanhaz(check_subtree(frames[1], "ICANHAZ", limits))


ADOPT_MAPS_MAX = 256
"""Maps one ``adopt=`` may name."""


def _adopt_claim(text: str) -> dict[str, tuple[int, int]]:
    """``adopt=``'s maps: generation -> (the sequence the requester holds it up to, the
    routing epoch of the whole snapshot it was built from)."""
    out: dict[str, tuple[int, int]] = {}
    for item in text.split(",") if text else ():
        parts = item.split(":")
        if (len(parts) != 3 or not parts[0] or not parts[1].isdigit()
                or not parts[2].isdigit() or len(out) >= ADOPT_MAPS_MAX):
            raise _fail(f"adopt= is <generation>:<sequence>:<epoch>,... (at most "
                        f"{ADOPT_MAPS_MAX}), got {text[:80]!r}", "ICANHAZ", "bad_adopt")
        out[parts[0]] = (int(parts[1]), int(parts[2]))
    return out


def _count_prop(fields: dict[str, str], name: str, missing: str, reason: str) -> int:
    """An ICANHAZ property that is a whole number (a sequence, a term, a shard index):
    ``missing`` when it is absent or not a number, and it may not be negative."""
    try:
        value = int(fields[name])
    except (KeyError, ValueError):
        raise _fail(missing, "ICANHAZ", reason) from None
    if value < 0:
        raise _fail(f"{name}={value} is negative", "ICANHAZ", reason)
    return value


def decode_snapshot(frames: list[bytes], limits: Limits = DEFAULT_LIMITS, *,
                    strict: bool = True) -> Kvsync | Kthxbai:
    """Decode a reply on the client's snapshot DEALER: a KVSYNC or the closing KTHXBAI.
    ``strict=False`` also reads the reference C server's KVSYNC (UUID and properties in
    frames 2 and 3, checked as a KVPUB's); its empty KTHXBAI subtree decodes as given."""
    if frames and frames[0] == KTHXBAI:
        _check_count(frames, 5, "KTHXBAI")
        seq = _seq(frames[1], "KTHXBAI")
        _empty(frames[2], 2, "KTHXBAI")
        if strict:
            _empty(frames[3], 3, "KTHXBAI")
            return Kthxbai(seq, check_subtree(frames[4], "KTHXBAI", limits))
        return Kthxbai(seq, check_subtree(frames[4], "KTHXBAI", limits),
                       check_props(frames[3], "KTHXBAI", limits))
    _check_count(frames, 5, "KVSYNC")
    key = check_key(frames[0], "KVSYNC", limits)
    seq = _seq(frames[1], "KVSYNC")
    if strict or not (frames[2] or frames[3]):
        _empty(frames[2], 2, "KVSYNC")
        _empty(frames[3], 3, "KVSYNC")
        return Kvsync(key, seq, _value(frames[4], "KVSYNC", limits))
    return Kvsync(key, seq, _value(frames[4], "KVSYNC", limits), _uuid(frames[2], "KVSYNC"),
                  check_props(frames[3], "KVSYNC", limits))


def decode_snapshot_liberal(frames: list[bytes],
                            limits: Limits = DEFAULT_LIMITS) -> Kvsync | Kthxbai:
    """``decode_snapshot(frames, limits, strict=False)`` without the keyword's cost (a
    client's hot path during a sync)."""
    return decode_snapshot(frames, limits, strict=False)


def decode_update(frames: list[bytes], limits: Limits = DEFAULT_LIMITS, *,
                  strict: bool = True) -> Kvpub | Hugz:
    """Decode a message from the server's publisher: a KVPUB or a HUGZ. ``strict=False``
    also takes "HUGZ" with a non-zero sequence as a HUGZ (the reference C server's)."""
    _check_count(frames, 5, "KVPUB")
    seq = _seq(frames[1], "KVPUB")
    if frames[0] == HUGZ and (seq == 0 or not strict):
        _empty(frames[2], 2, "HUGZ")
        _empty(frames[4], 4, "HUGZ")
        props = frames[3]
        if not props and not seq:
            return _HUGZ
        return Hugz(check_props(props, "HUGZ", limits), seq)
    key = check_key(frames[0], "KVPUB", limits)
    return Kvpub(key, seq, _uuid(frames[2], "KVPUB"), check_props(frames[3], "KVPUB", limits),
                 _value(frames[4], "KVPUB", limits))


def decode_kvset(frames: list[bytes], limits: Limits = DEFAULT_LIMITS) -> Kvset:
    """Decode an update arriving on the server's collector. Its sequence is ignored."""
    _check_count(frames, 5, "KVSET")
    key = check_key(frames[0], "KVSET", limits)
    _seq(frames[1], "KVSET")
    return Kvset(key, _uuid(frames[2], "KVSET"), check_props(frames[3], "KVSET", limits),
                 _value(frames[4], "KVSET", limits))


# ---------------------------------------------------------------------------- builders

STAGED_PREFIX = b"\xff"
"""On a publisher, what a staged update's key (``STAGED``) is sent under: no key starts
with it (keys are UTF-8). Our servers take a subscription to everything (an empty topic)
as one to every first byte a UTF-8 key can have (``EVERY_KEY``): no client, strict
12/CHP peer or not, receives a staged update. A server's passive and its relays also
subscribe to this prefix, and take it off (``unstaged``). The resume history, the log and
the link to the passive keep the plain key."""
STAGED_RANGES = b"staged="
"""How the properties of the HUGZ that names staged sequences begin
(``staged_ranges_hugz``)."""

EVERY_KEY = tuple(bytes((byte,)) for byte in (*range(0x80), *range(0xC2, 0xF5)))
"""The topics a subscription to everything becomes on our publishers: each first byte of
a UTF-8 string (HUGZ among them), not ``STAGED_PREFIX``."""


def unstaged(frames: list[bytes]) -> list[bytes]:
    """A KVPUB as published, with a staged update's key given back (``STAGED_PREFIX``)."""
    if frames and frames[0][:1] == STAGED_PREFIX:
        return [frames[0][1:], *frames[1:]]
    return frames


def staged_ranges_hugz(ranges: list[tuple[int, int]]) -> list[bytes]:
    """The HUGZ that follows staged updates on a publisher (their sequences ``ranges``,
    inclusive), so that a subscriber that did not receive them (``EVERY_KEY``) knows
    its stream has no gap there: ``staged=A-B,C-D``. A strict 12/CHP peer sees a HUGZ."""
    text = ",".join(f"{a}-{b}" for a, b in ranges).encode()
    return [HUGZ, SEQ_ZERO, b"", STAGED_RANGES + text + b"\n", b""]


def staged_ranges(props: bytes) -> list[tuple[int, int]] | None:
    """The sequence ranges a ``staged_ranges_hugz`` names, or None (another HUGZ)."""
    if not props.startswith(STAGED_RANGES):
        return None
    out = []
    try:
        for part in props[len(STAGED_RANGES):].strip().split(b","):
            a, _, b = part.partition(b"-")
            out.append((int(a), int(b)))
    except ValueError:
        return None
    return out


def icanhaz(subtree: bytes = b"", since: int | None = None,
            generation: str = "", meta: bool = False, term: int | None = None,
            move: int | None = None,
            adopt: dict[str, tuple[int, int]] | None = None,
            pace: int | None = None) -> list[bytes]:
    """``ICANHAZ?``; with ``since``, our resume extension: a third frame of properties
    ``since=<S>\n`` (and ``gen=<generation>\n``, ``term=<T>\n``: the Binary Star term of
    the server that gave the client its updates, see ``kthxbai_props``). A server that holds every update after
    S of that map sends only those (KVSYNCs with their own sequences, UUIDs and
    properties; an empty value deletes), then KTHXBAI with ``resume=1``; otherwise a full
    snapshot whose KTHXBAI says ``resume=0``. ``meta``: ``meta=1\n`` (see
    ``Icanhaz.meta``); ``move``: ``move=<index>\n`` (see ``Icanhaz.move``), with
    ``pace``: ``pace=<bytes per second>\n`` (see ``Icanhaz.pace``); ``adopt``:
    ``adopt=<gen>:<seq>:<epoch>,...\n`` (see ``Icanhaz.adopt``)."""
    if adopt is not None:
        claim = ",".join(f"{gen}:{seq}:{epoch}" for gen, (seq, epoch) in adopt.items())
        claim = claim.encode("ascii")
        return [ICANHAZ, subtree, b"adopt=%s\n" % claim + (b"meta=1\n" if meta else b"")]
    if move is not None:
        return [ICANHAZ, subtree, b"move=%d\n" % move + (b"pace=%d\n" % pace if pace else b"")
                + (b"meta=1\n" if meta else b"")]
    if since is None and not meta:
        return [ICANHAZ, subtree]
    props = b"" if since is None else b"since=%d\n" % since
    if generation and since is not None:
        props += b"gen=%s\n" % generation.encode("ascii")
    if term is not None and since is not None:
        props += b"term=%d\n" % term
    if meta:
        props += b"meta=1\n"
    return [ICANHAZ, subtree, props]


def kvsync(key: bytes, value: bytes, seq: int = 0) -> list[bytes]:
    return [key, pack_seq(seq), b"", b"", value]


def kthxbai(seq: int, subtree: bytes = b"", props: bytes = b"") -> list[bytes]:
    return [KTHXBAI, pack_seq(seq), b"", props, subtree]


def kvpub(key: bytes, seq: int, value: bytes, uuid: bytes = b"", props: bytes = b"") -> list[bytes]:
    return [key, pack_seq(seq), uuid, props, value]


def kvset(key: bytes, value: bytes, uuid: bytes = b"", props: bytes = b"") -> list[bytes]:
    return [key, SEQ_ZERO, uuid, props, value]


def hugz(ts: float | None = None, seq: int = 0, *, serving: bool = True,
         generation: str = "", route: str = "", cas: bool = False,
         term: int = 0, epoch: int = 0) -> list[bytes]:
    """A HUGZ: plain (``ts`` None, serving: frames 2-4 empty, as 12/CHP has it), or
    carrying in frame 3 the server clock ``ts=<epoch s, 6 decimals>\nseq=<current
    sequence>\n`` and the map's ``gen=<token>\n`` (with ``ts``), and ``serving=0\n``
    when the server will not answer an ICANHAZ now (see the module doc)."""
    props = b""
    if ts is not None:
        props = b"ts=%.6f\nseq=%d\n" % (ts, seq)
        if generation:
            props += b"gen=%s\n" % generation.encode("ascii")
        if term:
            props += b"term=%d\n" % term
    if not serving:
        props += b"serving=0\n"
    if route:
        props += b"route=%s\n" % route.encode("ascii")
        if epoch:
            props += b"epoch=%d\n" % epoch
    if cas:
        props += b"cas=1\n"
    return [HUGZ, SEQ_ZERO, b"", props, b""]


def hugz_info(msg: Hugz) -> HugzInfo:
    """Everything a HUGZ's properties say; a plain HUGZ says nothing (serving, no clock,
    no generation). Unreadable values read as absent, never as an error."""
    props = msg.props
    if not props:
        return _PLAIN_HUGZ_INFO if not msg.seq else HugzInfo(None, msg.seq, True, "")
    fields = parse_props(props)
    clock = _clock_of(fields)
    ts, seq = clock if clock is not None else (None, msg.seq or -1)
    try:
        term = int(fields.get("term", "0"))
    except ValueError:
        term = 0
    try:
        epoch = int(fields.get("epoch", "0"))
    except ValueError:
        epoch = 0
    return HugzInfo(ts, seq, fields.get("serving", "1") != "0", fields.get("gen", ""),
                    fields.get("route", ""), fields.get("cas") == "1", max(term, 0),
                    max(epoch, 0))


def hugz_clock(msg: Hugz) -> tuple[float, int] | None:
    """``(ts, seq)`` of a HUGZ that carries the server clock, else None (a plain HUGZ, or
    properties without a valid ``ts``; a missing or bad ``seq`` reads as -1)."""
    props = msg.props
    if not props:
        return None
    return _clock_of(parse_props(props))


def _clock_of(fields: dict[str, str]) -> tuple[float, int] | None:
    try:
        ts = float(fields["ts"])
    except (KeyError, ValueError):
        return None
    if ts != ts or ts in (float("inf"), float("-inf")):
        return None
    try:
        seq = int(fields.get("seq", "-1"))
    except ValueError:
        seq = -1
    return ts, seq


# ------------------------------------------------------------------- conditional writes
#
# Our extension of KVSET: ``if-seq=<S>`` (apply only if the key's last-modified sequence
# is S; 0: only if absent) and ``reply=<hex>`` (the writer's DEALER on P, answered with a
# KVREPLY: f0 "KVREPLY", f1 UUID, f2 outcome, f3 sequence, f4 detail). The outcomes and
# their sequences: shards/README.md, *Protocol decisions*.

IF_SEQ = "if-seq"
REPLY_TO = "reply"
KVREPLY = b"KVREPLY"
APPLIED, DUPLICATE, CONFLICT, REFUSED = b"applied", b"duplicate", b"conflict", b"refused"
OUTCOMES = (APPLIED, DUPLICATE, CONFLICT, REFUSED)
MAX_REPLY_ID = 32


def resendable_uuid() -> bytes:
    """A KVSET UUID that marks a write its client may send again (``wait=True``, a
    conditional write): an RFC 9562 version-8 UUID (the version for application-defined
    layouts), 122 random bits. Servers keep only these in their table of applied UUIDs
    (``clonemap.shards.applied``): fire-and-forget writes, never sent twice, cost nothing there.
    To any other peer a UUID is opaque 16 bytes."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x80  # version 8
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC variant
    return bytes(raw)


def is_resendable(uuid: bytes) -> bool:
    return len(uuid) == UUID_SIZE and uuid[6] & 0xF0 == 0x80


class WriteTerms(NamedTuple):
    """What a KVSET's properties ask beyond a plain write."""
    if_seq: int | None
    reply_to: bytes | None


_NO_TERMS = WriteTerms(None, None)


def write_terms(props: bytes) -> WriteTerms:
    """The ``if-seq`` and ``reply`` of validated KVSET properties; ``ProtocolError``
    (reason ``bad_condition``) when either is malformed."""
    if not props or (b"if-seq=" not in props and b"reply=" not in props):
        return _NO_TERMS
    fields = parse_props(props)
    if_seq = reply_to = None
    if IF_SEQ in fields:
        text = fields[IF_SEQ]
        if not text.isdigit() or len(text) > 20:
            raise _fail(f"if-seq {text[:24]!r} is not a sequence", "KVSET", "bad_condition")
        if_seq = int(text)
    if REPLY_TO in fields:
        try:
            reply_to = bytes.fromhex(fields[REPLY_TO])
        except ValueError:
            reply_to = b""
        if not 0 < len(reply_to) <= MAX_REPLY_ID:
            raise _fail(f"reply {fields[REPLY_TO][:24]!r} is not 1..{MAX_REPLY_ID} bytes of "
                        "hex", "KVSET", "bad_condition")
    return WriteTerms(if_seq, reply_to)


def write_props(if_seq: int | None = None, reply_to: bytes | None = None) -> bytes:
    out = b""
    if if_seq is not None:
        out += b"if-seq=%d\n" % if_seq
    if reply_to:
        out += b"reply=%s\n" % reply_to.hex().encode("ascii")
    return out


def strip_write_terms(props: bytes) -> bytes:
    """``props`` without ``if-seq`` and ``reply`` (what the KVPUB of an applied
    conditional write carries: the condition is the writer's business)."""
    return drop_props(props, (b"if-seq", b"reply"))


class Kvreply(NamedTuple):
    uuid: bytes
    outcome: bytes
    seq: int
    detail: str


def kvreply(uuid: bytes, outcome: bytes, seq: int, detail: str = "") -> list[bytes]:
    return [KVREPLY, uuid, outcome, pack_seq(seq), detail.encode("utf-8", "replace")[:512]]


def decode_kvreply(frames: list[bytes]) -> Kvreply:
    _check_count(frames, 5, "KVREPLY")
    if frames[0] != KVREPLY:
        raise _fail(f"header {bytes(frames[0][:16])!r} is not KVREPLY", "KVREPLY",
                    "unknown_command")
    if frames[2] not in OUTCOMES:
        raise _fail(f"outcome {bytes(frames[2][:16])!r}", "KVREPLY", "bad_outcome")
    return Kvreply(_uuid(frames[1], "KVREPLY"), bytes(frames[2]),
                   _seq(frames[3], "KVREPLY"),
                   bytes(frames[4][:512]).decode("utf-8", "replace"))
