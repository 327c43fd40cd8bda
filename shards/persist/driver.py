"""A data directory driven from a server's event loop (``Persistence``).

The server hands each applied update to ``append`` (the ``DataDir``'s own method: nothing
in between on the hot path), calls ``flush`` at the end of each batch (the group commit:
one write, and with ``fsync: always`` one fsync, before anything of the batch is
published), and ``tick`` every ``PERSIST_TICK_S``. Everything else happens here:

* the everysec fsync (``DataDir.tick``);
* compactions, when the log has grown enough (``DataDir.compaction_due``): the server's
  held updates are flushed first, then the snapshot of its map is written a chunk at a
  time, ``COMPACT_PACE_S`` apart, so that serving goes on between chunks; it is fsynced
  and renamed on the loop's executor, and what it covers is deleted;
* a map replaced by a Binary Star peer's (``replace``): rewritten as a snapshot the same
  way, its only copy here until whole;
* disk errors: a failed write or fsync, or a failed snapshot of a map that exists nowhere
  else here, is reported once (``on_disk_error``) and the server stops; a compaction of
  a map the log still holds that fails (a full disk) is counted and tried again later.

The server is told, besides: ``on_compacted(job)`` when a snapshot is whole on disk.
"""
from __future__ import annotations

import logging
from typing import Callable

from clonemap.shards.persist.writer import Compaction, DataDir
from clonemap.shards.store import Store

log = logging.getLogger("clonemap.shards.server")

PERSIST_TICK_S = 0.25
"""How often a persisting server checks its everysec fsync and whether to compact."""
COMPACT_PACE_S = 0.001
"""Pause between two chunks of a compaction: the snapshot takes at most about a quarter
of the reactor's time (256 keys, ~0.3 ms, per 1.3 ms), so a compaction under full load
costs clients little latency (``python -m bench durability``)."""


