"""What a server would refuse in a write, refused by the client at once: the key (empty,
not UTF-8, a reserved word, too long), the value's size, the ttl's range. ``AsyncClone``
checks every write with it; ``chp set/del`` before connecting."""
from __future__ import annotations

import math

from clonemap.shards.common.proto import chp


def check_write(key: str, blob: bytes, ttl: float | None,
                limits: chp.Limits = chp.DEFAULT_LIMITS) -> bytes:
    """What a server would refuse, refused here at once (``ValueError``/``TypeError``):
    the key (empty, not UTF-8, a reserved word, too long), the value's size, the ttl's
    range. Returns the encoded key. ``chp set/del`` run it before connecting."""
    if not isinstance(key, str):
        raise TypeError(f"keys are str, not {type(key).__name__}")
    key_b = key.encode("utf-8")
    chp.check_key(key_b, "", limits)
    if len(blob) > limits.max_value:
        raise ValueError(f"value for {key!r} is {len(blob)} bytes, limit {limits.max_value}")
    if ttl is not None:
        ttl_text(ttl)
    return key_b


def ttl_text(ttl: float) -> str:
    """``ttl`` as the ``ttl`` property's text (whole seconds without a fraction)."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not math.isfinite(ttl) or not 0 <= ttl <= chp.MAX_TTL_S:
        raise ValueError(f"ttl must be a number of seconds in 0..{chp.MAX_TTL_S:.0f} "
                         f"(ten years; 0: none), got {ttl!r}: a server drops anything else")
    return str(int(ttl)) if float(ttl).is_integer() else repr(float(ttl))
