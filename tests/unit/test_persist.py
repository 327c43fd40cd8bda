"""A data directory (``clonemap.shards.persist``) with real files and real fsyncs: what is written
comes back; a crash at any byte offset recovers the state after a whole prefix of the
operations (at least every fsynced batch), never an error or a mixed state, with or
without a compaction on the way; corruption is a clear error naming the file and offset.
"""
from __future__ import annotations

import os
import shutil
import struct

import pytest
from hypothesis import given, settings, strategies as st

from clonemap.shards.persist import CorruptLog, DataDir, fork_point, recover
from clonemap.shards.persist import format as fmt
from clonemap.shards.store import Store

GEN = "g0123456789abcdef"
KEYS = [b"/a", b"/b", b"/c/d", b"/e"]
op = st.tuples(st.sampled_from(KEYS),
               st.one_of(st.just(b""), st.binary(min_size=1, max_size=40)),
               st.one_of(st.none(), st.floats(1e9, 4e9, allow_nan=False)))


def apply_all(store: Store, writer: DataDir, ops) -> None:
    for key, value, expires in ops:
        expires = expires if value else None
        seq = store.apply(key, value, expires)
        writer.append(seq, key, value, expires)


def state_after(ops) -> dict:
    data = {}
    for key, value, expires in ops:
        if value:
            data[key] = (value, expires)
        else:
            data.pop(key, None)
    return data


def state_of(store: Store) -> dict:
    return {k: (v, store.expiry_of(k)) for k, v in store.items()}


def compact(writer: DataDir, store: Store, interleave=()) -> None:
    """A whole compaction, with ``interleave`` applied between its chunks."""
    job = writer.start_compaction(store)
    pending = list(interleave)
    while not job.step(keys=1):
        if pending:
            apply_all(store, writer, [pending.pop(0)])
            writer.flush()
    apply_all(store, writer, pending)
    writer.flush()
    job.finish()
    writer.compacted(job)


def test_what_is_written_comes_back_with_its_sequence_and_ttl_instants(tmp_path):
    ops = [(b"/a", b"1", None), (b"/b", b"2", 2e9), (b"/a", b"", None), (b"/c", b"3", 3.5e9)]
    store, writer = Store(), DataDir(tmp_path, "always")
    writer.open(GEN, 0)
    apply_all(store, writer, ops)
    writer.close()
    got = recover(tmp_path)
    assert got.generation == GEN and got.records == 4 and got.torn_bytes == 0
    assert state_of(got.store) == state_after(ops) and got.store.seq == 4
    assert got.store.expiry_of(b"/b") == 2e9 and got.store.ttl_keys == 2


def test_no_directory_is_an_empty_map(tmp_path):
    got = recover(tmp_path / "none")
    assert got.records == 0 and len(got.store) == 0 and got.generation == ""
    assert got.store.seq == 0 and got.term == 0 and got.history == []


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=30), batches=st.lists(st.integers(1, 4), min_size=30,
                                                       max_size=30),
       compact_at=st.one_of(st.none(), st.integers(0, 30)), cut=st.floats(0, 1))
