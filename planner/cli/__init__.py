"""The command line: a thin shell over the public API (`planner.api`), one module per command group.

`_app` holds the Typer application, `_output` where results and messages go, `_errors` how an
error becomes one line and an exit code; `search`, `measure`, `run`, `example`, `report`, `targets`,
`board` and `operators` register their commands on import, in the order `planner --help` lists them.
"""

from __future__ import annotations

import sys

from planner.cli._app import app

# isort: off
# importing a command module registers its commands, in this order (`planner --help` lists them so);
# a board's install (TVM's runtime, typer and rich, no pydantic: `planner board serve`) has the board's alone
try:
    import pydantic  # noqa: F401
except ImportError:
    from planner.cli import board  # noqa: F401
else:
    from planner.cli import search, measure, run, example, report, targets, board, operators  # noqa: F401
# isort: on

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # raised outside a command body (e.g. during imports)
        sys.exit(130)
