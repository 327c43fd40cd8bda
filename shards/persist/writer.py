"""Writing a data directory: the log segment, fsync policies, compaction and replacement.

``DataDir`` is owned by one server's reactor. With ``everysec`` it runs one background
thread (``persist-io``) for the fsyncs and writeback starts; a compaction's ``finish`` is
run off the reactor by the server. The calls the server makes, and when:

* ``append(seq, key, value, expires)`` for each applied update (a set, a delete, a TTL
  expiry); updates are batched in memory and ``flush()`` (once per loop turn, before the
  turn's KVPUBs go out) writes them as one record; with ``always`` it fsyncs too: one
  fsync per batch (group commit).
* ``tick()`` at least once a second: with ``everysec``, fsync what was written since the
  last fsync.
* Compaction (``compaction_due``, ``start_compaction``, ``Compaction.step``,
  ``Compaction.finish``, ``compacted``): the log is rotated (a new segment starts at the
  next sequence), the map is written as a snapshot from a point-in-time cursor a chunk per
  loop turn, then fsynced and renamed (``finish``: blocking, the server runs it off the
  loop thread), and the files it covers are deleted. Disk use stays below about
  ``1 + compact_ratio`` times the snapshot (plus ``compact_min_bytes``), and below three
  times while a compaction runs.
* ``replace(store, generation, dropped_from)`` when a passive installs a whole new map
  from its active: the old files go (updates at or after ``dropped_from`` are first
  copied to ``dropped-<utc>.cml``), a new segment starts after the new map's sequence, and
  a compaction writes the new map as its first snapshot.
* ``save_terms(term, history)`` when the Binary Star term changes (rare).
"""
from __future__ import annotations

import bisect
import logging
import os
import queue
import threading
import time
from pathlib import Path

from clonemap.shards.common.errors import os_error_text
from clonemap.shards.persist import format as fmt
from clonemap.shards.persist.recovery import list_files
from clonemap.shards.store import Store
from clonemap.shards.persist.compaction import SNAPSHOT_CHUNK_KEYS, Compaction

log = logging.getLogger("clonemap.shards.persist")

