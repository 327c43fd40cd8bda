"""shards.common.proto.chp: the pure 12/CHP codec (no zmq here).

Property tests: every valid message of the six commands round-trips through its builder
and decoder; any garbage (random frame lists, and valid messages with one thing broken)
raises nothing but ``ProtocolError``, with a reason from a known set. Then targeted
cases: 8-byte sequences, UUIDs, properties holding '=', size limits, reserved keys.
"""
from __future__ import annotations

import struct

import pytest
from hypothesis import assume, given, settings, strategies as st

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import chp

REASONS = {"frame_count", "bad_sequence", "bad_key", "oversize_key", "bad_subtree",
           "bad_uuid", "bad_props", "oversize_props", "oversize_value", "nonempty_frame",
           "unknown_command", "bad_resume"}
DECODERS = (chp.decode_icanhaz, chp.decode_snapshot, chp.decode_update, chp.decode_kvset)

# ------------------------------------------------------------------ strategies

keys = (st.text(min_size=1, max_size=60).map(lambda s: s.encode("utf-8"))
        .filter(lambda k: len(k) <= chp.DEFAULT_LIMITS.max_key and k not in chp.RESERVED_KEYS))
seqs = st.integers(0, 2**64 - 1)
uuids = st.one_of(st.just(b""), st.binary(min_size=16, max_size=16))
values = st.binary(max_size=300)
prop_names = st.text(min_size=1, max_size=12).filter(lambda s: "=" not in s and "\n" not in s)
prop_values = st.text(max_size=20).filter(lambda s: "\n" not in s)
props_dicts = st.dictionaries(prop_names, prop_values, max_size=5)
props = props_dicts.map(chp.format_props)
segments = st.text(min_size=1, max_size=8).filter(lambda s: "/" not in s)
subtrees = st.one_of(st.just(b""), st.lists(segments, min_size=1, max_size=4).map(
    lambda segs: ("/" + "".join(s + "/" for s in segs)).encode("utf-8")))

clock_ts = st.floats(0, 4e9, allow_nan=False)


def valid_messages():
    """(decoder, frames) for a valid message of any of the six commands."""
    return st.one_of(
        subtrees.map(lambda s: (chp.decode_icanhaz, chp.icanhaz(s))),
        st.tuples(keys, values, seqs).map(lambda a: (chp.decode_snapshot, chp.kvsync(*a))),
        st.tuples(seqs, subtrees).map(lambda a: (chp.decode_snapshot, chp.kthxbai(*a))),
        st.tuples(keys, st.integers(1, 2**64 - 1), values, uuids, props).map(
            lambda a: (chp.decode_update, chp.kvpub(*a))),
        st.just((chp.decode_update, chp.hugz())),
        st.tuples(clock_ts, seqs).map(lambda a: (chp.decode_update, chp.hugz(*a))),
        props.map(lambda p: (chp.decode_update, [b"HUGZ", b"\0" * 8, b"", p, b""])),
        st.tuples(keys, values, uuids, props).map(lambda a: (chp.decode_kvset, chp.kvset(*a))),
    )


# ------------------------------------------------------------------ round trips

@given(subtrees)
def test_icanhaz_round_trips(subtree):
    frames = chp.icanhaz(subtree)
    assert frames == [b"ICANHAZ?", subtree]
    assert chp.decode_icanhaz(frames) == chp.Icanhaz(subtree)


@given(keys, values, seqs)
def test_kvsync_round_trips(key, value, seq):
    frames = chp.kvsync(key, value, seq)
    assert frames == [key, struct.pack(">Q", seq), b"", b"", value]
    assert chp.decode_snapshot(frames) == chp.Kvsync(key, seq, value)


@given(seqs, subtrees)
def test_kthxbai_round_trips(seq, subtree):
    frames = chp.kthxbai(seq, subtree)
    assert frames == [b"KTHXBAI", struct.pack(">Q", seq), b"", b"", subtree]
    assert chp.decode_snapshot(frames) == chp.Kthxbai(seq, subtree)


