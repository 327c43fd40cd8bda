"""The PNG plots of ``python -m bench.report`` (matplotlib, Agg backend, no display).

``draw_all(records, plots_dir)`` draws what the records hold and returns
{name: path} for the plots it wrote: scaleout.png (aggregate updates/s against shard
count with the linear ideal, and updates/s per busy core), latency.png (p50/p99/p99.9
against offered rate, the 5 ms target and half the single-shard max), snapshot.png (join
time against map size with the bare PUB->SUB time for N updates) and fanout.png (p99
against subscribers per shard count). A plot whose data is absent is not drawn, and a
stale file of that name is removed so the report never links an old picture.
"""
from __future__ import annotations

import re
import statistics
from pathlib import Path

from bench.report_data import DPI, P99_TARGET_MS, PLOTS, errbar, get, median, points_of


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(what: str, data: dict) -> str:
    cores = get(data, "host", "cores_logical", default="?")
    day = str(data.get("started_at", ""))[:10]
    return f"{what}\n{cores}-core host, {day}"


def _series(pts: list[dict], x_key: str, y):
    """Sorted (xs, ys, yerr) of the points whose x is a number and y(p) a figure."""
    rows = sorted(((p[x_key], y(p)) for p in pts
                   if isinstance(p.get(x_key), (int, float)) and median(y(p)) is not None),
                  key=lambda r: r[0])
    xs = [r[0] for r in rows]
    ys = [median(r[1]) for r in rows]
    bars = [errbar(r[1]) for r in rows]
    return xs, ys, [[b[0] for b in bars], [b[1] for b in bars]]


def scaleout(plt, data: dict, path: Path) -> bool:
    pts = points_of(data)
    if not any(median(p.get("received_per_s")) is not None for p in pts):
        return False
    from matplotlib.ticker import FuncFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=DPI)
    counts = sorted({p.get("shards") for p in pts if isinstance(p.get("shards"), int)})
    for target, color, dy in (("server", "C0", -12), ("forwarder", "C1", 6)):
        mine = [p for p in pts if p.get("target") == target]
        xs, ys, err = _series(mine, "shards", lambda p: p.get("received_per_s"))
        if not xs:
            continue
        ax1.errorbar(xs, ys, yerr=err, marker="o", capsize=4, color=color,
                     label=f"{target} (median, min-max)")
        if 1 in xs:
            one = ys[xs.index(1)]
            ax1.plot(counts, [n * one for n in counts], ls=":", color=color,
                     label=f"{target} linear ideal")
        for p in mine:
            y = median(p.get("received_per_s"))
            if isinstance(p.get("efficiency"), (int, float)) and p.get("shards") in xs[1:] and y:
                ax1.annotate(f"eff {p['efficiency']:.2f}", (p["shards"], y),
                             textcoords="offset points", xytext=(6, dy), fontsize=8,
                             color=color)
        cx, cy, cerr = _series(mine, "shards", lambda p: p.get("per_core_per_s"))
        if cx:
            ax2.errorbar(cx, cy, yerr=cerr, marker="o", capsize=4, color=color, label=target)
    pubsub = median(get(data, "summary", "ceilings", "pubsub", "received_per_s"))
    if pubsub:
        ax1.axhline(pubsub, color="grey", ls="--", label="bare PUB->SUB ceiling")
    # the host's cores: past cores/2 shards, servers and harness share cores
    cores = get(data, "host", "cores_usable", default=None) or get(
        data, "host", "cores_logical", default=None)
    if isinstance(cores, int) and counts:
        fit = cores / 2
        if fit <= counts[-1]:
            ax1.axvline(fit, color="red", ls="-.", lw=1,
                        label=f"{cores} cores: a core per server and one per shard of harness")
        else:
            ax1.text(0.98, 0.03, f"host: {cores} cores\n(a core per server and per "
                     f"shard of harness\nup to {fit:g} shards)", transform=ax1.transAxes,
                     fontsize=8, va="bottom", ha="right")
    ax1.set(xlabel="shards", ylabel="aggregate updates/s", xticks=counts or [1, 2, 4],
            title="aggregate throughput")
    ax2.set(xlabel="shards", ylabel="updates/s per busy core", xticks=counts or [1, 2, 4],
            title="per-core efficiency")
    for ax in (ax1, ax2):
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(_title("Scale-out", data))
    return _save(plt, fig, path)


