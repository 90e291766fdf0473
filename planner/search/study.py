"""The Optuna study: propose candidates, measure them for real, keep every result in storage.

Three objectives — maximise val accuracy, minimise step latency and peak memory — and the target's
budgets as Optuna constraints, so the sampler learns to avoid over-budget regions and an infeasible
trial never reaches the Pareto front. A candidate that fails to build or run is a FAIL trial with
its reason stored; the study goes on. Storage is SQLite (or any Optuna URL) with heartbeats, so a
killed run's trials stay and the same command resumes where it stopped.

Everything Optuna-specific stays here: callers get plain `TrialRecord`s.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Literal

import optuna
import optuna.storages.journal

from planner.backend.threads import physical_cores
from planner.errors import BadInput, CandidateFailed, EnvironmentFailure, first_line
from planner.inputs.data import Dataset
from planner.inputs.model import Model
from planner.inputs.spaces import SearchSpace
from planner.inputs.targets import HardwareTarget
from planner.measurement import runner_for
from planner.search.evaluate import EvalSettings, Evaluator, Hooks
from planner.search.fidelity import ScreenPoint
from planner.search.urls import redact, scrubbed
from planner.types import Fidelity, TrialRecord, TrialState


def _experimental() -> warnings.catch_warnings:
    """Optuna's ExperimentalWarning silenced around a call that raises it: heartbeats and metric
    names are "experimental" in Optuna, and planner relies on them knowingly. Around the call, not
    a filter set on import: a program that imports planner keeps its own warning filters."""
    return warnings.catch_warnings(action="ignore", category=optuna.exceptions.ExperimentalWarning)


log = logging.getLogger(__name__)

OBJECTIVES = ("accuracy", "step_latency_ms", "peak_memory_bytes")
DIRECTIONS: tuple[Literal["maximize", "minimize"], ...] = ("maximize", "minimize", "minimize")


@dataclass(frozen=True)
class SearchSettings:
    trials: int  # finished trials the study should hold
    timeout_s: float | None
    evaluation: EvalSettings
    own_trials: int | None = None  # a worker's `--trials N`: run exactly N here, whatever the total
    # on a local target with 2+ cores, compile the next trial during this one's fine-tune. A
    # candidate that crashes the process (a compiler abort) then takes the trial beside it down
    # too: neither is blamed, both run again alone (`recover_dead_trials`, `_retry_stale`)
    overlap: bool = True


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


def open_storage(url: str | None) -> optuna.storages.BaseStorage:
    """An Optuna storage from planner's URL: an RDB URL (sqlite/postgresql/mysql), else a journal
    file path (Optuna's `JournalFileBackend`, safe for many processes on one disk); None keeps the
    study in this process's memory (a script's one-off search: nothing to resume).

    An RDB storage keeps heartbeats: a running trial records one every PLANNER_HEARTBEAT_S seconds
    (default 10). When a trial has been silent for PLANNER_HEARTBEAT_GRACE_S seconds (default 30),
    its process was killed or its machine lost. The next process to start a trial on the study
    (a `planner plan` or `planner worker`) then marks it FAIL and queues a copy with the same
    parameters, which Optuna runs before sampling anything new (`_retry_stale`: once per
    candidate, so a candidate that kills its process cannot kill every worker in turn).

    A journal file has no heartbeats in Optuna 5: a killed process's trial stays RUNNING there
    and is not retried (the study goes on without it).
    """
    if url is None:
        return optuna.storages.InMemoryStorage()
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        interval, grace = _env_seconds(HEARTBEAT_ENV, HEARTBEAT_S), _env_seconds(GRACE_ENV, GRACE_S)
        if grace <= interval:
            raise BadInput(f"{GRACE_ENV} ({grace} s) must be longer than {HEARTBEAT_ENV} ({interval} s)")
        with _experimental():
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=interval, grace_period=grace, heartbeat_stale_trial_callback=_retry_stale
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
        return self._anchors[trial.number] if self.fixes(trial.number) else None

    def fixes(self, number: int) -> bool:
        """Whether trial `number` is one of the anchors."""
        return number < len(self._anchors)

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


def takes_anchors(sampler: object) -> bool:
    """Whether a study with `sampler` starts from the space's hand-made recipes: TPE does (the
    default); random search is the blind baseline `benchmarks/search_quality.py` compares with."""
    return sampler == "tpe"


def make_sampler(name: str, seed: int | None, anchors: list[dict] | None = None) -> optuna.samplers.BaseSampler:
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
    storage_url: str | None,
    name: str,
    seed: int | None,
    config: dict,
    sampler: str = "tpe",
    anchors: list[dict] | None = None,
    inputs: dict | None = None,
) -> optuna.Study:
    """Create the study, or load it when it exists — for the same model, data, target and space.

    `inputs` (where the model, data, target and space are, and the run's settings) is stored at
    creation, so `planner worker` can join the study knowing only its storage and name.
    """
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are reported via on_trial
    optuna_sampler = make_sampler(sampler, seed, anchors)
    try:
        study = optuna.create_study(
            storage=open_storage(storage_url),
            study_name=name,
            directions=list(DIRECTIONS),
            sampler=optuna_sampler,
            load_if_exists=True,
        )
    except Exception as exc:  # bad URL, unreachable database, unwritable file
        raise BadInput(f"cannot open study storage {redact(storage_url)}: {scrubbed(exc, storage_url)}") from None
    _stamp_trials(study)
    stored = study.user_attrs.get("config")
    if stored is None:
        study.set_user_attr("config", config)
        if inputs is not None:
            study.set_user_attr("inputs", inputs)
        with _experimental():
            study.set_metric_names(list(OBJECTIVES))
    elif stored != config:
        changed = sorted(k for k in config if stored.get(k) != config[k])
        raise BadInput(
            f"study '{name}' in {redact(storage_url)} was created with a different {', '.join(changed)}; "
            "use another `study` name or `out` directory"
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
        raise BadInput(f"no study '{name}' in {redact(storage_url)}") from None
    except Exception as exc:
        raise BadInput(f"cannot open study storage {redact(storage_url)}: {scrubbed(exc, storage_url)}") from None
    if not {"inputs", "config"} <= study.user_attrs.keys():
        raise BadInput(f"study '{name}' in {redact(storage_url)} was not created by `planner plan`")
    return study


HOST = socket.gethostname()
WORKER = f"{HOST}:{os.getpid()}"


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux), to tell it from a later
    process that got the same pid; None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces


def _machine() -> dict:
    """What tells this machine and PID namespace from another with the same hostname (cloned
    images, containers on the host's network): the kernel's boot id and the PID namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return {}
    return {"boot": boot, "pidns": pidns}


PROCESS = {"host": HOST, "pid": os.getpid(), "start": _start_time(os.getpid()), **_machine()}


def _alive(process: dict) -> bool:
    """Whether the process that recorded `process` still runs. Only answerable in the same
    boot of the same machine and PID namespace; anything else counts as alive (its heartbeat,
    on an RDB storage, tells when it is not)."""
    here = _machine()
    if process.get("host") != HOST or not here or any(process.get(k) != v for k, v in here.items()):
        return True
    pid = int(process["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    start = _start_time(pid)
    return process.get("start") is None or start is None or start == process["start"]


def _requeue(
    trial: optuna.Trial | optuna.trial.FrozenTrial,
    study: optuna.Study,
    reason: str,
    crashed: bool = False,
    env_failures: int | None = None,
    alone: bool = False,
) -> None:
    """Queue `trial`'s candidate again: the copy runs before anything new is sampled.

    The trial itself is then ended PRUNED (planner prunes nothing else), which never counts as
    finished, so the study still wants as many trials as before. `crashed` marks a process that
    died mid-trial, which may be the candidate's doing (a crash in its code): such a candidate is
    queued again only RETRIES times, then it is a FAIL. `alone`: the copy runs with no other
    trial in flight (`_Pipeline.run_alone`), so a crash of its process is its own."""
    retries = int(trial.user_attrs.get("retries", 0)) + crashed
    if isinstance(trial, optuna.Trial):  # a live trial, about to end PRUNED: say why
        trial.set_user_attr("fail_reason", f"{reason}; queued again")
    attrs = {"requeued_from": trial.number, "requeue_reason": reason, "retries": retries, "alone": alone}
    attrs["env_failures"] = int(trial.user_attrs.get("env_failures", 0)) if env_failures is None else env_failures
    study.enqueue_trial(trial.params if _drawn(trial) else {}, user_attrs=attrs)  # (part of a candidate: none)


STALE = "its process stopped sending heartbeats (killed or lost)"


def _retry_stale(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Optuna's heartbeat-stale callback (see `open_storage`): `trial`, just failed by Optuna
    because its process went silent on some host, is queued again as `recover_dead_trials`
    queues a dead process's trial on this one. A candidate whose process died RETRIES times
    already stays FAIL; one that died beside another candidate of the same process (two in
    flight) is not blamed, and runs again alone. Its copy points back at it (`requeued_from`),
    so `_finished` does not count it."""
    shared = _drawn(trial) and any(
        t.number != trial.number and _drawn(t) and t.user_attrs.get("process") == trial.user_attrs.get("process") and _silenced(t)
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL))
    )
    if int(trial.user_attrs.get("retries", 0)) >= RETRIES and not shared:
        return  # it stays FAIL (`records` says why)
    _requeue(trial, study, f"{STALE} beside another trial; to run alone" if shared else STALE, crashed=not shared, alone=shared)


def _drawn(trial: optuna.trial.FrozenTrial | optuna.Trial) -> bool:
    """Whether `trial` had drawn its whole candidate (the objective records it once sampled): a
    process killed while the sampler was still drawing leaves only some of the parameters."""
    return "candidate" in trial.user_attrs


def _silenced(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether `trial`'s process is gone without a word from it: running still (about to be
    failed as stale too: its heartbeats stopped with its process), or failed by Optuna for its
    silence (a trial that failed on its own carries a reason)."""
    if trial.state == optuna.trial.TrialState.RUNNING:
        return True
    return "fail_reason" not in trial.user_attrs and "fail_reason" not in trial.system_attrs


class _Halt:
    """Why this process stops starting trials: Ctrl-C/SIGTERM (`stop`), a second one (`hard`), or
    an environment failure (`error`, raised once the trials in flight end)."""

    def __init__(self, stop: threading.Event | None) -> None:
        self.stop = stop or threading.Event()
        self.hard = False
        self.error: EnvironmentFailure | None = None

    def __call__(self) -> bool:
        return self.stop.is_set() or self.hard or self.error is not None


ENV_RETRIES = 3  # a candidate the environment failed this often is a FAIL: it may be what breaks it


NOT_BEGUN = "the study stopped before this trial began (no candidate drawn: nothing to measure again)"


class _Pipeline:
    """Two trials in flight on this machine, in a fixed order: trial k is sampled once trial k-1
    has been timed, compiles while k-1 fine-tunes, and is timed once k-1 has ended, so a compile
    overlaps the previous fine-tune but never a latency measurement (which always runs alone).

    Trials are ordered by when this process started them (`attach`: creation order is trial-number
    order), never by which thread gets where first, so a seeded study proposes the same candidates
    every run: each is sampled knowing every earlier trial's result but its predecessor's, and
    screened against every earlier trial."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tickets: dict[int, int] = {}  # trial id -> its place in this process's order
        self._timed: set[int] = set()
        self._ended: set[int] = set()
        self._exited: dict[int, float] = {}  # ticket -> when its objective ended
        self._alone: set[int] = set()  # tickets that run with no other trial in flight
        self._broken = False

    @contextlib.contextmanager
    def attach(self, study: optuna.Study):
        """Give each trial this process starts (created, or popped from the queue) its ticket."""
        storage = study._storage
        create, set_state = storage.create_new_trial, storage.set_trial_state_values

        def create_new_trial(study_id, template_trial=None):
            with self._cond:  # held across the creation: tickets follow trial numbers
                trial_id = create(study_id, template_trial)
                self._tickets[trial_id] = len(self._tickets)
            return trial_id

        def set_trial_state_values(trial_id, state, values=None):
            with self._cond:
                popped = set_state(trial_id, state, values)
                if popped and state == optuna.trial.TrialState.RUNNING:
                    self._tickets[trial_id] = len(self._tickets)
            return popped

        storage.create_new_trial, storage.set_trial_state_values = create_new_trial, set_trial_state_values  # type: ignore[method-assign]
        try:
            yield self
        finally:
            storage.create_new_trial, storage.set_trial_state_values = create, set_state  # type: ignore[method-assign]
            self.abort()

    TELL_S = 60.0  # a trial left its objective this long ago and is still not told: its tell failed

    def _after(self, trial_id: int, done: Callable[[int], bool]) -> None:
        """Wait until `done(ticket before)` (under the lock), or the pipeline is broken."""
        with self._cond:
            ticket = self._tickets.get(trial_id, 0)

            def ready() -> bool:
                if self._broken or ticket == 0 or done(ticket - 1):
                    return True
                left = self._exited.get(ticket - 1)  # (so its callbacks never ran: do not wait for ever)
                return left is not None and time.monotonic() - left > self.TELL_S

            while not self._cond.wait_for(ready, timeout=1.0):
                pass

    def before_sampling(self, trial_id: int) -> None:
        # after a trial that runs alone, the next waits for its end, not its timing; a trial says
        # so (run_alone) before it can be timed, so the test is made when it is timed or ended
        self._after(trial_id, lambda t: t in self._ended or (t in self._timed and t not in self._alone))

    def run_alone(self, trial_id: int) -> None:
        """Returns once the trial before has ended; the next waits for this one's end (a candidate
        suspected of crashing the process must not take another trial down with it)."""
        with self._cond:
            if trial_id in self._tickets:
                self._alone.add(self._tickets[trial_id])
        self.before_timing(trial_id)

    def before_timing(self, trial_id: int) -> None:
        self._after(trial_id, self._ended.__contains__)

    def exited(self, trial_id: int) -> None:
        """The trial's objective returned or raised: Optuna tells it next."""
        with self._cond:
            if trial_id in self._tickets:
                self._exited[self._tickets[trial_id]] = time.monotonic()
        self.timed(trial_id)

    def timed(self, trial_id: int) -> None:
        """The trial's latency is measured, or it will not be (it failed first, or it ended)."""
        with self._cond:
            if trial_id in self._tickets:
                self._timed.add(self._tickets[trial_id])
            self._cond.notify_all()

    def ended(self, trial_id: int) -> None:
        """The trial is told: the next may be timed and screened against it."""
        with self._cond:
            if trial_id in self._tickets:
                self._timed.add(self._tickets[trial_id])
                self._ended.add(self._tickets[trial_id])
            self._cond.notify_all()

    def abort(self) -> None:
        """Nobody waits any more (the study stopped on an error)."""
        with self._cond:
            self._broken = True
            self._cond.notify_all()


def _objective(evaluator: Evaluator, space: SearchSpace, halt: _Halt, pipeline: _Pipeline | None, n_jobs: int):
    share = max(1, physical_cores() // n_jobs)

    def threads() -> int:
        """A fine-tune's share of the cores: beside a compile (the pipeline's other trial) one,
        else all; with trials on several boards, whose fine-tunes all run here, an even share."""
        if pipeline is not None:
            return 1 if evaluator.compiling() else 0
        return share if n_jobs > 1 else 0

    def objective(trial: optuna.Trial) -> tuple[float, float, float]:
        try:
            if pipeline is not None:
                pipeline.before_sampling(trial._trial_id)
                if trial.user_attrs.get("alone"):
                    pipeline.run_alone(trial._trial_id)
                if halt():  # stopped while it waited its turn: it has not begun, nothing to queue again
                    trial.set_user_attr("fail_reason", NOT_BEGUN)
                    raise optuna.TrialPruned(NOT_BEGUN)
            return _evaluate(trial)
        except (optuna.TrialPruned, CandidateFailed):
            raise  # Optuna ends the trial and runs the callbacks, which move the pipeline on
        except KeyboardInterrupt:
            # the second Ctrl-C, anywhere in the trial: stop now, the candidate is not to blame
            halt.hard = True
            _requeue(trial, trial.study, "interrupted mid-trial")
            raise optuna.TrialPruned("interrupted mid-trial; queued again") from None
        except BaseException:  # a bug: the study stops, and no trial may wait for this one
            if pipeline is not None:
                pipeline.abort()
            raise
        finally:
            if pipeline is not None:
                pipeline.exited(trial._trial_id)

    def _evaluate(trial: optuna.Trial) -> tuple[float, float, float]:
        trial.set_user_attr("worker", WORKER)  # which process ran it (a popped queued trial names another)
        trial.set_user_attr("seed", evaluator.settings.seed)  # its fine-tune's seed (a resume may change it)
        candidate = space.sample(trial, evaluator.model)
        try:
            sampler = trial.study.sampler
            hooks = Hooks(
                rivals=lambda: screen_points(trial.study),
                interrupted=lambda: halt.hard,
                fine_tune_threads=threads,
                recipe=isinstance(sampler, AnchoredSampler) and sampler.fixes(trial.number),
            )
            if pipeline is not None:
                tid = trial._trial_id
                hooks = replace(
                    hooks, before_timing=lambda: pipeline.before_timing(tid), after_timing=lambda: pipeline.timed(tid)
                )
            constraints = evaluator.evaluate(candidate, trial.set_user_attr, hooks)
        except EnvironmentFailure as exc:
            # the board, the disk or the cache failed, not the candidate: it is measured again by
            # the next run, and this one stops (the caller raises `exc`)
            halt.error = halt.error or exc
            failures = int(trial.user_attrs.get("env_failures", 0)) + 1
            if failures >= ENV_RETRIES:  # ... unless it failed the environment every time it ran
                trial.set_user_attr(
                    "fail_reason", f"the environment failed each of the {failures} times this candidate ran: {first_line(exc)}"
                )
                raise CandidateFailed(first_line(exc)) from None
            _requeue(trial, trial.study, f"environment: {first_line(exc)}", env_failures=failures)
            raise optuna.TrialPruned(f"environment: {first_line(exc)}; queued again") from None
        except CandidateFailed:
            if not halt():
                raise
            # A terminal's Ctrl-C also reaches the compiler and linker this trial runs: its failure
            # says nothing about the candidate. Resuming measures the same parameters.
            _requeue(trial, trial.study, "interrupted mid-trial")
            raise optuna.TrialPruned("interrupted mid-trial; queued again") from None
        for key, value in constraints.items():
            trial.set_constraint(key, value)
        attrs = trial.user_attrs
        return attrs["accuracy"]["after"], attrs["latency"]["median"], float(attrs["memory"]["total"])

    return objective


def screen_points(study: optuna.Study) -> list[ScreenPoint]:
    """The screening results of the study's finished trials (every process's) that met the
    target's budgets and did not diverge: what a new candidate's short fine-tune is compared with."""
    points = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        fidelity = Fidelity.from_json(t.user_attrs.get("fidelity"))
        if fidelity is None or any(v > 0 for k, v in t.constraints.items() if k != "screened"):
            continue
        latency, memory = t.user_attrs["latency"]["median"], t.user_attrs["memory"]["total"]
        points.append(ScreenPoint(t.number, fidelity.screen.after, float(latency), float(memory)))
    return points


def _stamp_trials(study: optuna.Study) -> None:
    """Make every trial this process starts carry its `process` from the instant it exists: a
    new trial is created with it (one storage write), a queued one gets it right as it is popped.
    Set later, in the objective, a kill in between would leave a RUNNING trial nobody can tell
    is dead (until it is GRACE_S old)."""
    storage = study._storage
    create, set_state = storage.create_new_trial, storage.set_trial_state_values

    def create_new_trial(study_id, template_trial=None):
        if template_trial is None:
            template_trial = optuna.trial.FrozenTrial(
                number=-1,
                state=optuna.trial.TrialState.RUNNING,
                value=None,
                datetime_start=datetime.now(),
                datetime_complete=None,
                params={},
                distributions={},
                user_attrs={"process": PROCESS, "worker": WORKER},
                system_attrs={},
                intermediate_values={},
                trial_id=-1,
            )
        return create(study_id, template_trial)

    def set_trial_state_values(trial_id, state, values=None):
        popped = set_state(trial_id, state, values)
        if popped and state == optuna.trial.TrialState.RUNNING:
            storage.set_trial_user_attr(trial_id, "process", PROCESS)
        return popped

    storage.create_new_trial, storage.set_trial_state_values = create_new_trial, set_trial_state_values  # type: ignore[method-assign]


def recover_dead_trials(study: optuna.Study) -> list[int]:
    """End the RUNNING trials whose process died on this host (kill -9, a crash, power loss),
    whatever the storage (a journal file has no heartbeats; an RDB's only fire after a grace
    period), and queue their candidates again, so a rerun a second later measures them. A
    candidate whose process died RETRIES times already is a FAIL: it likely crashes planner.

    A process that died with two candidates in flight (`--overlap`) cannot say which one killed
    it: neither is blamed, and both are queued to run alone, where a second crash is the
    candidate's own. A trial that had not drawn its candidate yet is only ended.

    Returns the numbers of the trials ended."""
    ended = []
    queued = {
        t.user_attrs.get("requeued_from") for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    }
    dead: list[tuple[optuna.trial.FrozenTrial, str, str]] = []  # (trial, why, which process)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        process = t.user_attrs.get("process")
        if isinstance(process, dict):
            if _alive(process):
                continue
            reason = f"its process ({process.get('host')}:{process.get('pid')}) died mid-trial"
        elif t.datetime_start is not None and (datetime.now() - t.datetime_start).total_seconds() > _env_seconds(
            GRACE_ENV, GRACE_S
        ):
            reason = "its process died mid-trial (a trial with no process record, started long ago)"
        else:
            continue  # another process's trial, a moment old
        dead.append((t, reason, json.dumps(process, sort_keys=True) if isinstance(process, dict) else f"#{t.number}"))
    in_flight = collections.Counter(key for t, _, key in dead if _drawn(t))
    for t, reason, key in dead:
        storage, tid = study._storage, t._trial_id
        crashes = int(t.user_attrs.get("retries", 0))
        shared = in_flight[key] > 1
        try:
            if not _drawn(t):  # it was waiting its turn to draw a candidate (or drawing it): nothing to measure again
                storage.set_trial_user_attr(tid, "fail_reason", f"{reason} before drawing a candidate")
                storage.set_trial_state_values(tid, optuna.trial.TrialState.PRUNED)
            elif crashes >= RETRIES and not shared:
                storage.set_trial_user_attr(tid, "fail_reason", f"{reason}, again: the candidate may crash planner")
                storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
            else:
                why = f"{reason} beside another trial; to run alone" if shared else reason
                storage.set_trial_user_attr(tid, "fail_reason", f"{why}; queued again")
                storage.set_trial_state_values(tid, optuna.trial.TrialState.PRUNED)
                if t.number not in queued:  # (its own process queued it, then died before ending it)
                    _requeue(t, study, why, crashed=not shared, alone=shared)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another process got there first
        ended.append(t.number)
    return ended


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
    with _experimental():
        optuna.storages.fail_stale_trials(study)  # a silent heartbeat (another host): failed and queued again now
    done = _finished(study)
    remaining = settings.trials - done if settings.own_trials is None else settings.own_trials
    if on_start is not None:
        on_start(done, settings.trials)
    log.debug("study '%s': %d finished trials, %d to run here, %d in parallel", study.study_name, done, max(remaining, 0), n_jobs)
    halt = _Halt(stop)
    if remaining > 0 and not halt():
        # first: the next trial is timed as soon as this one is told (a later callback may raise)
        callbacks = [] if pipeline is None else [lambda s, t: pipeline.ended(t._trial_id)]
        if on_trial is not None:
            callbacks.append(lambda s, t: on_trial(to_record(t), _finished(s), settings.trials))
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
        with pipeline.attach(study) if pipeline is not None else contextlib.nullcontext(), _gil_turns(n_jobs):
            _in_threads(run_one, n_jobs, remaining, more, halt)
    if halt.error is not None:
        raise type(halt.error)(
            f"{first_line(halt.error)}; the trial was queued again and the study holds {_finished(study)} finished "
            "trials: rerun the same command once that is fixed"
        )
    if halt.hard:
        raise KeyboardInterrupt
    return records(study)


GIL_TURN_S = 0.0005  # Python's own switch interval is 5 ms: two batch-1 training steps


@contextlib.contextmanager
def _gil_turns(n_jobs: int):
    """Shorter turns on the GIL while trials run in threads side by side.

    A fine-tune is C (the step) between short stretches of Python; each time a step returns, its
    thread needs the GIL back, and a compile beside it, running TVM's passes, keeps the GIL until
    the switch interval ends. At Python's 5 ms a batch-1 fine-tune (2 ms steps) waited longer than
    it computed: 200 steps of MobileNetV2-0.35@96 beside compiles took 1.18-1.34 s, 1.04-1.22 s at
    0.2 ms (0.87-0.99 s alone), and the compiles beside them ran no slower."""
    before = sys.getswitchinterval()
    if n_jobs > 1:
        sys.setswitchinterval(GIL_TURN_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


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


FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)  # PRUNED: cut short by Ctrl-C


def _retried(trials: list[optuna.trial.FrozenTrial]) -> set[int]:
    """Trials queued again (`requeued_from`; `failed_trial`: a retry by Optuna's own callback, in
    studies planner ran before it had `_retry_stale`)."""
    return {n for t in trials for n in (t.user_attrs.get("requeued_from"), t.system_attrs.get("failed_trial")) if n is not None}


def _finished(study: optuna.Study) -> int:
    """Finished trials, not counting one a dead process left that runs again as a retry (so a
    killed worker costs the study no candidate)."""
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    return sum(t.state in FINISHED and t.number not in retried for t in trials)


def to_record(trial: optuna.trial.FrozenTrial) -> TrialRecord:
    attrs = dict(trial.user_attrs)
    attrs.setdefault("fail_reason", trial.system_attrs.get("fail_reason"))
    return TrialRecord.from_attrs(trial.number, trial.state.name, attrs, trial.constraints)


def records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial as a record. A trial whose heartbeat stopped and that Optuna ran again is shown
    cut short (PRUNED, not counted), as `_finished` counts it: a dead process costs no trial."""
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    why = {t.user_attrs.get("requeued_from"): t.user_attrs.get("requeue_reason") for t in trials}
    out = []
    for t in trials:
        rec = to_record(t)
        if rec.state is TrialState.FAIL and t.number in retried:
            rec.state = TrialState.PRUNED
            rec.fail_reason = rec.fail_reason or f"{why.get(t.number) or STALE}; queued again"
        elif rec.state is TrialState.FAIL and rec.fail_reason is None and _silenced(t):
            rec.fail_reason = f"{STALE}, again: the candidate may crash planner"
        out.append(rec)
    return out


def pareto_numbers(study: optuna.Study) -> list[int]:
    """Trial numbers on the feasible Pareto front (Optuna's own dominance, constraints respected)."""
    return [t.number for t in study.best_trials]


def load_records(storage_url: str, name: str) -> tuple[list[TrialRecord], list[int], dict]:
    """A study's trials, its feasible Pareto front and the inputs it was created with (for reports)."""
    study = _planner_study(storage_url, name)
    return records(study), pareto_numbers(study), study.user_attrs["inputs"]
