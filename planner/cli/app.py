"""The `planner` command: a thin shell over planner.api.

Results go to stdout (a table, or JSON with --json); progress and errors go to stderr. Every error
a user can cause is one line and an exit code: 2 bad input, 1 no feasible plan, 130 interrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from planner.inputs.defaults import DEFAULT_ACCURACY_STEPS, DEFAULT_RUN_STEPS, DEFAULT_TARGET, DEFAULT_TRIALS

# TVM's FFI imports PyTorch eagerly whenever it is installed (a work-around for Windows in
# tvm_ffi/__init__.py): 2-3 s on every command, for a library planner never calls. The command
# keeps it out; a script that imports planner as a library is not affected.
sys.modules.setdefault("torch", None)  # type: ignore[arg-type]

app = typer.Typer(
    help="Plan on-device training: which layers to update, in what precision, with what batch size — "
    "measured with TVM on the target, searched with Optuna.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
stderr = Console(stderr=True)
stdout = Console()


def _fail(exc: Exception, code: int) -> typer.Exit:
    stderr.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _guard(fn):
    """Run a command body, turning planner's errors into one line + exit code."""
    from planner.errors import Interrupted, PlannerError

    try:
        return fn()
    except Interrupted as exc:
        if exc.result is not None:
            _summary(exc.result)
        stderr.print(str(exc), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except PlannerError as exc:
        raise _fail(exc, exc.exit_code) from None
    except MemoryError:
        # the data or a step needs more memory than this process may have (RAM or `ulimit -v`)
        stderr.print("error: out of memory: the dataset or the training step does not fit in the memory this process may use", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        stderr.print("interrupted: finished trials are kept; rerun the same command to resume")
        raise typer.Exit(130) from None


TrackerOpt = Annotated[str | None, typer.Option(help="HOST:PORT of a TVM RPC tracker: measure on its boards instead of the target's runner")]
KeyOpt = Annotated[str | None, typer.Option(help="board key at the tracker (with --tracker)")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="one line per trial and planner's debug log on stderr")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="no progress on stderr (it is off anyway when stderr is not a terminal)")]
TuneOpt = Annotated[int, typer.Option(help="MetaSchedule trials spent on each compiled step, into one tuning database shared by every candidate and plan (0: planner's default schedules only; about 3-20 s per trial on 2 cores)")]


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


