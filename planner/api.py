"""planner's Python API; the CLI is a thin shell over these functions.

    from planner import api
    result = api.plan(trials=12, seed=0)          # the bundled example on the host
    print(result.plan.choice, result.out)
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from planner.backend.compile import CompiledStep, check_cache_dir, compile_candidate, default_cache_dir
from planner.inputs.data import load_dataset
from planner.inputs.defaults import DEFAULT_ACCURACY_STEPS, DEFAULT_DATA, DEFAULT_MODEL, DEFAULT_RUN_STEPS, DEFAULT_TARGET, DEFAULT_TRIALS
from planner.errors import BadInput, CandidateFailed, Interrupted, MeasureFailed, NoFeasiblePlan
from planner.backend.graph import check_importable
from planner.measurement import capacity
from planner.inputs.model import Model, load_model
from planner.plans.directory import locked, prepare_out_dir, study_storage_writes
from planner.plans.plan import MODEL_FILE, STEP_LIBRARY, Plan, Policy, assemble, model_files, read_plan, select, write_plan_dir
from planner.reports import content as report_content
from planner.reports import html as report_html
from planner.reports import markdown
from planner.plans.run import RunResult
from planner.plans.run import run_plan as _run_plan
from planner.search.evaluate import EvalSettings, Evaluator, TrialRecord
from planner.search.study import SearchSettings, make_sampler, open_study, pareto_numbers, run_study, stored_inputs
from planner.inputs.schemes import load_scheme
from planner.inputs.spaces import load_space
from planner.inputs.targets import HardwareTarget, load_target
from planner.search.urls import redact

__all__ = ["plan", "work", "measure", "compile_plan", "check_target", "inspect_model", "run_plan", "report", "resolve_target", "PlanResult", "RunResult"]


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    out: Path
    trials: list[TrialRecord]


def inspect_model(path: str | Path) -> Model:
    """The validated model with its layer table (see `Model.layers`), imported into TVM once, so
    a model TVM cannot read is refused here and not first in `measure` or `plan`."""
    model = load_model(path)
    check_importable(model)
    return model


def resolve_target(name: str, *, tracker: str | None = None, key: str | None = None) -> HardwareTarget:
    """A target by name or path; `tracker` and `key` (both or neither) move it onto RPC boards."""
    target = load_target(name)
    if (tracker is None) != (key is None):
        raise BadInput("--tracker and --key go together")
    if tracker is not None:
        target = target.over_tracker(tracker, key)
    target.toolchain_path()  # a missing cross compiler is bad input, not N failed trials
    return target


def _check_tune_trials(n: int) -> None:
    if n < 0:
        raise BadInput("--tune-trials must be 0 (default schedules only) or more")


SEED_MAX = 2**32 - 1  # numpy's and Optuna's samplers take seeds in [0, 2**32)


def _check_settings(
    *, trials: int | None = None, timeout_s: float | None = None, seed: int | None = None,
    accuracy_tolerance: float | None = None, accuracy_steps: int | None = None,
    latency_repeats: int | None = None, tune_trials: int = 0,
) -> None:
    """Every number a run takes, checked before anything is loaded or written: a NaN tolerance
    found after the last trial, or a negative step count burning every trial, costs the user
    the whole study."""
    if trials is not None and trials < 1:
        raise BadInput("--trials must be at least 1")
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise BadInput(f"--timeout must be a positive number of seconds (not {timeout_s:g})")
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise BadInput(f"--seed must lie in 0..{SEED_MAX} (not {seed})")
    if accuracy_tolerance is not None and not (math.isfinite(accuracy_tolerance) and 0 <= accuracy_tolerance <= 1):
        raise BadInput(f"--accuracy-tolerance must lie in 0..1, an accuracy a plan may give up (not {accuracy_tolerance:g})")
    if accuracy_steps is not None and accuracy_steps < 1:
        raise BadInput(f"--accuracy-steps must be at least 1: accuracy is measured by fine-tuning (not {accuracy_steps})")
    if latency_repeats is not None and latency_repeats < 1:
        raise BadInput(f"latency_repeats must be at least 1 (not {latency_repeats})")
    _check_tune_trials(tune_trials)


def plan(
    *,
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
    tracker: str | None = None,
    key: str | None = None,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
    tune_trials: int = 0,
    sampler: str = "tpe",
    anchors: bool = True,
    on_start: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
) -> PlanResult:
    """Search the space for the best training plan of `model` on `target`; write it to `out`.

    With no model and data, plans the bundled example (examples/digits). Inputs (and the tracker,
    for an RPC target) are checked before anything is written. Rerunning with the same storage
    and study resumes the study. `anchors=False` leaves out the hand-made starting schemes (to
    measure what they bring).
    """
    _check_settings(
        trials=trials, timeout_s=timeout_s, seed=seed, accuracy_tolerance=accuracy_tolerance,
        accuracy_steps=accuracy_steps, latency_repeats=latency_repeats, tune_trials=tune_trials,
    )
    make_sampler(sampler, seed)  # an unknown sampler fails before anything is written
    m = load_model(Path(model) if model else DEFAULT_MODEL)
    dataset = load_dataset(Path(data) if data else DEFAULT_DATA, m)
    hw = resolve_target(target, tracker=tracker, key=key)
    sp = load_space(space).for_target(hw.precisions).for_model(m)
    layer_names = sp.layer_names(m)
    model_files(m)  # a data file the plan directory cannot hold fails now, not after the study
    check_importable(m)
    capacity(hw)  # an unreachable tracker or a key without boards fails here (exit 3)
    cache = check_cache_dir(cache_dir or default_cache_dir())  # a file, read-only: one line, no trial burnt

    out = prepare_out_dir(out)  # a file, a read-only or foreign directory: one line before any trial
    with locked(out):  # a second `plan` on the same --out is refused, not raced
        storage_url = storage or f"sqlite:///{(out / 'study.db').resolve()}"
        study_name = study or "planner"
        config = {
            "model": m.sha256,
            "dataset": dataset.sha256,
            "target": hw.identity(),
            "space": sp.model_dump(),
            "accuracy_steps": accuracy_steps,
            "tune_trials": tune_trials,
        }
        inputs = {
            "model": str(m.path.resolve()), "data": str(dataset.source),
            "target": _where(target), "space": _where(space) if space else None, "tracker": tracker, "key": key,
            "trials": trials, "seed": seed, "sampler": sampler, "anchors": anchors,
            "accuracy_steps": accuracy_steps, "latency_repeats": latency_repeats, "tune_trials": tune_trials,
        }
        # the first trials try the space's hand-made schemes; random search stays the blind baseline
        with study_storage_writes(storage_url, out):  # out of disk for the study: one line, not a traceback
            st = open_study(
                storage_url, study_name, seed, config, sampler, sp.anchors(m) if anchors and sampler == "tpe" else None, inputs
            )
            evaluation = EvalSettings(seed, accuracy_steps, latency_repeats, cache, tune_trials)
            records = run_study(st, m, dataset, hw, sp, SearchSettings(trials, timeout_s, evaluation), on_trial, on_start, stop)
        interrupted = stop is not None and stop.is_set()
        n_finished = sum(r.state in ("COMPLETE", "FAIL") for r in records)
        try:
            chosen = select(records, policy, accuracy_tolerance)
        except NoFeasiblePlan:
            if interrupted:
                raise Interrupted(f"interrupted: no feasible trial among the {n_finished} finished, so no plan; rerun the same command to resume") from None
            raise
        compiled = compile_candidate(m, chosen.candidate, hw.tvm(), evaluation.cache_dir, hw.toolchain, tune_trials, hw.boards)
        result = assemble(
            m, dataset, hw, records, chosen, set(pareto_numbers(st)), compiled,
            selection={
                "policy": policy, "accuracy_tolerance": accuracy_tolerance, "layers_searched": layer_names,
                "layers_excluded": [{"layer": n, "reason": r} for n, r in sp.excluded_layers(m).items()],
            },
            study={"storage": redact(storage_url), "name": study_name},
            accuracy_seed=seed,
            tune_trials=tune_trials,
        )
        result = _write(out, result, compiled, m, records)
        if interrupted:
            raise Interrupted(
                f"interrupted: plan written to {out}/ from the {n_finished} finished trials; rerun the same command to resume",
                PlanResult(result, out, records),
            )
        return PlanResult(result, out, records)


def _where(name_or_path: str) -> str:
    """A target or space as a worker elsewhere finds it: a shipped name, or an absolute path."""
    path = Path(name_or_path)
    return str(path.resolve()) if path.is_file() else name_or_path


def work(
    *,
    storage: str,
    study: str,
    trials: int | None = None,
    cache_dir: Path | None = None,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
) -> list[TrialRecord]:
    """Join a study `plan` created and run trials for it: `trials` of this process's own, or
    (None) until the study holds the trial count it was created with. Returns every trial.

    The model, data, target and space are the ones stored with the study (their hashes are
    checked); this worker's sampler draws with its own random seed, so workers do not propose
    the same candidates, while fine-tuning uses the study's seed, so accuracies stay comparable.
    """
    _check_settings(trials=trials)
    config, inputs = stored_inputs(storage, study)
    m = load_model(inputs["model"])
    dataset = load_dataset(Path(inputs["data"]), m)
    if (m.sha256, dataset.sha256) != (config["model"], config["dataset"]):
        raise BadInput(f"the model or data of study '{study}' changed since it was created ({inputs['model']}, {inputs['data']})")
    hw = resolve_target(inputs["target"], tracker=inputs["tracker"], key=inputs["key"])
    sp = load_space(inputs["space"]).for_target(hw.precisions).for_model(m)
    capacity(hw)
    anchors = sp.anchors(m) if inputs["anchors"] and inputs["sampler"] == "tpe" else None
    evaluation = EvalSettings(
        inputs["seed"], inputs["accuracy_steps"], inputs["latency_repeats"], check_cache_dir(cache_dir or default_cache_dir()),
        inputs["tune_trials"],
    )
    with study_storage_writes(storage):  # a full disk under the journal: one line, not a traceback
        st = open_study(storage, study, None, config, inputs["sampler"], anchors)
        return run_study(st, m, dataset, hw, sp, SearchSettings(inputs["trials"], None, evaluation, trials), on_trial, on_start, stop)


def measure(
    model: str | Path,
    *,
    scheme: str | Path,
    data: str | Path,
    target: str = DEFAULT_TARGET,
    out: str | Path = "plan",
    seed: int = 0,
    accuracy_steps: int = DEFAULT_ACCURACY_STEPS,
    latency_repeats: int = 10,
    cache_dir: Path | None = None,
    tracker: str | None = None,
    key: str | None = None,
    tune_trials: int = 0,
) -> PlanResult:
    """Measure one explicit scheme (no search) and write a plan directory like `plan` does.

    The plan is written even when the scheme breaks the target's budgets — it is what the user
    asked to measure; `selection.feasible` says whether it fits.
    """
    _check_settings(seed=seed, accuracy_steps=accuracy_steps, latency_repeats=latency_repeats, tune_trials=tune_trials)
    m = load_model(model)
    dataset = load_dataset(data, m)
    hw = resolve_target(target, tracker=tracker, key=key)
    candidate = load_scheme(scheme).candidate(m)
    model_files(m)
    if candidate.precision not in hw.precisions:
        raise BadInput(
            f"scheme {Path(scheme).name} trains in {candidate.precision}; target {hw.name} supports only "
            f"{', '.join(hw.precisions)}"
        )
    check_importable(m)
    capacity(hw)
    cache = check_cache_dir(cache_dir or default_cache_dir())
    out = prepare_out_dir(out, create=False)  # checked before measuring; made when the plan is written
    evaluation = EvalSettings(seed, accuracy_steps, latency_repeats, cache, tune_trials)
    attrs: dict = {}
    try:
        constraints = Evaluator(m, dataset, hw, evaluation).evaluate(candidate, attrs.__setitem__)
    except CandidateFailed as exc:
        raise MeasureFailed(f"scheme {Path(scheme).name} failed: {exc}") from None
    rec = TrialRecord.from_attrs(0, "COMPLETE", attrs, constraints)
    compiled = compile_candidate(m, candidate, hw.tvm(), evaluation.cache_dir, hw.toolchain, tune_trials, hw.boards)
    result = assemble(
        m, dataset, hw, [rec], rec, {0}, compiled,
        selection={"policy": "scheme", "scheme": str(Path(scheme).resolve()), "feasible": rec.feasible,
                   "accuracy_tolerance": None, "over_budget": {k: v for k, v in constraints.items() if v > 0}},
        study={"storage": None, "name": None},
        accuracy_seed=seed,
        tune_trials=tune_trials,
    )
    return PlanResult(_write(out, result, compiled, m, [rec]), out, [rec])


def compile_plan(
    plan_dir: str | Path, *, target: str, out: str | Path, cache_dir: Path | None = None, tune_trials: int = 0
) -> Plan:
    """Re-target a plan: compile its chosen candidate for `target` into a new plan directory.

    The new plan keeps the choice and the metrics measured for the original target (their
    `device` says where); its memory is re-planned for the new build.
    """
    plan_dir = Path(plan_dir)
    _check_tune_trials(tune_trials)
    original = read_plan(plan_dir)  # every file checked against its sha256 before the model is read
    m = load_model(plan_dir / MODEL_FILE)
    hw = resolve_target(target)
    cache = check_cache_dir(cache_dir or default_cache_dir())
    prepare_out_dir(out, create=False)
    compiled = compile_candidate(m, original.candidate, hw.tvm(), cache, hw.toolchain, tune_trials, hw.boards)
    data = original.model_dump()
    data["target"] = {"name": hw.name, "tvm_target": hw.tvm_target, "device": hw.device, "toolchain": hw.toolchain}
    data["metrics"]["peak_memory_bytes"] = compiled.memory.to_json()
    data["metrics"]["library_bytes"] = compiled.library.stat().st_size
    data["measurement"]["retargeted_from"] = (
        f"{original.target.name}: latency and accuracy were measured there; re-plan with "
        f"`planner plan --target {hw.name}` to measure on this target"
    )
    data["step"].update(
        signature=compiled.signature.to_json(), kernels=compiled.kernels,
        tuned_kernels=list(compiled.tuned_kernels), tune_trials=tune_trials,
        in_place_updates=compiled.in_place_updates,
    )
    result = Plan.model_validate(data)
    trials = report_content.from_plan_dir(plan_dir).trials  # the study that chose the plan
    return _write(Path(out), result, compiled, m, trials)


def check_target(name: str, *, tracker: str | None = None, key: str | None = None) -> dict:
    """What `planner targets check` reports: the resolved TVM target, toolchain and free boards."""
    from planner.measurement.rpc import BoardPool

    hw = resolve_target(name, tracker=tracker, key=key)
    report = {"target": hw.name, "tvm": str(hw.tvm()), "toolchain": hw.toolchain_path() or "host default", "device": hw.device}
    if hw.runner == "rpc":
        status = BoardPool.for_target(hw).check()
        report["boards"] = f"{status.total} under key '{hw.rpc.key}' at {hw.rpc.tracker}, {status.free} free, {status.pending} pending requests"
    return report


def run_plan(
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
    """Execute a plan here, or — with `target` (or `tracker` and `key`) — on a board over RPC."""
    hw = None
    if target is not None:
        hw = resolve_target(target, tracker=tracker, key=key)
    elif tracker is not None or key is not None:
        hw = read_plan(Path(plan_dir)).as_target()
        if (tracker is None) != (key is None):
            raise BadInput("--tracker and --key go together")
        hw = hw.over_tracker(tracker, key)
    return _run_plan(Path(plan_dir), Path(data) if data else None, steps, Path(out) if out else None, shuffle, seed, hw)


def report(plan_dir: str | Path | None = None, *, storage: str | None = None, study: str | None = None, fmt: str = "html") -> str:
    """A plan directory's report (or, with `storage` and `study`, a study's, plan or not) as
    `fmt`: html (self-contained page), md or json."""
    if (storage is None) != (study is None):
        raise BadInput("--storage and --study go together")
    if fmt not in REPORT_FORMATS:
        raise BadInput(f"unknown report format {fmt!r} (one of {', '.join(REPORT_FORMATS)})")
    if storage is not None:
        content = report_content.from_study(storage, study)
    else:
        content = report_content.from_plan_dir(Path(plan_dir or "plan"))
    return REPORT_FORMATS[fmt](content)


REPORT_FORMATS: dict[str, Callable[[report_content.ReportContent], str]] = {
    "html": report_html.render,
    "md": markdown.render,
    "json": lambda c: json.dumps(c.to_json(), indent=2) + "\n",
}


def _write(out: Path, plan: Plan, compiled: CompiledStep, model: Model, trials: list[TrialRecord]) -> Plan:
    """The plan directory; returns the plan with its files' hashes."""
    content = report_content.from_plan(plan, model, trials)
    return write_plan_dir(
        out,
        plan,
        files={STEP_LIBRARY: compiled.library, **model_files(model)},
        weights=model.initializers,
        texts={
            "report.md": markdown.render(content),
            "report.html": report_html.render(content),
            report_content.TRIALS_FILE: report_content.write_trials(trials),
        },
    )
