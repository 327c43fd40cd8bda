"""What makes writes conditional and resends exactly-once, without sockets: the active's
decision (``clonemap.shards.applied.decide``) against a model, the table of applied UUIDs and its
bounds, and both surviving the disk (real files, real fsyncs): a restarted server knows
every key's last-modified sequence and the UUIDs it applied."""
from __future__ import annotations

import struct

from hypothesis import given, settings, strategies as st

from clonemap.shards.applied import APPLY, CONFLICT, DUPLICATE, ENTRY_BYTES, AppliedUuids, decide
from clonemap.shards.persist import DataDir, recover
from clonemap.shards.persist import format as fmt
from clonemap.shards.store import Store

GEN = "g0123456789abcdef"
KEYS = [b"/lock", b"/n", b"/cfg/a"]

write = st.tuples(
    st.sampled_from(KEYS),
    st.one_of(st.just(b""), st.binary(min_size=1, max_size=8)),
    st.one_of(st.none(), st.integers(0, 12)),  # if_seq (0: create)
    st.integers(0, 5),  # which UUID: a small pool, so resends happen
)


@settings(max_examples=300, deadline=None)
@given(st.lists(write, max_size=60))
def test_the_active_decides_as_the_model_says(writes):
    """Each write against a model of the shard (key -> (value, the sequence that set it),
    and each UUID's first application): a conditional write applies only when the key's
    sequence is the one asked, a resend of an applied UUID is a duplicate that names the
    first sequence and changes nothing, and the sequence grows by one per application."""
    store, applied = Store(), AppliedUuids()
    model: dict[bytes, tuple[bytes, int]] = {}
    first: dict[bytes, int] = {}
    seq = 0
    for key, value, if_seq, which in writes:
        uuid = b"%016d" % which
        current = model.get(key, (b"", 0))[1]
        verdict, at = decide(store.mod_seq(key), applied.get(uuid), if_seq, not value)
        if uuid in first:
            assert (verdict, at) == (DUPLICATE, first[uuid])
            continue
        if if_seq is not None and (current != if_seq or (not value and not current)):
            assert (verdict, at) == (CONFLICT, current)
            continue
        assert verdict == APPLY
        seq += 1
        assert store.apply(key, value) == seq
        applied.add(uuid, seq)
        first[uuid] = seq
        if value:
            model[key] = (value, seq)
        else:
            model.pop(key, None)
    assert {k: (v, store.mod_seq(k)) for k, v in store.data.items()} == model
    assert store.seq == seq


def test_the_table_keeps_at_least_half_its_entries_and_at_most_all():
    table = AppliedUuids(max_bytes=100 * ENTRY_BYTES, max_age_s=60.0, now=0.0)
    assert table.half == 50
    for i in range(1, 201):
        table.add(struct.pack(">16s", b"%d" % i), i)
        assert 50 <= len(table) <= 100 or i < 50
    # the newest 50 are always there, the oldest long gone
    assert all(table.get(struct.pack(">16s", b"%d" % i)) == i for i in range(151, 201))
    assert table.get(struct.pack(">16s", b"1")) is None
    assert len(table) * ENTRY_BYTES <= 100 * ENTRY_BYTES


def test_the_table_forgets_by_age():
    table = AppliedUuids(max_bytes=1 << 20, max_age_s=10.0, now=0.0)
    table.add(b"A" * 16, 1)
    table.tick(4.9)
    assert table.get(b"A" * 16) == 1  # younger than half the age: kept
    table.tick(5.0)
    assert table.get(b"A" * 16) == 1  # one rotation: still in the previous half
    table.add(b"B" * 16, 2)
    table.tick(10.0)
    assert table.get(b"A" * 16) is None and table.get(b"B" * 16) == 2
    older, newer = table.generations()  # (copies: what comes later leaves them as they are)
    table.add(b"C" * 16, 3)
    table.tick(20.0)
    assert (older, newer) == ({b"B" * 16: 2}, {}) and table.get(b"B" * 16) is None


