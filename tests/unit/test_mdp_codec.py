"""18/MDP v0.2 codec: exact frames, every validation rule, and property tests (no zmq)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.mdp import codec as mdp


# ------------------------------------------------------------------ exact frames

def test_builders_put_the_spec_frames_on_the_wire():
    assert mdp.client_request(b"echo", b"a", b"b") == [b"MDPC02", b"\x01", b"echo", b"a", b"b"]
    assert mdp.client_partial(b"echo", b"p") == [b"MDPC02", b"\x02", b"echo", b"p"]
    assert mdp.client_final(b"echo", b"f") == [b"MDPC02", b"\x03", b"echo", b"f"]
    assert mdp.ready(b"echo") == [b"MDPW02", b"\x01", b"echo"]
    assert mdp.worker_request(b"\x00ABCD", b"x") == [b"MDPW02", b"\x02", b"\x00ABCD", b"", b"x"]
    assert mdp.worker_partial(b"\x00ABCD", b"x") == [b"MDPW02", b"\x03", b"\x00ABCD", b"", b"x"]
    assert mdp.worker_final(b"\x00ABCD", b"x") == [b"MDPW02", b"\x04", b"\x00ABCD", b"", b"x"]
    assert mdp.heartbeat() == [b"MDPW02", b"\x05"]
    assert mdp.disconnect() == [b"MDPW02", b"\x06"]


def test_an_empty_body_is_sent_as_one_empty_frame():
    assert mdp.client_request(b"echo") == [b"MDPC02", b"\x01", b"echo", b""]
    assert mdp.worker_final(b"C") == [b"MDPW02", b"\x04", b"C", b"", b""]


def test_decode_client_commands():
    msg = mdp.decode_client([b"MDPC02", b"\x01", b"svc", b"1", b"2"])
    assert msg == mdp.ClientMessage(mdp.C_REQUEST, b"svc", [b"1", b"2"])
    assert mdp.decode_client(mdp.client_partial(b"svc", b"")).command == mdp.C_PARTIAL
    assert mdp.decode_client(mdp.client_final(b"svc", b"z")).body == [b"z"]


def test_decode_worker_commands():
    assert mdp.decode_worker(mdp.ready(b"svc")) == mdp.WorkerMessage(mdp.W_READY, b"svc")
    req = mdp.decode_worker(mdp.worker_request(b"CL", b"a", b"b"))
    assert (req.command, req.client, list(req.body)) == (mdp.W_REQUEST, b"CL", [b"a", b"b"])
    assert mdp.decode_worker(mdp.heartbeat()).command == mdp.W_HEARTBEAT
    assert mdp.decode_worker(mdp.disconnect()).command == mdp.W_DISCONNECT


# ------------------------------------------------------------------ each rule, each reason

def reason_of(frames, decoder=mdp.decode):
    with pytest.raises(ProtocolError) as info:
        decoder(frames)
    assert info.value.protocol == "18/MDP"
    return info.value.reason, info.value.command


@pytest.mark.parametrize("frames, reason, command", [
    ([], "frame_count", ""),
    ([b"MDPC01", b"\x01", b"svc", b"x"], "bad_header", ""),
    ([b"", b"MDPC01", b"svc", b"x"], "leading_empty_frame", ""),
    ([b"", b"MDPC02", b"\x01", b"svc", b"x"], "leading_empty_frame", ""),
    ([b"MDPC02"], "frame_count", ""),
    ([b"MDPC02", b"\x04", b"svc", b"x"], "bad_command", ""),
    ([b"MDPC02", b"\x01\x01", b"svc", b"x"], "bad_command", ""),
    ([b"MDPC02", b"", b"svc", b"x"], "bad_command", ""),
    ([b"MDPC02", b"\x01", b"svc"], "frame_count", "REQUEST"),  # no body frame
    ([b"MDPC02", b"\x03", b"svc"], "frame_count", "FINAL"),
    ([b"MDPC02", b"\x01", b"", b"x"], "bad_service", "REQUEST"),
    ([b"MDPC02", b"\x01", b"a\nb", b"x"], "bad_service", "REQUEST"),
    ([b"MDPC02", b"\x01", b"\xff\xfe", b"x"], "bad_service", "REQUEST"),
    ([b"MDPC02", b"\x01", b"s" * 256, b"x"], "bad_service", "REQUEST"),
    ([b"MDPW02", b"\x00"], "bad_command", ""),
    ([b"MDPW02", b"\x07"], "bad_command", ""),
    ([b"MDPW02", b"\x01"], "frame_count", "READY"),
    ([b"MDPW02", b"\x01", b"svc", b"x"], "frame_count", "READY"),
    ([b"MDPW02", b"\x01", b"\x00"], "bad_service", "READY"),
    ([b"MDPW02", b"\x05", b""], "frame_count", "HEARTBEAT"),
    ([b"MDPW02", b"\x06", b"x"], "frame_count", "DISCONNECT"),
    ([b"MDPW02", b"\x04", b"CL", b""], "frame_count", "FINAL"),  # no body frame
    ([b"MDPW02", b"\x03", b"CL", b"x", b"body"], "missing_delimiter", "PARTIAL"),
    ([b"MDPW02", b"\x02", b"", b"", b"body"], "bad_address", "REQUEST"),
    ([b"MDPW02", b"\x04", b"A" * 256, b"", b"body"], "bad_address", "FINAL"),
    ([b"MDPW02", b"\x04", b"CL", b"", *([b"x"] * 57)], "oversize_body", "FINAL"),
])
def test_each_fault_is_named(frames, reason, command):
    assert reason_of(frames) == (reason, command)


def test_body_bytes_are_bounded():
    limits = mdp.Limits(max_body_bytes=10)
    with pytest.raises(ProtocolError) as info:
        mdp.decode_client(mdp.client_request(b"s", b"12345", b"123456"), limits)
    assert info.value.reason == "oversize_body"
    assert mdp.decode_client(mdp.client_request(b"s", b"12345", b"12345"), limits).body == [
        b"12345", b"12345"]


def test_decoders_do_not_cross_sub_protocols():
    assert reason_of(mdp.ready(b"s"), mdp.decode_client)[0] == "bad_header"
    assert reason_of(mdp.client_request(b"s", b"x"), mdp.decode_worker)[0] == "bad_header"


def test_printable_unicode_service_names_are_accepted():
    name = "统计 s0".encode()
    assert mdp.decode_client(mdp.client_request(name, b"x")).service == name
    assert mdp.check_service(b"mmi.service") == b"mmi.service"


def test_command_name():
    assert mdp.command_name(mdp.MDPW, b"\x05") == "HEARTBEAT"
    assert mdp.command_name(mdp.MDPC, b"\x01") == "REQUEST"
    assert mdp.command_name(b"junk", b"\x01") == ""


# ------------------------------------------------------------------ properties

services = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), min_size=1,
                   max_size=40).map(str.encode)
bodies = st.lists(st.binary(max_size=64), min_size=1, max_size=8)
addresses = st.binary(min_size=1, max_size=32)

client_messages = st.builds(mdp.ClientMessage, st.sampled_from(list(mdp.CLIENT_COMMANDS)),
                            services, bodies)
worker_messages = st.one_of(
    st.builds(lambda s: mdp.WorkerMessage(mdp.W_READY, s), services),
    st.builds(lambda c, a, b: mdp.WorkerMessage(c, b"", a, b),
              st.sampled_from([mdp.W_REQUEST, mdp.W_PARTIAL, mdp.W_FINAL]), addresses, bodies),
    st.sampled_from([mdp.WorkerMessage(mdp.W_HEARTBEAT), mdp.WorkerMessage(mdp.W_DISCONNECT)]),
)


@given(st.one_of(client_messages, worker_messages))
def test_round_trip(message):
    frames = mdp.encode(message)
    decoded = mdp.decode(frames)
    assert decoded.command == message.command
    assert mdp.encode(decoded) == frames
    assert list(decoded.body) == list(message.body)


frame = st.one_of(st.binary(max_size=12), st.sampled_from(
    [b"MDPC02", b"MDPW02", b"MDPC01", b"", b"\x01", b"\x02", b"\x03", b"\x04", b"\x05",
     b"\x06", b"echo"]))


@settings(max_examples=500)
@given(st.lists(frame, max_size=9))
def test_garbage_raises_only_protocol_error(frames):
    for decoder in (mdp.decode, mdp.decode_client, mdp.decode_worker):
        try:
            msg = decoder(frames)
        except ProtocolError as exc:
            assert exc.reason and exc.protocol == "18/MDP"
        else:
            assert mdp.encode(msg) == list(frames)


@given(st.one_of(client_messages, worker_messages), st.integers(0, 8), st.binary(max_size=3))
def test_mutated_valid_messages_never_raise_anything_else(message, index, junk):
    frames = mdp.encode(message)
    frames[index % len(frames)] = junk
    try:
        mdp.decode(frames)
    except ProtocolError:
        pass
