"""The server's log (``shards.persist``) with real files: what is written comes back; a
crash at any byte offset recovers the state after a whole prefix of the records, never
an error or a mixed state; corruption in the middle is a clear error naming the offset.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from shards import persist
from shards.persist import CorruptLog, LogWriter, recover

KEYS = [b"/a", b"/b", b"/c/d", b"/e"]
ops = st.lists(st.tuples(st.sampled_from(KEYS),
                         st.one_of(st.just(b""), st.binary(min_size=1, max_size=40)),
                         st.one_of(st.none(), st.floats(1e9, 4e9, allow_nan=False))),
               min_size=0, max_size=25)


def write_log(tmp, history, policy="no") -> tuple[bytes, list[int]]:
    """Log ``history`` with sequences 1..n; the file's bytes and each record's end."""
    w = LogWriter(tmp, "g0123456789abcdef", fsync=policy)
    ends = []
    size = w.path.stat().st_size
    for seq, (key, value, expires) in enumerate(history, start=1):
        w.append(seq, key, value, expires)
        size += len(persist.encode_record(seq, key, value, expires))
        ends.append(size)
    w.close()
    return w.path.read_bytes(), ends


def state_after(history) -> dict:
    data = {}
    for key, value, expires in history:
        if value:
            data[key] = (value, expires)
        else:
            data.pop(key, None)
    return data


def state_of(store) -> dict:
    return {k: (v, store.expiry_of(k)) for k, v in store.items()}


def test_what_is_written_comes_back_with_its_sequence_and_ttl_instants(tmp_path):
    history = [(b"/a", b"1", None), (b"/b", b"2", 2e9), (b"/a", b"", None),
               (b"/c", b"3", 3.5e9)]
    write_log(tmp_path, history, policy="always")
    got = recover(tmp_path)
    assert got.generation == "g0123456789abcdef" and got.records == 4 and got.torn_bytes == 0
    assert state_of(got.store) == state_after(history) and got.store.seq == 4
    assert got.store.expiry_of(b"/b") == 2e9 and got.store.ttl_keys == 2


def test_no_log_is_an_empty_map(tmp_path):
    got = recover(tmp_path)
    assert got.records == 0 and len(got.store) == 0 and got.generation == ""


@settings(max_examples=120, deadline=None)
@given(history=ops, cut=st.floats(0, 1))
def test_a_crash_at_any_byte_recovers_exactly_the_whole_records(tmp_path_factory, history,
                                                                 cut):
    tmp = tmp_path_factory.mktemp("log")
    data, ends = write_log(tmp, history)
    offset = round(cut * len(data))
    (tmp / persist.LOG_NAME).write_bytes(data[:offset])
    got = recover(tmp)
    whole = sum(1 for e in ends if e <= offset)
    assert state_of(got.store) == state_after(history[:whole])
    assert got.store.seq == whole and got.records == whole
    # the torn tail is gone from the file: appending goes on after the last whole record
    header = len(persist.encode_header("g0123456789abcdef"))
    expected_size = ends[whole - 1] if whole else (header if offset >= header else 0)
    assert (tmp / persist.LOG_NAME).stat().st_size == expected_size


def test_a_corrupt_record_in_the_middle_names_the_file_and_offset(tmp_path):
    history = [(b"/a", b"1", None), (b"/b", b"2", None), (b"/c", b"3", None)]
    data, ends = write_log(tmp_path, history)
    bad = bytearray(data)
    bad[ends[0] + 10] ^= 0xFF  # inside the second record's payload
    (tmp_path / persist.LOG_NAME).write_bytes(bytes(bad))
    with pytest.raises(CorruptLog) as info:
        recover(tmp_path)
    assert info.value.offset == ends[0] and str(tmp_path) in str(info.value)
    assert "checksum" in str(info.value)


def test_a_file_that_is_not_a_log_is_refused(tmp_path):
    (tmp_path / persist.LOG_NAME).write_bytes(b"hello, this is not a clonemap log at all")
    with pytest.raises(CorruptLog, match="bad header"):
        recover(tmp_path)


def test_everysec_fsyncs_at_most_once_a_second_and_always_every_flush(tmp_path):
    now = [0.0]
    w = LogWriter(tmp_path / "e", "g", fsync="everysec", clock=lambda: now[0])
    base = w.fsyncs  # the header
    w.append(1, b"/a", b"1", None)
    w.flush()
    w.tick()
    assert w.fsyncs == base  # not a second yet
    now[0] = 1.0
    w.tick()
    assert w.fsyncs == base + 1
    w.tick()
    assert w.fsyncs == base + 1  # nothing new written
    w.close()
    a = LogWriter(tmp_path / "a", "g", fsync="always")
    base = a.fsyncs
    for i in range(3):
        a.append(i + 1, b"/k", b"v", None)
        a.flush()
    assert a.fsyncs == base + 3
    a.close()
    with pytest.raises(ValueError):
        LogWriter(tmp_path / "x", "g", fsync="sometimes")
    assert os.path.exists(tmp_path / "a" / persist.LOG_NAME)
