"""The broker's pure core: every rule with a fake clock and frames in memory (no zmq)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.mdp.broker_config import BrokerConfig
from clonemap.shards.common.mdp.broker_core import BrokerCore, Drop, InternalCall, Note

HB = 1.0
CFG = BrokerConfig(heartbeat_s=HB, liveness=3, request_expiry_s=5.0, max_queued=3)
C1, C2, C3 = b"\x00c1", b"\x00c2", b"\x00c3"
W1, W2, W3 = b"\x00w1", b"\x00w2", b"\x00w3"


def sends(effects):
    return [e for e in effects if isinstance(e, list)]


def drops(effects):
    return [e.reason for e in effects if isinstance(e, Drop)]


class Harness:
    """A core plus a fake clock; ``client``/``worker`` feed frames as the ROUTER would."""

    def __init__(self, config=CFG):
        self.core = BrokerCore(config)
        self.now = 100.0

    def client(self, ident, *frames):
        return self.core.on_message([ident, *frames], self.now)

    def request(self, ident, service, *body):
        return self.client(ident, *mdp.client_request(service, *body))

    def worker(self, ident, *frames):
        return self.core.on_message([ident, *frames], self.now)

    def ready(self, ident, service=b"echo"):
        return self.worker(ident, *mdp.ready(service))

    def tick(self, dt=0.0):
        self.now += dt
        return self.core.on_tick(self.now)


@pytest.fixture
def h():
    return Harness()


def test_request_goes_to_an_idle_worker_with_the_client_address(h):
    assert sends(h.ready(W1)) == []
    out = sends(h.request(C1, b"echo", b"a", b"b"))
    assert out == [[W1, b"MDPW02", b"\x02", C1, b"", b"a", b"b"]]


def test_partials_then_final_are_relayed_with_the_service_name(h):
    h.ready(W1)
    h.request(C1, b"echo", b"q")
    assert sends(h.worker(W1, *mdp.worker_partial(C1, b"p1"))) == [
        [C1, b"MDPC02", b"\x02", b"echo", b"p1"]]
    assert sends(h.worker(W1, *mdp.worker_partial(C1, b"p2", b"p2b"))) == [
        [C1, b"MDPC02", b"\x02", b"echo", b"p2", b"p2b"]]
    assert sends(h.worker(W1, *mdp.worker_final(C1, b"f"))) == [
        [C1, b"MDPC02", b"\x03", b"echo", b"f"]]
    assert h.core.counters["partials"] == 2 and h.core.counters["finals"] == 1
    # after FINAL the worker is idle again and takes the next request
    assert sends(h.request(C2, b"echo", b"q2"))[0][:4] == [W1, b"MDPW02", b"\x02", C2]


def test_workers_are_served_least_recently_used(h):
    for w in (W1, W2, W3):
        h.ready(w)
    order = []
    for client in (C1, C2, C3, C1, C2):
        (out,) = sends(h.request(client, b"echo", b"x"))
        worker = out[0]
        order.append(worker)
        h.worker(worker, *mdp.worker_final(client, b"y"))
    assert order == [W1, W2, W3, W1, W2]
    # a worker that just finished goes to the back
    (out,) = sends(h.request(C1, b"echo", b"x"))
    assert out[0] == W3


def test_queued_request_is_served_when_a_worker_arrives(h):
    assert h.request(C1, b"late", b"q") == []
    assert h.core.queued() == 1
    h.now += 1.0
    out = sends(h.ready(W1, b"late"))
    assert out == [[W1, b"MDPW02", b"\x02", C1, b"", b"q"]]
    assert h.core.queued() == 0


def test_queued_requests_expire_and_the_client_is_told_nothing(h):
    h.request(C1, b"ghost", b"old")
    assert sends(h.tick(4.9)) == []
    effects = h.tick(0.2)
    assert sends(effects) == [] and drops(effects) == ["request_expired"]
    h.request(C2, b"ghost", b"new")
    assert sends(h.ready(W1, b"ghost")) == [[W1, b"MDPW02", b"\x02", C2, b"", b"new"]]


def test_expired_requests_are_skipped_even_before_a_tick(h):
    h.request(C1, b"ghost", b"old")
    h.now += 6.0
    effects = h.ready(W1, b"ghost")
    assert drops(effects) == ["request_expired"] and sends(effects) == []
    assert sends(h.request(C2, b"ghost", b"new"))[0][3] == C2


def test_requests_behind_busy_workers_do_not_expire(h):
    h.ready(W1)
    h.request(C1, b"echo", b"long job")
    h.request(C2, b"echo", b"waits")
    for _ in range(8):  # 8 s > request_expiry_s, W1 busy but alive
        h.tick(1.0)
        h.worker(W1, *mdp.heartbeat())
    assert h.core.queued() == 1
    out = sends(h.worker(W1, *mdp.worker_final(C1, b"r")))
    assert out[1] == [W1, b"MDPW02", b"\x02", C2, b"", b"waits"]


def test_queues_are_bounded(h):
    for _ in range(3):
        assert h.request(C1, b"busy", b"x") == []
    assert drops(h.request(C1, b"busy", b"x")) == ["queue_full"]
    assert h.core.queued() == 3


def test_duplicate_ready_gets_disconnect_and_the_worker_is_forgotten(h):
    h.ready(W1)
    out = sends(h.ready(W1))
    assert out == [[W1, b"MDPW02", b"\x06"]]
    assert W1 not in h.core.workers
    assert h.core.counters["disconnect.duplicate_ready"] == 1
    assert h.request(C1, b"echo", b"x") == []  # queued: no worker left


def test_reply_without_request_gets_disconnect(h):
    h.ready(W1)
    assert sends(h.worker(W1, *mdp.worker_final(C1, b"f"))) == [[W1, b"MDPW02", b"\x06"]]
    assert W1 not in h.core.workers
    h.ready(W2)
    assert sends(h.worker(W2, *mdp.worker_partial(C1, b"p"))) == [[W2, b"MDPW02", b"\x06"]]


def test_reply_for_another_client_gets_disconnect_and_the_request_is_requeued(h):
    h.ready(W1)
    h.ready(W2)
    h.request(C1, b"echo", b"q")  # -> W1
    out = sends(h.worker(W1, *mdp.worker_final(C2, b"wrong")))
    assert out == [[W1, b"MDPW02", b"\x06"], [W2, b"MDPW02", b"\x02", C1, b"", b"q"]]
    assert h.core.counters["requeued"] == 1


def test_commands_from_unknown_peers(h):
    for frames in (mdp.heartbeat(), mdp.worker_final(C1, b"x"), mdp.worker_partial(C1, b"x")):
        assert sends(h.worker(W1, *frames)) == [[W1, b"MDPW02", b"\x06"]]
    assert h.worker(W1, *mdp.disconnect()) == []  # nothing sent after a DISCONNECT
    assert drops(h.worker(W1, *mdp.worker_request(C1, b"x"))) == ["wrong_direction"]
    assert h.core.workers == {}


def test_worker_disconnect_forgets_it_and_requeues_its_request(h):
    h.ready(W1)
    h.request(C1, b"echo", b"q")
    effects = h.worker(W1, *mdp.disconnect())
    assert sends(effects) == []
    assert W1 not in h.core.workers and h.core.queued() == 1
    assert sends(h.ready(W2)) == [[W2, b"MDPW02", b"\x02", C1, b"", b"q"]]


def test_stopping_disconnects_every_worker_and_counts_what_it_drops(h):
    h.ready(W1)
    h.ready(W2)
    h.ready(W3, b"other")
    h.request(C1, b"echo", b"in flight")
    h.request(C2, b"nobody", b"queued")
    out = h.core.on_stop()
    assert sorted(sends(out)) == [[w, b"MDPW02", b"\x06"] for w in (W1, W2, W3)]
    assert h.core.counters["dropped_on_stop"] == 2
    assert h.core.counters["disconnects_sent"] == 3
    assert h.core.workers == {} and h.core.queued() == 0
    assert sends(h.core.on_stop()) == []  # a second stop has nobody left to tell


def test_heartbeats_go_to_workers_not_recently_sent_to(h):
    h.ready(W1)
    h.ready(W2)
    h.tick(0.5)
    h.request(C1, b"echo", b"q")  # W1 gets a REQUEST at t+0.5
    out = sends(h.tick(0.5))
    assert out == [[W2, b"MDPW02", b"\x05"]]
    h.worker(W2, *mdp.heartbeat())
    out = sends(h.tick(0.5))
    assert out == [[W1, b"MDPW02", b"\x05"]]
    assert h.core.counters["heartbeats_sent"] == 2


def test_a_silent_worker_is_gone_and_its_request_goes_to_another(h):
    h.ready(W1)
    h.request(C1, b"echo", b"q")  # W1 busy
    h.ready(W2)
    for _ in range(5):
        h.tick(0.5)
        h.worker(W2, *mdp.heartbeat())  # W2 keeps talking, W1 is silent
    effects = h.tick(0.5)  # 3 s after W1's last message
    assert [W2, b"MDPW02", b"\x02", C1, b"", b"q"] in sends(effects)
    assert not any(e[0] == W1 for e in sends(effects))  # nothing sent to the dead worker
    assert W1 not in h.core.workers
    assert h.core.counters["workers_expired"] == 1 and h.core.counters["requeued"] == 1
    assert sends(h.worker(W2, *mdp.worker_final(C1, b"r"))) == [
        [C1, b"MDPC02", b"\x03", b"echo", b"r"]]


def test_any_worker_message_counts_as_a_heartbeat(h):
    h.ready(W1)
    for _ in range(10):
        h.request(C1, b"echo", b"q")
        h.now += 1.0
        h.worker(W1, *mdp.worker_final(C1, b"r"))
        h.tick()
    assert W1 in h.core.workers


def test_requeued_request_waits_if_no_worker_is_left(h):
    h.ready(W1)
    h.request(C1, b"echo", b"first")
    h.request(C2, b"echo", b"second")  # queued
    h.tick(3.0)  # W1 expires, "first" goes back to the FRONT of the queue
    assert h.core.queued() == 2
    assert sends(h.ready(W2)) == [[W2, b"MDPW02", b"\x02", C1, b"", b"first"]]


def test_invalid_messages_are_dropped_and_an_invalid_worker_forgotten(h):
    h.ready(W1)
    h.request(C1, b"echo", b"q")
    for frames in ([b"MDPW02", b"\x09"], [b"MDPW02", b"\x04", C1, b"nodelim", b"x"]):
        h.ready(W2)
        effects = h.worker(W2, *frames)
        assert drops(effects) and sends(effects) == []
        assert W2 not in h.core.workers
    effects = h.worker(W1, b"JUNK")
    assert drops(effects) == ["bad_header"]
    assert W1 not in h.core.workers and h.core.queued() == 1  # its request was re-queued
    assert h.core.counters["workers_invalid"] == 3


@pytest.mark.parametrize("frames, reason", [
    ([b""], "leading_empty_frame"),
    ([b"", b"MDPC02", b"\x01", b"echo", b"x"], "leading_empty_frame"),
    ([b"MDPC02", b"\x01", b"echo"], "frame_count"),
    ([b"MDPC02", b"\x07", b"echo", b"x"], "bad_command"),
    ([b"MDPC02", b"\x03", b"echo", b"x"], "wrong_direction"),
    ([b"MDPC02", b"\x01", b"bad\x00name", b"x"], "bad_service"),
    ([b"HELLO"], "bad_header"),
])
def test_invalid_client_messages_are_dropped(h, frames, reason):
    h.ready(W1)
    effects = h.client(C1, *frames)
    if reason == "leading_empty_frame" and len(frames) == 1:
        reason = "bad_header"  # a lone empty frame: nothing says it is MDP/0.1
    assert drops(effects) == [reason] and sends(effects) == []
    assert sends(h.request(C2, b"echo", b"ok"))[0][0] == W1  # still serving


def test_mmi_service(h):
    h.ready(W1)
    assert sends(h.request(C1, b"mmi.service", b"echo")) == [
        [C1, b"MDPC02", b"\x03", b"mmi.service", b"200"]]
    assert sends(h.request(C1, b"mmi.service", b"nobody"))[0][4] == b"404"
    assert sends(h.request(C1, b"mmi.nothing", b"x"))[0][4] == b"501"


def test_internal_services(h):
    h.core.add_internal(b"cluster.map")
    effects = h.request(C1, b"cluster.map", b"q")
    assert effects == [InternalCall(C1, b"cluster.map", [b"q"])]
    assert sends(h.request(C1, b"mmi.service", b"cluster.map"))[0][4] == b"200"
    # a worker may not take over a broker-hosted service
    assert sends(h.ready(W1, b"cluster.map")) == [[W1, b"MDPW02", b"\x06"]]
    assert sends(h.ready(W2, b"mmi.service")) == [[W2, b"MDPW02", b"\x06"]]


def test_services_and_workers_are_bounded():
    h = Harness(BrokerConfig(heartbeat_s=HB, max_services=2, max_workers=2, max_queued=5))
    h.request(C1, b"a", b"x")
    h.request(C1, b"b", b"x")
    assert drops(h.request(C1, b"c", b"x")) == ["too_many_services"]
    h.ready(W1, b"a")
    h.ready(W2, b"b")
    assert sends(h.ready(W3, b"a")) == [[W3, b"MDPW02", b"\x06"]]


def test_empty_services_are_forgotten_on_tick(h):
    h.request(C1, b"ghost", b"x")
    h.tick(6.0)
    assert b"ghost" not in h.core.services
    snap = h.core.snapshot()
    assert snap["queued"] == 0 and snap["counters"]["requests"] == 1


def test_lifecycle_notes(h):
    assert any(isinstance(e, Note) and e.event == "worker_ready" for e in h.ready(W1))
    effects = h.tick(3.5)
    assert any(isinstance(e, Note) and e.event == "worker_expired" for e in effects)


def test_the_expiry_clock_restarts_when_the_last_worker_leaves(h):
    h.ready(W1)
    h.request(C1, b"echo", b"long job")
    h.request(C2, b"echo", b"waits")  # queued behind the busy worker
    for _ in range(8):  # longer than request_expiry_s
        h.tick(1.0)
        h.worker(W1, *mdp.heartbeat())
    h.worker(W1, *mdp.disconnect())  # the service has no worker from now on
    assert drops(h.tick(4.9)) == [] and h.core.queued() == 2
    assert drops(h.tick(0.2)) == ["request_expired", "request_expired"]
    assert h.core.queued() == 0


def test_oversize_bodies_are_refused_on_the_hot_path_too():
    h = Harness(BrokerConfig(heartbeat_s=HB, limits=mdp.Limits(max_body_frames=3,
                                                               max_body_bytes=10)))
    h.ready(W1)
    for body in ([b"x"] * 4, [b"x" * 11], [b"x" * 6, b"y" * 6]):
        effects = h.request(C1, b"echo", *body)
        assert drops(effects) == ["oversize_body"] and sends(effects) == []
    assert sends(h.request(C1, b"echo", b"x" * 5, b"y" * 5))[0][0] == W1  # at the limits
    for body in ([b"x"] * 4, [b"x" * 11], [b"x" * 6, b"y" * 6]):
        h.ready(W2)
        (sent,) = sends(h.request(C2, b"echo", b"q"))
        assert sent[0] == W2
        effects = h.worker(W2, *mdp.worker_final(C2, *body))
        assert drops(effects) == ["oversize_body"] and not any(
            s[0] == C2 for s in sends(effects))  # nothing relayed
        assert W2 not in h.core.workers  # an invalid worker is forgotten...
        assert h.core.queued() == 1  # ...and its request waits for another
        h.core.services[b"echo"].requests.clear()
    assert h.core.counters["finals"] == 0 and h.core.counters["workers_invalid"] == 3


def test_a_final_with_a_bad_envelope_is_not_relayed(h):
    h.ready(W1)
    h.request(C1, b"echo", b"q")
    effects = h.worker(W1, b"MDPW02", b"\x04", C1, b"not-empty", b"r")
    assert drops(effects) == ["missing_delimiter"] and sends(effects) == []
    h.ready(W2)  # takes the re-queued request
    assert sends(h.worker(W2, *mdp.worker_final(C1, b"r"))) == [
        [C1, b"MDPC02", b"\x03", b"echo", b"r"]]


class _FullPathOnly(BrokerCore):
    def _fast_request(self, frames, n, now):
        return None

    def _fast_final(self, frames, n, now):
        return None


_WORKERS = st.sampled_from([b"\x00w1", b"\x00w2"])
_CLIENTS = st.sampled_from([b"\x00c1", b"\x00c2", b"\x00c3", b"\x00w1"])
_SERVICES = st.sampled_from([b"echo", b"echo", b"other", b"mmi.service"])
_BODY = st.lists(st.binary(max_size=5), min_size=0, max_size=4)
_DELIMITER = st.sampled_from([b"", b"", b"", b"x"])
_KINDS = st.sampled_from(["ready"] * 2 + ["request"] * 4 + ["answer"] * 4
                         + ["final", "partial", "heartbeat", "disconnect", "tick"])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_fast_paths_behave_exactly_like_the_full_path(data):
    """The same random traffic into a core with and without the fast paths."""
    config = BrokerConfig(heartbeat_s=HB, liveness=2, request_expiry_s=2.0, max_queued=3,
                          limits=mdp.Limits(max_body_frames=3, max_body_bytes=12))
    fast, full = BrokerCore(config), _FullPathOnly(config)
    now = 0.0
    for _ in range(data.draw(st.integers(5, 60))):
        kind = data.draw(_KINDS)
        if kind == "tick":
            now += data.draw(st.floats(min_value=0.0, max_value=1.5))
            assert fast.on_tick(now) == full.on_tick(now)
            continue
        if kind == "ready":
            frames = [data.draw(_WORKERS), *mdp.ready(data.draw(_SERVICES))]
        elif kind == "request":
            frames = [data.draw(_CLIENTS),
                      *mdp.client_request(data.draw(_SERVICES), *data.draw(_BODY))]
        elif kind in ("answer", "final", "partial"):
            ident = data.draw(_WORKERS)
            worker = fast.workers.get(ident)
            if kind == "answer" and worker is not None and worker.request is not None:
                client = worker.request.client  # a FINAL for the client it serves
            else:
                client = data.draw(_CLIENTS)
            cmd = mdp.W_PARTIAL if kind == "partial" else mdp.W_FINAL
            frames = [ident, b"MDPW02", cmd, client, data.draw(_DELIMITER),
                      *(data.draw(_BODY) or [b""])]
        else:
            frames = [data.draw(_WORKERS),
                      *(mdp.heartbeat() if kind == "heartbeat" else mdp.disconnect())]
        assert fast.on_message(frames, now) == full.on_message(frames, now), frames
        assert _state(fast) == _state(full)


def _state(core):
    """Everything the core keeps, as plain values."""
    workers = {i: (w.service.name, w.expires_at, w.sent_at,
                   w.request and (w.request.client, w.request.body, w.request.expires_at))
               for i, w in core.workers.items()}
    queues = {n: ([(r.client, r.body, r.expires_at) for r in svc.requests], list(svc.idle),
                  svc.workers) for n, svc in core.services.items()}
    return workers, queues, core.counters


# ------------------------------------------------------------------ byte budgets

BUDGET = BrokerConfig(heartbeat_s=HB, liveness=3, request_expiry_s=5.0, max_queued=1000,
                      max_held_bytes=10_000, max_held_bytes_per_client=4_000)


def test_held_request_bytes_are_bounded_per_client_and_in_all():
    """Requests for a service with no idle worker are held: in bytes, one client may hold
    ``max_held_bytes_per_client`` and all together ``max_held_bytes``; beyond, dropped and
    counted. Room comes back as requests leave the queue (dispatched or expired)."""
    h = Harness(BUDGET)
    big = b"x" * 3000
    assert drops(h.request(C1, b"slow", big)) == []
    assert drops(h.request(C1, b"slow", big)) == ["client_held_bytes"]
    for client in (C2, b"\x00c4"):
        assert drops(h.request(client, b"slow", big)) == []
    assert drops(h.request(b"\x00c5", b"slow", big)) == ["held_bytes"]
    core = h.core
    assert core.held_bytes == 3 * (3000 + len(C1) + len(b"slow"))
    h.ready(W1, b"slow")  # takes the first: C1's bytes are released
    assert core.held_by_client.get(C1) is None and core.held_bytes == 2 * 3007
    assert drops(h.request(C1, b"slow", big)) == []
    h.tick(BUDGET.worker_expiry_s + 1)
    # the silent worker is gone: its request was accepted once, so it is held again
    # (over the budget) for another worker, and the expiry clock starts now
    assert core.held_bytes == 4 * 3007
    h.tick(BUDGET.request_expiry_s + 1)
    assert core.held_bytes == 0 and core.held_by_client == {}
    assert core.snapshot()["held_bytes"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([C1, C2, C3]), st.integers(0, 2500),
                          st.sampled_from(["request", "ready", "tick", "final"])),
                max_size=40))
def test_held_bytes_always_equal_the_queued_requests(ops):
    h = Harness(BUDGET)
    for client, size, op in ops:
        if op == "request":
            h.request(client, b"svc", b"y" * size)
        elif op == "ready":
            h.ready(W1 + client, b"svc")
        elif op == "tick":
            h.tick(2.0)
        core = h.core
        queued = [r for svc in core.services.values() for r in svc.requests]
        # a request back from a worker that vanished is held over the budget (it was
        # accepted once); every other held request is within it
        assert core.held_bytes == sum(r.size for r in queued)
        assert sum(r.size for r in queued if not r.requeued) <= BUDGET.max_held_bytes
        assert len([r for r in queued if r.requeued]) <= core.counters["requeued"]
        per = {}
        for r in queued:
            per[r.client] = per.get(r.client, 0) + r.size
        assert core.held_by_client == per
