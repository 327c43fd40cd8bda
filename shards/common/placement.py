"""Placement: resolve a validated config against a host into a plan, or say precisely why
it does not fit.

``plan(config, facts)`` is pure. It gives every server its shard, role, core set, NIC,
IPv4 address and ports P..P+3, and collects every problem into one ConfigError whose
lines read ``FIELD: given VALUE: PROBLEM; WHAT THE HOST HAS``:

- a core the host lacks (the host's usable cores are listed), a NIC the host lacks (its
  NICs are listed), a NIC without an IPv4 address, a ``host`` address no NIC holds;
- two servers whose port ranges overlap on one address (both named), a server range
  that holds the control port, a control address the host lacks.

(Shard count, port range, unknown fields and prefixes pinned twice are schema errors,
raised by ``clonemap.shards.common.config`` while loading.) ``check_ports_free(plan)`` is the one
check that touches the OS: it binds every port of every server and the control port.

``auto`` cores: each auto server gets one core from a pool, the host's usable cores that
no server names explicitly (all usable cores if fewer than two are left). Primaries take
the pool round-robin from its first core; backups continue where the primaries stopped
(one further when that would land each backup on its own primary's core), so on a 2-core
host each core carries as many primaries as backups. A server never lands on a core of
its own pair's partner while the pool has another. Deterministic: the same config and
host give the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.config import ROLES, ClusterConfig, Problems, load_config
from clonemap.shards.common.config_values import PORTS_PER_SERVER, endpoint_parts, format_cores
from clonemap.shards.common.endpoints import WILDCARD
from clonemap.shards.common.rights import ENFORCED, OPEN, Access
from clonemap.shards.common.hostfacts import HostFacts, local_host_facts, probe_port
from clonemap.shards.common.routing import FIRST_EPOCH, ShardMap

# What each of a server's ports P..P+3 carries.
PORT_NAMES = ("snapshot", "updates", "collector", "peer")


@dataclass(frozen=True)
class ServerPlan:
    """Where one CHP server runs."""

    shard: str
    index: int
    role: str
    cores: tuple[int, ...]
    cores_auto: bool
    nic: str
    address: str
    port: int
    io_threads: int = 1
    """libzmq I/O threads (``--io-threads``): subscribers' connections spread over them."""

    @property
    def name(self) -> str:
        return f"{self.shard}/{self.role}"

    @property
    def field(self) -> str:
        return f"shards[{self.index}].{self.role}"

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(range(self.port, self.port + PORTS_PER_SERVER))

    def endpoint(self, which: str = "snapshot") -> str:
        return f"tcp://{self.address}:{self.port + PORT_NAMES.index(which)}"

    def to_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "index": self.index, "role": self.role,
                "cores": list(self.cores), "cores_auto": self.cores_auto, "nic": self.nic,
                "address": self.address, "port": self.port, "ports": list(self.ports),
                "io_threads": self.io_threads,
                "endpoints": {n: self.endpoint(n) for n in PORT_NAMES}}


@dataclass(frozen=True)
class ShardPlan:
    index: int
    name: str
    prefixes: tuple[str, ...]
    primary: ServerPlan
    backup: ServerPlan

    @property
    def servers(self) -> tuple[ServerPlan, ServerPlan]:
        return (self.primary, self.backup)


@dataclass(frozen=True)
class RoutingParams:
    """What a router needs besides addresses: the shard count and each shard's pinned
    prefixes, in shard index order (see shards.common.routing)."""

    shard_count: int
    prefixes: tuple[tuple[str, ...], ...]
    epoch: int = FIRST_EPOCH
    """The routing's epoch (``clonemap.shards.common.routing``): the config gives the
    routing, the run directory its epoch (``clonemap.supervisor.routing_state``)."""

    def pins(self) -> dict[str, int]:
        """Pinned prefix -> shard index."""
        return {p: i for i, ps in enumerate(self.prefixes) for p in ps}

    def shard_map(self) -> ShardMap:
        """This routing as the function every party routes with."""
        return ShardMap(self.shard_count,
                        {i: list(ps) for i, ps in enumerate(self.prefixes) if ps},
                        epoch=self.epoch)

    def to_dict(self) -> dict[str, Any]:
        return {"shard_count": self.shard_count,
                "prefixes": [list(ps) for ps in self.prefixes], "epoch": self.epoch}


