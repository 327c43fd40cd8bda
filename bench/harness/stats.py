"""The one percentile rule every benchmark uses: nearest rank.

The p-th percentile of n sorted values is the value at rank ``ceil(p/100 * n)`` (1-based,
at least 1): the smallest value such that at least p percent of the values are at or
below it. It is always one of the measured values (never interpolated), ``p100`` is the
maximum, and it needs no more than the sorted list. With ``weights`` (a value standing
for that many measurements: a process's strided sample of its own latencies), the rank
is counted in weight instead: the first value whose cumulative weight reaches p percent
of the total.
"""
from __future__ import annotations

import math
from typing import Sequence


def percentile(sorted_values: Sequence[float], pct: float,
               weights: Sequence[float] | None = None) -> float | None:
    """Nearest-rank ``pct`` (0-100] percentile of ``sorted_values`` (ascending); None
    when there are none."""
    if not sorted_values:
        return None
    if not 0 < pct <= 100:
        raise ValueError(f"a percentile is in (0, 100], not {pct}")
    if weights is None:
        rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
        return sorted_values[rank - 1]
    goal = pct / 100 * sum(weights)
    acc = 0.0
    for value, weight in zip(sorted_values, weights):
        acc += weight
        if acc >= goal:
            return value
    return sorted_values[-1]
