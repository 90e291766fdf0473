"""`measure`: one explicit scheme measured like a trial, written as a plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from planner.api._inputs import INPUT_FIELDS, for_precisions, load_inputs, split_options
from planner.api._search import PlanResult, _evaluation
from planner.api._writing import write
from planner.errors import BadInput, CandidateFailed, MeasureFailed
from planner.inputs.schemes import load_scheme
from planner.inputs.settings import Settings
from planner.plans.directory import data_files, prepare_out_dir
from planner.plans.select import Context, assemble
from planner.types import TrialRecord, TrialResult, TrialState

_OPTIONS = INPUT_FIELDS - {"model", "data", "space", "classes"} | {
    "seed",
    "accuracy_steps",
    "latency_repeats",
    "tune_trials",
    "cache_dir",
}


def measure(
    model: str | Path,
    *,
    scheme: str | Path,
    data: str | Path,
    out: str | Path,
    settings: Settings | None = None,
    profile: bool = False,
    **options: Any,
) -> PlanResult:
    """Measure one explicit scheme (a YAML file, see `planner.load_scheme`) with no search, and
    write a plan directory as `plan` does.

        result = planner.measure("model.onnx", scheme="last-two.yaml", data="data.npz", out="m")
        print(result.plan.metrics.step_latency_ms.median, result.plan.selection.feasible)

    The plan is written even when the scheme breaks the target's budgets — it is what was asked
    to be measured; `plan.selection.feasible` says whether it fits. `options`: `preprocess`,
    `tokenizer`, `target`, `tracker`, `key` as in `plan`, and the settings a measurement takes
    (`seed`, `accuracy_steps`, `latency_repeats`, `tune_trials`, `cache_dir`). `profile` also times each
    kernel of the step (`PlanResult.profile`: time per step and GFLOP/s, slowest first), on
    this machine: a target measured on boards cannot be profiled here.
    """
    from planner.search.evaluate import Evaluator

    inputs, settings = split_options("measure", options, settings, _OPTIONS)
    loaded = load_inputs(replace(inputs, model=model, data=data), settings)
    m, hw, runner = loaded.model, loaded.target, loaded.runner
    if profile and not runner.runs_here:
        raise BadInput(f"`profile` times kernels on this machine; target {hw.name} is measured on {runner.device}")
    candidate = load_scheme(scheme).candidate(m)
    loaded.dataset.check_batch(candidate.batch_size * candidate.grad_accum, f"scheme {Path(scheme).name}")
    if candidate.precision not in hw.precisions:
        raise BadInput(
            f"scheme {Path(scheme).name} trains in {candidate.precision}; target {hw.name} supports only "
            f"{', '.join(hw.precisions)}"
        )
    loaded = for_precisions(loaded, [candidate.precision])
    m = loaded.model
    runner.capacity()
    out = prepare_out_dir(out, create=False)  # checked before measuring; made when the plan is written
    measured = TrialResult()
    evaluator = Evaluator(m, loaded.dataset, hw, _evaluation(loaded, settings.model_copy(update={"screen_steps": 0})))
    try:
        constraints = evaluator.evaluate(candidate, measured, estimate=False)  # measured, even over budget
    except CandidateFailed as exc:
        raise MeasureFailed(f"scheme {Path(scheme).name} failed: {exc}") from None
    rec = TrialRecord.of(0, TrialState.COMPLETE, measured, constraints)
    compiled = evaluator.backend.build(m, candidate)
    selection = {
        "policy": "scheme",
        "scheme": str(Path(scheme).resolve()),
        "feasible": rec.feasible,
        "accuracy_tolerance": None,
        "over_budget": {k: v for k, v in constraints.items() if v > 0},
    }
    context = Context(selection, {"storage": None, "name": None}, settings.seed, evaluator.backend, runner)
    result = assemble(m, loaded.dataset, hw, [rec], rec, {0}, compiled, context)
    written = write(out, result, compiled, m, [rec], data_files(loaded.dataset))
    step_profile = None
    if profile:
        from planner.measurement.profile import profile_step

        step_profile = profile_step(compiled, m.initializers, seed=settings.seed)
    return PlanResult(written, out, [rec], profile=step_profile)