@dataclass(frozen=True)
class Plan:
    cluster: str
    control: str
    control_address: str
    control_port: int
    heartbeat_s: float
    silence_timeout_s: float
    shards: tuple[ShardPlan, ...]
    routing: RoutingParams
    host: HostFacts
    notes: tuple[str, ...] = ()
    data_dir: str | None = None
    """Where servers persist (relative: to the run directory); None: memory only."""
    fsync: str = "everysec"
    curve: bool = False
    keys_dir: str = ""
    control_limits: tuple[int, int, int] = (1 << 20, 64 << 20, 8 << 20)
    """The broker's (message, held, per-client held) byte budgets."""
    subscriber_held_bytes: int = 64 << 20
    """What one never-reading subscriber may pin in a server (``--subscriber-held-bytes``)."""
    writer_held_bytes: int = 64 << 20
    applied_uuids: tuple[int, float] = (16 << 20, 120.0)
    """Each server's table of applied UUIDs: bytes and seconds (``--dedup-bytes/-s``)."""
    metrics: tuple[str, int] | None = None
    """Where the supervisor serves Prometheus metrics (host, port), or None."""
    relays: tuple["ServerPlan", ...] = ()
    """Relays (role ``relay<j>``), shard by shard."""
    host_name: str | None = None
    """A cluster over several hosts: the host this plan is for (``--host NAME``)."""
    hosts: tuple[tuple[str, str], ...] = ()
    """Every host of such a cluster and its supervisor's control endpoint."""
    remote: frozenset[str] = frozenset()
    """Servers (``shard/role``) that another host's supervisor runs."""
    coordination: tuple[str, float, str] | None = None
    """(etcd URL, lease_s, replication) for the pairs across hosts."""
    across: frozenset[int] = frozenset()
    """Indexes of the shards whose two servers are on different hosts."""
    placed: tuple[tuple[str, str], ...] = ()
    """A cluster over several hosts: each pair server (``shard/role``) and its host's name."""
    access: Access = field(default=OPEN, compare=False)
    """The named client identities' rights (``security.clients`` and ``.roles``)."""

    def is_local(self, server: "ServerPlan") -> bool:
        """Whether this host's supervisor runs ``server`` (a relay: where its primary runs)."""
        if server.role.startswith("relay"):
            return f"{server.shard}/primary" not in self.remote
        return server.name not in self.remote
    """... one writer's queue, and a passive's pending table (``--writer-held-bytes``)."""

    @property
    def servers(self) -> list[ServerPlan]:
        return [s for shard in self.shards for s in shard.servers]

    def control_of(self, server: "ServerPlan") -> str:
        """The control endpoint of the supervisor that runs ``server`` (this one's, unless
        another host's runs it)."""
        if self.is_local(server):
            return self.control
        name = server.name if not server.role.startswith("relay") else f"{server.shard}/primary"
        host = dict(self.placed).get(name)
        return dict(self.hosts).get(host, self.control) if host else self.control

    def server(self, name: str) -> ServerPlan:
        """``"s1/backup"`` -> its ServerPlan (KeyError if there is none)."""
        for s in self.servers:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "control": self.control,
                "heartbeat_s": self.heartbeat_s, "silence_timeout_s": self.silence_timeout_s,
                "routing": self.routing.to_dict(),
                "data_dir": self.data_dir, "fsync": self.fsync,
                "metrics": None if self.metrics is None else "%s:%d" % self.metrics,
                "relays": [r.to_dict() for r in self.relays],
                "security": {"curve": self.curve, "keys_dir": self.keys_dir,
                             "identities": self.access.describe()},
                "shards": [{"index": sh.index, "name": sh.name,
                            "prefixes": list(sh.prefixes),
                            "primary": sh.primary.to_dict(),
                            "backup": sh.backup.to_dict()} for sh in self.shards],
                "host": self.host.to_dict(), "notes": list(self.notes),
                "host_name": self.host_name, "hosts": dict(self.hosts),
                "remote": sorted(self.remote),
                "coordination": None if self.coordination is None else dict(
                    zip(("url", "lease_s", "replication"), self.coordination)),
                "across": sorted(self.shards[i].name for i in self.across)}


# ---------------------------------------------------------------- plan

def _host_label(facts: HostFacts) -> str:
    return "this host" if facts.local else f"host {facts.source}"


def _given_port(config: ClusterConfig, index: int, role: str) -> str:
    if role.startswith("relay"):
        return f"(relays.port_base {relay_port_base(config)})"
    server = config.shards[index].server(role)
    if server.port_from_base:
        return f"{server.port} (from port_base {config.port_base})"
    return str(server.port)


