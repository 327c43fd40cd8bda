"""``python -m bench.report``: one Markdown report and PNG plots from the latest records.

    python -m bench.report [--results-dir bench/results] [--out DIR]

Reads ``<results-dir>/latest/<name>.json`` for every scenario in ``SCENARIOS`` (from
chp_throughput to the resharding records) and writes ``<out>/REPORT.md`` and
``<out>/plots/{scaleout,latency,snapshot,fanout}.png`` (out defaults to the results dir).
Takes a few seconds. Every figure comes from a record, beside the command that produced
it and the host it ran on; nothing is measured here.

A missing record gives a "not run yet" line with the command to run. A record that cannot
be read (bad JSON, not an object) gives a line saying so in its section and a warning on
stderr; the report is still written and the exit code is 0. A results dir that does not
exist is a usage error (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.harness import record as rec
from bench.report_data import P99_TARGET_MS, get, is_spread, median, points_of

# (record name, section title, the command that produces it)
SCENARIOS = [
    ("chp_throughput", "Single-shard throughput", "python -m bench single"),
    ("scaleout", "Scale-out over 1, 2 and 4 shards", "python -m bench scaleout"),
    ("latency", "Latency at fixed offered rates (open loop)", "python -m bench latency"),
    ("snapshot", "Snapshot join time and memory per key", "python -m bench snapshot"),
    ("fanout", "Fan-out to many subscribers", "python -m bench fanout"),
    ("failover", "Failover gap", "python -m bench failover"),
    ("failover_supervised", "Failover under the supervisor (restart as passive)",
     "python -m bench failover_supervised"),
    ("load", "Load generator", "python -m bench load"),
    ("cluster", "The supervised cluster flat out and at fixed shares of it",
     "python -m bench cluster"),
    ("handoff", "Callback hand-off", "python -m bench handoff"),
    ("durability", "Durability: fsync policies, compaction, recovery, storage choice",
     "python -m bench durability"),
    ("curve", "CURVE cost: encryption and authentication on every socket",
     "python -m bench curve"),
    ("slow_subscriber", "A never-reading subscriber: what it pins, budgets on and off",
     "python -m bench slow_subscriber"),
    ("relays", "Relays and resume: fan-out per relay hop, failover cost, memory",
     "python -m bench relays"),
    ("hot_path", "The hot path: one shard against the plain five-receive loop",
     "python -m bench hot_path"),
    ("peers", "Against Redis, NATS KV and etcd at everyday rates", "python -m bench peers"),
    ("peers-read", "Reads of a live map, 4 readers, a session each: against Redis's cache, "
     "NATS KV and etcd",
     "python -m bench peers --workloads read"),
    ("peers-read-shared", "Reads of a live map, 4 readers in one session",
     "python -m bench peers --workloads read --client-sessions shared"),
    ("peers-read-1reader", "Reads of a live map, 1 reader",
     "python -m bench peers --workloads read --readers 1"),
    ("peers-reconnect", "A live map's copy after a broken link",
     "python -m bench peers --workloads reconnect"),
    ("peers-memory", "A live map's copy: memory per key",
     "python -m bench peers --systems clonemap,redis --workloads memory "
     "--memory-keys 100000,1000000"),
    ("read_burst", "Reads of a live map during a burst of updates", "python -m bench read_burst"),
    ("conditional", "Conditional writes: compare-and-set against plain writes",
     "python -m bench conditional"),
    ("hosts", "A pair over two hosts: replication and takeover", "python -m bench hosts"),
    ("reshard", "Resharding a running cluster: a growth, 2 -> 3 shards",
     "python -m bench reshard"),
    ("reshard-shrink", "Resharding a running cluster: a shrink, 3 -> 2 shards",
     "python -m bench reshard --change shrink"),
]
LINKED = {"peers-read", "peers-read-shared", "peers-read-1reader", "peers-reconnect",
          "peers-memory"}
"""Records whose tables only their scenario draws (per path and system): the report
links their Markdown and lists their targets."""
FORWARDER_TARGET = 0.70   # one shard / bare forwarding loop


class Unreadable(Exception):
    """A record file that exists but cannot be used."""


# ------------------------------------------------------------------------------ reading

def load_record(results_dir: Path, name: str) -> dict | None:
    """The latest record called ``name``, None if there is none; Unreadable if broken."""
    path = results_dir / "latest" / f"{name}.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Unreadable(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise Unreadable(f"{path}: a JSON {type(data).__name__}, not a record object")
    return data










# --------------------------------------------------------------------------- formatting

def num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.4g}"
    return str(v)


def fmt(v) -> str:
    """A SPREAD as ``median (min-max, spread%)`` (one run: the value); a number as itself;
    else ``-`` or the text."""
    if is_spread(v) and v.get("n") == 1:
        return num(v["median"])  # one run: no spread to show
    if is_spread(v):
        lo, hi, m = v.get("min"), v.get("max"), v["median"]
        sp = v.get("spread_pct")
        if sp is None and isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and m:
            sp = round(100 * (hi - lo) / m, 1)
        tail = f", {sp}%" if sp is not None else ""
        return f"{num(m)} ({num(lo)}-{num(hi)}{tail})"
    if isinstance(v, dict):
        return "-"
    if isinstance(v, list):
        return ", ".join(num(x) for x in v) if v else "-"
    return num(v)


def runs_of(v) -> str:
    return num(v.get("n")) if is_spread(v) else "-"


def md_table(columns: list[str], rows: list[list], left: int = 1) -> list[str]:
    """A Markdown table; the first ``left`` columns (text) left-aligned, the rest right."""
    def cell(x) -> str:
        return (x if isinstance(x, str) else fmt(x)).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(columns) + " |",
           "|" + "|".join("---" if i < left else "---:" for i in range(len(columns))) + "|"]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out + [""]


def host_line(data: dict) -> str:
    h = data.get("host") if isinstance(data.get("host"), dict) else {}
    git = h.get("git") if isinstance(h.get("git"), dict) else {}
    commit = (git.get("commit") or "?")[:12]
    return (f"{h.get('cores_logical', '?')} cores ({h.get('cpu_model', '?')}), load average "
            f"{h.get('loadavg_before', '?')} -> {h.get('loadavg_after', '?')}; Python "
            f"{h.get('python', '?')}, pyzmq {h.get('pyzmq', '?')}, libzmq {h.get('libzmq', '?')};"
            f" git {commit}{' (dirty tree)' if git.get('dirty') else ''}")


# --------------------------------------------------------------------- per-record tables

def figures_tables(summary: dict) -> list[str]:
    """Every summary entry (but points and ceilings, shown apart) as Markdown."""
    figures, scalars, out = [], [], []
    for key, v in summary.items():
        if key in ("points", "ceilings", "contention", "estimate_16core") or (
                (key == "by_run" or key.isdigit()) and summary.get("points")):
            continue  # shown apart; by_run (fan-out), "<keys>" (snapshot): in the points
        if is_spread(v):
            figures.append([key, fmt(v), runs_of(v)])
        elif isinstance(v, dict) and v and all(is_spread(x) or not isinstance(x, (dict, list))
                                                for x in v.values()):
            if any(is_spread(x) for x in v.values()):
                figures += [[f"{key} {k}", fmt(x), runs_of(x)] for k, x in v.items()]
            else:
                scalars.append(f"{key}: " + ", ".join(f"{k} {num(x)}" for k, x in v.items()))
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            cols: list[str] = []
            for x in v.values():
                cols += [c for c in x if c not in cols]
            out += [f"**{key}**", ""]
            out += md_table([key] + cols, [[k] + [fmt(x.get(c)) for c in cols]
                                           for k, x in v.items()])
        elif not isinstance(v, dict) and not is_ratio(key):
            scalars.append(f"{key}: {fmt(v)}")
    head = []
    if figures:
        head += md_table(["figure", "median (min-max, spread)", "runs"], figures)
    if scalars:
        head += [f"- {s}" for s in scalars] + [""]
    return head + out


def ceilings_table(summary: dict) -> list[str]:
    ceil = summary.get("ceilings")
    if not isinstance(ceil, dict):
        return []
    figs = {k: v for k, v in ceil.items() if k in ("pubsub", "forwarder") and isinstance(v, dict)}
    if not figs:  # one set per point: {"<label>": {"pubsub": FIG, ...}}
        figs = {f"{lbl} {k}": v for lbl, c in ceil.items() if isinstance(c, dict)
                for k, v in c.items() if k in ("pubsub", "forwarder") and isinstance(v, dict)}
    if not figs:
        return []
    rows = [[k, f.get("received_per_s"), f.get("sent_per_s"), get(f, "latency_ms", "p50"),
             get(f, "latency_ms", "p99"), f.get("loss_window"), f.get("cpu_cores")]
            for k, f in figs.items()]
    lines = ["Ceilings measured in the same run (pubsub = bare PUB->SUB, forwarder = bare "
             "SUB->dict->PUB loop):", ""]
    rate = get(ceil, "config", "rate_per_s")
    if isinstance(rate, (int, float)):
        lines[0] = lines[0][:-1] + (f", open loop at {num(rate)}/s:" if rate else ", flat out:")
    lines += md_table(["ceiling", "received/s", "sent/s", "p50 ms", "p99 ms",
                       "loss in window", "cores busy"], rows)
    notes = [f"{k.replace('_', ' ')} {v}" for k, v in ceil.items()
             if k.endswith("_from") and isinstance(v, str)]  # e.g. forwarder_from
    if isinstance(get(ceil, "config", "from"), str):
        notes.append(f"taken from {ceil['config']['from']}")
    return lines + ([f"Note: {'; '.join(notes)}.", ""] if notes else [])


def is_ratio(key: str) -> bool:
    return "ratio" in key or "_over_" in key


def ratios(summary: dict) -> list[str]:
    """Server / ceiling medians from the record, and any ratio the producer computed."""
    out = []
    server = median(get(summary, "server", "received_per_s"))
    for kind in ("forwarder", "pubsub"):
        c = median(get(summary, "ceilings", kind, "received_per_s"))
        if server is not None and c:
            out.append(f"server / {kind} ceiling (medians): {server / c:.3f}")
    for key, v in summary.items():
        if is_ratio(key) and not isinstance(v, dict):
            out.append(f"{key}: {fmt(v)}")
    return ["Ratios:", ""] + [f"- {r}" for r in out] + [""] if out else []




LABELS = {"received_per_s": "received/s", "cpu_cores": "cores busy",
          "per_core_per_s": "received/s per busy core", "offered_per_s": "offered/s",
          "fraction_of_max": "of max", "join_s": "join s", "bytes_per_key": "bytes/key",
          "writer_drops": "writer drops", "delivered_per_s_min": "delivered/s (lowest sub)",
          "ceiling_pubsub_s": "pubsub ceiling s (N / rate)",
          "ceiling_forwarder_s": "forwarder ceiling s (N / rate)",
          "join_to_pubsub": "join / pubsub", "join_to_forwarder": "join / forwarder",
          "bytes_per_key_beyond_kv": "bytes/key beyond key+value",
          "delivered_to_pubsub": "delivered / pubsub", "p50_to_pubsub": "p50 / pubsub",
          "p99_to_pubsub": "p99 / pubsub", "targets_cpu_pct": "targets cpu %",
          "harness_cpu_pct": "harness cpu %", "others_cpu_pct": "others cpu %",
          "ratio_to_forwarder": "/ forwarder", "ratio_to_pubsub": "/ pubsub",
          "ratio_to_plain_loop": "/ plain loop (x shards)"}
NOTES = {"scaleout": "received/s: the aggregate over all shards; efficiency: aggregate / "
                     "(shards x the 1-shard median of the same target).",
         "latency": "Latency in ms from each update's intended send time (open loop)."}


def points_table(name: str, data: dict) -> list[str]:
    """``summary["points"]``, one row each; nested figures (latency_ms) one column per key;
    a column that no point fills is left out."""
    pts = points_of(data)
    if not pts:
        return []
    cols: list[tuple] = []
    for p in pts:
        for k, v in p.items():
            paths = ([(k, q) for q in v] if isinstance(v, dict) and not is_spread(v)
                     and all(is_spread(x) or not isinstance(x, (dict, list)) for x in v.values())
                     else [(k,)])
            cols += [c for c in paths if c not in cols]
    cols = [c for c in cols if any(get(p, *c) is not None for p in pts)
            and not all(isinstance(get(p, *c), (dict, list)) and not is_spread(get(p, *c))
                        for p in pts)]

    def runs(p) -> str:
        return next((runs_of(get(p, *c)) for c in cols if is_spread(get(p, *c))), "-")

    head = [f"{c[1]} ms" if c[0] == "latency_ms" and len(c) == 2
            else " ".join(LABELS.get(part, part) for part in c) for c in cols]
    lines = [NOTES[name], ""] if name in NOTES else []
    return lines + md_table(head + ["runs"], [[get(p, *c) for c in cols] + [runs(p)]
                                              for p in pts], left=0)


SYSTEM_FIGURES = (("the change (s)", ("total_s",)), ("keys moved", ("moved_keys",)),
                  ("keys/s", ("keys_per_s",)), ("writes/s before", ("writes_per_s_before",)),
                  ("writes/s during", ("writes_per_s_during",)),
                  ("p99 before (ms)", ("before", "p99_ms")),
                  ("moving keys: p99 / longest (ms)", ("during_moving", "p99_ms"),
                   ("during_moving", "max_ms")),
                  ("staying keys: p99 / longest (ms)", ("during_staying", "p99_ms"),
                   ("during_staying", "max_ms")),
                  ("writes failed", ("failed_writes",)))


def systems_table(data: dict) -> list[str]:
    """A record that ran the same change on several systems (``reshard``'s clonemap and
    Valkey): their figures side by side."""
    systems = data.get("systems")
    if not isinstance(systems, dict) or len(systems) < 2:
        return []
    names = [n for n, v in systems.items() if isinstance(v, dict)]

    def cell(system: dict, path: tuple) -> str:
        v = get(system, *path)
        return num(v) if isinstance(v, (int, float)) else "-"

    rows = [[label, *(" / ".join(cell(systems[n], path) for path in paths) for n in names)]
            for label, *paths in SYSTEM_FIGURES]
    return ["Side by side, in the same run:", ""] + md_table(["figure", *names], rows)


def targets_table(data: dict) -> list[str]:
    rows = []
    for t in data.get("targets") or []:
        if not isinstance(t, dict):
            continue
        op = ">= " if t.get("higher_is_better", True) else "< "
        rows.append([t.get("name", "?"), t.get("value"), op + num(t.get("target")),
                     t.get("unit", ""), rec.met_word(t)])
    return md_table(["target", "value", "goal", "unit", "met"], rows) if rows else []


# ------------------------------------------------------------------- targets at a glance

def _single_ratio(data: dict) -> float | None:
    s = data.get("summary") if isinstance(data.get("summary"), dict) else {}
    for key in ("ratio_server_to_forwarder", "ratio_server_to_ceiling"):
        if median(s.get(key)) is not None:
            return median(s.get(key))
    server = median(get(s, "server", "received_per_s"))
    fwd = median(get(s, "ceilings", "forwarder", "received_per_s")) or \
        median(get(s, "ceiling", "received_per_s"))
    return server / fwd if server is not None and fwd else None


def _scaleout_growth(data: dict) -> tuple[str, bool | None]:
    pts = [p for p in get(data, "summary", "points", default=[]) or []
           if isinstance(p, dict) and p.get("target") == "server"
           and median(p.get("received_per_s")) is not None]
    agg = {p.get("shards"): median(p["received_per_s"]) for p in pts}
    cores = get(data, "host", "cores_logical", default=0) or 0
    counts = sorted(n for n in agg if isinstance(n, int))
    if 1 not in agg or len(counts) < 2:
        return "-", None
    within = [n for n in counts if 1 < n <= max(cores, 2)]
    grows = all(agg[n] > agg[prev] for prev, n in zip(counts, counts[1:]) if n in within)
    effs = "; ".join(f"{n} shards x{agg[n] / agg[1]:.2f}, efficiency "
                     f"{agg[n] / (n * agg[1]):.2f}" for n in counts if n > 1 and agg[1])
    return effs, grows if within else None


def _p99_at_half(data: dict) -> tuple[float | None, str]:
    pts = [p for p in get(data, "summary", "points", default=[]) or []
           if isinstance(p, dict) and p.get("target") == "server"
           and isinstance(p.get("fraction_of_max"), (int, float))
           and median(get(p, "latency_ms", "p99")) is not None]
    if not pts:
        return None, ""
    p = min(pts, key=lambda p: abs(p["fraction_of_max"] - 0.5))
    return median(get(p, "latency_ms", "p99")), f"at {p['fraction_of_max']:.0%} of max"


def glance_rows(records: dict) -> list[list[str]]:
    """Issue 7's targets, then every record's own targets: [scenario, target, value, goal,
    met]. ``records`` maps name -> record dict, None (not run) or an Unreadable."""
    def state(name):
        r = records.get(name)
        return r if isinstance(r, dict) else None

    def missing(name):
        return "unreadable record" if isinstance(records.get(name), Unreadable) else "not run yet"

    rows = []
    goal = f">= {FORWARDER_TARGET:.2f}"
    d = state("chp_throughput")
    ratio = _single_ratio(d) if d else None
    rows.append(["single", "one shard / bare forwarding loop (medians)",
                 f"{ratio:.3f}" if ratio is not None else "-", goal,
                 missing("chp_throughput") if d is None else
                 "-" if ratio is None else "met" if ratio >= FORWARDER_TARGET else "NOT met"])
    d = state("scaleout")
    text, grows = _scaleout_growth(d) if d else ("-", None)
    rows.append(["scaleout", "aggregate grows with shards while cores remain", text,
                 "more at each shard count <= cores", missing("scaleout") if d is None else
                 "-" if grows is None else "met" if grows else "NOT met"])
    d = state("latency")
    p99, where = _p99_at_half(d) if d else (None, "")
    rows.append(["latency", "server p99 at half the single-shard max",
                 f"{num(p99)} ms {where}" if p99 is not None else "-", f"< {P99_TARGET_MS:g} ms",
                 missing("latency") if d is None else
                 "-" if p99 is None else "met" if p99 < P99_TARGET_MS else "NOT met"])
    for name, _, _ in SCENARIOS:
        for t in (state(name) or {}).get("targets") or []:
            if isinstance(t, dict):
                op = ">= " if t.get("higher_is_better", True) else "< "
                rows.append([name, t.get("name", "?"), f"{num(t.get('value'))} {t.get('unit', '')}",
                             op + num(t.get("target")), "met" if t.get("met") else
                             "harness-bound" if t.get("harness_bound") else "NOT met"])
    return rows


# ------------------------------------------------------------------------------- report

METHOD = """\
- **Warm-up, then repeated runs.** Every scenario warms up before its measured windows and
  repeats each point (`--rounds`/`--repeats`); figures are the median with the min-max and
  the spread ((max - min) / median) and the number of runs beside it.
