"""clonemap: a sharded, replicated key-value map over ZeroMQ.

The common API is here::

    from clonemap import Clone, AsyncClone, Conflict

``clonemap.client`` is the client library and the ``chp`` command, ``clonemap.shards``
the shard server (``python -m clonemap.shards``) and the protocol library every part
shares (``clonemap.shards.common``), ``clonemap.supervisor`` the ``supervisor`` command.
The names below are loaded on first use, so a server process that imports
``clonemap.shards`` does not load the client.

In a checkout the three packages are the repository's top-level folders ``client/``,
``shards/`` and ``supervisor/``; the installed wheel lays them out under this package.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# A checkout that is not installed (PYTHONPATH=., a worktree for an A/B): the packages are
# the folders beside this one. An installed wheel has them inside, and this adds nothing.
_here = Path(__file__).resolve().parent
if not (_here / "shards").is_dir() and (_here.parent / "shards" / "server.py").is_file():
    __path__.append(str(_here.parent))

if TYPE_CHECKING:
    __version__: str
    from clonemap.client.api import (DEFAULT_TIMEOUT_S, AsyncClone, Change, ClientOptions,
                                     Clone, ClonemapError, Conflict, FailoverInfo, KeyMeta,
                                     NotRunning, NotSupported, ResetInfo, ShardReset,
                                     SlowConsumer, SlowSubscriber, Timeout, WriteRefused)

__all__ = ["AsyncClone", "Change", "ClientOptions", "Clone", "ClonemapError", "Conflict",
           "DEFAULT_TIMEOUT_S", "FailoverInfo", "KeyMeta", "NotRunning", "NotSupported",
           "ResetInfo", "ShardReset", "SlowConsumer", "SlowSubscriber", "Timeout",
           "WriteRefused", "__version__"]


def _version() -> str:
    """The installed distribution's version (looked up on first use: ``importlib.metadata``
    and what it imports cost every process of the cluster ~20 ms at its start)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clonemap")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "0+checkout"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    if name in __all__:
        value = getattr(importlib.import_module("clonemap.client.api"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'clonemap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
