"""What the benchmark report and its plots share: reading values out of records (a
number, or a spread with its median), the snapshot record's points, and the figures'
common constants. Kept apart so that ``bench.report`` (tables, Markdown) and
``bench.report_plots`` (PNG figures) both build on it and neither imports the other's
internals.
"""
from __future__ import annotations

import statistics

PLOTS = ("scaleout", "latency", "snapshot", "fanout", "relays")
P99_TARGET_MS = 5.0       # p99 at half the single-shard max
DPI = 100


def get(d, *path, default=None):
    """``d[p0][p1]...`` or ``default`` where any step is missing or of the wrong type."""
    for p in path:
        if isinstance(d, dict) and p in d:
            d = d[p]
        elif isinstance(d, list) and isinstance(p, int) and -len(d) <= p < len(d):
            d = d[p]
        else:
            return default
    return d


def is_spread(v) -> bool:
    return isinstance(v, dict) and isinstance(v.get("median"), (int, float))


def median(v) -> float | None:
    """A SPREAD's median, or the number itself; None if neither."""
    if is_spread(v):
        return float(v["median"])
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def errbar(v) -> tuple[float, float]:
    """(below, above) the median for an error bar; zeros for a bare number."""
    m = median(v)
    if not is_spread(v) or m is None:
        return 0.0, 0.0
    return max(0.0, m - v.get("min", m)), max(0.0, v.get("max", m) - m)


def points_of(data: dict) -> list[dict]:
    """``summary["points"]``. For a snapshot record, join times come from the raw runs
    when the summary has none or rounded them (record.spread keeps one decimal, and a
    10k-key join takes ~0.05 s); an older snapshot record gets its points from its runs.
    Warm-up snapshots (``"warmup": true``) are left out."""
    pts = [p for p in get(data, "summary", "points", default=[]) or [] if isinstance(p, dict)]
    if data.get("benchmark") != "snapshot":
        return pts
    raw = {}
    for r in data.get("runs") or []:
        secs = [s.get("seconds") for s in get(r, "snapshots", default=[]) or []
                if isinstance(s, dict) and isinstance(s.get("seconds"), (int, float))
                and not s.get("warmup")]
        if isinstance(r, dict) and isinstance(r.get("keys"), int) and secs:
            m = statistics.median(secs)
            raw[r["keys"]] = ({"n": len(secs), "median": round(m, 4), "min": round(min(secs), 4),
                               "max": round(max(secs), 4),
                               "spread_pct": round(100 * (max(secs) - min(secs)) / m, 1)},
                              r.get("bytes_per_key"))
    for p in pts:
        if p.get("keys") in raw and not median(p.get("join_s")):
            p["join_s"] = raw[p["keys"]][0]
        join, ceiling = median(p.get("join_s")), median(p.get("ceiling_pubsub_s"))
        if join and ceiling and p.get("join_to_pubsub") is None:
            p["join_to_pubsub"] = round(join / ceiling, 2)
    if not pts:
        pts = [{"keys": n, "join_s": j, "bytes_per_key": b} for n, (j, b) in sorted(raw.items())]
    return pts
