"""``bench.harness.resp``, the anchor writer's RESP client, against nodes of our own that
speak RESP over real sockets and answer as a cluster in the middle of a slot migration
does: MOVED, ASK, TRYAGAIN, an error, a reply in pieces, a connection that closes."""
from __future__ import annotations

import asyncio

import pytest

from bench.harness.resp import RespCluster, RespError, command, slot_table, split_replies
from conftest import free_port_base


def test_replies_split_anywhere_come_out_whole_and_in_order():
    stream = b"+OK\r\n-MOVED 7 127.0.0.1:20001\r\n$5\r\nhe\r\no\r\n$-1\r\n:12\r\n"
    whole, rest = split_replies(stream)
    assert whole == [b"+OK", b"-MOVED 7 127.0.0.1:20001", b"$he\r\no", None, b":12"]
    assert rest == b""
    for cut in range(len(stream)):  # every split of the stream in two reads
        first, rest = split_replies(stream[:cut])
        second, left = split_replies(rest + stream[cut:])
        assert first + second == whole and left == b"", cut
    with pytest.raises(RespError, match="unexpected reply type"):
        split_replies(b"?what\r\n")


def test_a_command_is_an_array_of_bulk_strings():
    assert command(b"SET", b"k", b"a\r\nb") == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n"


def test_the_slot_table_names_every_slot_s_primary_and_refuses_a_gap():
    table = slot_table([[0, 1, [b"127.0.0.1", 20001, b"id"]], [2, 3, ["h", 20002, "id", {}]]],
                       slots=4)
    assert table == [("127.0.0.1", 20001)] * 2 + [("h", 20002)] * 2
    with pytest.raises(RespError, match="2 slots have no owner"):
        slot_table([[0, 1, [b"127.0.0.1", 20001, b"id"]]], slots=4)


class Node:
    """A RESP node of our own: each command read is kept (``seen``) and answered by
    ``answer(args, node)``: the reply's bytes, or None to close the connection."""

    def __init__(self, answer):
        self.answer = answer
        self.seen: list[list[bytes]] = []
        self.server = None
        self.port = 0

    async def start(self) -> "Node":
        self.port = free_port_base(1)
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def _serve(self, reader, writer) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                assert line[:1] == b"*", line
                args = []
                for _ in range(int(line[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                self.seen.append(args)
                reply = self.answer(args, self)
                if reply is None:
                    writer.close()
                    return
                for i in range(len(reply)):  # (a byte a write: the client reads pieces)
                    writer.write(reply[i:i + 1])
                    await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        self.server.close()


def _run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_moved_sends_the_write_to_the_new_owner_and_remembers_it():
    async def scenario():
        new = await Node(lambda args, node: b"+OK\r\n").start()
        old = await Node(lambda args, node: b"-MOVED 2 127.0.0.1:%d\r\n" % new.port).start()
        cluster = RespCluster([("127.0.0.1", old.port)] * 4, key_slot=lambda key: 2)
        try:
            await cluster.set(b"k", b"v1")
            await cluster.set(b"k", b"v2")  # (straight to the new owner)
        finally:
            cluster.close()
            old.close()
            new.close()
        assert old.seen == [[b"SET", b"k", b"v1"]]
        assert new.seen == [[b"SET", b"k", b"v1"], [b"SET", b"k", b"v2"]]
        assert cluster.slots[2] == ("127.0.0.1", new.port)
        assert cluster.slots[1] == ("127.0.0.1", old.port)
        assert cluster.redirects == {"MOVED": 1}

    _run(scenario)


def test_ask_sends_asking_then_the_write_this_once_only():
    def importing(args, node):  # a write without ASKING first is not this node's yet
        asked = len(node.seen) > 1 and node.seen[-2] == [b"ASKING"]
        if args == [b"ASKING"] or asked:
            return b"+OK\r\n"
        return b"-MOVED 0 127.0.0.1:%d\r\n" % owner.port

    async def scenario():
        nonlocal owner
        target = await Node(importing).start()
        owner = await Node(lambda args, node: b"-ASK 0 127.0.0.1:%d\r\n" % target.port
                           ).start()
        cluster = RespCluster([("127.0.0.1", owner.port)], key_slot=lambda key: 0)
        try:
            await cluster.set(b"k", b"v")
            await cluster.set(b"k", b"w")
        finally:
            cluster.close()
            owner.close()
            target.close()
        assert target.seen == [[b"ASKING"], [b"SET", b"k", b"v"], [b"ASKING"],
                               [b"SET", b"k", b"w"]]
        assert owner.seen == [[b"SET", b"k", b"v"], [b"SET", b"k", b"w"]]
        assert cluster.slots == [("127.0.0.1", owner.port)]  # (ASK moves nothing)
        assert cluster.redirects == {"ASK": 2}

    owner = None
    _run(scenario)


def test_tryagain_is_sent_again_and_another_error_fails_the_write():
    def answer(args, node):
        if args[1] == b"busy" and len(node.seen) < 3:
            return b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n"
        if args[1] == b"bad":
            return b"-WRONGTYPE Operation against a key holding the wrong kind\r\n"
        if args[1] == b"bare":
            return b"-\r\n"
        return b"+OK\r\n"

    async def scenario():
        node = await Node(answer).start()
        cluster = RespCluster([("127.0.0.1", node.port)], key_slot=lambda key: 0)
        try:
            await cluster.set(b"busy", b"v")
            with pytest.raises(RespError, match="WRONGTYPE"):
                await cluster.set(b"bad", b"v")
            with pytest.raises(RespError, match="^-$"):
                await cluster.set(b"bare", b"v")
        finally:
            cluster.close()
            node.close()
        assert [args[1] for args in node.seen] == [b"busy"] * 3 + [b"bad", b"bare"]
        assert cluster.redirects == {"TRYAGAIN": 2, "WRONGTYPE": 1, "ERR": 1}

    _run(scenario)


def test_a_write_redirected_round_and_round_fails_after_the_bound():
    async def scenario():
        node = await Node(lambda args, node: b"-MOVED 0 127.0.0.1:%d\r\n" % node.port
                          ).start()
        cluster = RespCluster([("127.0.0.1", node.port)], key_slot=lambda key: 0)
        try:
            with pytest.raises(RespError, match="16 redirects or retries"):
                await cluster.set(b"k", b"v")
        finally:
            cluster.close()
            node.close()
        assert len(node.seen) == 16

    _run(scenario)


def test_a_connection_closed_fails_its_waiting_write_and_the_next_one_reconnects():
    async def scenario():
        node = await Node(lambda args, node: None if args[1] == b"drop" else b"+OK\r\n"
                          ).start()
        cluster = RespCluster([("127.0.0.1", node.port)], key_slot=lambda key: 0)
        try:
            with pytest.raises(ConnectionError, match="closed"):
                await cluster.set(b"drop", b"v")
            await cluster.set(b"k", b"v")
        finally:
            cluster.close()
            node.close()
        assert [args[1] for args in node.seen] == [b"drop", b"k"]

    _run(scenario)
