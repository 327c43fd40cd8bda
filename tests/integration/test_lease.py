"""``clonemap.shards.coord.Lease`` against a real etcd: one holder at a time, a released lease
passes at once, a holder that cannot renew loses it at its own deadline (before etcd lets
it go), and the other claimant acquires it only after that."""
from __future__ import annotations

import contextlib
import threading
import time
import uuid as uuidlib

import pytest

from conftest import EtcdServer
from clonemap.shards import coord

pytestmark = pytest.mark.timeout(60)
LEASE_S = 2.0


class Claimant:
    """A Lease whose changes are kept, each with the monotonic time it was seen."""

    def __init__(self, etcd, name: str, me: str):
        self.changes: list[tuple[float, coord.LeaseView]] = []
        self.changed = threading.Condition()
        self.lease = coord.Lease(coord.Etcd([(etcd.host, etcd.port)], timeout_s=0.5), name,
                                 me, lease_s=LEASE_S, on_change=self._on_change)
        self.lease.start()

    def _on_change(self, view: coord.LeaseView) -> None:
        with self.changed:
            self.changes.append((time.monotonic(), view))
            self.changed.notify_all()

    def wait(self, pred, what: str, timeout_s: float = 15.0, since: float = 0.0
             ) -> tuple[float, coord.LeaseView]:
        """The first change seen at or after ``since`` that ``pred`` accepts."""
        def first():
            return next((c for c in self.changes if c[0] >= since and pred(c[1])), None)
        with self.changed:
            found = self.changed.wait_for(first, timeout_s)
            assert found, f"{self.lease.me}: no {what} within {timeout_s} s: {self.changes}"
            return found


@pytest.fixture
def claimants():
    made = []

    def make(etcd, name, me):
        made.append(Claimant(etcd, name, me))
        return made[-1]
    yield make
    for claimant in made:
        claimant.lease.close()


def test_one_holder_at_a_time_and_a_release_passes_it_at_once(etcd_server, claimants):
    name = f"l-{uuidlib.uuid4().hex[:8]}"
    a, b = claimants(etcd_server, name, "a"), claimants(etcd_server, name, "b")
    a.lease.want(True)
    a.wait(lambda v: v.held, "acquire")
    b.lease.want(True)
    b.wait(lambda v: v.holder == "a" and not v.held, "refusal naming the holder")
    assert a.lease.valid(time.monotonic()) and not b.lease.valid(time.monotonic())
    released = time.monotonic()
    a.lease.want(False)
    at, _ = b.wait(lambda v: v.held, "acquire after the release", since=released)
    assert at - released < LEASE_S  # did not wait the lease out
    assert a.lease.counters["released"] == 1 and b.lease.counters["refused"] >= 1
    assert coord.Etcd([(etcd_server.host, etcd_server.port)]).get(
        coord.lease_key(name)) == b"b"


def test_a_holder_cut_from_etcd_is_fenced_at_its_own_deadline(tmp_path, claimants):
    etcd = EtcdServer(tmp_path / "etcd")
    try:
        name = f"l-{uuidlib.uuid4().hex[:8]}"
        a = claimants(etcd, name, "a")
        a.lease.want(True)
        a.wait(lambda v: v.held, "acquire")
        port = etcd.port
        etcd.stop()
        cut = time.monotonic()
        deadline = a.lease.view.valid_until
        at, view = a.wait(lambda v: not v.held and v.holder == "", "loss", since=cut)
        assert at >= deadline and deadline - cut <= LEASE_S  # fenced, within one lease
        assert not a.lease.valid(at) and a.lease.view.error
        # etcd returns: the fenced holder wants it still and gets it back
        back = time.monotonic()
        etcd = EtcdServer(tmp_path / "etcd", port=port)
        a.wait(lambda v: v.held and not v.error, "acquire after etcd returned", 30, back)
        assert a.lease.counters["lost"] == 1 and a.lease.counters["errors"] >= 1
    finally:
        etcd.stop()


def test_a_revoked_lease_still_wanted_comes_back_as_a_new_generation(etcd_server, claimants):
    """etcd revokes the holder's lease (a lapse, as an operator's `etcdctl lease revoke`
    makes one). Its next renewal finds it gone: a loss; still wanted, it is acquired again
    under a new grant, and the view says so by its generation, so that a loop which looks
    only after both can still tell the loss (``clonemap.shards.leased``)."""
    name = f"l-{uuidlib.uuid4().hex[:8]}"
    a = claimants(etcd_server, name, "a")
    a.lease.want(True)
    _, first = a.wait(lambda v: v.held, "acquire")
    assert first.generation == 1
    client = coord.Etcd([(etcd_server.host, etcd_server.port)])
    revoked = time.monotonic()
    client.revoke(a.lease.stats()["lease_id"])
    lost_at, _ = a.wait(lambda v: not v.held, "loss", since=revoked)
    _, again = a.wait(lambda v: v.held, "acquire again", since=lost_at)
    assert again.generation == 2 and a.lease.view.generation == 2
    assert a.lease.counters["lost"] == 1 and a.lease.counters["acquired"] == 2
    assert client.get(coord.lease_key(name)) == b"a"


