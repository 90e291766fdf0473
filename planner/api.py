"""planner's Python API: plan, measure, run, compile and report, as scripts call them.

    import planner

    result = planner.plan(model="model.onnx", data="data.npz", target="raspberry-pi-4", out="plan", trials=40)
    print(result.plan.choice.trainable, result.plan.metrics.peak_memory_bytes.total)

Every parameter after the subject is keyword-only. Errors are `planner.errors` types whose
messages name parameters as they are named here (`trials`, `out`); the CLI maps those to its
flags and exit codes, in `planner/cli/`. Importing this module loads no TVM: each function
imports the compiler when it needs it, so `import planner` stays fast for reports and scripts.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from planner.cachefile import default_cache_dir
from planner.errors import BadInput, CandidateFailed, MeasureFailed, NoFeasiblePlan
from planner.inputs.data import bind_lengths, load_dataset
from planner.inputs.defaults import (
    DEFAULT_ACCURACY_STEPS,
    DEFAULT_DATA,
    DEFAULT_MODEL,
    DEFAULT_RUN_STEPS,
    DEFAULT_TARGET,
    DEFAULT_TRIALS,
)
from planner.inputs.model import Model, load_model
from planner.inputs.schemes import load_scheme
from planner.inputs.spaces import load_space
from planner.inputs.targets import HardwareTarget, budget_label, load_target, parse_bytes
from planner.plans.directory import (
    MODEL_FILE,
    REPORT_HTML,
    REPORT_MD,
    STUDY_FILE,
    TOKENIZER_FILE,
    TRIALS_FILE,
    data_files,
    locked,
    model_files,
    plan_tokenizer,
    prepare_out_dir,
    read_plan,
    study_storage_writes,
    write_plan_dir,
)
from planner.plans.schema import Plan, Policy
from planner.plans.select import assemble, select, target_record
from planner.reports import content as report_content
from planner.reports import html as report_html
from planner.reports import markdown
from planner.search.urls import redact
from planner.types import RunResult, StepProfile, TrialRecord, TrialState

if TYPE_CHECKING:
    from planner.backend import Artifact

__all__ = ["plan", "work", "measure", "compile", "check_target", "inspect", "run", "report", "resolve_target", "PlanResult"]


@dataclass(frozen=True)
class PlanResult:
    """What `plan` and `measure` return.

    `plan` is the plan written to `out` (None only when an interrupted search had no feasible
    trial yet); `trials` every trial of the study; `interrupted` whether `stop` cut the search
    short (the plan then comes from the trials finished so far, and the same call resumes the
    study when it has a `storage`).
    """

    plan: Plan | None
    out: Path
    trials: list[TrialRecord]
    interrupted: bool = False
    profile: StepProfile | None = None  # `measure(profile=True)`: where the step's time goes

    @property
    def finished(self) -> int:
        """Trials the study counts: measured, or failed as a candidate."""
        return sum(t.state.finished for t in self.trials)


def default_storage(out: str | Path) -> str:
    """The study storage the CLI keeps inside a plan directory: `sqlite:///OUT/study.db`."""
    return f"sqlite:///{(Path(out) / STUDY_FILE).resolve()}"


def inspect(model: str | Path) -> Model:
    """The validated model with its layer table (`Model.layers`: name, op, parameters, output
    shape, whether planner can train it), imported into TVM once, so a model TVM cannot read is
    refused here and not first in `measure` or `plan`.

        for layer in planner.inspect("model.onnx").layers:
            print(layer.name, layer.op, layer.trainable)
    """
    from planner.backend.graph import check_importable

    m = load_model(model)
    check_importable(m)
    return m


def resolve_target(name: str, *, tracker: str | None = None, key: str | None = None) -> HardwareTarget:
    """A target by name (`planner.list_targets()`) or YAML path; `tracker` and `key` (both or
    neither) move it onto RPC boards. A missing cross compiler is refused here."""
    target = load_target(name)
    if (tracker is None) != (key is None):
        raise BadInput("`tracker` and `key` go together")
    if tracker is not None and key is not None:
        target = target.over_tracker(tracker, key)
    target.toolchain_path()  # a missing cross compiler is bad input, not N failed trials
    from planner.measurement import runner_for

    runner_for(target)  # an unknown back end or runner, or a pair that cannot work together: refused now
    return target


SEED_MAX = 2**32 - 1  # numpy's and Optuna's samplers take seeds in [0, 2**32)


def _check_settings(
    *,
    trials: int | None = None,
    timeout_s: float | None = None,
    seed: int | None = None,
    accuracy_tolerance: float | None = None,
    accuracy_steps: int | None = None,
    screen_steps: int | None = None,
    latency_repeats: int | None = None,
    tune_trials: int = 0,
    policy: str | None = None,
) -> None:
    """Every number a run takes, checked before anything is loaded or written: a NaN tolerance
    found after the last trial, or a negative step count burning every trial, costs the user
    the whole study."""
    if trials is not None and trials < 1:
        raise BadInput("`trials` must be at least 1")
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise BadInput(f"`timeout_s` must be a positive number of seconds (not {timeout_s:g})")
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise BadInput(f"`seed` must lie in 0..{SEED_MAX} (not {seed})")
    if accuracy_tolerance is not None and not (math.isfinite(accuracy_tolerance) and 0 <= accuracy_tolerance <= 1):
        raise BadInput(f"`accuracy_tolerance` must lie in 0..1, an accuracy a plan may give up (not {accuracy_tolerance:g})")
    if accuracy_steps is not None and accuracy_steps < 1:
        raise BadInput(f"`accuracy_steps` must be at least 1: accuracy is measured by fine-tuning (not {accuracy_steps})")
    if screen_steps is not None and not 0 <= screen_steps < (accuracy_steps or DEFAULT_ACCURACY_STEPS):
        raise BadInput(
            f"`screen_steps` must lie in 0..{(accuracy_steps or DEFAULT_ACCURACY_STEPS) - 1}, fewer than "
            f"`accuracy_steps` (0 fine-tunes every candidate for all of them; not {screen_steps})"
        )
    if latency_repeats is not None and latency_repeats < 1:
        raise BadInput(f"`latency_repeats` must be at least 1 (not {latency_repeats})")
    if tune_trials < 0:
        raise BadInput("`tune_trials` must be 0 (default schedules only) or more")
    if policy is not None and policy not in ("memory", "latency", "accuracy"):
        raise BadInput(f"`policy` must be memory, latency or accuracy (not {policy!r})")


def plan(
    *,
    out: str | Path,
    model: str | Path | None = None,
    data: str | Path | None = None,
    preprocess: str | Path | None = None,
    tokenizer: str | Path | None = None,
    target: str = DEFAULT_TARGET,
    space: str | Path | None = None,
    trials: int = DEFAULT_TRIALS,
    timeout_s: float | None = None,
    seed: int = 0,
    storage: str | None = None,
    study: str = "planner",
    policy: Policy = "memory",
    accuracy_tolerance: float = 0.01,
    accuracy_steps: int = DEFAULT_ACCURACY_STEPS,
    screen_steps: int | None = None,
    overlap: bool = True,
    latency_repeats: int = 10,
    tune_trials: int = 0,
    sampler: str = "tpe",
    anchors: bool = True,
    tracker: str | None = None,
    key: str | None = None,
    budgets: Sequence[int | str] | None = None,
    cache_dir: Path | None = None,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_data: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
) -> PlanResult:
    """Search `space` for the best way to fine-tune `model` on `target`; write the plan to `out`.

        result = planner.plan(model="model.onnx", data="data.npz", target="raspberry-pi-4",
                              out="plan", trials=40, storage="sqlite:///study.db")
        if result.plan:
            print(result.plan.choice.trainable)

    Each trial compiles a candidate's training step with TVM, times it on the target (here, or on
    boards behind `tracker` under `key`), plans its memory and fine-tunes it for `screen_steps`
    (default: a quarter of `accuracy_steps`; 0: no screening), then on to `accuracy_steps` only if
    no finished trial beats it by then (`planner.search.fidelity`; a screened-out trial is never
    the plan). `overlap` (a local target with 2+ cores) compiles the next candidate while this
    one fine-tunes; latency is still timed alone, and a seeded study proposes the same candidates.
    The plan is the feasible trial chosen by `policy` (`memory`: least peak memory among those
    within `accuracy_tolerance` of the best accuracy; `latency`; `accuracy`).

    - `model`, `data`: an ONNX classifier and a dataset (a `.npz`, an image folder, a CSV of
      `path,label`, or text: a CSV of `text,label` or JSON Lines, see `planner.load_dataset`);
      both None plans the bundled example.
    - `preprocess`: for images, the preprocessing spec — torchvision-style text such as
      "Resize(72), CenterCrop(64), Normalize(mean=[0.5], std=[0.5])" or a YAML path; what it
      leaves open is completed from the model, and the plan records the whole of it.
    - `tokenizer`: for text, the tokenizer.json (Hugging Face tokenizers) that makes it token
      ids, truncated and padded to the model's length; the plan keeps a copy and records how.
    - `target`, `space`: a shipped name (`planner.list_targets()`, `search_spaces/`) or a YAML path.
    - `storage`: an Optuna storage URL (or journal file path) that keeps the study, so the same
      call resumes it and `work` joins it; None keeps the study in memory. `study` names it.
    - `on_trial(record, finished, total)`, `on_start(finished, total)`, `on_data(samples, total)`:
      progress callbacks (`on_data` while the data is read once and checked, before any trial).
    - `stop`: set it (e.g. from a signal handler) to finish the trials in flight and start no
      more; the result then says `interrupted`.
    - `sampler`: `tpe` (default, starting from the space's hand-made schemes unless `anchors`
      is False) or `random`.
    - `budgets`: RAM budgets (bytes, or sizes like "256KiB"; default: the target's
      `ram_budgets`), a plan for each from the same trials: `out/<budget>/` (e.g. `out/256KiB/`),
      each a whole plan directory, so a device takes the one that fits the memory it has. The
      study keeps the trials within the largest; `out` itself holds its plan, and its report
      draws accuracy against memory with every budget marked.

    Inputs (and the boards, for an RPC target) are checked before anything is written.
    """
    from planner.backend import backend_for
    from planner.backend.compile import check_cache_dir
    from planner.backend.graph import check_importable
    from planner.measurement import runner_for
    from planner.search.evaluate import EvalSettings
    from planner.search.study import SearchSettings, make_sampler, open_study, pareto_numbers, run_study

    _check_settings(
        trials=trials,
        timeout_s=timeout_s,
        seed=seed,
        accuracy_tolerance=accuracy_tolerance,
        accuracy_steps=accuracy_steps,
        screen_steps=screen_steps,
        latency_repeats=latency_repeats,
        tune_trials=tune_trials,
        policy=policy,
    )
    if screen_steps is None:
        screen_steps = accuracy_steps // 4
    make_sampler(sampler, seed)  # an unknown sampler fails before anything is written
    m = load_model(Path(model) if model else DEFAULT_MODEL)
    cache = check_cache_dir(cache_dir or default_cache_dir())  # a file, read-only: one line, no trial burnt
    dataset = load_dataset(
        Path(data) if data else DEFAULT_DATA, m, preprocess=preprocess, tokenizer=tokenizer, cache_dir=cache, progress=on_data
    )
    m = bind_lengths(m, dataset)
    hw = resolve_target(target, tracker=tracker, key=key)
    family = _budget_family(budgets, hw)
    if family:  # the study keeps what fits the largest; each budget picks among those
        hw = hw.model_copy(update={"ram_budget_bytes": family[-1]})
    sp = load_space(str(space) if space else None).for_target(hw.precisions).for_model(m)
    layer_names = sp.layer_names(m)
    model_files(m)  # a data file the plan directory cannot hold fails now, not after the study
    check_importable(m)
    runner = runner_for(hw)
    runner.capacity()  # an unreachable tracker or a key without boards fails here (exit 3)

    out = prepare_out_dir(out)  # a file, a read-only or foreign directory: one line before any trial
    with locked(out):  # a second `plan` into the same `out` is refused, not raced
        config = {
            "model": m.key,
            "dataset": dataset.sha256,
            "target": hw.identity(),
            "space": sp.model_dump(mode="json"),
            "accuracy_steps": accuracy_steps,
            "screen_steps": screen_steps,
            "tune_trials": tune_trials,
        }
        inputs = {
            "model": str(m.path.resolve()),
            "data": str(dataset.source),
            "preprocess": dataset.preprocess.to_json() if dataset.preprocess is not None else None,
            "tokenizer": str(dataset.tokenizer.path.resolve()) if dataset.tokenizer is not None else None,
            "classes": list(dataset.classes) if dataset.classes is not None else None,
            "target": _where(target),
            "space": _where(str(space)) if space else None,
            "tracker": tracker,
            "key": key,
            "trials": trials,
            "seed": seed,
            "sampler": sampler,
            "anchors": anchors,
            "accuracy_steps": accuracy_steps,
            "screen_steps": screen_steps,
            "latency_repeats": latency_repeats,
            "tune_trials": tune_trials,
        }
        # the first trials try the space's hand-made schemes; random search stays the blind baseline
        with study_storage_writes(storage, out):  # out of disk for the study: one line, not a traceback
            st = open_study(
                storage, study, seed, config, sampler, sp.anchors(m) if anchors and sampler == "tpe" else None, inputs
            )
            evaluation = EvalSettings(seed, accuracy_steps, latency_repeats, cache, tune_trials, screen_steps)
            records = run_study(
                st, m, dataset, hw, sp, SearchSettings(trials, timeout_s, evaluation, overlap=overlap), on_trial, on_start, stop
            )
        interrupted = stop is not None and stop.is_set()
        try:
            chosen = select(records, policy, accuracy_tolerance)
        except NoFeasiblePlan:
            if interrupted:
                return PlanResult(None, out, records, interrupted=True)
            raise
        backend = backend_for(hw, cache_dir=evaluation.cache_dir, tune_trials=tune_trials)
        selection = {
            "policy": policy,
            "accuracy_tolerance": accuracy_tolerance,
            "layers_searched": layer_names,
            "layers_excluded": [{"layer": n, "reason": r} for n, r in sp.excluded_layers(m).items()],
        }
        pareto = set(pareto_numbers(st))
        study_info = {"storage": redact(storage) if storage else None, "name": study}

        def write(where: Path, within: HardwareTarget, judged: list[TrialRecord], picked: TrialRecord, extra: dict) -> Plan:
            compiled = backend.build(m, picked.measured().candidate)
            written = assemble(
                m, dataset, within, judged, picked, pareto, compiled, {**selection, **extra}, study_info, seed, backend, runner
            )
            return _write(where, written, compiled, m, judged, data_files(dataset))

        # each budget's directory first: plan.json in `out`, written last, names them all
        family_plans = []
        for budget in family[:-1]:
            within = hw.model_copy(update={"ram_budget_bytes": budget})
            judged = [_within(t, budget) for t in records]
            picked = _select_or_none(judged, policy, accuracy_tolerance)
            label = budget_label(budget)
            if picked is not None:
                write(out / label, within, judged, picked, {})
            family_plans.append({"budget_bytes": budget, "directory": label, "trial": None if picked is None else picked.number})
        if family:
            label = budget_label(family[-1])
            write(out / label, hw, records, chosen, {})
            family_plans.append({"budget_bytes": family[-1], "directory": label, "trial": chosen.number})
        return PlanResult(write(out, hw, records, chosen, {"budgets": family_plans}), out, records, interrupted)


def _budget_family(budgets: Sequence[int | str] | None, target: HardwareTarget) -> list[int]:
    """The RAM budgets to plan for, ascending: those given, else the target's own list."""
    if budgets is None:
        return list(target.ram_budgets)
    try:
        family = sorted({parse_bytes(b) for b in budgets})
    except ValueError as exc:
        raise BadInput(f"`budgets`: {exc}") from None
    if not family or family[0] <= 0:
        raise BadInput("`budgets` lists RAM budgets of more than 0 bytes, e.g. 256KiB,1MiB,4MiB")
    return family


