"""The study's sampler: one of planner's by name (what the CLI offers), or any Optuna sampler
object a script passes; and the space's hand-made recipes (anchors) as its first trials, where
they apply."""

from __future__ import annotations

import numpy as np
import optuna

from planner.errors import BadInput
from planner.search.samplers import SAMPLERS


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


def takes_anchors(sampler: str | optuna.samplers.BaseSampler) -> bool:
    """Whether the space's hand-made recipes (anchors) start a study with `sampler`: TPE's, by
    name or as an object, which learns from them as from its startup trials. Not random search,
    the blind baseline `benchmarks/search_quality.py` compares with; nor another sampler object,
    taken as the script gave it (a grid's or a sequence's own bookkeeping would not survive
    fixed parameters) — a script wanting recipes there wraps its sampler in `AnchoredSampler`."""
    if isinstance(sampler, str):
        return sampler in SAMPLERS and SAMPLERS[sampler].anchors
    return isinstance(sampler, optuna.samplers.TPESampler)


def make_sampler(
    sampler: str | optuna.samplers.BaseSampler, seed: int | None, anchors: list[dict] | None = None
) -> optuna.samplers.BaseSampler:
    """A sampler by name (`SAMPLERS`: `tpe`, the default, or `random`), built with `seed`, or an
    Optuna sampler object as it is (its own seed). `anchors` (the space's hand-made schemes) fix
    the parameters of the first trials."""
    if isinstance(sampler, optuna.samplers.BaseSampler):
        base = sampler
    elif isinstance(sampler, str) and sampler in SAMPLERS:
        base = SAMPLERS[sampler].make(seed)
    else:
        what = repr(sampler) if isinstance(sampler, str) else f"a {type(sampler).__name__}"
        raise BadInput(f"unknown sampler {what} (one of {', '.join(SAMPLERS)}, or an optuna.samplers.BaseSampler)")
    return AnchoredSampler(base, anchors) if anchors else base


def resumed_seed(seed: int, begun: int) -> int:
    """The seed a study resumed after `begun` trials draws with. Why not `seed` itself: a sampler
    seeded alike replays its first draws, so a resumed random search (or TPE's startup) would
    measure its first candidates again, cheaply from the caches and uselessly. Why not a random
    one: the same resume of the same study still draws the same candidates."""
    return int(np.random.SeedSequence([seed, begun]).generate_state(1)[0])