def latency(plt, data: dict, path: Path) -> bool:
    pts = points_of(data)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=DPI)
    drawn = False
    for target, ls in (("server", "-"), ("forwarder", "--"), ("pubsub", ":")):
        mine = [p for p in pts if p.get("target") == target]
        for q, color in (("p50", "C0"), ("p99", "C1"), ("p99.9", "C3")):
            xs, ys, err = _series(mine, "offered_per_s", lambda p: get(p, "latency_ms", q))
            keep = [i for i, y in enumerate(ys) if y > 0]  # log axis
            if not keep:
                continue
            ax.errorbar([xs[i] for i in keep], [ys[i] for i in keep],
                        yerr=[[err[0][i] for i in keep], [err[1][i] for i in keep]],
                        ls=ls, marker="o", ms=3, capsize=2, color=color,
                        label=f"{target} {q}")
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    ax.axhline(P99_TARGET_MS, color="red", lw=1, label=f"{P99_TARGET_MS:g} ms p99 target")
    top = get(data, "summary", "single_shard_max_per_s")
    if isinstance(top, (int, float)) and top > 0:
        ax.axvline(top / 2, color="grey", lw=1, ls="-.", label="half the single-shard max")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set(xlabel="offered updates/s", ylabel="latency ms (log)",
           title=_title("Latency against offered rate (server solid, forwarder dashed, "
                        "pubsub dotted)", data))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=3)
    return _save(plt, fig, path)