def test_the_alone_record_is_written_only_by_the_holder_of_the_lease(etcd_server, claimants):
    """Going on alone is recorded under the lease: a server whose lease lapsed (revoked
    here) and whose peer took the lease meanwhile cannot name itself in the record."""
    name = f"l-{uuidlib.uuid4().hex[:8]}"
    a, b = claimants(etcd_server, name, "a"), claimants(etcd_server, name, "b")
    client = coord.Etcd([(etcd_server.host, etcd_server.port)])
    a.lease.want(True)
    a.wait(lambda v: v.held, "acquire")
    a.lease.record_alone()
    assert client.get(coord.alone_key(name)) == b"a"
    a.lease.clear_alone()
    assert client.get(coord.alone_key(name)) is None
    lease = a.lease.stats()["lease_id"]
    b.lease.want(True)  # refused while a holds it, tried again every 0.2 s
    revoked = time.monotonic()
    client.revoke(lease)
    b.wait(lambda v: v.held, "b's acquire once a's lease is gone", since=revoked)
    # the write a server makes, under the lease it held: refused now that b holds the
    # key (a server frozen between its check of the lease and this write)
    assert not client.put_while_held(coord.alone_key(name), b"a", coord.lease_key(name),
                                     lease)
    assert client.get(coord.alone_key(name)) is None
    a.wait(lambda v: not v.held, "a's loss", since=revoked)
    with pytest.raises(coord.CoordinationError, match="not held"):
        a.lease.record_alone()
    b.lease.record_alone()  # the holder's own record is written
    assert client.get(coord.alone_key(name)) == b"b"


class FirstPutTimesOut(coord.Etcd):
    """A real etcd whose first acquire put times out after the grant, ``timeout_for``
    seconds later (a fault at the client's boundary: etcd itself cannot be made to
    answer one request late)."""

    def __init__(self, *args, timeout_for: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.granted_at: list[float] = []
        self.failed = False
        self.timeout_for = timeout_for

    def grant(self, ttl_s: float) -> tuple[int, float]:
        self.granted_at.append(time.monotonic())
        lease, self.ttl = super().grant(ttl_s)
        return lease, self.ttl

    def put_unless(self, *args, **kwargs):
        if not self.failed:
            self.failed = True
            time.sleep(self.timeout_for)  # (what the client waited for its answer)
            raise coord.CoordinationError("injected: timed out")
        return super().put_unless(*args, **kwargs)


@contextlib.contextmanager
def acquired_after_a_failed_put(etcd_server, lease_s: float, timeout_for: float):
    """A lease of ``lease_s`` wanted through ``FirstPutTimesOut``, once it is held: (the
    lease, its etcd client). Closed on the way out."""
    etcd = FirstPutTimesOut([(etcd_server.host, etcd_server.port)], timeout_s=1.0,
                            timeout_for=timeout_for)
    held = threading.Event()
    lease = coord.Lease(etcd, f"l-{uuidlib.uuid4().hex[:8]}", "a", lease_s=lease_s,
                        on_change=lambda view: view.held and held.set())
    lease.start()
    try:
        lease.want(True)
        assert held.wait(15), lease.stats()
        yield lease, etcd
    finally:
        lease.close()


def test_the_fencing_deadline_counts_from_the_grant_etcd_gave(etcd_server):
    """The deadline after an acquire counts from the grant, with the TTL etcd gave:
    ``lease_s`` 2.4 is granted as 2 s, and the put that failed first was made again
    under that grant 1 s later. Counted from the retry with 2.4 s, the deadline came
    after etcd could let the lease go (and the peer acquire it)."""
    with acquired_after_a_failed_put(etcd_server, 2.4, timeout_for=1.0) as (lease, etcd):
        view = lease.view
        assert etcd.failed and len(etcd.granted_at) == 1  # one grant, the put tried twice
        assert etcd.ttl == 2.0  # whole seconds: 2.4 asked
        assert view.valid_until <= etcd.granted_at[0] + etcd.ttl * (1 - coord.DRIFT), (
            view.valid_until - etcd.granted_at[0])


def test_a_grant_that_outlived_a_failed_put_is_not_used_again(etcd_server):
    """The put after a grant times out for longer than the grant's TTL (etcd cut off
    meanwhile): etcd let that lease go, and a put under it fails for good ("lease not
    found"). The next try takes a new grant and acquires; before, it retried the dead
    grant forever and the server could never hold the lease again."""
    # (3.5 s: the TTL, 2 s, and etcd's expiry tick)
    with acquired_after_a_failed_put(etcd_server, 2.0, timeout_for=3.5) as (lease, etcd):
        assert etcd.failed and len(etcd.granted_at) == 2
        assert lease.valid(time.monotonic())
