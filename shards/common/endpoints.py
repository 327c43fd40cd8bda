"""Endpoint facts every process must agree on: the default control endpoint, and which
host to reach a server at when it binds a wildcard address.
"""
from __future__ import annotations

LOOPBACK = "127.0.0.1"
DEFAULT_CONTROL = f"tcp://{LOOPBACK}:5555"
"""The supervisor's MDP/0.2 control endpoint unless a config or option says otherwise."""
WILDCARD = "0.0.0.0"
"""How a wildcard bind address is written in a plan (``*`` in a config or endpoint)."""
WILDCARDS = frozenset({WILDCARD, "*", "", "::"})


def reachable(host: str, fallback: str = LOOPBACK) -> str:
    """The host to connect to for a server bound to ``host``: ``fallback`` (the host the
    address came from; loopback by default) when ``host`` is a wildcard."""
    return fallback if host in WILDCARDS else host