def _resolve_address(field: str, server: Any, facts: HostFacts,
                     problems: Problems) -> tuple[str, str] | None:
    label = _host_label(facts)
    if server.nic is not None:
        if server.nic not in facts.nics:
            problems.add(f"{field}.nic", server.nic,
                         f"no NIC of that name on {label}; it has: {facts.describe_nics()}")
            return None
        addresses = facts.ipv4_of(server.nic)
        if not addresses:
            problems.add(f"{field}.nic", server.nic,
                         f"NIC {server.nic} has no IPv4 address; NICs with IPv4 on {label}: "
                         f"{facts.describe_nics(ipv4_only=True)}")
            return None
        return server.nic, addresses[0]
    nic = facts.nic_with(server.host)
    if nic is None:
        problems.add(f"{field}.host", server.host,
                     f"no NIC of {label} holds this address; its IPv4 addresses: "
                     f"{facts.describe_nics(ipv4_only=True)}")
        return None
    return nic, server.host


def _check_cores(field: str, cores: tuple[int, ...], facts: HostFacts,
                 problems: Problems) -> None:
    missing = [c for c in cores if c not in facts.cores]
    if missing:
        which = (f"core {missing[0]} is" if len(missing) == 1
                 else f"cores {format_cores(tuple(missing))} are")
        problems.add(f"{field}.cores", list(cores),
                     f"{which} not usable on {_host_label(facts)}; "
                     f"it has cores {facts.describe_cores()}")


def _auto_cores(config: ClusterConfig, usable: tuple[int, ...]) -> dict[tuple[int, str], int]:
    """(shard index, role) -> core for every ``auto`` server (see the module docstring)."""
    explicit = {(i, role): shard.server(role).cores
                for i, shard in enumerate(config.shards) for role in ROLES
                if shard.server(role).cores != "auto"}
    claimed = {c for cores in explicit.values() for c in cores}
    unclaimed = [c for c in usable if c not in claimed]
    pool = unclaimed if len(unclaimed) >= min(2, len(usable)) else list(usable)
    n = len(pool)

    def pick(position: int, avoid: tuple[int, ...]) -> int:
        for step in range(n):
            core = pool[(position + step) % n]
            if core not in avoid:
                return core
        return pool[position % n]

    chosen: dict[tuple[int, str], int] = {}
    primaries = [i for i, sh in enumerate(config.shards) if sh.primary.cores == "auto"]
    for j, i in enumerate(primaries):
        chosen[(i, "primary")] = pick(j, explicit.get((i, "backup"), ()))
    m = len(primaries)
    shift = 1 if n > 1 and m % n == 0 else 0
    backups = [i for i, sh in enumerate(config.shards) if sh.backup.cores == "auto"]
    for j, i in enumerate(backups):
        partner = explicit.get((i, "primary")) or (chosen[(i, "primary")],)
        chosen[(i, "backup")] = pick(m + j + shift, partner)
    return chosen


def _check_ports(config: ClusterConfig, servers: list[ServerPlan], problems: Problems) -> None:
    width = PORTS_PER_SERVER - 1
    by_address: dict[str, list[ServerPlan]] = {}
    for s in servers:
        by_address.setdefault(s.address, []).append(s)
    order = {(s.index, s.role): k for k, s in enumerate(servers)}
    for address, group in by_address.items():
        group.sort(key=lambda s: (s.port, order[(s.index, s.role)]))
        for a, first in enumerate(group):
            for second in group[a + 1:]:
                if second.port > first.port + width:
                    break
                early, late = sorted((first, second), key=lambda s: order[(s.index, s.role)])
                problems.add(f"{late.field}.port", _given_port(config, late.index, late.role),
                             f"ports {late.port}-{late.port + width} of {late.name} overlap "
                             f"ports {early.port}-{early.port + width} of {early.name} "
                             f"({early.field}.port) on {address}; a server uses "
                             f"port..port+{width}, so port bases on one address must be at "
                             f"least {PORTS_PER_SERVER} apart", raw_given=True)
    control_address, control_port = config.control_address, config.control_port
    for s in servers:
        if s.port <= control_port <= s.port + width and (
                control_address in (WILDCARD, s.address)):
            problems.add(f"{s.field}.port", _given_port(config, s.index, s.role),
                         f"ports {s.port}-{s.port + width} of {s.name} include the control "
                         f"port {control_port} (control: {config.control}); move the server "
                         "or the control endpoint", raw_given=True)


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("localhost", "::1")


RELAY_PORT_STRIDE = 4
RELAY_PORT_OFFSET = 1000


def relay_port_base(config: ClusterConfig) -> int:
    return config.relays.port_base or config.port_base + RELAY_PORT_OFFSET


