"""A compaction: the map written as a snapshot file beside the log, a chunk at a time,
then fsynced and renamed into place; the log segments and older snapshots it covers are
then deleted (``clonemap.shards.persist.format``: the file layout). ``clonemap.shards.persist.driver``
drives it from a server's loop; ``DataDir`` starts it and takes its result.
"""
from __future__ import annotations

import os
import time
from itertools import chain, islice
from pathlib import Path

from clonemap.shards.persist import format as fmt
from clonemap.shards.persist.recovery import list_files
from clonemap.shards.store import SnapshotCursor


SNAPSHOT_CHUNK_KEYS = 256
"""Keys written per loop turn by a compaction: ~0.3 ms here, so a KVSET arriving during
a compaction waits at most that long for the reactor."""
UUID_PIECE = 8192
"""Applied UUIDs written per loop turn, after the entries: each piece its own ``uuids``
record (a reader adds them up). 120,000 UUIDs flattened and packed in one turn took
~11 ms of the loop on an idle host (4 ms to flatten, 7 to pack); now the snapshot's
start copies the two generations (3.5 ms) and no step takes more than ~1.1 ms."""


class Compaction:
    """One snapshot being written from a cursor (see the module doc)."""

    def __init__(self, directory: Path, cursor: SnapshotCursor, generation: str,
                 retired_fd: int = -1):
        self.directory = directory
        """The data directory (``DataDir.path``)."""
        self.retired_fd = retired_fd
        """The segment the rotation closed: fsynced and closed by ``finish``, off the
        reactor (and at once by ``abort``)."""
        self.cursor = cursor
        self.seq = cursor.seq
        self.path = directory / fmt.seq_name(fmt.SNAP_PREFIX, self.seq, fmt.SNAP_SUFFIX)
        self.tmp = self.path.with_name(self.path.name + fmt.TMP_SUFFIX)
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fmt.write_all(self._fd, fmt.header(fmt.SNAP_MAGIC, generation) +
                          fmt.record({"seq": self.seq}))
        except OSError:
            os.close(self._fd)
            self._fd = -1
            self.tmp.unlink(missing_ok=True)
            raise
        self.keys = 0
        self.bytes = 0
        self.started = time.monotonic()
        self.written = False
        self.finishing = False
        """``finish`` is running on another thread: ``abort`` leaves the file to it."""
        self.removed: list[Path] = []
        self.only_copy = False
        """The snapshot of a map installed from the peer (``DataDir.replace``): the old
        files are gone, so until it is whole the map is on no disk here, and failing to
        write it is a disk error, not a compaction to try again later."""
        self.uuids: tuple[dict[bytes, int], ...] = ()
        """The applied UUIDs as of the snapshot's sequence, written after its entries,
        ``UUID_PIECE`` a turn: dicts ``{uuid: seq}``, oldest first
        (``AppliedUuids.generations``: copies, taken with the snapshot; an entry past the
        snapshot's sequence is left out)."""
        self._uuid_pairs = None

    def step(self, keys: int = SNAPSHOT_CHUNK_KEYS) -> bool:
        """Write the next chunk; True once the snapshot is all written (not yet synced)."""
        if self.written:
            return True
        entries = None if self.cursor.done else self.cursor.next_entries(keys)
        if entries:
            data = fmt.record(entries)
            fmt.write_all(self._fd, data)
            self.keys += len(entries) // 4
            self.bytes += len(data)
        if self.cursor.done:
            if self._uuid_pairs is None:
                self._uuid_pairs = self._pairs()
            piece = list(chain.from_iterable(islice(self._uuid_pairs, UUID_PIECE)))
            if piece:
                fmt.write_all(self._fd, fmt.record({"uuids": piece}))
                if len(piece) == 2 * UUID_PIECE:
                    return False  # (more, at the next turn)
            fmt.write_all(self._fd, fmt.record({"keys": self.keys}))
            self.written = True
        return self.written

    def _pairs(self):
        """``(uuid, seq)`` of ``uuids`` at or before the snapshot's sequence."""
        seq = self.seq
        return (pair for pair in chain.from_iterable(table.items() for table in self.uuids)
                if pair[1] <= seq)

    def finish(self) -> None:
        """Blocking (run it off the loop): fsync the segment the rotation retired and the
        snapshot, rename the snapshot into place, fsync the directory."""
        self._retire()
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.rename(self.tmp, self.path)
        fmt.fsync_dir(self.directory)
        self.removed = self._remove_covered()

    def _remove_covered(self) -> list[Path]:
        """Delete the older snapshots and the segments this snapshot covers (those that
        start at or before its sequence: the rotation started a new one after it). Safe
        off the reactor: the reactor only ever creates later segments meanwhile."""
        files = list_files(self.directory)
        removed = [path for seq, path in files.snapshots if seq < self.seq]
        removed += [path for first, path in files.segments if first <= self.seq]
        for path in removed:
            path.unlink()
        fmt.fsync_dir(self.directory)
        return removed

    def _retire(self) -> None:
        fd, self.retired_fd = self.retired_fd, -1
        if fd >= 0:
            os.fsync(fd)
            os.close(fd)

    def abort(self) -> None:
        self.cursor.close()
        if self.finishing:
            return  # the snapshot is whole; finish() renames it, and recovery may use it
        self._retire()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass
