"""The objective a trial runs: draw a candidate, evaluate it, and say what became of it — its three
objectives and budgets, a FAIL of its own, or PRUNED and queued again when the machine, not the
candidate, stopped it (an environment failure, Ctrl-C)."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import optuna

from planner.errors import CandidateFailed, NotTheCandidates, first_line
from planner.inputs.spaces import SearchSpace
from planner.runtime.threads import physical_cores
from planner.search._attrs import Saver, explain, result_of
from planner.search._pipeline import _Pipeline
from planner.search._recovery import ENV_RETRIES, _requeue
from planner.search._samplers import AnchoredSampler
from planner.search._storage import trial_id
from planner.search.evaluate import Evaluator, Hooks
from planner.search.fidelity import ScreenPoint
from planner.types import Metric, TrialResult


class _Halt:
    """Why this process stops starting trials: Ctrl-C/SIGTERM (`stop`), a second one (`hard`), or
    a failure not the candidate's (`error`, raised once the trials in flight end)."""

    def __init__(self, stop: threading.Event | None) -> None:
        self.stop = stop or threading.Event()
        self.hard = False
        self.error: NotTheCandidates | None = None

    def __call__(self) -> bool:
        return self.stop.is_set() or self.hard or self.error is not None


NOT_BEGUN = "the study stopped before this trial began (no candidate drawn: nothing to measure again)"


def _objective(evaluator: Evaluator, space: SearchSpace, halt: _Halt, pipeline: _Pipeline | None, n_jobs: int):
    """The study's objective: each trial draws its candidate (once the pipeline gives it its turn),
    evaluates it and returns (accuracy, latency, memory), its budgets set as constraints. What is
    not the candidate's fault ends it PRUNED with its candidate queued again (`_requeue`)."""
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
                pipeline.before_sampling(trial_id(trial))
                if trial.user_attrs.get("alone"):
                    pipeline.run_alone(trial_id(trial))
                if halt():  # stopped while it waited its turn: it has not begun, nothing to queue again
                    explain(trial.set_user_attr, NOT_BEGUN)
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
                pipeline.exited(trial_id(trial))

    def _evaluate(trial: optuna.Trial) -> tuple[float, float, float]:
        trial.set_user_attr("seed", evaluator.settings.seed)  # its fine-tune's seed (a resume may change it)
        candidate = space.sample(trial, evaluator.model)
        try:
            sampler = trial.study.sampler
            hooks = Hooks(
                rivals=lambda: screen_points(trial.study),
                interrupted=lambda: halt.hard,
                fine_tune_threads=threads,
                recipe=isinstance(sampler, AnchoredSampler) and sampler.fixes(trial.number),
                saved=Saver(trial),
            )
            if pipeline is not None:
                tid = trial_id(trial)
                hooks = replace(
                    hooks, before_timing=lambda: pipeline.before_timing(tid), after_timing=lambda: pipeline.timed(tid)
                )
            result = TrialResult()
            constraints = evaluator.evaluate(candidate, result, hooks)
        except NotTheCandidates as exc:
            # the board, the disk or the cache failed, or planner did: not the candidate. It is
            # measured again by the next run, and this one stops (the caller raises `exc`)
            halt.error = halt.error or exc
            failures = int(trial.user_attrs.get("env_failures", 0)) + 1
            if failures >= ENV_RETRIES:  # ... unless it failed the environment every time it ran
                explain(
                    trial.set_user_attr,
                    f"the environment failed each of the {failures} times this candidate ran: {first_line(exc)}",
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
        return _values(result, evaluator.model.task.metric)

    return objective


def _values(result: TrialResult, metric: Metric) -> tuple[float, float, float]:
    """A trial's objectives: the task's metric (accuracy), latency and memory, as measured; one
    over budget by its estimate or by the linker was never run, and samplers rank it by its
    violation alone (its metric the worst there is: 0 accuracy, an infinite error)."""
    assert result.memory is not None  # (what `evaluate` returns after, it measures first)
    if result.accuracy is None or result.latency is None:
        return 0.0 if metric.higher_is_better else math.inf, math.inf, float(result.memory.total)
    return result.accuracy.after, result.latency.median, float(result.memory.total)


def screen_points(study: optuna.Study) -> list[ScreenPoint]:
    """The screening results of the study's finished trials (every process's) that met the
    target's budgets and did not diverge: what a new candidate's short fine-tune is compared with."""
    points = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        result = result_of(t)
        fidelity = result.fidelity
        if fidelity is None or any(v > 0 for k, v in t.constraints.items() if k != "screened"):
            continue
        assert result.latency is not None and result.memory is not None  # (measured before it was screened)
        points.append(ScreenPoint(t.number, fidelity.screen.quality, result.latency.median, float(result.memory.total)))
    return points