@app.command()
def plan(
    model: Annotated[Path | None, typer.Option(help="ONNX classifier [default: the bundled digits example]")] = None,
    data: Annotated[Path | None, typer.Option(help=".npz with x_train/y_train/x_val/y_val (or x/y) [default: the example's]")] = None,
    target: Annotated[str, typer.Option(help="hardware target: a name in hw_targets/ or a YAML path")] = DEFAULT_TARGET,
    space: Annotated[str | None, typer.Option(help="search space: a name in search_spaces/ or a YAML path [default: per-layer]")] = None,
    out: Annotated[Path, typer.Option(help="plan directory (plan.json, train_step.so, weights.npz, report.md, study.db)")] = Path("plan"),
    trials: Annotated[int, typer.Option(help="finished trials the study should hold; a rerun only adds the missing ones")] = DEFAULT_TRIALS,
    timeout: Annotated[float | None, typer.Option(help="stop starting new trials after this many seconds")] = None,
    seed: Annotated[int, typer.Option(help="sampler and fine-tuning seed")] = 0,
    storage: Annotated[str | None, typer.Option(help="Optuna storage URL [default: sqlite:///OUT/study.db]")] = None,
    study: Annotated[str | None, typer.Option(help="study name in the storage [default: planner]")] = None,
    select: Annotated[Literal["memory", "latency", "accuracy"], typer.Option(help="pick the least memory / least latency among trials within --accuracy-tolerance of the best, or the most accurate")] = "memory",
    accuracy_tolerance: Annotated[float, typer.Option(help="accuracy a plan may give up against the best feasible trial")] = 0.01,
    accuracy_steps: Annotated[int, typer.Option(help="fine-tuning steps per candidate for its accuracy")] = DEFAULT_ACCURACY_STEPS,
    tune_trials: TuneOpt = 0,
    sampler: Annotated[Literal["tpe", "random"], typer.Option(help="tpe: the space's hand-made schemes (last layer, all biases, all layers) first, then multivariate TPE; random: random search, a baseline")] = "tpe",
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
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
        result = _guard(
            lambda: api.plan(
                model=model, data=data, target=target, space=space, out=out, trials=trials, timeout_s=timeout, seed=seed,
                storage=storage, study=study, policy=select, accuracy_tolerance=accuracy_tolerance,
                accuracy_steps=accuracy_steps, tracker=tracker, key=key, on_trial=progress.trial,
                on_start=progress.start, stop=stop, tune_trials=tune_trials, sampler=sampler,
            )
        )
    if json_out:
        print(json.dumps(result.plan.model_dump(), indent=2))
        return
    _summary(result)


@app.command()
def worker(
    storage: Annotated[str, typer.Option(help="the study's Optuna storage: a journal file path (safe for many processes) or an RDB URL")],
    study: Annotated[str, typer.Option(help="study name in the storage")],
    trials: Annotated[int | None, typer.Option(help="trials to run here [default: until the study holds the count it was created with]")] = None,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the study's finished trials, and this process's, as JSON")] = False,
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
        records = _guard(lambda: api.work(storage=storage, study=study, trials=trials, on_trial=progress.trial, on_start=progress.start, stop=stop))
    finished = sum(r.state in ("COMPLETE", "FAIL") for r in records)
    if stop.is_set():
        stderr.print(f"interrupted: study '{study}' holds {finished} finished trials; start the worker again to go on", markup=False, highlight=False)
        raise typer.Exit(130)
    if json_out:
        from planner.search.study import WORKER

        mine = sum(r.worker == WORKER and r.state in ("COMPLETE", "FAIL") for r in records)
        from planner.search.urls import redact

        print(json.dumps({"study": study, "storage": redact(storage), "finished": finished, "ran_here": mine, "worker": WORKER}))
        return
    stdout.print(f"study '{study}' holds {finished} finished trials", markup=False, highlight=False)


def _summary(result) -> None:
    p = result.plan
    m = p.metrics
    stdout.print(
        f"plan written to {result.out}/: trial {p.selection['trial']}, trains "
        f"{', '.join(t['layer'] + ':' + t['mode'] for t in p.choice.trainable)}; batch {p.choice.batch_size}; "
        f"val acc {m['accuracy']['before']:.3f} → {m['accuracy']['after']:.3f}; "
        f"step {m['step_latency_ms']['median']:.2f} ms; peak {_kib(m['peak_memory_bytes']['total'])}",
        markup=False, highlight=False, soft_wrap=True,
    )
    if p.selection.get("feasible") is False:
        stderr.print(f"warning: the scheme is infeasible here (over budget or diverged): {', '.join(p.selection['over_budget'])}", markup=False, highlight=False)


@app.command()
def measure(
    model: Annotated[Path, typer.Argument(help="ONNX classifier")],
    scheme: Annotated[Path, typer.Option(help="scheme YAML: trainable layers/params, batch_size, optimizer {name, lr}, precision")],
    data: Annotated[Path, typer.Option(help=".npz dataset (x_train/y_train/x_val/y_val, or x/y)")],
    target: Annotated[str, typer.Option(help="hardware target: a name in hw_targets/ or a YAML path")] = DEFAULT_TARGET,
    out: Annotated[Path, typer.Option(help="plan directory to write")] = Path("plan"),
    seed: Annotated[int, typer.Option(help="fine-tuning seed")] = 0,
    accuracy_steps: Annotated[int, typer.Option(help="fine-tuning steps for the accuracy")] = DEFAULT_ACCURACY_STEPS,
    tune_trials: TuneOpt = 0,
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="print plan.json to stdout")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Measure one explicit scheme (e.g. a paper's) with no search; writes a plan directory.

    The directory has the format `planner plan` writes, so `planner run DIR` executes it and its
    numbers compare directly with a searched plan's.
    """
    from planner import api
    from planner.cli._progress import configure_logging

    configure_logging(stderr, verbose)
    result = _guard(lambda: api.measure(
        model, scheme=scheme, data=data, target=target, out=out, seed=seed, accuracy_steps=accuracy_steps,
        tracker=tracker, key=key, tune_trials=tune_trials,
    ))
    if json_out:
        print(json.dumps(result.plan.model_dump(), indent=2))
        return
    _summary(result)


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model")],
    json_out: Annotated[bool, typer.Option("--json", help="print the layer table as JSON")] = False,
) -> None:
    """Show the model's layers: parameters, bytes, output shape and whether planner can train them."""
    from planner import api

    m = _guard(lambda: api.inspect_model(model))
    rows = [
        {
            "layer": layer.name,
            "op": layer.op,
            "params": {n: list(s) for n, s in layer.param_shapes.items()},
            "param_bytes": layer.param_bytes,
            "output_shape": list(layer.output_shape),
            "trainable": layer.trainable,
            "reason": layer.problem,
            "shared_by": list(layer.shared_by),
        }
        for layer in m.layers
    ]
    if json_out:
        print(json.dumps({"model": str(m.path), "sha256": m.sha256, "input": m.input_name, "layers": rows}, indent=2))
        return
    # escaped: rich reads `[batch, 3, 32, 32]` (or a bracket in a name) as markup and drops it
    table = Table(title=escape(f"{m.path.name}: input {m.input_name} [batch, {', '.join(map(str, m.input_shape))}], {m.n_classes} classes"))
    # a layer's name is what schemes and spaces refer to: shown whole, never cut
    table.add_column("layer", no_wrap=True, min_width=max((len(r["layer"]) for r in rows), default=5))
    for col in ("op", "parameters", "bytes", "output", "trainable"):
        table.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
    for layer, r in zip(m.layers, rows):
        op = f"{r['op']} ×{1 + len(layer.shared_by)} (shared)" if layer.shared_by else r["op"]
        cells = (r["layer"], op, _param_roles(layer), f"{r['param_bytes']:,}", str(tuple(r["output_shape"])),
                 "yes" if r["trainable"] else f"no: {r['reason']}")
        table.add_row(*map(escape, cells))
    stdout.print(table)


def _param_roles(layer) -> str:
    """`weight (64, 3, 7, 7)` and `bias (64,)` lines: the layer's name already says whose (the
    ONNX names are in `--json`)."""
    roles = {layer.weight: "weight", layer.bias: "bias"}
    return "\n".join(f"{roles.get(n, 'buffer')} {tuple(s)}" for n, s in layer.param_shapes.items())


@app.command()
def run(
    plan_dir: Annotated[Path, typer.Argument(help="a plan directory written by `planner plan`")] = Path("plan"),
    data: Annotated[Path | None, typer.Option(help="dataset [default: the plan's]")] = None,
    steps: Annotated[int, typer.Option(help="training steps")] = DEFAULT_RUN_STEPS,
    out_dir: Annotated[Path | None, typer.Option("--out", help="where weights.npz and model.onnx go [default: PLAN_DIR/finetuned]")] = None,
    no_shuffle: Annotated[bool, typer.Option("--no-shuffle", help="step k uses train samples [k*B, (k+1)*B) in file order")] = False,
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
    r = _guard(lambda: api.run_plan(plan_dir, data=data, steps=steps, out=out_dir, shuffle=not no_shuffle, seed=seed, target=target, tracker=tracker, key=key))
    if json_out:
        print(json.dumps(r.to_json(), indent=2))
        return
    stdout.print(
        f"{r.steps} steps: val loss {r.before['loss']:.4f} → {r.after['loss']:.4f}, "
        f"accuracy {r.before['accuracy']:.3f} → {r.after['accuracy']:.3f} ({r.device}); wrote {r.out}/",
        markup=False, highlight=False, soft_wrap=True,
    )


@app.command()
def report(
    plan_dir: Annotated[Path, typer.Argument(help="a plan directory")] = Path("plan"),
    fmt: Annotated[Literal["html", "md", "json"], typer.Option("--format", help="html: one self-contained page with the figures (plotly inlined, opens offline); md: tables; json: the data behind both")] = "html",
    out_file: Annotated[Path | None, typer.Option("--out", help="write the report here [default: stdout]")] = None,
    storage: Annotated[str | None, typer.Option(help="report a study in this Optuna storage instead (with --study); works while workers still run")] = None,
    study: Annotated[str | None, typer.Option(help="study name in --storage")] = None,
) -> None:
    """Report a plan: Pareto front, memory breakdown, per-layer map, trial history, provenance.

    `planner plan` already writes report.html and report.md into the plan directory; this
    re-renders them, in another format, or for a study in storage that has no plan yet.
    """
    from planner import api

    text = _guard(lambda: api.report(plan_dir, storage=storage, study=study, fmt=fmt))
    if out_file is None:
        sys.stdout.write(text)
        return
    _guard(lambda: _write_text(out_file, text))
    stderr.print(f"wrote {out_file}", markup=False, highlight=False)


def _write_text(path: Path, text: str) -> None:
    from planner.errors import BadInput

    try:
        path.write_text(text)
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror}") from None


@app.command("compile")
def compile_(
    plan_dir: Annotated[Path, typer.Argument(help="a plan directory")],
    target: Annotated[str, typer.Option(help="target to compile for: a name in hw_targets/ or a YAML path")],
    out_dir: Annotated[Path, typer.Option("--out", help="the re-targeted plan directory")],
    tune_trials: TuneOpt = 0,
    json_out: Annotated[bool, typer.Option("--json", help="print the new plan.json")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Re-target a plan: compile its chosen training step for another board (cross-compiling)."""
    from planner import api
    from planner.cli._progress import configure_logging

    configure_logging(stderr, verbose)
    result = _guard(lambda: api.compile_plan(plan_dir, target=target, out=out_dir, tune_trials=tune_trials))
    if json_out:
        print(json.dumps(result.model_dump(), indent=2))
        return
    stdout.print(f"compiled the plan's step for {result.target.name} into {out_dir}/", markup=False, highlight=False, soft_wrap=True)


targets_app = typer.Typer(help="Hardware targets: list, show, check.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(targets_app, name="targets")


@targets_app.command("list")
def targets_list(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """The shipped targets (hw_targets/*.yaml)."""
    from planner.inputs.targets import list_targets

    targets = _guard(list_targets)
    if json_out:
        print(json.dumps([t.model_dump() for t in targets], indent=2))
        return
    table = Table()
    for col in ("name", "device", "RAM budget", "TVM target"):
        table.add_column(col)
    for t in targets:
        tvm_target = " ".join(str(t.tvm_target[k]) for k in ("kind", "mtriple", "mcpu") if k in t.tvm_target)
        table.add_row(t.name, t.device, f"{t.ram_budget_bytes / 2**20:,.0f} MiB", tvm_target)
    stdout.print(table)


@targets_app.command("show")
def targets_show(name: Annotated[str, typer.Argument(help="a target name or YAML path")]) -> None:
    """One target, as planner reads it (JSON)."""
    from planner.inputs.targets import load_target

    print(json.dumps(_guard(lambda: load_target(name)).model_dump(), indent=2))


@targets_app.command("check")
def targets_check(
    name: Annotated[str, typer.Argument(help="a target name or YAML path")],
    tracker: TrackerOpt = None,
    key: KeyOpt = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Resolve the TVM target, find the toolchain, and ask the tracker how many boards are free."""
    from planner import api

    report = _guard(lambda: api.check_target(name, tracker=tracker, key=key))
    if json_out:
        print(json.dumps(report, indent=2))
        return
    for k, v in report.items():
        stdout.print(f"{k:>10}: {v}", markup=False, highlight=False, soft_wrap=True)


board_app = typer.Typer(
    help="Run the board side: a TVM RPC tracker, and RPC servers that register boards with it. "
    "TVM RPC executes any code it is sent: both bind to 127.0.0.1, and a --host other than "
    "loopback needs --allow-remote. Their TVM worker processes die with them, even on kill -9.",
    no_args_is_help=True, rich_markup_mode=None,
)
app.add_typer(board_app, name="board")


@board_app.command("tracker")
def board_tracker(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (the next free one up to --port-end is taken)")] = 9190,
    port_end: Annotated[int | None, typer.Option(help="last port to try [default: port+100]")] = None,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="bind a --host other than loopback: anyone who can reach the port can run code here")] = False,
) -> None:
    """Start a TVM RPC tracker and keep it running until Ctrl-C."""
    from planner.measurement.board import check_bind_host, start_tracker
    from planner.errors import BadInput

    try:
        warning = check_bind_host(host, allow_remote)
    except BadInput as exc:
        raise _fail(exc, 2) from None
    if warning:
        stderr.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)
    tracker = start_tracker(host, port, port_end)
    stderr.print(f"tracker listening on {host}:{tracker.port} (Ctrl-C stops it)", markup=False, highlight=False)
    _wait(tracker.terminate)


@board_app.command("serve")
def board_serve(
    tracker: Annotated[str, typer.Option(help="HOST:PORT of the tracker to register with")],
    key: Annotated[str, typer.Option(help="board key, e.g. raspberry-pi-4 (boards of one kind share it)")],
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (the next free one up to --port-end is taken)")] = 9090,
    port_end: Annotated[int | None, typer.Option(help="last port to try [default: port+100]")] = None,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="bind a --host other than loopback: anyone who can reach the port can run code here")] = False,
) -> None:
    """Serve this machine as a board: TVM's RPC server, registered under KEY, until Ctrl-C."""
    from planner.inputs.targets import parse_host_port
    from planner.measurement.board import check_bind_host, serve
    from planner.errors import BadInput

    try:
        addr = parse_host_port(tracker)
        warning = check_bind_host(host, allow_remote)
    except (ValueError, BadInput) as exc:
        raise _fail(exc, 2) from None
    if warning:
        stderr.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)
    server = serve(addr, key, host, port, port_end)
    stderr.print(f"board '{key}' serving on {host}:{server.port}, registered with {tracker} (Ctrl-C stops it)", markup=False, highlight=False)
    _wait(server.terminate)


def _wait(stop) -> None:
    """Block until Ctrl-C or SIGTERM, then stop the service."""
    import signal
    import threading

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # raised outside a command body (e.g. during imports)
        sys.exit(130)
