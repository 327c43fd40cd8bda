"""Endpoint facts every process must agree on: the default control endpoint, which
host to reach a server at when it binds a wildcard address, how many I/O threads a
ZeroMQ context of ours may be given, and how an endpoint is read (``parse_endpoint``:
here, not beside the config's models, so that a command given ``--control`` does not
import pydantic).
"""
from __future__ import annotations

import ipaddress
import re

LOOPBACK = "127.0.0.1"
DEFAULT_CONTROL = f"tcp://{LOOPBACK}:5555"
"""The supervisor's MDP/0.2 control endpoint unless a config or option says otherwise."""
WILDCARD = "0.0.0.0"
"""How a wildcard bind address is written in a plan (``*`` in a config or endpoint)."""
WILDCARDS = frozenset({WILDCARD, "*", "", "::"})
MAX_IO_THREADS = 64
"""The most libzmq I/O threads one context is given: a server's or relay's
``--io-threads``, a config's ``io_threads`` (checked by the supervisor, run by the
server: one bound for both) and a client's ``io_threads``."""


def reachable(host: str, fallback: str = LOOPBACK) -> str:
    """The host to connect to for a server bound to ``host``: ``fallback`` (the host the
    address came from; loopback by default) when ``host`` is a wildcard."""
    return fallback if host in WILDCARDS else host


LISTEN_CHECK_S = 0.5
"""How long a look for a listener on a control port may take (``ensure_listening``)."""
NOT_LISTENING = "not listening"
"""The ``Timeout.what`` of a control port where nothing listens (a down cluster)."""


def endpoint_parts(endpoint: str) -> tuple[str, int]:
    """``tcp://127.0.0.1:5555`` -> ``("127.0.0.1", 5555)``; ``*`` becomes 0.0.0.0."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return (WILDCARD if host == "*" else host), int(port)


def _refused(endpoint: str, port: int):
    from clonemap.shards.common.errors import Timeout

    return Timeout(f"no supervisor at {endpoint}: nothing listens on port {port}",
                   what=NOT_LISTENING)


def ensure_listening(endpoint: str) -> None:
    """Fail at once, ``Timeout`` with ``what=NOT_LISTENING`` (exit 4), when nothing
    listens on a control port: a refused TCP connection needs no MDP deadline (two 2.5 s
    tries). Anything else (a listener, a slow host) is left to the MDP request and its
    own deadline."""
    import socket

    host, port = endpoint_parts(str(endpoint))
    try:
        with socket.create_connection((host, port), timeout=LISTEN_CHECK_S):
            return
    except ConnectionRefusedError:
        raise _refused(endpoint, port) from None
    except OSError:
        return


def parse_endpoint(value) -> str:
    """``tcp://IPV4:PORT`` (or ``tcp://*:PORT``) -> a normalised endpoint string."""
    expected = "expected tcp://IPV4:PORT such as tcp://127.0.0.1:5555 (or tcp://*:PORT)"
    if not isinstance(value, str):
        raise ValueError(expected)
    host, port = host_port(value.strip(), r"tcp://([^:/]+):(\d+)", expected)
    host = "*" if host == WILDCARD else host
    return f"tcp://{host}:{port}"


def host_port(text: str, pattern: str, expected: str) -> tuple[str, int]:
    """An IPv4 address (``*`` and 0.0.0.0: every interface, as 0.0.0.0) and a port
    1..65535 from ``text`` matching ``pattern`` (two groups); ValueError naming
    ``expected`` otherwise."""
    m = re.fullmatch(pattern, text)
    if not m:
        raise ValueError(expected)
    host, port = m.group(1), int(m.group(2))
    host = WILDCARD if host == "*" else host
    try:
        host = str(ipaddress.IPv4Address(host))
    except ValueError:
        raise ValueError(f"{host!r} is not an IPv4 address; {expected}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range; expected 1..65535")
    return host, port
