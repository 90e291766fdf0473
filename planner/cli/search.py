"""`planner plan` and `planner worker`: the search, from one process or many."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from planner.cli._app import (
    DATA_HELP,
    KeyOpt,
    PreprocessOpt,
    QuietOpt,
    TokenizerOpt,
    TrackerOpt,
    VerboseOpt,
    app,
    short_gil_turns,
)
from planner.cli._errors import INTERRUPTED, LEARNED_NOTHING, guard
from planner.cli._output import learned_nothing, note, plan_summary, stderr, stdout
from planner.cli._settings import info, with_settings
from planner.inputs.defaults import DEFAULT_TARGET


@app.command()
@with_settings
def plan(
    model: Annotated[Path | None, typer.Option(help="ONNX classifier [default: the bundled digits example]")] = None,
    data: Annotated[Path | None, typer.Option(help=f"{DATA_HELP} [default: the example's]", show_default=False)] = None,
    preprocess: PreprocessOpt = None,
    tokenizer: TokenizerOpt = None,
    target: Annotated[str, typer.Option(help="hardware target: a name in hw_targets/ or a YAML path")] = DEFAULT_TARGET,
    space: Annotated[
        str | None, typer.Option(help="search space: a name in search_spaces/ or a YAML path [default: per-layer]")
    ] = None,
    out: Annotated[Path, typer.Option(help="plan directory (plan.json, train_step.so, weights.npz, report.md, study.db)")] = Path(
        "plan"
    ),
    storage: Annotated[str | None, typer.Option(help="Optuna storage URL [default: sqlite:///OUT/study.db]")] = None,
    study: Annotated[str, typer.Option(help="study name in the storage")] = "planner",
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="print plan.json to stdout")] = False,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
    settings: dict | None = None,
) -> None:
    """Search for the best training plan and write it to --out.

    With no arguments, plans the bundled example (a digits CNN adapting to a new sensor) on this
    machine. Each trial compiles the candidate's training step with TVM, times it, plans its
    memory and fine-tunes it for real. Ctrl-C lets the trials in flight finish and writes the
    plan from the finished trials (exit 130); the same command resumes the study.
    """
    from planner import api
    from planner.cli._progress import TrialProgress, configure_logging, graceful_interrupt

    configure_logging(stderr, verbose)
    with TrialProgress(stderr, quiet, verbose) as progress, graceful_interrupt(stderr) as stop, short_gil_turns():
        result = guard(
            lambda: api.plan(
                model=model,
                data=data,
                preprocess=preprocess,
                tokenizer=tokenizer,
                target=target,
                space=space,
                out=out,
                storage=storage or api.default_storage(out),
                study=study,
                tracker=tracker,
                key=key,
                on_trial=progress.trial,
                on_start=progress.start,
                on_data=progress.data,
                stop=stop,
                **(settings or {}),
            )
        )
    if result.interrupted:
        if result.plan is None:
            note(
                f"interrupted: no feasible trial among the {result.finished} finished, so no plan; rerun the same command to resume"
            )
        else:
            plan_summary(result)
            note(
                f"interrupted: plan written to {result.out}/ from the {result.finished} finished trials; rerun the same command to resume"
            )
        raise typer.Exit(INTERRUPTED)
    assert result.plan is not None, "only an interrupted search ends without a plan"
    if json_out:
        print(json.dumps(result.plan.model_dump(mode="json"), indent=2))
    else:
        plan_summary(result)
    if result.plan.selection.learned is False:
        note(learned_nothing(result.plan))
        raise typer.Exit(LEARNED_NOTHING)


@app.command()
def worker(
    storage: Annotated[
        str, typer.Option(help="the study's Optuna storage: a journal file path (safe for many processes) or an RDB URL")
    ],
    study: Annotated[str, typer.Option(help="study name in the storage")],
    trials: Annotated[
        int | None, typer.Option(help="trials to run here [default: until the study holds the count it was created with]")
    ] = None,
    overlap: Annotated[bool, info("overlap")] = True,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="print the study's finished trials, and this process's, as JSON")
    ] = False,
) -> None:
    """Join a study `planner plan --storage … --study …` created and run trials for it.

    The model, data, target and space are stored with the study, so a worker needs nothing else
    (the files must be at the same paths here). Start any number, on this machine or others
    sharing the storage; each finished trial is in the study at once. Rerun `planner plan` with
    the same storage and study to write the plan from all of them.
    """
    from planner import api
    from planner.cli._progress import TrialProgress, configure_logging, graceful_interrupt

    configure_logging(stderr, verbose)
    with TrialProgress(stderr, quiet, verbose) as progress, graceful_interrupt(stderr) as stop, short_gil_turns():
        records = guard(
            lambda: api.work(
                storage=storage,
                study=study,
                trials=trials,
                overlap=overlap,
                on_trial=progress.trial,
                on_start=progress.start,
                on_data=progress.data,
                stop=stop,
            )
        )
    finished = sum(r.state.finished for r in records)
    if stop.is_set():
        stderr.print(
            f"interrupted: study '{study}' holds {finished} finished trials; start the worker again to go on",
            markup=False,
            highlight=False,
        )
        raise typer.Exit(INTERRUPTED)
    if json_out:
        from planner.search.study import worker

        mine = sum(r.worker == worker() and r.state.finished for r in records)
        from planner.search.urls import redact

        print(
            json.dumps({"study": study, "storage": redact(storage), "finished": finished, "ran_here": mine, "worker": worker()})
        )
        return
    stdout.print(f"study '{study}' holds {finished} finished trials", markup=False, highlight=False)
