"""The Optuna study: propose candidates, measure them for real, keep every result in storage.

Three objectives — maximise val accuracy, minimise step latency and peak memory — and the target's
budgets as Optuna constraints, so the sampler learns to avoid over-budget regions and an infeasible
trial never reaches the Pareto front. A candidate that fails to build or run is a FAIL trial with
its reason stored; the study goes on. Storage is SQLite (or any Optuna URL) with heartbeats, so a
killed run's trials stay and the same command resumes where it stopped.

Everything Optuna-specific stays here: callers get plain `TrialRecord`s.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import optuna

from .data import Dataset
from .errors import BadInput, CandidateFailed
from .evaluate import EvalSettings, Evaluator, TrialRecord
from .measure import capacity
from .model import Model
from .space import SearchSpace
from .target import HardwareTarget

# heartbeats and metric names are "experimental" in Optuna; planner relies on them knowingly
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

OBJECTIVES = ("accuracy", "step_latency_ms", "peak_memory_bytes")
DIRECTIONS = ("maximize", "minimize", "minimize")


@dataclass(frozen=True)
class SearchSettings:
    trials: int  # finished trials the study should hold
    timeout_s: float | None
    evaluation: EvalSettings
    own_trials: int | None = None  # a worker's `--trials N`: run exactly N here, whatever the total


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage from planner's URL: an RDB URL (sqlite/postgresql/mysql), else a journal
    file path (Optuna's `JournalFileBackend`, safe for many processes on one disk)."""
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        # Heartbeats let a later run mark a killed run's RUNNING trials as failed.
        return optuna.storages.RDBStorage(url, heartbeat_interval=10, grace_period=30)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))


SAMPLERS = ("tpe", "random")


class AnchoredSampler(optuna.samplers.BaseSampler):
    """Trial number i < len(anchors) takes the parameters of `anchors[i]`; everything else comes
    from the base sampler (like Optuna's `PartialFixedSampler`, per trial).

    Keyed by trial number rather than queued with `enqueue_trial`, so parallel jobs and workers
    on one storage never race for the same queued trial, and a resumed study does not redo one.
    """

    def __init__(self, base: optuna.samplers.BaseSampler, anchors: list[dict]) -> None:
        self._base, self._anchors = base, anchors

    def _anchor(self, trial: optuna.trial.FrozenTrial) -> dict | None:
        return self._anchors[trial.number] if trial.number < len(self._anchors) else None

    def reseed_rng(self) -> None:
        self._base.reseed_rng()

    def infer_relative_search_space(self, study, trial):
        return {} if self._anchor(trial) is not None else self._base.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._base.sample_relative(study, trial, search_space) if search_space else {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        anchor = self._anchor(trial)
        if anchor is not None and param_name in anchor:
            return anchor[param_name]
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self._base.before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._base.after_trial(study, trial, state, values)


def make_sampler(name: str, seed: int, anchors: list[dict] | None = None) -> optuna.samplers.BaseSampler:
    """`tpe`: multivariate TPE after 8 startup trials, which learns the budgets from the trials'
    constraints (the default); `random`: independent uniform draws, the baseline
    `benchmarks/search_quality.py` compares with. `anchors` (the space's hand-made schemes) fix
    the parameters of the first trials."""
    if name == "tpe":
        base: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)
    elif name == "random":
        base = optuna.samplers.RandomSampler(seed=seed)
    else:
        raise BadInput(f"unknown sampler {name!r} (one of {', '.join(SAMPLERS)})")
    return AnchoredSampler(base, anchors) if anchors else base


