"""The cluster's routing and its epoch, durable in the supervisor's run directory.

On one host the run directory is the routing's source of truth: ``routing.json`` there
holds the routing the cluster follows (``ShardMap.describe()``, with its epoch), written
atomically and fsynced (``clonemap.shards.persist.format.replace_json``). ``supervisor
start`` settles it against the config (``settle``):

* no file: the config's routing is the cluster's first (epoch 1), and is written;
* a server's data directory (on this host) holds a newer routing than the file: that
  one is the cluster's (a change reached the servers and the supervisor stopped before
  it wrote the file), and the file is brought up to it;
* the config routes as the file does: the file's epoch is the cluster's (a cluster whose
  routing changed keeps its later epoch across restarts);
* the config routes otherwise, and the servers persist: the start is refused. Their data
  directories hold keys placed by the file's routing, and starting with another would
  leave keys on shards that no longer own them. The error names both routings;
* the config routes otherwise and nothing persists (every server starts empty): the
  config's routing becomes the next epoch.

Every server gets the settled routing (``--routing``), and each server with a data
directory keeps the newest routing it followed there too (``clonemap.shards.persist.routing``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.placement import Plan
from clonemap.shards.common.routing import ShardMap
from clonemap.shards.persist.format import replace_json

log = logging.getLogger(__name__)

ROUTING_FILE = "routing.json"


def read(run_dir: Path) -> ShardMap | None:
    """The routing ``run_dir`` holds, or None; ``ConfigError`` if it does not parse."""
    path = Path(run_dir) / ROUTING_FILE
    try:
        doc = json.loads(path.read_text())
        return ShardMap.from_description(doc["routing"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a routing file ({exc}); it records the cluster's "
                          "routing epoch: restore it, or remove it to start a new cluster",
                          field="routing") from None


def write(run_dir: Path, cluster: str, shard_map: ShardMap) -> None:
    replace_json(Path(run_dir) / ROUTING_FILE,
                 {"version": 1, "cluster": cluster, "routing": shard_map.describe()})


def _text(shard_map: ShardMap) -> str:
    pins = ", ".join(f"{p} -> {s}" for p, s in shard_map.pins.items()) or "no pins"
    return (f"epoch {shard_map.epoch}: {shard_map.shards} shard"
            f"{'' if shard_map.shards == 1 else 's'}, {pins}")


def newest_of_servers(run_dir: Path, plan: Plan) -> ShardMap | None:
    """The newest routing that this host's servers keep in their data directories
    (``<run-dir>/<data_dir>/*/routing``), or None. A server takes a new routing before
    the run directory does (a move's targets commit first), so after a crash in between
    it is the newer one."""
    from clonemap.shards.persist import CorruptLog
    from clonemap.shards.persist.routing import read_routing

    if plan.data_dir is None:
        return None
    newest = None
    base = Path(run_dir) / plan.data_dir
    for entry in sorted(base.iterdir()) if base.is_dir() else ():
        try:
            held = read_routing(entry)
        except (CorruptLog, OSError):
            continue  # the server itself reports it at its start
        if held is not None and (newest is None or held[1].epoch > newest.epoch):
            newest = held[1]
    return newest


def settle(run_dir: Path, plan: Plan) -> Plan:
    """``plan`` with the cluster's routing epoch (module doc), durable in ``run_dir``."""
    given = plan.routing.shard_map()
    held = read(run_dir)
    servers = newest_of_servers(run_dir, plan)
    if servers is not None and (held is None or servers.epoch > held.epoch):
        if held is not None:
            log.warning("routing: a server's data directory holds epoch %d, newer than the "
                        "run directory's %d (a change was cut short after it reached the "
                        "servers): the cluster is at epoch %d", servers.epoch, held.epoch,
                        servers.epoch)
        held = servers
        write(run_dir, plan.cluster, held)
    if held is None:
        chosen = given
    elif held == given:
        chosen = held
    elif plan.data_dir is not None:
        raise ConfigError(
            f"the config routes keys otherwise than the cluster in {run_dir} ("
            f"{_text(held)}; the config: {given.shards} shard"
            f"{'' if given.shards == 1 else 's'}, "
            + (", ".join(f"{p} -> {s}" for p, s in given.pins.items()) or "no pins")
            + "), and its servers persist keys placed by that routing. Start the "
            "config that cluster runs, or use another --run-dir (and data_dir) for a "
            "new cluster", field="routing")
    else:
        chosen = given.with_epoch(held.epoch + 1)
        log.info("routing: the config routes otherwise than the run directory's %s, and "
                 "no server persists: the config's routing is epoch %d", _text(held),
                 chosen.epoch)
    if held is None or chosen.epoch != held.epoch:
        write(run_dir, plan.cluster, chosen)
    return dataclasses.replace(plan, routing=dataclasses.replace(plan.routing,
                                                                 epoch=chosen.epoch))
