"""A client's options, with their defaults and their checks, in one place.

``ClientOptions`` is everything an application tunes on ``AsyncClone``/``Clone`` besides
where the cluster is (``servers=``, ``shards=``, ``config=``, ``control=``) and a ZeroMQ
``context``. Give its fields as keywords (``Clone(config=..., subtree="/orders/")``) or
one object (``Clone(config=..., options=ClientOptions(subtree="/orders/"))``; keywords
given beside it replace its fields). A wrong value is refused here, when the client is
made, with a ``ValueError``/``TypeError`` that names the option.

``AgentOptions`` is the part each shard's agent reads (``clonemap.client.agent.ShardAgent``): one
object, shared by the agents of a client, passed whole. ``AgentHooks`` are the calls an
agent makes into its client and the application (all optional).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from clonemap.shards.common.endpoints import MAX_IO_THREADS
from clonemap.shards.common.proto import chp
from clonemap.shards.common.timing import SILENCE_TIMEOUT_S
from clonemap.client import shard_machine as sm

if TYPE_CHECKING:
    from clonemap.client.events import FailoverInfo, ResetInfo

DEFAULT_TIMEOUT_S = 10.0
CONTROL_TIMEOUT_S = 3.0
"""How long ``control=`` waits for a supervisor's ``cluster.map`` (each endpoint)."""
SYNC_BUFFER_MAX = 500_000
"""Updates buffered while a snapshot streams (~400 B each with 100-byte values)."""
KVSET_QUEUE_MAX = 100_000
SUB_RCVHWM = 100_000
WATCH_CAPACITY = 10_000
RESYNC, DIE = "resync", "die"
SLOW_POLICIES = (RESYNC, DIE)
MAX_LAG_S = 1.0
"""A shard read this much later than usual (by the server clock in HUGZ) is a slow
subscriber."""
PER_SHARD = "per_shard"
"""``io_threads=PER_SHARD``: one ZeroMQ I/O thread per followed shard (Black Box)."""
AUTO = "auto"
ACCEPT, KEEP = "accept", "keep"
RESET_POLICIES = (ACCEPT, KEEP)
"""``reset_policy``: what a shard does when its server lost data this client had."""
VIAS = ("servers", "relays")


