"""Client-specific errors, under the package root ``clonemap.shards.common.errors.ClonemapError``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from clonemap.shards.common.errors import ClonemapError, Exit, SlowConsumer

if TYPE_CHECKING:
    from clonemap.client.events import ResetInfo


class NotRunning(ClonemapError, RuntimeError):
    """The client was used before ``start()`` or after ``close()``."""


class SlowSubscriber(SlowConsumer):
    """The client fell behind a shard's publisher: updates were lost on the way (the
    guide's Suicidal Snail). Raised by every call of a client whose ``slow_policy`` is
    ``"die"``; ``shard`` says where, and either ``expected``/``got`` (a sequence gap) or
    ``lag_s`` (the server clock in a HUGZ showed the client that far behind)."""

    def __init__(self, message: str, *, shard: str = "", expected: int = 0, got: int = 0,
                 lag_s: float | None = None):
        super().__init__(message, dropped=max(0, got - expected), shard=shard)
        self.expected = expected
        self.got = got
        self.lag_s = lag_s


class ShardReset(ClonemapError, RuntimeError):
    """A write to a shard kept read-only after its server lost the data this client holds
    (``reset_policy="keep"``). ``info`` is the ``clonemap.client.events.ResetInfo``."""

    def __init__(self, message: str, *, shard: str = "", info: "ResetInfo | None" = None):
        super().__init__(message)
        self.shard = shard
        self.info = info


class Conflict(ClonemapError):
    """A conditional write was not applied: the key's last-modified sequence is
    ``current_seq`` (0: the key is absent), not the ``expected`` one (0: ``create``).
    Never a timeout: the owning shard's active decided it, and nothing was published."""

    def __init__(self, message: str, *, key: str = "", expected: int = 0,
                 current_seq: int = 0):
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.current_seq = current_seq


class WriteRefused(ClonemapError, RuntimeError):
    """The shard's server answered a write that asked for a reply with a refusal
    (``reason``: it is not active, it does not own the key, or the client's identity may
    not write the key: then ``forbidden`` is True and the reason names the prefix that
    denies it or the prefixes the identity may write; nothing was applied)."""

    def __init__(self, message: str, *, reason: str = "", key: str = ""):
        super().__init__(message)
        self.reason = reason
        self.key = key
        self.forbidden = reason.startswith(FORBIDDEN_PREFIX)
        if self.forbidden:
            self.exit_code = Exit.FORBIDDEN


FORBIDDEN_PREFIX = "forbidden: "
"""How a server's refusal for want of a right starts (``clonemap.shards.gate``)."""


class ReadRefused(ClonemapError, PermissionError):
    """The client's identity may read nothing of the subtree it asked a shard for
    (``subtree``): the server refused its snapshot (``refused=read``). A subtree it may
    read part of is narrowed instead: the keys it may not read are left out."""

    exit_code = Exit.FORBIDDEN

    def __init__(self, message: str, *, shard: str = "", subtree: str = ""):
        super().__init__(message)
        self.shard = shard
        self.subtree = subtree


class NotSupported(ClonemapError, RuntimeError):
    """A conditional write to a server that does not decide them (a relay, a server that
    does not say ``cas=1``: the guide's, or an older clonemap): refused here, because such
    a server would apply it unconditionally."""