@given(keys, st.integers(1, 2**64 - 1), values, uuids, props_dicts)
def test_kvpub_round_trips_with_its_properties(key, seq, value, uuid, pdict):
    raw = chp.format_props(pdict)
    frames = chp.kvpub(key, seq, value, uuid, raw)
    assert frames == [key, struct.pack(">Q", seq), uuid, raw, value]
    msg = chp.decode_update(frames)
    assert msg == chp.Kvpub(key, seq, uuid, raw, value)
    assert chp.parse_props(msg.props) == pdict


def test_hugz_round_trips():
    frames = chp.hugz()
    assert frames == [b"HUGZ", b"\0" * 8, b"", b"", b""]
    assert chp.decode_update(frames) == chp.Hugz()
    assert chp.hugz_clock(chp.decode_update(frames)) is None


@given(clock_ts, seqs)
def test_hugz_with_the_server_clock_round_trips(ts, seq):
    """Our deviation: frame 3 of a HUGZ carries ts=<epoch s, 6 decimals> and seq."""
    frames = chp.hugz(ts, seq)
    raw = b"ts=%.6f\nseq=%d\n" % (ts, seq)
    assert frames == [b"HUGZ", b"\0" * 8, b"", raw, b""]
    msg = chp.decode_update(frames)
    assert msg == chp.Hugz(raw)
    got_ts, got_seq = chp.hugz_clock(msg)
    assert abs(got_ts - ts) <= 1e-6 and got_seq == seq


@given(props_dicts)
def test_hugz_accepts_any_valid_properties(pdict):
    raw = chp.format_props(pdict)
    msg = chp.decode_update([b"HUGZ", b"\0" * 8, b"", raw, b""])
    assert msg == chp.Hugz(raw)
    clock = chp.hugz_clock(msg)
    if "ts" not in pdict:
        assert clock is None


@pytest.mark.parametrize("raw", [b"ts=x\nseq=1\n", b"ts=nan\n", b"ts=inf\n", b"seq=3\n"])
def test_hugz_without_a_usable_clock_reads_as_plain(raw):
    assert chp.hugz_clock(chp.decode_update([b"HUGZ", b"\0" * 8, b"", raw, b""])) is None


def test_hugz_with_a_bad_seq_keeps_its_ts():
    msg = chp.decode_update([b"HUGZ", b"\0" * 8, b"", b"ts=12.5\nseq=zz\n", b""])
    assert chp.hugz_clock(msg) == (12.5, -1)


def test_hugz_with_bad_properties_is_dropped():
    with pytest.raises(ProtocolError) as err:
        chp.decode_update([b"HUGZ", b"\0" * 8, b"", b"no-equals-sign\n", b""])
    assert err.value.reason == "bad_props" and err.value.command == "HUGZ"
    with pytest.raises(ProtocolError) as err:
        chp.decode_update([b"HUGZ", b"\0" * 8, b"", b"ts=1\n" * 2000, b""])
    assert err.value.reason == "oversize_props"


@given(keys, values, uuids, props_dicts)
def test_kvset_round_trips_and_ignores_its_sequence(key, value, uuid, pdict):
    raw = chp.format_props(pdict)
    frames = chp.kvset(key, value, uuid, raw)
    assert frames == [key, b"\0" * 8, uuid, raw, value]
    assert chp.decode_kvset(frames) == chp.Kvset(key, uuid, raw, value)
    frames[1] = struct.pack(">Q", 12345)  # "no significance": any 8 bytes
    assert chp.decode_kvset(frames) == chp.Kvset(key, uuid, raw, value)
    assert chp.parse_props(raw) == pdict


@given(props_dicts)
def test_props_round_trip_through_format_and_parse(pdict):
    raw = chp.format_props(pdict)
    assert chp.check_props(raw) == raw
    assert chp.parse_props(raw) == pdict


# ------------------------------------------------------------------ garbage