def _within(trial: TrialRecord, budget: int) -> TrialRecord:
    """`trial` judged against a smaller RAM budget than the study's."""
    over = trial.memory is not None and trial.memory.total > budget
    if not over:
        return trial
    assert trial.memory is not None, "a trial over a budget has its memory measured"
    return replace(trial, feasible=False, over_budget={**trial.over_budget, "ram_budget": float(trial.memory.total - budget)})


def _select_or_none(trials: list[TrialRecord], policy: Policy, tolerance: float) -> TrialRecord | None:
    try:
        return select(trials, policy, tolerance)
    except NoFeasiblePlan:
        return None


def _where(name_or_path: str) -> str:
    """A target or space as a worker elsewhere finds it: a shipped name, or an absolute path."""
    path = Path(name_or_path)
    return str(path.resolve()) if path.is_file() else name_or_path


def _recorded_preprocess(raw, where: str):
    """A completed spec as a study or a plan records it (None: arrays, no preprocessing)."""
    from planner.inputs.preprocess import Preprocess

    return None if raw is None else Preprocess.from_json(raw, where)


def work(
    *,
    storage: str,
    study: str = "planner",
    trials: int | None = None,
    cache_dir: Path | None = None,
    overlap: bool = True,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_data: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
) -> list[TrialRecord]:
    """Join a study `plan` created in `storage` and run trials for it: `trials` of this
    process's own, or (None) until the study holds the trial count it was created with.
    Returns every trial of the study.

        planner.work(storage="postgresql://planner@db/planner", study="resnet-pi4")

    The model, data, target and space are the ones stored with the study (their hashes are
    checked); this worker's sampler draws with its own random seed, so workers do not propose
    the same candidates, while fine-tuning uses the study's seed, so accuracies stay comparable.
    `overlap` as in `plan`.
    """
    from planner.backend.compile import check_cache_dir
    from planner.measurement import runner_for
    from planner.search.evaluate import EvalSettings
    from planner.search.study import SearchSettings, open_study, run_study, stored_inputs

    _check_settings(trials=trials)
    config, inputs = stored_inputs(storage, study)
    m = load_model(inputs["model"])
    cache = check_cache_dir(cache_dir or default_cache_dir())
    dataset = load_dataset(
        Path(inputs["data"]),
        m,
        preprocess=_recorded_preprocess(inputs.get("preprocess"), "the study's preprocessing"),
        tokenizer=inputs.get("tokenizer"),  # the dataset's sha256, checked below, covers the tokenizer's
        classes=inputs.get("classes"),
        cache_dir=cache,
        progress=on_data,
    )
    m = bind_lengths(m, dataset)
    if (m.key, dataset.sha256) != (config["model"], config["dataset"]):
        raise BadInput(f"the model or data of study '{study}' changed since it was created ({inputs['model']}, {inputs['data']})")
    hw = resolve_target(inputs["target"], tracker=inputs["tracker"], key=inputs["key"])
    sp = load_space(inputs["space"]).for_target(hw.precisions).for_model(m)
    runner_for(hw).capacity()
    anchors = sp.anchors(m) if inputs["anchors"] and inputs["sampler"] == "tpe" else None
    evaluation = EvalSettings(
        inputs["seed"],
        inputs["accuracy_steps"],
        inputs["latency_repeats"],
        cache,
        inputs["tune_trials"],
        inputs.get("screen_steps", 0),  # a study from before screening fine-tuned every candidate fully
    )
    with study_storage_writes(storage):  # a full disk under the journal: one line, not a traceback
        st = open_study(storage, study, None, config, inputs["sampler"], anchors)
        return run_study(
            st, m, dataset, hw, sp, SearchSettings(inputs["trials"], None, evaluation, trials, overlap), on_trial, on_start, stop
        )