def open_study(
    storage_url: str, name: str, seed: int | None, config: dict, sampler: str = "tpe", anchors: list[dict] | None = None,
    inputs: dict | None = None,
) -> optuna.Study:
    """Create the study, or load it when it exists — for the same model, data, target and space.

    `inputs` (where the model, data, target and space are, and the run's settings) is stored at
    creation, so `planner worker` can join the study knowing only its storage and name.
    """
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are reported via on_trial
    sampler = make_sampler(sampler, seed, anchors)
    try:
        study = optuna.create_study(
            storage=open_storage(storage_url), study_name=name, directions=list(DIRECTIONS),
            sampler=sampler, load_if_exists=True,
        )
    except Exception as exc:  # bad URL, unreachable database, unwritable file
        raise BadInput(f"cannot open study storage {storage_url}: {str(exc).splitlines()[0]}") from None
    stored = study.user_attrs.get("config")
    if stored is None:
        study.set_user_attr("config", config)
        if inputs is not None:
            study.set_user_attr("inputs", inputs)
        study.set_metric_names(list(OBJECTIVES))
    elif stored != config:
        changed = sorted(k for k in config if stored.get(k) != config[k])
        raise BadInput(
            f"study '{name}' in {storage_url} was created with a different {', '.join(changed)}; "
            "use another --study name or --out directory"
        )
    return study


def stored_inputs(storage_url: str, name: str) -> tuple[dict, dict]:
    """The (config, inputs) a study was created with, for a worker joining it."""
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(storage_url))
    except KeyError:
        raise BadInput(f"no study '{name}' in {storage_url}") from None
    except Exception as exc:
        raise BadInput(f"cannot open study storage {storage_url}: {str(exc).splitlines()[0]}") from None
    attrs = study.user_attrs
    if "inputs" not in attrs or "config" not in attrs:
        raise BadInput(f"study '{name}' in {storage_url} was not created by `planner plan`")
    return attrs["config"], attrs["inputs"]


WORKER = f"{socket.gethostname()}:{os.getpid()}"


def _objective(evaluator: Evaluator, space: SearchSpace):
    def objective(trial: optuna.Trial) -> tuple[float, float, float]:
        trial.set_user_attr("worker", WORKER)  # which process ran it (plan or `planner worker`)
        candidate = space.sample(trial, evaluator.model)
        for key, value in evaluator.evaluate(candidate, trial.set_user_attr).items():
            trial.set_constraint(key, value)
        attrs = trial.user_attrs
        return attrs["accuracy"]["after"], attrs["latency"]["median"], float(attrs["memory"]["total"])

    return objective


def run_study(
    study: optuna.Study,
    model: Model,
    data: Dataset,
    target: HardwareTarget,
    space: SearchSpace,
    settings: SearchSettings,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
) -> list[TrialRecord]:
    """Run trials until the study holds `settings.trials` finished ones, counting those other
    processes (workers) finish meanwhile — or exactly `settings.own_trials` here — or until the
    timeout."""
    space.layer_names(model)  # refuse an untrainable space before the first compile
    n_jobs = capacity(target)  # one trial in flight per board
    done = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
    remaining = settings.trials - done if settings.own_trials is None else settings.own_trials
    if remaining > 0:
        callbacks = []
        if settings.own_trials is None:
            finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
            callbacks.append(optuna.study.MaxTrialsCallback(settings.trials, states=finished))
        if on_trial is not None:
            callbacks.append(lambda s, t: on_trial(to_record(t), t.number + 1, settings.trials))
        study.optimize(
            _objective(Evaluator(model, data, target, settings.evaluation), space),
            n_trials=remaining,
            timeout=settings.timeout_s,
            catch=(CandidateFailed,),
            n_jobs=n_jobs,
            callbacks=callbacks,
            gc_after_trial=False,
        )
    return records(study)


def to_record(trial: optuna.trial.FrozenTrial) -> TrialRecord:
    attrs = dict(trial.user_attrs)
    attrs.setdefault("fail_reason", trial.system_attrs.get("fail_reason"))
    return TrialRecord.from_attrs(trial.number, trial.state.name, attrs, trial.constraints)


def records(study: optuna.Study) -> list[TrialRecord]:
    return [to_record(t) for t in study.get_trials(deepcopy=False)]


def pareto_numbers(study: optuna.Study) -> list[int]:
    """Trial numbers on the feasible Pareto front (Optuna's own dominance, constraints respected)."""
    return [t.number for t in study.best_trials]