def _only_protocol_errors(decoder, frames, limits=chp.DEFAULT_LIMITS):
    try:
        decoder(frames, limits)
    except ProtocolError as err:
        assert err.reason in REASONS, err.reason
        assert err.protocol == "12/CHP"
        assert str(err).startswith("12/CHP ")


frame_lists = st.lists(st.one_of(
    st.binary(max_size=24),
    st.sampled_from([b"", b"ICANHAZ?", b"KTHXBAI", b"HUGZ", b"\0" * 8, b"\0" * 16,
                     b"/a/", b"ttl=1\n", b"\xff\xfe", b"a=b=c\n", b"=x\n"])), max_size=8)


@settings(max_examples=400)
@given(frame_lists)
def test_garbage_frames_raise_only_protocol_errors(frames):
    for decoder in DECODERS:
        _only_protocol_errors(decoder, list(frames))


@st.composite
def broken_messages(draw):
    """A valid message with one thing broken: a frame dropped, added, replaced, cut."""
    decoder, frames = draw(valid_messages())
    frames = list(frames)
    how = draw(st.sampled_from(["drop", "add", "replace", "truncate", "extend"]))
    i = draw(st.integers(0, len(frames) - 1))
    if how == "drop":
        del frames[i]
    elif how == "add":
        frames.insert(draw(st.integers(0, len(frames))), draw(st.binary(max_size=20)))
    elif how == "replace":
        frames[i] = draw(st.binary(max_size=20))
    elif how == "truncate":
        frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    else:
        frames[i] = frames[i] + draw(st.binary(min_size=1, max_size=3))
    return decoder, frames


@settings(max_examples=400)
@given(broken_messages(), st.sampled_from([chp.DEFAULT_LIMITS,
                                           chp.Limits(max_key=4, max_value=4, max_props=6,
                                                      max_subtree=4)]))
def test_broken_valid_messages_raise_only_protocol_errors(msg, limits):
    decoder, frames = msg
    for dec in DECODERS:
        _only_protocol_errors(dec, frames, limits)
    _only_protocol_errors(decoder, frames, limits)


@given(st.text(max_size=30))
def test_check_props_on_arbitrary_text_accepts_exactly_name_value_lines(text):
    raw = text.encode("utf-8")
    lines = text.split("\n")
    ok = (raw == b"" or (text.endswith("\n")
                         and all("=" in ln and not ln.startswith("=") for ln in lines[:-1])))
    if ok:
        assert chp.check_props(raw) == raw
    else:
        with pytest.raises(ProtocolError):
            chp.check_props(raw)


# ------------------------------------------------------------------ sequences

@pytest.mark.parametrize("size", [0, 1, 7, 9, 16])
def test_a_sequence_must_be_exactly_8_bytes(size):
    frames = [b"/k", b"\0" * size, b"", b"", b"v"]
    for decoder in (chp.decode_kvset, chp.decode_update, chp.decode_snapshot):
        with pytest.raises(ProtocolError) as err:
            decoder(frames)
        assert err.value.reason == "bad_sequence"
        assert "8 bytes" in str(err.value) and str(size) in str(err.value)
    with pytest.raises(ProtocolError) as err:
        chp.decode_snapshot([b"KTHXBAI", b"\0" * size, b"", b"", b""])
    assert err.value.reason == "bad_sequence" and err.value.command == "KTHXBAI"


def test_sequences_are_network_order_and_span_64_bits():
    assert chp.kvpub(b"k", 1, b"v")[1] == b"\0\0\0\0\0\0\0\x01"
    assert chp.kthxbai(0x0102030405060708)[1] == bytes(range(1, 9))
    top = 2**64 - 1
    assert chp.decode_update(chp.kvpub(b"k", top, b"v")).seq == top
    with pytest.raises(struct.error):
        chp.pack_seq(2**64)