def measure(
    model: str | Path,
    *,
    scheme: str | Path,
    data: str | Path,
    out: str | Path,
    preprocess: str | Path | None = None,
    tokenizer: str | Path | None = None,
    target: str = DEFAULT_TARGET,
    seed: int = 0,
    accuracy_steps: int = DEFAULT_ACCURACY_STEPS,
    latency_repeats: int = 10,
    tune_trials: int = 0,
    tracker: str | None = None,
    key: str | None = None,
    cache_dir: Path | None = None,
    profile: bool = False,
) -> PlanResult:
    """Measure one explicit scheme (a YAML file, see `planner.load_scheme`) with no search, and
    write a plan directory as `plan` does.

        result = planner.measure("model.onnx", scheme="last-two.yaml", data="data.npz", out="m")
        print(result.plan.metrics.step_latency_ms.median, result.plan.selection.feasible)

    The plan is written even when the scheme breaks the target's budgets — it is what was asked
    to be measured; `plan.selection.feasible` says whether it fits. `preprocess` and `tokenizer`
    as in `plan`. `profile` also times each
    kernel of the step (`PlanResult.profile`: time per step and GFLOP/s, slowest first), on
    this machine: a target measured on boards cannot be profiled here.
    """
    from planner.backend.compile import CompiledStep, check_cache_dir
    from planner.backend.graph import check_importable
    from planner.measurement import runner_for
    from planner.search.evaluate import EvalSettings, Evaluator

    _check_settings(seed=seed, accuracy_steps=accuracy_steps, latency_repeats=latency_repeats, tune_trials=tune_trials)
    m = load_model(model)
    cache = check_cache_dir(cache_dir or default_cache_dir())
    dataset = load_dataset(data, m, preprocess=preprocess, tokenizer=tokenizer, cache_dir=cache)
    m = bind_lengths(m, dataset)
    hw = resolve_target(target, tracker=tracker, key=key)
    runner = runner_for(hw)
    if profile and not runner.runs_here:
        raise BadInput(f"`profile` times kernels on this machine; target {hw.name} is measured on {runner.device}")
    candidate = load_scheme(scheme).candidate(m)
    model_files(m)
    if candidate.precision not in hw.precisions:
        raise BadInput(
            f"scheme {Path(scheme).name} trains in {candidate.precision}; target {hw.name} supports only "
            f"{', '.join(hw.precisions)}"
        )
    check_importable(m)
    runner.capacity()
    out = prepare_out_dir(out, create=False)  # checked before measuring; made when the plan is written
    evaluation = EvalSettings(seed, accuracy_steps, latency_repeats, cache, tune_trials)
    attrs: dict = {}
    evaluator = Evaluator(m, dataset, hw, evaluation)
    try:
        constraints = evaluator.evaluate(candidate, attrs.__setitem__)
    except CandidateFailed as exc:
        raise MeasureFailed(f"scheme {Path(scheme).name} failed: {exc}") from None
    rec = TrialRecord.from_attrs(0, TrialState.COMPLETE, attrs, constraints)
    compiled = evaluator.backend.build(m, candidate)
    result = assemble(
        m,
        dataset,
        hw,
        [rec],
        rec,
        {0},
        compiled,
        selection={
            "policy": "scheme",
            "scheme": str(Path(scheme).resolve()),
            "feasible": rec.feasible,
            "accuracy_tolerance": None,
            "over_budget": {k: v for k, v in constraints.items() if v > 0},
        },
        study={"storage": None, "name": None},
        accuracy_seed=seed,
        backend=evaluator.backend,
        runner=runner,
    )
    written = _write(out, result, compiled, m, [rec], data_files(dataset))
    step_profile = None
    if profile:
        from planner.measurement.profile import profile_step

        if not isinstance(compiled, CompiledStep):
            raise BadInput(f"`profile` times the kernels of a VM library; the {hw.backend} back end builds {compiled.kind}")
        step_profile = profile_step(compiled, m.initializers, seed=seed)
    return PlanResult(written, out, [rec], profile=step_profile)


