"""``clonemap.shards.coord``'s pure parts: the ``--coordination`` URL and the fencing deadline."""
from __future__ import annotations

import pytest

from clonemap.shards import coord


def test_coordination_urls_name_one_or_more_endpoints():
    assert coord.parse_url("etcd://10.0.0.1:2379") == [("10.0.0.1", 2379)]
    assert coord.parse_url("etcd://a:1, b:2") == [("a", 1), ("b", 2)]


@pytest.mark.parametrize("text", ["http://a:1", "etcd://a", "etcd://:5", "etcd://a:x",
                                  "etcd://a:1,", "consul://a:1"])
def test_a_bad_coordination_url_is_refused_with_its_form(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        coord.parse_url(text)


def test_the_fencing_deadline_comes_before_etcd_can_let_the_lease_go():
    lease = coord.Lease(coord.Etcd([("127.0.0.1", 1)]), "x", "me", lease_s=5.0)
    # sent at 100: etcd restarts its TTL no earlier, so it lets go no earlier than 105
    deadline = lease._deadline(100.0, 5.0)
    assert deadline <= 100.0 + 5.0 * (1 - coord.DRIFT) - lease.margin_s
    assert lease.renew_s < deadline - 100.0  # renewed well before it
    with pytest.raises(ValueError, match="at least"):
        coord.Lease(coord.Etcd([("127.0.0.1", 1)]), "x", "me", lease_s=1.0)
