"""The samplers the CLI offers by name: one entry each, read without loading Optuna.

A script passes any Optuna sampler object instead (`planner.plan(..., sampler=...)`); a name is
for the command line (`--sampler`) and a study's stored record. Each entry builds its sampler on
demand, importing Optuna then, so that `planner --help` lists the names without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna


@dataclass(frozen=True)
class NamedSampler:
    """A sampler by name: what `--help` says of it, how it is built from a seed, and whether the
    space's hand-made recipes start a study with it (`takes_anchors`)."""

    help: str
    make: Callable[[int | None], optuna.samplers.BaseSampler]
    anchors: bool


def _tpe(seed: int | None) -> optuna.samplers.BaseSampler:
    """Multivariate TPE after 8 startup trials: it learns the budgets from the trials' constraints."""
    import optuna

    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)


def _random(seed: int | None) -> optuna.samplers.BaseSampler:
    """Independent uniform draws: the blind baseline `benchmarks/search_quality.py` compares with."""
    import optuna

    return optuna.samplers.RandomSampler(seed=seed)


SAMPLERS: dict[str, NamedSampler] = {
    "tpe": NamedSampler(
        "the space's hand-made schemes (last layer, all biases, all layers) first, then multivariate TPE", _tpe, True
    ),
    "random": NamedSampler("random search, a baseline", _random, False),
}
DEFAULT_SAMPLER = "tpe"
