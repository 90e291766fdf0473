"""Reading a study's trials, for a report, a resumed run or a worker joining: plain `TrialRecord`s,
the feasible Pareto front and the inputs the study was created with.

Apart from the study's running (`study`): reading trials loads nothing of a trial's evaluation
(compile, measure, fine-tune), so a report of a study never loads TVM.
"""

from __future__ import annotations

import optuna

from planner.errors import BadInput
from planner.search._attrs import record_of
from planner.search._recovery import STALE, _silenced
from planner.search._storage import open_storage
from planner.search.urls import redact, scrubbed
from planner.types import TrialRecord, TrialState


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


def records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial as a record. A trial whose heartbeat stopped and that Optuna ran again is shown
    cut short (PRUNED, not counted), as `_finished` counts it: a dead process costs no trial."""
    trials = study.get_trials(deepcopy=False)
    retried = _retried(trials)
    why = {t.user_attrs.get("requeued_from"): t.user_attrs.get("requeue_reason") for t in trials}
    out = []
    for t in trials:
        rec = record_of(t)
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
