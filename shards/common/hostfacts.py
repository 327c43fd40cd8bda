"""Facts about the host a cluster is placed on, and the one OS probe placement needs.

``HostFacts`` holds the cores this process may use (its CPU affinity), every NIC with its
IPv4 addresses (in the order the OS lists them), and where the facts came from. They are
read from this host (``local_host_facts``) or from a YAML/JSON file
(``load_host_facts``), so a config written for a bigger host can be validated and
planned anywhere. A facts file:

    # a 16-core host with two NICs
    cores: 0-15                # the cores the supervisor may use (list or "2-3,6" form)
    nics:                      # interface name -> its IPv4 addresses ([] for none)
      lo: [127.0.0.1]
      eth0: [10.0.0.5]
      eth1: [10.1.0.5]

``probe_port(address, port)`` answers whether a TCP port can be bound now (with
SO_REUSEADDR, as ZeroMQ binds), which only makes sense for facts of this host.
"""
from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Union

import psutil
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.config import config_error_from, read_yaml
from clonemap.shards.common.config_values import format_cores, parse_cores

LOCAL_SOURCE = "this host"


@dataclass(frozen=True)
class HostFacts:
    """Usable cores and NICs (name -> IPv4 addresses) of one host."""

    cores: tuple[int, ...]
    nics: dict[str, tuple[str, ...]] = field(default_factory=dict)
    source: str = LOCAL_SOURCE
    local: bool = True  # ports can be probed only on this host

    def ipv4_of(self, nic: str) -> tuple[str, ...]:
        return self.nics.get(nic, ())

    def nic_with(self, address: str) -> str | None:
        """The NIC holding ``address``; loopback addresses (127/8) belong to the NIC
        that holds any loopback address, as Linux routes the whole block to ``lo``."""
        for name, addresses in self.nics.items():
            if address in addresses:
                return name
        if ipaddress.IPv4Address(address).is_loopback:
            for name, addresses in self.nics.items():
                if any(ipaddress.IPv4Address(a).is_loopback for a in addresses):
                    return name
        return None

    def describe_cores(self) -> str:
        count = len(self.cores)
        return f"{format_cores(self.cores)} ({count} core{'s' if count != 1 else ''})"

    def describe_nics(self, ipv4_only: bool = False) -> str:
        parts = []
        for name, addresses in self.nics.items():
            if addresses:
                parts.append(f"{name} ({', '.join(addresses)})")
            elif not ipv4_only:
                parts.append(f"{name} (no IPv4)")
        return ", ".join(parts) if parts else "none"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "cores": list(self.cores),
                "nics": {name: list(addrs) for name, addrs in self.nics.items()}}


def local_host_facts() -> HostFacts:
    """This process's usable cores (CPU affinity) and this host's NICs."""
    proc = psutil.Process()
    try:
        cores = tuple(sorted(proc.cpu_affinity()))
    except (AttributeError, NotImplementedError):  # no affinity on this platform
        cores = tuple(range(psutil.cpu_count() or 1))
    nics = {name: tuple(a.address for a in addrs if a.family == socket.AF_INET)
            for name, addrs in psutil.net_if_addrs().items()}
    return HostFacts(cores=cores, nics=nics, source=LOCAL_SOURCE, local=True)


# ---------------------------------------------------------------- facts file

def _parse_host_cores(value: Any) -> tuple[int, ...]:
    cores = parse_cores(value)
    if cores == "auto":
        raise ValueError('"auto" describes no host; expected the cores, e.g. 0-15')
    return cores


def _parse_addresses(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ValueError("expected a list of IPv4 addresses ([] for none)")
    out = []
    for item in value:
        try:
            out.append(str(ipaddress.IPv4Address(str(item).strip())))
        except ValueError:
            raise ValueError(f"{item!r} is not an IPv4 address; expected a list of IPv4 "
                             "addresses ([] for none)") from None
    return tuple(out)


class HostFactsFile(BaseModel):
    """The schema of a host-facts file."""

    model_config = ConfigDict(extra="forbid")

    description: str = ""
    cores: Annotated[tuple[int, ...], PlainValidator(_parse_host_cores)]
    nics: dict[str, Annotated[Union[tuple[str, ...], None],
                              PlainValidator(_parse_addresses)]] = Field(default_factory=dict)


def load_host_facts(path: str | Path) -> HostFacts:
    """Read host facts from a YAML/JSON file; errors are one ConfigError."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with fields: "
                          f"{', '.join(HostFactsFile.model_fields)}")
    try:
        parsed = HostFactsFile.model_validate(data)
    except ValidationError as exc:
        raise config_error_from(exc, HostFactsFile, str(path)) from None
    return HostFacts(cores=parsed.cores, nics=dict(parsed.nics), source=str(path),
                     local=False)


# ---------------------------------------------------------------- the OS probe

def probe_port(address: str, port: int) -> str | None:
    """None if TCP ``address:port`` can be bound now, else why not ("in use", ...).

    Binds with SO_REUSEADDR like ZeroMQ does, so a port in TIME_WAIT counts as free."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        return None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "already in use"
        return exc.strerror or str(exc)
    finally:
        sock.close()