def test_a_crash_at_any_byte_recovers_a_whole_prefix(tmp_path_factory, ops, batches,
                                                     compact_at, cut):
    """Operations flushed in batches (one record each), a compaction somewhere, then the
    newest segment cut at any byte: the state after some prefix of the operations, at
    least everything before the cut batch, with its sequence."""
    tmp = tmp_path_factory.mktemp("d")
    store, writer = Store(), DataDir(tmp, "no")
    writer.open(GEN, 0)
    done = 0
    flushed = []  # the operation count at the end of each record of the newest segment
    sizes = []
    compacted_at = 0
    sizes_base = writer.segment.stat().st_size
    for size in batches:
        if compact_at is not None and compacted_at == 0 and done >= compact_at:
            compact(writer, store)
            compacted_at = done
            flushed, sizes = [], []
            sizes_base = writer.segment.stat().st_size
        batch = ops[done:done + size]
        if not batch:
            break
        apply_all(store, writer, batch)
        writer.flush()
        done += len(batch)
        flushed.append(done)
        sizes.append(writer.segment.stat().st_size)
    segment = writer.segment
    writer.close()
    data = segment.read_bytes()
    offset = round(cut * len(data))
    segment.write_bytes(data[:offset])
    got = recover(tmp)
    whole = [n for n, end in zip(flushed, sizes) if end <= offset]
    expect = whole[-1] if whole else compacted_at
    assert state_of(got.store) == state_after(ops[:expect])
    assert got.store.seq == expect
    assert got.torn_bytes == (offset - (sizes[len(whole) - 1] if whole else
                                        (sizes_base if offset >= sizes_base else 0)))


def test_a_compaction_during_writes_snapshots_the_map_as_it_was(tmp_path):
    """Writes between the compaction's chunks (new keys, rewrites that change or drop a
    TTL, deletes) land in the new segment; the snapshot holds each key as it was at its
    sequence, so recovery from snapshot + segment is exactly the live map."""
    store, writer = Store(), DataDir(tmp_path, "no")
    writer.open(GEN, 0)
    apply_all(store, writer, [(b"/k%d" % i, b"v%d" % i, 2e9 + i if i % 2 else None)
                              for i in range(40)])
    writer.flush()
    during = [(b"/k1", b"new", None), (b"/k2", b"x", 3e9), (b"/k3", b"", None),
              (b"/n", b"fresh", 2.5e9), (b"/k5", b"again", 2.2e9)]
    compact(writer, store, during)
    writer.close()
    names = sorted(os.listdir(tmp_path))
    assert names == [fmt.seq_name("log-", 41, ".cml"), fmt.seq_name("snap-", 40, ".cms")]
    got = recover(tmp_path)
    assert got.snapshot_seq == 40 and got.records == 5
    assert state_of(got.store) == state_of(store) and got.store.seq == store.seq == 45
    # the TTL index is whole after a bulk load: every key expires at its instant
    assert got.store.ttl_keys == store.ttl_keys
    assert got.store.next_expiry() == min(store.expiries().values())
    due = sorted(store.expiries().items(), key=lambda kv: kv[1])
    assert [k for k, _ in got.store.pop_expired(due[-1][1])] == [k for k, _ in due]


def test_compaction_keeps_the_disk_within_three_times_the_live_data(tmp_path):
    store, writer = Store(), DataDir(tmp_path, "no", compact_min_bytes=20_000)
    writer.open(GEN, 0)
    peak = 0
    for round_ in range(60):  # the same 100 keys rewritten over and over
        apply_all(store, writer, [(b"/k%03d" % i, os.urandom(50), None) for i in range(100)])
        writer.flush()
        if writer.compaction_due():
            compact(writer, store)
        peak = max(peak, sum(f.stat().st_size for f in tmp_path.iterdir()))
    live = sum(len(k) + len(v) for k, v in store.items())
    assert writer.counters["compactions"] >= 3
    assert peak < 3 * live + 20_000
    writer.close()
    assert state_of(recover(tmp_path).store) == state_of(store)


def test_a_corrupt_record_in_the_middle_names_the_file_and_offset(tmp_path):
    store, writer = Store(), DataDir(tmp_path, "no")
    writer.open(GEN, 0)
    ends = []
    for i in range(3):
        apply_all(store, writer, [(b"/k%d" % i, b"v", None)])
        writer.flush()
        ends.append(writer.segment.stat().st_size)
    segment = writer.segment
    writer.close()
    bad = bytearray(segment.read_bytes())
    bad[ends[0] + 10] ^= 0xFF  # inside the second record's payload
    segment.write_bytes(bytes(bad))
    with pytest.raises(CorruptLog) as info:
        recover(tmp_path)
    assert info.value.offset == ends[0] and str(segment) in str(info.value)
    assert "checksum" in str(info.value)


