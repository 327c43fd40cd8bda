"""Durability: each server logs what it applies and recovers it before binding its ports.

* ``shards.persist.format``: the on-disk format (file names, headers, records);
* ``shards.persist.recovery``: loading a data directory (``recover``);
* ``shards.persist.writer``: ``DataDir``, the writer (segments, fsync policies,
  compaction, replacement by a peer's map, the Binary Star term file);
* ``python -m shards.persist``: ``verify``, ``dump`` and ``backup`` of data directories.
"""
from shards.persist.format import CorruptLog, VERSION
from shards.persist.recovery import Recovered, fork_point, recover
from shards.persist.writer import FSYNC_POLICIES, Compaction, DataDir

__all__ = ["CorruptLog", "VERSION", "Recovered", "fork_point", "recover", "FSYNC_POLICIES",
           "Compaction", "DataDir"]
