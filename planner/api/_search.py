"""`plan` and `work`: a search over a space, from one process or many sharing its storage."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from planner.api._inputs import (
    INPUT_FIELDS,
    SETTING_FIELDS,
    Inputs,
    Loaded,
    for_precisions,
    load_inputs,
    recorded_preprocess,
    split_options,
    where,
)
from planner.api._writing import write
from planner.errors import BadInput, NoFeasiblePlan, OutputUnwritable
from planner.inputs.settings import Policy, Settings, StudyRecord
from planner.inputs.spaces import SearchSpace, load_space
from planner.inputs.targets import HardwareTarget, budget_label, parse_bytes
from planner.plans.directory import data_files, locked, prepare_out_dir, release_if_empty
from planner.plans.schema import Plan
from planner.plans.select import Context, assemble, learned, select
from planner.search.urls import redact
from planner.types import StepProfile, TrialRecord

log = logging.getLogger(__name__)
Progress = Callable[[TrialRecord, int, int], None]
_PLAN_OPTIONS = INPUT_FIELDS - {"classes"} | SETTING_FIELDS


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


def plan(
    *,
    out: str | Path,
    settings: Settings | None = None,
    storage: str | None = None,
    study: str = "planner",
    on_trial: Progress | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_data: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
    **options: Any,
) -> PlanResult:
    """Search `space` for the best way to fine-tune `model` on `target`; write the plan to `out`.

        result = planner.plan(model="model.onnx", data="data.npz", target="raspberry-pi-4",
                              out="plan", trials=40, storage="sqlite:///study.db")
        if result.plan:
            print(result.plan.choice.trainable)

    Each trial compiles a candidate's training step for the target, times it there (here, or on
    boards behind `tracker` under `key`), plans its memory and fine-tunes it for `screen_steps`
    (default: a quarter of `accuracy_steps`; 0: no screening), then on to `accuracy_steps` only if
    no finished trial beats it by then (`planner.search.fidelity`; a screened-out trial is never
    the plan). `overlap` (a local target with 2+ cores) compiles the next candidate while this
    one fine-tunes; latency is still timed alone, and a seeded study proposes the same candidates.
    The plan is the feasible trial chosen by `policy` (`memory`: least peak memory among those
    within `accuracy_tolerance` of the best accuracy; `latency`; `accuracy`).

    `options` are the inputs (`planner.api.Inputs`: where they are) and the settings
    (`planner.Settings`: how the search runs; those given override `settings`):

    - `model`, `data`: an ONNX classifier and a dataset (a `.npz`, an image folder, a CSV of
      `path,label`, or text: a CSV of `text,label` or JSON Lines, see `planner.load_dataset`);
      both None plans the bundled example.
    - `preprocess`: for images, the preprocessing spec — torchvision-style text such as
      "Resize(72), CenterCrop(64), Normalize(mean=[0.5], std=[0.5])" or a YAML path; what it
      leaves open is completed from the model, and the plan records the whole of it.
    - `tokenizer`: for text, the tokenizer.json (Hugging Face tokenizers) that makes it token
      ids, truncated and padded to the model's length; the plan keeps a copy and records how.
    - `target`, `space`: a shipped name (`planner.list_targets()`, `search_spaces/`) or a YAML path.
    - `sampler`: `tpe` (default, starting from the space's hand-made schemes unless `anchors`
      is False), `random`, or an Optuna sampler object.
    - `budgets`: RAM budgets (bytes, or sizes like "256KiB"; default: the target's
      `ram_budgets`), a plan for each from the same trials: `out/<budget>/` (e.g. `out/256KiB/`),
      each a whole plan directory, so a device takes the one that fits the memory it has. The
      study keeps the trials within the largest; `out` itself holds its plan, and its report
      draws accuracy against memory with every budget marked.

    `storage`: an Optuna storage URL (or journal file path) that keeps the study, so the same
    call resumes it and `work` joins it; None keeps the study in memory. `study` names it.
    `on_trial(record, finished, total)`, `on_start(finished, total)`, `on_data(samples, total)`:
    progress callbacks (`on_data` while the data is read once and checked, before any trial).
    `stop`: set it (e.g. from a signal handler) to finish the trials in flight and start no
    more; the result then says `interrupted`.

    Inputs (and the boards, for an RPC target) are checked before anything is written.
    """
    from planner.search.study import SearchSettings, make_sampler, open_study, run_study, storage_writes, takes_anchors

    inputs, settings = split_options("plan", options, settings, _PLAN_OPTIONS)
    make_sampler(settings.sampler, settings.seed)  # an unknown sampler fails before anything is written
    loaded = load_inputs(inputs, settings, on_data=on_data)
    m, dataset, hw = loaded.model, loaded.dataset, loaded.target
    family = _budget_family(settings.budgets, hw)
    if family:  # the study keeps what fits the largest; each budget picks among those
        hw = hw.model_copy(update={"ram_budget_bytes": family[-1]})
        loaded = replace(loaded, target=hw)
    sp = (
        load_space(str(inputs.space) if inputs.space else None)
        .for_target(hw.precisions)
        .for_model(m)
        .for_data(len(dataset.train), dataset.source.name)
    )
    sp.layer_names(m)  # a space listing a layer that cannot train fails now, not in the first trial
    loaded = for_precisions(loaded, sp.precision)
    m = loaded.model
    loaded.runner.capacity()  # an unreachable tracker or a key without boards fails here (exit 3)

    out = prepare_out_dir(out)  # a file, a read-only or foreign directory: one line before any trial
    with locked(out):  # a second `plan` into the same `out` is refused, not raced
        anchors = sp.anchors(m, lean=hw.mcu is not None) if settings.anchors and takes_anchors(settings.sampler) else None
        # the first trials try the space's hand-made schemes; random search stays the blind baseline
        with _released_if_empty(out), storage_writes(storage):  # out of disk for the study: one line, not a traceback
            st = open_study(
                storage,
                study,
                settings.seed,
                _config(loaded, sp, settings),
                settings.sampler,
                anchors,
                _record(inputs, loaded, settings),
                m.task.metric,
            )
            _say_how_a_resume_seeds(st, study, settings)
            records = run_study(
                st,
                m,
                dataset,
                hw,
                sp,
                SearchSettings(
                    trials=settings.trials,
                    timeout_s=settings.timeout_s,
                    evaluation=_evaluation(loaded, settings),
                    overlap=settings.overlap,
                ),
                on_trial,
                on_start,
                stop,
            )
        interrupted = stop is not None and stop.is_set()
        try:
            chosen = select(records, settings.policy, settings.accuracy_tolerance)
        except NoFeasiblePlan:
            if interrupted:
                return PlanResult(None, out, records, interrupted=True)
            raise
        written = _write_plans(out, loaded, sp, settings, records, chosen, family, storage, study, st)
        return PlanResult(written, out, records, interrupted)


@contextlib.contextmanager
def _released_if_empty(out: Path) -> Iterator[None]:
    """`out` removed again when the study's storage could not be written and nothing is in it."""
    try:
        yield
    except OutputUnwritable:
        release_if_empty(out)
        raise


