"""What a task's fine-tune is judged by: a metric, and which way is better.

A measured result carries its metric's name (`AccuracyResult.metric`), so everything that ranks
or prints a result — the selection, the screening, the Pareto front, the reports — reads the
direction from the result itself and never assumes "higher accuracy".
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # as plan.json, the reports and the progress line name it
    higher_is_better: bool
    # a share in [0, 1] (accuracy, F1): a tolerance is absolute; else (an error, a perplexity) it is
    # relative to the best value, and no range is checked
    bounded: bool
    short: str  # the progress line's column
    floor: float = 0.0  # the least an unbounded metric can be (an error 0, a perplexity 1)

    @property
    def direction(self) -> str:
        """Optuna's direction for this metric as a study objective."""
        return "maximize" if self.higher_is_better else "minimize"

    def quality(self, value: float) -> float:
        """`value` as a number where higher is better: the one way selection and screening compare."""
        return value if self.higher_is_better else -value

    def gain(self, before: float, after: float) -> float:
        """How much better `after` is than `before` (negative: worse), in the metric's own units."""
        return self.quality(after) - self.quality(before)

    def slack(self, best: float, tolerance: float) -> float:
        """How far from `best` a value may fall and still be as good: `tolerance` itself for a
        share, a `tolerance` fraction of the best value's size for an unbounded metric."""
        return tolerance if self.bounded else tolerance * abs(best)

    def text(self, value: float) -> str:
        """`value` as planner prints it: a share to three places, an error to four figures."""
        return f"{value:.3f}" if self.bounded else f"{value:.4g}"

    def valid(self, value: float) -> bool:
        """A value this metric can take: a share in [0, 1]; an error or a perplexity finite and not
        negative (a perplexity at least 1)."""
        if self.bounded:
            return 0.0 <= value <= 1.0
        return value == value and value != float("inf") and value >= self.floor


ACCURACY = Metric("accuracy", higher_is_better=True, bounded=True, short="acc")
METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        ACCURACY,
        Metric("f1", higher_is_better=True, bounded=True, short="f1"),
        Metric("token_accuracy", higher_is_better=True, bounded=True, short="tok acc"),
        Metric("auc", higher_is_better=True, bounded=True, short="auc"),
        Metric("mse", higher_is_better=False, bounded=False, short="mse"),
        Metric("mae", higher_is_better=False, bounded=False, short="mae"),
        Metric("perplexity", higher_is_better=False, bounded=False, short="ppl", floor=1.0),
        Metric("loss", higher_is_better=False, bounded=False, short="loss", floor=-math.inf),
    )
}


def metric_named(name: str) -> Metric:
    """The metric called `name`, or ValueError listing them."""
    if name not in METRICS:
        raise ValueError(f"no metric {name!r}: planner measures {', '.join(METRICS)}")
    return METRICS[name]