def test_a_file_that_is_not_a_segment_or_another_version_is_refused(tmp_path):
    name = fmt.seq_name("log-", 1, ".cml")
    (tmp_path / name).write_bytes(b"hello, this is not a clonemap log at all")
    with pytest.raises(CorruptLog, match="bad header"):
        recover(tmp_path)
    (tmp_path / name).write_bytes(fmt.LOG_MAGIC + struct.pack(">HB", 3, 0))
    with pytest.raises(CorruptLog, match="format version 3; this server reads versions 1, 2"):
        recover(tmp_path)


def test_missing_updates_between_files_are_an_error_not_a_mixed_map(tmp_path):
    store, writer = Store(), DataDir(tmp_path, "no")
    writer.open(GEN, 0)
    apply_all(store, writer, [(b"/a", b"1", None), (b"/b", b"2", None)])
    writer.close()
    later = DataDir(tmp_path, "no")
    later.open(GEN, 5)  # as if updates 3..5 had been lost
    later.append(6, b"/c", b"3", None)
    later.close()
    with pytest.raises(CorruptLog, match="updates 3..5 are missing"):
        recover(tmp_path)


def test_a_snapshot_cut_short_is_refused_and_a_temporary_one_ignored(tmp_path):
    store, writer = Store(), DataDir(tmp_path, "no")
    writer.open(GEN, 0)
    apply_all(store, writer, [(b"/k%d" % i, b"v", None) for i in range(10)])
    writer.flush()
    job = writer.start_compaction(store)
    while not job.step(keys=3):
        pass
    killed = tmp_path.parent / (tmp_path.name + "-killed")
    shutil.copytree(tmp_path, killed)  # the files as a kill before the rename leaves them
    got = recover(killed)  # the .tmp is ignored (and removed)
    assert len(got.store) == 10 and got.snapshot_seq is None
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert not any(p.name.endswith(".tmp") for p in killed.iterdir())
    writer.close()  # a clean stop finishes the compaction
    assert recover(tmp_path).snapshot_seq == 10
    writer = DataDir(tmp_path, "no")
    writer.open(GEN, 10)
    compact(writer, got.store)
    writer.close()
    snap = next(tmp_path.glob("snap-*"))
    snap.write_bytes(snap.read_bytes()[:-7])
    with pytest.raises(CorruptLog, match=snap.name):
        recover(tmp_path)


def test_everysec_fsyncs_at_most_once_a_second_and_always_every_flush(tmp_path):
    now = [0.0]
    w = DataDir(tmp_path / "e", "everysec", clock=lambda: now[0])
    w.open(GEN, 0)
    base = w.counters["fsyncs"]  # the header
    w.append(1, b"/a", b"1", None)
    w.flush()
    w.tick()
    assert w.counters["fsyncs"] == base  # not a second yet
    now[0] = 1.0
    w.tick()  # on a background thread, off the event loop
    assert w.wait_fsync(10)
    assert w.counters["fsyncs"] == base + 1
    w.tick()
    assert w.wait_fsync(10)
    assert w.counters["fsyncs"] == base + 1  # nothing new written
    w.close()
    a = DataDir(tmp_path / "a", "always")
    a.open(GEN, 0)
    base = a.counters["fsyncs"]
    for i in range(3):
        a.append(i + 1, b"/k", b"v", None)
        a.append(i + 1 + 100, b"/k", b"v", None)  # not consecutive: its own record
        a.flush()
    assert a.counters["fsyncs"] == base + 3 and a.counters["records"] == 6
    a.close()
    with pytest.raises(ValueError):
        DataDir(tmp_path / "x", "sometimes")


