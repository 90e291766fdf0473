"""Single-label classification: `[batch, classes]` logits, one class index per sample, mean
cross-entropy, judged by accuracy."""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.errors import BadInput
from planner.tasks._base import LossGraph, Score, Task, log_softmax, shape_text
from planner.types import ModelInput
from planner.types._metric import ACCURACY


class _Accuracy(Score):
    def __init__(self) -> None:
        self.loss, self.correct, self.n = 0.0, 0, 0

    def add(self, outputs: np.ndarray, targets: np.ndarray) -> None:
        logp = log_softmax(outputs)
        self.loss += float(-logp[np.arange(len(targets)), targets].sum())
        self.correct += int((outputs.argmax(axis=1) == targets).sum())
        self.n += len(targets)

    def result(self) -> tuple[float, float]:
        return self.loss / self.n, self.correct / self.n


class Classification(Task):
    name = "classification"
    description = "one class per sample: [batch, classes] logits, cross-entropy, accuracy"
    metric = ACCURACY

    def _refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        if len(output.shape) != 1 or not isinstance(output.shape[0], int) or output.shape[0] < 2:
            return f"its output '{output.name}' is {shape_text(output.shape)}, not logits [batch, classes] of 2 or more"
        return None

    def target(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
        return ModelInput("labels", (), "int64")

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        if y is None or y.ndim != 1:
            return False
        return y.dtype.kind in "iuUS" or (y.dtype.kind == "f" and bool(np.all(y == np.round(y))))

    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        """Class indices: integers, or floats that are whole numbers (labels often arrive as
        floats from pandas or MATLAB); anything else is one line saying what is wrong."""
        n_classes = int(output.shape[0])
        if y.dtype.kind not in "iuf":
            raise BadInput(
                f"{where} labels are {y.dtype}; planner needs class indices 0..{n_classes - 1} (integers) or class names"
            )
        if y.ndim == 2 and y.shape[1] == n_classes:
            raise BadInput(
                f"{where} labels have shape {y.shape}, one-hot or scores; planner needs one class index per sample "
                "(store y.argmax(axis=1)), or for several labels a sample --task multilabel"
            )
        if y.ndim != 1:
            raise BadInput(f"{where} labels have shape {y.shape}; planner needs one class index per sample, shape ({len(y)},)")
        if y.dtype.kind == "f":
            whole = np.isfinite(y) & (y == np.round(y))
            if not whole.all():
                i = int(np.argmin(whole))
                raise BadInput(
                    f"{where} labels must be whole class indices; label {i} is {float(y[i]):g} (float targets are "
                    "regression: a model with one output per target, --task regression)"
                )
        if len(y) and (y.min() < 0 or y.max() >= n_classes):
            raise BadInput(
                f"{where} labels must lie in [0, {n_classes - 1}] for a model with {n_classes} outputs; "
                f"found {int(y.min())}..{int(y.max())}"
            )
        return y if y.dtype.kind in "iu" else y.astype(np.int64)

    def check_train(self, where: str, targets: np.ndarray) -> None:
        if len(np.unique(targets)) < 2:
            raise BadInput(
                f"{where}: every train label is {int(targets[0])}: with a single class, fine-tuning learns nothing and "
                "accuracy cannot rank candidates"
            )

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        return g.emit(g.op.nn.nll_loss(g.emit(g.op.nn.log_softmax(outputs)), targets, reduction="mean"))

    def scorer(self) -> Score:
        return _Accuracy()
