"""Routing: segment rule, jump hash, pinned prefixes, subtree fan-out, fixed vectors."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.routing import (FIRST_EPOCH, ROUTING_VERSION, OwnerCache, ShardMap,
                                            jump_consistent_hash, routing_segment,
                                            segment_hash)

# A small alphabet makes keys, subtrees and pins collide often.
ALPHABET = "/ab1é"
keys = st.text(alphabet=ALPHABET, max_size=12)
prefixes = st.text(alphabet=ALPHABET, min_size=1, max_size=6)


@st.composite
def shard_maps(draw):
    shards = draw(st.integers(1, 40))
    pinned = draw(st.dictionaries(prefixes, st.integers(0, shards - 1), max_size=5))
    pins: dict[int, list[str]] = {}
    for prefix, shard in pinned.items():
        pins.setdefault(shard, []).append(prefix)
    return ShardMap(shards, pins), pinned


# ------------------------------------------------------------------ segment and hashes

@pytest.mark.parametrize("key, segment", [
    ("/users/42/name", "users"), ("/users", "users"), ("/users/", "users"), ("/", ""),
    ("//x", ""), ("config/a/b", "config"), ("plain", "plain"), ("", ""), ("a/", "a"),
    ("/é/x", "é"),
])
def test_routing_segment(key, segment):
    assert routing_segment(key) == segment


def test_jump_hash_matches_published_vectors():
    # vectors from independent implementations of the paper's C++ code
    assert jump_consistent_hash(123456, 1000) == 984
    assert jump_consistent_hash(1, 1) == 0
    assert jump_consistent_hash(1, 10) == 6
    assert jump_consistent_hash(1, 100) == 55
    assert jump_consistent_hash(2, 100) == 62
    assert jump_consistent_hash(0xDEADBEEF, 1000) == 285
    assert jump_consistent_hash(2016238256797177309, 11) == 3


def test_jump_hash_rejects_no_buckets():
    with pytest.raises(ValueError):
        jump_consistent_hash(1, 0)


@given(st.integers(0, 2**64 - 1), st.integers(1, 300))
def test_jump_hash_moves_keys_only_into_the_new_bucket(key, n):
    before = jump_consistent_hash(key, n)
    after = jump_consistent_hash(key, n + 1)
    assert 0 <= before < n
    assert after == before or after == n


def test_jump_hash_spreads_and_moves_about_one_in_n():
    n = 8
    counts = [0] * (n + 1)
    moved = 0
    total = 20000
    for k in range(total):
        h = segment_hash(f"k{k}")
        before, after = jump_consistent_hash(h, n), jump_consistent_hash(h, n + 1)
        counts[after] += 1
        moved += before != after
    assert min(counts) > total / (n + 1) * 0.85
    assert max(counts) < total / (n + 1) * 1.15
    assert abs(moved - total / (n + 1)) < total / (n + 1) * 0.15


def test_segment_hash_is_blake2b64_big_endian():
    assert segment_hash("users") == segment_hash(b"users") == 0x889B3FB8E93E603E
    assert segment_hash("") == 0xE4A6A0577479B2B4
    assert segment_hash("é") == 0xCB1ABF8BEFF3192F
    assert segment_hash("config") == 0xC42529561396EB19


# ------------------------------------------------------------------ fixed vectors
# Never edit these to make a test pass: a change here means every deployed client and
# server routes differently. Change ROUTING_VERSION (and the cluster map) instead.

VECTOR_KEYS = ["/users/42", "/orders/7", "/config/x", "/a", "plain", "x/y", "", "/é/1"]
OWNER_VECTORS = {
    1: [0, 0, 0, 0, 0, 0, 0, 0],
    2: [1, 0, 0, 0, 1, 0, 0, 0],
    4: [1, 0, 3, 0, 3, 0, 2, 2],
    16: [1, 12, 7, 11, 9, 7, 5, 2],
}


@pytest.mark.parametrize("shards", sorted(OWNER_VECTORS))
def test_fixed_owner_vectors(shards):
    smap = ShardMap(shards)
    assert [smap.owner(k) for k in VECTOR_KEYS] == OWNER_VECTORS[shards]
    assert [smap.owner(k.encode()) for k in VECTOR_KEYS] == OWNER_VECTORS[shards]


def test_routing_version_and_description_are_pinned():
    assert ROUTING_VERSION == 1
    assert ShardMap(4, {2: ["/config/"]}).describe() == {
        "version": 1,
        "function": "pinned-prefix-then-jump-consistent-hash",
        "segment": "first path segment",
        "hash": "blake2b-64-big-endian",
        "shards": 4,
        "pins": [["/config/", 2]],
        "epoch": 1,
    }


def test_the_epoch_names_a_routing_without_changing_it():
    first = ShardMap(2, {1: ["/hot/"]})
    later = ShardMap(2, {1: ["/hot/"]}, epoch=3)
    assert first.epoch == FIRST_EPOCH == 1
    # the same routing function: equal, the same digest, every key with the same owner
    assert later == first and later.digest() == first.digest()
    assert later.newer_than(first) and not first.newer_than(later)
    assert first.with_epoch(3).describe() == later.describe()
    # the description carries it; one without (an older supervisor's) reads as the first
    assert ShardMap.from_description(later.describe()).epoch == 3
    doc = later.describe()
    del doc["epoch"]
    assert ShardMap.from_description(doc).epoch == FIRST_EPOCH
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ConfigError) as info:
            ShardMap(2, epoch=bad)
        assert info.value.field == "routing.epoch"


# ------------------------------------------------------------------ ShardMap

@given(shard_maps(), keys)
def test_every_key_has_exactly_one_owner_in_range(sm, key):
    smap, _ = sm
    owner = smap.owner(key)
    assert 0 <= owner < smap.shards
    assert smap.owner(key.encode("utf-8")) == owner
    assert smap.owner(key) == owner  # deterministic


@given(shard_maps(), st.lists(keys, max_size=30), st.data())
def test_a_shard_s_owned_keys_are_those_its_owner_cache_owns(sm, some, data):
    """``OwnerCache.owned`` (a client's adoption: its slot lookup inlined) picks exactly
    the keys the map gives the shard, whatever the cache already knew of their slots."""
    smap, pinned = sm
    slots = [OwnerCache.slot(p.encode("utf-8")) for p in pinned]  # "/a/" of a pin "/a/b"
    some = [*slots, *(k.encode("utf-8") for k in [*some, *pinned,
                                                   *(p + "x/y" for p in pinned)])]
    index = data.draw(st.integers(0, smap.shards - 1))
    cache = OwnerCache(smap, index)
    for key in data.draw(st.lists(st.sampled_from(some), max_size=5)) if some else []:
        cache.owns(key)  # (some slots known first)
    assert cache.owned(some) == [k for k in some if smap.owner(k) == index]
    assert cache.owned(some) == [k for k in some if cache.owns(k)]


def test_a_key_that_is_its_own_slot_does_not_hide_a_pin_under_it():
    """Until 2026-11-30 the owner of a key such as "/users/" was remembered for its whole
    slot, so a key under "/users/vip/" pinned elsewhere was then answered by it."""
    smap = ShardMap(4, {0: ["/users/vip/"]})
    assert smap.owner("/users/") != 0 and smap.owner("/users/vip/x") == 0
    cache = OwnerCache(smap, 0)
    assert not cache.owns(b"/users/") and cache.owns(b"/users/vip/x")
    assert cache.owned([b"/users/", b"/users/vip/y", b"/users/z"]) == [b"/users/vip/y"]
    # owners told for a slot with a pin under it are not taken for the pinned keys
    told = OwnerCache(smap, 0, known={b"/users/": smap.owner("/users/")})
    assert told.owns(b"/users/vip/x") and not told.owns(b"/users/z")


@given(shard_maps(), st.lists(keys, max_size=30))
def test_the_slot_owners_a_count_found_are_the_routing_s(sm, some):
    """``LeavingTally.slot_owners`` (a plan's count), which a move's export takes as
    known (``OwnerCache(known=)``), names each slot's true owner, and an export told
    them picks the same keys as one that hashes every slot."""
    from clonemap.shards.server import LeavingTally

    smap, pinned = sm
    some = [k.encode("utf-8") for k in [*some, *pinned, *(p + "x/y" for p in pinned)]]
    tally = LeavingTally(smap, 0)
    tally.add_keys(some, dict.fromkeys(some, b"v"))
    owners = tally.slot_owners()
    for slot, owner in owners.items():
        assert slot.endswith(b"/") and smap.owner(slot + b"k") == owner
    for index in range(smap.shards):
        told = OwnerCache(smap, index, known=owners)
        assert told.owned(some) == [k for k in some if smap.owner(k) == index]


@given(shard_maps(), st.lists(keys, max_size=40), st.lists(keys, max_size=10),
       st.integers(1, 64))
def test_a_count_by_columns_is_the_key_by_key_count(sm, some, absent, max_slots):
    """``LeavingTally.add_keys`` (the plan's count: slots and what the owner cache knows
    of them read in C, only the leaving keys looked at one by one) finds the keys, bytes
    and slot owners that the routing gives, key by key, for any routing and pins, keys a
    store no longer holds, slots that are whole keys, and an owner cache cleared between
    keys; in one call or in chunks, as a count goes."""
    from clonemap.shards.server import LeavingTally

    smap, pinned = sm
    held = [k.encode("utf-8") for k in [*some, *pinned, *(p + "x/y" for p in pinned)]]
    data = {k: b"v" * (len(k) % 5) for k in held}
    asked = list(dict.fromkeys(held + [k.encode("utf-8") + b"/gone" for k in absent]))
    for index in range(min(smap.shards, 3)):
        whole = LeavingTally(smap, index)
        cols = LeavingTally(smap, index, max_slots=max_slots)
        whole.add_keys(asked, data)
        for at in range(0, len(asked), 7):  # (in chunks, as a count goes)
            cols.add_keys(asked[at:at + 7], data)
        assert cols.rows() == whole.rows()
        expected = {}
        for k, v in data.items():
            if smap.owner(k) != index:
                row = expected.setdefault(smap.owner(k), [0, 0])
                row[0] += 1
                row[1] += len(k) + len(v)
        assert cols.rows() == {i: tuple(r) for i, r in expected.items()}
        owners = cols.slot_owners()
        for k in data:  # (each held key's slot says its owner)
            assert owners.get(OwnerCache.slot(k), smap.owner(k)) == smap.owner(k)
        for slot, owner in owners.items():  # (and any key under a slot that is a subtree:
            if len(slot) > 1 and slot.endswith(b"/"):  # "/" alone is the key "/" only)
                assert smap.owner(slot + b"k") == owner


@given(shard_maps(), keys)
def test_longest_pinned_prefix_wins(sm, key):
    smap, pinned = sm
    matching = [p for p in pinned if key.startswith(p)]
    if matching:
        assert smap.owner(key) == pinned[max(matching, key=len)]
    else:
        assert smap.owner(key) == jump_consistent_hash(segment_hash(routing_segment(key)),
                                                       smap.shards)


@settings(max_examples=300)
@given(shard_maps(), keys, st.lists(keys, min_size=1, max_size=8))
def test_subtree_fan_out_covers_every_owner_under_it(sm, subtree, suffixes):
    smap, pinned = sm
    owners = smap.owners_of_subtree(subtree)
    assert owners == sorted(set(owners))
    assert all(0 <= s < smap.shards for s in owners)
    for suffix in suffixes + [""] + [p[len(subtree):] for p in pinned if p.startswith(subtree)]:
        assert smap.owner(subtree + suffix) in owners


@given(shard_maps(), keys)
def test_subtree_fan_out_is_tight_for_complete_segments(sm, subtree):
    """Every shard returned really owns some key under the subtree (no needless fan-out)."""
    smap, pinned = sm
    owners = smap.owners_of_subtree(subtree)
    if owners == list(range(smap.shards)):
        return  # open segment: any shard may own a key under it
    # witnesses: the subtree itself, each pin under it, and a key avoiding every pin
    witnesses = [subtree] + [p for p in pinned if p.startswith(subtree)]
    witnesses.append(subtree + "\x00zz")  # no pin contains "\x00"
    assert sorted({smap.owner(k) for k in witnesses}) == owners


@st.composite
def routing_changes(draw):
    """Two routings of one cluster: a shrink or growth with the same pins, or the same
    count with pins added, removed or moved (what ``supervisor reshard`` applies), or
    both at once."""
    old, pinned = draw(shard_maps())
    kind = draw(st.sampled_from(["count", "pins", "both"]))
    shards = old.shards if kind == "pins" else draw(st.integers(1, 40))
    if kind == "count":
        changed = {p: s for p, s in pinned.items() if s < shards}
        if changed != pinned:  # a pin on a removed shard: its prefix moves too
            kind = "both"
    else:
        changed = draw(st.dictionaries(prefixes, st.integers(0, shards - 1), max_size=5))
    pins: dict[int, list[str]] = {}
    for prefix, shard in changed.items():
        pins.setdefault(shard, []).append(prefix)
    return old, ShardMap(shards, pins)


@settings(max_examples=400)
@given(routing_changes(), st.lists(keys, min_size=1, max_size=20))
def test_what_a_routing_change_may_take_from_a_shard_covers_every_key_it_takes(
        change, some_keys):
    """Where ``may_take_from`` says no key of a shard moves, or only keys under some
    prefixes, every key that shard holds under the old routing and the new routing
    places elsewhere is within what it said (for the shard that owns the first key)."""
    old, new = change
    index = old.owner(some_keys[0].encode("utf-8"))
    where = new.may_take_from(old, index)
    for key in some_keys:
        raw = key.encode("utf-8")
        if old.owner(raw) != index or new.owner(raw) == index:
            continue
        assert where is None or (where and raw.startswith(where)), (key, where)


def test_what_a_routing_change_may_take_examples():
    two, three = ShardMap(2), ShardMap(3)
    assert two.may_take_from(three, 0) == () and two.may_take_from(three, 1) == ()
    assert two.may_take_from(three, 2) is None  # the removed shard: every key
    assert three.may_take_from(two, 0) is None  # a growth: any key may go
    pinned = ShardMap(3, {1: ["/hot/"]})
    assert pinned.may_take_from(three, 0) == (b"/hot/",)
    assert three.may_take_from(three.with_epoch(4), 2) == ()
    assert ShardMap(2, {1: ["/hot/"]}).may_take_from(pinned, 0) == ()  # the same pins
    assert ShardMap(2, {0: ["/hot/"]}).may_take_from(pinned, 0) is None  # pins differ


def test_subtree_examples_without_pins():
    smap = ShardMap(4)
    assert smap.owners_of_subtree("") == [0, 1, 2, 3]
    assert smap.owners_of_subtree("/") == [0, 1, 2, 3]
    assert smap.owners_of_subtree("/us") == [0, 1, 2, 3]
    assert smap.owners_of_subtree("/users/") == [smap.owner("/users/1")]
    assert smap.owners_of_subtree("/users/42/") == [smap.owner("/users/1")]
    assert smap.owners_of_subtree(b"/users/") == [smap.owner("/users/1")]
    assert smap.owners_of_subtree("cfg/") == [smap.owner("cfg")]


def test_subtree_examples_with_pins():
    smap = ShardMap(4, {3: ["/users/admin/"], 2: ["/config/"]})
    hashed = smap.owner("/users/1")
    assert hashed != 3  # the example needs the pin to add a shard
    assert smap.owners_of_subtree("/users/") == sorted({hashed, 3})
    assert smap.owners_of_subtree("/users/admin/") == [3]
    assert smap.owners_of_subtree("/users/admin/x/") == [3]
    assert smap.owners_of_subtree("/config/") == [2]
    assert smap.owner("/config/a") == 2
    assert smap.owner("/users/admin/") == 3
    assert smap.owner("/users/admin") == hashed  # the pin is "/users/admin/", not a prefix


def test_pin_to_two_shards_is_an_error():
    with pytest.raises(ConfigError) as info:
        ShardMap(4, {0: ["/config/"], 1: ["/config/"]})
    assert "pinned to shards 0 and 1" in str(info.value)
    assert info.value.field == "pins.1"


@pytest.mark.parametrize("shards, pins, text", [
    (0, None, "shard count"),
    (True, None, "shard count"),
    ("4", None, "shard count"),
    (4, {4: ["/x/"]}, "not in 0..3"),
    (4, {0: [""]}, "non-empty"),
    (4, {0: "/x/"}, "list of prefixes"),
])
def test_bad_maps_are_refused(shards, pins, text):
    with pytest.raises(ConfigError) as info:
        ShardMap(shards, pins)
    assert text in str(info.value)


def test_same_prefix_twice_on_one_shard_is_fine():
    assert ShardMap(2, {1: ["/a/", "/a/"]}).pins == {"/a/": 1}


def test_describe_round_trips_through_json():
    smap = ShardMap(16, {3: ["/config/", "/users/admin/"], 0: ["/z/"]})
    description = json.loads(json.dumps(smap.describe()))
    assert description["version"] == ROUTING_VERSION
    assert description["shards"] == 16
    again = ShardMap.from_description(description)
    assert again == smap
    assert hash(again) == hash(smap)


def test_unknown_routing_version_is_refused():
    description = ShardMap(2).describe()
    description["version"] = ROUTING_VERSION + 1
    with pytest.raises(ConfigError) as info:
        ShardMap.from_description(description)
    assert info.value.field == "routing.version"


def test_invalid_utf8_bytes_key_still_has_an_owner():
    assert 0 <= ShardMap(16).owner(b"/\xff\xfe/x") < 16


def test_the_segment_owners_remembered_stay_bounded_right_and_out_of_the_collector(
        monkeypatch):
    """``_hashed_owner`` remembers owners per shard count in two dicts of bytes -> int:
    the garbage collector tracks neither (a full collection does not walk them), they
    hold between HASHED_MEMO and twice that, a segment asked again after the newer half
    filled is found in the older and moved up, and every answer is the jump hash's."""
    import gc

    from clonemap.shards.common import routing

    monkeypatch.setattr(routing, "HASHED_MEMO", 100)
    monkeypatch.setattr(routing, "_memo", {})
    segments = [b"seg%d" % i for i in range(350)]
    for segment in segments:
        assert routing._hashed_owner(segment, 7) == jump_consistent_hash(
            segment_hash(segment), 7)
    newer, older = routing._memo[7]
    assert len(newer) == 50 and len(older) == 100  # (350 = 3 x 100 + 50)
    assert not gc.is_tracked(newer) and not gc.is_tracked(older)
    assert set(older) == set(segments[200:300])
    assert routing._hashed_owner(segments[250], 7) == older[segments[250]]
    assert segments[250] in routing._memo[7][0]
    assert routing._hashed_owner(segments[0], 3) == jump_consistent_hash(
        segment_hash(segments[0]), 3)
    assert set(routing._memo) == {3, 7}
    for shards in range(10, 18):  # a ninth count: the memo starts again
        routing._hashed_owner(b"x", shards)
    assert len(routing._memo) <= 8 and 7 not in routing._memo
