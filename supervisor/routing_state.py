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

**Across hosts** (a config with ``hosts:`` and ``coordination.etcd``) the routing's single
source of truth is one etcd key, ``clonemap/<cluster>/routing`` (``SharedRouting``): the
routing, its epoch and the config that set it. It only moves forward, by a
compare-and-swap on the key's revision, so of two supervisors that race, one wins and the
other reads the winner's. ``settle`` reads it first: an epoch newer than the run
directory's (the cluster changed while this host was away) becomes this host's, so the
config it starts must route as the cluster does (else the start is refused, naming the
config that set it); a run directory or server newer than etcd (a change stopped after
its flip reached this host and before etcd took it) moves etcd forward. Each host's
supervisor then follows the key (``Resharding.follow``), so every host serves the same
map within a heartbeat of a change. etcd unreachable at a start: the start is refused.
A change records itself under ``clonemap/<cluster>/move`` before it seals its holds, so
that another host's supervisor settles it should its own die (``Resharding``).
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
SHARED_TIMEOUT_S = 2.0
"""How long one etcd call of the shared routing may take."""
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


class SharedRouting:
    """The routing of a cluster over several hosts, in etcd (module doc)."""

    def __init__(self, url: str, cluster: str, timeout_s: float = SHARED_TIMEOUT_S):
        from clonemap.shards.coord import Etcd, parse_url

        self.url = url
        self.etcd = Etcd(parse_url(url), timeout_s)
        self.key = f"clonemap/{cluster}/routing".encode()
        self.cluster = cluster

    @classmethod
    def of(cls, plan: Plan) -> "SharedRouting | None":
        """The plan's shared routing: a config over several hosts with etcd; else None."""
        if not plan.hosts or plan.coordination is None:
            return None
        return cls(plan.coordination[0], plan.cluster)

    def read(self) -> tuple[ShardMap | None, str, int]:
        """(the routing etcd holds or None, the config that set it, the key's revision);
        ``CoordinationError`` when etcd does not answer, ``ConfigError`` if it does not parse."""
        raw, revision = self.etcd.get_revision(self.key)
        if raw is None:
            return None, "", 0
        try:
            doc = json.loads(raw)
            return ShardMap.from_description(doc["routing"]), doc.get("config", ""), revision
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"etcd {self.url}: {self.key.decode()} is not a routing "
                              f"({exc})", field="routing") from None

    def advance(self, shard_map: ShardMap, config: str = "") -> ShardMap:
        """Make ``shard_map`` the cluster's unless etcd holds a later epoch already; the
        routing etcd holds afterwards (a compare-and-swap, tried again when another
        supervisor changed the key in between)."""
        while True:
            held, _, revision = self.read()
            if held is not None and held.epoch >= shard_map.epoch:
                return held
            doc = {"version": 1, "cluster": self.cluster, "routing": shard_map.describe(),
                   "config": config}
            if self.etcd.put_if_revision(self.key, json.dumps(doc).encode(), revision):
                return shard_map


    def claim(self, who: str, ttl_s: float) -> tuple[int, str]:
        """Take the cluster's one change at a time: (lease, "") once this supervisor holds
        ``clonemap/<cluster>/change`` under a lease of ``ttl_s`` (kept by ``keep``, given
        back by ``release``), or (0, who holds it)."""
        lease, _ = self.etcd.grant(ttl_s)
        got, holder = self.etcd.put_if_absent(self._change_key, who.encode(), lease)
        if got:
            return lease, ""
        self.etcd.revoke(lease)
        return 0, holder.decode(errors="replace")

    def claimed(self) -> bool:
        """Whether a change is under way (a supervisor holds the claim)."""
        return self.etcd.get(self._change_key) is not None

    def keep(self, lease: int) -> bool:
        return self.etcd.keepalive(lease) > 0

    def release(self, lease: int) -> None:
        self.etcd.revoke(lease)

    @property
    def _change_key(self) -> bytes:
        return f"clonemap/{self.cluster}/change".encode()

    @property
    def _move_key(self) -> bytes:
        return f"clonemap/{self.cluster}/move".encode()

    def write_move(self, doc: dict, claim: int = 0) -> int:
        """A change is about to seal its holds (past that it completes or comes back
        only through a flip): its record, for whoever settles it should its supervisor
        die (``Resharding._settle_orphan``); the revision it was written at (to clear
        it by: ``clear_move``). ``claim``: written only while the change's claim is
        still held under that lease (one transaction): 0 when it lapsed, and another
        supervisor may have begun a change of its own."""
        value = json.dumps(doc).encode()
        if not claim:
            return self.etcd.put(self._move_key, value)
        return self.etcd.put_while_held(self._move_key, value, self._change_key, claim)

    def read_move(self) -> dict | None:
        return self.read_move_at()[0]

    def read_move_at(self) -> tuple[dict | None, int]:
        """The record of a change past its seal, if any, and the revision it was
        written at."""
        raw, revision = self.etcd.get_revision(self._move_key)
        try:
            return (json.loads(raw) if raw is not None else None), revision
        except ValueError:
            log.error("etcd %s: %s is not a move record; removed", self.url,
                      self._move_key.decode())
            self.clear_move(revision)
            return None, 0

    def clear_move(self, revision: int = 0) -> bool:
        """The record goes: only the one written (or read) at ``revision`` when that is
        given, so that a supervisor done with its own change, or with one it settled,
        never removes the record of a change begun since by another (its claim lapsed
        meanwhile). False: the key holds another record now, or none."""
        if not revision:
            self.etcd.delete(self._move_key)
            return True
        return self.etcd.delete_if_revision(self._move_key, revision)