def _relay_plans(config: ClusterConfig, shard_plans: list, facts: HostFacts,
                 problems: Problems) -> list[ServerPlan]:
    """Relay j of shard i: ``relays.port_base + 4 * (i * per_shard + j)``, on
    ``relays.host`` (default the shard's primary's address), role ``relay<j>``."""
    relays = config.relays
    out = []
    if relays.cores is not None:
        _check_cores("relays.cores", relays.cores, facts, problems)
    cores = tuple(relays.cores) if relays.cores is not None else tuple(facts.cores)
    base = relay_port_base(config)
    names = [sh.name for sh in shard_plans]
    for name in relays.shards or ():
        if name not in names:
            problems.add("relays.shards", name, f"no shard {name!r}; shards: "
                         f"{', '.join(names)}")
    for sh in shard_plans:
        if relays.shards is not None and sh.name not in relays.shards:
            continue
        for j in range(relays.per_shard):
            port = base + RELAY_PORT_STRIDE * (sh.index * relays.per_shard + j)
            if port > 65532:
                problems.add("relays.port_base", base, f"relay {j} of {sh.name} would bind "
                             f"port {port}: out of range; lower relays.port_base")
                continue
            out.append(ServerPlan(shard=sh.name, index=sh.index, role=f"relay{j}",
                                  cores=cores, cores_auto=relays.cores is None,
                                  nic=sh.primary.nic, address=relays.host or sh.primary.address,
                                  port=port, io_threads=relays.io_threads))
    return out


def plan(config: ClusterConfig, facts: HostFacts, *, source: str = "",
         host: str | None = None) -> Plan:
    """Resolve ``config`` on the host ``facts`` describes; ConfigError lists every misfit.

    ``source`` (the config's path) prefixes each error line. A config with ``hosts``
    needs ``host``, the name of the host this plan is for: only its servers are checked
    against ``facts`` (the others are checked by their own host's supervisor) and its
    control endpoint is the plan's."""
    problems = Problems(prefix=f"{source}: " if source else "")
    label = _host_label(facts)
    control = config.control
    metrics = config.metrics_address
    if config.hosts is not None:
        if host is None or host not in config.hosts:
            raise ConfigError(
                f"{source + ': ' if source else ''}hosts: this config runs on "
                f"{len(config.hosts)} hosts ({', '.join(sorted(config.hosts))}): "
                + ("say which one this is with --host NAME" if host is None else
                   f"{host!r} is not one of them"), field="hosts")
        entry = config.hosts[host]
        control = entry.control
        metrics = None
        if entry.metrics is not None:
            m_host, _, m_port = entry.metrics.rpartition(":")
            metrics = (m_host, int(m_port))
    elif host is not None:
        raise ConfigError(f"{source + ': ' if source else ''}--host {host}: this config "
                          "names no hosts (add hosts: to run it on several)", field="hosts")
    control_address = endpoint_parts(control)[0]
    if control_address != WILDCARD and facts.nic_with(control_address) is None:
        problems.add("control" if config.hosts is None else f"hosts.{host}.control",
                     control, f"no NIC of {label} holds address {control_address}; its "
                              f"IPv4 addresses: {facts.describe_nics(ipv4_only=True)}")
    remote = frozenset(f"{shard.name}/{role}" for shard in config.shards for role in ROLES
                       if config.hosts is not None and shard.server(role).at != host)
    auto = _auto_cores(config, facts.cores)
    servers: list[ServerPlan] = []
    shard_plans: list[ShardPlan] = []
    notes: list[str] = []
    for i, shard in enumerate(config.shards):
        pair: dict[str, ServerPlan] = {}
        for role in ROLES:
            server = shard.server(role)
            if f"{shard.name}/{role}" in remote:  # its own host's supervisor checks it
                cores = () if server.cores == "auto" else server.cores
                pair[role] = ServerPlan(shard=shard.name, index=i, role=role, cores=cores,
                                        cores_auto=server.cores == "auto", nic="",
                                        address=server.host, port=server.port,
                                        io_threads=server.io_threads)
                continue
            if server.cores != "auto":
                _check_cores(f"shards[{i}].{role}", server.cores, facts, problems)
            resolved = _resolve_address(f"shards[{i}].{role}", server, facts, problems)
            nic, address = resolved if resolved else ("?", "?")
            is_auto = server.cores == "auto"
            cores = (auto[(i, role)],) if is_auto else server.cores
            pair[role] = ServerPlan(shard=shard.name, index=i, role=role, cores=cores,
                                    cores_auto=is_auto, nic=nic, address=address,
                                    port=server.port, io_threads=server.io_threads)
            if resolved:
                servers.append(pair[role])
        shared = set(pair["primary"].cores) & set(pair["backup"].cores)
        if shared:
            notes.append(f"shard {shard.name}: primary and backup share core(s) "
                         f"{format_cores(tuple(sorted(shared)))}")
        shard_plans.append(ShardPlan(index=i, name=shard.name, prefixes=tuple(shard.prefixes),
                                     primary=pair["primary"], backup=pair["backup"]))
    relay_plans = [r for r in _relay_plans(config, shard_plans, facts, problems)
                   if f"{r.shard}/primary" not in remote]
    _check_ports(config, servers + relay_plans, problems)
    problems.raise_if_any()
    if not config.security.curve:
        exposed = sorted({s.address for s in servers if not _loopback(s.address)}
                         | ({control_address}
                            if not _loopback(control_address) else set()))
        if exposed:
            notes.append(f"warning: servers or the control plane bind {', '.join(exposed)} "
                         "(not loopback) with security.curve off: anyone who can reach "
                         "them can read and write the map and use the control commands; "
                         "set security: {curve: true} (see the README's Security)")
    if config.security.clients:
        notes.append(ENFORCED)
    routing = RoutingParams(shard_count=len(shard_plans),
                            prefixes=tuple(sh.prefixes for sh in shard_plans))
    coordination = None
    if config.coordination is not None:
        c = config.coordination
        coordination = (c.url, c.lease_s, c.replication)
    return Plan(cluster=config.cluster, control=control,
                control_address=control_address, control_port=endpoint_parts(control)[1],
                heartbeat_s=config.heartbeat_s, silence_timeout_s=config.silence_timeout_s,
                shards=tuple(shard_plans), routing=routing, host=facts, notes=tuple(notes),
                data_dir=config.data_dir, fsync=config.fsync,
                curve=config.security.curve, keys_dir=str(config.keys_dir),
                control_limits=(config.limits.control_message_bytes,
                                config.limits.control_held_bytes,
                                config.limits.control_client_held_bytes),
                subscriber_held_bytes=config.limits.subscriber_held_bytes,
                writer_held_bytes=config.limits.writer_held_bytes,
                applied_uuids=(config.limits.applied_uuid_bytes,
                               config.limits.applied_uuid_s),
                metrics=metrics, relays=tuple(relay_plans), host_name=host,
                hosts=tuple((name, h.control) for name, h in (config.hosts or {}).items()),
                remote=remote, coordination=coordination, access=config.security.access(),
                across=frozenset(i for i in range(len(config.shards))
                                 if config.pair_across_hosts(i)),
                placed=tuple((f"{shard.name}/{role}", shard.server(role).at)
                             for shard in config.shards for role in ROLES
                             if config.hosts is not None))


