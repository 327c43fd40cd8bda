"""Cluster configuration: the YAML schema, its defaults, and precise errors.

A config names the cluster, its control endpoint and timeouts, and its shards. Each shard
is a Binary Star pair (``primary`` and ``backup``); each server has a port base P (it
uses P..P+3), an address (``host``: an IPv4 address, or ``nic``: an interface whose
IPv4 address is bound) and a core set (``cores``: ``[2, 3]``, ``"2-3,6"``, ``5`` or
``auto``). The shortest config is ``shards: N``; everything else has a default:

    field               default                          notes
    cluster             "clonemap"                       letters, digits, _ . -
    control             "tcp://127.0.0.1:5555"           tcp://IPV4:PORT or tcp://*:PORT
    metrics             "127.0.0.1:9464"                 Prometheus /metrics; off: none
    heartbeat_s         1.0                              > 0
    silence_timeout_s   3 x heartbeat_s                  > heartbeat_s
    port_base           6000                             shard i: primary port_base+20*i,
                                                          backup port_base+20*i+10
    defaults.host/nic   host 127.0.0.1                   for every server lacking both
    defaults.cores      auto
    defaults.io_threads 1                                a server's I/O threads (1..64)
    shards              (required)                       a count >= 1, or a list of shards
    shards[i].name      "s<i>"                           unique
    shards[i].prefixes  []                               pinned key prefixes, each on one shard
    shards[i].primary / .backup: host | nic, port, cores, io_threads (each falls back as above)
    data_dir            "data"                           where servers persist: each in
                                                          <data_dir>/<shard>-<role>/;
                                                          relative to the run directory;
                                                          null: memory only
    fsync               everysec                         always | everysec | no
    relays.per_shard    0                                relays per shard (shards.relay)
    relays.port_base    port_base + 1000                 relay j of shard i: +4*(i*N+j)
    relays.host/cores   the primary's address / every core; relays.io_threads 1
    relays.shards       every shard                      names of the shards with relays
    security.curve      false                            CURVE on every socket
    security.keys_dir   "keys" beside the config file    the cluster's key pairs
    security.clients    {}                               named identities: NAME: {role: R}
    security.roles      {}                               R: {read, write, deny, admin}
    limits.control_message_bytes      1 MiB    the broker's largest frame and message
    limits.control_held_bytes         64 MiB   request bytes the broker holds, in all
    limits.control_client_held_bytes  8 MiB    ... for one client
    limits.subscriber_held_bytes      64 MiB   what one never-reading subscriber may
                                               pin in a server (0: count messages only)
    limits.writer_held_bytes          64 MiB   ... one writer's queued KVSETs, and a
                                               passive's pending table
    limits.applied_uuid_bytes         16 MiB   each server's table of applied UUIDs
    limits.applied_uuid_s             120      ... and its age (exactly-once resends)

Every model forbids unknown fields. ``load_config`` turns YAML and pydantic errors into
one ``ConfigError`` whose lines read ``FIELD: given VALUE: PROBLEM; EXPECTED``, with
the field as a path such as ``shards[1].backup.cores``. Checks that need the host (cores,
NICs, addresses, ports) live in ``clonemap.shards.common.placement``.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, PrivateAttr,
                      ValidationError, field_validator, model_validator)

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common import timing
from clonemap.shards.common.rights import NAME_RE, RESERVED, Access, Rights
from clonemap.shards.common.endpoints import DEFAULT_CONTROL
from clonemap.shards.common.timing import HEARTBEAT_S as DEFAULT_HEARTBEAT_S, SILENCE_HEARTBEATS
from clonemap.shards.common.config_values import (DEFAULT_METRICS, MAX_PORT_BASE, PORTS_PER_SERVER, Cores,
                                         Endpoint, Host, IoThreads, Metrics, Name, Nic,
                                         OptSeconds, Port, Prefix, Seconds, endpoint_parts,
                                         format_given, parse_etcd_endpoint, parse_name,
                                         parse_port)

DEFAULT_CLUSTER = "clonemap"
DEFAULT_PORT_BASE = 6000
SHARD_PORT_STRIDE = 20
BACKUP_PORT_OFFSET = 10
DEFAULT_HOST = "127.0.0.1"
DEFAULT_DATA_DIR = "data"
ROLES = ("primary", "backup")


# ---------------------------------------------------------------- problems and messages

def field_path(loc: tuple) -> str:
    """``("shards", 1, "backup", "cores")`` -> ``shards[1].backup.cores``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class Problems:
    """Collects ``FIELD: given VALUE: PROBLEM`` lines; ``raise_if_any`` raises one
    ConfigError holding them all (its ``field`` is the first one's)."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.lines: list[str] = []
        self.fields: list[str] = []

    def add(self, field: str, given: Any, text: str, *, raw_given: bool = False) -> None:
        shown = given if raw_given else format_given(given)
        self.fields.append(field)
        self.lines.append(f"{field}: given {shown}: {text}")

    def add_line(self, field: str, line: str) -> None:
        self.fields.append(field)
        self.lines.append(line)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def raise_if_any(self) -> None:
        if self.lines:
            text = "\n".join(self.prefix + line for line in self.lines)
            raise ConfigError(text, field=self.fields[0])


# ---------------------------------------------------------------- models

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_one_address(model: Any) -> Any:
    if model.host is not None and model.nic is not None:
        raise ValueError("both host and nic are set; give one: host (an IPv4 address) "
                         "or nic (an interface whose IPv4 address is bound)")
    return model


class Defaults(_Model):
    """Settings every server takes unless it sets its own."""

    host: Host = None
    nic: Nic = None
    cores: Cores = None
    io_threads: IoThreads | None = None

    @model_validator(mode="after")
    def _one_address(self) -> "Defaults":
        return _check_one_address(self)


class ServerEntry(_Model):
    """One CHP server's entry in a config file (``shards[i].primary`` / ``.backup``; the
    running server's settings are ``clonemap.shards.server.ServerConfig``). After
    ``ClusterConfig`` validation ``port`` and ``cores`` are set and exactly one of
    ``host`` / ``nic`` is."""

    host: Host = None
    nic: Nic = None
    port: Port = None
    cores: Cores = None
    io_threads: IoThreads | None = None
    at: Name = None
    """The host (a name under ``hosts:``) whose supervisor runs this server."""
    _port_from_base: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _one_address(self) -> "ServerEntry":
        return _check_one_address(self)

    @property
    def port_from_base(self) -> bool:
        """True when ``port`` was derived from the cluster's ``port_base``."""
        return self._port_from_base

    def note_port_from_base(self) -> None:
        """``port`` was derived from the cluster's ``port_base`` (set while placing)."""
        self._port_from_base = True