def _positive(name: str, value: object, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0{' or None' if none_ok else ''}, got {value!r}")


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AgentOptions:
    """How one shard's agent follows its shard (``clonemap.client.shard_machine`` has the rules)."""

    silence_timeout_s: float | None = SILENCE_TIMEOUT_S
    """No KVPUB and no HUGZ this long: fail over to the next server (None: never)."""
    sync_timeout_s: float = sm.SYNC_TIMEOUT_S
    connect_timeout_s: float = sm.CONNECT_TIMEOUT_S
    sync_buffer_max: int = SYNC_BUFFER_MAX
    kvset_queue_max: int = KVSET_QUEUE_MAX
    sub_rcvhwm: int = SUB_RCVHWM
    limits: chp.Limits = chp.DEFAULT_LIMITS
    max_lag_s: float | None = None
    reset_policy: str = ACCEPT
    resume: bool = True
    """Ask our servers for a resume (the updates after ours) instead of a snapshot."""

    def __post_init__(self) -> None:
        _positive("silence_timeout_s", self.silence_timeout_s, none_ok=True)
        _positive("sync_timeout_s", self.sync_timeout_s)
        _positive("connect_timeout_s", self.connect_timeout_s)
        _count("sync_buffer_max", self.sync_buffer_max)
        _count("kvset_queue_max", self.kvset_queue_max)
        _count("sub_rcvhwm", self.sub_rcvhwm)
        _positive("max_lag_s", self.max_lag_s, none_ok=True)
        if self.reset_policy not in RESET_POLICIES:
            raise ValueError(f"reset_policy is one of {', '.join(RESET_POLICIES)}, "
                             f"got {self.reset_policy!r}")
        if not isinstance(self.limits, chp.Limits):
            raise TypeError(f"limits is a chp.Limits, not {type(self.limits).__name__}")

    def machine(self, servers: int, contiguous: bool) -> sm.Config:
        """The shard machine's configuration for ``servers`` servers."""
        return sm.Config(servers=servers, contiguous=contiguous,
                         sync_timeout_s=self.sync_timeout_s,
                         connect_timeout_s=self.connect_timeout_s,
                         silence_timeout_s=self.silence_timeout_s, resume=self.resume)


@dataclass(frozen=True)
class AgentHooks:
    """What an agent calls: the application's callbacks, and its client's checks."""

    on_failover: Callable[[FailoverInfo], None] | None = None
    on_reset: Callable[[ResetInfo], None] | None = None
    on_behind: Callable[[Any, int, int], bool] | None = None
    """(agent, expected seq, got seq) on a gap in an unfiltered stream: updates were lost
    (this client fell behind the publisher). True: handled (policy "die"), no resync."""
    on_lag: Callable[[Any, float], bool] | None = None
    """(agent, lag_s) when the shard is read later than ``max_lag_s``; True: handled."""
    on_wrong_route: Callable[[Any, str, int], None] | None = None
    """(agent, the server's route, its routing epoch): a server routes otherwise."""
    """(agent, the route a HUGZ named) when it is not the one this client expects."""
    on_read_refused: Callable[[Any], None] | None = None
    """(agent) when its server refused its snapshot: the client's identity may read
    nothing of the agent's subtree."""


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """Everything a client is tuned with; see ``client/README.md`` for each option's
    story. Every field is also a keyword of ``AsyncClone``/``Clone``."""

    subtree: str = ""
    """Follow only keys under this prefix (``"/orders/"``); "" follows the whole map."""
    codec: Any = "bytes"
    """How values are encoded: ``"bytes"``, ``"msgpack"`` or a ``clonemap.client.codec.Codec``."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """``start()`` and ``wait=True`` writes give up after this long (``Timeout``)."""
    control_timeout_s: float = CONTROL_TIMEOUT_S
    heartbeat_s: float | None = None
    """The servers' heartbeat, when the cluster map does not say it."""
    silence_timeout_s: float | None | str = AUTO
    """``"auto"``: the cluster's, else 3 x ``heartbeat_s``; None: never fail over."""
    sync_timeout_s: float = sm.SYNC_TIMEOUT_S
    connect_timeout_s: float = sm.CONNECT_TIMEOUT_S
    sync_buffer_max: int = SYNC_BUFFER_MAX
    kvset_queue_max: int = KVSET_QUEUE_MAX
    watch_capacity: int = WATCH_CAPACITY
    limits: chp.Limits = chp.DEFAULT_LIMITS
    io_threads: int | str | None = None
    """None, N (1..64) or ``"per_shard"``: the client's own context's I/O threads, each
    shard's sockets pinned to one (the Black Box pattern)."""
    slow_policy: str = RESYNC
    sub_rcvhwm: int = SUB_RCVHWM
    max_lag_s: float | None = MAX_LAG_S
    reset_policy: str = ACCEPT
    keys: str | os.PathLike[str] | None = None
    """The cluster's keys directory (CURVE); a config's ``security`` gives it too."""
    identity: str | None = None
    """Present this named client identity's key pair (``security.clients`` of the
    cluster's config; ``keys/clients/NAME.key_secret``) instead of the shared client
    pair; default ``$CLONEMAP_IDENTITY``."""
    only_key: str | None = None
    """Follow only the shard that owns this key (``chp get/set/del``)."""
    via: str = "servers"
    """``"relays"``: follow each shard through its relays."""
    resume: bool = True
    read_view: bool = True
    """With the ``bytes`` codec, keep a flat read view of the whole map (``str`` keys):
    ``get`` of a key the map holds is one dict lookup, for about 110 B more per key.
    False: ``get`` finds each key through its shard's map (a little slower, leaner)."""
    on_failover: Callable[[FailoverInfo], None] | None = field(default=None, compare=False)
    on_slow: Callable[[Any], None] | None = field(default=None, compare=False)
    on_reset: Callable[[ResetInfo], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.subtree, str):
            raise TypeError("subtree is a str such as '/orders/' (or '')")
        chp.check_subtree(self.subtree.encode("utf-8"))
        if self.via not in VIAS:
            raise ValueError(f"via is 'servers' or 'relays', got {self.via!r}")
        if self.only_key is not None and not self.only_key.startswith(self.subtree):
            raise ValueError(f"only_key {self.only_key!r} is outside the subtree "
                             f"{self.subtree!r}")
        _positive("timeout_s", self.timeout_s)
        _positive("control_timeout_s", self.control_timeout_s)
        _positive("heartbeat_s", self.heartbeat_s, none_ok=True)
        if self.silence_timeout_s != AUTO:
            _positive("silence_timeout_s", self.silence_timeout_s, none_ok=True)
        _count("watch_capacity", self.watch_capacity)
        if not (self.io_threads is None or self.io_threads == PER_SHARD
                or (isinstance(self.io_threads, int) and not isinstance(self.io_threads, bool)
                    and 1 <= self.io_threads <= MAX_IO_THREADS)):
            raise ValueError(f"io_threads is None, {PER_SHARD!r} or 1..{MAX_IO_THREADS}, "
                             f"got {self.io_threads!r}")
        if self.slow_policy not in SLOW_POLICIES:
            raise ValueError(f"slow_policy is one of {', '.join(SLOW_POLICIES)}, "
                             f"got {self.slow_policy!r}")
        self.agent(None)  # the agents' options are checked now, not at start()

    @classmethod
    def given(cls, options: "ClientOptions | None", where: str,
              **changes: Any) -> "ClientOptions":
        """``options`` (or the defaults) with ``changes`` in place of its fields; a
        keyword that is no option is a ``TypeError`` that lists them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"{where}: no option {', '.join(map(repr, unknown))} (the "
                            f"options: {', '.join(sorted(names))})")
        base = options if options is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"options is a ClientOptions, not {type(base).__name__}")
        return dataclasses.replace(base, **changes) if changes else base

    def agent(self, silence_timeout_s: float | None) -> AgentOptions:
        """The agents' part, with the silence timeout this client settled on."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(AgentOptions)
                  if f.name != "silence_timeout_s"}  # every other field has its twin here
        return AgentOptions(silence_timeout_s=silence_timeout_s, **shared)
