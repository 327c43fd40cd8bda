"""The on-disk format, format version 2: file names, headers and checksummed records.

A server's data directory holds (all integers network order)::

    log-<F>.cml      a log segment: every update with sequence >= F, in order
                     (F is 20 decimal digits, so names sort by sequence)
    snap-<S>.cms     a snapshot: the whole map at sequence S, with each key's absolute
                     expiry; written as snap-<S>.cms.tmp, fsynced, then renamed, so a
                     snapshot that exists is whole
    terms            JSON {"version": 1, "term": t, "history": [[term, first_seq], ...]}
                     (replaced atomically; Binary Star servers only)
    routing          JSON {"version": 1, "shard_index": i, "routing": ShardMap.describe()}:
                     the newest routing this server followed, with its epoch (replaced
                     atomically; servers of a routed cluster only;
                     ``clonemap.shards.persist.routing``)
    dropped-<utc>.cml  updates a server had to drop when it synchronised from a peer
                     holding a later state (the segment format; see ``clonemap.shards.persist``)

Every file starts with a header::

    magic     13 bytes   "CLONEMAP-LOG\\n" (segment) or "CLONEMAP-SNP\\n" (snapshot)
    version   u16        2 (version 1 files are read too; see below)
    gen_len   u8
    gen       gen_len    the map's generation token (ASCII)

then records::

    length    u32        of the payload
    crc32     u32        of the payload (zlib.crc32)
    payload   msgpack    an array, see below

Segment record: ``[first_seq, key, value, expires, uuid, key, value, expires, uuid,
...]``: the updates ``first_seq``, ``first_seq + 1``, ... (one record per flush: a batch;
a torn batch is dropped whole). ``value`` b"" is a delete; ``expires`` is the key's
absolute expiry in epoch seconds, or nil; ``uuid`` the KVSET's UUID (b"" if it had none),
from which a restarted server rebuilds its table of applied UUIDs (``clonemap.shards.applied``).

Snapshot records: first ``{"seq": S}``, then chunks ``[key, value, expires, mod_seq,
...]`` (a multiple of 4 items; ``mod_seq`` the sequence that last changed the key), then
``{"uuids": [uuid, seq, ...]}`` records (the applied UUIDs as of S, oldest first, in
pieces: ``compaction.UUID_PIECE``), last ``{"keys": n}`` (the count, checked on load).

Version 1 (written before conditional writes) had no UUIDs: segment records of 3 items
per update, snapshot chunks of 3 (no ``mod_seq``: its keys are loaded with the
snapshot's sequence, an upper bound no later write reuses) and no ``uuids`` record. A
server reads both and writes version 2.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Iterator

import msgpack

from clonemap.shards.common import libc
from clonemap.shards.common.errors import ClonemapError

VERSION = 2
READABLE = (1, 2)


def width(version: int) -> int:
    """Items per update in a segment record (after ``first_seq``), and per key in a
    snapshot chunk, for a file of ``version``."""
    return 3 if version == 1 else 4

LOG_MAGIC = b"CLONEMAP-LOG\n"
SNAP_MAGIC = b"CLONEMAP-SNP\n"
LOG_PREFIX, LOG_SUFFIX = "log-", ".cml"
SNAP_PREFIX, SNAP_SUFFIX = "snap-", ".cms"
TMP_SUFFIX = ".tmp"
TERMS_NAME = "terms"
ROUTING_NAME = "routing"
DROPPED_PREFIX = "dropped-"
NEEDS_PEER_NAME = "needs-peer"
"""Present while a Binary Star server's directory holds no map it can trust: its files
could not be read and were moved to ``unreadable-<utc>/``, and it has not yet written a
whole copy of its peer's map (``recovery.quarantine``)."""
UNREADABLE_PREFIX = "unreadable-"
_HEAD = struct.Struct(">HB")
_REC = struct.Struct(">II")
HEADER_MIN = len(LOG_MAGIC) + _HEAD.size


class CorruptLog(ClonemapError):
    """A data file that cannot be read: ``path`` and ``offset`` say where."""

    def __init__(self, message: str, *, path: str, offset: int):
        super().__init__(f"{path}: offset {offset}: {message}")
        self.path = path
        self.offset = offset


def seq_name(prefix: str, seq: int, suffix: str) -> str:
    return f"{prefix}{seq:020d}{suffix}"


def seq_of(name: str, prefix: str, suffix: str) -> int | None:
    """The sequence in a file name made by ``seq_name``, or None if it is not one."""
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    digits = name[len(prefix):len(name) - len(suffix)]
    return int(digits) if len(digits) == 20 and digits.isdigit() else None


def header(magic: bytes, generation: str) -> bytes:
    gen = generation.encode("ascii")
    return magic + _HEAD.pack(VERSION, len(gen)) + gen


_packers = threading.local()


def record(items: list) -> bytes:
    # One Packer per thread, kept: ``msgpack.packb`` makes a new one per call, whose 256 KiB
    # buffer is a fresh mmap and munmap (and its page faults) on every loop turn's write.
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    payload = packer.pack(items)
    return _REC.pack(len(payload), zlib.crc32(payload)) + payload


