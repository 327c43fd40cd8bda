"""Loading a data directory back into a ``Store``: the newest whole snapshot, then every
segment update after it, in sequence order.

Outcomes:

* the same map, sequence and TTL instants as when the last whole record was written (a
  key whose instant passed while the server was down is due at once: the server expires
  it, and logs that delete, before it serves);
* a torn tail on the newest segment (a crash in the middle of a write) is truncated at
  the last whole record, and reported (``torn_bytes``);
* a record that fails its checksum with more data after it, a snapshot that does not
  load, or updates missing between two files is ``CorruptLog`` naming the file and the
  offset: never a silent empty map;
* a directory whose files do not start at sequence 1 or at a snapshot is an *incomplete
  replica*: a passive server was killed while it rewrote its directory from its active
  peer (``DataDir.replace``). Its files are moved to ``incomplete-<utc>/`` and the server
  starts empty with sequence 0 and the ``needs-peer`` marker (``mark_needs_peer``): its
  peer, which holds the map, wins the start-up election (``clonemap.shards.bstar``), it
  synchronises again, and until then it never serves its empty map as the shard's, not
  even when the supervisor reports that peer down.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from clonemap.shards.persist import format as fmt
from clonemap.shards.persist.format import CorruptLog
from clonemap.shards.store import Store


@dataclass
class Files:
    snapshots: list[tuple[int, Path]] = field(default_factory=list)
    segments: list[tuple[int, Path]] = field(default_factory=list)
    temporary: list[Path] = field(default_factory=list)


def list_files(data_dir: Path) -> Files:
    """The data files in ``data_dir``, each list sorted by sequence."""
    out = Files()
    if not data_dir.is_dir():
        return out
    for entry in os.scandir(data_dir):
        name = entry.name
        if name.endswith(fmt.TMP_SUFFIX):
            out.temporary.append(Path(entry.path))
        elif (seq := fmt.seq_of(name, fmt.SNAP_PREFIX, fmt.SNAP_SUFFIX)) is not None:
            out.snapshots.append((seq, Path(entry.path)))
        elif (seq := fmt.seq_of(name, fmt.LOG_PREFIX, fmt.LOG_SUFFIX)) is not None:
            out.segments.append((seq, Path(entry.path)))
    out.snapshots.sort()
    out.segments.sort()
    return out


def needed(files: Files) -> tuple[tuple[int, Path] | None, list[tuple[int, Path]]]:
    """What a recovery reads: the newest snapshot (or None) and the segments from the
    one holding the update after it (older segments are covered by the snapshot)."""
    snapshot = files.snapshots[-1] if files.snapshots else None
    base = snapshot[0] if snapshot else 0
    start = 0
    for i, (first, _) in enumerate(files.segments):
        if first <= base + 1:
            start = i
    return snapshot, files.segments[start:]


@dataclass
class Recovered:
    store: Store
    generation: str
    term: int = 0
    history: list[tuple[int, int]] = field(default_factory=list)
    snapshot_seq: int | None = None
    records: int = 0
    """Updates replayed from segments."""
    torn_bytes: int = 0
    """Bytes of a torn last record that were truncated (0: none)."""
    torn_updates: int = 0
    """Updates in that record, when what was written of it says (0: none or unknown)."""
    torn_first_seq: int = 0
    """The first of their sequences (``torn_first_seq .. + torn_updates - 1``)."""
    incomplete: str = ""
    """Where an incomplete replica's files were moved ("" normally)."""
    segments: int = 0
    uuids: list = field(default_factory=list)
    """``[uuid, seq, ...]``, oldest first: the applied UUIDs the snapshot file and the
    segments hold (for ``clonemap.shards.applied``)."""


