"""The client's public face: import the client from here.

::

    from clonemap.client.api import AsyncClone, Clone

    async with AsyncClone(config="configs/4shard.yaml", subtree="/orders/") as clone: ...
    with Clone(control="tcp://127.0.0.1:5555") as clone: ...

``AsyncClone`` (asyncio, ``clonemap.client.clone``) and ``Clone`` (the same client run on a
background thread, ``clonemap.client.sync``), what their callbacks receive (``FailoverInfo``,
``ResetInfo``, ``Change``) and the errors they raise. See those modules for how each
works; this module defines nothing.
"""
from __future__ import annotations

from clonemap.shards.common.errors import ClonemapError, SlowConsumer, Timeout
from clonemap.client.events import FailoverInfo, KeyMeta, ResetInfo
from clonemap.client.clone import AsyncClone
from clonemap.client.options import DEFAULT_TIMEOUT_S, ClientOptions
from clonemap.client.errors import (Conflict, NotRunning, NotSupported, ReadRefused, ShardReset,
                                    SlowSubscriber, WriteRefused)
from clonemap.client.sync import Clone
from clonemap.client.watch import Change

__all__ = ["AsyncClone", "Change", "ClonemapError", "Clone", "Conflict", "DEFAULT_TIMEOUT_S",
           "ClientOptions", "FailoverInfo", "KeyMeta", "NotRunning", "NotSupported", "ReadRefused", "ResetInfo", "ShardReset",
           "SlowConsumer", "SlowSubscriber", "Timeout", "WriteRefused"]
