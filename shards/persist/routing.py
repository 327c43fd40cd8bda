"""A server's routing in its data directory: the newest routing it followed, durable.

The file ``routing`` (``clonemap.shards.persist.format``) holds the routing
(``ShardMap.describe()``, with its epoch) and this server's shard index. It is written
before a server follows a routing (at start, and when a new one is installed while it
runs), so a restarted server never goes back to an older routing than one it served:

* no file, or an older epoch than the one given on the command line: the given routing
  is written and followed;
* a newer epoch than the one given (the cluster was resharded, and whoever restarted
  this server passed an older routing): the file's routing is followed, and the start
  is logged as such;
* the same epoch with another routing, or another shard index: the data directory
  belongs to another cluster or another shard: ``ConfigError``, the server does not start.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.routing import ShardMap
from clonemap.shards.persist import format as fmt
from clonemap.shards.persist.format import CorruptLog

log = logging.getLogger(__name__)


def read_routing(data_dir: str | Path) -> tuple[int, ShardMap] | None:
    """``(shard index, routing)`` from ``data_dir``, or None when it holds none."""
    path = Path(data_dir) / fmt.ROUTING_NAME
    try:
        doc = json.loads(path.read_text())
        index = doc["shard_index"]
        shard_map = ShardMap.from_description(doc["routing"])
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"shard_index {index!r}")
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError) as exc:
        raise CorruptLog(f"routing file does not parse ({exc})", path=str(path),
                         offset=0) from None
    return index, shard_map


def save_routing(data_dir: str | Path, shard_map: ShardMap, index: int) -> None:
    """Make ``shard_map`` (shard ``index``'s routing) durable in ``data_dir``."""
    fmt.replace_json(Path(data_dir) / fmt.ROUTING_NAME,
                     {"version": fmt.VERSION, "shard_index": index,
                      "routing": shard_map.describe()})


def settle(data_dir: str | Path, given: ShardMap, index: int) -> ShardMap:
    """The routing a server starting on ``data_dir`` follows, given ``given`` on its
    command line (module doc); it is durable in ``data_dir`` when this returns."""
    held = read_routing(data_dir)
    if held is not None:
        held_index, held_map = held
        if held_index != index:
            raise ConfigError(f"{data_dir} holds shard {held_index}'s data, not shard "
                              f"{index}'s (its routing file says so)", field="shard_index")
        if held_map.epoch > given.epoch:
            log.warning("routing: %s holds routing epoch %d (%d shards), newer than the "
                        "epoch %d given; following epoch %d", data_dir, held_map.epoch,
                        held_map.shards, given.epoch, held_map.epoch)
            return held_map
        if held_map.epoch == given.epoch:
            if held_map != given:
                raise ConfigError(
                    f"{data_dir} holds routing epoch {held_map.epoch} as "
                    f"{held_map.shards} shards (digest {held_map.digest()}), but the "
                    f"same epoch was given as {given.shards} shards (digest "
                    f"{given.digest()}): the data directory belongs to another cluster",
                    field="routing")
            return held_map
    save_routing(data_dir, given, index)
    return given