class ShardConfig(_Model):
    """One shard: a name, its pinned prefixes, and its pair of servers."""

    name: Name = None
    prefixes: list[Prefix] = Field(default_factory=list)
    primary: ServerEntry = Field(default_factory=ServerEntry)
    backup: ServerEntry = Field(default_factory=ServerEntry)

    def server(self, role: str) -> ServerEntry:
        return getattr(self, role)


class LimitsConfig(_Model):
    """Byte budgets: the control plane's (``clonemap.shards.common.mdp.broker_core``) and a
    server publisher's per subscriber (``clonemap.shards.pub_budget``)."""

    control_message_bytes: int = Field(default=1 << 20, ge=1024)
    control_held_bytes: int = Field(default=64 << 20, ge=0)
    control_client_held_bytes: int = Field(default=8 << 20, ge=0)
    subscriber_held_bytes: int = Field(default=64 << 20, ge=0)
    """Bytes one subscriber that reads nothing may pin in a server (``clonemap.shards.byte_marks``)."""
    writer_held_bytes: int = Field(default=64 << 20, ge=0)
    """Bytes one writer's queued KVSETs may pin in a server's collector; also the
    passive's pending-table budget (at least 1 MiB there)."""
    applied_uuid_bytes: int = Field(default=16 << 20, ge=0)
    """Each server's table of applied UUIDs (``clonemap.shards.applied``): a resent write is
    recognised for at least half of this (/ 128 B an entry) later writes ..."""
    applied_uuid_s: float = Field(default=120.0, ge=0)
    """... and at least half of this many seconds."""


class RelaysConfig(_Model):
    """Relays (``clonemap.shards.relay``): last-value caches that fan each shard out to clients."""

    per_shard: int = Field(default=0, ge=0, le=16)
    """Relays for each shard (0: none)."""
    port_base: Annotated[Union[int, None], PlainValidator(parse_port)] = None
    """Relay j of shard i binds port_base + 4 * (i * per_shard + j); default: the
    cluster's port_base + 1000."""
    host: Host = None
    """The relays' address; default the shard's primary's."""
    cores: Cores = None
    """Cores the relays may use; default every core (not pinned)."""
    io_threads: IoThreads = 1
    shards: list[str] | None = None
    """The shards (by name) that get relays; default every shard."""