def snapshot(plt, data: dict, path: Path) -> bool:
    pts = points_of(data)
    pts = [p for p in pts if (median(p.get("join_s")) or 0) > 0]  # log axes
    xs, ys, err = _series(pts, "keys", lambda p: p.get("join_s"))
    if not xs:
        return False
    fig, ax = plt.subplots(figsize=(8, 5), dpi=DPI)
    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4, label="server join (median, min-max)")
    rate = median(get(data, "summary", "ceilings", "pubsub", "received_per_s"))
    cx, cy, _ = _series(pts, "keys", lambda p: p.get("ceiling_pubsub_s"))
    if not cx and rate:
        cx, cy = xs, [n / rate for n in xs]
    if cx:
        ax.plot(cx, cy, ls="--", color="grey", marker=".", label="bare PUB->SUB: N / rate")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log(ax.xaxis, xs)
    _plain_log(ax.yaxis)
    ax.set(xlabel="keys in the map (log)", ylabel="seconds to a whole snapshot (log)",
           title=_title("Snapshot join time against map size", data))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def fanout(plt, data: dict, path: Path) -> bool:
    rows = []  # (shards, subscribers, p99): the points (with spreads), else by_run medians
    for p in points_of(data):
        if isinstance(p.get("shards"), int) and isinstance(p.get("subscribers"), int):
            p99 = get(p, "latency_ms", "p99", default=p.get("p99_ms"))
            if median(p99) is not None:
                rows.append((p["shards"], p["subscribers"], p99))
    for key, v in ({} if rows else get(data, "summary", "by_run", default={}) or {}).items():
        m = re.fullmatch(r"(\d+)x(\d+)", str(key))
        if m and isinstance(v, dict) and median(v.get("p99_ms")) is not None:
            rows.append((int(m[1]), int(m[2]), v["p99_ms"]))
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(8, 5), dpi=DPI)
    for shards in sorted({r[0] for r in rows}):
        mine = sorted(((r[1], r[2]) for r in rows if r[0] == shards and median(r[2]) > 0),
                      key=lambda r: r[0])
        if mine:
            bars = [errbar(v) for _, v in mine]
            ax.errorbar([s for s, _ in mine], [median(v) for _, v in mine],
                        yerr=[[b[0] for b in bars], [b[1] for b in bars]], marker="o",
                        capsize=3, label=f"{shards} shard{'s' if shards > 1 else ''}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_log(ax.xaxis, sorted({r[1] for r in rows}))
    _plain_log(ax.yaxis)
    ax.axhline(P99_TARGET_MS, color="red", lw=1, label=f"{P99_TARGET_MS:g} ms")
    ceiling = median(get(data, "summary", "ceilings", "pubsub", "latency_ms", "p99"))
    if ceiling:
        ax.axhline(ceiling, color="grey", ls="--", lw=1,
                   label="bare PUB->SUB p99, 1 subscriber, same rate")
    ax.set(xlabel="subscribers (log2)", ylabel="p99 latency ms (log)",
           title=_title("Fan-out: p99 against subscribers", data))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _plain_log(axis, ticks=None) -> None:
    """Plain numbers (1, 4, 0.5, 1e+06) on a log axis instead of powers; optional ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if ticks:
        axis.set_ticks(ticks)
    else:  # 1, 2, 5, 10, 20, 50...: labels even on a range narrower than a decade
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(plt, fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def relays(plt, data: dict, path: Path) -> bool:
    """Bytes served by the shard and by the relays for one failover, per mode (log)."""
    runs = [r for r in data.get("runs") or [] if r.get("part") == "failover"]
    fan = [r for r in data.get("runs") or [] if r.get("part") == "fanout"]
    if not runs and not fan:
        return False
    modes = ["direct_no_resume", "direct_resume", "relays"]
    labels = ["direct,\nno resume", "direct,\nresume", "through\nrelays"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=DPI)
    for side, color, dx in (("shard", "C0", -0.2), ("relay", "C1", 0.2)):
        ys = []
        for m in modes:
            mine = [r for r in runs if r.get("mode") == m]
            per = [(r.get(f"{side}_kvsync", 0) + r.get(f"{side}_resume", 0)) for r in mine]
            ys.append(statistics.median(per) if per else 0)
        ax1.bar([i + dx for i in range(len(modes))], ys, width=0.4, color=color,
                label=f"served by the {side}")
    if runs:
        ax1.set_yscale("log")
        ax1.set_ylim(bottom=0.5)  # a mode with none served shows no bar
    ax1.set_xticks(range(len(modes)), labels)
    ax1.set_ylabel("KVSYNCs and resumed updates (median over rounds)")
    cfg = data.get("config") or {}
    ax1.set_title(_title(f"one failover, {cfg.get('clients')} clients, "
                         f"{cfg.get('keys'):,} keys", data))
    ax1.legend()
    every = [data, *data.get("_sizes", [])]
    sizes = {(r.get("subscribers"), r.get("rate")) for d in every for r in d.get("runs") or []
             if r.get("part") == "fanout"}
    if not runs and len(sizes) > 1:   # fan-out only, at several sizes: latency by size
        fanout_sizes(ax1, every, data)
    elif not runs:   # a fan-out-only run (--parts fanout)
        ax1.set_visible(False)
    for i, (m, color) in enumerate((("direct", "C0"), ("relays", "C1"))):
        mine = [r for r in fan if r.get("mode") == m]
        for j, q in enumerate(("p50_ms", "p99_ms")):
            vals = [r[q] for r in mine if isinstance(r.get(q), (int, float))]
            if vals:
                ax2.bar(j * 3 + i, statistics.median(vals), color=color,
                        label=m if j == 0 else None)
    ax2.set_xticks([0.5, 3.5], ["p50", "p99"])
    ax2.set_ylabel("ms from the intended send time")
    ax2.set_title(_title(f"fan-out to {cfg.get('subscribers')} subscribers, direct vs "
                         "through relays", data))
    ax2.legend()
    return _save(plt, fig, path)


def fanout_sizes(ax, records: list[dict], data: dict) -> None:
    """p50 and p99 of the fan-out against deliveries per second (subscribers x rate),
    direct and through relays, one point per record; the 20 ms target marked."""
    ax.clear()
    for mode, color in (("direct", "C0"), ("relays", "C1")):
        pts = sorted(((r["subscribers"] * r.get("rate", get(rec, "config", "rate")), r, rec)
                      for rec in records for r in rec.get("runs") or []
                      if r.get("part") == "fanout" and r.get("mode") == mode),
                     key=lambda p: p[0])
        if not pts:
            continue
        xs = [x for x, _, _ in pts]
        for q, style in (("p50_ms", "--"), ("p99_ms", "-")):
            ax.plot(xs, [r[q] for _, r, _ in pts], style, marker="o", color=color,
                    label=f"{mode} {q[:3]}")
        for x, r, rec in pts:
            if mode == "relays":
                ax.annotate(f"{r['subscribers']} x {r.get('rate', 0):g}/s", (x, r["p99_ms"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(20.0, color="red", ls=":", label="target p99 20 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="deliveries/s (subscribers x updates/s)", ylabel="ms from the intended "
           "send time", title=_title("fan-out latency by size", data))
    ax.legend(fontsize=7)


DRAW = {"scaleout": scaleout, "latency": latency, "snapshot": snapshot, "fanout": fanout,
        "relays": relays}


def draw_all(records: dict[str, dict], plots_dir: Path) -> dict[str, Path]:
    plots_dir.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    drawn = {}
    for name in PLOTS:
        path = plots_dir / f"{name}.png"
        if name in records and DRAW[name](plt, records[name], path):
            drawn[name] = path
        elif path.exists():
            path.unlink()
    return drawn
