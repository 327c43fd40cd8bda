"""The resume history (``clonemap.shards.history``): its bounds in updates and bytes, what it
covers, what a resume gets, and that it holds nothing per update for the cyclic garbage
collector (a ring of per-update tuples made the young generation's rare collections walk
the whole ring: the server's p99 at 100,000 updates/s)."""
from __future__ import annotations

import gc
import struct

from clonemap.shards.history import ENTRY_OVERHEAD, WIDTH, History

SEQ = struct.Struct(">Q")
UUID = b"u" * 16


def kvpub(seq: int, key: bytes = b"/k", value: bytes = b"v", props: bytes = b"") -> list:
    return [key, SEQ.pack(seq), UUID, props, value]


def burst(first: int, n: int, key: bytes = b"/k") -> list[bytes]:
    return [f for s in range(first, first + n) for f in kvpub(s, key)]


def size_of(frames: list[bytes]) -> int:
    return sum(map(len, frames)) + len(frames) // WIDTH * ENTRY_OVERHEAD


def test_batches_and_single_updates_keep_one_sequence():
    h = History(seq=10)
    h.extend(burst(11, 3))
    for s in (14, 15):
        h.append(s, b"/k", UUID, b"", b"v")
    h.extend(burst(16, 2))
    assert (h.base, h.last, h.count) == (10, 17, 7)
    assert h.bytes == size_of(burst(11, 7))
    assert [e[0] for e in h.since(10)] == list(range(11, 18))
    assert h.since(15) == [(16, b"/k", UUID, b"", b"v"), (17, b"/k", UUID, b"", b"v")]
    assert h.since(17) == []


def test_the_oldest_blocks_go_first_and_coverage_follows():
    h = History(max_updates=10)
    for first in range(1, 31, 5):           # six batches of five
        h.extend(burst(first, 5))
    assert h.count == 10 and (h.base, h.last) == (20, 30)
    assert h.covers(20) and h.covers(30) and not h.covers(19)
    assert h.since(19) is None and h.counters["not_covered"] == 1
    assert [e[0] for e in h.since(25)] == [26, 27, 28, 29, 30]


def test_a_single_block_over_the_bounds_is_cut_not_dropped():
    h = History(max_updates=4)
    h.extend(burst(1, 10))
    assert h.count == 4 and (h.base, h.last) == (6, 10)
    assert [e[0] for e in h.since(6)] == [7, 8, 9, 10]
    assert h.bytes == size_of(burst(7, 4))


def test_the_byte_bound_counts_every_frame():
    one = size_of(kvpub(1, value=b"x" * 1000))
    h = History(max_bytes=3 * one)
    for s in range(1, 8):
        h.append(s, b"/k", UUID, b"", b"x" * 1000)
    assert h.bytes <= 3 * one and h.count == 3 and h.base == 4


def test_a_hole_restarts_coverage_and_a_subtree_filters():
    h = History()
    h.extend(burst(1, 3, b"/a/x"))
    h.extend(burst(7, 2, b"/b/y"))          # 4..6 never came: only 7.. can be resumed
    assert (h.base, h.last, h.count) == (6, 8, 2)
    h.append(9, b"/a/z", UUID, b"", b"v")
    assert [(e[0], e[1]) for e in h.since(6, b"/a/")] == [(9, b"/a/z")]
    h.reset(100)
    assert h.count == 0 and h.covers(100) and not h.covers(99)


def test_the_history_holds_no_tracked_object_per_update():
    """The server's steady state: a batch in, the oldest out. The objects the collector
    tracks must not grow with the updates held (a tuple each did: 100,000 more)."""
    h = History(max_updates=50_000)
    gc.collect()
    before = len(gc.get_objects())
    gc.disable()  # what the steady state does to the young generation: nothing collects it
    try:
        for first in range(1, 200_001, 250):
            h.extend(burst(first, 250))
        for s in range(200_001, 201_001):
            h.append(s, b"/k", UUID, b"", b"v")
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert h.count == 50_000
    assert grown < 1_000, grown             # ~200 block lists, not 50,000 entries


def test_block_lists_are_off_the_collectors_lists_on_the_compiled_path():
    """Tracked, a full history's ~500,000 frames were walked by every older-generation
    collection (4-7 ms each): a new block, an appended one and a cut one are all off."""
    from clonemap.shards.common import zio

    h = History(max_updates=100)
    h.extend(burst(1, 300))                  # one block over the bounds: cut to 201..300
    h.append(301, b"/k", UUID, b"", b"v")    # into that block, which is cut again
    h.extend(burst(302, 60))                 # a new block; the cut one is dropped whole
    assert (h.count, h.base, len(h.blocks)) == (60, 301, 1)
    h.append(362, b"/k", UUID, b"", b"v")
    tracked = [gc.is_tracked(frames) for _, frames, _ in h.blocks]
    assert tracked == [not zio.COMPILED]
    assert h.since(h.base)[0][0] == 302


def test_untrack_refuses_anything_but_a_list_of_bytes():
    from clonemap.shards.common import zio

    if not zio.COMPILED:
        frames = [b"a", []]
        assert zio.untrack_frames(frames) is frames  # the pure path leaves it as it is
        return
    for bad in ([b"a", []], (b"a",), [b"a", "str"]):
        try:
            zio.untrack_frames(bad)
        except TypeError:
            continue
        raise AssertionError(f"untracked {bad!r}")
