"""Persisting what a server applies: an append-only log of checksummed records, and the
recovery that loads it back before the server binds its ports.

File ``<data_dir>/clonemap.log``, format version 1 (all integers network order)::

    header   "CLONEMAP-LOG\\n" (13 bytes), version u16 (1), generation length u8,
             generation (ASCII: the map's generation, see ``shards.server``)
    record   length u32 (of the payload), crc32 u32 (of the payload), payload:
             msgpack [sequence, key, value, expires]  (value b"" = a delete; expires the
             absolute expiry in epoch seconds, or nil)

Every applied update is one record with the sequence it was published under: sets,
deletes and TTL expiries (a delete), each TTL key with its absolute instant. Recovery
replays the records into a ``Store``, so the map, its sequence and every TTL instant come
back; a key whose instant passed while the server was down is due at once and the
server expires it (and logs that delete) as soon as it runs.

A crash can tear the last record (a partial write). ``recover`` detects it (a length past
the end of the file, or a checksum that fails on the last record), truncates the file at
the last whole record, and reports the bytes dropped. A record that fails its checksum
with more data after it is corruption in the middle: ``CorruptLog`` names the file and
the offset, and nothing is loaded (never a silent empty map).

Flushing (``LogWriter``): records are buffered and written once per loop turn
(``flush``); ``fsync`` follows the policy, named as Redis's ``appendfsync``: ``always``
(every flush), ``everysec`` (at most once a second, from ``tick``), ``no`` (the OS
decides).
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

from shards.common.errors import ClonemapError
from shards.store import Store

LOG_NAME = "clonemap.log"
MAGIC = b"CLONEMAP-LOG\n"
VERSION = 1
FSYNC_POLICIES = ("always", "everysec", "no")
EVERYSEC_S = 1.0
_HEAD = struct.Struct(">HB")
_REC = struct.Struct(">II")


class CorruptLog(ClonemapError):
    """A log that cannot be read: ``path`` and ``offset`` say where."""

    def __init__(self, message: str, *, path: str, offset: int):
        super().__init__(f"{path}: offset {offset}: {message}")
        self.path = path
        self.offset = offset


def encode_header(generation: str) -> bytes:
    gen = generation.encode("ascii")
    return MAGIC + _HEAD.pack(VERSION, len(gen)) + gen


def encode_record(seq: int, key: bytes, value: bytes, expires: float | None) -> bytes:
    payload = msgpack.packb([seq, key, value, expires], use_bin_type=True)
    return _REC.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass
class Recovered:
    store: Store
    generation: str
    records: int
    torn_bytes: int
    """Bytes of a torn last record that were truncated (0: none)."""
    path: Path


def recover(data_dir: str | os.PathLike) -> Recovered:
    """Load ``data_dir``'s log into a new ``Store`` (an empty one if there is no log).
    Truncates a torn tail; raises ``CorruptLog`` for anything else unreadable."""
    path = Path(data_dir) / LOG_NAME
    store = Store()
    if not path.exists():
        return Recovered(store, "", 0, 0, path)
    data = path.read_bytes()
    where = str(path)
    head = len(MAGIC) + _HEAD.size
    if len(data) < head or not data.startswith(MAGIC):
        if len(data) < head and MAGIC.startswith(data[:len(MAGIC)]):
            # a crash while the header was written: nothing was ever logged after it
            _truncate(path, 0)
            return Recovered(store, "", 0, len(data), path)
        raise CorruptLog("not a clonemap log (bad header)", path=where, offset=0)
    version, gen_len = _HEAD.unpack_from(data, len(MAGIC))
    if version != VERSION:
        raise CorruptLog(f"log format version {version}; this server reads {VERSION}",
                         path=where, offset=len(MAGIC))
    pos = head + gen_len
    if pos > len(data):
        _truncate(path, 0)
        return Recovered(store, "", 0, len(data), path)
    generation = data[head:pos].decode("ascii", "replace")
    records = 0
    end = len(data)
    while pos < end:
        if pos + _REC.size > end:
            break  # torn: a partial record header
        length, crc = _REC.unpack_from(data, pos)
        start, stop = pos + _REC.size, pos + _REC.size + length
        if stop > end:
            break  # torn: the payload runs past the end
        payload = data[start:stop]
        if zlib.crc32(payload) != crc:
            if stop == end:
                break  # the last record, torn in place
            raise CorruptLog("record checksum mismatch with more records after it",
                             path=where, offset=pos)
        try:
            seq, key, value, expires = msgpack.unpackb(payload, raw=False)
        except Exception as exc:  # the checksum held: a writer bug, not a torn write
            raise CorruptLog(f"record does not decode ({exc})", path=where,
                             offset=pos) from None
        store.seq = seq - 1
        store.apply(key, value, expires if value else None)
        records += 1
        pos = stop
    torn = end - pos
    if torn:
        _truncate(path, pos)
    return Recovered(store, generation, records, torn, path)


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


class LogWriter:
    """Appends records to ``data_dir``'s log (see the module doc)."""

    def __init__(self, data_dir: str | os.PathLike, generation: str, fsync: str = "everysec",
                 clock=time.monotonic, torn_bytes: int = 0):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync is one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        self.path = Path(data_dir) / LOG_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.policy = fsync
        self.clock = clock
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._buf = bytearray()
        self.records = 0
        self.torn_bytes = torn_bytes
        """Bytes of a torn last record truncated by the recovery before this writer."""
        self.fsyncs = 0
        self.fsync_s_total = 0.0
        self._unsynced = False
        self._synced_at = clock()
        if new:
            os.write(self._fd, encode_header(generation))
            self._fsync()

    def append(self, seq: int, key: bytes, value: bytes, expires: float | None) -> None:
        self._buf += encode_record(seq, key, value, expires)
        self.records += 1

    @property
    def pending(self) -> bool:
        return bool(self._buf)

    def flush(self) -> None:
        """Write what is buffered; fsync at once with ``always``."""
        if self._buf:
            os.write(self._fd, self._buf)
            self._buf.clear()
            self._unsynced = True
        if self.policy == "always" and self._unsynced:
            self._fsync()

    def tick(self) -> None:
        """``everysec``: fsync what was written, at most once per second."""
        if (self.policy == "everysec" and self._unsynced
                and self.clock() - self._synced_at >= EVERYSEC_S):
            self._fsync()

    def _fsync(self) -> None:
        t0 = time.perf_counter()
        os.fsync(self._fd)
        self.fsync_s_total += time.perf_counter() - t0
        self.fsyncs += 1
        self._unsynced = False
        self._synced_at = self.clock()

    def close(self) -> None:
        """Flush and fsync (whatever the policy: a clean stop loses nothing), close."""
        if self._fd < 0:
            return
        self.flush()
        if self._unsynced:
            self._fsync()
        os.close(self._fd)
        self._fd = -1

    def stats(self) -> dict:
        return {"path": str(self.path), "fsync": self.policy, "records": self.records,
                "fsyncs": self.fsyncs, "fsync_s_total": round(self.fsync_s_total, 6),
                "torn_bytes_recovered": self.torn_bytes}