def test_hugz_is_recognised_by_key_and_sequence_zero_only():
    with pytest.raises(ProtocolError) as err:   # "HUGZ" with a sequence is a bad KVPUB key
        chp.decode_update([b"HUGZ", chp.pack_seq(5), b"", b"", b""])
    assert err.value.reason == "bad_key"
    with pytest.raises(ProtocolError) as err:
        chp.decode_update([b"HUGZ", b"\0" * 8, b"", b"", b"x"])
    assert err.value.reason == "nonempty_frame" and err.value.command == "HUGZ"
    with pytest.raises(ProtocolError) as err:
        chp.decode_update([b"HUGZ", b"\0" * 8, b"\0" * 16, b"", b""])
    assert err.value.reason == "nonempty_frame" and err.value.command == "HUGZ"


# ------------------------------------------------------------------ UUIDs

@pytest.mark.parametrize("size", [1, 15, 17, 32])
def test_a_uuid_must_be_empty_or_16_bytes(size):
    with pytest.raises(ProtocolError) as err:
        chp.decode_kvset(chp.kvset(b"/k", b"v", b"u" * size))
    assert err.value.reason == "bad_uuid" and "16" in str(err.value)
    with pytest.raises(ProtocolError):
        chp.decode_update(chp.kvpub(b"/k", 1, b"v", b"u" * size))


@pytest.mark.parametrize("uuid", [b"", bytes(16), b"\xff" * 16])
def test_empty_and_16_byte_uuids_are_accepted(uuid):
    assert chp.decode_kvset(chp.kvset(b"/k", b"v", uuid)).uuid == uuid
    assert chp.decode_update(chp.kvpub(b"/k", 9, b"v", uuid)).uuid == uuid


# ------------------------------------------------------------------ properties

def test_a_property_value_may_hold_equals_signs():
    raw = b"owner=a=b\nexpr=x==y=\nttl=5\n"
    msg = chp.decode_kvset(chp.kvset(b"/k", b"v", b"", raw))
    assert msg.props == raw
    assert chp.parse_props(raw) == {"owner": "a=b", "expr": "x==y=", "ttl": "5"}
    assert chp.format_props({"owner": "a=b"}) == b"owner=a=b\n"


def test_empty_property_values_and_no_properties():
    assert chp.parse_props(b"a=\n") == {"a": ""}
    assert chp.parse_props(b"") == {} and chp.format_props({}) == b""
    assert chp.format_props(None) == b""


@pytest.mark.parametrize("raw", [b"ttl=5", b"novalue\n", b"=5\n", b"\n", b"a=1\n\n",
                                 b"a=1\nb\n", b"\xff=1\n", b"a=\xc3\n"])
def test_malformed_properties_are_refused(raw):
    with pytest.raises(ProtocolError) as err:
        chp.decode_kvset(chp.kvset(b"/k", b"v", b"", raw))
    assert err.value.reason == "bad_props"


@pytest.mark.parametrize("pdict", [{"a=b": "1"}, {"": "1"}, {"a\nb": "1"}, {"a": "1\n2"}])
def test_format_props_refuses_what_cannot_be_encoded(pdict):
    with pytest.raises(ProtocolError) as err:
        chp.format_props(pdict)
    assert err.value.reason == "bad_props"


# ------------------------------------------------------------------ keys and subtrees

@pytest.mark.parametrize("key", [b"", b"ICANHAZ?", b"KTHXBAI", b"HUGZ", b"\xff", b"a\xc3",
                                 b"\xed\xa0\x80"])
def test_bad_keys_are_refused(key):
    with pytest.raises(ProtocolError) as err:
        chp.decode_kvset(chp.kvset(key, b"v"))
    assert err.value.reason == "bad_key" and err.value.command == "KVSET"


def test_non_ascii_utf8_keys_are_accepted():
    key = "/ключ/ü/😀".encode()
    assert chp.decode_kvset(chp.kvset(key, b"v")).key == key


