"""BSTAR-TTL: the absolute expiry times a passive server asks its active peer for. Pure codec.

A 12/CHP KVSYNC carries no properties (frames 2 and 3 are empty by the spec), so a
snapshot alone would turn every key with a TTL into a permanent one on the passive. The
passive's replica (``clonemap.shards.replica``) therefore first asks the active's snapshot ROUTER
(port P) for its TTL table, then for the snapshot. The table is a point-in-time copy at
the active's sequence T, sent in chunks so that a map with millions of TTL keys never
stalls the active for longer than one chunk (``clonemap.shards.pair`` streams them, one chunk per
peer per loop turn, with ROUTER_MANDATORY flow control).

Frames (DEALER <-> ROUTER; the ROUTER's identity frame is not shown)::

    request  f0 "BSTAR-TTL?"
    reply    f0 "BSTAR-TTL"
             f1 sequence T, 8 bytes, network order (the same in every chunk of a table)
             f2 entries: (expiry_s f64, key_len u16, key) repeated, network order
             f3 1 byte: 0x00 more chunks follow, 0x01 the last chunk
             f4 the active's map generation (ASCII token, 0..64 bytes; optional)
             f5 the active's term history (optional, needs f4): (term u64,
                first_seq u64) repeated, oldest first: where each term's updates
                began (``clonemap.shards.persist.fork_point``)
             f6 the active's applied UUIDs as of T (optional, needs f5, last chunk
                only): (UUID 16 bytes, sequence u64) repeated, oldest first
                (``clonemap.shards.applied``: so a write sent again is applied once after a
                failover to this passive too)
             f7 the keys a move staged in the active's store as of T (optional, needs
                f6, last chunk only): (key_len u16, key) repeated. The snapshot holds
                them like any key; the passive or relay keeps them out of its own
                clients' snapshots until the flip (``ShardServer.staged``)

A table with no TTL key is one chunk with an empty f2 and f3 = 0x01. The generation
(``clonemap.shards.server_config.new_generation``) tells the passive which map its replica now copies:
it takes that generation over at the end of the sync, so the pair announces one
generation for as long as the map lives. Rules enforced by ``decode_chunk``
(``ProtocolError`` with ``protocol="bstar/1"``, reason ``bad_ttl_table``): 4 or 5
frames, the header, an 8-byte sequence, whole entries, a flag of 0 or 1, and a
generation of 1..64 ASCII letters and digits when present.
"""
from __future__ import annotations

import struct
from typing import Iterable, NamedTuple

from clonemap.shards.common.errors import ProtocolError

PROTOCOL = "bstar/1"
REQUEST = b"BSTAR-TTL?"
REPLY = b"BSTAR-TTL"
MORE, LAST = b"\x00", b"\x01"
CHUNK_ENTRIES = 4096
"""Entries per chunk: ~0.1 MB of 20-byte keys, a few milliseconds to encode."""

_ENTRY = struct.Struct(">dH")
_SEQ = struct.Struct(">Q")
_TERM = struct.Struct(">QQ")
_UUID_ENTRY = struct.Struct(">16sQ")
_KEY_LEN = struct.Struct(">H")


MAX_GENERATION = 64


class Chunk(NamedTuple):
    seq: int
    table: dict[bytes, float]
    last: bool
    generation: str = ""
    history: tuple[tuple[int, int], ...] = ()
    uuids: list = []
    """``[uuid, seq, ...]`` (f6), oldest first."""
    staged: tuple[bytes, ...] = ()
    """The keys staged in the active's store (f7)."""


def request() -> list[bytes]:
    return [REQUEST]


