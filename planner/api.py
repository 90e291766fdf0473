"""planner's Python API; the CLI is a thin shell over these functions.

    from planner import api
    result = api.plan(trials=12, seed=0)          # the bundled example on the host
    print(result.plan.choice, result.out)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .compile import compile_candidate, default_cache_dir
from .data import load_dataset
from .defaults import DEFAULT_ACCURACY_STEPS, DEFAULT_DATA, DEFAULT_MODEL, DEFAULT_TARGET, DEFAULT_TRIALS
from .errors import BadInput
from .graph import check_importable
from .model import Model, load_model
from .plan import (
    MODEL_FILE,
    SCHEMA_VERSION,
    STEP_LIBRARY,
    Plan,
    Policy,
    choice_json,
    metrics_json,
    select,
    versions,
    write_plan_dir,
)
from .report import markdown
from .runner import RunResult, run_plan
from .search import SearchSettings, TrialRecord, open_study, pareto_numbers, run_study
from .space import load_space
from .target import load_target

__all__ = ["plan", "inspect_model", "run_plan", "PlanResult", "RunResult", "DEFAULT_MODEL", "DEFAULT_DATA"]


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    out: Path
    trials: list[TrialRecord]


def inspect_model(path: str | Path) -> Model:
    """The validated model with its layer table (see `Model.layers`)."""
    return load_model(path)


def plan(
    model: str | Path | None = None,
    data: str | Path | None = None,
    target: str = DEFAULT_TARGET,
    space: str | None = None,
    out: str | Path = "plan",
    trials: int = DEFAULT_TRIALS,
    timeout_s: float | None = None,
    seed: int = 0,
    storage: str | None = None,
    study: str | None = None,
    policy: Policy = "memory",
    accuracy_tolerance: float = 0.01,
    accuracy_steps: int = DEFAULT_ACCURACY_STEPS,
    latency_repeats: int = 10,
    cache_dir: Path | None = None,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
) -> PlanResult:
    """Search the space for the best training plan of `model` on `target`; write it to `out`.

    With no model and data, plans the bundled example (examples/digits). Inputs are validated
    before anything is written. Rerunning with the same storage and study resumes the study.
    """
    model_path = Path(model) if model else DEFAULT_MODEL
    data_path = Path(data) if data else DEFAULT_DATA
    m = load_model(model_path)
    dataset = load_dataset(data_path, m)
    hw = load_target(target)
    sp = load_space(space)
    layer_names = sp.layer_names(m)
    check_importable(m)
    if trials < 1:
        raise BadInput("--trials must be at least 1")

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    storage_url = storage or f"sqlite:///{(out / 'study.db').resolve()}"
    study_name = study or "planner"
    config = {
        "model": m.sha256,
        "dataset": dataset.sha256,
        "target": hw.model_dump(),
        "space": sp.model_dump(),
        "accuracy_steps": accuracy_steps,
    }
    st = open_study(storage_url, study_name, seed, config)
    settings = SearchSettings(trials, timeout_s, seed, accuracy_steps, latency_repeats, cache_dir or default_cache_dir())
    records = run_study(st, m, dataset, hw, sp, settings, on_trial)

    chosen = select(records, policy, accuracy_tolerance)
    compiled = compile_candidate(m, chosen.candidate, hw.tvm(), settings.cache_dir)
    front = set(pareto_numbers(st))
    result = Plan(
        schema_version=SCHEMA_VERSION,
        model={
            "path": str(m.path),
            "sha256": m.sha256,
            "inputs": [{"name": m.input_name, "shape": ["batch", *m.input_shape], "dtype": "float32"}],
        },
        dataset={**dataset.to_json(), "sha256": dataset.sha256},
        target={"name": hw.name, "tvm_target": hw.tvm_target, "device": hw.device},
        choice=choice_json(m, chosen.candidate),
        metrics=metrics_json(chosen),
        measurement={
            "latency": f"TVM VM time_evaluator on {hw.device} device, whole step (forward+backward+update), "
            f"median and p90 over {chosen.latency.repeats} repeats, each the mean of {chosen.latency.number} back-to-back steps; spread "
            f"{chosen.latency.min:.3f}-{chosen.latency.max:.3f} ms",
            "memory": "liveness over the compiled step after TVM static memory planning, plus resident "
            "weights, optimizer state and the batch",
            "accuracy": f"fine-tuned on the host for {accuracy_steps} steps (seed {seed}) with the "
            "candidate's own compiled step; accuracy does not depend on the board",
            "ram_budget_bytes": hw.ram_budget_bytes,
            "latency_budget_ms": hw.latency_budget_ms,
        },
        pareto=[
            {"trial": t.number, "choice": choice_json(m, t.candidate), "metrics": metrics_json(t)}
            for t in records
            if t.number in front
        ],
        selection={
            "policy": policy,
            "accuracy_tolerance": accuracy_tolerance,
            "trial": chosen.number,
            "n_feasible": sum(t.feasible for t in records),
            "layers_searched": layer_names,
        },
        step={"library": STEP_LIBRARY, "signature": compiled.signature.to_json()},
        versions=versions(),
        study={
            "storage": storage_url,
            "name": study_name,
            "n_trials": sum(t.state in ("COMPLETE", "FAIL", "PRUNED") for t in records),
            "n_failed": sum(t.state == "FAIL" for t in records),
        },
    )
    write_plan_dir(
        out,
        result,
        files={STEP_LIBRARY: compiled.library, MODEL_FILE: m.path},
        weights=m.initializers,
        texts={"report.md": markdown.render(result, m)},
    )
    return PlanResult(result, out, records)
