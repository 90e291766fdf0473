"""The one adapter between a trial's `TrialResult` and Optuna: the result stored as the trial's
user attributes (its JSON, a key per measurement, written as each stage finishes) and read back.

A trial has attributes of its own beside the result's — the worker and process that ran it, its
fine-tune's seed, retries and requeues (`_storage`, `_recovery`) — which only the search reads.
"""

from __future__ import annotations

from collections.abc import Callable

import optuna

from planner.types import TrialRecord, TrialResult

_MISSING = object()
_CANDIDATE, _FAIL_REASON = "candidate", "fail_reason"  # `TrialResult.to_json`'s keys of those fields


def explain(set_attr: Callable[[str, object], None], reason: str) -> None:
    """Records why a trial ended without a result of its own (stopped before it began, queued
    again, its process dead), through `set_attr`: a live trial's, or the storage's for another's."""
    set_attr(_FAIL_REASON, reason)


def drawn(trial: optuna.trial.FrozenTrial | optuna.Trial) -> bool:
    """Whether `trial` had drawn its whole candidate (saved once sampled, before anything else)."""
    return _CANDIDATE in trial.user_attrs


def explained(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether `trial` says why it ended: planner's reason, or Optuna's."""
    return _FAIL_REASON in trial.user_attrs or _FAIL_REASON in trial.system_attrs


class Saver:
    """`Hooks.saved` for a live trial: each measurement written once, when it first appears or
    changes, so what a trial measured survives its process."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial
        self.written: dict[str, object] = {}

    def __call__(self, result: TrialResult) -> None:
        for key, value in result.to_json().items():
            if self.written.get(key, _MISSING) != value:
                self.trial.set_user_attr(key, value)
                self.written[key] = value


def result_of(trial: optuna.trial.FrozenTrial) -> TrialResult:
    """What `trial` measured; its failure's reason where Optuna recorded it rather than planner."""
    result = TrialResult.from_json(trial.user_attrs)
    if result.fail_reason is None:
        result.fail_reason = trial.system_attrs.get("fail_reason")
    return result


def record_of(trial: optuna.trial.FrozenTrial) -> TrialRecord:
    attrs = trial.user_attrs
    return TrialRecord.of(
        trial.number, trial.state.name, result_of(trial), trial.constraints, worker=attrs.get("worker"), seed=attrs.get("seed")
    )
