"""The supervisor's wait for a move's copies counts from their last progress
(``clonemap.supervisor.resharding.snapshots_moved``, read at each look by ``_copies``):
a snapshot read further, or whole now, is progress; the same figures twice, or a copy
whole already, are not. Each target's copy from each source is its own: two targets
copying from one source (a growth by two shards) do not stand in for each other. And the
rate a copy keeps to when the operator names none, and the part of a hold's bound kept for
the flip."""
from __future__ import annotations

import json
import os

from clonemap.supervisor.resharding import (FLIP_RESERVE_S, default_copy_rate, flip_reserve,
                                            parse_change, snapshots_moved)


def imp(source: str, received: int, whole: bool = False) -> dict:
    return {"source": source, "prefix": "", "received": received,
            "snapshot_seq": 7 if whole else -1}


def test_a_snapshot_read_further_is_progress_and_the_same_figures_are_not():
    moved, was = snapshots_moved({}, [("s2/primary", imp("tcp://a", 0))])
    assert moved  # (the first look)
    moved, was = snapshots_moved(was, [("s2/primary", imp("tcp://a", 0))])
    assert not moved
    moved, was = snapshots_moved(was, [("s2/primary", imp("tcp://a", 4096))])
    assert moved
    moved, was = snapshots_moved(was, [("s2/primary", imp("tcp://a", 4096, whole=True))])
    assert moved  # (whole now)
    moved, was = snapshots_moved(was, [("s2/primary", imp("tcp://a", 4096, whole=True))])
    assert not moved


def test_each_target_s_copy_from_one_source_is_its_own():
    stuck, going = imp("tcp://a", 100), imp("tcp://a", 100)
    _, was = snapshots_moved({}, [("s2/primary", stuck), ("s3/primary", going)])
    moved, was = snapshots_moved(was, [("s2/primary", imp("tcp://a", 100)),
                                       ("s3/primary", imp("tcp://a", 100))])
    assert not moved  # (keyed by one source alone, the two would have looked alike)
    moved, _ = snapshots_moved(was, [("s2/primary", imp("tcp://a", 100)),
                                     ("s3/primary", imp("tcp://a", 900))])
    assert moved


def test_a_copy_whole_already_is_no_progress_whatever_its_figures():
    _, was = snapshots_moved({}, [("s2/primary", imp("tcp://a", 100, whole=True))])
    moved, _ = snapshots_moved(was, [("s2/primary", imp("tcp://a", 200, whole=True))])
    assert not moved  # (its tail catching up is the catch-up's own deadline)


def test_the_default_copy_rate_follows_the_cores_within_its_bounds():
    """``supervisor reshard`` without ``--copy-rate``: 2 MiB/s a core, 4 to 32 MiB/s
    (the request's body without a rate takes it; 0 is unpaced)."""
    mib = 2**20
    assert default_copy_rate(1) == 4 * mib
    assert default_copy_rate(2) == 4 * mib
    assert default_copy_rate(5) == 10 * mib
    assert default_copy_rate(16) == 32 * mib
    assert default_copy_rate(64) == 32 * mib
    cores = len(os.sched_getaffinity(0))
    assert default_copy_rate() == default_copy_rate(cores)
    _, _, rate, _ = parse_change([json.dumps({"config": "c.yaml"}).encode()])
    assert rate == default_copy_rate(cores)
    _, _, rate, _ = parse_change([json.dumps({"config": "c.yaml", "copy_rate": 0}).encode()])
    assert rate is None


def test_the_flip_keeps_its_part_of_the_hold_s_bound():
    """The floor before any flip was measured, half as much again as the last one once
    that is more, and never more than half the bound: the catch-up keeps the rest."""
    assert flip_reserve(0.5, 0.0) == FLIP_RESERVE_S == 0.15
    assert flip_reserve(0.5, 0.05) == FLIP_RESERVE_S
    assert abs(flip_reserve(0.5, 0.14) - 0.21) < 1e-9
    assert flip_reserve(0.5, 0.4) == 0.25
    assert flip_reserve(0.2, 0.0) == 0.1
