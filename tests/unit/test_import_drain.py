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
