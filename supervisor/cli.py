"""``supervisor`` command line: a click group whose sub-commands live one per module in
``supervisor/commands/`` (each module defines ``command``), discovered at start-up."""
from __future__ import annotations

import importlib
import pkgutil

import click

from supervisor import commands as _commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run and control a clonemap cluster (not supervisord)."""


for _info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda i: i.name):
    _module = importlib.import_module(f"{_commands.__name__}.{_info.name}")
    main.add_command(_module.command)