def encode_chunk(seq: int, entries: Iterable[tuple[bytes, float]], last: bool,
                 generation: str = "", history: Iterable[tuple[int, int]] = (),
                 uuids: list = (), staged: Iterable[bytes] = (),
                 packed_uuids: bytes = b"") -> list[bytes]:
    """One reply chunk for ``entries``: (key, absolute expiry in epoch seconds) pairs;
    ``uuids`` (``[uuid, seq, ...]``) and the ``staged`` keys go in the last one, after
    ``packed_uuids`` (entries packed already, by ``pack_uuids``)."""
    staged = list(staged) if last else []
    parts = []
    for key, expiry_s in entries:
        parts.append(_ENTRY.pack(expiry_s, len(key)))
        parts.append(key)
    frames = [REPLY, _SEQ.pack(seq), b"".join(parts), LAST if last else MORE]
    history = list(history)
    more = bool((uuids or packed_uuids) and last) or bool(staged)
    if generation or history or more:
        frames.append(generation.encode("ascii"))
    if history or more:
        frames.append(b"".join(_TERM.pack(term, first) for term, first in history))
    if more:
        frames.append(packed_uuids + pack_uuids(zip(uuids[0::2], uuids[1::2])))
    if staged:
        frames.append(b"".join(_KEY_LEN.pack(len(key)) + key for key in staged))
    return frames


def pack_uuids(entries: Iterable[tuple[bytes, int]]) -> bytes:
    """(uuid, sequence) pairs as the UUID table's entries; a UUID that is not 16 bytes is
    left out."""
    pack = _UUID_ENTRY.pack
    return b"".join(pack(uuid, at) for uuid, at in entries if len(uuid) == 16)


def _fail(message: str) -> ProtocolError:
    return ProtocolError(f"BSTAR-TTL reply: {message}", protocol=PROTOCOL, command="BSTAR-TTL",
                         reason="bad_ttl_table")


def decode_chunk(frames: list[bytes]) -> Chunk:
    if len(frames) not in (4, 5, 6, 7, 8):
        raise _fail(f"expected 4 to 8 frames, got {len(frames)}")
    generation = ""
    history: tuple[tuple[int, int], ...] = ()
    if len(frames) >= 5:
        raw = bytes(frames[4])
        least = 1 if len(frames) == 5 else 0
        if not least <= len(raw) <= MAX_GENERATION or (raw and not (raw.isascii()
                                                                     and raw.isalnum())):
            raise _fail(f"generation {raw[:16]!r} is not {least}..{MAX_GENERATION} ASCII "
                        "letters and digits")
        generation = raw.decode("ascii")
    uuids: list = []
    staged: list[bytes] = []
    if len(frames) == 8:
        raw = bytes(frames[7])
        pos = 0
        while pos < len(raw):
            if pos + _KEY_LEN.size > len(raw):
                raise _fail("truncated staged key")
            (size,) = _KEY_LEN.unpack_from(raw, pos)
            pos += _KEY_LEN.size
            if pos + size > len(raw):
                raise _fail("truncated staged key")
            staged.append(raw[pos:pos + size])
            pos += size
    if len(frames) >= 7:
        raw = bytes(frames[6])
        if len(raw) % _UUID_ENTRY.size:
            raise _fail(f"UUID table of {len(raw)} bytes is not whole 24-byte entries")
        for uuid, at in _UUID_ENTRY.iter_unpack(raw):
            uuids += (uuid, at)
    if len(frames) >= 6:
        raw = bytes(frames[5])
        if len(raw) % _TERM.size:
            raise _fail(f"term history of {len(raw)} bytes is not whole 16-byte entries")
        history = tuple(_TERM.iter_unpack(raw))
    if frames[0] != REPLY:
        raise _fail(f"header {bytes(frames[0][:16])!r} is not {REPLY!r}")
    if len(frames[1]) != 8:
        raise _fail(f"sequence is {len(frames[1])} bytes, expected 8")
    if frames[3] not in (MORE, LAST):
        raise _fail(f"flag {bytes(frames[3][:4])!r} is neither 0x00 nor 0x01")
    body = frames[2]
    table: dict[bytes, float] = {}
    pos, end, size = 0, len(body), _ENTRY.size
    unpack = _ENTRY.unpack_from
    while pos < end:
        if pos + size > end:
            raise _fail("truncated entry")
        expiry_s, key_len = unpack(body, pos)
        pos += size
        if pos + key_len > end:
            raise _fail("truncated key")
        table[body[pos:pos + key_len]] = expiry_s
        pos += key_len
    return Chunk(_SEQ.unpack(frames[1])[0], table, frames[3] == LAST, generation, history,
                 uuids, tuple(staged))