class Persistence:
    """One server's data directory on its loop (see the module doc)."""

    def __init__(self, data_dir: DataDir, *, flush_held: Callable[[], None],
                 snapshot_of: Callable[[], tuple[Store, tuple[dict[bytes, int], ...]]],
                 on_disk_error: Callable[[str, OSError], None],
                 on_compacted: Callable[[Compaction], None] = lambda job: None):
        self.dir = data_dir
        self.append = data_dir.append
        """``append(seq, key, value, expires, uuid=b"")``: one applied update, written at
        the next ``flush``."""
        self.path = data_dir.path
        self._flush_held = flush_held
        self._snapshot_of = snapshot_of
        self._on_disk_error = on_disk_error
        self._on_compacted = on_compacted
        self.loop = None
        self.failed = False
        """A disk error was reported: nothing more is written or compacted."""
        self.closed = False

    def start(self, loop) -> None:
        self.loop = loop

    # ------------------------------------------------------------------ the log
    def flush(self) -> bool:
        """Write the batch's records (fsync with ``always``); False after a disk error
        (reported: nothing of the batch may be published)."""
        if self.failed:
            return False
        try:
            self.dir.flush()
        except OSError as exc:
            self.fail("writing the log", exc)
            return False
        return True

    def sync(self) -> bool:
        """Write and fsync the log now (``DataDir.sync``); False after a disk error."""
        if self.failed:
            return False
        try:
            self.dir.sync()
        except OSError as exc:
            self.fail("syncing the log", exc)
            return False
        return True

    def fail(self, what: str, exc: OSError) -> None:
        if not self.failed:
            self.failed = True
            self._on_disk_error(what, exc)

    def tick(self) -> None:
        """The everysec fsync, and a compaction when one is due."""
        if self.failed:
            return
        try:
            self.dir.tick()
        except OSError as exc:  # a failed fsync (here or on the background thread)
            self.fail("fsync of the log", exc)
            return
        if self.dir.compaction_due():
            self._compact("the log has grown")

    def compact_now(self) -> str:
        """Start a compaction now, whatever the log's size (an operator's, after a bulk
        load: ``compact`` on the control service); "" once started, else why not."""
        if self.failed:
            return "the data directory had a disk error"
        if self.dir.compaction is not None:
            return "a compaction is running"
        return "" if self._compact("asked") else "the snapshot could not be started"

    def _compact(self, why: str) -> bool:
        self._flush_held()  # the snapshot must not miss what the log will drop
        if self.failed:
            return False
        store, uuids = self._snapshot_of()
        try:
            job = self.dir.start_compaction(store, uuids)
        except OSError:
            return False  # counted and logged by the data directory; tried again later
        log.info("compaction (%s): writing the snapshot at sequence %d (%d keys)", why,
                 job.seq, len(store))
        self._drive(job)
        return True

    # ------------------------------------------------------------------ a replaced map
    def replace(self, store: Store, generation: str, dropped_from: int | None,
                uuids: tuple[dict[bytes, int], ...]) -> tuple[int, Compaction] | None:
        """Rewrite the directory from ``store`` (a Binary Star peer's map): how many of
        this directory's updates were dropped (kept in ``dropped-*``), and the snapshot
        being written (its only copy: a failure of it is a disk error). None after a
        disk error (reported)."""
        self._flush_held()
        if self.failed:
            return None
        try:
            dropped = self.dir.replace(store, generation, dropped_from, uuids)
        except OSError as exc:
            self.fail("installing the active's map", exc)
            return None
        job = self.dir.compaction
        self._drive(job)
        return dropped, job

    def save_terms(self, term: int, history: list[tuple[int, int]]) -> None:
        self.dir.save_terms(term, history)

    # ------------------------------------------------------------------ compactions
    def _drive(self, job: Compaction) -> None:
        if self.loop is not None:
            self.loop.call_soon(self._step, job)

    def _step(self, job: Compaction) -> None:
        if self.closed or self.failed or self.dir.compaction is not job:
            return  # closed, or replaced by another
        try:
            written = job.step()
        except OSError as exc:  # a full disk: the partial snapshot goes, the log stays
            self.dir.abort_compaction()
            self._failed(job, exc)
            return
        if not written:
            self.loop.call_later(COMPACT_PACE_S, self._step, job)
            return
        job.finishing = True
        fut = self.loop.run_in_executor(None, job.finish)
        fut.add_done_callback(lambda f: self._finished(job, f))

    def _finished(self, job: Compaction, fut) -> None:
        job.finishing = False
        if self.closed:
            return
        exc = fut.exception()
        if exc is not None:
            log.error("compaction: the snapshot at sequence %d failed: %s", job.seq, exc)
            if self.dir.compaction is job:
                self.dir.abort_compaction()
                self._failed(job, exc)
            return
        if self.dir.compaction is not job:
            # replaced meanwhile (a passive installed its active's map): this snapshot
            # belongs to the old map and must not outlive it
            job.path.unlink(missing_ok=True)
            return
        removed = self.dir.compacted(job)
        self._on_compacted(job)
        log.info("compaction: snapshot at sequence %d (%d keys, %d bytes) in %.2f s; %d "
                 "older files removed", job.seq, job.keys, job.bytes,
                 self.dir.last_compaction_s, len(removed))

    def _failed(self, job: Compaction, exc: BaseException) -> None:
        """A snapshot could not be written. Its log still holds the map: try again later.
        But the snapshot of a map installed from the peer is its only copy here: a disk
        error."""
        if job.only_copy and isinstance(exc, OSError):
            self.fail("writing the installed map's snapshot", exc)
        else:
            self.dir.compaction_failed(exc)

    # ------------------------------------------------------------------ the rest
    def close(self) -> None:
        """Flush and fsync: a clean stop loses nothing."""
        self.closed = True
        self.dir.close()

    def inject_fault(self, kind: str, errno_: int) -> None:
        self.dir.inject_fault(kind, errno_)

    def stats(self) -> dict:
        return self.dir.stats()
