"""Commands over a plan directory — `run`, `compile`, `report` — and over a target or a model on their own."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from planner.api._inputs import resolve_target
from planner.api._writing import write
from planner.cachefile import default_cache_dir
from planner.errors import BadInput
from planner.inputs import operators as operator_table
from planner.inputs.defaults import DEFAULT_RUN_STEPS
from planner.inputs.model import Model, load_model
from planner.inputs.settings import Settings
from planner.plans.directory import TOKENIZER_FILE, plan_model, plan_tokenizer, prepare_out_dir, read_plan
from planner.plans.schema import Plan
from planner.plans.select import target_record
from planner.reports import content as report_content
from planner.reports import html as report_html
from planner.reports import markdown
from planner.types import RunResult
from planner.units import kib


def inspect(model: str | Path) -> Model:
    """The validated model with its layer table (`Model.layers`: name, op, parameters, output
    shape, whether planner can train it), imported into TVM once, so a model TVM cannot read is
    refused here and not first in `measure` or `plan`.

        for layer in planner.inspect("model.onnx").layers:
            print(layer.name, layer.op, layer.trainable)
    """
    from planner.backend.graph.importer import check_importable

    m = load_model(model)
    check_importable(m)
    return m


def operators(names: Sequence[str] | None = None) -> list[operator_table.Operator]:
    """The operator table's rows (`names`, or all of them): what planner does with each ONNX
    operator — trains, frozen only, refused — and the forms that get less.

        for op in planner.operators(["Conv", "Resize"]):
            print(op.name, op.support.value, op.limits())
    """
    return operator_table.select(names)


def operators_markdown() -> str:
    """The operator table as docs/operators.md holds it."""
    return operator_table.markdown()


def compile(plan_dir: str | Path, *, target: str, out: str | Path, tune_trials: int = 0, cache_dir: Path | None = None) -> Plan:
    """Re-target a plan: compile its chosen candidate for `target` into a new plan directory.

        planner.compile("plan", target="raspberry-pi-4", out="plan-pi4")

    The new plan keeps the choice, and the latency and accuracy measured for the original target
    (their `device` says where; `measurement.retargeted_from` names it, and the report leads
    with it); its memory is re-planned for the new build and held to the new target's budgets:
    a step over its RAM (or flash) budget is refused (BadInput) before anything is written.
    """
    from planner.backend import backend_for
    from planner.backend.cache import check_cache_dir
    from planner.measurement import runner_for
    from planner.plans.select import step_record

    plan_dir = Path(plan_dir)
    Settings(tune_trials=tune_trials)
    original = read_plan(plan_dir)  # every file checked against its sha256 before the model is read
    m = plan_model(plan_dir, original)
    hw = resolve_target(target)
    cache = check_cache_dir(cache_dir or default_cache_dir())
    prepare_out_dir(out, create=False)
    backend = backend_for(hw, cache_dir=cache, tune_trials=tune_trials)
    compiled = backend.build(m, original.candidate)
    over = [
        f"{what} {kib(needs)}, over its {kib(budget)} budget"
        for what, needs, budget in (
            ("RAM", compiled.memory.total, hw.ram_budget_bytes),
            ("flash", compiled.stored_bytes, hw.flash_budget_bytes),
        )
        if budget is not None and needs > budget
    ]
    if over:
        raise BadInput(
            f"the plan's step does not fit {hw.name}: it needs {' and '.join(over)}; "
            f"plan for it instead (planner plan --target {target})"
        )
    provenance = backend.provenance(compiled)
    lat = original.metrics.step_latency_ms
    retargeted = original.model_copy(
        update={
            "target": target_record(hw, runner_for(hw)),
            "metrics": original.metrics.model_copy(
                update={
                    "peak_memory_bytes": type(original.metrics.peak_memory_bytes)(**compiled.memory.to_json()),
                    "library_bytes": compiled.stored_bytes,
                }
            ),
            "measurement": original.measurement.model_copy(
                update={
                    "latency": f"not measured on {hw.name}: measured on {original.target.name} ({lat.device}), "
                    + original.measurement.latency,
                    "memory": provenance.memory,
                    "schedules": provenance.schedules,
                    "ram_budget_bytes": hw.ram_budget_bytes,
                    "latency_budget_ms": hw.latency_budget_ms,
                    "flash_budget_bytes": hw.flash_budget_bytes,
                    "retargeted_from": original.target.name,
                }
            ),
            "step": step_record(compiled, tune_trials),
        }
    )
    result = Plan.model_validate(retargeted.model_dump())  # the edited plan, validated as any read one
    trials = report_content.from_plan_dir(plan_dir).trials  # the study that chose the plan
    tokenizer = plan_tokenizer(plan_dir, original)
    return write(Path(out), result, compiled, m, trials, {TOKENIZER_FILE: tokenizer} if tokenizer is not None else {})


def check_target(name: str, *, tracker: str | None = None, key: str | None = None) -> dict[str, str]:
    """A target resolved for use: its TVM target, toolchain, back end, device and what its runner
    reports (for RPC, the free boards)."""
    from planner.backend import backend_class
    from planner.measurement import runner_for

    hw = resolve_target(name, tracker=tracker, key=key)
    runner = runner_for(hw)
    report = {"target": hw.name, "tvm": backend_class(hw.backend).check(hw), "toolchain": hw.toolchain_path() or "host default"}
    return {**report, "backend": hw.backend, "device": runner.device, **runner.status()}


def run(
    plan_dir: str | Path,
    *,
    data: str | Path | None = None,
    steps: int = DEFAULT_RUN_STEPS,
    out: str | Path | None = None,
    shuffle: bool = True,
    seed: int = 0,
    target: str | None = None,
    tracker: str | None = None,
    key: str | None = None,
) -> RunResult:
    """Execute a plan: fine-tune `steps` steps with its compiled step, here or — with `target`
    (or `tracker` and `key`) — on a board over RPC; write the fine-tuned `weights.npz` and
    `model.onnx` to `out` (default `PLAN_DIR/finetuned`).

        result = planner.run("plan", data="new-data.npz", steps=500)
        print(result.before[result.metric], "->", result.after[result.metric])  # accuracy, or the task's metric

    Every file of the plan is checked against its sha256 before anything is loaded.
    """
    from planner.plans.run import run_plan

    hw = None
    if target is not None:
        hw = resolve_target(target, tracker=tracker, key=key)
    elif tracker is not None or key is not None:
        if tracker is None or key is None:
            raise BadInput("`tracker` and `key` go together")
        hw = read_plan(Path(plan_dir)).as_target().over_tracker(tracker, key)
    return run_plan(Path(plan_dir), Path(data) if data else None, steps, Path(out) if out else None, shuffle, seed, hw)


REPORT_FORMATS = ("html", "md", "json")


def report(plan_dir: str | Path | None = None, *, storage: str | None = None, study: str | None = None, fmt: str = "html") -> str:
    """A plan directory's report — or, with `storage` and `study`, a study's, plan or not — as
    `fmt`: `html` (a self-contained page), `md` or `json`.

        Path("report.md").write_text(planner.report("plan", fmt="md"))
    """
    if (storage is None) != (study is None):
        raise BadInput("`storage` and `study` go together")
    if fmt not in REPORT_FORMATS:
        raise BadInput(f"unknown report format {fmt!r} (one of {', '.join(REPORT_FORMATS)})")
    if storage is not None and study is not None:  # both, or neither (above)
        content = report_content.from_study(storage, study)
    elif plan_dir is None:
        raise BadInput("give a plan directory, or `storage` and `study`")
    else:
        content = report_content.from_plan_dir(Path(plan_dir))
    if fmt == "html":
        return report_html.render(content)
    if fmt == "md":
        return markdown.render(content)
    return json.dumps(content.to_json(), indent=2) + "\n"


def example_images(*, out: str | Path = "digits-images") -> Path:
    """Write the bundled example as image files and return their folder.

        folder = planner.example_images(out="digits-images")
        planner.plan(data=folder, preprocess=folder / "preprocess.yaml", out="plan-images")

    The digits transfer task as grey PNG files of 8 to 32 pixels, one folder per digit under
    `train/` and `val/`, and `preprocess.yaml`, the steps that make each file the model's input.
    A folder that already holds the example is kept as it is.
    """
    from planner.inputs.example import write_image_example

    return write_image_example(Path(out))
