"""The cluster config's values: how each kind of field is read and checked (cores, ports,
addresses, NICs, durations, endpoints, names, prefixes), as functions and as the
annotated types the models of ``clonemap.shards.common.config`` use."""
from __future__ import annotations

import ipaddress
import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, PlainValidator

from clonemap.shards.common.endpoints import (  # noqa: F401 - parse_endpoint: here too
    MAX_IO_THREADS, WILDCARD, endpoint_parts, host_port, parse_endpoint)

PORTS_PER_SERVER = 4
MAX_PORT_BASE = 65535 - (PORTS_PER_SERVER - 1)
CoreSet = tuple[int, ...]
CoreSpec = Union[Literal["auto"], CoreSet]
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_NAME_EXPECTED = "expected 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"


def format_given(value: Any) -> str:
    """A value as the user wrote it, compactly (strings quoted, lists as lists)."""
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


# ---------------------------------------------------------------- value parsers

def parse_cores(value: Any) -> CoreSpec:
    """``"auto"``, an int, a list of ints or a string like ``"2-3,6"`` -> ``"auto"`` or a
    sorted tuple of distinct core numbers."""
    expected = 'expected "auto", a core number, a list like [2, 3] or a string like "2-3,6"'
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return "auto"
        cores: set[int] = set()
        for part in text.split(","):
            part = part.strip()
            m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
            if not m:
                raise ValueError(f"cannot read {part!r} as a core or a range; {expected}")
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if hi < lo:
                raise ValueError(f"range {part!r} runs backwards; write it low-high")
            cores.update(range(lo, hi + 1))
        return tuple(sorted(cores))
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"an empty core set; {expected}")
        for core in value:
            if isinstance(core, bool) or not isinstance(core, int):
                raise ValueError(f"{format_given(core)} is not a core number; {expected}")
            if core < 0:
                raise ValueError(f"core {core} is negative; core numbers start at 0")
        return tuple(sorted(set(value)))
    raise ValueError(expected)


def format_cores(cores: CoreSpec) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``."""
    if cores == "auto":
        return "auto"
    runs: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


def parse_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"not a port number; expected an integer in 1..{MAX_PORT_BASE}")
    if not 1 <= value <= MAX_PORT_BASE:
        raise ValueError(f"out of range; expected a port base in 1..{MAX_PORT_BASE} "
                         f"(a server uses port..port+{PORTS_PER_SERVER - 1})")
    return value


def parse_ipv4(value: Any) -> str:
    expected = ("expected a dotted IPv4 address such as 127.0.0.1 "
                "(or use nic: to bind an interface's address)")
    if not isinstance(value, str):
        raise ValueError(f"not an IPv4 address; {expected}")
    try:
        address = ipaddress.IPv4Address(value.strip())
    except ValueError:
        raise ValueError(f"not an IPv4 address; {expected}") from None
    if address.is_unspecified or address.is_multicast:
        raise ValueError(f"{address} cannot be a server's address (clients must connect "
                         f"to it); {expected}")
    return str(address)


def parse_nic(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected an interface name such as eth0 or lo")
    return value.strip()


def parse_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a number of seconds; expected a number > 0 such as 1.0")
    if not math.isfinite(value) or value <= 0:
        raise ValueError("expected a number of seconds > 0 such as 1.0")
    return float(value)


DEFAULT_METRICS = "127.0.0.1:9464"


def parse_metrics(value: Any) -> str | None:
    """``HOST:PORT`` where the supervisor serves Prometheus metrics; ``off`` (YAML reads
    a bare off as false) or null: none."""
    expected = ("expected HOST:PORT such as 127.0.0.1:9464 (0.0.0.0:PORT for every "
                "interface), or off")
    if value is None or value is False or (isinstance(value, str)
                                           and value.strip().lower() == "off"):
        return None
    if not isinstance(value, str):
        raise ValueError(expected)
    host, port = host_port(value.strip(), r"([^:/\s]+):(\d+)", expected)
    return f"{host}:{port}"


def parse_name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(_NAME_EXPECTED)
    return value


def parse_prefix(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError('not a string; expected a key prefix such as "/config/"')
    if not value:
        raise ValueError('an empty prefix would pin every key; expected a key prefix '
                         'such as "/config/"')
    return value


Cores = Annotated[Union[CoreSpec, None], PlainValidator(parse_cores)]
Port = Annotated[Union[int, None], PlainValidator(parse_port)]
Host = Annotated[Union[str, None], PlainValidator(parse_ipv4)]
IoThreads = Annotated[int, Field(ge=1, le=MAX_IO_THREADS)]
Nic = Annotated[Union[str, None], PlainValidator(parse_nic)]
Name = Annotated[Union[str, None], PlainValidator(parse_name)]
Prefix = Annotated[str, PlainValidator(parse_prefix)]
Seconds = Annotated[float, PlainValidator(parse_seconds)]
OptSeconds = Annotated[Union[float, None], PlainValidator(parse_seconds)]
Endpoint = Annotated[str, PlainValidator(parse_endpoint)]
Metrics = Annotated[Union[str, None], PlainValidator(parse_metrics)]


def parse_etcd_endpoint(value: Any) -> str:
    expected = "expected HOST:PORT of an etcd member such as 10.0.0.5:2379"
    if not isinstance(value, str):
        raise ValueError(expected)
    host, _, port = value.strip().rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(expected)
    return f"{host}:{int(port)}"
