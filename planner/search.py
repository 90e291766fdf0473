"""The Optuna study: propose candidates, measure them for real, keep every result in storage.

Three objectives — maximise val accuracy, minimise step latency and peak memory — and the target's
budgets as Optuna constraints, so the sampler learns to avoid over-budget regions and an infeasible
trial never reaches the Pareto front. A candidate that fails to build or run is a FAIL trial with
its reason stored; the study goes on. Storage is SQLite (or any Optuna URL) with heartbeats, so a
killed run's trials stay and the same command resumes where it stopped.

Everything Optuna-specific stays here: callers get plain `TrialRecord`s.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import tvm

from .accuracy import AccuracyResult, measure_accuracy
from .compile import compile_candidate
from .data import Dataset
from .errors import BadInput, BoardLost, CandidateFailed
from .measure import capacity, measure_step
from .measure.latency import Latency
from .memory import MemoryBreakdown
from .model import Model
from .space import Candidate, SearchSpace
from .target import HardwareTarget

# heartbeats and metric names are "experimental" in Optuna; planner relies on them knowingly
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

OBJECTIVES = ("accuracy", "step_latency_ms", "peak_memory_bytes")
DIRECTIONS = ("maximize", "minimize", "minimize")


@dataclass(frozen=True)
class SearchSettings:
    trials: int
    timeout_s: float | None
    seed: int
    accuracy_steps: int
    latency_repeats: int
    cache_dir: Path


@dataclass
class TrialRecord:
    """One trial as plain data: what was tried, what was measured, or why it failed."""

    number: int
    state: str  # COMPLETE | FAIL | RUNNING | PRUNED
    candidate: Candidate | None
    accuracy: AccuracyResult | None = None
    latency: Latency | None = None
    memory: MemoryBreakdown | None = None
    feasible: bool = False
    fail_reason: str | None = None
    board: str | None = None
    board_memory: dict | None = None
    library_bytes: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.state == "COMPLETE" and self.accuracy is not None


def _storage(url: str) -> optuna.storages.BaseStorage:
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        # Heartbeats let a later run mark a killed run's RUNNING trials as failed.
        return optuna.storages.RDBStorage(url, heartbeat_interval=10, grace_period=30)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))


def open_study(storage_url: str, name: str, seed: int, config: dict) -> optuna.Study:
    """Create the study, or load it when it exists — for the same model, data, target and space."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials are reported via on_trial
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)
    try:
        study = optuna.create_study(
            storage=_storage(storage_url), study_name=name, directions=list(DIRECTIONS),
            sampler=sampler, load_if_exists=True,
        )
    except Exception as exc:  # bad URL, unreachable database, unwritable file
        raise BadInput(f"cannot open study storage {storage_url}: {str(exc).splitlines()[0]}") from None
    stored = study.user_attrs.get("config")
    if stored is None:
        study.set_user_attr("config", config)
        study.set_metric_names(list(OBJECTIVES))
    elif stored != config:
        changed = sorted(k for k in config if stored.get(k) != config[k])
        raise BadInput(
            f"study '{name}' in {storage_url} was created with a different {', '.join(changed)}; "
            "use another --study name or --out directory"
        )
    return study


HOST_TARGET = {"kind": "llvm"}


