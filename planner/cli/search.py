"""`planner plan` and `planner worker`: the search, from one process or many."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

import typer

from planner.cli._app import (
    DATA_HELP,
    KeyOpt,
    OverlapOpt,
    PreprocessOpt,
    QuietOpt,
    TokenizerOpt,
    TrackerOpt,
    TuneOpt,
    VerboseOpt,
    app,
)
from planner.cli._errors import INTERRUPTED, LEARNED_NOTHING, guard
from planner.cli._output import learned_nothing, note, plan_summary, stderr, stdout
from planner.inputs.defaults import DEFAULT_ACCURACY_STEPS, DEFAULT_TARGET, DEFAULT_TRIALS
from planner.search.samplers import DEFAULT_SAMPLER, SAMPLERS

# the `--sampler` choices: every sampler registered by name
SamplerName = StrEnum("SamplerName", {name: name for name in SAMPLERS})  # type: ignore[misc]  # members from the registry


@app.command()
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
    trials: Annotated[
        int, typer.Option(help="finished trials the study should hold; a rerun only adds the missing ones")
    ] = DEFAULT_TRIALS,
    timeout: Annotated[float | None, typer.Option(help="stop starting new trials after this many seconds")] = None,
    seed: Annotated[int, typer.Option(help="sampler and fine-tuning seed")] = 0,
    storage: Annotated[str | None, typer.Option(help="Optuna storage URL [default: sqlite:///OUT/study.db]")] = None,
    study: Annotated[str, typer.Option(help="study name in the storage")] = "planner",
    select: Annotated[
        Literal["memory", "latency", "accuracy"],
        typer.Option(
            help="pick the least memory / least latency among trials within --accuracy-tolerance of the best, or the most accurate"
        ),
    ] = "memory",
    accuracy_tolerance: Annotated[float, typer.Option(help="accuracy a plan may give up against the best feasible trial")] = 0.01,
    accuracy_steps: Annotated[
        int, typer.Option(help="fine-tuning steps per candidate for its accuracy")
    ] = DEFAULT_ACCURACY_STEPS,
    screen_steps: Annotated[
        int | None,
        typer.Option(
            help="fine-tune every candidate this many steps first and go on to --accuracy-steps only when no "
            "finished trial is better by then (more accurate, no slower, no larger); the space's hand-made "
            "recipes always get all steps, screened-out trials are never the plan. 0: every candidate gets all "
            "steps [default: a quarter of --accuracy-steps]",
            show_default=False,
        ),
    ] = None,
    overlap: OverlapOpt = True,
    tune_trials: TuneOpt = 0,
    sampler: Annotated[
        SamplerName, typer.Option(help="; ".join(f"{name}: {s.help}" for name, s in SAMPLERS.items()))
    ] = SamplerName(DEFAULT_SAMPLER),
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
    budgets: Annotated[
        str | None,
        typer.Option(
            help="RAM budgets, comma-separated (e.g. 256KiB,1MiB,4MiB): a plan for each from the same trials, "
            "in OUT/<budget>/, so a device takes the one that fits; the study keeps the trials within the "
            "largest, and the report marks every budget [default: the target's ram_budgets, if it lists any]",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print plan.json to stdout")] = False,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
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
    with TrialProgress(stderr, quiet, verbose) as progress, graceful_interrupt(stderr) as stop:
        result = guard(
            lambda: api.plan(
                model=model,
                data=data,
                preprocess=preprocess,
                tokenizer=tokenizer,
                target=target,
                space=space,
                out=out,
                trials=trials,
                timeout_s=timeout,
                seed=seed,
                storage=storage or api.default_storage(out),
                study=study,
                policy=select,
                accuracy_tolerance=accuracy_tolerance,
                accuracy_steps=accuracy_steps,
                screen_steps=screen_steps,
                overlap=overlap,
                tracker=tracker,
                key=key,
                on_trial=progress.trial,
                on_start=progress.start,
                on_data=progress.data,
                stop=stop,
                tune_trials=tune_trials,
                sampler=sampler.value,
                budgets=None if budgets is None else [b for b in budgets.split(",") if b.strip()],
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
    overlap: OverlapOpt = True,
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
    with TrialProgress(stderr, quiet, verbose) as progress, graceful_interrupt(stderr) as stop:
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
