"""`planner operators`: the operator table — which ONNX operators train, run frozen only, or are refused."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from planner.cli._app import app
from planner.cli._errors import guard
from planner.cli._output import stdout


@app.command()
def operators(
    names: Annotated[list[str] | None, typer.Argument(help="operators to show (default: all), e.g. Conv Resize")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="print docs/operators.md")] = False,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """What planner does with each ONNX operator: trains (a gradient flows through it, proven against
    finite differences), frozen only (runs where no gradient is needed), or refused (a model holding
    it is refused when loaded). An operator not listed is refused.

        planner operators Conv ConvTranspose Resize
    """
    from planner import api

    if markdown:
        print(api.operators_markdown(), end="")
        return
    rows = guard(lambda: api.operators(names))
    if json_out:
        print(json.dumps([op.to_json() for op in rows], indent=2))
        return
    table = Table()
    for col in ("operator", "support", "PyTorch", "limits"):
        table.add_column(col, overflow="fold")
    for op in rows:
        table.add_row(
            *map(escape, (op.name, op.support.value, op.what.replace("`", ""), "; ".join(op.limits()).replace("`", "")))
        )
    stdout.print(table)
