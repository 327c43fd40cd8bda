"""A move's copy on its target (``clonemap.shards.migrate.Import``): the source's updates
queued while the snapshot came are applied after it, ``DRAIN_CHUNK`` a loop turn, in
order, with what the source publishes meanwhile queued behind them; the copy says
``copied`` only once they are all applied. (A serving target, a shrink's, applied them
all in one loop turn: about 33,000 updates of a 20 s copy in ``bench reshard --change
shrink``, half a second in which its own writes waited.) The copy's messages are handed
to it as its sockets would; no socket is opened."""
from __future__ import annotations

import asyncio

from clonemap.shards import migrate
from clonemap.shards.common.proto import chp


def one_turn(loop: asyncio.AbstractEventLoop) -> None:
    """Run the callbacks ready now (those they schedule wait for the next turn)."""
    loop.call_soon(loop.stop)
    loop.run_forever()


def test_the_updates_queued_during_the_snapshot_are_applied_a_chunk_a_turn_in_order():
    loop = asyncio.new_event_loop()
    try:
        staged: list[tuple[bytes, bytes]] = []
        flushes: list[int] = []
        imp = migrate.Import(None, loop, "tcp://127.0.0.1:1", b"/m/", chp.DEFAULT_LIMITS,
                             stage=lambda k, v, e: staged.append((k, v)),
                             flush=lambda: flushes.append(len(staged)))
        imp._live = True  # (the publisher's welcome came; the TTL table was asked)
        queued = migrate.DRAIN_CHUNK * 2 + 10
        for seq in range(11, 11 + queued):  # published while the snapshot came
            imp._on_update(chp.kvpub(b"/m/%d" % seq, seq, b"v%d" % seq))
        imp._on_reply(chp.kvsync(b"/m/snap", b"s", 10))
        imp._on_reply(chp.kthxbai(10, b"/m/"))
        assert imp.snapshot_seq == 10 and not imp.copied
        assert staged == [(b"/m/snap", b"s")]  # (nothing queued applied in that turn)

        turns = 0
        while not imp.copied:
            one_turn(loop)
            turns += 1
            if turns == 1:  # the source goes on publishing: behind the queue
                assert len(staged) == 1 + migrate.DRAIN_CHUNK
                imp._on_update(chp.kvpub(b"/m/late", 11 + queued, b"late"))
            assert turns < 10, "the queue was never drained"
        assert turns == 3 and flushes[-3:] == [1 + migrate.DRAIN_CHUNK,
                                               1 + 2 * migrate.DRAIN_CHUNK, 2 + queued]
        assert [k for k, _ in staged[1:]] == [b"/m/%d" % s for s in range(11, 11 + queued)
                                              ] + [b"/m/late"]
        assert imp.source_seq == 11 + queued and imp.updates == queued + 1
        imp._on_update(chp.kvpub(b"/m/after", 12 + queued, b"a"))  # copied: at once
        assert staged[-1] == (b"/m/after", b"a")
    finally:
        loop.close()


def test_a_copy_closed_while_it_drains_is_not_copied():
    loop = asyncio.new_event_loop()
    try:
        imp = migrate.Import(None, loop, "tcp://127.0.0.1:1", b"/m/", chp.DEFAULT_LIMITS,
                             stage=lambda k, v, e: None, flush=lambda: None)
        imp._live = True
        for seq in range(11, 11 + migrate.DRAIN_CHUNK * 3):
            imp._on_update(chp.kvpub(b"/m/%d" % seq, seq, b"v"))
        imp._on_reply(chp.kthxbai(10, b"/m/"))
        one_turn(loop)
        imp.close()  # (the move rolled back)
        one_turn(loop)
        assert not imp.copied and imp.updates == migrate.DRAIN_CHUNK
    finally:
        loop.close()


def test_the_queue_keeps_each_key_s_last_update_however_often_it_is_written():
    """While the snapshot comes, the queue holds each moving key's last update, so it is
    bounded by the keys that move, not by the writes' rate times the copy's length (a
    list of every update grew to 75,284 updates in a 30 s copy at 5,000 writes/s, and
    would grow without bound on a longer copy). After the snapshot the copy holds the
    same as if every update had been applied in order: an update the snapshot already
    holds is not applied over it, a key deleted last is deleted, and one written and
    deleted during the snapshot is never staged."""
    loop = asyncio.new_event_loop()
    try:
        staged: dict[bytes, bytes] = {}
        imp = migrate.Import(None, loop, "tcp://127.0.0.1:1", b"/m/", chp.DEFAULT_LIMITS,
                             stage=lambda k, v, e: staged.__setitem__(k, v) if v
                             else staged.pop(k, None), flush=lambda: None)
        imp._live = True
        seq = 0
        for seq in range(5, 10_005):  # (three keys written 10,000 times)
            imp._on_update(chp.kvpub(b"/m/k%d" % (seq % 3), seq, b"v%d" % seq))
        imp._on_update(chp.kvpub(b"/m/gone", seq + 1, b"x"))
        imp._on_update(chp.kvpub(b"/m/gone", seq + 2, b""))
        imp._on_update(chp.kvpub(b"/m/old", 3, b"older than the snapshot"))
        imp._on_update(chp.kvpub(b"/m/del", seq + 3, b""))
        imp._on_update(chp.hugz(1.0, seq + 10))
        assert imp.stats()["queued"] == 6  # (one update a key)
        imp._on_reply(chp.kvsync(b"/m/old", b"snap", 4))
        imp._on_reply(chp.kvsync(b"/m/del", b"snap", 4))
        imp._on_reply(chp.kvsync(b"/m/k0", b"snap", 4))
        imp._on_reply(chp.kthxbai(4, b"/m/"))
        while not imp.copied:
            one_turn(loop)
        assert staged == {b"/m/old": b"snap", b"/m/k0": b"v10002", b"/m/k1": b"v10003",
                          b"/m/k2": b"v10004"}
        assert imp.source_seq == seq + 10 and imp.stats()["queued"] == 0
    finally:
        loop.close()


def test_a_new_source_term_fails_the_copy_while_its_snapshot_comes():
    """A HUGZ with another Binary Star term (a new process at the source's address) fails
    the copy as it arrives, not once the snapshot is in."""
    loop = asyncio.new_event_loop()
    try:
        imp = migrate.Import(None, loop, "tcp://127.0.0.1:1", b"/m/", chp.DEFAULT_LIMITS,
                             stage=lambda k, v, e: None, flush=lambda: None)
        imp._live = True
        imp._on_update(chp.hugz(1.0, 5, term=7))
        assert imp.error == ""
        imp._on_update(chp.hugz(1.0, 6, term=8))
        assert imp.error == "the source's active changed under the copy (term 7 -> 8)"
    finally:
        loop.close()
