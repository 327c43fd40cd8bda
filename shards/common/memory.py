"""Give freed large buffers back to the OS.

glibc's malloc serves an allocation above its mmap threshold (128 KiB at start) with its
own mapping, which ``free`` unmaps. But the threshold is dynamic: each time such a block
is freed, glibc raises the threshold to that block's size (up to 32 MiB). After the first
large message is freed, later ones of the same size come from the heap arenas, and a
freed arena block is kept by the process. A flood of 900 KB requests that the broker
drops then leaves 10-70 MiB more resident than the bytes it still holds, a different
amount each run, and a server keeps what a departed slow subscriber pinned.

``return_large_frees()`` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``), which
turns the dynamic adjustment off: every block above it is mapped and unmapped on its
own, so a process's RSS follows the bytes it really holds. Small allocations (keys,
values, frames of ordinary updates) are untouched, so the hot path does not change. Call
it once at process start, before the zmq Context's threads allocate. On a C library
other than glibc it does nothing and says so.
"""
from __future__ import annotations

import ctypes
import logging

from clonemap.shards.common import libc

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
LARGE_BYTES = 128 * 1024
"""glibc's own starting threshold: blocks above it get their own mapping."""


def return_large_frees(threshold: int = LARGE_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes. True if it was applied."""
    mallopt = libc.function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        log.debug("no mallopt in this C library: large frees stay with the allocator")
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now (modules, classes, functions, the
    server's sockets and handlers: ~30,000 in a shard server) to the garbage collector's
    permanent generation (``gc.freeze``). A collection of the older generations walked them
    all, for nothing (they live as long as the process): 1-1.6 ms pauses in the middle of
    the hot path. Call it once a process is set up, just before it serves. Returns how
    many objects were frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_malloc_trim = libc.function("malloc_trim", (ctypes.c_size_t,))


def give_back() -> bool:
    """Return the heap's free pages to the OS (glibc ``malloc_trim(0)``, which since glibc
    2.8 releases free pages anywhere in the heap, not only at its top). Small blocks that
    a flood left free (the frames of a few million queued KVSYNCs, say) are otherwise
    kept by the process for good. A few milliseconds on a large heap: call it after a
    flood, not per message. False where the C library has no ``malloc_trim``."""
    if _malloc_trim is None:
        return False
    return _malloc_trim(0) == 1
