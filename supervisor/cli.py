"""``supervisor`` command line: a click group whose sub-commands live one per module in
``supervisor/commands/`` (each module defines ``command``, named as its module). A
command's module is imported when that command runs (or a listing needs its help): a
``supervisor stop`` does not load what ``start`` and ``reshard`` need, ~50 ms of every
short command's start."""
from __future__ import annotations

import importlib
import os
import pkgutil

# pydantic looks for plugins when it builds its first model, by reading the metadata of
# every installed distribution: ~80 ms of a `supervisor validate` here (0.43 -> 0.35 s of
# CPU), paid by every command that reads a config. The supervisor's commands use no
# pydantic plugin; a value the operator set wins.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

import click  # noqa: E402  (after the setting above, as the imports below are)

from clonemap.supervisor import commands as _commands
from clonemap.supervisor.control import common_options
from clonemap.shards.common.version_option import version_option


class _Commands(click.Group):
    """The group's commands, found by their modules' names and imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(info.name for info in pkgutil.iter_modules(_commands.__path__))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.list_commands(ctx):
            return None
        command = importlib.import_module(f"{_commands.__name__}.{name}").command
        assert command.name == name, (name, command.name)  # (a module names its command)
        return command


def _group_options(fn):
    for decorate in reversed(common_options()):
        fn = decorate(fn)
    return fn


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@version_option("supervisor")
@_group_options
def main(control: str | None, config: str | None, host: str | None,
         identity: str | None, timeout_s: float | None) -> None:
    """Run and control a clonemap cluster (not supervisord).

    The control commands (status, stop, kill, restart, logs) take the cluster the same
    way, before or after the command: a CONFIG argument or --config, --control, else
    $CLONEMAP_CONTROL; --host NAME for a config over several hosts; --identity NAME for
    a named client identity; and --timeout-s."""

