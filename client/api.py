"""The client's public face: import the client from here.

::

    from client.api import AsyncClone, Clone

    async with AsyncClone(config="configs/4shard.yaml", subtree="/orders/") as clone: ...
    with Clone(control="tcp://127.0.0.1:5555") as clone: ...

``AsyncClone`` (asyncio, ``client.clone``) and ``Clone`` (the same client run on a
background thread, ``client.sync``), what their callbacks receive (``FailoverInfo``,
``ResetInfo``, ``Change``) and the errors they raise. See those modules for how each
works; this module defines nothing.
"""
from __future__ import annotations

from shards.common.errors import ClonemapError, SlowConsumer, Timeout
from client.events import FailoverInfo, KeyMeta, ResetInfo
from client.clone import AsyncClone
from client.options import DEFAULT_TIMEOUT_S, ClientOptions
from client.errors import (Conflict, NotRunning, NotSupported, ShardReset, SlowSubscriber,
                           WriteRefused)
from client.sync import Clone
from client.watch import Change

__all__ = ["AsyncClone", "Change", "ClonemapError", "Clone", "Conflict", "DEFAULT_TIMEOUT_S",
           "ClientOptions", "FailoverInfo", "KeyMeta", "NotRunning", "NotSupported", "ResetInfo", "ShardReset",
           "SlowConsumer", "SlowSubscriber", "Timeout", "WriteRefused"]
