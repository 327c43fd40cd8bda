"""The cluster a client routes over: shards, their servers, and the routing function.

A ``Cluster`` is what ``AsyncClone`` needs to route: a ``clonemap.shards.common.routing.ShardMap`` (who
owns a key, which shards a subtree fans out to) and, per shard index, its name and its
servers in failover order (a Binary Star pair: primary, backup). Four ways to get one::

    Cluster.from_servers("tcp://h:6000")                 one shard (one server or a pair)
    Cluster.from_pairs([[p0, b0], [p1, b1], ...])         N shards, hashed (no pins)
    Cluster.from_config("configs/4shard.yaml")            the supervisor's plan, read locally
    await fetch_cluster("tcp://h:5555")                   MDP ``cluster.map`` from a supervisor

The last two read the same document (``clonemap.shards.common.cluster.cluster_map``): routing
parameters (``ShardMap.describe``), shard names, pinned prefixes, and each server's
address and base port P. A server bound to a wildcard address ("0.0.0.0", "*") is reached
on the host the map came from (the control endpoint's host, or 127.0.0.1 for a file).

Pure except ``from_config`` (reads a file) and ``fetch_cluster`` (one MDP request).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import zmq

from clonemap.shards.common.endpoints import LOOPBACK, reachable
from clonemap.shards.common.errors import (CONFIG_MODULES, ConfigError, ProtocolError,
                                          require_extra)
from clonemap.shards.common.routing import ShardMap
from clonemap.client.collector import ServerAddress, parse_server
from clonemap.client.options import CONTROL_TIMEOUT_S

if TYPE_CHECKING:
    from clonemap.shards.common.security import Security

CLUSTER_MAP_SERVICE = "cluster.map"
WHOAMI_SERVICE = "cluster.whoami"
_HOST_RE = re.compile(r"tcp://(\[[^\]]+\]|[^:/]+):\d+")


@dataclass(frozen=True)
class ShardSpec:
    """One shard: its index in the routing function, its name, its servers."""

    index: int
    name: str
    servers: tuple[ServerAddress, ...]
    relays: tuple[ServerAddress, ...] = ()
    """The shard's relays (``clonemap.shards.relay``), if the cluster runs any."""


@dataclass(frozen=True)
class Cluster:
    shard_map: ShardMap
    shards: tuple[ShardSpec, ...]
    heartbeat_s: float | None = None
    silence_timeout_s: float | None = None
    source: str = ""
    curve: bool = False
    """The servers use CURVE (``security.curve`` in the config)."""
    keys_dir: str | None = None
    """Where the config keeps the cluster's keys (a path on the supervisor's host)."""
    control: str | None = None
    """The supervisor's control endpoint, as the map names it (None: not given)."""

    def __post_init__(self):
        if len(self.shards) != self.shard_map.shards:
            raise ConfigError(f"{self.source or 'cluster'}: {len(self.shards)} shards listed "
                              f"but the routing function has {self.shard_map.shards}",
                              field="shards")
        for i, shard in enumerate(self.shards):
            if shard.index != i:
                raise ConfigError(f"shard {shard.name!r} has index {shard.index}, "
                                  f"expected {i}", field=f"shards[{i}].index")
            if not shard.servers:
                raise ConfigError(f"shard {shard.name!r} has no server",
                                  field=f"shards[{i}]")

    def shard(self, which: "str | int") -> ShardSpec:
        """A shard by name or by index (``"s1"``, ``1`` or ``"1"``); KeyError if none."""
        for shard in self.shards:
            if shard.name == str(which):
                return shard
        if isinstance(which, int) or str(which).isdigit():
            i = int(which)
            if 0 <= i < len(self.shards):
                return self.shards[i]
        raise KeyError(which)

    def shards_for(self, subtree: "str | bytes") -> list[ShardSpec]:
        """The shards that can own a key under ``subtree`` (the ICANHAZ fan-out)."""
        return [self.shards[i] for i in self.shard_map.owners_of_subtree(subtree)]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_servers(cls, servers) -> "Cluster":
        """One shard served by ``servers`` (one address, or a pair in failover order)."""
        return cls.from_pairs([servers], source="servers")

    @classmethod
    def from_pairs(cls, pairs: Sequence, *, source: str = "shards") -> "Cluster":
        """Shard i served by ``pairs[i]`` (an address or a sequence of them), hashed."""
        if isinstance(pairs, (str, ServerAddress)) or not pairs:
            raise ValueError("shards: give a list with one entry per shard, each a server "
                             "address or a [primary, backup] pair")
        specs = []
        for i, entry in enumerate(pairs):
            if isinstance(entry, (str, ServerAddress)):
                entry = [entry]
            servers = tuple(parse_server(s) for s in entry)
            if not servers:
                raise ValueError(f"shards[{i}]: no server address")
            specs.append(ShardSpec(i, f"s{i}", servers))
        return cls(ShardMap(len(specs)), tuple(specs), source=source)

    @classmethod
    def from_map(cls, doc: Mapping[str, Any], *, host: str = LOOPBACK,
                 source: str = "cluster map") -> "Cluster":
        """From a ``cluster.map`` document; ``host`` replaces wildcard bind addresses."""
        try:
            shard_map = ShardMap.from_description(doc["routing"])
            specs = []
            for i, sh in enumerate(doc["shards"]):
                servers = []
                for role in ("primary", "backup"):
                    server = sh.get(role)
                    if not server:
                        continue
                    address = reachable(str(server["address"]), host)
                    servers.append(ServerAddress(address, int(server["port"])))
                relays = tuple(ServerAddress(reachable(str(r["address"]), host),
                                             int(r["port"])) for r in sh.get("relays") or ())
                specs.append(ShardSpec(int(sh.get("index", i)), str(sh["name"]),
                                       tuple(servers), relays))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{source}: not a cluster map ({type(exc).__name__}: {exc})",
                              field="cluster map") from None
        security = doc.get("security") if isinstance(doc.get("security"), Mapping) else {}
        return cls(shard_map, tuple(specs), heartbeat_s=_seconds(doc.get("heartbeat_s")),
                   silence_timeout_s=_seconds(doc.get("silence_timeout_s")), source=source,
                   curve=bool(security.get("curve")),
                   keys_dir=security.get("keys_dir") or None,
                   control=_control_of(doc.get("control"), host))

    @classmethod
    def from_config(cls, path) -> "Cluster":
        """Plan the supervisor config at ``path`` on this host and read its cluster map
        (the same document the supervisor serves; raises ``ConfigError``, and
        ``MissingExtra`` where the ``config`` extra is not installed)."""
        require_extra("reading a cluster config", "config", CONFIG_MODULES)
        from clonemap.shards.common.cluster import cluster_map
        from clonemap.shards.common.placement import load_plan

        return cls.from_map(cluster_map(load_plan(path)), source=str(path))