def load_snapshot(path: Path, uuids: list | None = None) -> tuple[Store, str, int]:
    """``(store, generation, entries)`` from a snapshot file; ``CorruptLog`` if not whole.
    Its applied UUIDs are added to ``uuids`` (``[uuid, seq, ...]``)."""
    scan = fmt.Scan(path, fmt.SNAP_MAGIC, allow_torn=False)
    per = fmt.width(scan.version)
    store = Store()
    seq = None
    count = None
    loaded = 0
    for offset, obj in scan.records():
        if count is not None:
            raise CorruptLog("a record after the snapshot's end", path=scan.where,
                             offset=offset)
        if isinstance(obj, dict):
            if seq is None and "seq" in obj:
                seq = int(obj["seq"])
            elif seq is not None and "keys" in obj:
                count = int(obj["keys"])
            elif seq is not None and isinstance(obj.get("uuids"), list):
                if uuids is not None:
                    uuids += obj["uuids"]
            else:
                raise CorruptLog(f"unexpected snapshot record {sorted(obj)}",
                                 path=scan.where, offset=offset)
        elif isinstance(obj, list) and seq is not None and len(obj) % per == 0:
            store.load_entries(obj, per, seq)
            loaded += len(obj) // per
        else:
            raise CorruptLog("not a snapshot record", path=scan.where, offset=offset)
    if seq is None or count is None:
        raise CorruptLog("the snapshot has no " + ("start" if seq is None else "end"),
                         path=scan.where, offset=scan.end)
    if count != loaded or count != len(store):
        raise CorruptLog(f"the snapshot says {count} keys, holds {loaded}",
                         path=scan.where, offset=scan.end)
    store.rebuild_ttl_index()
    store.seq = seq
    return store, scan.generation, loaded


def segment_records(scan: fmt.Scan):
    """``(offset, [first_seq, key, value, expires, uuid, ...])`` for each record of a
    segment (``fmt.width(scan.version)`` items per update); ``CorruptLog`` for a record
    of another shape."""
    per = fmt.width(scan.version)
    for offset, rec in scan.records():
        if not isinstance(rec, list) or len(rec) % per != 1 or not isinstance(rec[0], int):
            raise CorruptLog("not a segment record", path=scan.where, offset=offset)
        yield offset, rec


def replay_segment(store: Store, path: Path, *, last: bool, uuids: list | None = None
                   ) -> tuple[int, int, str, tuple[int, int] | None]:
    """Apply the segment's updates after ``store.seq``; ``(applied, torn_bytes,
    generation, torn_batch)``, the last the torn tail's ``(updates, first_seq)`` when
    known. Truncates a torn tail when ``last``; raises ``CorruptLog`` on a gap. The
    applied updates' UUIDs are added to ``uuids``."""
    scan = fmt.Scan(path, fmt.LOG_MAGIC, allow_torn=last)
    per = fmt.width(scan.version)
    applied = 0
    apply = store.apply
    for offset, rec in segment_records(scan):
        first = rec[0]
        if first > store.seq + 1:
            raise CorruptLog(f"updates {store.seq + 1}..{first - 1} are missing",
                             path=scan.where, offset=offset)
        skip = store.seq + 1 - first  # already covered by the snapshot or an older file
        for i in range(1 + per * skip, len(rec), per):
            value = rec[i + 1]
            seq = apply(rec[i], value, rec[i + 2] if value else None)
            if per == 4 and uuids is not None and rec[i + 3]:
                uuids += (rec[i + 3], seq)
            applied += 1
    if scan.torn:
        fmt.truncate(path, scan.end)
    return applied, scan.torn, scan.generation, scan.torn_batch


def read_terms(data_dir: Path) -> tuple[int, list[tuple[int, int]]]:
    path = data_dir / fmt.TERMS_NAME
    try:
        doc = json.loads(path.read_text())
        term = int(doc["term"])
        history = [(int(t), int(s)) for t, s in doc.get("history", [])]
    except FileNotFoundError:
        return 0, []
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptLog(f"terms file does not parse ({exc})", path=str(path),
                         offset=0) from None
    return term, history


def recover(data_dir: str | os.PathLike) -> Recovered:
    """Load ``data_dir`` (see the module doc). An absent or empty directory gives an empty
    store with sequence 0."""
    path = Path(data_dir)
    files = list_files(path)
    term, history = read_terms(path)
    for tmp in files.temporary:  # a snapshot or terms file cut short: never renamed
        tmp.unlink()
    store, generation, snap_seq = Store(), "", None
    uuids: list = []
    snapshot, segments = needed(files)
    if snapshot is not None:
        snap_seq, snap_path = snapshot
        store, generation, _ = load_snapshot(snap_path, uuids)
        if store.seq != snap_seq:
            raise CorruptLog(f"the snapshot's sequence is {store.seq}, its name says "
                             f"{snap_seq}", path=str(snap_path), offset=0)
    if segments and segments[0][0] > store.seq + 1 and snap_seq is None:
        moved = _move_aside(path, files)
        return Recovered(Store(), "", term, history, None, incomplete=moved)
    out = Recovered(store, generation, term, history, snap_seq, segments=len(segments),
                    uuids=uuids)
    for i, (_, seg_path) in enumerate(segments):
        applied, torn, gen, batch = replay_segment(store, seg_path,
                                                   last=i == len(segments) - 1, uuids=uuids)
        if batch is not None:
            out.torn_updates, out.torn_first_seq = batch
        out.records += applied
        out.torn_bytes += torn
        if gen and not out.generation:
            out.generation = gen
    return out


