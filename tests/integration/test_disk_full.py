"""A data directory on a real, nearly full filesystem (a tmpfs this module mounts).

``os.write`` on a nearly full tmpfs writes part of a record and returns a short count,
and only the next call raises ENOSPC. Before ``format.write_all`` the partial record
stayed in the log, the same record was written again after it, and recovery refused the
directory for good ("record checksum mismatch with more records after it"). Needs root
(CI runs as root); without it the module fails, it does not skip.
"""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from helpers import fill_disk
from clonemap.shards.persist import format as fmt
from clonemap.shards.persist.recovery import recover
from clonemap.shards.persist.writer import DataDir
from clonemap.shards.store import Store

TMPFS_BYTES = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted for the test, unmounted after it."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "clonemap-test",
                    str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_never_leaves_a_partial_record_and_the_batch_is_written_again(small_disk):
    data = small_disk / "data"
    store, writer = Store(), DataDir(data, "always")
    writer.open("g" * 16, store.seq)
    filler = fill_disk(small_disk, leave=64 << 10)
    value = os.urandom(3000)  # random: a record is not much smaller than its values
    written: list[bytes] = []
    failed_at = None
    for i in range(200):
        key = f"/k/{i}".encode()
        seq = store.apply(key, value, None)
        writer.append(seq, key, value, None)
        try:
            writer.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            failed_at, failed_key = seq, key
            break
        written.append(key)
    assert failed_at is not None, "the disk never filled"
    assert writer.pending, "the failed batch must stay buffered"
    assert writer.disk_error.startswith("ENOSPC")
    assert writer.counters["write_errors"] == 1
    # what is on disk is whole records only: nothing torn, every acknowledged update
    segment = writer.segment
    scan = fmt.Scan(segment, fmt.LOG_MAGIC, allow_torn=False)
    assert sum(1 for _ in scan.records()) == len(written)

    filler.unlink()  # space returns: the same batch goes out whole, once
    writer.flush()
    assert not writer.pending and writer.disk_error == ""
    writer.close()
    got = recover(data)
    assert got.torn_bytes == 0
    assert got.store.seq == failed_at
    assert sorted(k for k, _ in got.store.items()) == sorted(written + [failed_key])


def test_a_compaction_that_fills_the_disk_is_abandoned_and_its_file_removed(small_disk):
    data = small_disk / "data"
    store, writer = Store(), DataDir(data, "no")
    writer.open("g" * 16, store.seq)
    for i in range(120):
        key = f"/c/{i}".encode()
        value = os.urandom(2000)
        writer.append(store.apply(key, value, None), key, value, None)
    writer.flush()
    fill_disk(small_disk, leave=48 << 10)  # less than the snapshot needs
    with pytest.raises(OSError) as caught:
        job = writer.start_compaction(store)
        while not job.step():
            pass
    assert caught.value.errno == errno.ENOSPC
    writer.abort_compaction()
    writer.compaction_failed(caught.value)
    assert not any(p.name.endswith(fmt.TMP_SUFFIX) for p in data.iterdir())
    assert not writer.compaction_due(), "a failed compaction waits before the next try"
    assert writer.counters["compactions_failed"] == 1
    writer.close()
    assert len(recover(data).store) == 120