def _control_of(value: Any, host: str) -> str | None:
    """A map's control endpoint, with a wildcard host made reachable."""
    if not isinstance(value, str) or not value.startswith("tcp://"):
        return None
    return value.replace("tcp://*:", f"tcp://{host}:").replace("tcp://0.0.0.0:",
                                                               f"tcp://{host}:")


async def fetch_rights(endpoint: str, *, timeout_s: float = CONTROL_TIMEOUT_S,
                       security=None) -> dict:
    """``cluster.whoami``: the presented identity's rights as the cluster sees them
    (identity, role, read, write, deny, admin, rights, enforced)."""
    import json

    from clonemap.shards.common.mdp.client import MdpClient

    endpoint = endpoint.replace("tcp://*:", "tcp://127.0.0.1:")
    async with MdpClient(endpoint, timeout_s=timeout_s, retries=1,
                         security=security) as mdp:
        frames = await mdp.request(WHOAMI_SERVICE)
    if len(frames) < 2 or frames[0] != b"200":
        text = b" ".join(frames).decode("utf-8", "replace")
        raise ConfigError(f"{endpoint}: cluster.whoami answered {text!r} (a supervisor "
                          "older than access control?)", field="control")
    return json.loads(frames[1])


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def control_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint (127.0.0.1 for a wildcard)."""
    m = _HOST_RE.match(endpoint)
    return reachable(m.group(1) if m else LOOPBACK)


def parse_map_reply(frames: list[bytes], endpoint: str) -> dict:
    """The FINAL body of ``cluster.map``: status ``200`` then the JSON document."""
    if len(frames) < 2 or frames[0] != b"200":
        status = frames[0].decode("utf-8", "replace") if frames else "(empty)"
        text = frames[1].decode("utf-8", "replace") if len(frames) > 1 else ""
        raise ProtocolError(f"{CLUSTER_MAP_SERVICE} at {endpoint} answered {status} {text}",
                            reason="bad_cluster_map")
    try:
        return json.loads(frames[1])
    except ValueError as exc:
        raise ProtocolError(f"{CLUSTER_MAP_SERVICE} at {endpoint}: not JSON ({exc})",
                            reason="bad_cluster_map") from None


async def fetch_cluster(endpoint: str, *, ctx: zmq.Context | None = None,
                        timeout_s: float = CONTROL_TIMEOUT_S, retries: int = 1,
                        security=None) -> Cluster:
    """Ask the supervisor at ``endpoint`` for ``cluster.map`` (MDP/0.2). Raises
    ``clonemap.shards.common.errors.Timeout`` when nobody answers within the deadline (per attempt)."""
    from clonemap.shards.common.mdp.client import MdpClient

    endpoint = endpoint.replace("tcp://*:", "tcp://127.0.0.1:")
    async with MdpClient(endpoint, ctx=ctx, timeout_s=timeout_s, retries=retries,
                         security=security) as mdp:
        frames = await mdp.request(CLUSTER_MAP_SERVICE)
    return Cluster.from_map(parse_map_reply(frames, endpoint), host=control_host(endpoint),
                            source=endpoint)


async def discover(control: "str | Sequence[str]", *, timeout_s: float,
                   keys_dir=None, identity: str | None = None,
                   security: "Security | None" = None) -> Cluster:
    """The cluster map from the first of ``control``'s supervisors that answers (a list,
    or a comma-separated string: one per host of a cluster over several hosts, each
    serving the same map). ``Timeout`` naming each endpoint's failure when none does.
    The request runs on a context of its own: a client's context may still be waiting
    for its ``io_threads`` to be set, which must happen before its first socket.
    ``security``: the keys of a client that already routes (a config's CURVE keys
    included); else those ``keys_dir`` and ``identity`` name."""
    from clonemap.shards.common.errors import Timeout
    from clonemap.shards.common.security import client_keys

    endpoints = ([e.strip() for e in control.split(",") if e.strip()]
                 if isinstance(control, str) else list(control))
    if security is None:
        security = client_keys(keys_dir, identity=identity)
    failures = []
    ctx = zmq.Context()
    try:
        for endpoint in endpoints:  # one host's supervisor may be down: the next
            try:
                return await fetch_cluster(endpoint, ctx=ctx, timeout_s=timeout_s,
                                           retries=0 if len(endpoints) > 1 else 1,
                                           security=security)
            except Timeout as exc:
                failures.append(f"{endpoint}: {exc}")
    finally:
        ctx.destroy(linger=0)
    raise Timeout("no supervisor answered with the cluster map: " + "; ".join(failures),
                  what="cluster map", deadline_s=timeout_s)