@pytest.mark.parametrize("subtree", [b"", b"/a/", b"/a/b/", b"/a b/=/", "/ü/".encode()])
def test_good_subtrees(subtree):
    assert chp.decode_icanhaz(chp.icanhaz(subtree)).subtree == subtree
    assert chp.decode_snapshot(chp.kthxbai(3, subtree)).subtree == subtree


@pytest.mark.parametrize("subtree", [b"/", b"a/", b"/a", b"//", b"/a//", b"a", b"/a/b",
                                     b"/\xff/"])
def test_bad_subtrees(subtree):
    with pytest.raises(ProtocolError) as err:
        chp.decode_icanhaz(chp.icanhaz(subtree))
    assert err.value.reason == "bad_subtree"
    with pytest.raises(ProtocolError):
        chp.decode_snapshot(chp.kthxbai(3, subtree))


def test_icanhaz_frame_count_and_unknown_commands():
    for frames, reason in (([b"ICANHAZ?"], "frame_count"),
                           ([b"ICANHAZ?", b"", b""], "frame_count"),
                           ([], "unknown_command"),
                           ([b"ICANHAZ"], "unknown_command"),
                           ([b"GIMME", b""], "unknown_command")):
        with pytest.raises(ProtocolError) as err:
            chp.decode_icanhaz(frames)
        assert err.value.reason == reason, frames


@pytest.mark.parametrize("count", [0, 1, 4, 6])
def test_five_frame_commands_check_their_frame_count(count):
    frames = [b"/k", b"\0" * 8, b"", b"", b"v", b"x"][:count]
    for decoder in (chp.decode_kvset, chp.decode_update, chp.decode_snapshot):
        with pytest.raises(ProtocolError) as err:
            decoder(frames)
        assert err.value.reason == "frame_count" and f"got {count}" in str(err.value)


def test_kvsync_and_kthxbai_frames_2_and_3_must_be_empty():
    with pytest.raises(ProtocolError) as err:
        chp.decode_snapshot([b"/k", b"\0" * 8, b"u", b"", b"v"])
    assert err.value.reason == "nonempty_frame"
    with pytest.raises(ProtocolError) as err:
        chp.decode_snapshot([b"KTHXBAI", b"\0" * 8, b"", b"p", b""])
    assert err.value.reason == "nonempty_frame"


def test_in_subtree():
    assert chp.in_subtree(b"/a/b", b"/a/") and chp.in_subtree(b"x", b"")
    assert not chp.in_subtree(b"/ab", b"/a/")


# ------------------------------------------------------------------ limits

SMALL = chp.Limits(max_key=8, max_value=16, max_props=12, max_subtree=6)


def test_limits_are_inclusive_and_name_the_reason():
    ok = chp.kvset(b"k" * 8, b"v" * 16, b"", b"ab=" + b"x" * 8 + b"\n")
    assert len(ok[3]) == 12
    assert chp.decode_kvset(ok, SMALL).key == b"k" * 8
    cases = [(chp.kvset(b"k" * 9, b"v"), "oversize_key"),
             (chp.kvset(b"k", b"v" * 17), "oversize_value"),
             (chp.kvset(b"k", b"v", b"", b"ab=" + b"x" * 9 + b"\n"), "oversize_props")]
    for frames, reason in cases:
        with pytest.raises(ProtocolError) as err:
            chp.decode_kvset(frames, SMALL)
        assert err.value.reason == reason
        assert "limit" in str(err.value)
    assert chp.decode_icanhaz(chp.icanhaz(b"/abcd/"), SMALL).subtree == b"/abcd/"
    with pytest.raises(ProtocolError) as err:
        chp.decode_icanhaz(chp.icanhaz(b"/abcde/"), SMALL)
    assert err.value.reason == "bad_subtree"


def test_limits_apply_to_every_decoder_that_carries_the_field():
    with pytest.raises(ProtocolError) as err:
        chp.decode_update(chp.kvpub(b"k", 1, b"v" * 17), SMALL)
    assert err.value.reason == "oversize_value"
    with pytest.raises(ProtocolError) as err:
        chp.decode_snapshot(chp.kvsync(b"k" * 9, b"v"), SMALL)
    assert err.value.reason == "oversize_key"


