"""The BSTAR-TTL codec (shards.common.proto.bstar_ttl): round trips and every malformed reply."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, strategies as st

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import bstar_ttl

keys = st.binary(min_size=1, max_size=300)
expiries = st.floats(min_value=0, max_value=4e9, allow_nan=False)


@given(st.dictionaries(keys, expiries, max_size=50), st.integers(0, 2**64 - 1), st.booleans())
def test_a_chunk_round_trips(table, seq, last):
    frames = bstar_ttl.encode_chunk(seq, table.items(), last)
    assert frames[0] == b"BSTAR-TTL" and len(frames[1]) == 8
    assert frames[3] == (b"\x01" if last else b"\x00")
    assert bstar_ttl.decode_chunk(frames) == (seq, table, last, "", (), [], ())


def test_the_request_is_one_frame():
    assert bstar_ttl.request() == [b"BSTAR-TTL?"]


def test_an_empty_table_is_one_empty_last_chunk():
    frames = bstar_ttl.encode_chunk(7, [], last=True)
    assert frames == [b"BSTAR-TTL", struct.pack(">Q", 7), b"", b"\x01"]
    assert bstar_ttl.decode_chunk(frames) == (7, {}, True, "", (), [], ())


GOOD = bstar_ttl.encode_chunk(3, [(b"/a", 1.5)], last=False)


def test_a_chunk_carries_the_map_generation_when_given():
    frames = bstar_ttl.encode_chunk(9, [(b"/k", 12.5)], last=True, generation="a1b2c3d4e5f60718")
    assert frames[4] == b"a1b2c3d4e5f60718"
    assert bstar_ttl.decode_chunk(frames) == (9, {b"/k": 12.5}, True, "a1b2c3d4e5f60718", (),
                                               [], ())


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
                min_size=1, max_size=8))
def test_a_chunk_carries_the_term_history_when_given(history):
    frames = bstar_ttl.encode_chunk(9, [], last=True, history=history)
    assert len(frames) == 6 and frames[4] == b"" and len(frames[5]) == 16 * len(history)
    assert bstar_ttl.decode_chunk(frames).history == tuple(history)


@given(st.lists(st.binary(min_size=1, max_size=300), max_size=40), st.booleans())
def test_the_last_chunk_carries_the_staged_keys(staged, last):
    """The keys a move staged in the active's store (f7, the last chunk only): a passive
    or relay that copies the map keeps them out of its clients' snapshots."""
    frames = bstar_ttl.encode_chunk(4, [(b"/t", 2.0)], last, generation="g1", staged=staged)
    chunk = bstar_ttl.decode_chunk(frames)
    assert chunk.staged == (tuple(staged) if last else ())
    assert len(frames) == (8 if last and staged else 5)
    assert (chunk.seq, chunk.table, chunk.generation) == (4, {b"/t": 2.0}, "g1")


@pytest.mark.parametrize("frames, fault", [
    (GOOD[:3], "expected 4 to 8 frames"),
    (GOOD + [b"gen", b"", b"", b"", b""], "expected 4 to 8 frames"),
    (GOOD + [b"gen", b"", b"", b"\x00"], "truncated staged key"),
    (GOOD + [b"gen", b"", b"", b"\x00\x05/ab"], "truncated staged key"),
    (GOOD + [b"gen", b"", b"x" * 23], "UUID table of 23 bytes"),
    (GOOD + [b"gen", b"\x00" * 15], "term history of 15 bytes"),
    (GOOD + [b"g\xff", b""], "generation"),
    (GOOD + [b""], "generation"),
    (GOOD + [b"not ascii \xff"], "generation"),
    (GOOD + [b"g" * 65], "generation"),
    ([b"BSTAR-TTX", *GOOD[1:]], "header"),
    ([GOOD[0], b"\x00" * 7, *GOOD[2:]], "sequence is 7 bytes"),
    ([*GOOD[:3], b"\x02"], "flag"),
    ([*GOOD[:3], b""], "flag"),
    ([GOOD[0], GOOD[1], GOOD[2][:5], GOOD[3]], "truncated entry"),
    ([GOOD[0], GOOD[1], GOOD[2][:-1], GOOD[3]], "truncated key"),
])
def test_malformed_replies_name_their_fault(frames, fault):
    with pytest.raises(ProtocolError) as info:
        bstar_ttl.decode_chunk(frames)
    assert info.value.reason == "bad_ttl_table" and fault in str(info.value)


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=6))
def test_garbage_raises_nothing_but_protocol_error(frames):
    try:
        bstar_ttl.decode_chunk(frames)
    except ProtocolError:
        pass


def test_the_last_chunk_carries_the_applied_uuids():
    uuids = [b"U" * 16, 5, b"V" * 16, 9]
    frames = bstar_ttl.encode_chunk(9, [], last=True, uuids=uuids)
    assert len(frames) == 7 and len(frames[6]) == 2 * 24
    assert bstar_ttl.decode_chunk(frames).uuids == uuids
    assert len(bstar_ttl.encode_chunk(9, [], last=False, uuids=uuids)) == 4


def test_a_table_streamed_packs_its_uuids_a_piece_a_turn_before_its_last_chunk():
    """``TtlStream`` (``clonemap.shards.ttl_table``) given copies of the applied UUIDs'
    generations: the TTL chunks go one a turn; before the last, the UUIDs are packed
    ``UUID_PIECE`` entries a turn with nothing sent (a whole table in one turn held the
    answering server's writes 27 ms); the reply decodes to the same table and UUIDs, oldest
    first, and a UUID that is not 16 bytes is left out, as before."""
    import zmq

    from clonemap.shards import streams
    from clonemap.shards.ttl_table import UUID_PIECE, TtlStream

    expiries = {b"/t/%d" % i: 1000.0 + i for i in range(2 * bstar_ttl.CHUNK_ENTRIES + 5)}
    older = {b"%016d" % i: i + 1 for i in range(UUID_PIECE + 7)}
    newer = {b"%016d" % (i + 10**6): UUID_PIECE + 8 + i for i in range(UUID_PIECE)}
    newer[b"short"] = UUID_PIECE * 3
    seq = UUID_PIECE * 3
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.IDENTITY, b"peer")
        router.bind("inproc://ttl-pieces")
        dealer.connect("inproc://ttl-pieces")
        dealer.send(b"hello")
        assert router.recv_multipart() == [b"peer", b"hello"]
        stream = TtlStream(b"peer", seq, expiries, "g1", {"chunks": 0}, (),
                           uuid_tables=(older, newer))
        turns, sent, chunks = [], 0, []
        while True:
            outcome = stream.send_some(router)
            got = []
            while dealer.poll(0):
                got.append(dealer.recv_multipart())
            chunks += got
            turns.append((outcome, len(got)))
            if outcome == streams.DONE:
                break
            assert outcome == streams.PROGRESS and len(turns) < 20, turns
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
    assert [n for _, n in turns] == [1, 1, 0, 0, 0, 1], turns  # (3 pieces, then the last)
    decoded = [bstar_ttl.decode_chunk(frames) for frames in chunks]
    assert [c.last for c in decoded] == [False, False, True]
    assert {k: v for c in decoded for k, v in c.table.items()} == expiries
    flat = [x for table in (older, newer) for kv in table.items() if len(kv[0]) == 16
            for x in kv]
    assert decoded[-1].uuids == flat and decoded[-1].generation == "g1"
    assert decoded[-1].uuids == bstar_ttl.decode_chunk(bstar_ttl.encode_chunk(
        seq, [], True, uuids=[x for t in (older, newer) for kv in t.items() for x in kv])
        ).uuids
