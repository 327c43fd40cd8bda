"""The cluster's default timing, in one place for every process that must agree on it.

A shard server publishes a HUGZ when it has been idle for ``HEARTBEAT_S``, and the two
servers of a Binary Star pair exchange their state that often; a client fails a shard
over after ``SILENCE_TIMEOUT_S`` without a message from its server. The supervisor's
config (``heartbeat_s``, ``silence_timeout_s``) overrides both for a whole cluster, and
hands them to every server and, through ``cluster.map``, to every client.

The control plane's MDP heartbeat (``MDP_HEARTBEAT_S`` x ``MDP_LIVENESS``) is here too:
the broker, its workers and the ``supervisor broker`` command must agree on it.

Pure constants: no imports, so the wire codecs, the pure state machines and the
supervisor's config can all read them.
"""
from __future__ import annotations

HEARTBEAT_S = 1.0
"""Idle HUGZ interval of a server, and heartbeat interval between a pair's servers."""

SILENCE_HEARTBEATS = 3
"""A client fails a shard over after this many heartbeats without a message."""

SILENCE_TIMEOUT_S = SILENCE_HEARTBEATS * HEARTBEAT_S


def silence_timeout_s(heartbeat_s: float) -> float:
    """The client silence timeout that goes with a server heartbeat."""
    return SILENCE_HEARTBEATS * heartbeat_s


MDP_HEARTBEAT_S = 2.5
"""MDP/0.2 heartbeat between the broker and its workers (and clients' default)."""

MDP_LIVENESS = 3
"""Heartbeats missed before an MDP peer counts as gone."""