def test_sequences_and_uuids_survive_a_restart_with_and_without_compaction(tmp_path):
    store, writer = Store(), DataDir(tmp_path, "always")
    writer.open(GEN, 0)
    applied = AppliedUuids()
    for i, (key, value) in enumerate([(b"/a", b"1"), (b"/b", b"2"), (b"/a", b"3")]):
        uuid = bytes([65 + i]) * 16
        seq = store.apply(key, value)
        applied.add(uuid, seq)
        writer.append(seq, key, value, None, uuid)
    writer.flush()
    got = recover(tmp_path)
    assert got.store.mod == {b"/a": 3, b"/b": 2}
    assert got.uuids == [b"A" * 16, 1, b"B" * 16, 2, b"C" * 16, 3]
    job = writer.start_compaction(store, applied.generations())
    while not job.step(keys=1):
        pass
    seq = store.apply(b"/c", b"4")  # after the snapshot: in the new segment
    writer.append(seq, b"/c", b"4", None, b"D" * 16)
    writer.flush()
    job.finish()
    writer.compacted(job)
    writer.close()
    assert not list(tmp_path.glob("log-00000000000000000001.cml"))  # covered, removed
    got = recover(tmp_path)
    assert got.store.mod == {b"/a": 3, b"/b": 2, b"/c": 4}
    assert got.uuids == [b"A" * 16, 1, b"B" * 16, 2, b"C" * 16, 3, b"D" * 16, 4]


def test_a_version_1_directory_is_still_read(tmp_path):
    """Files written before conditional writes: segments without UUIDs, snapshots
    without each key's sequence (loaded with the snapshot's: conditional writes on them
    can only conflict until the key is written again)."""
    head = fmt.LOG_MAGIC + struct.pack(">HB", 1, len(GEN)) + GEN.encode()
    snap = fmt.SNAP_MAGIC + struct.pack(">HB", 1, len(GEN)) + GEN.encode()
    (tmp_path / fmt.seq_name("snap-", 2, ".cms")).write_bytes(
        snap + fmt.record({"seq": 2}) + fmt.record([b"/a", b"1", None, b"/b", b"2", None])
        + fmt.record({"keys": 2}))
    (tmp_path / fmt.seq_name("log-", 3, ".cml")).write_bytes(
        head + fmt.record([3, b"/c", b"3", None]))
    got = recover(tmp_path)
    assert got.store.data == {b"/a": b"1", b"/b": b"2", b"/c": b"3"}
    assert got.store.mod == {b"/a": 2, b"/b": 2, b"/c": 3} and got.store.seq == 3
    assert got.uuids == []


def test_a_compaction_writes_its_applied_uuids_a_piece_a_turn(tmp_path, monkeypatch):
    """The applied UUIDs go into the snapshot ``UUID_PIECE`` a step (a loop turn), each
    piece a ``uuids`` record, after the entries; one applied after the snapshot's
    sequence (in a generation copied later) is left out; recovery reads every piece back,
    oldest first."""
    from clonemap.shards.persist import compaction

    monkeypatch.setattr(compaction, "UUID_PIECE", 4)
    store, writer = Store(), DataDir(tmp_path, "always")
    writer.open(GEN, 0)
    applied = AppliedUuids()
    for i in range(10):
        uuid = b"%016d" % i
        seq = store.apply(b"/k%d" % i, b"v")
        applied.add(uuid, seq)
        writer.append(seq, b"/k%d" % i, b"v", None, uuid)
        if i == 5:
            applied.rotate()  # (two generations: the older one's entries first)
    writer.flush()
    older, newer = applied.generations()
    newer[b"late" * 4] = store.seq + 1  # (past the snapshot: not in it)
    job = writer.start_compaction(store, (older, newer))
    steps = 0
    while not job.step(keys=100):
        steps += 1
    assert steps == 2  # entries and the first piece, then a piece a turn: 4 + 4 + 2
    job.finish()
    writer.compacted(job)
    writer.close()
    [snap] = tmp_path.glob("snap-*.cms")
    scan = fmt.Scan(snap, fmt.SNAP_MAGIC, allow_torn=False)
    pieces = [obj["uuids"] for _, obj in scan.records()
              if isinstance(obj, dict) and "uuids" in obj]
    assert [len(p) // 2 for p in pieces] == [4, 4, 2]
    got = recover(tmp_path)
    assert got.uuids == [x for i in range(10) for x in (b"%016d" % i, i + 1)]
