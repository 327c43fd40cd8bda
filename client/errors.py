"""Client-specific errors, under the package root ``shards.common.errors.ClonemapError``."""
from __future__ import annotations

from shards.common.errors import ClonemapError, SlowConsumer


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
    (``reset_policy="keep"``). ``info`` is the ``client.agent.ResetInfo``."""

    def __init__(self, message: str, *, shard: str = "", info=None):
        super().__init__(message)
        self.shard = shard
        self.info = info
