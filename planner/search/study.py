"""The Optuna study: propose candidates, measure them for real, keep every result in storage.

Three objectives — maximise val accuracy, minimise step latency and peak memory — and the target's
budgets as Optuna constraints, so the sampler learns to avoid over-budget regions and an infeasible
trial never reaches the Pareto front. A candidate that fails to build or run is a FAIL trial with
its reason stored; the study goes on. Storage is SQLite (or any Optuna URL) with heartbeats, so a
killed run's trials stay and the same command resumes where it stopped.

This module is the orchestration and the public surface of `search/`; each job is a module of its
own: `_storage` (storages, and the wrapper that stamps this process's trials), `_samplers`,
`_recovery` (dead processes' trials queued again), `_pipeline` (two trials in flight),
`_objective` (one trial); reading a study's trials is `records`'s. Everything Optuna-specific stays in `search/`: callers get plain
`TrialRecord`s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import optuna

from planner.errors import BadInput, CandidateFailed, first_line
from planner.inputs.data import Dataset
from planner.inputs.model import Model
from planner.inputs.spaces import SearchSpace
from planner.inputs.targets import HardwareTarget
from planner.measurement import runner_for
from planner.search._attrs import record_of
from planner.search._objective import NOT_BEGUN, _Halt, _objective
from planner.search._pipeline import _Pipeline
from planner.search._recovery import _retry_stale, process, recover_dead_trials, worker
from planner.search._samplers import SAMPLERS, AnchoredSampler, make_sampler, resumed_seed, takes_anchors
from planner.search._storage import GRACE_ENV, HEARTBEAT_ENV, ProcessStorage, experimental, open_storage, storage_of, trial_id
from planner.search._storage import storage_writes as storage_writes  # (for the API: a study's disk full is one line)
from planner.search.evaluate import EvalSettings, Evaluator
from planner.search.records import _finished, records
from planner.search.urls import redact, scrubbed
from planner.types import ACCURACY, Metric, TrialRecord

__all__ = [
    "GRACE_ENV",
    "HEARTBEAT_ENV",
    "NOT_BEGUN",
    "OBJECTIVES",
    "SAMPLERS",
    "AnchoredSampler",
    "ProcessStorage",
    "SearchSettings",
    "directions",
    "make_sampler",
    "open_storage",
    "open_study",
    "process",
    "recover_dead_trials",
    "run_study",
    "takes_anchors",
    "worker",
]

log = logging.getLogger(__name__)

OBJECTIVES = ("accuracy", "step_latency_ms", "peak_memory_bytes")  # the first: the task's metric


def directions(metric: Metric = ACCURACY) -> list[Literal["maximize", "minimize"]]:
    """The study's directions: the task's metric its own way (accuracy up, an error down), then
    latency and memory down."""
    return ["maximize" if metric.higher_is_better else "minimize", "minimize", "minimize"]


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    trials: int  # finished trials the study should hold
    timeout_s: float | None
    evaluation: EvalSettings
    own_trials: int | None = None  # a worker's `--trials N`: run exactly N here, whatever the total
    # on a local target with 2+ cores, compile the next trial during this one's fine-tune. A
    # candidate that crashes the process (a compiler abort) then takes the trial beside it down
    # too: neither is blamed, both run again alone (`recover_dead_trials`, `_retry_stale`)
    overlap: bool = True


def open_study(
    storage_url: str | None,
    name: str,
    seed: int | None,
    config: dict,
    sampler: str | optuna.samplers.BaseSampler = "tpe",
    anchors: list[dict] | None = None,
    inputs: dict | None = None,
    metric: Metric = ACCURACY,
) -> optuna.Study:
    """Create the study, or load it when it exists — for the same model, data, target and space.

    `sampler`: a name (`SAMPLERS`) or an Optuna sampler object (`make_sampler`). `inputs` (where
    the model, data, target and space are, and the run's settings) is stored at creation, so
    `planner worker` can join the study knowing only its storage and name.
    """
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are reported via on_trial
    optuna_sampler = make_sampler(sampler, seed, anchors)
    try:
        study = optuna.create_study(
            storage=_process_storage(storage_url),
            study_name=name,
            directions=directions(metric),
            sampler=optuna_sampler,
            load_if_exists=True,
        )
    except Exception as exc:  # bad URL, unreachable database, unwritable file
        raise BadInput(f"cannot open study storage {redact(storage_url)}: {scrubbed(exc, storage_url)}") from None
    stored = study.user_attrs.get("config")
    if stored is None:
        study.set_user_attr("config", config)
        if inputs is not None:
            study.set_user_attr("inputs", inputs)
        with experimental():
            study.set_metric_names([metric.name, *OBJECTIVES[1:]])
    elif stored != config:
        changed = sorted(k for k in config if stored.get(k) != config[k])
        raise BadInput(
            f"study '{name}' in {redact(storage_url)} was created with a different {', '.join(changed)}; "
            "use another `study` name or `out` directory"
        )
    begun = len(study.get_trials(deepcopy=False))
    if begun and seed is not None and isinstance(sampler, str):  # a script's sampler object keeps its own seed
        study.sampler = make_sampler(sampler, resumed_seed(seed, begun), anchors)
    return study


def _process_storage(url: str | None) -> ProcessStorage:
    """The storage `url` names, as this process writes to it: each trial it starts stamped with
    `process()` (and `worker()`: which process ran it), a silent heartbeat's trial queued again
    (`_retry_stale`). Over what Optuna itself would make of it (`get_storage`: an RDB behind
    Optuna's cache, so reading the trials stays incremental)."""
    backend = optuna.storages.get_storage(open_storage(url))
    return ProcessStorage(backend, {"process": process(), "worker": worker()}, on_stale=_retry_stale)


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
    # one trial in flight per board; here, two in a fixed pipeline where a second core can compile
    runner = runner_for(target)
    pipeline = _Pipeline() if runner.runs_here and settings.overlap and (os.cpu_count() or 1) > 1 else None
    n_jobs = runner.capacity() if pipeline is None else 2
    recover_dead_trials(study)  # a dead process on this host: queued again at once
    with experimental():
        optuna.storages.fail_stale_trials(study)  # a silent heartbeat (another host): failed and queued again now
    done = _finished(study)
    remaining = settings.trials - done if settings.own_trials is None else settings.own_trials
    if on_start is not None:
        on_start(done, settings.trials)
    log.debug("study '%s': %d finished trials, %d to run here, %d in parallel", study.study_name, done, max(remaining, 0), n_jobs)
    halt = _Halt(stop)
    if remaining > 0 and not halt():
        # first: the next trial is timed as soon as this one is told (a later callback may raise)
        callbacks = [] if pipeline is None else [lambda s, t: pipeline.ended(trial_id(t))]
        if on_trial is not None:
            callbacks.append(lambda s, t: on_trial(record_of(t), _finished(s), settings.trials))
        deadline = None if settings.timeout_s is None else time.monotonic() + settings.timeout_s

        def more() -> bool:
            """Whether to start another trial (besides the `remaining` count)."""
            if halt() or (deadline is not None and time.monotonic() > deadline):
                return False
            return settings.own_trials is not None or _finished(study) < settings.trials

        objective = _objective(Evaluator(model, data, target, settings.evaluation), space, halt, pipeline, n_jobs)
        run_one = functools.partial(
            study.optimize, objective, n_trials=1, catch=(CandidateFailed,), callbacks=callbacks, gc_after_trial=False
        )
        with pipeline.attach(storage_of(study)) if pipeline is not None else contextlib.nullcontext():
            _in_threads(run_one, n_jobs, remaining, more, halt)
    if halt.error is not None:  # the same error (its type, its exit code), saying what became of the study
        error = halt.error
        error.args = (
            f"{first_line(error)}; the trial was queued again and the study holds {_finished(study)} finished "
            "trials: rerun the same command once that is fixed",
        )
        raise error
    if halt.hard:
        raise KeyboardInterrupt
    return records(study)


def _in_threads(run_one: Callable[[], None], n_jobs: int, trials: int, more: Callable[[], bool], halt: _Halt) -> None:
    """Run `run_one` (one trial) `trials` times, `n_jobs` at once, while `more()` says to start
    another; the first exception stops new trials and is raised once those in flight end.

    Not Optuna's `n_jobs`: it drops the exception of every trial still running when the last one
    has been submitted, so a storage out of disk ended a two-trial run as if all went well. The
    trials run in threads, never the main one, so a second Ctrl-C (KeyboardInterrupt, raised in
    the main thread) reaches those in flight: it sets `halt.hard`, their fine-tunes stop at the
    next step and queue their candidates again, and this waits for them to end before the caller
    raises KeyboardInterrupt."""
    lock = threading.Lock()
    left, running = [trials], [n_jobs]
    failure: list[BaseException] = []
    # waited for with an Event, not Thread.join: a KeyboardInterrupt inside join can leave a
    # running thread looking finished (CPython 3.11), and the process would exit mid-trial
    ended = threading.Event()

    def work() -> None:
        try:
            while True:
                with lock:
                    if failure or left[0] <= 0 or not more():
                        return
                    left[0] -= 1
                run_one()
        except BaseException as exc:
            with lock:
                failure.append(exc)
        finally:
            with lock:
                running[0] -= 1
                if not running[0]:
                    ended.set()

    for i in range(n_jobs):
        threading.Thread(target=work, name=f"planner-trials-{i}").start()
    try:
        while not ended.wait(0.2):
            pass
    except KeyboardInterrupt:
        halt.hard = True
        while not ended.wait(0.2):
            pass
    if failure:
        raise failure[0]