def _say_how_a_resume_seeds(st, study: str, settings: Settings) -> None:
    """A resumed study run with another seed than it began with: its finished trials keep theirs,
    and a study that already holds its trials runs none, so the seed would change nothing."""
    finished = sum(t.state.is_finished() for t in st.get_trials(deepcopy=False))
    began = (st.user_attrs.get("inputs") or {}).get("seed")
    if not finished or began is None or began == settings.seed:
        return
    if finished >= settings.trials:
        log.warning(
            "study '%s' already holds %d finished trials (begun with seed %d): seed %d changes nothing; "
            "raise `trials` to run more with it",
            study,
            finished,
            began,
            settings.seed,
        )
    else:
        log.warning(
            "resuming study '%s' (begun with seed %d): its %d finished trials keep their seeds, the new ones use %d",
            study,
            began,
            finished,
            settings.seed,
        )


def _evaluation(loaded: Loaded, settings: Settings):
    from planner.search.evaluate import EvalSettings

    return EvalSettings(
        seed=settings.seed,
        accuracy_steps=settings.accuracy_steps,
        latency_repeats=settings.latency_repeats,
        cache_dir=loaded.cache_dir,
        tune_trials=settings.tune_trials,
        screen_steps=settings.screen,
    )


def _config(loaded: Loaded, space: SearchSpace, settings: Settings) -> dict:
    """What decides a study's results: a study created with other values is refused, not mixed."""
    return {
        "model": loaded.model.key,
        "dataset": loaded.dataset.sha256,
        "target": loaded.target.identity(),
        "space": space.model_dump(mode="json"),
        "accuracy_steps": settings.accuracy_steps,
        "screen_steps": settings.screen,
        "tune_trials": settings.tune_trials,
    }


def _record(inputs: Inputs, loaded: Loaded, settings: Settings) -> dict:
    """What the study stores of this run, for `work` to join it and a report to describe it."""
    dataset = loaded.dataset
    return StudyRecord.of(
        settings,
        model=str(loaded.model.path.resolve()),
        data=str(dataset.source),
        preprocess=dataset.preprocess.to_json() if dataset.preprocess is not None else None,
        tokenizer=str(dataset.tokenizer.path.resolve()) if dataset.tokenizer is not None else None,
        classes=list(dataset.classes) if dataset.classes is not None else None,
        target=where(inputs.target),
        space=where(inputs.space) if inputs.space else None,
        tracker=inputs.tracker,
        key=inputs.key,
    ).model_dump(mode="json")


