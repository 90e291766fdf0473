"""`planner run` (execute a plan) and `planner compile` (re-target it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from planner.cli._app import KeyOpt, TrackerOpt, VerboseOpt, app
from planner.cli._errors import guard
from planner.cli._output import measured_line, note, say, stderr, stdout
from planner.cli._settings import info
from planner.inputs.defaults import DEFAULT_RUN_STEPS
from planner.units import kib


@app.command()
def run(
    plan_dir: Annotated[Path, typer.Argument(help="a plan directory written by `planner plan`")] = Path("plan"),
    data: Annotated[
        Path | None,
        typer.Option(
            help="dataset, made the model's input as the plan's was (its preprocessing, its tokenizer) [default: the plan's]"
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="training steps")] = DEFAULT_RUN_STEPS,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="where weights.npz and model.onnx go [default: PLAN_DIR/finetuned]")
    ] = None,
    no_shuffle: Annotated[
        bool, typer.Option("--no-shuffle", help="step k uses train samples [k*B, (k+1)*B) in file order")
    ] = False,
    seed: Annotated[int, typer.Option(help="shuffling seed")] = 0,
    target: Annotated[str | None, typer.Option(help="run on this target's boards over RPC [default: in this process]")] = None,
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="print before/after loss and accuracy as JSON")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Execute a plan: fine-tune with its compiled step, write the weights and a fine-tuned model.onnx.

    Runs in this process by default (e.g. on the board itself). With --target (an RPC target) or
    --tracker/--key, the training runs on a board and the updated weights come back.
    """
    from planner import api
    from planner.cli._progress import configure_logging

    configure_logging(stderr, verbose)
    r = guard(
        lambda: api.run(
            plan_dir,
            data=data,
            steps=steps,
            out=out_dir,
            shuffle=not no_shuffle,
            seed=seed,
            target=target,
            tracker=tracker,
            key=key,
        )
    )
    for warning in r.check.warnings if r.check else ():
        note(f"warning: {warning}")
    if json_out:
        print(json.dumps(r.to_json(), indent=2))
        return
    say(
        f"{r.steps} steps: val loss {r.before['loss']:.4f} → {r.after['loss']:.4f}, "
        f"{r.metric} {r.before[r.metric]:.4g} → {r.after[r.metric]:.4g} ({r.device}); wrote {r.out}/"
    )
    if r.check is not None:
        say(measured_line(r.check))


@app.command("compile")
def compile_(
    plan_dir: Annotated[Path, typer.Argument(help="a plan directory")],
    target: Annotated[str, typer.Option(help="target to compile for: a name in hw_targets/ or a YAML path")],
    out_dir: Annotated[Path, typer.Option("--out", help="the re-targeted plan directory")],
    tune_trials: Annotated[int, info("tune_trials")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="print the new plan.json")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Re-target a plan: compile its chosen training step for another board (cross-compiling)."""
    from planner import api
    from planner.cli._progress import configure_logging

    configure_logging(stderr, verbose)
    result = guard(lambda: api.compile(plan_dir, target=target, out=out_dir, tune_trials=tune_trials))
    if json_out:
        print(json.dumps(result.model_dump(mode="json"), indent=2))
        return
    stdout.print(
        f"compiled the plan's step for {result.target.name} into {out_dir}/: peak {kib(result.metrics.peak_memory_bytes.total)} "
        f"planned; latency and accuracy not measured there (measured on {result.measurement.retargeted_from})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
