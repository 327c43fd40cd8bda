"""Writes awaiting their echo (``clonemap.client.echoes.Echoes``): what is confirmed, and what is
sent again after an outage (every write still waiting, in order, with its own frames)."""
from __future__ import annotations

import asyncio

from clonemap.client.echoes import Echoes


def test_after_an_outage_the_writes_still_waiting_are_resent_in_order():
    loop = asyncio.new_event_loop()
    try:
        echoes = Echoes()
        frames = {u: [b"/k" + u, b"", u, b"", b"v" + u] for u in (b"1", b"2", b"3", b"4")}
        futs = {u: echoes.expect(loop, u, f[0], f[4], f) for u, f in frames.items()}
        echoes.confirm(b"1", 10)                         # its KVPUB arrived
        echoes.confirm_in({b"/k2": b"v2"}, 11)           # a snapshot already holds it
        futs[b"4"].cancel()                              # the caller gave up (timeout)
        loop.run_until_complete(asyncio.sleep(0))        # done callbacks run
        assert futs[b"1"].result() == 10 and futs[b"2"].result() == 11
        assert echoes.unconfirmed() == [frames[b"3"]]
        assert echoes.resent == 1
        echoes.confirm(b"3", 12)
        loop.run_until_complete(asyncio.sleep(0))
        assert echoes.unconfirmed() == [] and len(echoes) == 0 and echoes.frames == {}
    finally:
        loop.close()
