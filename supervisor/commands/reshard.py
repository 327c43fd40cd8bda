"""``supervisor reshard CONFIG --to NEW_CONFIG``: change the running cluster's routing
(MDP ``cluster.reshard``, which needs ``admin``; ``clonemap.supervisor.resharding``).

The supervisor plans NEW_CONFIG on its host (its shard count and pins are the new
routing; the running shards keep their names and servers; added shards' servers are
placed like ``start``'s), every server counts the keys it would give up, by target
shard, and the command prints that plan. After a yes on a terminal the supervisor
applies it: added shards start, the keys move while they are written, the owner flips
under the next epoch, removed shards stop (``clonemap.supervisor.resharding``). With
``--yes`` the command sends the apply at once: the supervisor starts the added shards
while the servers count, and says the plan first (printed as it comes). The command
prints the new epoch and what the move took. ``--abort`` (from another terminal) stops
the change under way at its next step and rolls it back, until it seals its holds (past
that it always completes). Exit 0 applied (or nothing to change, or ``--dry-run``, or an
abort asked), 1 refused or rolled back (or an abort refused), 2 a NEW_CONFIG that does
not validate, 9 without ``admin``, 4 when no supervisor answers.
"""
from __future__ import annotations

import contextlib
import json
import sys

import click

from clonemap.shards.common.cpu_priority import COPY_PRIORITIES
from clonemap.shards.common.errors import ConfigError
from clonemap.supervisor.control import (ReplyError, Selection, call, control_options, ping,
                                         run_command)



_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_rate(text: str) -> float:
    """``--copy-rate``'s bytes per second: a number with an optional unit (``4MiB``,
    ``40MB``, ``500kB``, ``1048576``; an optional ``/s``); 0: unpaced."""
    import re

    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*(?:/s)?\s*", text)
    unit = found[2].lower() if found else ""
    if found is None or unit not in _UNITS:
        raise click.BadParameter(f"{text!r} is not bytes per second (e.g. 4MiB, 40MB, "
                                 "1048576, 0 for unpaced)")
    return float(found[1]) * _UNITS[unit]


def routing_change(path: str) -> dict:
    """``cluster.reshard``'s body: NEW_CONFIG, checked here first (``ConfigError``)."""
    from pathlib import Path

    from clonemap.shards.common.config import load_config

    load_config(path)
    return {"config": str(Path(path).resolve())}


def plan_lines(plan: dict) -> list[str]:
    was, now = plan.get("shards", [0, 0])
    lines = [f"routing epoch {plan['epoch']} -> {plan.get('next_epoch', plan['epoch'])}"
             + (f", {was} -> {now} shards" if was != now else "")]
    for prefix, (was, now) in sorted(plan.get("prefixes", {}).items()):
        lines.append(f"  prefix {prefix!r}: shard {was} -> shard {now}")
    moves = plan.get("moves", [])
    for m in moves:
        lines.append(f"  shard {m['from']} -> shard {m['to']}: {m['keys']} keys, "
                     f"{m['bytes']} bytes")
    if not moves:
        lines.append("  no key moves")
    return lines


PLAN_TIMEOUT_S = 60.0
"""How long the command waits for the plan (each server counts its map once)."""
APPLY_TIMEOUT_S = 15.0
"""How long it waits for the next word of a change under way (the supervisor says how
far it got every half second; silence this long means it is gone)."""


