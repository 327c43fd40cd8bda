"""The reactor's outbox (``clonemap.shards.outbox``): what waits for its flush, what is
parked, and the sequence HUGZ may announce."""
from __future__ import annotations

from clonemap.shards.outbox import KVPUB_FRAMES, Batch, Outbox


def update(seq: int) -> tuple[bytes, ...]:
    return (f"/k/{seq}".encode(), seq.to_bytes(8, "big"), b"", b"", b"v")


def test_take_returns_everything_in_order_and_leaves_it_empty():
    box = Outbox()
    assert not box and box.pending == 0
    box.add(*update(1))
    box.updates += update(2)  # the hot path's form
    box.reply([b"writer", b"KVREPLY"])
    assert box and box.pending == 2
    batch = box.take(2, at=5.0)
    assert batch.count == 2 and batch.last_seq == 2 and batch.at == 5.0
    assert batch.updates == [*update(1), *update(2)]
    assert batch.replies == [[b"writer", b"KVREPLY"]]
    assert not box and box.take(2).count == 0


def test_a_held_batch_goes_back_in_front_of_what_came_since():
    box = Outbox()
    box.add(*update(1))
    box.reply([b"a"])
    held = box.take(1)
    box.add(*update(2))
    box.reply([b"b"])
    box.restore(held)
    again = box.take(2)
    assert again.updates == [*update(1), *update(2)]
    assert again.replies == [[b"a"], [b"b"]]


def test_published_seq_counts_out_what_waits_and_what_is_parked():
    box = Outbox()
    for seq in (1, 2, 3):
        box.add(*update(seq))
    assert box.published_seq(3) == 0
    batch = box.take(3)
    assert box.published_seq(3) == 3  # taken: published unless parked
    box.park(batch)
    assert box.published_seq(3) == 0
    box.add(*update(4))
    assert box.published_seq(4) == 0
    box.unpark(batch.count)
    assert box.published_seq(4) == 3
    box.unpark(10)  # never below zero
    assert box.parked == 0


def test_a_failed_log_write_answers_nobody():
    box = Outbox()
    box.add(*update(1))
    box.reply([b"a"])
    box.reply([b"b"])
    assert box.drop_replies() == 2
    assert box.replies == [] and box.pending == 1  # the update stays, never published


def test_an_empty_batch_is_false_and_counts_whole_updates():
    assert not Batch(0)
    assert Batch(1, list(update(1))).count == 1 == len(update(1)) // KVPUB_FRAMES
    assert Batch(0, replies=[[b"r"]])
