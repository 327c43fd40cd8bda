"""The shard's map: key -> value, its sequence, a TTL index and point-in-time snapshots.

Pure: no sockets, no clock reads (time is passed in, wall-clock float seconds).

Memory layout (per key, beyond the key and value ``bytes`` themselves):

* ``data``: one ``dict`` slot, the value stored directly (no entry object, no tuple);
* ``mod``: one ``dict`` slot and one ``int``, the sequence that last changed the key
  (what a conditional write compares, and what a KVSYNC carries);
* keys with a TTL only: one float in ``_expiry`` and one ``(expiry, key)`` entry in the
  heap. Properties and UUIDs are not kept: a KVSYNC carries neither (12/CHP).

TTL index: a min-heap of ``(expiry_s, key)`` with lazy deletion. A heap entry is live only
while ``_expiry[key]`` still equals its expiry; rewriting or deleting a key just changes
``_expiry`` and leaves the old entry to be skipped when it reaches the top. The heap is
rebuilt from ``_expiry`` (never from the map) once stale entries outnumber live ones, so
it stays O(live TTL keys) and every operation is O(log n) amortised.

Snapshots: ``open_snapshot`` copies the key list (``list(data)``: ~25 ms per million keys
here) and registers the cursor; until it is closed, the first change to a key it may
still have to send records that key's old value in the cursor's ``undo`` dict
(copy-on-write), with its old sequence in ``undo_seq``. A cursor therefore yields exactly the map as it was at ``cursor.seq``:
keys created later are not in its list, keys changed or deleted later come from ``undo``.
Each chunk's values and sequences are read by walking the two dicts in order beside the key
list (checked against it chunk by chunk) until a key is inserted or deleted, then by a
lookup per key: the walk costs no hash probe, and the probes, two random memory reads a
key, were most of a 100,000-key snapshot's CPU. It holds no copy of the values.
"""
from __future__ import annotations

import heapq
from itertools import compress, islice
from typing import Iterator

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.zio import untrack_frames

from clonemap.shards.common.proto.chp import MAX_TTL_S  # re-exported: the store checks it

_TTL = b"ttl"
_EXPIRES = b"expires"


def _bad(message: str, reason: str) -> ProtocolError:
    return ProtocolError(f"12/CHP KVSET: {message}", protocol="12/CHP", command="KVSET",
                         reason=reason)


def ttl_props(props: bytes, now_wall_s: float) -> tuple[float | None, bytes]:
    """The absolute expiry a KVSET asks for, and the properties its KVPUB carries.

    ``props`` are already-validated CHP properties (``name=value\\n`` lines).

    * ``ttl=<seconds>`` (float, 0 < ttl <= ``MAX_TTL_S``): expiry = now + ttl, rounded to
      the millisecond; the KVPUB carries the client's properties minus any ``expires``
      line, plus ``expires=<epoch seconds, 3 decimals>``, so a backup that replays the
      KVPUB honours the same absolute expiry.
    * ``ttl=0``: no expiry (as the guide's server), properties unchanged.
    * no ``ttl`` but ``expires=<epoch seconds>``: that absolute expiry, properties unchanged.
    * a ``ttl`` or ``expires`` that is not a finite number in range raises
      ``ProtocolError`` (reason ``bad_ttl`` / ``bad_expires``).
    * neither: ``(None, props)``.
    If a name repeats, the last line wins.
    """
    if not props or (b"ttl=" not in props and b"expires=" not in props):
        return None, props
    lines = props.split(b"\n")
    lines.pop()  # validated properties end with "\n"
    ttl = expires = None
    for line in lines:
        name, _, value = line.partition(b"=")
        if name == _TTL:
            ttl = value
        elif name == _EXPIRES:
            expires = value
    if ttl is not None:
        try:
            ttl_s = float(ttl)
        except ValueError:
            raise _bad(f"ttl {ttl[:40]!r} is not a number", "bad_ttl") from None
        if not (0.0 <= ttl_s <= MAX_TTL_S):  # also false for nan
            raise _bad(f"ttl {ttl[:40]!r} is not within 0..{MAX_TTL_S:.0f} s", "bad_ttl")
        if ttl_s == 0.0:
            return None, props
        expiry_s = round(now_wall_s + ttl_s, 3)
        kept = [line for line in lines if not line.startswith(b"expires=")]
        kept.append(b"expires=%.3f" % expiry_s)
        kept.append(b"")
        return expiry_s, b"\n".join(kept)
    if expires is not None:
        try:
            expiry_s = float(expires)
        except ValueError:
            raise _bad(f"expires {expires[:40]!r} is not a number", "bad_expires") from None
        if not (0.0 <= expiry_s <= now_wall_s + MAX_TTL_S):
            raise _bad(f"expires {expires[:40]!r} is out of range", "bad_expires")
        return expiry_s, props
    return None, props