def _objective(model: Model, data: Dataset, target: HardwareTarget, space: SearchSpace, settings: SearchSettings):
    board_target = target.tvm()
    host_target = tvm.target.Target(HOST_TARGET)
    compile_lock = threading.Lock()  # trials run in threads (one per board); TVM compiles one at a time

    def build(candidate: Candidate, tvm_target, toolchain):
        with compile_lock:
            return compile_candidate(model, candidate, tvm_target, settings.cache_dir, toolchain)

    def objective(trial: optuna.Trial) -> tuple[float, float, float]:
        candidate = space.sample(trial, model)
        trial.set_user_attr("candidate", candidate.to_json())
        try:
            compiled = build(candidate, board_target, target.toolchain)
            trial.set_user_attr("memory", compiled.memory.to_json())
            trial.set_user_attr("library_bytes", compiled.library.stat().st_size)
            trial.set_user_attr("compile_s", 0.0 if compiled.cached else compiled.compile_seconds)
            t0 = time.perf_counter()
            measured = measure_step(compiled, model.initializers, target, settings.latency_repeats)
            trial.set_user_attr("latency", measured.latency.to_json())
            trial.set_user_attr("board", measured.board)
            trial.set_user_attr("board_memory", measured.board_memory)
            trial.set_user_attr("measure_s", time.perf_counter() - t0)
            # accuracy does not depend on the board: a board build may not even run here
            on_host = compiled if target.runner == "local" else build(candidate, host_target, None)
            acc = measure_accuracy(model, data, candidate, on_host, settings.accuracy_steps, settings.seed, settings.cache_dir)
            trial.set_user_attr("accuracy", acc.to_json())
        except BoardLost as exc:
            trial.set_user_attr("fail_reason", str(exc))
            raise CandidateFailed(str(exc)) from None
        except CandidateFailed as exc:
            trial.set_user_attr("fail_reason", str(exc))
            raise
        except Exception as exc:  # anything else in TVM: this candidate fails, the study goes on
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            trial.set_user_attr("fail_reason", reason)
            raise CandidateFailed(reason) from exc
        trial.set_constraint("ram_budget", compiled.memory.total - target.ram_budget_bytes)
        if target.latency_budget_ms is not None:
            trial.set_constraint("latency_budget", measured.latency.median - target.latency_budget_ms)
        if target.flash_budget_bytes is not None:
            trial.set_constraint("flash_budget", compiled.library.stat().st_size - target.flash_budget_bytes)
        return acc.after, measured.latency.median, float(compiled.memory.total)

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
    """Run trials until the study holds `settings.trials` finished ones (or the timeout)."""
    space.layer_names(model)  # refuse an untrainable space before the first compile
    n_jobs = capacity(target)  # one trial in flight per board
    done = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
    remaining = settings.trials - done
    if remaining > 0:
        callbacks = []
        if on_trial is not None:
            callbacks.append(lambda s, t: on_trial(to_record(t), t.number + 1, settings.trials))
        study.optimize(
            _objective(model, data, target, space, settings),
            n_trials=remaining,
            timeout=settings.timeout_s,
            catch=(CandidateFailed,),
            n_jobs=n_jobs,
            callbacks=callbacks,
            gc_after_trial=False,
        )
    return records(study)


def to_record(trial: optuna.trial.FrozenTrial) -> TrialRecord:
    attrs = trial.user_attrs
    cand = attrs.get("candidate")
    rec = TrialRecord(
        number=trial.number,
        state=trial.state.name,
        candidate=Candidate.from_json(cand) if cand else None,
        accuracy=AccuracyResult(**attrs["accuracy"]) if "accuracy" in attrs else None,
        latency=Latency(**attrs["latency"]) if "latency" in attrs else None,
        memory=MemoryBreakdown(**attrs["memory"]) if "memory" in attrs else None,
        fail_reason=attrs.get("fail_reason") or trial.system_attrs.get("fail_reason"),
        board=attrs.get("board"),
        board_memory=attrs.get("board_memory"),
        library_bytes=attrs.get("library_bytes"),
        seconds={k: float(attrs[k]) for k in ("compile_s", "measure_s") if k in attrs},
    )
    rec.feasible = rec.complete and all(c <= 0 for c in trial.constraints.values())
    if rec.accuracy is not None:
        rec.seconds["accuracy_s"] = rec.accuracy.seconds
    return rec


def records(study: optuna.Study) -> list[TrialRecord]:
    return [to_record(t) for t in study.get_trials(deepcopy=False)]


def pareto_numbers(study: optuna.Study) -> list[int]:
    """Trial numbers on the feasible Pareto front (Optuna's own dominance, constraints respected)."""
    return [t.number for t in study.best_trials]
