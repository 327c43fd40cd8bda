"""The two frame paths of ``clonemap.shards.common.zio`` (compiled and pure) keep every message
boundary: a short message, a long one, and one of 64+ frames between valid ones cost no
valid message, on a socket and in a real server's collector; and the pure path takes over
when the extension is disabled or missing.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import pytest
import zmq

from clonemap.shards.common import zio
from conftest import FRAME_PATHS, ROOT, free_port_base
from test_server_conformance import SEQ, Peer
from test_server_hostile import stats_now

VALID = [b"/ok/1", b"\0" * 8, b"", b"", b"v1"]
SHORT = [b"/short", b"\0" * 8]
LONG = [b"/long", b"\0" * 8, b"", b"", b"v", b"extra"]
MANY = [b"m"] * 70


def valid(i: int) -> list[bytes]:
    return [b"/ok/%d" % i, b"\0" * 8, b"", b"", b"v%d" % i]


def burst() -> list[list[bytes]]:
    """Valid messages with each kind of misfit between two of them."""
    return [valid(0), SHORT, valid(1), LONG, valid(2), MANY, valid(3), [b""], valid(4)]


def expected(sent: list[list[bytes]]) -> list[list[bytes]]:
    return [frames[:zio.MAX_FRAMES + 1] for frames in sent]


def pair(zctx):
    pull = zctx.socket(zmq.PULL)
    pull.rcvhwm = 0
    port = free_port_base(1)
    pull.bind(f"tcp://127.0.0.1:{port}")
    push = zctx.socket(zmq.PUSH)
    push.sndhwm = 0
    push.connect(f"tcp://127.0.0.1:{port}")
    return push, pull


def test_recv_frames_keeps_every_boundary(zctx, frame_path):
    push, pull = pair(zctx)
    sent = burst() * 3
    for frames in sent:
        zio.send_frames(push, frames, 0)
    got = []
    while len(got) < len(sent):
        assert pull.poll(5000)
        got.append(zio.recv_frames(pull))
    assert got == expected(sent)
    with pytest.raises(zmq.Again):
        zio.recv_frames(pull)


def test_async_socket_drains_every_message_whole(zctx, frame_path):
    push, pull = pair(zctx)
    sent = burst() * 200

    async def main():
        loop = asyncio.get_running_loop()
        got, done = [], loop.create_future()

        def on_message(frames):
            got.append(frames)
            if frames == [b"boom"]:
                raise RuntimeError("a handler bug")
            if len(got) == len(sent) + 1 and not done.done():
                done.set_result(None)

        reader = zio.AsyncSocket(pull, on_message, batch=64)
        assert (reader._drain is not None) == (frame_path == "compiled")
        for frames in sent[:len(sent) // 2]:
            zio.send_frames(push, frames, 0)
        zio.send_frames(push, [b"boom"], 0)  # the handler raises: counted, the drain goes on
        for frames in sent[len(sent) // 2:]:
            zio.send_frames(push, frames, 0)
        await asyncio.wait_for(done, 10)
        reader.close()
        return got, reader

    got, reader = asyncio.run(main())
    want = expected(sent)
    assert got == want[:len(sent) // 2] + [[b"boom"]] + want[len(sent) // 2:]
    assert reader.errors == 1 and reader.received == len(sent) + 1


def test_a_handler_that_closes_its_socket_ends_the_drain(zctx, frame_path):
    push, pull = pair(zctx)
    for i in range(50):
        zio.send_frames(push, valid(i), 0)

    async def main():
        loop = asyncio.get_running_loop()
        got, done = [], loop.create_future()
        reader = None

        def on_message(frames):
            got.append(frames)
            if len(got) == 3:
                reader.close()
                loop.call_soon(done.set_result, None)

        assert pull.poll(5000)
        reader = zio.AsyncSocket(pull, on_message, batch=256)
        await asyncio.wait_for(done, 10)
        return got

    got = asyncio.run(main())
    assert got == [valid(0), valid(1), valid(2)] and pull.closed


@pytest.mark.parametrize("path", FRAME_PATHS)
def test_a_server_loses_no_valid_update_around_misfit_messages(procs, port_base, zctx, path):
    """Through a real server's collector: each misfit is dropped and counted
    ``frame_count``; every valid KVSET is published, in order, with consecutive
    sequences."""
    env = {"CLONEMAP_PURE": "1"} if path == "pure" else {"CLONEMAP_PURE": "0"}
    server = procs.python("-m", "clonemap.shards", "--port", str(port_base), "--heartbeat-s", "0.2",
                          ready="READY", env=env)
    peer = Peer(zctx, port_base, subscribe=(b"/ok/", b"/probe/"))
    base = peer.sync()
    rounds = 50
    for _ in range(rounds):
        for frames in burst():
            peer.send_raw(frames)
    got = []
    for _ in range(rounds * 5):
        got.append(peer.recv_update())
    want = [[b"/ok/%d" % (i % 5), SEQ.pack(base + 1 + i), b"", b"", b"v%d" % (i % 5)]
            for i in range(rounds * 5)]
    assert got == want
    stats = stats_now(server)
    assert stats["drops"] == {"frame_count": rounds * 4}
    assert stats["frame_path"] == ("compiled" if path == "compiled" else
                                   "pure (CLONEMAP_PURE is set)")


PROBE = "from shards.common import zio; print(zio.FRAME_PATH)"


def frame_path_of(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "CLONEMAP_PURE"}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, check=True,
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_the_pure_path_takes_over_when_the_extension_is_missing():
    """As on a machine without a compiler: the import of ``_zframes`` fails."""
    blocked = "import sys; sys.modules['clonemap.shards.common._zframes'] = None\n" + PROBE
    assert frame_path_of(blocked).startswith("pure (the compiled extension is not built")
    assert frame_path_of(PROBE, CLONEMAP_PURE="1") == "pure (CLONEMAP_PURE is set)"


def test_the_extension_is_built_where_a_compiler_is():
    """``make venv`` builds it (pyproject's optional ext-module): a silent build failure
    on a machine with a compiler would leave every server on the slower path."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        assert frame_path_of(PROBE).startswith("pure")
    else:
        assert frame_path_of(PROBE) == "compiled"


def test_publisher_many_sends_a_burst_whole_and_in_order(zctx, frame_path):
    push, pull = pair(zctx)
    burst_ = [valid(i) for i in range(300)] + [SHORT, MANY[:3]]
    zio.publisher_many(push)(burst_)
    got = []
    while len(got) < len(burst_):
        assert pull.poll(5000)
        got.append(zio.recv_frames(pull))
    assert got == burst_
    with pytest.raises(TypeError):  # a frame that is not bytes: an error, not a crash
        zio.publisher_many(push)([[b"ok", 42]])
    zio.publisher_many(push)([valid(7)])  # and no half message went out before it
    assert pull.poll(5000) and zio.recv_frames(pull) == valid(7)


def test_publisher_many_sends_a_flat_burst_width_frames_to_a_message(zctx, frame_path):
    """The server's held KVPUBs and its resume history are one flat list of frames; a
    burst of them goes out as whole messages, and a malformed burst as none of it."""
    push, pull = pair(zctx)
    send_flat = zio.publisher_many(push, 5)
    messages = [valid(i) for i in range(300)]
    send_flat([frame for message in messages for frame in message])
    got = []
    while len(got) < len(messages):
        assert pull.poll(5000)
        got.append(zio.recv_frames(pull))
    assert got == messages
    with pytest.raises(ValueError):  # 7 frames are not whole messages of 5
        send_flat(valid(1) + [b"x", b"y"])
    with pytest.raises(TypeError):   # a frame that is not bytes: refused before it goes
        send_flat(valid(2)[:4] + [42])
    send_flat(valid(3))
    assert pull.poll(5000) and zio.recv_frames(pull) == valid(3)  # nothing went before


def test_send_rows_stops_whole_at_the_high_water_mark_and_resumes_in_order(zctx):
    """The compiled snapshot sender (``zio.send_rows``; the pure path sends row by row,
    checked through real servers in ``test_a_snapshot_is_whole_on_either_path``): a peer
    that does not read makes it return early, never raise and never leave half a row;
    sending on from where it stopped delivers every row once, in order."""
    if zio.send_rows is None:
        assert not zio.COMPILED  # the pure path has no such call: nothing to check here
        return
    router = zctx.socket(zmq.ROUTER)
    router.router_mandatory = 1
    router.sndhwm = 20
    port = free_port_base(1)
    router.bind(f"tcp://127.0.0.1:{port}")
    dealer = zctx.socket(zmq.DEALER)
    dealer.rcvhwm = 20
    dealer.identity = b"peer"
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    assert router.poll(5000) and router.recv_multipart() == [b"peer", b"hello"]
    n = 5000
    keys = [b"/k/%d" % i for i in range(n)]
    values = [b"v" * (i % 50) for i in range(n)]
    seqs = [i * 0x0102030405 if i < n - 1 else 2**64 - 1 for i in range(n)]
    props = [b"ttl=1\n" if i % 7 == 0 else b"" for i in range(n)]
    sent, stops, got = 0, 0, []
    while sent < n:
        nxt = zio.send_rows(router.underlying, b"peer", keys, values, seqs, props, sent, n)
        assert sent <= nxt <= n
        stops += nxt < n
        sent = nxt
        while dealer.poll(0 if sent < n else 200):
            got.append(dealer.recv_multipart())
    while len(got) < n and dealer.poll(5000):
        got.append(dealer.recv_multipart())
    assert stops > 0  # the mark was reached, and no exception came of it
    assert got == [[keys[i], SEQ.pack(seqs[i]), b"", props[i], values[i]] for i in range(n)]
    # one props frame for every row (the common snapshot: no TTLs asked for)
    assert zio.send_rows(router.underlying, b"peer", keys, values, seqs, b"", 3, 5) == 5
    assert [dealer.recv_multipart() for _ in range(2)] == [
        [keys[i], SEQ.pack(seqs[i]), b"", b"", values[i]] for i in (3, 4)]
    with pytest.raises(TypeError):  # a value that is not bytes: an error, rows before it sent
        zio.send_rows(router.underlying, b"peer", keys[:2], [values[0], "v"], seqs, b"", 0, 2)
    assert dealer.poll(5000) and dealer.recv_multipart()[0] == keys[0]
    with pytest.raises(OverflowError):  # a sequence that 8 bytes cannot hold
        zio.send_rows(router.underlying, b"peer", keys, values, [-1], b"", 0, 1)
    assert not dealer.poll(200)  # nothing of that row went out
    assert zio.send_rows(router.underlying, b"peer", keys, values, seqs, b"", 10, 5) == 10
    assert zio.send_rows(router.underlying, b"peer", keys[:3], values, seqs, b"", 0, 9) == 3


@pytest.mark.parametrize("path", FRAME_PATHS)
def test_a_snapshot_is_whole_on_either_path(procs, port_base, zctx, path):
    """A real server on each frame path streams 30,000 keys to a requester whose pipe
    holds 100 messages (the server meets the mark and waits, again and again): every key
    arrives once, with its value and its own sequence, then KTHXBAI at the server's
    sequence."""
    from clonemap.shards.common.proto import chp

    env = {"CLONEMAP_PURE": "1"} if path == "pure" else {"CLONEMAP_PURE": "0"}
    procs.python("-m", "clonemap.shards", "--port", str(port_base), ready="READY", env=env)
    peer = Peer(zctx, port_base)
    peer.sync()
    for i in range(30000):
        peer.kvset(b"/s/%d" % i, b"x" * (1 + i % 300))  # (an empty value deletes)
    last = peer.sync()
    dealer = zctx.socket(zmq.DEALER)
    dealer.rcvhwm = 100
    dealer.connect(f"tcp://127.0.0.1:{port_base}")
    dealer.send_multipart(chp.icanhaz(b"/s/"))
    got = {}
    while True:
        assert dealer.poll(10000), f"{len(got)} keys, then nothing"
        msg = chp.decode_snapshot(dealer.recv_multipart())
        if isinstance(msg, chp.Kthxbai):
            break
        assert msg.key not in got
        got[msg.key] = (msg.value, msg.seq)
    assert msg.seq == last
    assert len(got) == 30000
    assert all(got[b"/s/%d" % i][0] == b"x" * (1 + i % 300) for i in range(30000))
    assert len({seq for _, seq in got.values()}) == 30000  # each key's own sequence