def compile(plan_dir: str | Path, *, target: str, out: str | Path, tune_trials: int = 0, cache_dir: Path | None = None) -> Plan:
    """Re-target a plan: compile its chosen candidate for `target` into a new plan directory.

        planner.compile("plan", target="raspberry-pi-4", out="plan-pi4")

    The new plan keeps the choice and the metrics measured for the original target (their
    `device` says where; `measurement.retargeted_from` says so); its memory is re-planned for
    the new build.
    """
    from planner.backend import backend_for
    from planner.backend.compile import check_cache_dir
    from planner.measurement import runner_for
    from planner.plans.select import step_record

    plan_dir = Path(plan_dir)
    _check_settings(tune_trials=tune_trials)
    original = read_plan(plan_dir)  # every file checked against its sha256 before the model is read
    m = load_model(plan_dir / MODEL_FILE)
    hw = resolve_target(target)
    cache = check_cache_dir(cache_dir or default_cache_dir())
    prepare_out_dir(out, create=False)
    backend = backend_for(hw, cache_dir=cache, tune_trials=tune_trials)
    compiled = backend.build(m, original.candidate)
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
                    "retargeted_from": f"{original.target.name}: latency and accuracy were measured there; re-plan "
                    f"for {hw.name} to measure on this target"
                }
            ),
            "step": step_record(compiled, tune_trials),
        }
    )
    result = Plan.model_validate(retargeted.model_dump())  # the edited plan, validated as any read one
    trials = report_content.from_plan_dir(plan_dir).trials  # the study that chose the plan
    tokenizer = plan_tokenizer(plan_dir, original)
    return _write(Path(out), result, compiled, m, trials, {TOKENIZER_FILE: tokenizer} if tokenizer is not None else {})


def check_target(name: str, *, tracker: str | None = None, key: str | None = None) -> dict[str, str]:
    """A target resolved for use: its TVM target, toolchain, back end, device and what its runner
    reports (for RPC, the free boards)."""
    from planner.measurement import runner_for

    hw = resolve_target(name, tracker=tracker, key=key)
    runner = runner_for(hw)
    report = {"target": hw.name, "tvm": str(hw.tvm()), "toolchain": hw.toolchain_path() or "host default"}
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
        print(result.before["accuracy"], "->", result.after["accuracy"])

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


def _write(out: Path, plan: Plan, compiled: Artifact, model: Model, trials: list[TrialRecord], data: dict[str, Path]) -> Plan:
    """The plan directory, with the files its data needs (`data`: `data_files`); returns the plan
    with its files' hashes."""
    content = report_content.from_plan(plan, model, trials)
    return write_plan_dir(
        out,
        plan,
        files={**{f.name: f for f in compiled.files}, **model_files(model), **data},
        weights=model.initializers,
        texts={
            REPORT_MD: markdown.render(content),
            REPORT_HTML: report_html.render(content),
            TRIALS_FILE: report_content.write_trials(trials),
        },
    )


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
