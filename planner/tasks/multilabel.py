"""Multi-label tagging: `[batch, labels]` logits, a 0/1 target per label, binary cross-entropy on
the logits (as PyTorch's `BCEWithLogitsLoss`), judged by micro-averaged F1 at logit 0."""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.errors import BadInput
from planner.tasks._base import LossGraph, Score, Task, numeric, same_shape, shape_text
from planner.types import ModelInput
from planner.types._metric import METRICS


def bce_with_logits(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Elementwise, in the stable form the step computes: max(x, 0) - x y + log(1 + exp(-|x|))."""
    x = x.astype(np.float64)
    return np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))


class _F1(Score):
    def __init__(self) -> None:
        self.loss, self.n, self.tp, self.fp, self.fn = 0.0, 0, 0, 0, 0

    def add(self, outputs: np.ndarray, targets: np.ndarray) -> None:
        self.loss += float(bce_with_logits(outputs, targets).sum())
        self.n += targets.size
        said, true = outputs > 0, targets > 0.5
        self.tp += int((said & true).sum())
        self.fp += int((said & ~true).sum())
        self.fn += int((~said & true).sum())

    def result(self) -> tuple[float, float]:
        both = 2 * self.tp + self.fp + self.fn
        return self.loss / self.n, (2 * self.tp / both) if both else 1.0


class Multilabel(Task):
    name = "multilabel"
    description = "several labels per sample: [batch, labels] logits, 0/1 targets, binary cross-entropy, micro F1"
    metric = METRICS["f1"]

    def _refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        if len(output.shape) != 1 or not isinstance(output.shape[0], int):
            return f"its output '{output.name}' is {shape_text(output.shape)}, not logits [batch, labels]"
        return None

    def target(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
        return ModelInput("labels", output.static, "float32")

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        return (
            y is not None
            and y.dtype.kind in "biuf"
            and tuple(y.shape[1:]) == tuple(output.shape)
            and len(output.shape) == 1
            and bool(np.isin(y, (0, 1)).all())
            and not bool((y.sum(axis=1) == 1).all())  # one-hot rows: a class each, meant as classification
        )

    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        y = numeric(where, y, "a 0/1 matrix of labels")
        same_shape(where, y, output.static, self.name)
        if not np.isin(y, (0, 1)).all():
            raise BadInput(f"{where} multi-label targets must be 0 or 1; found {float(y[~np.isin(y, (0, 1))][0]):g}")
        return y.astype(np.uint8)

    def check_train(self, where: str, targets: np.ndarray) -> None:
        if targets.min() == targets.max():
            raise BadInput(f"{where}: every train target is {int(targets.flat[0])}: a fine-tune learns nothing from it")

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        op = g.op
        x = outputs
        soft = g.emit(op.log(g.emit(op.add(g.const(1.0), g.emit(op.exp(g.emit(op.negative(g.emit(op.abs(x))))))))))
        each = g.emit(op.add(g.emit(op.subtract(g.emit(op.nn.relu(x)), g.emit(op.multiply(x, targets)))), soft))
        return g.emit(op.mean(each))

    def scorer(self) -> Score:
        return _F1()