class _Bar:
    """On a terminal: the keys copied against the plan's, and the phase (rich)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(TextColumn("reshard"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.description}"))
        self._task = self._progress.add_task("planning", total=max(total, 1))

    def update(self, phase: str, keys: int | None) -> None:
        self._progress.update(self._task, description=phase,
                              **({"completed": keys} if keys is not None else {}))

    def __enter__(self) -> "_Bar":
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()


@click.command("reshard")
@click.option("--to", "new_config", default=None, type=click.Path(dir_okay=False),
              help="The config whose routing (shard count and pins) the cluster takes.")
@click.option("--yes", is_flag=True, help="Apply without asking.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@click.option("--copy-rate", default=None, metavar="BYTES/S",
              help="How fast each target copies at most, e.g. 4MiB (default: 2 MiB/s "
                   "per core the supervisor may use, from 4 to 32 MiB/s; 0: unpaced). "
                   "Lower it on a host with little CPU to spare.")
@click.option("--copy-priority", type=click.Choice(COPY_PRIORITIES), default=None,
              help="The CPU priority of an added shard's servers while they copy: idle "
                   "(the default: only the CPU the serving shards and their clients "
                   "leave) or normal.")
@click.option("--abort", is_flag=True,
              help="Stop the change under way and roll it back (refused once it sealed "
                   "its holds: past that it completes).")
@control_options
def command(sel: Selection, new_config: str | None, yes: bool, dry_run: bool,
            copy_rate: str | None, copy_priority: str | None, abort: bool) -> None:
    """Change the running cluster's routing to NEW_CONFIG's (a new routing epoch), or
    with --abort stop the change under way."""
    if abort:
        def stop() -> int:
            from clonemap.supervisor.services import ABORT_BODY

            try:
                said = call(sel.endpoint(), "cluster.reshard", ABORT_BODY,
                            timeout_s=sel.timeout_s, retries=0)
            except ReplyError as exc:
                if exc.status == "409":
                    click.echo(f"error: not aborted: {exc.text}", err=True)
                    return 1
                raise
            click.echo(said.decode())
            return 0

        run_command(stop)
        return
    if new_config is None:
        raise click.UsageError("--to NEW_CONFIG is needed (or --abort)")
    rate = parse_rate(copy_rate) if copy_rate is not None else None

    def body() -> int:
        try:
            change = routing_change(new_config)
        except ConfigError as exc:
            raise ConfigError(f"{new_config}: {exc}", field=exc.field) from None
        if rate is not None:
            change["copy_rate"] = rate
        if copy_priority is not None:
            change["copy_priority"] = copy_priority
        endpoint = sel.endpoint()
        ping(endpoint, "cluster.reshard", sel.timeout_s)
        printed = {"plan": False}
        if dry_run or not yes:  # the plan first, then the question
            plan = json.loads(call(endpoint, "cluster.reshard",
                                   json.dumps(dict(change, apply=False)).encode(),
                                   timeout_s=max(sel.timeout_s, PLAN_TIMEOUT_S), retries=0))
            if plan.get("prefixes") is not None and not plan.get("next_epoch"):
                click.echo(f"nothing to change: the cluster routes as {new_config} "
                           f"(epoch {plan['epoch']})")
                return 0
            for line in plan_lines(plan):
                click.echo(line)
            printed["plan"] = True
            if dry_run:
                return 0
            if not sys.stdin.isatty():
                click.echo("error: not applied: add --yes (no terminal to ask on)", err=True)
                return 1
            if not click.confirm("apply?", default=False):
                return 1
        # (with --yes one request: the supervisor counts the plan while it starts the
        # added shards, and says the plan first, which is printed then)
        shown = {"phase": ""}
        bars = contextlib.ExitStack()
        bar: list[_Bar] = []

        def show_bar(plan: dict) -> None:  # (on a terminal: the keys copied, the phase)
            if sys.stdout.isatty() and not bar:
                bar.append(bars.enter_context(_Bar(sum(
                    m["keys"] for m in plan.get("moves", [])))))

        if printed["plan"]:
            show_bar(plan)

        def progress(body: bytes) -> None:
            try:
                doc = json.loads(body)
            except ValueError:
                return
            if isinstance(doc.get("plan"), dict):
                if not printed["plan"]:
                    printed["plan"] = True
                    for line in plan_lines(doc["plan"]):
                        click.echo(line)
                show_bar(doc["plan"])
                return
            if not printed["plan"]:  # (the count's beats: the plan comes first)
                return
            if bar:  # a terminal: one bar, the phase beside it
                bar[0].update(doc.get("phase") or "", doc.get("keys"))
                return
            if doc.get("phase") != shown["phase"]:
                shown["phase"] = doc.get("phase")
                click.echo(f"  {doc.get('phase')}")
            elif "keys" in doc and doc["keys"] != shown.get("keys"):
                shown["keys"] = doc["keys"]
                click.echo(f"    copied {doc['keys']} keys, {doc['bytes']} bytes")

        try:
            with bars:
                done = json.loads(call(endpoint, "cluster.reshard",
                                       json.dumps(dict(change, apply=True)).encode(),
                                       timeout_s=max(sel.timeout_s, APPLY_TIMEOUT_S),
                                       retries=0, on_partial=progress))
        except ReplyError as exc:
            if exc.status == "409":
                click.echo(f"error: not applied: {exc.text}", err=True)
                return 1
            raise
        if done.get("changed") is False:
            click.echo(f"nothing to change: the cluster routes as {new_config} "
                       f"(epoch {done['epoch']})")
            return 0
        click.echo(f"routing epoch {done['epoch']}: followed by {len(done['servers'])} "
                   "servers and relays")
        if done.get("moved_keys") is not None:
            phases = done.get("phases", {})
            click.echo(f"moved {done['moved_keys']} keys in {done['took_s']:.3f} s "
                       f"(copy {phases.get('copy_s', 0):.3f} s, writes held "
                       f"{phases.get('hold_s', 0) * 1000:.0f} ms, attempt "
                       f"{done['attempts']}; of the hold: catch-up "
                       f"{phases.get('catch_up_s', 0) * 1000:.0f} ms, commit "
                       f"{phases.get('commit_s', 0) * 1000:.0f} ms)")
            pace = done.get("copy_rate")
            click.echo(f"the copy paused {phases.get('copy_paused_s', 0):.3f} s to keep "
                       f"within {pace / 2**20:.3g} MiB/s per target" if pace else
                       "the copy was not paced (--copy-rate 0)")
            before, after = (done.get("shards") or [0, 0])[:2]
            if done.get("background"):
                click.echo(f"copied at background CPU priority: {', '.join(done['background'])}")
            elif done.get("copy_priority") == "idle" and after > before:
                click.echo("copied at normal CPU priority (the added shard's servers could "
                           "not go to the background: see the supervisor's log)")
        for index in done.get("removed", []):
            click.echo(f"shard {index} is removed: its servers stop in a few heartbeats "
                       "(their data directories stay)")
        return 0

    run_command(body)