def _write_plans(
    out: Path,
    loaded: Loaded,
    sp: SearchSpace,
    settings: Settings,
    records: list[TrialRecord],
    chosen: TrialRecord,
    family: list[int],
    storage: str | None,
    study: str,
    st,
) -> Plan:
    """The plan in `out`, after one in `out/<budget>/` for each smaller budget of `family`."""
    from planner.backend import backend_for
    from planner.search.records import pareto_numbers

    m, hw = loaded.model, loaded.target
    backend = backend_for(hw, cache_dir=loaded.cache_dir, tune_trials=settings.tune_trials)
    selection = {
        "policy": settings.policy,
        "accuracy_tolerance": settings.accuracy_tolerance,
        "layers_searched": sp.layer_names(m),
        "layers_excluded": [{"layer": n, "reason": r} for n, r in sp.excluded_layers(m).items()],
    }
    pareto = set(pareto_numbers(st))
    study_info = {"storage": redact(storage) if storage else None, "name": study}

    def one(where: Path, within: HardwareTarget, judged: list[TrialRecord], picked: TrialRecord, extra: dict) -> Plan:
        compiled = backend.build(m, picked.measured().candidate)
        did, noise = learned(picked, loaded.dataset.judged)
        judged_learning = {"learned": did, "accuracy_noise": noise}
        context = Context({**selection, **extra, **judged_learning}, study_info, settings.seed, backend, loaded.runner)
        written = assemble(m, loaded.dataset, within, judged, picked, pareto, compiled, context)
        return write(where, written, compiled, m, judged, data_files(loaded.dataset))

    # each budget's directory first: plan.json in `out`, written last, names them all
    family_plans = []
    for budget in family[:-1]:
        within = hw.model_copy(update={"ram_budget_bytes": budget})
        judged = [_within(t, budget) for t in records]
        picked = _select_or_none(judged, settings.policy, settings.accuracy_tolerance)
        label = budget_label(budget)
        if picked is not None:
            one(out / label, within, judged, picked, {})
        family_plans.append({"budget_bytes": budget, "directory": label, "trial": None if picked is None else picked.number})
    if family:
        label = budget_label(family[-1])
        one(out / label, hw, records, chosen, {})
        family_plans.append({"budget_bytes": family[-1], "directory": label, "trial": chosen.number})
    return one(out, hw, records, chosen, {"budgets": family_plans})


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


def work(
    *,
    storage: str,
    study: str = "planner",
    trials: int | None = None,
    cache_dir: Path | None = None,
    overlap: bool = True,
    on_trial: Progress | None = None,
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
    from planner.search.records import stored_inputs
    from planner.search.study import SAMPLERS, SearchSettings, open_study, run_study, storage_writes, takes_anchors

    if trials is not None and trials < 1:
        raise BadInput("`trials` must be at least 1")
    config, raw = stored_inputs(storage, study)
    rec = StudyRecord.model_validate(raw)
    if rec.sampler not in SAMPLERS:
        raise BadInput(
            f"study '{study}' samples with a {rec.sampler} object: join it from a script, with `plan` and the same sampler"
        )
    inputs = Inputs(
        model=rec.model,
        data=rec.data,
        preprocess=recorded_preprocess(rec.preprocess, "the study's preprocessing"),
        tokenizer=rec.tokenizer,  # the dataset's sha256, checked below, covers the tokenizer's
        classes=rec.classes,
        target=rec.target,
        space=rec.space,
        tracker=rec.tracker,
        key=rec.key,
    )
    settings = rec.settings(overlap=overlap, cache_dir=cache_dir)
    loaded = load_inputs(inputs, settings, on_data=on_data)
    m, hw = loaded.model, loaded.target
    if (m.key, loaded.dataset.sha256) != (config["model"], config["dataset"]):
        raise BadInput(f"the model or data of study '{study}' changed since it was created ({rec.model}, {rec.data})")
    sp = load_space(rec.space).for_target(hw.precisions).for_model(m)
    loaded = for_precisions(loaded, sp.precision)
    m = loaded.model
    loaded.runner.capacity()
    anchors = sp.anchors(m, lean=hw.mcu is not None) if settings.anchors and takes_anchors(settings.sampler) else None
    with storage_writes(storage):  # a full disk under the journal: one line, not a traceback
        st = open_study(storage, study, None, config, settings.sampler, anchors, metric=m.task.metric)
        search = SearchSettings(
            trials=settings.trials, timeout_s=None, evaluation=_evaluation(loaded, settings), own_trials=trials, overlap=overlap
        )
        return run_study(st, m, loaded.dataset, hw, sp, search, on_trial, on_start, stop)