- **Ceilings in the same run.** A bare pyzmq PUB->SUB and a bare SUB->dict->PUB forwarding
  loop of the same 5-frame message are measured with the same writer and subscriber in the
  same run, so the server is judged by a ratio that shares the host's conditions.
- **Open-loop latency.** Writers send at fixed intended times and latency is taken from the
  intended send time, so a stall delays every later message and shows in the tail
  (coordinated omission does not hide it).
- **A shared {cores} host.** The machine runs other work: each record keeps the load average
  before and after and the CPU used by others. Compare ratios within one run, not absolute
  figures across runs."""


def render(results_dir: Path, out: Path, records: dict, plots: dict[str, str]) -> str:
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = ["# clonemap benchmark report", "",
             f"Generated {now} by `python -m bench.report` from "
             f"`{_shown(results_dir / 'latest')}/`. Every figure below is copied from a "
             "record, beside the command that produced it.", "",
             "## Targets at a glance", ""]
    lines += md_table(["scenario", "target", "value", "goal", "met"], glance_rows(records),
                      left=2)
    cores = sorted({get(r, "host", "cores_logical") for r in records.values()
                    if isinstance(r, dict) and isinstance(get(r, "host", "cores_logical"), int)})
    lines += ["## Method", "", METHOD.format(cores="/".join(map(str, cores)) + "-core"
                                             if cores else "multi-core"), ""]
    for name, title, command in SCENARIOS:
        lines += [f"## {title} (`{name}`)", ""]
        data = records.get(name)
        if data is None:
            lines += [f"Not run yet: `{command}`", ""]
            continue
        if isinstance(data, Unreadable):
            lines += [f"**Record unreadable**, section skipped: {data}. Re-run `{command}`.", ""]
            continue
        summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
        lines += [f"- command: `{data.get('command', '?')}`",
                  f"- when: {data.get('started_at', '?')} to {data.get('finished_at', '?')}"
                  f" ({num(data.get('duration_s'))} s)",
                  f"- host: {host_line(data)}", ""]
        if name in LINKED:  # (its tables are the scenario's own: the record's Markdown)
            shown = _rel(results_dir / "latest" / f"{name}.md", out)
            lines += [f"Tables: [{shown}]({shown}).", ""] + targets_table(data)
            continue
        lines += points_table(name, data) + figures_tables(summary)
        lines += ceilings_table(summary) + ratios(summary)
        for key in ("contention",):
            if isinstance(summary.get(key), str):
                lines += [f"{key.capitalize()}: {summary[key]}", ""]
        if isinstance(summary.get("estimate_16core"), dict):
            lines += ["16-core estimate (computed by the scenario from this run's CPU per "
                      "update, not measured):", ""]
            lines += [f"- {k}: " + (", ".join(f"{a} {fmt(b)}" for a, b in v.items())
                                    if isinstance(v, dict) else fmt(v))
                      for k, v in summary["estimate_16core"].items()] + [""]
        lines += systems_table(data) + targets_table(data)
        if name in plots:
            lines += [f"![{name}]({plots[name]})", ""]
    mdp = results_dir / "mdp" / "SUMMARY.md"
    lines += ["## MDP/0.2 broker", ""]
    lines += ([f"See [{_rel(mdp, out)}]({_rel(mdp, out)}) (`python -m bench.mdp_echo`).", ""]
              if mdp.exists() else ["Not run yet: `python -m bench.mdp_echo`", ""])
    lines += ["## How to reproduce", "", "- everything, then this report: "
              "`python -m bench all --full`", "- this report alone: `python -m bench report`"]
    for name, _, command in SCENARIOS:
        data = records.get(name)
        used = data.get("command") if isinstance(data, dict) else None
        lines.append(f"- {name}: `{used or command}`")
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    """A path as the reader would type it: relative to the repository when inside it."""
    try:
        return path.resolve().relative_to(rec.ROOT).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report",
                                 description="Markdown report and PNG plots from the latest "
                                 "benchmark records (a few seconds).")
    ap.add_argument("--results-dir", default=str(rec.RESULTS_DIR),
                    help="reads DIR/latest/<name>.json (default: %(default)s)")
    ap.add_argument("--out", help="writes REPORT.md and plots/*.png here (default: the "
                    "results dir)")
    args = ap.parse_args(argv)
    results_dir = Path(args.results_dir)
    if not results_dir.is_dir():
        ap.error(f"--results-dir {results_dir}: no such directory")
    out = Path(args.out) if args.out else results_dir
    try:
        (out / "plots").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {out}: {exc.strerror or exc}")
    records: dict = {}
    for name, _, _ in SCENARIOS:
        try:
            records[name] = load_record(results_dir, name)
        except Unreadable as exc:
            rec.log(f"report: warning: {exc}")
            records[name] = exc
    sizes = sorted(results_dir.glob("relays-sizes-*.json"))   # fan-out at other sizes
    if sizes and isinstance(records.get("relays"), dict):
        import json

        records["relays"] = dict(records["relays"], _sizes=[
            json.loads(p.read_text()) for p in sizes])
    from bench import report_plots

    plots = report_plots.draw_all({k: v for k, v in records.items() if isinstance(v, dict)},
                                  out / "plots")
    text = render(results_dir, out, records, {k: f"plots/{v.name}" for k, v in plots.items()})
    (out / "REPORT.md").write_text(text)
    rec.log(f"report: wrote {out / 'REPORT.md'} and {len(plots)} plot(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