def test_everysec_background_work_runs_on_one_thread_that_close_ends(tmp_path, caplog):
    """The fsyncs and writeback starts go, in order, to one thread that open() starts. A
    thread per job made the reactor wait in ``Thread.start`` until it ran: ~12 loop turns
    over 0.2 ms (up to 0.8 ms) in 5 s at 20,000 updates/s. A job that raises is logged,
    its descriptor closed and its event set; the thread goes on; close() ends it."""
    import threading

    def ours():
        return [t for t in threading.enumerate() if t.ident not in before]

    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    before = {t.ident for t in threading.enumerate()}
    now = [0.0]
    w = DataDir(tmp_path / "t", "everysec", clock=lambda: now[0])
    w.open(GEN, 0)
    worker = ours()
    assert [t.name for t in worker] == ["persist-io"]
    fsyncs, fds = w.counters["fsyncs"], open_fds()
    for i in range(3):
        w.append(i + 1, b"/k", b"v" * 100, None)
        w.flush()
        now[0] += 1.0
        w.tick()
        assert w.wait_fsync(10)
    assert w.counters["fsyncs"] == fsyncs + 3
    assert ours() == worker and open_fds() == fds  # no new thread, every dup closed
    done = w._on_a_thread("a broken job", lambda fd: 1 / 0)
    assert done.wait(10) and worker[0].is_alive() and open_fds() == fds
    assert "a broken job failed" in caplog.text
    w.close()
    worker[0].join(10)
    assert not worker[0].is_alive()


