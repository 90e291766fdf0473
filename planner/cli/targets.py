"""`planner targets`: list, show and check hardware targets."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from planner.cli._app import KeyOpt, TrackerOpt, app
from planner.cli._errors import guard
from planner.cli._output import stdout

targets_app = typer.Typer(help="Hardware targets: list, show, check.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(targets_app, name="targets")


@targets_app.command("list")
def targets_list(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The shipped targets (hw_targets/*.yaml)."""
    from planner.inputs.targets import budget_label, list_targets
    from planner.measurement import runner_for

    targets = guard(list_targets)
    if json_out:
        print(json.dumps([t.model_dump() for t in targets], indent=2))
        return
    table = Table()
    for col in ("name", "device", "RAM budget", "TVM target"):
        table.add_column(col)
    for t in targets:
        tvm_target = " ".join(str(t.tvm_target[k]) for k in ("kind", "mtriple", "mcpu") if k in t.tvm_target)
        table.add_row(t.name, guard(lambda: runner_for(t)).device, budget_label(t.ram_budget_bytes), tvm_target)
    stdout.print(table)


@targets_app.command("show")
def targets_show(name: Annotated[str, typer.Argument(help="a target name or YAML path")]) -> None:
    """One target, as planner reads it (JSON)."""
    from planner.inputs.targets import load_target

    print(json.dumps(guard(lambda: load_target(name)).model_dump(), indent=2))


@targets_app.command("check")
def targets_check(
    name: Annotated[str, typer.Argument(help="a target name or YAML path")],
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Resolve the TVM target, find the toolchain, and ask the tracker how many boards are free."""
    from planner import api

    report = guard(lambda: api.check_target(name, tracker=tracker, key=key))
    if json_out:
        print(json.dumps(report, indent=2))
        return
    for k, v in report.items():
        stdout.print(f"{k:>10}: {v}", markup=False, highlight=False, soft_wrap=True)
