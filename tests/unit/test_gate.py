"""What a server's gate lets through, pure (``clonemap.shards.gate``): a subscription's
narrowed prefixes take exactly the readable keys under the topic (never one more), a
snapshot is whole, narrowed or refused, the rights file round-trips, and the cluster's
own pairs are never checked."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clonemap.shards.common.rights import Access, Rights
from clonemap.shards.gate import ALL, MAX_COVER, NONE, SOME, Gate, Scope, write_rights

# a small alphabet, so that random prefixes and keys overlap often
_text = st.text(alphabet="/ab", max_size=4)
_prefixes = st.lists(_text, max_size=3).map(tuple)


def _matched(prefixes: list[bytes], key: bytes) -> bool:
    return any(key.startswith(p) for p in prefixes)


@settings(max_examples=400, deadline=None)
@given(read=_prefixes, deny=_prefixes, topic=_text, keys=st.lists(_text, max_size=25))
def test_a_subscription_s_cover_takes_only_readable_keys_under_its_topic(read, deny, topic,
                                                                         keys):
    scope = Scope("x", Rights(read=read, deny=deny))
    cover = scope.cover(topic.encode())
    assert cover is not None  # a tiny alphabet's covers are small
    rules = [p.encode() for p in read + deny]
    for text in keys + [topic + k for k in keys]:
        key = text.encode()
        readable = key.startswith(topic.encode()) and scope.may_read(key)
        if _matched(cover, key):
            assert readable, (read, deny, topic, key, cover)  # never widened
        elif readable:
            # left out only when the key is itself the start of a deeper rule (a prefix
            # cannot take it without the keys that extend it)
            assert any(len(r) > len(key) and r.startswith(key) for r in rules), (
                read, deny, topic, key, cover)


def test_a_deny_inside_a_readable_subtree_is_carved_out_byte_by_byte():
    scope = Scope("reader", Rights(read=("/",), deny=("/secrets/",)))
    cover = scope.cover(b"")
    assert not _matched(cover, b"/secrets/root") and not _matched(cover, b"/secrets/")
    assert all(_matched(cover, k) for k in (b"/public/x", b"/secretsX", b"/sa", b"/\xff"))
    assert not _matched(cover, b"/s")  # the start of the deny itself: left out
    assert not _matched(cover, b"config")  # "/" does not start it
    assert len(cover) <= MAX_COVER
    # the subscription adds HUGZ (they carry no data) for an identity that reads anything
    assert scope.subscription(b"")[-1] == b"HUGZ"
    assert scope.subscription(b"HUGZ") == [b"HUGZ"]
    assert Scope("none", Rights()).subscription(b"") == []


def test_a_cover_that_would_take_too_many_prefixes_is_refused_never_widened():
    deep = "/" + "x" * 40 + "/"
    scope = Scope("deep", Rights(read=("",), deny=(deep,)))
    assert scope.cover(b"") is None and scope.subscription(b"") is None


def test_a_snapshot_is_whole_narrowed_or_refused():
    scope = Scope("orders", Rights(read=("/orders/", "/config/"), write=("/orders/",)))
    assert scope.snapshot(b"/orders/") == ALL
    assert scope.snapshot(b"/orders/1/") == ALL
    assert scope.snapshot(b"") == SOME
    assert scope.snapshot(b"/users/") == NONE
    assert scope.may_write(b"/orders/1") and not scope.may_write(b"/config/a")
    why = scope.why_not(b"/users/1", "write")
    assert why.startswith("forbidden: identity 'orders' may not write '/users/1'")
    assert "it may write '/orders/'" in why
    denied = Scope("r", Rights(read=("/",), deny=("/secrets/",)))
    assert "denied by prefix '/secrets/'" in denied.why_not(b"/secrets/k", "read")


def test_the_cluster_s_own_pairs_and_unknown_names(tmp_path):
    access = Access({"dash": Rights(read=("/",))}, {"dash": "reader"})
    gate = Gate(access)
    assert gate.enforcing
    assert gate.scope("server") is None and gate.scope("client") is None
    assert gate.scope(None) is None  # no CURVE: no User-Id
    stranger = gate.scope("stranger")  # admitted by a newer config: no right here
    assert not stranger.may_read(b"/a") and not stranger.may_write(b"/a")
    assert not Gate().enforcing and Gate().scope("dash") is None
    path = write_rights(tmp_path / "rights.json", access, version=3)
    loaded = Gate.load(path)
    assert loaded.access == access and loaded.version == 3
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    gate.count("dash", "writes_refused", "detail")
    gate.count("dash", "writes_refused")
    assert gate.stats()["by_identity"] == {"dash": {"writes_refused": 2}}
    assert gate.stats()["refused_writes"] == 2


def test_a_bad_rights_file_is_refused_naming_it(tmp_path):
    from clonemap.shards.common.errors import ConfigError

    bad = tmp_path / "rights.json"
    for text in ("not json", json.dumps({"identities": {"server": {}}}),
                 json.dumps({"identities": {"x": {"read": 5}}})):
        bad.write_text(text)
        with pytest.raises(ConfigError, match="rights.json"):
            Gate.load(bad)
