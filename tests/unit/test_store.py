"""shards.store: the map, its sequence, the TTL heap, point-in-time snapshot cursors (pure)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.store import MAX_TTL_S, Store, ttl_props


def drain(cursor, n=3):
    out = []
    while not cursor.done:
        out.extend(cursor.next_chunk(n))
    return out


# ------------------------------------------------------------------ apply / sequence

def test_apply_sequences_every_update_including_deletes_of_missing_keys():
    s = Store()
    assert s.apply(b"/a", b"1") == 1
    assert s.apply(b"/a", b"2") == 2
    assert s.get(b"/a") == b"2"
    assert s.apply(b"/a", b"") == 3
    assert s.get(b"/a") is None
    assert s.apply(b"/missing", b"") == 4  # still sequenced, like the guide
    assert s.seq == 4 and len(s) == 0


def test_store_can_start_at_a_given_sequence():
    s = Store(seq=41)
    assert s.apply(b"k", b"v") == 42


# ------------------------------------------------------------------ ttl_props

def test_ttl_sets_absolute_expiry_and_publishes_expires():
    expiry, props = ttl_props(b"owner=x=y\nttl=1.5\n", 1000.0)
    assert expiry == 1001.5
    assert props == b"owner=x=y\nttl=1.5\nexpires=1001.500\n"


def test_ttl_rounds_expiry_to_the_millisecond_and_replaces_a_client_expires():
    expiry, props = ttl_props(b"expires=5\nttl=2\n", 1000.12345)
    assert expiry == 1002.123
    assert props == b"ttl=2\nexpires=1002.123\n"


def test_no_ttl_properties_pass_through():
    assert ttl_props(b"", 1.0) == (None, b"")
    assert ttl_props(b"a=b\n", 1.0) == (None, b"a=b\n")
    assert ttl_props(b"xttl=5\n", 1.0) == (None, b"xttl=5\n")  # a name ending in ttl


def test_ttl_zero_means_no_expiry():
    assert ttl_props(b"ttl=0\n", 1.0) == (None, b"ttl=0\n")


def test_expires_without_ttl_is_honoured_as_the_absolute_expiry():
    assert ttl_props(b"a=1\nexpires=1234.5\n", 1000.0) == (1234.5, b"a=1\nexpires=1234.5\n")


@pytest.mark.parametrize("props", [b"ttl=abc\n", b"ttl=-1\n", b"ttl=nan\n", b"ttl=inf\n",
                                   b"ttl=\n", b"ttl=%d\n" % (MAX_TTL_S + 1)])
def test_bad_ttl_is_a_protocol_error(props):
    with pytest.raises(ProtocolError) as err:
        ttl_props(props, 1000.0)
    assert err.value.reason == "bad_ttl"


@pytest.mark.parametrize("props", [b"expires=soon\n", b"expires=-5\n", b"expires=nan\n",
                                   b"expires=1e300\n"])
def test_bad_expires_is_a_protocol_error(props):
    with pytest.raises(ProtocolError) as err:
        ttl_props(props, 1000.0)
    assert err.value.reason == "bad_expires"


# ------------------------------------------------------------------ TTL heap

def test_pop_expired_deletes_due_keys_in_expiry_order_with_new_sequences():
    s = Store()
    s.apply(b"b", b"v", 20.0)
    s.apply(b"a", b"v", 10.0)
    s.apply(b"c", b"v", 30.0)
    s.apply(b"plain", b"v")
    assert s.next_expiry() == 10.0
    assert s.pop_expired(9.999) == []
    assert s.pop_expired(20.0) == [(b"a", 5), (b"b", 6)]
    assert s.get(b"a") is None and s.get(b"b") is None and s.get(b"c") == b"v"
    assert s.next_expiry() == 30.0
    assert s.ttl_keys == 1


def test_rewrite_without_ttl_loses_the_ttl_and_delete_forgets_it():
    s = Store()
    s.apply(b"k", b"v", 10.0)
    s.apply(b"k", b"v2")
    assert s.expiry_of(b"k") is None
    s.apply(b"d", b"v", 10.0)
    s.apply(b"d", b"")
    assert s.pop_expired(100.0) == []
    assert s.get(b"k") == b"v2"
    assert s.next_expiry() is None


def test_expiries_is_a_copy_of_the_ttl_keys_only():
    s = Store()
    s.apply(b"/a", b"1", 100.0)
    s.apply(b"/b", b"2")
    s.apply(b"/c", b"3", 50.0)
    copy = s.expiries()
    assert copy == {b"/a": 100.0, b"/c": 50.0}
    s.apply(b"/a", b"")          # later changes do not reach the copy
    s.apply(b"/d", b"4", 70.0)
    assert copy == {b"/a": 100.0, b"/c": 50.0}
    assert s.expiries() == {b"/c": 50.0, b"/d": 70.0}


def test_rewrite_with_a_later_ttl_moves_the_expiry():
    s = Store()
    s.apply(b"k", b"v", 10.0)
    s.apply(b"k", b"v", 50.0)
    assert s.pop_expired(20.0) == []  # the stale heap entry is skipped
    assert s.pop_expired(50.0) == [(b"k", 3)]


def test_heap_stays_bounded_under_rewrites():
    s = Store()
    for i in range(20000):
        s.apply(b"k%d" % (i % 10), b"v", 1000.0 + i)
    assert s.ttl_keys == 10
    assert s.ttl_heap_size <= 2 * 10 + 1024 + 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.booleans(), st.one_of(st.none(),
                st.integers(0, 100))), max_size=60), st.integers(0, 120))
def test_pop_expired_matches_a_model(ops, now):
    s = Store()
    model: dict[bytes, float | None] = {}
    for k, is_set, expiry in ops:
        key = b"k%d" % k
        if is_set:
            s.apply(key, b"v", None if expiry is None else float(expiry))
            model[key] = None if expiry is None else float(expiry)
        else:
            s.apply(key, b"")
            model.pop(key, None)
    due = sorted((e, k) for k, e in model.items() if e is not None and e <= now)
    popped = s.pop_expired(float(now))
    assert sorted(k for k, _ in popped) == sorted(k for _, k in due)
    assert [q for _, q in popped] == sorted(q for _, q in popped)
    assert set(s.data) == {k for k, e in model.items() if e is None or e > now}


# ------------------------------------------------------------------ snapshots

def test_snapshot_yields_the_map_with_its_sequence():
    s = Store()
    for i in range(10):
        s.apply(b"/a/%d" % i, b"v%d" % i)
    cur = s.open_snapshot()
    assert cur.seq == 10
    assert dict(drain(cur)) == {b"/a/%d" % i: b"v%d" % i for i in range(10)}
    assert cur.done and cur.closed and s.open_cursors == 0


def test_snapshot_filters_by_subtree():
    s = Store()
    for k in (b"/a/1", b"/a/2", b"/ab/3", b"/b/4", b"plain"):
        s.apply(k, b"x")
    assert sorted(k for k, _ in drain(s.open_snapshot(b"/a/"))) == [b"/a/1", b"/a/2"]


def test_snapshot_is_point_in_time_while_updates_continue():
    s = Store()
    for i in range(100):
        s.apply(b"k%03d" % i, b"old%d" % i)
    cur = s.open_snapshot()
    first = cur.next_chunk(10)
    for i in range(100):
        if i % 3 == 0:
            s.apply(b"k%03d" % i, b"")           # deleted after open: still in snapshot
        elif i % 3 == 1:
            s.apply(b"k%03d" % i, b"new%d" % i)  # changed after open: old value
    s.apply(b"fresh", b"x")                       # created after open: absent
    s.apply(b"k000", b"again")                    # deleted then recreated: old value
    got = dict(first + drain(cur, 7))
    assert got == {b"k%03d" % i: b"old%d" % i for i in range(100)}
    assert cur.seq == 100
    assert s.open_cursors == 0


def test_closed_cursor_stops_recording_and_two_cursors_are_independent():
    s = Store()
    s.apply(b"a", b"1")
    c1 = s.open_snapshot()
    s.apply(b"a", b"2")
    c2 = s.open_snapshot()
    s.apply(b"a", b"3")
    c1.close()
    s.apply(b"a", b"4")
    assert drain(c2) == [(b"a", b"2")]
    assert c1.undo == {} and s.open_cursors == 0


def test_a_cursors_key_list_is_off_the_collectors_lists_on_the_compiled_path():
    """Tracked, a cursor's copy of a 100,000-key map's keys was walked by the next
    collection of each generation after every compaction and snapshot began (~0.4 ms
    each). A key that is not exact bytes (never from the wire or the log) keeps the list
    tracked, and the cursor still works."""
    import gc

    from clonemap.shards.common import zio

    s = Store()
    for i in range(100):
        s.apply(b"/k%d" % i, b"v")
    cursor = s.open_snapshot()
    assert gc.is_tracked(cursor._keys) is (not zio.COMPILED)
    assert len(drain(cursor)) == 100

    class Key(bytes):
        pass

    s.apply(Key(b"/odd"), b"v")
    odd = s.open_snapshot()
    assert gc.is_tracked(odd._keys)
    assert len(drain(odd)) == 101


def test_undo_is_only_recorded_for_keys_under_the_cursor_subtree():
    s = Store()
    s.apply(b"/x/1", b"a")
    s.apply(b"/y/1", b"b")
    cur = s.open_snapshot(b"/x/")
    s.apply(b"/y/1", b"c")
    s.apply(b"/x/1", b"d")
    assert cur.undo == {b"/x/1": b"a"}


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_snapshot_equals_the_map_at_open_under_random_interleaving(data):
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    s = Store()
    keys = [b"/%s/%d" % (rng.choice([b"a", b"b"]), i) for i in range(30)]
    for _ in range(data.draw(st.integers(0, 60))):
        s.apply(rng.choice(keys), rng.choice([b"", b"v%d" % rng.randrange(100)]))
    subtree = data.draw(st.sampled_from([b"", b"/a/", b"/b/"]))
    expected = {k: v for k, v in s.data.items() if k.startswith(subtree)}
    cur = s.open_snapshot(subtree)
    got = {}
    while not cur.done:
        for _ in range(rng.randrange(4)):
            s.apply(rng.choice(keys), rng.choice([b"", b"w%d" % rng.randrange(100)]))
        got.update(cur.next_chunk(rng.randrange(1, 5)))
    assert got == expected


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_entries_with_expiry_are_the_map_and_its_ttls_at_open(data):
    """A compaction's cursor (``with_expiry``): every ``[key, value, expires, mod_seq]``
    it gives is the map, each key's absolute expiry and the sequence that last changed it
    as they were when it opened, however the
    keys and their TTLs change between chunks (rewritten with or without a TTL, deleted,
    new), with no TTL anywhere or some; with ``keep`` (a move's copy), the same of only
    the keys it accepts."""
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    ttls = data.draw(st.booleans())
    s = Store()
    keys = [b"/k/%d" % i for i in range(30)]

    def write(value: bytes) -> None:
        expiry = 1_000.0 + rng.randrange(100) if ttls and rng.random() < 0.5 else None
        s.apply(rng.choice(keys), value, expiry)

    for _ in range(data.draw(st.integers(0, 60))):
        write(rng.choice([b"", b"v%d" % rng.randrange(100)]))
    expected = {k: (v, s.expiries().get(k), s.mod_seq(k)) for k, v in s.data.items()}
    cur = s.open_snapshot(with_expiry=True)
    got = {}
    synced = {}
    synced_cur = s.open_snapshot(with_expiry=True)
    kept, kept_cur = {}, s.open_snapshot(with_expiry=True)  # (a move's copy: a third)
    third = lambda key: int(key.rsplit(b"/", 1)[1]) % 3 == 0  # noqa: E731
    while not cur.done or not synced_cur.done or not kept_cur.done:
        for _ in range(rng.randrange(4)):
            write(rng.choice([b"", b"w%d" % rng.randrange(100)]))
        flat = cur.next_entries(rng.randrange(1, 5))
        assert len(flat) % 4 == 0
        got.update((k, (v, e, m)) for k, v, e, m in zip(flat[0::4], flat[1::4], flat[2::4],
                                                         flat[3::4]))
        ks, values, mods, expiries = synced_cur.next_columns(rng.randrange(1, 5), True)
        synced.update((k, (v, e, m)) for k, v, m, e in zip(ks, values, mods, expiries))
        ks, values, mods, expiries = kept_cur.next_columns(rng.randrange(1, 5), True, third)
        assert len(ks) == len(values) == len(mods) == len(expiries)
        kept.update((k, (v, e, m)) for k, v, m, e in zip(ks, values, mods, expiries))
    assert got == expected
    assert synced == expected
    assert kept == {k: v for k, v in expected.items() if third(k)}


@pytest.mark.parametrize("subtree", [b"", b"/a/"])
def test_a_cursor_walks_the_dicts_in_order_until_a_key_is_inserted_or_deleted(subtree):
    """``next_columns`` reads values and sequences by walking the dicts in step with the
    key list (no lookup per key) while no key is inserted or deleted: a rewrite of an
    existing key keeps the walk (the old value and sequence come from ``undo``); an insert
    or a delete ends it, and the lookups give the same answer. A ``mod`` dict whose order
    is not the key list's is never walked."""
    s = Store()
    for i in range(40):
        s.apply(b"/%s/%d" % (b"ab"[i % 2:i % 2 + 1], i), b"v%d" % i)
    at_open = {k: (v, s.mod_seq(k)) for k, v in s.data.items() if k.startswith(subtree)}

    def drain(cur, between, keep=None) -> dict:
        got = {}
        step = 0
        while not cur.done:
            keys, values, mods, _ = cur.next_columns(7, keep=keep)
            got.update(zip(keys, zip(values, mods)))
            between(step)
            step += 1
        return got

    cur = s.open_snapshot(subtree)
    walked = []
    got = drain(cur, lambda step: (walked.append(cur.walks is not None),
                                   s.apply(b"/a/%d" % (step * 2), b"rewritten")))
    assert got == at_open
    assert walked[:-1] == [True] * (len(walked) - 1)  # rewrites alone never end the walk

    # a move's copy (``keep``) walks the same way, and gives only what ``keep`` accepts
    even = lambda key: int(key.rsplit(b"/", 1)[1]) % 4 < 2  # noqa: E731
    at_open = {k: (v, s.mod_seq(k)) for k, v in s.data.items() if k.startswith(subtree)}
    cur = s.open_snapshot(subtree)
    walked = []
    got = drain(cur, lambda step: (walked.append(cur.walks is not None),
                                   s.apply(b"/b/%d" % (step * 2 + 1), b"again")), keep=even)
    assert got == {k: v for k, v in at_open.items() if even(k)} != {}
    assert walked[:-1] == [True] * (len(walked) - 1)

    for change in (lambda: s.apply(b"/a/new", b"x"), lambda: s.apply(b"/a/0", b"")):
        at_open = {k: (v, s.mod_seq(k)) for k, v in s.data.items() if k.startswith(subtree)}
        cur = s.open_snapshot(subtree)
        states = []
        got = drain(cur, lambda step: (change() if step == 1 else None,
                                       states.append(cur.walks is not None)))
        assert len(states) > 3 and states[0] and not any(states[1:])
        assert got == at_open

    s.mod = dict(reversed(s.mod.items()))  # (never so in the server: both change together)
    at_open = {k: (v, s.mod_seq(k)) for k, v in s.data.items() if k.startswith(subtree)}
    cur = s.open_snapshot(subtree)
    assert drain(cur, lambda step: None) == at_open
    assert cur.walks is None