def test_everysec_starts_writeback_between_fsyncs_once_a_mebibyte_was_written(tmp_path):
    """A tick between fsyncs has the kernel start writing back what was written
    (sync_file_range, not waited for) once WRITEBACK_BYTES are new since the last start or
    fsync; the fsync stays once a second, and a tick that is due fsyncs instead."""
    from clonemap.shards.persist import writer

    now = [0.0]
    w = DataDir(tmp_path / "w", "everysec", clock=lambda: now[0])
    w.open(GEN, 0)
    fsyncs = w.counters["fsyncs"]
    value = b"v" * 1000

    def write(n):
        for _ in range(n):
            w.append(w_seq[0], b"/k", value, None)
            w_seq[0] += 1
        w.flush()

    w_seq = [1]
    write(10)                                  # ~10 KB: too little to start anything
    now[0] = 0.25
    w.tick()
    assert w.wait_fsync(10) and w.counters.get("writebacks", 0) == 0
    write(writer.WRITEBACK_BYTES // 1000 + 10)  # past a mebibyte
    now[0] = 0.5
    w.tick()
    assert w.wait_fsync(10) and w.counters["writebacks"] == 1
    now[0] = 0.75
    w.tick()                                   # nothing new since that start
    assert w.wait_fsync(10) and w.counters["writebacks"] == 1
    assert w.counters["fsyncs"] == fsyncs      # and no fsync before its second
    write(writer.WRITEBACK_BYTES // 1000 + 10)
    now[0] = 1.0
    w.tick()                                   # due: the fsync, not a writeback start
    assert w.wait_fsync(10)
    assert w.counters["fsyncs"] == fsyncs + 1 and w.counters["writebacks"] == 1
    assert w.counters.get("writeback_errors", 0) == 0
    w.close()
    got = recover(tmp_path / "w")                # every write is back, in order
    assert got.store.seq == w_seq[0] - 1 and state_of(got.store) == {b"/k": (value, None)}


@pytest.mark.parametrize("mine, theirs, expected", [
    ([(1, 1)], [(1, 1)], None),                       # the same lineage: merely behind
    ([], [(1, 1)], None),                             # nothing of its own
    ([(1, 1)], [(1, 1), (2, 98)], 98),                # the peer took over at 98
    ([(1, 1), (3, 50)], [(1, 1)], 50),                # a term the peer never followed
    ([(1, 1), (2, 40)], [(1, 1), (3, 60)], 40),       # both took over: the earlier split
])
def test_fork_point(mine, theirs, expected):
    assert fork_point(mine, theirs) == expected


def test_replacing_the_map_keeps_updates_the_new_map_never_had(tmp_path):
    """A passive installs its active's map: its own updates from the fork on go to a
    ``dropped-*`` file (readable, in the segment format), the rest is the new map."""
    store, writer = Store(), DataDir(tmp_path, "no")
    writer.open(GEN, 0)
    apply_all(store, writer, [(b"/k%d" % i, b"mine", None) for i in range(10)])
    peer = Store()
    for i in range(12):
        peer.apply(b"/p%d" % i, b"theirs")
    dropped = writer.replace(peer, "gpeer", dropped_from=8)
    assert dropped == 3  # 8, 9, 10
    job = writer.compaction
    while not job.step():
        pass
    job.finish()
    writer.compacted(job)
    writer.close()
    got = recover(tmp_path)
    assert state_of(got.store) == state_of(peer) and got.generation == "gpeer"
    (kept,) = tmp_path.glob("dropped-*.cml")
    from clonemap.shards.persist.recovery import replay_records
    assert [(s, k) for s, k, _, _ in replay_records(kept)] == [
        (8, b"/k7"), (9, b"/k8"), (10, b"/k9")]


def test_an_incomplete_replica_starts_empty_and_keeps_its_files_aside(tmp_path):
    """Killed after a replace and before its first snapshot was renamed: the segment does
    not start at 1 and there is no snapshot. Never a partial map."""
    peer = Store()
    for i in range(5):
        peer.apply(b"/p%d" % i, b"v")
    writer = DataDir(tmp_path, "no")
    writer.open(GEN, 0)
    writer.replace(peer, "gpeer", None)
    writer.append(6, b"/p9", b"v", None)
    writer.flush()
    killed = tmp_path.parent / (tmp_path.name + "-killed")
    shutil.copytree(tmp_path, killed)  # the files as a kill at this point leaves them
    got = recover(killed)
    assert got.incomplete and len(got.store) == 0 and got.store.seq == 0
    assert any(p.name.startswith("log-") for p in (killed / os.path.basename(
        got.incomplete)).iterdir())
    writer.close()  # a clean stop instead finishes the new map's first snapshot
    clean = recover(tmp_path)
    assert not clean.incomplete and clean.snapshot_seq == 5 and clean.store.seq == 6


def test_terms_are_saved_atomically_and_read_back(tmp_path):
    writer = DataDir(tmp_path, "no")
    writer.open(GEN, 0)
    writer.save_terms(3, [(1, 1), (3, 77)])
    writer.close()
    got = recover(tmp_path)
    assert got.term == 3 and got.history == [(1, 1), (3, 77)]
    (tmp_path / "terms").write_text("{not json")
    with pytest.raises(CorruptLog, match="terms"):
        recover(tmp_path)


def test_a_torn_tail_is_reported_in_updates_and_sequences(tmp_path):
    store, writer = Store(), DataDir(tmp_path, "always")
    writer.open(GEN, 0)
    apply_all(store, writer, [(b"/a", b"1", None), (b"/b", b"2", None)])
    writer.close()
    segment = next(p for p in tmp_path.iterdir() if p.name.startswith(fmt.LOG_PREFIX))
    torn = fmt.record([3, b"/c", b"3", None, b"", b"/d", b"4", None, b"", b"/e", b"5", None,
                       b""])
    with open(segment, "ab") as f:
        f.write(torn[:len(torn) - 4])  # a crash in the middle of the write
    got = recover(tmp_path)
    assert got.store.seq == 2 and got.torn_bytes == len(torn) - 4
    assert (got.torn_updates, got.torn_first_seq) == (3, 3)
    with open(segment, "ab") as f:
        f.write(torn[:5])  # too little written to tell
    got = recover(tmp_path)
    assert got.torn_bytes == 5 and got.torn_updates == 0
