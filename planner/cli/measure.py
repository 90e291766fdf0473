"""`planner measure` (one explicit scheme) and `planner inspect` (the model's layers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from planner.cli._app import DATA_HELP, KeyOpt, PreprocessOpt, TokenizerOpt, TrackerOpt, VerboseOpt, app
from planner.cli._errors import guard
from planner.cli._output import note, plan_summary, stderr, stdout
from planner.cli._settings import info
from planner.errors import NoFeasiblePlan
from planner.inputs.defaults import DEFAULT_ACCURACY_STEPS, DEFAULT_TARGET


@app.command()
def measure(
    model: Annotated[Path, typer.Argument(help="ONNX classifier")],
    scheme: Annotated[
        Path, typer.Option(help="scheme YAML: trainable layers/params, batch_size, optimizer {name, lr}, precision")
    ],
    data: Annotated[Path, typer.Option(help=DATA_HELP)],
    preprocess: PreprocessOpt = None,
    tokenizer: TokenizerOpt = None,
    target: Annotated[str, typer.Option(help="hardware target: a name in hw_targets/ or a YAML path")] = DEFAULT_TARGET,
    out: Annotated[Path, typer.Option(help="plan directory to write")] = Path("plan"),
    seed: Annotated[int, typer.Option(help="fine-tuning seed")] = 0,
    accuracy_steps: Annotated[int, typer.Option(help="fine-tuning steps for the accuracy")] = DEFAULT_ACCURACY_STEPS,
    tune_trials: Annotated[int, info("tune_trials")] = 0,
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="print plan.json to stdout")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Measure one explicit scheme (e.g. a paper's) with no search; writes a plan directory.

    The directory has the format `planner plan` writes, so `planner run DIR` executes it and its
    numbers compare directly with a searched plan's. With -v it also prints the step's kernel
    profile: each kernel's time per step and GFLOP/s, slowest first (targets measured here).
    """
    from planner import api
    from planner.cli._progress import configure_logging
    from planner.inputs.targets import load_target
    from planner.measurement import runner_for

    configure_logging(stderr, verbose)
    profile = verbose and tracker is None and guard(lambda: runner_for(load_target(target))).runs_here
    result = guard(
        lambda: api.measure(
            model,
            scheme=scheme,
            data=data,
            preprocess=preprocess,
            tokenizer=tokenizer,
            target=target,
            out=out,
            seed=seed,
            accuracy_steps=accuracy_steps,
            tracker=tracker,
            key=key,
            tune_trials=tune_trials,
            profile=profile,
        )
    )
    assert result.plan is not None, "`measure` always writes a plan"
    if json_out:
        print(json.dumps(result.plan.model_dump(mode="json"), indent=2))
    else:
        plan_summary(result)
    if result.plan.selection.feasible is False:  # written, measured, and not deployable as it is
        raise typer.Exit(NoFeasiblePlan.exit_code)
    if json_out:
        return
    if result.profile is not None:
        _print_profile(result.profile)
    elif verbose:
        note("kernel profile: only for a target measured on this machine")


PROFILE_ROWS = 15


def _print_profile(profile) -> None:
    """The slowest kernels of the step, then the rest in one line."""
    table = Table(title=f"kernel profile: {profile.step_seconds * 1e3:.2f} ms per instrumented step (mean of {profile.steps})")
    for column in ("kernel", "calls", "ms/step", "share", "GFLOP/s"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    total = sum(k.seconds for k in profile.kernels) or 1.0
    for k in profile.kernels[:PROFILE_ROWS]:
        rate = "" if k.gflops is None else f"{k.gflops:.1f}"
        table.add_row(escape(k.name), str(k.calls), f"{k.seconds * 1e3:.3f}", f"{k.seconds / total:.0%}", rate)
    rest = profile.kernels[PROFILE_ROWS:]
    if rest:
        seconds = sum(k.seconds for k in rest)
        table.add_row(
            f"({len(rest)} more)", str(sum(k.calls for k in rest)), f"{seconds * 1e3:.3f}", f"{seconds / total:.0%}", ""
        )
    stdout.print(table)
    gflop = profile.flops / 1e9
    stdout.print(f"{gflop:.3f} GFLOP per step: {gflop / profile.step_seconds:.1f} GFLOP/s over the whole step")


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model")],
    json_out: Annotated[bool, typer.Option("--json", help="print the layer table as JSON")] = False,
) -> None:
    """Show the model's layers: parameters, bytes, output shape and whether planner can train them."""
    from planner import api

    m = guard(lambda: api.inspect(model))
    rows: list[dict[str, Any]] = [  # as --json prints them
        {
            "layer": layer.name,
            "op": layer.op,
            "params": {n: list(s) for n, s in layer.param_shapes.items()},
            "param_bytes": layer.param_bytes,
            "output_shape": list(layer.output_shape),
            "trainable": layer.trainable,
            "reason": layer.problem,
            "shared_by": list(layer.shared_by),
            "folded_weight": layer.folded_weight,
        }
        for layer in m.layers
    ]
    if json_out:
        described = [i.to_json() for i in m.inputs]
        copies = [list(group) for group in m.copies]
        print(
            json.dumps(
                {
                    "model": str(m.path),
                    "sha256": m.sha256,
                    "inputs": described,
                    "output": m.output.to_json(),
                    "layers": rows,
                    "copies": copies,
                },
                indent=2,
            )
        )
        return
    inputs = ", ".join(
        f"{i.name} [batch, {', '.join(map(str, i.shape))}]{'' if i.dtype == 'float32' else ' ' + i.dtype}" for i in m.inputs
    )
    # escaped: rich reads `[batch, 3, 32, 32]` (or a bracket in a name) as markup and drops it
    out = m.output
    output = f"output {out.name} " + (f"[batch, {', '.join(map(str, out.shape))}]" if out.batched else "a scalar loss")
    table = Table(title=escape(f"{m.path.name}: input{'s' if len(m.inputs) > 1 else ''} {inputs}; {output}"))
    # a layer's name is what schemes and spaces refer to: shown whole, never cut
    table.add_column("layer", no_wrap=True, min_width=max((len(r["layer"]) for r in rows), default=5))
    for col in ("op", "parameters", "bytes", "output", "trainable"):
        table.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
    for layer, r in zip(m.layers, rows):
        op = f"{r['op']} ×{1 + len(layer.shared_by)} (shared)" if layer.shared_by else r["op"]
        cells = (r["layer"], op, _param_roles(layer), f"{r['param_bytes']:,}", str(tuple(r["output_shape"])), _trainable(layer))
        table.add_row(*map(escape, cells))
    stdout.print(table)
    for group in m.copies:  # what planner cannot tie is said, not silently trained apart
        stdout.print(
            f"note: {', '.join(group)} hold equal values (or one the other's transpose) and nothing in the file ties them; "
            "if they are one PyTorch "
            "parameter written once per use, planner trains them apart (export with dynamo=False to keep it one tensor)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _trainable(layer) -> str:
    if not layer.trainable:
        return f"no: {layer.problem}"
    if layer.folded_weight:
        return (
            f"bias only: weight '{layer.folded_weight}' is a constant the exporter computed (a weight_norm or "
            "spectral_norm); export with dynamo=False to train it"
        )
    return "yes"


def _param_roles(layer) -> str:
    """`weight (64, 3, 7, 7)` and `bias (64,)` lines: the layer's name already says whose (the
    ONNX names are in `--json`)."""
    roles = {layer.weight: "weight", layer.bias: "bias"}
    return "\n".join(f"{roles.get(n, 'buffer')} {tuple(s)}" for n, s in layer.param_shapes.items())