def test_default_limits_accept_a_megabyte_value():
    value = bytes(chp.DEFAULT_LIMITS.max_value)
    assert chp.decode_kvset(chp.kvset(b"/big", value)).value == value
    with pytest.raises(ProtocolError):
        chp.decode_kvset(chp.kvset(b"/big", value + b"x"))


@given(valid_messages())
def test_every_valid_message_decodes_under_its_own_decoder(msg):
    decoder, frames = msg
    decoded = decoder(list(frames))
    assume(decoded is not None)
    assert isinstance(decoded, (chp.Icanhaz, chp.Kvsync, chp.Kthxbai, chp.Kvpub, chp.Hugz,
                                chp.Kvset))


# ------------------------------------------------------------------ HUGZ properties, dialects

def test_hugz_carries_clock_generation_and_the_serving_hint():
    frames = chp.hugz(1700000000.5, 42, generation="00ff00ff00ff00ff")
    assert frames == [b"HUGZ", b"\0" * 8, b"",
                      b"ts=1700000000.500000\nseq=42\ngen=00ff00ff00ff00ff\n", b""]
    info = chp.hugz_info(chp.decode_update(frames))
    assert info == (1700000000.5, 42, True, "00ff00ff00ff00ff", "", False, 0, 0)
    passive = chp.decode_update(chp.hugz(1.0, 3, serving=False, generation="ab"))
    assert chp.hugz_info(passive).serving is False
    plain_passive = chp.hugz(serving=False)  # clock off: the hint alone
    assert plain_passive[3] == b"serving=0\n"
    assert chp.hugz_info(chp.decode_update(plain_passive)) == (None, -1, False, "", "", False, 0, 0)
    assert chp.hugz_info(chp.decode_update(chp.hugz())) == (None, -1, True, "", "", False, 0, 0)
    routed = chp.hugz(1.0, 3, route="2/4/0123abcd")
    assert routed[3].endswith(b"route=2/4/0123abcd\n")
    assert chp.hugz_info(chp.decode_update(routed)).route == "2/4/0123abcd"
    assert chp.hugz_info(chp.decode_update(routed)).epoch == 0  # not given
    # the routing's epoch rides with the route (no route: no epoch)
    epoched = chp.hugz(1.0, 3, route="2/4/0123abcd", epoch=7)
    assert epoched[3].endswith(b"route=2/4/0123abcd\nepoch=7\n")
    assert chp.hugz_info(chp.decode_update(epoched))[4:] == ("2/4/0123abcd", False, 0, 7)
    assert b"epoch" not in chp.hugz(1.0, 3, epoch=7)[3]
    garbled = [b"HUGZ", b"\0" * 8, b"", b"route=2/4/0123abcd\nepoch=x\n", b""]
    assert chp.hugz_info(chp.decode_update(garbled)).epoch == 0  # unreadable: absent


def test_the_resume_extension_of_icanhaz_and_kthxbai():
    frames = chp.icanhaz(b"/a/", 41, "00ff")
    assert frames == [b"ICANHAZ?", b"/a/", b"since=41\ngen=00ff\n"]
    assert chp.decode_icanhaz(frames) == chp.Icanhaz(b"/a/", 41, "00ff")
    assert chp.icanhaz(b"") == [b"ICANHAZ?", b""]  # without since: plain 12/CHP
    assert chp.decode_icanhaz([b"ICANHAZ?", b""]) == chp.Icanhaz(b"", None, "")
    for bad, reason in (([b"ICANHAZ?", b"", b"gen=1\n"], "bad_resume"),
                        ([b"ICANHAZ?", b"", b"since=x\n"], "bad_resume"),
                        ([b"ICANHAZ?", b"", b"since=-1\n"], "bad_resume"),
                        ([b"ICANHAZ?", b"", b"since"], "bad_props"),
                        ([b"ICANHAZ?", b"", b""], "frame_count")):
        with pytest.raises(ProtocolError) as err:
            chp.decode_icanhaz(bad)
        assert err.value.reason == reason, bad
    resumed = chp.kthxbai(7, b"/a/", chp.RESUMED)
    assert chp.decode_snapshot(resumed, strict=False) == chp.Kthxbai(7, b"/a/", b"resume=1\n")
    with pytest.raises(ProtocolError):
        chp.decode_snapshot(resumed)  # strict 12/CHP: KTHXBAI's frame 3 is empty