def _settle_shared(run_dir: Path, plan: Plan, shared: SharedRouting) -> str:
    """etcd's routing, when newer than the run directory's, becomes this host's; the
    config that set etcd's routing ("" if none is named)."""
    from clonemap.shards.coord import CoordinationError

    try:
        held, config, _ = shared.read()
    except CoordinationError as exc:
        raise ConfigError(f"etcd {shared.url} did not answer ({exc}): a cluster over "
                          "several hosts keeps its routing epoch there; start etcd first",
                          field="coordination") from None
    mine = read(run_dir)
    if held is not None and (mine is None or held.epoch > mine.epoch):
        if mine is not None:
            log.warning("routing: etcd holds epoch %d, newer than this host's %d (set by "
                        "%s while this host was away): the cluster is at epoch %d",
                        held.epoch, mine.epoch, config or "a reshard", held.epoch)
        write(run_dir, plan.cluster, held)
    return config


def settle(run_dir: Path, plan: Plan, config: str = "") -> Plan:
    """``plan`` with the cluster's routing epoch (module doc), durable in ``run_dir``
    (and, across hosts, in etcd, with ``config``: the path of the config that routes so,
    which another host's supervisor plans to follow it)."""
    shared = SharedRouting.of(plan)
    if shared is None:
        return _settle_here(run_dir, plan)
    setter = _settle_shared(run_dir, plan, shared)
    try:
        settled = _settle_here(run_dir, plan)
    except ConfigError as exc:
        if not setter or setter == config:
            raise
        raise ConfigError(f"{exc}. The cluster's routing was set by {setter}",
                          field=exc.field) from None
    if shared is not None:
        chosen = settled.routing.shard_map()
        from clonemap.shards.coord import CoordinationError

        try:
            now = shared.advance(chosen, config)
        except CoordinationError as exc:
            raise ConfigError(f"etcd {shared.url} did not answer ({exc}): a cluster over "
                              "several hosts keeps its routing epoch there",
                              field="coordination") from None
        if now != chosen:  # another host's supervisor moved it on in between
            raise ConfigError(f"the cluster's routing changed while this host started "
                              f"(etcd: {_text(now)}; this host: {_text(chosen)}): start "
                              "again", field="routing")
        if now.epoch != chosen.epoch:  # the same routing, a later epoch: etcd's
            write(run_dir, plan.cluster, now)
            settled = dataclasses.replace(settled, routing=dataclasses.replace(
                settled.routing, epoch=now.epoch))
    return settled


def _settle_here(run_dir: Path, plan: Plan) -> Plan:
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