def partial_batch(data: bytes, per: int = 4) -> tuple[int, int] | None:
    """A torn segment record's ``(updates, first_seq)``, read from what was written of it:
    the payload's msgpack array header gives its length (``1 + per * updates``) and its
    first item the first sequence. None when too little of it was written to tell."""
    if len(data) <= _REC.size:
        return None
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data[_REC.size:])
    try:
        items = unpacker.read_array_header()
        first = unpacker.unpack()
    except (msgpack.OutOfData, ValueError, TypeError, msgpack.ExtraData):
        return None
    if not isinstance(first, int) or items < 1 + per or items % per != 1:
        return None
    return (items - 1) // per, first


class Scan:
    """One file read back: its generation, then ``records()`` yields ``(offset, payload
    object)`` for each whole record; afterwards ``end`` is the offset after the last whole
    record and ``torn`` the bytes after it (a torn tail), if ``allow_torn``."""

    def __init__(self, path: Path, magic: bytes, *, allow_torn: bool):
        self.path = path
        self.where = str(path)
        self.allow_torn = allow_torn
        self.data = data = path.read_bytes()
        self.size = len(data)
        self.torn = 0
        self.torn_batch: tuple[int, int] | None = None
        """(updates, first sequence) of a torn last record, when its start says so."""
        self.generation = ""
        self.version = VERSION
        if len(data) < HEADER_MIN or not data.startswith(magic):
            if allow_torn and len(data) < HEADER_MIN and magic.startswith(data[:len(magic)]):
                self.end = 0  # torn while the header was written: nothing in it
                self.torn = len(data)
                self.header_end = len(data)
                return
            raise CorruptLog(f"not a clonemap {'segment' if magic == LOG_MAGIC else 'snapshot'}"
                             " (bad header)", path=self.where, offset=0)
        version, gen_len = _HEAD.unpack_from(data, len(magic))
        if version not in READABLE:
            raise CorruptLog(f"format version {version}; this server reads versions "
                             f"{', '.join(map(str, READABLE))}", path=self.where,
                             offset=len(magic))
        self.version = version
        self.header_end = HEADER_MIN + gen_len
        if self.header_end > len(data):
            if not allow_torn:
                raise CorruptLog("header cut short", path=self.where, offset=0)
            self.end = 0
            self.torn = len(data)
            return
        self.generation = data[HEADER_MIN:self.header_end].decode("ascii", "replace")
        self.end = self.header_end

    def records(self) -> Iterator[tuple[int, object]]:
        data, where = self.data, self.where
        if self.end == 0 and self.torn:
            return
        pos, end = self.header_end, len(data)
        unpack_rec, rec_size, crc32, unpackb = _REC.unpack_from, _REC.size, zlib.crc32, \
            msgpack.unpackb
        while pos < end:
            if pos + rec_size > end:
                break  # a partial record header
            length, crc = unpack_rec(data, pos)
            start = pos + rec_size
            stop = start + length
            if stop > end:
                break  # the payload runs past the end
            payload = data[start:stop]
            if crc32(payload) != crc:
                if stop == end:
                    break  # the last record, torn in place
                raise CorruptLog("record checksum mismatch with more records after it",
                                 path=where, offset=pos)
            try:
                obj = unpackb(payload, raw=False)
            except Exception as exc:  # the checksum held: a writer bug, not a torn write
                raise CorruptLog(f"record does not decode ({exc})", path=where,
                                 offset=pos) from None
            yield pos, obj
            pos = self.end = stop
        if pos < end:
            if not self.allow_torn:
                raise CorruptLog(f"{end - pos} bytes of a partial record at the end",
                                 path=where, offset=pos)
            self.torn = end - pos
            self.torn_batch = partial_batch(data[pos:], width(self.version))


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at ``fd``'s offset, looping over short writes (a nearly full
    filesystem returns them); raise the ``OSError`` that stops it (ENOSPC, EIO, ...).
    ``os.write`` alone may write part of a record and say so only in its return value."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # not seen on Linux for a regular file; never loop on it
            raise OSError(errno.EIO, f"write returned {n} with {len(view)} bytes left")
        view = view[n:]


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def replace_json(path: Path, doc: dict) -> None:
    """Replace the file at ``path`` with ``doc`` as JSON, atomically and durably: written
    beside it as ``.tmp``, fsynced, renamed over it, the directory fsynced. A crash leaves
    the old file or the new one (and perhaps a ``.tmp`` that recovery removes)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SYNC_FILE_RANGE_WRITE = 2
"""linux/fs.h: start writeback of the range's dirty pages, without waiting for it."""

sync_file_range = libc.function("sync_file_range", (ctypes.c_int, ctypes.c_int64,
                                                     ctypes.c_int64, ctypes.c_uint))
"""``sync_file_range(fd, offset, nbytes, flags)`` (Linux), or None."""
