"""Durability: each server logs what it applies and recovers it before binding its ports.

* ``clonemap.shards.persist.format``: the on-disk format (file names, headers, records);
* ``clonemap.shards.persist.recovery``: loading a data directory (``recover``);
* ``clonemap.shards.persist.writer``: ``DataDir``, the writer (segments, fsync policies,
  compaction, replacement by a peer's map, the Binary Star term file);
* ``python -m clonemap.shards.persist``: ``verify``, ``dump`` and ``backup`` of data directories.
"""
from clonemap.shards.persist.format import CorruptLog, VERSION
from clonemap.shards.persist.recovery import Recovered, fork_point, recover
from clonemap.shards.persist.writer import FSYNC_POLICIES, Compaction, DataDir

__all__ = ["CorruptLog", "VERSION", "Recovered", "fork_point", "recover", "FSYNC_POLICIES",
           "Compaction", "DataDir"]