def _off_the_collector(keys: list) -> list:
    """A cursor's copy of the key list, off the cyclic garbage collector's lists when it
    holds only bytes (keys from the wire and from the log always are). Tracked, the list
    of a 100,000-key map was walked by the next collection of each generation, ~0.4 ms
    each, right after every compaction and snapshot started."""
    try:
        return untrack_frames(keys)
    except TypeError:
        return keys


class Store:
    """key (bytes) -> value (bytes), sequenced. Not thread-safe: one owner (the reactor)."""

    __slots__ = ("data", "mod", "seq", "_expiry", "_heap", "_cursors")

    def __init__(self, seq: int = 0):
        self.data: dict[bytes, bytes] = {}
        self.mod: dict[bytes, int] = {}
        """key -> the sequence that last changed it (present keys only)."""
        self.seq = seq
        self._expiry: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []
        self._cursors: list[SnapshotCursor] = []

    def __len__(self) -> int:
        return len(self.data)

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def mod_seq(self, key: bytes) -> int:
        """The sequence that last changed ``key``; 0 when it is absent."""
        return self.mod.get(key, 0)

    def expiry_of(self, key: bytes) -> float | None:
        return self._expiry.get(key)

    @property
    def expiry_table(self) -> dict[bytes, float]:
        """The live {key: absolute expiry} dict, not a copy: read it, never change it (a
        snapshot cursor reads its chunk's expiries from it)."""
        return self._expiry

    def expiries(self) -> dict[bytes, float]:
        """A copy of {key: absolute expiry} for every key with a TTL (one C-level dict
        copy: ~25 ms per million keys), e.g. for a Binary Star peer's TTL table."""
        return dict(self._expiry)

    # ------------------------------------------------------------------ updates
    def apply(self, key: bytes, value: bytes, expiry_s: float | None = None) -> int:
        """Set (or, with an empty value, delete) ``key``; return its new sequence.

        A delete of a missing key is still sequenced (it is still published). ``expiry_s``
        is an absolute wall-clock time; a key written without one loses any TTL it had.
        """
        self.seq = seq = self.seq + 1
        data = self.data
        if self._cursors:
            self._record_undo(key, bool(value))
        if self._expiry:
            self._expiry.pop(key, None)
        if value:
            data[key] = value
            self.mod[key] = seq
            if expiry_s is not None:
                self._expiry[key] = expiry_s
                heapq.heappush(self._heap, (expiry_s, key))
                if len(self._heap) > 2 * len(self._expiry) + 1024:
                    self.rebuild_ttl_index()
        else:
            data.pop(key, None)
            self.mod.pop(key, None)
        return seq

    def forget(self, keys) -> int:
        """Remove ``keys`` without a sequence and without a delete to publish: keys that
        moved to another shard (``clonemap.shards.migrate``), which clients re-home without
        an event. An open snapshot cursor still sees them as of its start. How many."""
        data, count = self.data, 0
        for key in keys:
            if key in data:
                if self._cursors:
                    self._record_undo(key, False)
                del data[key]
                self.mod.pop(key, None)
                self._expiry.pop(key, None)  # (its heap entry is skipped as stale)
                count += 1
        return count

    def put(self, key: bytes, value: bytes, expiry_s: float | None, seq: int) -> None:
        """Install one entry of a copied map (a peer's KVSYNC, a snapshot file) with the
        sequence that last changed it; the store's own sequence is not touched, and no
        cursor may be open. ``value`` is never empty. Call ``rebuild_ttl_index`` after
        the last entry."""
        self.data[key] = value
        self.mod[key] = seq
        if expiry_s is not None:
            self._expiry[key] = expiry_s
        else:
            self._expiry.pop(key, None)

    def load_entries(self, flat: list, width: int = 4, seq: int = 0) -> None:
        """Bulk-load ``[key, value, expires, mod_seq, ...]`` (a snapshot file's chunk:
        present keys, expires an absolute instant or None, mod_seq the sequence that
        last changed the key). ``width`` 3: a format-1 chunk, without ``mod_seq``: every
        key gets ``seq`` (the snapshot's: an upper bound no later write reuses, so a
        conditional write can only conflict, never pass wrongly). Does not touch the
        store's sequence; no cursor may be open. Call ``rebuild_ttl_index`` once after
        the last chunk (one heapify for the whole load, not one per chunk)."""
        keys, values, expiries = flat[0::width], flat[1::width], flat[2::width]
        self.data.update(zip(keys, values))
        if width == 4:
            self.mod.update(zip(keys, flat[3::4]))
        else:
            self.mod.update(dict.fromkeys(keys, seq))
        expiry = self._expiry
        for key, expiry_s in zip(keys, expiries):
            if expiry_s is not None:
                expiry[key] = expiry_s

    def _record_undo(self, key: bytes, sets: bool) -> None:
        old = self.data.get(key)
        if (old is None) == sets:  # an insert or a delete: the dicts' order moves
            for cursor in self._cursors:
                cursor.walks = None
        if old is None:
            return  # absent now, so absent when every open cursor was opened
        for cursor in self._cursors:
            undo = cursor.undo
            if key not in undo and key.startswith(cursor.subtree):
                undo[key] = old
                cursor.undo_seq[key] = self.mod.get(key, 0)
                if cursor.undo_expiry is not None:
                    cursor.undo_expiry[key] = self._expiry.get(key)

    # ------------------------------------------------------------------ TTL
    def next_expiry(self) -> float | None:
        """The earliest expiry in the heap (possibly a stale entry: then a harmless early
        wake-up), or None when no key has a TTL."""
        heap = self._heap
        while heap and self._expiry.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_expired(self, now_wall_s: float) -> list[tuple[bytes, int]]:
        """Delete every key whose expiry is <= now; return ``(key, seq)`` for each delete,
        in sequence order (each must be published as an empty-valued KVPUB)."""
        out = []
        heap = self._heap
        expiry = self._expiry
        while heap and heap[0][0] <= now_wall_s:
            expiry_s, key = heapq.heappop(heap)
            if expiry.get(key) == expiry_s:
                out.append((key, self.apply(key, b"")))
        return out

    @property
    def ttl_keys(self) -> int:
        return len(self._expiry)

    @property
    def ttl_heap_size(self) -> int:
        return len(self._heap)

    def rebuild_ttl_index(self) -> None:
        """The TTL heap from ``_expiry`` alone: drops stale entries (and indexes a bulk
        load)."""
        self._heap = [(e, k) for k, e in self._expiry.items()]
        heapq.heapify(self._heap)

    # ------------------------------------------------------------------ snapshots
    def open_snapshot(self, subtree: bytes = b"", *,
                      with_expiry: bool = False) -> "SnapshotCursor":
        """A point-in-time cursor; ``with_expiry`` also keeps each changed key's old
        expiry, for ``SnapshotCursor.next_entries``."""
        cursor = SnapshotCursor(self, subtree, with_expiry)
        self._cursors.append(cursor)
        return cursor

    def close_cursor(self, cursor: "SnapshotCursor") -> None:
        """A cursor is done: its walk no longer needs the undo records of writes."""
        try:
            self._cursors.remove(cursor)
        except ValueError:
            pass

    @property
    def open_cursors(self) -> int:
        return len(self._cursors)

    def items(self, subtree: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """The live map under ``subtree`` (not point-in-time; for tests and tools)."""
        for key, value in self.data.items():
            if key.startswith(subtree):
                yield key, value


class SnapshotCursor:
    """The map under ``subtree`` as it was at sequence ``seq``, yielded in chunks.

    ``next_chunk(n)`` examines up to ``n`` keys of the key list and returns the
    ``(key, value)`` pairs among them that lie under the subtree (possibly none, before
    ``done``). Close the cursor when finished or abandoned (``close`` is idempotent and
    also runs when the last chunk is taken), so the store stops recording undo entries.
    """

    __slots__ = ("store", "subtree", "seq", "undo", "undo_seq", "undo_expiry", "_keys", "_pos",
                 "closed", "walks")

    def __init__(self, store: Store, subtree: bytes, with_expiry: bool = False):
        self.store = store
        self.subtree = subtree
        self.seq = store.seq
        self.undo: dict[bytes, bytes] = {}
        self.undo_seq: dict[bytes, int] = {}
        self.undo_expiry: dict[bytes, float | None] | None = {} if with_expiry else None
        self._keys = _off_the_collector(list(store.data))
        self._pos = 0
        self.closed = False
        data, mod = store.data, store.mod
        self.walks: tuple | None = (iter(data), iter(data.values()), iter(mod), iter(mod.values()))
        """Iterators over the two dicts, in step with ``_keys`` while no key is inserted or
        deleted (``Store._record_undo`` drops them then): a chunk's values and sequences
        read in order, without a hash lookup per key (two random memory reads each, most
        of a 100,000-key snapshot's CPU). Checked chunk by chunk against ``_keys``."""

    @property
    def done(self) -> bool:
        return self._pos >= len(self._keys)

    @property
    def remaining(self) -> int:
        return len(self._keys) - self._pos

    def _walk(self, listed: list[bytes]) -> tuple[list, list] | None:
        """The values and sequences of ``listed`` (the chunk just taken from ``_keys``)
        read in order from ``walks``, or None when the dicts' order no longer matches."""
        walks = self.walks
        if walks is None:
            return None
        n = len(listed)
        keys_it, values_it, mod_keys_it, mods_it = walks
        try:
            if list(islice(keys_it, n)) != listed or list(islice(mod_keys_it, n)) != listed:
                self.walks = None  # (identity first: no key's bytes are compared)
                return None
            return list(islice(values_it, n)), list(islice(mods_it, n))
        except RuntimeError:  # a dict changed size: the walk is over
            self.walks = None
            return None

    def next_chunk(self, n: int) -> list[tuple[bytes, bytes]]:
        keys, values, _, _ = self.next_columns(n)
        return list(zip(keys, values))

    def next_entries(self, n: int) -> list:
        """Like ``next_chunk`` but flat, with each key's absolute expiry and the sequence
        that last changed it, as of ``seq``: ``[key, value, expires, mod_seq, ...]`` (a
        cursor opened ``with_expiry``; built from ``next_columns`` by slice assignment)."""
        keys, values, mods, expiries = self.next_columns(n, True)
        out = [None] * (4 * len(keys))
        out[0::4], out[1::4], out[2::4], out[3::4] = keys, values, expiries, mods
        return out

    def next_columns(self, n: int, with_expiry: bool = False, keep=None
                     ) -> tuple[list, list, list, list | None]:
        """What a KVSYNC carries for the next keys, as of ``seq``, in columns (built by
        C-level maps: the snapshot stream's hot path): ``(keys, values, mod_seqs,
        expiries)``, ``expiries`` None unless ``with_expiry`` (then each key's absolute
        expiry or None; the cursor must be opened ``with_expiry``). ``keep(key)``: only
        the keys it accepts of the next ``n`` (a move's copy, which sends about a third of
        the keys it looks at: their values and sequences are not read)."""
        undo, old_seq = self.undo, self.undo_seq  # before the last chunk closes the cursor
        old_expiry = self.undo_expiry
        store = self.store
        start = self._pos
        self._pos = end = min(start + n, len(self._keys))
        listed = self._keys[start:end]
        walked = self._walk(listed)
        keys = listed
        if self.subtree:
            subtree = self.subtree
            inside = [key.startswith(subtree) for key in listed]
            keys = list(compress(listed, inside))
            if walked is not None:
                walked = list(compress(walked[0], inside)), list(compress(walked[1], inside))
        if keep is not None:
            kept = list(map(keep, keys))
            if not all(kept):
                keys = list(compress(keys, kept))
                if walked is not None:
                    walked = list(compress(walked[0], kept)), list(compress(walked[1], kept))
        if self._pos >= len(self._keys):
            self.close()
        # (a key in ``undo`` was rewritten or deleted since the cursor opened: its value
        # and sequence then are there; any other is as it is now)
        changed = bool(undo) and not undo.keys().isdisjoint(keys)
        if walked is not None and not changed:
            values, mods = walked  # (as they were at ``seq``: no key of them changed)
        elif changed:
            data, mod = store.data, store.mod
            values = list(map(undo.get, keys, map(data.get, keys)))
            mods = list(map(old_seq.get, keys, map(mod.get, keys)))
        else:
            values = list(map(store.data.__getitem__, keys))
            mods = list(map(store.mod.__getitem__, keys))
        expiries = None
        if with_expiry:
            expiry = store.expiry_table
            if old_expiry and not old_seq.keys().isdisjoint(keys):
                expiries = list(map(old_expiry.get, keys, map(expiry.get, keys)))
            elif expiry:
                expiries = list(map(expiry.get, keys))
            else:
                expiries = [None] * len(keys)
        return keys, values, mods, expiries

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.store.close_cursor(self)
            self._keys = []
            self.walks = None
            self.undo = {}
            self.undo_seq = {}
            if self.undo_expiry is not None:
                self.undo_expiry = {}