class RoleConfig(_Model):
    """What a role grants (``clonemap.shards.common.rights``): key prefixes to read, to
    write and to deny (the most specific prefix wins, a deny of the same length wins),
    and the control commands that change the cluster (``admin``)."""

    read: list[str] = Field(default_factory=list)
    write: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    admin: bool = False

    def rights(self) -> Rights:
        return Rights(tuple(self.read), tuple(self.write), tuple(self.deny), self.admin)


class IdentityConfig(_Model):
    """A named client identity: its own key pair (``supervisor keygen``) and its role."""

    role: str


class SecurityConfig(_Model):
    """CURVE on every socket (``clonemap.shards.common.security``), and the named client
    identities with their roles (``clonemap.shards.common.rights``)."""

    curve: bool = False
    keys_dir: str | None = None
    """Relative to the config file's directory; default ``keys`` there."""
    clients: dict[str, IdentityConfig] = Field(default_factory=dict)
    """Named client identities: ``NAME: {role: ROLE}``."""
    roles: dict[str, RoleConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _identities(self) -> "SecurityConfig":
        problems = Problems()
        if self.clients and not self.curve:
            problems.add("security.clients", sorted(self.clients),
                         "identities are CURVE key pairs; set security.curve: true")
        for name, identity in self.clients.items():
            if not NAME_RE.match(name) or name in RESERVED:
                problems.add(f"security.clients.{name}", name,
                             "an identity's name is 1-64 of A-Z a-z 0-9 _ . - (not "
                             f"{' or '.join(RESERVED)}: those are the cluster's own pairs)")
            if identity.role not in self.roles:
                known = ", ".join(sorted(self.roles)) or "none"
                problems.add(f"security.clients.{name}.role", identity.role,
                             f"no such role in security.roles (roles: {known})")
        for name in self.roles:
            if not NAME_RE.match(name):
                problems.add(f"security.roles.{name}", name,
                             "a role's name is 1-64 of A-Z a-z 0-9 _ . -")
        problems.raise_if_any()
        return self

    def access(self) -> Access:
        """Every named identity's rights (``Access.rights_of`` by User-Id)."""
        return Access({name: self.roles[identity.role].rights()
                       for name, identity in self.clients.items()},
                      {name: identity.role for name, identity in self.clients.items()})


class HostEntry(_Model):
    """One host of a cluster over several (``hosts:``): its supervisor's control
    endpoint (the broker clients and the other supervisors reach) and metrics."""

    control: Endpoint
    metrics: Metrics = None


class CoordinationConfig(_Model):
    """The coordination service of pairs whose servers are on different hosts
    (``clonemap.shards.coord``): etcd's members, the lease, and what an acknowledgement means."""

    etcd: list[Annotated[str, PlainValidator(parse_etcd_endpoint)]]
    lease_s: float = Field(default=5.0, ge=2.0, le=3600.0)
    replication: Literal["sync", "async"] = "sync"

    @field_validator("etcd")
    @classmethod
    def _members(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("expected at least one etcd member HOST:PORT")
        return value

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(self.etcd)


class ClusterConfig(_Model):
    """A whole cluster. Validation fills every default (see the module docstring)."""

    cluster: Annotated[str, PlainValidator(parse_name)] = DEFAULT_CLUSTER
    control: Endpoint = DEFAULT_CONTROL
    metrics: Metrics = DEFAULT_METRICS
    heartbeat_s: Seconds = DEFAULT_HEARTBEAT_S
    silence_timeout_s: OptSeconds = None
    port_base: Annotated[int, PlainValidator(parse_port)] = DEFAULT_PORT_BASE
    defaults: Defaults = Field(default_factory=Defaults)
    data_dir: str | None = DEFAULT_DATA_DIR
    fsync: Literal["always", "everysec", "no"] = "everysec"
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    relays: RelaysConfig = Field(default_factory=RelaysConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    hosts: dict[Annotated[str, PlainValidator(parse_name)], HostEntry] | None = None
    """A cluster over several hosts: each host's name and its supervisor's control
    endpoint; every server then says ``at:`` which host runs it."""
    coordination: CoordinationConfig | None = None
    shards: list[ShardConfig]
    _source_dir: Path | None = PrivateAttr(default=None)

    def note_source_dir(self, path: Path) -> None:
        """The directory of the file this config was read from (relative paths)."""
        self._source_dir = path

    @property
    def keys_dir(self) -> Path:
        """Where the cluster's keys are: ``security.keys_dir`` (relative to the config
        file's directory), default ``keys/`` there."""
        base = self._source_dir or Path(".")
        return (base / (self.security.keys_dir or "keys")).resolve()

    @field_validator("data_dir")
    @classmethod
    def _data_dir(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("expected a directory path, or null for memory only")
        return value

    @field_validator("shards", mode="before")
    @classmethod
    def _shard_count(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("expected a shard count (an integer >= 1) or a list of shards")
        if isinstance(value, int):
            if value < 1:
                raise ValueError("a cluster needs at least 1 shard")
            return [{} for _ in range(value)]
        if isinstance(value, list) and not value:
            raise ValueError("a cluster needs at least 1 shard; list one or more shards")
        if not isinstance(value, list):
            raise ValueError("expected a shard count (an integer >= 1) or a list of shards")
        return value

    @model_validator(mode="after")
    def _resolve(self) -> "ClusterConfig":
        problems = Problems()
        if self.silence_timeout_s is None:
            self.silence_timeout_s = timing.silence_timeout_s(self.heartbeat_s)
        elif self.silence_timeout_s <= self.heartbeat_s:
            problems.add("silence_timeout_s", self.silence_timeout_s,
                         f"must be longer than heartbeat_s ({self.heartbeat_s:g} s); "
                         f"the default is {SILENCE_HEARTBEATS} x heartbeat_s")
        names: dict[str, int] = {}
        pinned: dict[str, tuple[int, int]] = {}
        for i, shard in enumerate(self.shards):
            if shard.name is None:
                shard.name = f"s{i}"
            if shard.name in names:
                problems.add(f"shards[{i}].name", shard.name,
                             f"already the name of shards[{names[shard.name]}]; "
                             "shard names must be unique")
            names.setdefault(shard.name, i)
            for j, prefix in enumerate(shard.prefixes):
                if prefix in pinned:
                    oi, oj = pinned[prefix]
                    first = f"shards[{oi}].prefixes[{oj}]"
                    if oi == i:
                        text = f"pinned twice in shard {shard.name} (also {first})"
                    else:
                        text = (f"pinned to two shards: {self.shards[oi].name} ({first}) "
                                f"and {shard.name}; a prefix may be pinned to one shard only")
                    problems.add(f"shards[{i}].prefixes[{j}]", prefix, text)
                else:
                    pinned[prefix] = (i, j)
            for role in ROLES:
                self._resolve_server(i, role, shard.server(role), problems)
            self._check_hosts(i, shard, problems)
        if self.hosts is not None and not self.hosts:
            problems.add("hosts", {}, "no hosts named; list each host's name and its "
                                      "supervisor's control endpoint, or leave hosts out")
        problems.raise_if_any()
        return self

    def _check_hosts(self, index: int, shard: ShardConfig, problems: Problems) -> None:
        """Where each server runs: ``at`` a named host when the config has ``hosts``
        (with a ``host`` address: the other hosts and the clients must know it), never
        otherwise; a pair across two hosts needs ``coordination``."""
        for role in ROLES:
            server = shard.server(role)
            field = f"shards[{index}].{role}"
            if self.hosts is None:
                if server.at is not None:
                    problems.add(f"{field}.at", server.at,
                                 "this config names no hosts; add hosts: {NAME: {control: "
                                 "tcp://ADDRESS:PORT}} for each host, or leave at out")
                continue
            if server.at is None:
                problems.add(f"{field}.at", None,
                             f"a config with hosts must say where each server runs; "
                             f"expected one of: {', '.join(sorted(self.hosts))}")
            elif server.at not in self.hosts:
                problems.add(f"{field}.at", server.at,
                             f"not a host of this config; expected one of: "
                             f"{', '.join(sorted(self.hosts))}")
            if server.nic is not None:
                problems.add(f"{field}.nic", server.nic,
                             "a config with hosts needs each server's address (host: IPV4): "
                             "the other hosts and the clients connect to it")
        if (self.hosts is not None and shard.primary.at != shard.backup.at
                and self.coordination is None):
            problems.add(f"shards[{index}]", f"{shard.primary.at}/{shard.backup.at}",
                         "a pair across two hosts needs a tie-breaker that a partition "
                         "cannot split: add coordination: {etcd: [HOST:PORT, ...]} (see "
                         "shards/README.md, Pairs across hosts)", raw_given=True)

    def pair_across_hosts(self, index: int) -> bool:
        shard = self.shards[index]
        return self.hosts is not None and shard.primary.at != shard.backup.at

    def _resolve_server(self, index: int, role: str, server: ServerEntry,
                        problems: Problems) -> None:
        if server.host is None and server.nic is None:
            server.host, server.nic = self.defaults.host, self.defaults.nic
            if server.host is None and server.nic is None:
                server.host = DEFAULT_HOST
        if server.cores is None:
            server.cores = self.defaults.cores if self.defaults.cores is not None else "auto"
        if server.io_threads is None:
            server.io_threads = self.defaults.io_threads or 1
        if server.port is None:
            offset = SHARD_PORT_STRIDE * index + (BACKUP_PORT_OFFSET if role == "backup" else 0)
            port = self.port_base + offset
            server.note_port_from_base()
            if port > MAX_PORT_BASE:
                problems.add(f"shards[{index}].{role}.port",
                             f"{port} (port_base {self.port_base} + {offset})",
                             f"out of range; expected a port base in 1..{MAX_PORT_BASE} "
                             f"(a server uses port..port+{PORTS_PER_SERVER - 1}); "
                             "lower port_base or give this server a port",
                             raw_given=True)
            server.port = port

    @property
    def control_address(self) -> str:
        return endpoint_parts(self.control)[0]

    @property
    def control_port(self) -> int:
        return endpoint_parts(self.control)[1]

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the metrics endpoint, or None when it is off."""
        if self.metrics is None:
            return None
        host, _, port = self.metrics.rpartition(":")
        return host, int(port)

    @property
    def shard_count(self) -> int:
        return len(self.shards)


# ---------------------------------------------------------------- pydantic -> ConfigError

def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class found at ``loc`` below ``root`` (list indices are skipped)."""
    current: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        if current is None or part not in current.model_fields:
            return None
        current = _model_of(current.model_fields[part].annotation)
    return current


def _error_line(err: dict, root: type[BaseModel]) -> tuple[str, str]:
    loc = tuple(err["loc"])
    path = field_path(loc) or "(top level)"
    given = format_given(err.get("input"))
    kind = err["type"]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):
        return cause.field, str(cause)
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        fields = list(parent.model_fields) if parent else []
        text = "unknown field"
        if fields:
            text += f"; expected one of: {', '.join(fields)}"
            close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
            if close:
                text += f' (did you mean "{close[0]}"?)'
        return path, f"{path}: given {given}: {text}"
    if kind == "missing":
        return path, f"{path}: missing required field"
    if kind == "model_type":
        model = _model_at(root, loc)
        fields = ", ".join(model.model_fields) if model else ""
        return path, f"{path}: given {given}: expected a mapping with fields: {fields}"
    if kind == "value_error":
        text = str(cause) if cause is not None else err["msg"]
    else:
        text = err["msg"].replace("Input should be", "expected")
    return path, f"{path}: given {given}: {text}"


def config_error_from(err: ValidationError, root: type[BaseModel],
                      source: str = "") -> ConfigError:
    """One ConfigError with a line per pydantic error (field path, given, expected)."""
    prefix = f"{source}: " if source else ""
    lines, fields = [], []
    for item in err.errors(include_url=False):
        field, line = _error_line(item, root)
        fields.append(field)
        lines.extend(prefix + part for part in line.split("\n"))
    return ConfigError("\n".join(lines), field=fields[0] if fields else "")


# ---------------------------------------------------------------- YAML

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (YAML keeps the last)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode,
                                deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # SafeLoader reports unhashable keys itself
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"line {line}: duplicate key {format_given(key)} "
                              f"(first at line {seen[key]}); each key may appear once "
                              "per mapping", field=str(key))
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _mapping_without_duplicates)


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML (or JSON) file; any failure is a ConfigError naming file and line."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}", field=exc.field) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: invalid YAML: {where}{problem}") from None


def parse_config(data: Any, source: str = "") -> ClusterConfig:
    """Validate already-parsed data (a dict) into a ClusterConfig, or raise ConfigError."""
    prefix = f"{source}: " if source else ""
    if data is None:
        raise ConfigError(f"{prefix}the config is empty; expected a mapping with at least "
                          "shards: N")
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}given {format_given(data)}: expected a mapping "
                          f"with fields: {', '.join(ClusterConfig.model_fields)}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error_from(exc, ClusterConfig, source) from None


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster config file; errors are one ConfigError."""
    config = parse_config(read_yaml(path), source=str(path))
    config.note_source_dir(Path(path).resolve().parent)
    return config
