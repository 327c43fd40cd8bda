"""Benchmark records: host facts, statistics, a printed table and a saved JSON file.

Every benchmark ends with ``save(record)``, which writes
``<results_dir>/<name>-<UTC timestamp>.json`` and ``<results_dir>/latest/<name>.json``,
and the same tables as printed, in Markdown, beside each (``.md``).
A record holds (schema 1)::

    benchmark   name, e.g. "chp_throughput"
    command     the command line that reproduces it (always explicit options)
    invoked_as  the command line actually typed (e.g. "python -m bench")
    started_at, finished_at   UTC ISO times; duration_s
    host        cores, CPU model, load average before and after, Python, pyzmq, libzmq,
                platform, git commit (and whether the tree was dirty)
    config      every option the benchmark ran with
    runs        one entry per measured run (raw figures)
    summary     medians, spreads, ratios
    targets     [{name, target, value, unit, met}]

No figure is quoted without the command that produced it.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"
"""Committed: ``latest/`` (one record per benchmark), the report and its plots. The
timestamped copies a save also writes there are the local history (not committed)."""
SCRATCH_DIR = RESULTS_DIR / "scratch"
"""Where smoke runs go (not committed): never over the committed figures."""
PROFILE_DIRS = {"16core": RESULTS_DIR / "16core"}
"""Where a host profile's records go by default: beside the 2-core ones, never over them."""
SCHEMA = 1


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git() -> dict:
    def run(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": run("rev-parse", "HEAD"),
            # the records a benchmark run writes are not code: they never make a tree dirty
            "dirty": bool(run("status", "--porcelain", "--untracked-files=no", "--", ".",
                              ":(exclude)bench/results"))}


def host_facts() -> dict:
    import psutil
    import zmq

    return {
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_bytes": psutil.virtual_memory().total,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "platform": platform.platform(),
        "git": _git(),
    }


def command_line(module: str, options: dict) -> str:
    """``python -m <module> --opt value ...`` from a dict of option -> value."""
    parts = ["python", "-m", module]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):  # a repeatable option
            for item in value:
                parts += [flag, str(item)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def invoked_as() -> str:
    """The command line actually typed, with a module path shown as ``-m module``."""
    if not sys.argv:
        return ""
    head, rest = sys.argv[0], sys.argv[1:]
    try:
        rel = Path(head).resolve().relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__main__"]
        return shlex.join(["python", "-m", ".".join(parts), *rest])
    except ValueError:
        return shlex.join(["python", head, *rest])


class Record:
    def __init__(self, benchmark: str, command: str, config: dict):
        self.data: dict = {
            "schema": SCHEMA,
            "benchmark": benchmark,
            "command": command,
            "invoked_as": invoked_as(),
            "started_at": _utc_now(),
            "host": host_facts(),
            "config": config,
            "runs": [],
            "summary": {},
            "targets": [],
        }
        self._t0 = time.monotonic()
        self.tables: list[tuple[str, list[str], list[list[str]], str]] = []

    def add_run(self, run: dict) -> None:
        self.data["runs"].append(run)

    def target(self, name: str, value: float, target: float, unit: str,
               higher_is_better: bool = True, harness_bound: str = "") -> None:
        """``harness_bound``: why the harness, not the target, set the figure (a harness
        process over ``HARNESS_BOUND_PCT`` of a core); a target not met then reads
        "harness-bound", never "NO" for the servers."""
        met = value >= target if higher_is_better else value < target
        self.data["targets"].append({"name": name, "value": value, "target": target,
                                     "unit": unit, "higher_is_better": higher_is_better,
                                     "met": bool(met), "harness_bound": harness_bound})

    def finish(self) -> None:
        self.data["finished_at"] = _utc_now()
        self.data["duration_s"] = round(time.monotonic() - self._t0, 2)
        self.data["host"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]

    def save(self, results_dir: Path | str = RESULTS_DIR) -> Path:
        results_dir = Path(results_dir)
        (results_dir / "latest").mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        name = self.data["benchmark"]
        path = results_dir / f"{name}-{stamp}.json"
        text = json.dumps(self.data, indent=2, sort_keys=False) + "\n"
        path.write_text(text)
        (results_dir / "latest" / f"{name}.json").write_text(text)
        md = self.markdown()
        path.with_suffix(".md").write_text(md)
        (results_dir / "latest" / f"{name}.md").write_text(md)
        return path

    def markdown(self) -> str:
        """The record's tables (as printed), its command and host, in Markdown."""
        d = self.data
        host = d["host"]
        git = host.get("git", {})
        lines = [
            f"# {d['benchmark']} ({d['started_at']})", "",
            f"- command: `{d['command']}`",
            f"- invoked as: `{d['invoked_as']}`",
            f"- host: {host['cores_logical']} logical cores ({host['cpu_model']}), load "
            f"average {host['loadavg_before']} before, {host.get('loadavg_after')} after",
            f"- Python {host['python']}, pyzmq {host['pyzmq']}, libzmq {host['libzmq']}; "
            f"git {git.get('commit', '')[:12]}{' (dirty tree)' if git.get('dirty') else ''}",
            f"- duration: {d.get('duration_s')} s", "",
        ]
        for title, columns, rows, caption in self.tables:
            lines += [f"## {title}", "", "| " + " | ".join(columns) + " |",
                      "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns)))
                      + "|"]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            if caption:
                lines += ["", caption.replace("\n", " ")]
            lines.append("")
        return "\n".join(lines)


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def spread(values: list[float], digits: int = 1) -> dict:
    """Median, min, max (rounded to ``digits`` decimals: 1 for rates, 3-4 for seconds
    and milliseconds) and the relative spread (max - min) / median in percent."""
    if not values:
        return {"n": 0}
    med = statistics.median(values)
    return {"n": len(values), "median": round(med, digits), "min": round(min(values), digits),
            "max": round(max(values), digits),
            "spread_pct": round(100 * (max(values) - min(values)) / med, 1) if med else None}


def ratios_per_round(runs: list[dict], value, num: str, den: str, by: str) -> list[float]:
    """For each round, ``value(run)`` of the run whose ``by`` is ``num`` over the one
    whose ``by`` is ``den`` (rounded to 3 decimals); rounds missing either are skipped.
    Ratios in the same round share the host's conditions (see the report's method)."""
    out = []
    for r in sorted({x["round"] for x in runs}):
        row = {x[by]: x for x in runs if x["round"] == r}
        a, b = row.get(num), row.get(den)
        if a and b and value(a) and value(b):
            out.append(round(value(a) / value(b), 3))
    return out


# ------------------------------------------------------------------------------ tables

def print_table(title: str, columns: list[str], rows: list[list], caption: str = "") -> None:
    from rich.table import Table

    table = Table(title=title, caption=caption or None)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    _console().print(table)


def table(record: Record, title: str, columns: list[str], rows: list[list],
          caption: str = "") -> None:
    """Print a table and keep it in the record for the Markdown file."""
    print_table(title, columns, rows, caption)
    record.tables.append((title, list(columns), [[_fmt(v) for v in row] for row in rows],
                          caption))


HARNESS_BOUND_PCT = 90.0
"""A harness process (writer, subscriber) busier than this share of a core sets the
figure itself: the target line then says so instead of blaming the servers."""


def saturated(label: str, pcts: list[float]) -> list[str]:
    """"<label> i at N% of a core" for each process busier than ``HARNESS_BOUND_PCT``."""
    return [f"{label} {i} at {v:.0f}% of a core" for i, v in enumerate(pcts)
            if v > HARNESS_BOUND_PCT]


def met_word(t: dict) -> str:
    if t.get("met"):
        return "yes"
    return "harness-bound" if t.get("harness_bound") else "NO"


def print_targets(record: Record) -> None:
    rows = [[t["name"], t["value"], ("< " if not t["higher_is_better"] else ">= ") + _fmt(t["target"]),
             t["unit"], met_word(t)] for t in record.data["targets"]]
    host = record.data["host"]
    table(record, f"{record.data['benchmark']}: targets", ["target", "value", "goal", "unit", "met"],
          rows, caption=f"{record.data['command']}\n{host['cores_logical']} cores, load "
          f"{host['loadavg_before']} -> {host.get('loadavg_after')}")


def _console():
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=150)


