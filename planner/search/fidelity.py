"""Multi-fidelity accuracy: every candidate is fine-tuned briefly, only promising ones to the end.

Fine-tuning is most of a trial's time once compiles are cached, and most candidates of a long
study are plainly worse than ones already measured. So each candidate is first fine-tuned for
`screen_steps` and compared with every finished trial's screening result; it trains on to the
full `accuracy_steps` (from where it stopped: `FineTune`) only when no such trial beats it (the
space's hand-made recipes always do: `Evaluator._screen`).
Optuna's pruners decide one objective at a time and do not cover multi-objective studies, so
this is planner's own policy, and each trial records what was decided and why (`Fidelity`).

"Beats" is Pareto dominance with a noise margin on accuracy: a rival must be more accurate by
more than `margin` (the standard error of a val accuracy near 0.5, so a difference of a sample
or two on a small val split promotes rather than discards) and no slower and no larger. A
screened-out trial keeps its short fine-tune's accuracy as its objective, so the sampler learns
from it, and is never deployable: its accuracy was not measured at the step count a plan states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.types import ACCURACY, Metric


@dataclass(frozen=True)
class ScreenPoint:
    """A trial as the screening sees it: its short fine-tune's metric (as `Metric.quality`: higher
    is better, whatever the task), its latency and memory."""

    trial: int
    accuracy: float
    latency_ms: float
    memory_bytes: float


def margin(n_val: int, metric: Metric = ACCURACY, value: float = 0.5) -> float:
    """Differences of `metric` within this are noise: for a share (accuracy, F1) the standard
    error of one of 0.5 measured on `n_val` samples; for a mean squared error of about `value`,
    its standard error were the errors normal (sqrt(2 / n) of it)."""
    if metric.bounded:
        return 0.5 / math.sqrt(max(n_val, 1))
    return abs(value) * math.sqrt(2.0 / max(n_val, 1))


def beaten_by(
    accuracy: float, latency_ms: float, memory_bytes: float, rivals: list[ScreenPoint], noise: float
) -> ScreenPoint | None:
    """The most accurate rival that dominates a candidate's screening result (more accurate by
    more than `noise`, no slower, no larger), or None when none does: then it is promising."""
    better = [
        r for r in rivals if r.accuracy > accuracy + noise and r.latency_ms <= latency_ms and r.memory_bytes <= memory_bytes
    ]
    return max(better, key=lambda r: r.accuracy, default=None)