def test_the_term_travels_in_hugz_kthxbai_and_the_resume_request():
    termed = chp.hugz(1.0, 3, generation="ab", term=7)
    assert termed[3] == b"ts=1.000000\nseq=3\ngen=ab\nterm=7\n"
    assert chp.hugz_info(chp.decode_update(termed)).term == 7
    assert b"term" not in chp.hugz(1.0, 3, generation="ab")[3]  # term 0: not said
    assert chp.hugz(term=7)[3] == b""  # no clock: a plain HUGZ, as 12/CHP has it
    frames = chp.icanhaz(b"/a/", 41, "00ff", term=7)
    assert frames[2] == b"since=41\ngen=00ff\nterm=7\n"
    assert chp.decode_icanhaz(frames) == chp.Icanhaz(b"/a/", 41, "00ff", False, 7)
    assert chp.decode_icanhaz(chp.icanhaz(b"", 3, "g", term=0)).term == 0
    assert chp.decode_icanhaz(chp.icanhaz(b"", 3, "g")).term is None  # an older client
    for bad in (b"since=1\nterm=x\n", b"since=1\nterm=-2\n"):
        with pytest.raises(ProtocolError) as err:
            chp.decode_icanhaz([b"ICANHAZ?", b"", bad])
        assert err.value.reason == "bad_resume"
    assert chp.kthxbai_props() == b""
    assert chp.kthxbai_props(True, 0) == chp.RESUMED
    assert chp.kthxbai_props(False, 0) == chp.FULL_AFTER_RESUME
    assert chp.kthxbai_props(True, 9) == b"resume=1\nterm=9\n"
    assert chp.kthxbai_props(term=9) == b"term=9\n"
    assert chp.kthxbai_info(b"resume=1\nterm=9\n") [:4] == (True, 9, False, False)
    assert chp.kthxbai_info(b"resume=0\n") [:4] == (False, None, False, False)
    assert chp.kthxbai_info(b"") == (None, None, False, False, 0, False)
    assert chp.kthxbai_info(b"term=x\n")[:4] == (None, None, False, False)  # unreadable: absent
    # access control (shards.gate): a snapshot narrowed to the readable keys, or refused
    assert chp.kthxbai_info(chp.kthxbai_props(True, 3) + chp.NARROWED)[:4] == (True, 3, True, False)
    assert chp.kthxbai_info(chp.REFUSED_READ)[:4] == (None, None, False, True)


def test_strict_decoding_refuses_the_reference_c_servers_dialect():
    kvsync = [b"/k", chp.pack_seq(5), b"U" * 16, b"ttl=0\n", b"v"]
    hugz = [b"HUGZ", chp.pack_seq(9), b"", b"", b""]
    with pytest.raises(ProtocolError, match="frame 2 must be empty"):
        chp.decode_snapshot(kvsync)
    with pytest.raises(ProtocolError, match="reserved"):
        chp.decode_update(hugz)


