"""The cluster's default timing, in one place for every process that must agree on it.

A shard server publishes a HUGZ when it has been idle for ``HEARTBEAT_S``, and the two
servers of a Binary Star pair exchange their state that often; a client fails a shard
over after ``SILENCE_TIMEOUT_S`` without a message from its server. The supervisor's
config (``heartbeat_s``, ``silence_timeout_s``) overrides both for a whole cluster, and
hands them to every server and, through ``cluster.map``, to every client.

Pure constants: no imports, so the wire codecs, the pure state machines and the
supervisor's config can all read them.
"""
from __future__ import annotations

HEARTBEAT_S = 1.0
"""Idle HUGZ interval of a server, and heartbeat interval between a pair's servers."""

SILENCE_HEARTBEATS = 3
"""A client fails a shard over after this many heartbeats without a message."""

SILENCE_TIMEOUT_S = SILENCE_HEARTBEATS * HEARTBEAT_S
