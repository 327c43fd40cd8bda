"""``--version`` / ``-V`` for the ``supervisor`` and ``chp`` commands: "PROG (clonemap)
VERSION", with the version looked up only when asked (``clonemap.__version__``: the
installed distribution's metadata, whose import every process would otherwise pay at
its start)."""
from __future__ import annotations

from typing import Any, Callable

import click


def version_option(prog: str) -> Callable[[Any], Any]:
    """The option, for ``prog``'s top-level group."""
    def show(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if not value or ctx.resilient_parsing:
            return
        import clonemap

        click.echo(f"{prog} (clonemap) {clonemap.__version__}")
        ctx.exit()

    return click.option("--version", "-V", is_flag=True, expose_value=False, is_eager=True,
                        callback=show, help="Show the version and exit.")