def _fmt(v) -> str:
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def log(message: str) -> None:
    """A progress line on stderr (stdout carries the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- progress

class Progress:
    """What a benchmark shows while it runs: one step per measured run.

    On a terminal, a rich progress bar over the steps with a live status line (the
    current step, the time left in its window and whatever ``status()`` returns, e.g.
    the received rate so far); otherwise (CI, a pipe) a log line on stderr when a step
    starts and a status line every ``every_s`` seconds while it waits.

        with rec.Progress("scaleout", total=9) as progress:
            progress.step("1 shard, server, round 1")
            progress.wait_until(window.t_end, status=lambda: f"{n:,} received")
    """

    def __init__(self, name: str, total: int, every_s: float = 5.0):
        self.name = name
        self.total = max(1, total)
        self.done = 0
        self.every_s = every_s
        self._bar = None
        self._task = None
        self._description = ""
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar,
                                       TextColumn, TimeElapsedColumn)

            self._bar = Bar(TextColumn("[bold]{task.fields[name]}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"),
                            console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("", total=self.total, name=name)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def step(self, description: str) -> None:
        """A new step begins; the previous one (if any) counts as done."""
        if self._description:
            self.done += 1
        self._description = description
        text = f"{self.name}: [{self.done + 1}/{self.total}] {description}"
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=description)
        else:
            log(text)

    def note(self, text: str) -> None:
        """A line about the current step (a result, a retry)."""
        if self._bar is not None:
            self._bar.console.print(f"  {text}")
        else:
            log(f"  {text}")

    def finish_step(self) -> None:
        if self._description:
            self.done += 1
            self._description = ""
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done)

    def wait_until(self, t: float, status=None) -> None:
        """Sleep until ``time.monotonic() >= t``, refreshing the live line (``status``:
        a callable returning a short string, called at most every 0.25 s)."""
        last_log = time.monotonic()
        while (left := t - time.monotonic()) > 0:
            time.sleep(min(left, 0.25))
            extra = ""
            if status is not None:
                try:
                    extra = status() or ""
                except Exception as exc:  # a status probe must never break a run
                    extra = f"(status: {exc})"
            left = max(0.0, t - time.monotonic())
            line = f"{self._description}: {left:4.1f} s left" + (f", {extra}" if extra else "")
            if self._bar is not None:
                self._bar.update(self._task, description=line)
            elif time.monotonic() - last_log >= self.every_s:
                last_log = time.monotonic()
                log(f"  {line}")