FSYNC_POLICIES = ("always", "everysec", "no")
EVERYSEC_S = 1.0
WRITEBACK_BYTES = 1 << 20
"""``everysec``: once this much was written since the last fsync or writeback start, a
tick between fsyncs starts the kernel's writeback of it (``sync_file_range``, not waiting
for it). A second of writes at 100,000 updates/s is ~15 MiB: written back all at once by
the fsync, it stalled the server's writes for milliseconds (p99 5.6-7.8 ms at half load,
pinned); started a quarter at a time, the fsync finds little left (4.0-4.2 ms)."""
FSYNC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds of the log fsync duration histogram (``clonemap_persist_fsync_seconds``)."""
COMPACT_RATIO = 1.0
"""Compact when the segments since the last snapshot exceed this times its size."""
COMPACT_MIN_BYTES = 64 << 20
"""... and exceed this many bytes (a small map is not rewritten over and over)."""
MIN_FREE_BYTES = 4 << 20
"""A server starts only with this much free on its data directory's filesystem: with
less, it would stop again on its first writes (a disk error), so it exits at once and
the supervisor tries again later (``python -m clonemap.shards --min-free-bytes``)."""
COMPACT_RETRY_S = 5.0
"""After a compaction failed (a full disk), the next one waits this long."""


class DataDir:
    """A server's data directory, open for writing (see the module doc)."""

    def __init__(self, path: str | os.PathLike, fsync: str = "everysec", *,
                 clock=time.monotonic, compact_ratio: float = COMPACT_RATIO,
                 compact_min_bytes: int = COMPACT_MIN_BYTES):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync is one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.policy = fsync
        self.clock = clock
        self.compact_ratio = compact_ratio
        self.compact_min_bytes = compact_min_bytes
        self.generation = ""
        self._fd = -1
        self.segment: Path | None = None
        self._items: list = []
        self._next = 0
        """The sequence the next appended update must have."""
        self._unsynced = False
        self._synced_at = clock()
        self._bg_fsync: threading.Event | None = None
        """Set when the last background (everysec) fsync has finished."""
        self._bg_writeback: threading.Event | None = None
        """Set when the last background writeback start has returned."""
        self._jobs: queue.SimpleQueue | None = None
        """The background thread's queue (``_start_worker``), once it runs."""
        self._written = 0          # bytes written to the log by this process
        self._written_kicked = 0   # ... when the last fsync or writeback start began
        self.snapshot_bytes = 0
        self.log_bytes = 0
        """Bytes in the segments written since the newest snapshot."""
        self.compaction: Compaction | None = None
        self.counters = dict.fromkeys(
            ("records", "updates", "fsyncs", "compactions", "compactions_aborted",
             "snapshot_keys_written", "replaced", "dropped_updates", "write_errors",
             "compactions_failed"), 0)
        self._compact_retry_at = 0.0
        self.disk_error = ""
        """The last failed log write's errno and text, until a record is written again."""
        self.fsync_failed: OSError | None = None
        """A failed log fsync. Never retried as if nothing happened: the kernel may have
        dropped the dirty pages it could not write, so a later fsync that succeeds proves
        nothing (PostgreSQL's "fsyncgate"). Every later flush and tick raises it; the
        server stops and recovers from what is on disk."""
        self._injected: tuple[str, int] | None = None
        """A fault armed by ``inject_fault`` (tests): (``write`` | ``fsync``, errno)."""
        self._segment_bytes = 0
        """Bytes of whole records (and the header) in the open segment."""
        self.fsync_s_total = 0.0
        self.fsync_counts = [0] * (len(FSYNC_BUCKETS_S) + 1)
        """Log fsyncs per duration bucket (``FSYNC_BUCKETS_S``, the last: beyond)."""
        self.torn_bytes = 0
        self.torn_updates = 0
        self.torn_first_seq = 0
        """A torn last record truncated at recovery: its updates and first sequence."""
        self.last_compaction_s = 0.0

    # ------------------------------------------------------------------ opening
    def open(self, generation: str, seq: int) -> None:
        """Start writing after ``seq`` (the recovered store's sequence): a new segment
        ``log-<seq+1>``, replacing one of that name (it can only hold a torn tail)."""
        self.generation = generation
        files = list_files(self.path)
        if files.snapshots:
            self.snapshot_bytes = files.snapshots[-1][1].stat().st_size
            newest = files.snapshots[-1][0]
            self.log_bytes = sum(p.stat().st_size for first, p in files.segments
                                 if first > newest)
        else:
            self.log_bytes = sum(p.stat().st_size for _, p in files.segments)
        self._open_segment(seq + 1)
        if self.policy == "everysec" and self._jobs is None:
            self._start_worker()  # now, not in the middle of the first busy second

    def _open_segment(self, first: int, sync: bool = True) -> None:
        """A new segment. ``sync`` False (a rotation under everysec or no): its header and
        directory entry are fsynced by the next everysec tick and the compaction's
        ``finish``, not on the reactor."""
        self.segment = self.path / fmt.seq_name(fmt.LOG_PREFIX, first, fmt.LOG_SUFFIX)
        fd = os.open(self.segment, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                     0o644)
        head = fmt.header(fmt.LOG_MAGIC, self.generation)
        try:
            fmt.write_all(fd, head)
        except OSError as exc:
            os.close(fd)
            self.segment.unlink(missing_ok=True)
            self._disk_error("the new segment's header", exc)
            raise
        self._fd = fd
        self._segment_bytes = len(head)
        self.log_bytes += len(head)
        self._next = first
        if sync:
            self._fsync()
            fmt.fsync_dir(self.path)
        else:
            self._unsynced = True

    def _close_segment(self) -> None:
        if self._fd >= 0:
            self.flush()
            if self._unsynced:
                self._fsync()
            os.close(self._fd)
            self._fd = -1

    # ------------------------------------------------------------------ the log
    def append(self, seq: int, key: bytes, value: bytes, expires: float | None,
               uuid: bytes = b"") -> None:
        items = self._items
        if not items:
            items.append(seq)
        elif seq != self._next:  # not consecutive (never in practice): a new record
            self._write()
            items = self._items
            items.append(seq)
        items += (key, value, expires, uuid)
        self._next = seq + 1

    @property
    def pending(self) -> bool:
        return bool(self._items)

    def flush(self) -> None:
        """Write what is buffered as one record; fsync at once with ``always``."""
        self._write()
        if self.policy == "always" and self._unsynced:
            self._fsync()

    def _write(self) -> None:
        """Write the buffered updates as one record, all of it or none: a write that
        fails part-way (ENOSPC on a nearly full disk writes short first) is cut back to
        the last whole record and the updates stay buffered, so the caller holds their
        KVPUBs and the next flush writes the record again, whole."""
        items = self._items
        if items:
            if self.fsync_failed is not None:
                raise self.fsync_failed
            data = fmt.record(items)
            try:
                if self._injected is not None:
                    self._raise_injected("write")
                fmt.write_all(self._fd, data)
            except OSError as exc:
                self._cut_back(exc)
                raise
            self._segment_bytes += len(data)
            if self.disk_error:
                log.warning("%s: log writes succeed again after %s", self.path,
                            self.disk_error)
                self.disk_error = ""
            self.log_bytes += len(data)
            self._written += len(data)
            self.counters["records"] += 1
            self.counters["updates"] += len(items) // 3
            self._items = []
            self._unsynced = True

    def _cut_back(self, exc: OSError) -> None:
        """A record write failed: truncate the segment to its last whole record (freeing
        the partial one's blocks), count and say it."""
        self._disk_error("a log record", exc)
        try:
            os.ftruncate(self._fd, self._segment_bytes)
        except OSError as cut:  # recovery truncates a torn tail anyway
            log.error("could not cut %s back to %d bytes: %s", self.segment,
                      self._segment_bytes, cut)

    def _disk_error(self, what: str, exc: OSError) -> None:
        """Count a failed write; log the first of a run (each batch retries while the
        disk stays full) and every 1,000th after it."""
        self.counters["write_errors"] += 1
        first = not self.disk_error
        self.disk_error = os_error_text(exc)
        if first or self.counters["write_errors"] % 1000 == 0:
            log.error("writing %s in %s failed (%d failed writes so far): %s; the updates "
                      "stay unacknowledged and are written again", what, self.path,
                      self.counters["write_errors"], exc)

    def inject_fault(self, kind: str, errno_: int) -> None:
        """Tests: the next log write (``kind`` "write") or fsync ("fsync") fails with
        ``errno_``, as a failing disk would (``python -m clonemap.shards`` arms it on SIGUSR2 when
        ``$CLONEMAP_INJECT_DISK_FAULT`` says ``write:EIO`` or ``fsync:EIO``)."""
        if kind not in ("write", "fsync"):
            raise ValueError(f"kind is write or fsync, not {kind!r}")
        self._injected = (kind, errno_)

    def _raise_injected(self, kind: str) -> None:
        armed = self._injected
        if armed is not None and armed[0] == kind:
            self._injected = None
            raise OSError(armed[1], f"{os.strerror(armed[1])} (injected)")

    def tick(self) -> None:
        """``everysec``: fsync what was written, at most once a second, on a background
        thread: an fsync of a second of writes takes milliseconds, and on the event loop
        it stalled every update behind it (the p99 at half load). The thread fsyncs a
        duplicate of the descriptor, so a segment closed meanwhile stays valid for it.
        Between fsyncs, a tick starts the writeback of what was written
        (``WRITEBACK_BYTES``). Raises the ``OSError`` of a failed fsync (any policy)."""
        if self.fsync_failed is not None:
            raise self.fsync_failed
        if self.policy != "everysec" or not self._unsynced:
            return
        if self.clock() - self._synced_at < EVERYSEC_S:
            self._start_writeback()
            return
        if self._bg_fsync is not None and not self._bg_fsync.is_set():
            return  # the last one is still running: the next tick tries again
        self._written_kicked = self._written
        self._unsynced = False
        self._synced_at = self.clock()
        self._bg_fsync = self._on_a_thread("everysec-fsync", self._fsync_in_background)

    def _start_writeback(self) -> None:
        """Between ``everysec`` fsyncs: once ``WRITEBACK_BYTES`` were written since the
        last start, have the kernel begin writing them back, on a background thread (it
        can wait for a busy device), so the next fsync has little left to do."""
        if (self._written - self._written_kicked < WRITEBACK_BYTES or fmt.sync_file_range is None
                or (self._bg_writeback is not None and not self._bg_writeback.is_set())):
            return
        self._written_kicked = self._written
        self._bg_writeback = self._on_a_thread("everysec-writeback",
                                               self._writeback_in_background)

    def _on_a_thread(self, name: str, work) -> threading.Event:
        """Run ``work(fd)`` on the background thread, on a duplicate of the log's
        descriptor (a segment closed meanwhile stays valid for it); the event is set when
        it ends. ``name`` is the job's, for the log if it fails."""
        done = threading.Event()
        if self._jobs is None:
            self._start_worker()
        self._jobs.put((name, work, os.dup(self._fd), done))
        return done

    def _start_worker(self) -> None:
        """One long-lived thread for the everysec fsyncs and writeback starts, in order.
        A thread per job cost the reactor a ``Thread.start`` each time, which waits until
        the new thread has run: 0.3-0.8 ms at 20,000 updates/s here, and ~12 times a
        second at 100,000 updates/s (a writeback start per MiB)."""
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._run_jobs, args=(self._jobs,), name="persist-io",
                         daemon=True).start()

    @staticmethod
    def _run_jobs(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            name, work, fd, done = job
            try:
                work(fd)
            except Exception:  # each job counts its own errors; this is a bug
                log.exception("%s failed", name)
            finally:
                os.close(fd)
                done.set()

    def _writeback_in_background(self, fd: int) -> None:
        if fmt.sync_file_range(fd, 0, 0, fmt.SYNC_FILE_RANGE_WRITE) == 0:
            self.counters["writebacks"] = self.counters.get("writebacks", 0) + 1
        else:  # the fsync still writes everything back: counted, nothing more
            self.counters["writeback_errors"] = self.counters.get("writeback_errors", 0) + 1

    def _fsync_in_background(self, fd: int) -> None:
        try:
            t0 = time.perf_counter()
            if self._injected is not None:
                self._raise_injected("fsync")
            os.fsync(fd)
            self._count_fsync(time.perf_counter() - t0)
        except OSError as exc:
            self._fsync_failure(exc)

    def wait_fsync(self, timeout_s: float | None = None) -> bool:
        """Wait for a background fsync (and writeback start) in progress; True when none
        is left."""
        return all(done is None or done.wait(timeout_s)
                   for done in (self._bg_fsync, self._bg_writeback))

    def _count_fsync(self, took: float) -> None:
        self.fsync_s_total += took
        self.fsync_counts[bisect.bisect_left(FSYNC_BUCKETS_S, took)] += 1
        self.counters["fsyncs"] += 1

    def _fsync_failure(self, exc: OSError) -> None:
        """Never retried (see ``fsync_failed``): counted, logged once, kept."""
        self.counters["fsync_errors"] = self.counters.get("fsync_errors", 0) + 1
        if self.fsync_failed is None:
            self.fsync_failed = exc
            self.disk_error = f"{os_error_text(exc)} (fsync)"
            log.critical("fsync of the log in %s failed: %s; what was written since the "
                         "last good fsync may not be on disk, and is never fsynced again "
                         "as if nothing happened", self.path, exc)

    def sync(self) -> None:
        """Write what is pending and fsync it now, whatever the policy (a step that must
        be on disk before the next one: a move's commit). Raises ``OSError``."""
        self.flush()
        if self._fd >= 0:
            self._fsync()

    def _fsync(self) -> None:
        if self.fsync_failed is not None:
            raise self.fsync_failed
        t0 = time.perf_counter()
        try:
            if self._injected is not None:
                self._raise_injected("fsync")
            os.fsync(self._fd)
        except OSError as exc:
            self._fsync_failure(exc)
            raise
        self._count_fsync(time.perf_counter() - t0)
        self._unsynced = False
        self._synced_at = self.clock()

    def close(self) -> None:
        """A clean stop: flush and fsync whatever the policy, and finish a compaction in
        progress here (a passive's first snapshot of a new map must exist, or its
        directory would restart as an incomplete replica); close. After a disk error it
        writes nothing more (``abandon``)."""
        if self.fsync_failed is not None or self.disk_error:
            self.abandon()
            return
        job = self.compaction
        if job is not None and not job.finishing:
            while not job.step(SNAPSHOT_CHUNK_KEYS * 64):
                pass
            self._close_segment()
            job.finish()
            self.compacted(job)
        elif job is not None:
            job.abort()  # finish() runs on another thread: it renames the snapshot
            self.compaction = None
        self._close_segment()
        self.wait_fsync()
        if self._jobs is not None:
            self._jobs.put(None)  # the background thread ends after what it was given
            self._jobs = None

    def abandon(self) -> None:
        """Close everything without writing: the disk failed, and what is not on it was
        never acknowledged (a record is published only once written). Recovery reads what
        is there."""
        self._items = []
        if self.compaction is not None:
            job, self.compaction = self.compaction, None
            if not job.finishing:
                job.abort()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    # ------------------------------------------------------------------ terms
    def save_terms(self, term: int, history: list[tuple[int, int]]) -> None:
        fmt.replace_json(self.path / fmt.TERMS_NAME,
                         {"version": fmt.VERSION, "term": term,
                          "history": [list(pair) for pair in history]})

    # ------------------------------------------------------------------ compaction
    def compaction_due(self) -> bool:
        return (self.compaction is None and self.log_bytes > self.compact_min_bytes
                and self.clock() >= self._compact_retry_at
                and self.log_bytes > self.compact_ratio * self.snapshot_bytes)

    def start_compaction(self, store: Store, uuids: tuple[dict[bytes, int], ...] = ()
                         ) -> Compaction:
        """Rotate the log and start writing ``store``'s snapshot at its sequence, with
        ``uuids`` (the applied UUIDs as of it: ``AppliedUuids.generations``). The
        retired segment is written now and fsynced by the compaction, off the reactor."""
        self.flush()
        retired, self._fd = self._fd, -1
        segment, size, log_bytes = self.segment, self._segment_bytes, self.log_bytes
        self.log_bytes = 0
        try:
            self._open_segment(store.seq + 1, sync=self.policy == "always")
        except OSError:  # no rotation: go on in the segment we had
            self._fd, self.segment, self._segment_bytes = retired, segment, size
            self.log_bytes = log_bytes
            raise
        cursor = store.open_snapshot(with_expiry=True)
        try:
            self.compaction = Compaction(self.path, cursor, self.generation, retired_fd=retired)
            self.compaction.uuids = uuids
        except OSError as exc:
            cursor.close()
            os.fsync(retired)  # what the compaction would have done, off the reactor
            os.close(retired)
            self.compaction_failed(exc)
            raise
        return self.compaction

    def compaction_failed(self, exc: BaseException) -> None:
        """A compaction could not write its snapshot (the server aborted it): no new one
        for ``COMPACT_RETRY_S``; the log goes on as before."""
        self.counters["compactions_failed"] += 1
        self._compact_retry_at = self.clock() + COMPACT_RETRY_S
        log.error("compaction in %s failed: %s; next try in %.0f s", self.path, exc,
                  COMPACT_RETRY_S)

    def compacted(self, job: Compaction) -> list[Path]:
        """``job.finish()`` has run (and deleted the files the snapshot covers): count
        it; the files removed."""
        if self.compaction is not job:
            return []
        self.compaction = None
        removed = job.removed
        self.snapshot_bytes = job.path.stat().st_size
        self.counters["compactions"] += 1
        self.counters["snapshot_keys_written"] += job.keys
        self.last_compaction_s = time.monotonic() - job.started
        return removed

    def abort_compaction(self) -> None:
        if self.compaction is not None:
            self.compaction.abort()
            self.compaction = None
            self.counters["compactions_aborted"] += 1

    # ------------------------------------------------------------------ replacement
    def replace(self, store: Store, generation: str, dropped_from: int | None,
                uuids: tuple[dict[bytes, int], ...] = ()) -> int:
        """A passive installs ``store`` (its active's map): keep the updates from
        ``dropped_from`` on (if any) in a ``dropped-<utc>.cml`` file, delete the old
        files, start a new segment after ``store.seq`` and a compaction that writes
        ``store`` as the first snapshot. Returns the number of updates dropped."""
        self.abort_compaction()
        self._close_segment()
        files = list_files(self.path)
        dropped = 0
        if dropped_from is not None:
            dropped = self._keep_dropped(files, dropped_from)
        for _, path in files.snapshots + files.segments:
            path.unlink()
        fmt.fsync_dir(self.path)
        self.generation = generation
        self.snapshot_bytes = 0
        self.log_bytes = 0
        self._items = []
        self._open_segment(store.seq + 1)
        self.compaction = Compaction(self.path, store.open_snapshot(with_expiry=True), generation)
        self.compaction.only_copy = True
        self.compaction.uuids = uuids
        self.counters["replaced"] += 1
        self.counters["dropped_updates"] += dropped
        return dropped

    def _keep_dropped(self, files, dropped_from: int) -> int:
        """Copy every logged update with sequence >= ``dropped_from`` to a new
        ``dropped-<utc>.cml`` (fsynced); how many. A snapshot taken after that point
        is kept whole beside it (its single updates are gone)."""
        from clonemap.shards.persist.recovery import replay_records

        name = time.strftime(f"{fmt.DROPPED_PREFIX}%Y%m%dT%H%M%SZ", time.gmtime())
        out = self.path / (name + fmt.LOG_SUFFIX)
        updates = []
        for _, path in files.segments:
            for seq, key, value, expires in replay_records(path):
                if seq >= dropped_from:
                    if not updates:
                        updates.append(seq)
                    updates += (key, value, expires, b"")
        kept_snapshot = [p for seq, p in files.snapshots if seq >= dropped_from]
        for path in kept_snapshot:
            path.rename(self.path / (name + fmt.SNAP_SUFFIX))
            files.snapshots = [(s, p) for s, p in files.snapshots if p != path]
        if not updates:
            return 0
        with open(out, "wb") as f:
            f.write(fmt.header(fmt.LOG_MAGIC, self.generation) + fmt.record(updates))
            f.flush()
            os.fsync(f.fileno())
        fmt.fsync_dir(self.path)
        return len(updates) // 4

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        job = self.compaction
        return {"path": str(self.path), "fsync": self.policy, **self.counters,
                "fsync_s_total": round(self.fsync_s_total, 6),
                "fsync_buckets": {"le": list(FSYNC_BUCKETS_S),
                                  "counts": list(self.fsync_counts)},
                "torn_bytes_recovered": self.torn_bytes,
                "torn_updates_recovered": self.torn_updates,
                "torn_first_seq": self.torn_first_seq,
                "disk_error": self.disk_error,
                "log_bytes": self.log_bytes, "snapshot_bytes": self.snapshot_bytes,
                "compacting": None if job is None else {"seq": job.seq, "keys": job.keys},
                "last_compaction_s": round(self.last_compaction_s, 3)}
