"""Finding free TCP port ranges on one address (a server uses P..P+3).

One probe shared by the tests, the benchmarks and the demo: bind every port of the range
with a plain socket, then close them. The answer is only true *now*; callers that start
a server on the range must still handle ``PortInUse`` (and retry) because another
process can take a port between the check and the bind. Ranges below Linux's default
ephemeral range (32768-60999) make that rare: outgoing connections draw from it.
"""
from __future__ import annotations

import os
import random
import socket
import time
from typing import Iterable


def ports_free(host: str, base: int, count: int) -> bool:
    """True if ``base .. base+count-1`` can all be bound on ``host`` now."""
    socks = []
    try:
        for port in range(base, base + count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_base(lo: int, hi: int, count: int = 4, host: str = "127.0.0.1", *,
                   avoid: Iterable[int] = (), spacing: int = 0, tries: int = 500) -> int:
    """A base P in [lo, hi - count), a multiple of 10, with P..P+count-1 free on ``host``
    now and at least ``spacing`` away from every base in ``avoid``."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    avoid = tuple(avoid)
    for _ in range(tries):
        base = rng.randrange(lo, hi - count) // 10 * 10
        if spacing and any(abs(base - b) < spacing for b in avoid):
            continue
        if ports_free(host, base, count):
            return base
    raise RuntimeError(f"no {count} free consecutive ports found in {lo}-{hi} on {host}")
