"""``supervisor`` command line: a click group whose sub-commands live one per module in
``supervisor/commands/`` (each module defines ``command``), discovered at start-up."""
from __future__ import annotations

import importlib
import pkgutil

import click

from clonemap.supervisor import commands as _commands
from clonemap.supervisor.control import common_options
from clonemap.shards.common.version_option import version_option


def _group_options(fn):
    for decorate in reversed(common_options()):
        fn = decorate(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@version_option("supervisor")
@_group_options
def main(control: str | None, config: str | None, host: str | None,
         identity: str | None, timeout_s: float | None) -> None:
    """Run and control a clonemap cluster (not supervisord).

    The control commands (status, stop, kill, restart, logs) take the cluster the same
    way, before or after the command: a CONFIG argument or --config, --control, else
    $CLONEMAP_CONTROL; --host NAME for a config over several hosts; --identity NAME for
    a named client identity; and --timeout-s."""


for _info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda i: i.name):
    _module = importlib.import_module(f"{_commands.__name__}.{_info.name}")
    main.add_command(_module.command)
