"""shards.common.ports: the free-range probe shared by tests, benchmarks and the demo."""
from __future__ import annotations

import socket

import pytest

from clonemap.shards.common.ports import free_port_base, ports_free


def test_a_bound_port_makes_its_range_not_free():
    base = free_port_base(20000, 32760, 4)
    assert ports_free("127.0.0.1", base, 4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        assert not ports_free("127.0.0.1", base, 4)
        assert ports_free("127.0.0.1", base, 2)
    assert ports_free("127.0.0.1", base, 4)


def test_bases_are_multiples_of_ten_in_range_and_away_from_avoided_ones():
    avoid = {free_port_base(20000, 20200, 4)}
    for _ in range(20):
        base = free_port_base(20000, 20200, 4, avoid=avoid, spacing=40)
        assert base % 10 == 0 and 20000 <= base < 20196
        assert all(abs(base - b) >= 40 for b in avoid)


def test_an_impossible_request_says_what_it_looked_for():
    with pytest.raises(RuntimeError, match="no 4 free consecutive ports found in 20000-20010"):
        free_port_base(20000, 20010, 4, avoid={20000}, spacing=40, tries=20)