def test_liberal_decoding_reads_the_reference_c_servers_dialect():
    kvsync = chp.decode_snapshot([b"/k", chp.pack_seq(5), b"U" * 16, b"ttl=1700000000123\n",
                                  b"v"], strict=False)
    assert kvsync == chp.Kvsync(b"/k", 5, b"v", b"U" * 16, b"ttl=1700000000123\n")
    plain = chp.decode_snapshot(chp.kvsync(b"/k", b"v", 3), strict=False)
    assert plain == chp.Kvsync(b"/k", 3, b"v")
    hugz = chp.decode_update([b"HUGZ", chp.pack_seq(9), b"", b"", b""], strict=False)
    assert hugz == chp.Hugz(b"", 9) and chp.hugz_info(hugz) == (None, 9, True, "", "", False, 0, 0)
    assert chp.decode_snapshot(chp.kthxbai(4, b""), strict=False) == chp.Kthxbai(4, b"")
    # still refused, liberal or not: a bad UUID, bad properties, a value in a HUGZ
    for frames in ([b"/k", chp.pack_seq(1), b"abc", b"", b"v"],
                   [b"/k", chp.pack_seq(1), b"", b"no-equals\n", b"v"]):
        with pytest.raises(ProtocolError):
            chp.decode_snapshot(frames, strict=False)
    with pytest.raises(ProtocolError):
        chp.decode_update([b"HUGZ", chp.pack_seq(9), b"", b"", b"body"], strict=False)


@given(st.lists(st.binary(max_size=40), min_size=0, max_size=7))
def test_liberal_decoding_of_garbage_raises_nothing_but_protocol_error(frames):
    for decode in (chp.decode_snapshot, chp.decode_update):
        try:
            decode(frames, strict=False)
        except ProtocolError:
            pass


def test_an_adoption_claim_and_its_answer_travel_in_the_extension_frames():
    """``adopt=<gen>:<seq>:<epoch>,...`` (a client that holds the maps an added shard was
    copied from asks to adopt its keys) and the KTHXBAI's ``adopted=1`` and ``epoch=``;
    a malformed claim is a protocol error with its own reason."""
    frames = chp.icanhaz(b"", meta=True, adopt={"g1": (120, 1), "g2": (7, 1)})
    assert frames[2] == b"adopt=g1:120:1,g2:7:1\nmeta=1\n"
    request = chp.decode_icanhaz(frames)
    assert request.adopt == {"g1": (120, 1), "g2": (7, 1)} and request.meta
    assert request.since is None and request.move is None
    for bad in (b"adopt=g1:120\n", b"adopt=:1:1\n", b"adopt=g1:x:1\n", b"adopt=g1:1:-1\n"):
        with pytest.raises(ProtocolError) as err:
            chp.decode_icanhaz([chp.ICANHAZ, b"", bad])
        assert err.value.reason == "bad_adopt"
    info = chp.kthxbai_info(chp.kthxbai_props(True, 4, epoch=2) + chp.ADOPTED)
    assert (info.resumed, info.term, info.epoch, info.adopted) == (True, 4, 2, True)
    assert chp.kthxbai_info(b"epoch=x\n").epoch == 0  # unreadable: absent


def test_a_move_s_copy_names_its_shard_and_its_pace():
    """``move=<index>`` (a move's copy), with ``pace=<bytes per second>`` when the copy
    is paced: the source sends no faster. A pace that is not a count is a protocol error;
    0 or absent: unpaced."""
    frames = chp.icanhaz(b"/p/", move=2, pace=4 << 20)
    assert frames[2] == b"move=2\npace=4194304\n"
    request = chp.decode_icanhaz(frames)
    assert (request.subtree, request.move, request.pace) == (b"/p/", 2, 4 << 20)
    assert chp.icanhaz(b"", move=1)[2] == b"move=1\n"
    assert chp.decode_icanhaz(chp.icanhaz(b"", move=1)).pace is None
    assert chp.decode_icanhaz([chp.ICANHAZ, b"", b"move=1\npace=0\n"]).pace is None
    for bad in (b"move=1\npace=x\n", b"move=1\npace=-5\n"):
        with pytest.raises(ProtocolError) as err:
            chp.decode_icanhaz([chp.ICANHAZ, b"", bad])
        assert err.value.reason == "bad_move"
