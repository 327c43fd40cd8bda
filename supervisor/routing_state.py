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

A change's flip is recorded first (``move.json``: the routing before and after, and the
data directories of each shard that takes keys), before any of those shards commits,
and removed once the run directory holds the new epoch. A start that finds it decides
(``_settle_move``): every such shard committed (one of its servers keeps the new epoch)
and the change goes forward, as above; some did and others did not (their copies died
with the supervisor that stopped, and the sources still hold every key, since they
forget only after the run directory took the new epoch), and the routing before the
change comes back as the epoch after it, so that the shards that committed forget what
they took, and nothing is lost.

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
MOVE_FILE = "move.json"


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


def write_move(run_dir: Path, before: ShardMap, after: ShardMap,
               targets: dict[int, list[str]]) -> None:
    """A change's flip begins: ``targets`` maps each shard that takes keys to its
    servers' data directory names (module doc)."""
    replace_json(Path(run_dir) / MOVE_FILE,
                 {"version": 1, "from": before.describe(), "to": after.describe(),
                  "targets": {str(t): names for t, names in targets.items()}})


def clear_move(run_dir: Path) -> None:
    (Path(run_dir) / MOVE_FILE).unlink(missing_ok=True)


def _epoch_in(data_dir: Path) -> int:
    from clonemap.shards.persist import CorruptLog
    from clonemap.shards.persist.routing import read_routing

    try:
        held = read_routing(data_dir)
    except (CorruptLog, OSError):
        return 0
    return held[1].epoch if held is not None else 0


def _settle_move(run_dir: Path, plan: Plan) -> None:
    """A flip the last supervisor began and did not record (module doc): forward when
    every target committed, else the routing before it back, one epoch later."""
    path = Path(run_dir) / MOVE_FILE
    try:
        doc = json.loads(path.read_text())
        before = ShardMap.from_description(doc["from"])
        after = ShardMap.from_description(doc["to"])
        targets = {int(t): list(names) for t, names in doc["targets"].items()}
    except FileNotFoundError:
        return
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a move record ({exc}); it says where a change of "
                          "the routing stopped: restore it", field="routing") from None
    held = read(run_dir)
    if held is not None and held.epoch >= after.epoch:
        clear_move(run_dir)  # the flip was recorded: nothing to decide
        return
    base = Path(run_dir) / (plan.data_dir or "data")
    took = {t: any(_epoch_in(base / name) >= after.epoch for name in names)
            for t, names in targets.items()}
    if any(took.values()) and not all(took.values()):
        back = before.with_epoch(after.epoch + 1)
        log.warning("routing: a change to %s stopped after shard%s %s took its keys and "
                    "before shard%s %s did: the routing before it is back as epoch %d, "
                    "and the shards that took keys forget them (every key is still on "
                    "its source)", _text(after), "" if sum(took.values()) == 1 else "s",
                    ", ".join(str(t) for t, ok in took.items() if ok),
                    "" if len(took) - sum(took.values()) == 1 else "s",
                    ", ".join(str(t) for t, ok in took.items() if not ok), back.epoch)
        write(run_dir, plan.cluster, back)
    clear_move(run_dir)


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
    _settle_move(run_dir, plan)
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
