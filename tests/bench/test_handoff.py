"""Where a watch callback runs (``Clone(deliver=...)``), and bench.handoff's smoke run.

``deliver="inline"``: on the client's loop thread, values decoded; ``"thread"`` (the
default): on the watch's own dispatcher thread. Both against a real server, both see the
items, the ``synced`` marker and live changes in order. The smoke run's record (every
mode, workers included) is checked with ``bench all --smoke`` in test_bench_scenarios.py.
"""
from __future__ import annotations

import queue
import threading

import pytest

from clonemap.client.api import Clone

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 10.0


@pytest.fixture
def server(procs, port_base):
    procs.python("-m", "clonemap.shards", "--port", str(port_base), "--heartbeat-s", "0.2",
                 "--log-level", "info", ready="READY")
    return f"tcp://127.0.0.1:{port_base}"


@pytest.mark.parametrize("deliver, thread_prefix", [("inline", "clonemap-client"),
                                                    ("thread", "clonemap-watch")])
def test_a_callback_runs_where_deliver_says(server, deliver, thread_prefix):
    got: "queue.Queue[tuple[str, str, object, str]]" = queue.Queue()

    def on_change(change) -> None:
        got.put((change.kind, change.key, change.value, threading.current_thread().name))

    with Clone(server, subtree="/h/", codec="msgpack", deliver=deliver) as clone:
        clone.set("/h/a", {"n": 1}, wait=True)
        with clone.watch("/h/", callback=on_change) as w:
            assert w.deliver == deliver
            clone.set("/h/b", [1, 2], wait=True)
            clone.delete("/h/a", wait=True)
            seen = [got.get(timeout=DEADLINE_S) for _ in range(4)]
    assert [s[:3] for s in seen] == [("put", "/h/a", {"n": 1}), ("synced", "/h/", None),
                                     ("put", "/h/b", [1, 2]), ("delete", "/h/a", None)]
    assert all(s[3].startswith(thread_prefix) for s in seen), seen


def test_deliver_is_checked(server):
    with pytest.raises(ValueError, match="deliver"):
        Clone(server, deliver="process")
    with Clone(server) as clone:
        with pytest.raises(ValueError, match="needs a callback"):
            clone.watch("", deliver="inline")