def quarantine(data_dir: str | os.PathLike, why: str) -> str:
    """A Binary Star server whose directory cannot be read (``CorruptLog``, say): move
    every data file (snapshots, segments, terms, dropped-*; not the routing) to
    ``unreadable-<utc>/``
    (kept for the operator, never deleted), and leave the ``needs-peer`` marker saying
    why, so that the server starts empty and serves only after copying its peer's map
    (``clonemap.shards.bstar`` rule 8). Returns where the files went."""
    path = Path(data_dir)
    dest = path / time.strftime(f"{fmt.UNREADABLE_PREFIX}%Y%m%dT%H%M%SZ", time.gmtime())
    dest.mkdir(exist_ok=True)
    for entry in os.scandir(path):
        # the routing file stays: it is not the map, and it is what keeps a restarted
        # server from following an older routing than one it served
        if entry.is_file() and entry.name not in (fmt.NEEDS_PEER_NAME, fmt.ROUTING_NAME):
            os.rename(entry.path, dest / entry.name)
    mark_needs_peer(path, why, str(dest))
    return str(dest)


def mark_needs_peer(data_dir: str | os.PathLike, why: str, moved_to: str) -> None:
    """Leave the ``needs-peer`` marker (fsynced): this directory holds no copy of the
    map a Binary Star server may serve until it has copied its peer's."""
    path = Path(data_dir)
    with open(path / fmt.NEEDS_PEER_NAME, "w") as f:
        json.dump({"why": why, "moved_to": moved_to, "at": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    fmt.fsync_dir(path)


def needs_peer(data_dir: str | os.PathLike) -> bool:
    """Whether ``data_dir`` holds the ``needs-peer`` marker (``quarantine``)."""
    return (Path(data_dir) / fmt.NEEDS_PEER_NAME).exists()


def peer_copy_written(data_dir: str | os.PathLike) -> None:
    """The peer's whole map is on disk here: the marker goes (fsynced)."""
    path = Path(data_dir)
    (path / fmt.NEEDS_PEER_NAME).unlink(missing_ok=True)
    fmt.fsync_dir(path)


def _move_aside(path: Path, files: Files) -> str:
    dest = path / time.strftime("incomplete-%Y%m%dT%H%M%SZ", time.gmtime())
    dest.mkdir(exist_ok=True)
    for _, src in files.snapshots + files.segments:
        src.rename(dest / src.name)
    fmt.fsync_dir(path)
    return str(dest)


def replay_records(path: Path):
    """Every update in one segment, as ``(seq, key, value, expires)`` (a torn tail is
    ignored, not truncated): for tools and for keeping dropped updates."""
    scan = fmt.Scan(path, fmt.LOG_MAGIC, allow_torn=True)
    per = fmt.width(scan.version)
    for _, rec in segment_records(scan):
        seq = rec[0]
        for i in range(1, len(rec), per):
            yield seq, rec[i], rec[i + 1], rec[i + 2]
            seq += 1


def fork_point(mine: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> int | None:
    """The first sequence from which this server's updates may not be in its peer's map,
    from the two term histories (``[(term, first sequence of that term), ...]``, oldest
    first), or None when the histories agree (this server is merely behind).

    Where the histories first differ, the earlier of the two terms' first sequences is
    where the lineages split: an update this server logged at or after it was sequenced
    by a term its peer never followed (the peer took over without it)."""
    for a, b in zip(mine, theirs):
        if a != b:
            return min(a[1], b[1])
    if len(mine) > len(theirs):
        return mine[len(theirs)][1]
    if len(theirs) > len(mine) and mine:
        return theirs[len(mine)][1]
    return None
