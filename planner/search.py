"""The Optuna study: propose candidates, measure them for real, keep every result in storage.

Three objectives — maximise val accuracy, minimise step latency and peak memory — and the target's
budgets as Optuna constraints, so the sampler learns to avoid over-budget regions and an infeasible
trial never reaches the Pareto front. A candidate that fails to build or run is a FAIL trial with
its reason stored; the study goes on. Storage is SQLite (or any Optuna URL) with heartbeats, so a
killed run's trials stay and the same command resumes where it stopped.

Everything Optuna-specific stays here: callers get plain `TrialRecord`s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
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

log = logging.getLogger(__name__)

OBJECTIVES = ("accuracy", "step_latency_ms", "peak_memory_bytes")
DIRECTIONS = ("maximize", "minimize", "minimize")


@dataclass(frozen=True)
class SearchSettings:
    trials: int  # finished trials the study should hold
    timeout_s: float | None
    evaluation: EvalSettings
    own_trials: int | None = None  # a worker's `--trials N`: run exactly N here, whatever the total


HEARTBEAT_ENV, GRACE_ENV = "PLANNER_HEARTBEAT_S", "PLANNER_HEARTBEAT_GRACE_S"
HEARTBEAT_S, GRACE_S = 10, 30  # their defaults
RETRIES = 1  # a trial whose process died is run once more; dying again, it stays FAIL


def _env_seconds(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise BadInput(f"{name} must be a whole number of seconds, at least 1 (not {raw!r})")
    return int(raw)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage from planner's URL: an RDB URL (sqlite/postgresql/mysql), else a journal
    file path (Optuna's `JournalFileBackend`, safe for many processes on one disk).

    An RDB storage keeps heartbeats: a running trial records one every PLANNER_HEARTBEAT_S seconds
    (default 10). When a trial has been silent for PLANNER_HEARTBEAT_GRACE_S seconds (default 30),
    its process was killed or its machine lost. The next process to start a trial on the study
    (a `planner plan` or `planner worker`) then marks it FAIL and queues a copy with the same
    parameters, which Optuna runs before sampling anything new (`RetryHeartbeatStaleTrialCallback`;
    once per trial, so a candidate that kills its process cannot kill every worker in turn).

    A journal file has no heartbeats in Optuna 5: a killed process's trial stays RUNNING there
    and is not retried (the study goes on without it).
    """
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        interval, grace = _env_seconds(HEARTBEAT_ENV, HEARTBEAT_S), _env_seconds(GRACE_ENV, GRACE_S)
        if grace <= interval:
            raise BadInput(f"{GRACE_ENV} ({grace} s) must be longer than {HEARTBEAT_ENV} ({interval} s)")
        return optuna.storages.RDBStorage(
            url, heartbeat_interval=interval, grace_period=grace,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=RETRIES),
        )
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
    attrs = _planner_study(storage_url, name).user_attrs
    return attrs["config"], attrs["inputs"]


def _planner_study(storage_url: str, name: str) -> optuna.Study:
    """An existing study `planner plan` created; anything else is one BadInput line."""
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(storage_url))
    except KeyError:
        raise BadInput(f"no study '{name}' in {storage_url}") from None
    except Exception as exc:
        raise BadInput(f"cannot open study storage {storage_url}: {str(exc).splitlines()[0]}") from None
    if not {"inputs", "config"} <= study.user_attrs.keys():
        raise BadInput(f"study '{name}' in {storage_url} was not created by `planner plan`")
    return study


WORKER = f"{socket.gethostname()}:{os.getpid()}"


def _objective(evaluator: Evaluator, space: SearchSpace, stop: threading.Event | None):
    def objective(trial: optuna.Trial) -> tuple[float, float, float]:
        trial.set_user_attr("worker", WORKER)  # which process ran it (plan or `planner worker`)
        candidate = space.sample(trial, evaluator.model)
        try:
            constraints = evaluator.evaluate(candidate, trial.set_user_attr)
        except CandidateFailed:
            if stop is None or not stop.is_set():
                raise
            # A terminal's Ctrl-C also reaches the compiler and linker this trial runs: its failure
            # says nothing about the candidate. PRUNED (planner prunes nothing else) does not count
            # as finished, and the same parameters are queued, so resuming measures them.
            trial.study.enqueue_trial(trial.params, user_attrs={"requeued_from": trial.number})
            raise optuna.TrialPruned("interrupted (Ctrl-C) mid-trial; queued again") from None
        for key, value in constraints.items():
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
    on_start: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
) -> list[TrialRecord]:
    """Run trials until the study holds `settings.trials` finished ones, counting those other
    processes (workers) finish meanwhile — or exactly `settings.own_trials` here — or until the
    timeout, or until `stop` is set (trials in flight then finish; none start).

    `on_start(done, total)` and `on_trial(record, done, total)` report progress, `done` being the
    study's finished trials (every process's)."""
    space.layer_names(model)  # refuse an untrainable space before the first compile
    n_jobs = capacity(target)  # one trial in flight per board
    optuna.storages.fail_stale_trials(study)  # a dead process's trial: failed and queued again now
    done = _finished(study)
    remaining = settings.trials - done if settings.own_trials is None else settings.own_trials
    if on_start is not None:
        on_start(done, settings.trials)
    log.debug("study '%s': %d finished trials, %d to run here, %d in parallel", study.study_name, done, max(remaining, 0), n_jobs)
    if remaining > 0 and not (stop is not None and stop.is_set()):
        callbacks = []
        if settings.own_trials is None:
            callbacks.append(lambda s, t: s.stop() if _finished(s) >= settings.trials else None)
        if on_trial is not None:
            callbacks.append(lambda s, t: on_trial(to_record(t), _finished(s), settings.trials))
        if stop is not None:
            callbacks.append(lambda s, t: s.stop() if stop.is_set() else None)
        study.optimize(
            _objective(Evaluator(model, data, target, settings.evaluation), space, stop),
            n_trials=remaining,
            timeout=settings.timeout_s,
            catch=(CandidateFailed,),
            n_jobs=n_jobs,
            callbacks=callbacks,
            gc_after_trial=False,
        )
    return records(study)


FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)  # PRUNED: cut short by Ctrl-C


def _finished(study: optuna.Study) -> int:
    """Finished trials, not counting one a dead process left that runs again as a retry (so a
    killed worker costs the study no candidate)."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.system_attrs.get("failed_trial") for t in trials}
    return sum(t.state in FINISHED and t.number not in retried for t in trials)


def to_record(trial: optuna.trial.FrozenTrial) -> TrialRecord:
    attrs = dict(trial.user_attrs)
    attrs.setdefault("fail_reason", trial.system_attrs.get("fail_reason"))
    return TrialRecord.from_attrs(trial.number, trial.state.name, attrs, trial.constraints)


def records(study: optuna.Study) -> list[TrialRecord]:
    return [to_record(t) for t in study.get_trials(deepcopy=False)]


def pareto_numbers(study: optuna.Study) -> list[int]:
    """Trial numbers on the feasible Pareto front (Optuna's own dominance, constraints respected)."""
    return [t.number for t in study.best_trials]


def load_records(storage_url: str, name: str) -> tuple[list[TrialRecord], list[int], dict]:
    """A study's trials, its feasible Pareto front and the inputs it was created with (for reports)."""
    study = _planner_study(storage_url, name)
    return records(study), pareto_numbers(study), study.user_attrs["inputs"]
