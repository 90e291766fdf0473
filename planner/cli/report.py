"""`planner report`: a plan's or a study's report, as html, md or json."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from planner.cli._app import app
from planner.cli._errors import guard
from planner.cli._output import stderr


@app.command()
def report(
    plan_dir: Annotated[Path, typer.Argument(help="a plan directory")] = Path("plan"),
    fmt: Annotated[
        Literal["html", "md", "json"],
        typer.Option(
            "--format",
            help="html: one self-contained page with the figures (plotly inlined, opens offline); md: tables; json: the data behind both",
        ),
    ] = "html",
    out_file: Annotated[Path | None, typer.Option("--out", help="write the report here [default: stdout]")] = None,
    storage: Annotated[
        str | None,
        typer.Option(help="report a study in this Optuna storage instead (with --study); works while workers still run"),
    ] = None,
    study: Annotated[str | None, typer.Option(help="study name in --storage")] = None,
) -> None:
    """Report a plan: Pareto front, memory breakdown, per-layer map, trial history, provenance.

    `planner plan` already writes report.html and report.md into the plan directory; this
    re-renders them, in another format, or for a study in storage that has no plan yet.
    """
    from planner import api

    text = guard(lambda: api.report(plan_dir, storage=storage, study=study, fmt=fmt))
    if out_file is None:
        sys.stdout.write(text)
        return
    guard(lambda: _write_text(out_file, text))
    stderr.print(f"wrote {out_file}", markup=False, highlight=False)


def _write_text(path: Path, text: str) -> None:
    from planner.errors import BadInput

    try:
        path.write_text(text)
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror}") from None
