"""The status table: one row per server from ``cluster.status`` rows (or
``Runner.describe()``), rendered with rich for the live view and ``supervisor status``.

    column     what
    shard      the shard's name
    role       primary / backup (the configured role; Binary Star decides who serves)
    bstar      the server's Binary Star state: ACTIVE serves clients, PASSIVE replicates,
               PRIMARY/BACKUP still looking for its peer; ``-``: no stats from this run
               of the server yet (it is starting, restarting, or does not answer)
    pid        the process id of the current run
    cores      the cores it is pinned to
    address    the address and port base P it binds (P..P+3); only ``port`` when every
               server binds one address (it is then in the title)
    seq        the shard's last sequence number seen by this server
    keys       keys in its map
    upd/s      updates per second since the previous poll (about 1 s)
    restarts   how often the supervisor started it again
    state      RUNNING, STARTING, BACKOFF (waiting to restart: shows the delay),
               FAILED (crashed too often: not restarted), STOPPING, STOPPED
"""
from __future__ import annotations

import time

from rich import box
from rich.table import Table
from rich.text import Text

STATE_STYLE = {"RUNNING": "green", "STARTING": "cyan", "BACKOFF": "yellow",
               "FAILED": "bold red", "STOPPING": "magenta", "STOPPED": "dim"}
BSTAR_STYLE = {"ACTIVE": "bold green", "PASSIVE": "blue"}
COLUMNS = ("shard", "role", "bstar", "pid", "cores", "address", "seq", "keys", "upd/s",
           "restarts", "state")
NUMERIC = {"pid", "seq", "keys", "upd/s", "restarts"}


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _state(row: dict) -> Text:
    state = row.get("state", "?")
    text = state
    if state == "BACKOFF" and row.get("restart_in_s") is not None:
        text += f" {row['restart_in_s']:.1f}s"
    elif state == "FAILED":
        text += f" ({row.get('reason', '')})"
    return Text(text, style=STATE_STYLE.get(state, ""))


def row_cells(row: dict, with_address: bool = True) -> list:
    rate = row.get("updates_per_s")
    bstar = row.get("bstar")
    where = f"{row.get('address')}:{row.get('port')}" if with_address else str(row.get("port"))
    return [row.get("shard", "?"), row.get("role", "?"),
            Text(_dash(bstar), style=BSTAR_STYLE.get(bstar or "", "")),
            _dash(row.get("pid")), row.get("cores_text") or ",".join(map(str, row["cores"])),
            where, _dash(row.get("seq")), _dash(row.get("keys")),
            "-" if rate is None else f"{rate:.0f}", str(row.get("restarts", 0)), _state(row)]


def common_address(rows: list[dict]) -> str | None:
    """The one address every server binds, if there is one."""
    addresses = {row.get("address") for row in rows}
    return addresses.pop() if len(addresses) == 1 else None


def status_table(rows: list[dict], title: str | None = None) -> Table:
    """The table; when every server binds one address it goes to the title and the
    column shows only the port (so the table fits 80 columns)."""
    shared = common_address(rows)
    if shared is not None and title is not None:
        title += f"  address {shared}"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, collapse_padding=True)
    for column in COLUMNS:
        name = "port" if column == "address" and shared is not None else column
        table.add_column(name, justify="right" if column in NUMERIC else "left",
                         no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*row_cells(row, with_address=shared is None))
    return table


def status_notes(rows: list[dict], summary: dict) -> list[str]:
    """Lines under the table: shards without an ACTIVE server (in words), what ``-``
    means when it shows, and recent takeovers."""
    from clonemap.supervisor.health import shards_without_active

    lines = []
    routing = summary.get("routing") or {}
    if routing.get("running"):
        lines.append(f"[bold]resharding[/] to {routing.get('to')}: phase "
                     f"{routing.get('phase') or '-'}, {routing.get('keys', 0):,} keys "
                     f"({routing.get('bytes', 0):,} bytes) copied; routing epoch "
                     f"{routing.get('epoch')}")
    without = summary.get("without_active")
    if not isinstance(without, list):
        without = shards_without_active(rows)
    for shard in without:
        mine = [r for r in rows if r.get("shard") == shard]
        states = ", ".join(f"{r['role']} {r.get('state')}"
                           + (f" ({r['bstar']})" if r.get("bstar") else "") for r in mine)
        waiting = [r["role"] for r in mine
                   if r.get("state") == "RUNNING" and r.get("bstar") == "PASSIVE"]
        if waiting and len(waiting) < len(mine):
            effect = (f"the {waiting[0]} is PASSIVE and takes over at the next client "
                      "request (a Binary Star vote)")
        else:
            effect = "its clients cannot read a snapshot or write now"
        lines.append(f"[bold red]{shard} has no ACTIVE server[/]: {effect} ({states})")
    for row in rows:
        name = row.get("name") or f"{row.get('shard')}/{row.get('role')}"
        if row.get("disk_error"):
            lines.append(f"[bold red]{name}: disk error[/]: {row['disk_error']}; it stopped "
                         "so that its peer serves, and is restarted until its disk works "
                         "(free space, or fix the device)")
        stats = row.get("stats") or {}
        if stats.get("needs_peer"):
            lines.append(f"[yellow]{name}: its data directory could not be read[/] "
                         f"({row.get('unreadable') or 'moved aside'}); it serves only "
                         "after copying its peer's map")
    if any(row.get("bstar") is None for row in rows):
        lines.append("[dim]bstar -: no stats from that run of the server yet (starting, "
                     "restarting, or not answering)[/]")
    for event in (summary.get("events") or [])[-5:]:
        at = time.strftime("%H:%M:%S", time.localtime(event.get("at", 0)))
        lines.append(f"{at} {event.get('text')}")
    return lines


def summary_line(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.get("state", "?")] = counts.get(row.get("state", "?"), 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