# ---------------------------------------------------------------- the OS check

def check_ports_free(the_plan: Plan, *, source: str = "",
                     probe: Callable[[str, int], str | None] = probe_port) -> None:
    """Bind-test the control port and P..P+3 of every server; ConfigError names each
    server and port that cannot be bound. Only meaningful for facts of this host."""
    problems = Problems(prefix=f"{source}: " if source else "")
    reason = probe(the_plan.control_address, the_plan.control_port)
    if reason:
        problems.add("control", the_plan.control,
                     f"control port {the_plan.control_port} cannot be bound on "
                     f"{the_plan.control_address}: {reason}")
    if the_plan.metrics is not None:
        host, port = the_plan.metrics
        reason = probe(host, port)
        if reason:
            problems.add("metrics", f"{host}:{port}",
                         f"metrics port {port} cannot be bound on {host}: {reason}; pick "
                         "another (metrics: HOST:PORT) or turn it off (metrics: off)")
    for s in list(the_plan.servers) + list(the_plan.relays):
        if not the_plan.is_local(s):
            continue
        for port, what in zip(s.ports, PORT_NAMES):
            reason = probe(s.address, port)
            if reason:
                problems.add(f"{s.field}.port", s.port,
                             f"port {port} of {s.name} ({what}, P+{port - s.port}) cannot "
                             f"be bound on {s.address}: {reason}; stop what holds it or "
                             "pick another port")
    problems.raise_if_any()


def load_plan(path: str | Path, facts: HostFacts | None = None, host: str | None = None
              ) -> Plan:
    """Load a config file and plan it on ``facts`` (this host when None) for ``host`` (a
    config with ``hosts``); no port probe."""
    return plan(load_config(path), facts if facts is not None else local_host_facts(),
                source=str(path), host=host)


__all__ = ["PORT_NAMES", "ServerPlan", "ShardPlan", "RoutingParams", "Plan", "plan",
           "check_ports_free", "load_plan", "ConfigError"]
