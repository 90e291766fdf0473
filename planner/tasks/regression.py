"""Regression and reconstruction: float outputs against float targets, mean squared error.

`regression` reads its targets from the data (`[N]` or `[N, k]`, as the model's output);
`anomaly` trains as `reconstruction` and judges by how well each val sample's reconstruction
error tells the anomalous ones (flagged 1 in `y_val`) from the normal: the ROC AUC;
`regression-l1` and `regression-huber` train the same targets with PyTorch's `l1_loss` and
`huber_loss` (delta 1), robust to outliers among them, judged by the mean absolute error;
`reconstruction` (an autoencoder) has none: the target is the input itself, trained on normal
data to reconstruct it (anomaly detection scores a sample by its reconstruction error)."""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.errors import BadInput
from planner.tasks._base import LossGraph, Score, Task, finite, numeric, same_shape, shape_text
from planner.types import ModelInput
from planner.types._metric import METRICS


class _Mse(Score):
    def __init__(self) -> None:
        self.sum, self.n = 0.0, 0

    def add(self, outputs: np.ndarray, targets: np.ndarray) -> None:
        d = outputs.astype(np.float64) - targets.reshape(outputs.shape)
        self.sum += float((d * d).sum())
        self.n += d.size

    def result(self) -> tuple[float, float]:
        return self.sum / self.n, self.sum / self.n


class _Mae(_Mse):
    def add(self, outputs: np.ndarray, targets: np.ndarray) -> None:
        d = outputs.astype(np.float64) - targets.reshape(outputs.shape)
        self.sum += float(np.abs(d).sum())
        self.n += d.size


def _mse(g: LossGraph, outputs: Any, targets: Any) -> Any:
    op = g.op
    d = g.emit(op.subtract(outputs, targets))
    return g.emit(op.mean(g.emit(op.multiply(d, d))))


class Regression(Task):
    name = "regression"
    description = "float targets: [batch] or [batch, k] outputs, mean squared error"
    metric = METRICS["mse"]

    def _refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        if not all(isinstance(d, int) for d in output.shape):
            return f"its output '{output.name}' {shape_text(output.shape)} has dynamic sizes"
        return None

    def target(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
        return ModelInput("targets", output.static, "float32")

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        """Numbers shaped as the output; not a matrix of 0/1 alone (labels, one-hot or several)."""
        if y is None or y.dtype.kind not in "iuf" or not _fits(y.shape[1:], output.shape):
            return False
        return y.ndim == 1 or not bool(np.isin(y, (0, 1)).all())

    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        y = finite(where, numeric(where, y, "a float target"))
        if _fits(y.shape[1:], output.shape) and tuple(y.shape[1:]) != tuple(output.shape):
            y = y.reshape(len(y), *output.static)  # [N] targets for a [batch, 1] output
        same_shape(where, y, output.static, self.name)
        return y.astype(np.float32)

    def check_train(self, where: str, targets: np.ndarray) -> None:
        if targets.min() == targets.max():
            raise BadInput(f"{where}: every train target is {float(targets.flat[0]):g}: a fine-tune learns nothing from it")

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        return _mse(g, outputs, targets)

    def scorer(self) -> Score:
        return _Mse()


class RegressionL1(Regression):
    name = "regression-l1"
    description = "float targets, mean absolute error (L1): robust to outlying targets; judged by it"
    metric = METRICS["mae"]

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        return False  # named with --task: the same targets read as `regression` (MSE) otherwise

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        return g.emit(g.op.mean(g.emit(g.op.abs(g.emit(g.op.subtract(outputs, targets))))))

    def scorer(self) -> Score:
        return _Mae()


class RegressionHuber(RegressionL1):
    name = "regression-huber"
    description = "float targets, Huber loss (delta 1: squared near, absolute far), judged by mean absolute error"

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        """mean(0.5 d² where |d| < 1, else |d| - 0.5): PyTorch's `huber_loss` at its default delta."""
        op = g.op
        d = g.emit(op.subtract(outputs, targets))
        size = g.emit(op.abs(d))
        near = g.emit(op.multiply(g.emit(op.multiply(d, d)), g.const(0.5)))
        far = g.emit(op.subtract(size, g.const(0.5)))
        return g.emit(op.mean(g.emit(op.where(g.emit(op.less(size, g.const(1.0))), near, far))))


def _fits(y_shape: tuple[int, ...], out_shape: tuple[int | str, ...]) -> bool:
    """Targets of shape `y_shape` (after the samples) for an output of `out_shape`: the same, or
    one value per sample for one output."""
    return tuple(y_shape) == tuple(out_shape) or (tuple(y_shape) == () and tuple(out_shape) == (1,))


class Reconstruction(Task):
    name = "reconstruction"
    description = "an autoencoder: the output reconstructs the input; no labels; mean squared error"
    metric = METRICS["mse"]
    labelled = False

    def _refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        if len(inputs) != 1 or inputs[0].integer:
            return "it takes no single float input to reconstruct"
        if tuple(output.shape) != tuple(inputs[0].shape):
            return f"its output {shape_text(output.shape)} is not shaped as its input {shape_text(inputs[0].shape)}"
        return None

    def target(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
        return ModelInput("targets", inputs[0].static, "float32")

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        return y is None

    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        raise BadInput(f"{where}: reconstruction trains without labels; the data's labels would be ignored (drop y)")

    def unlabelled(self, n: int) -> np.ndarray | None:
        return None

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        return _mse(g, outputs, targets)

    def scorer(self) -> Score:
        return _Mse()


class _Auc(Score):
    """Each sample's reconstruction error (mean square over its values) against its 0/1 anomaly
    flag: the mean error, and the probability that an anomalous sample's error is above a normal
    one's (ties count half), the ROC AUC."""

    def __init__(self) -> None:
        self.errors: list[np.ndarray] = []
        self.flags: list[np.ndarray] = []

    def add(self, outputs: np.ndarray, targets: Any) -> None:
        inputs, flags = targets
        d = outputs.astype(np.float64) - np.asarray(inputs, np.float64).reshape(outputs.shape)
        self.errors.append((d * d).reshape(len(d), -1).mean(axis=1))
        self.flags.append(np.asarray(flags).reshape(-1))

    def result(self) -> tuple[float, float]:
        errors, flags = np.concatenate(self.errors), np.concatenate(self.flags).astype(bool)
        _, inverse, counts = np.unique(errors, return_inverse=True, return_counts=True)
        ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # 1-based, ties at their mean rank
        n_bad, n_good = int(flags.sum()), int((~flags).sum())
        auc = (ranks[flags].sum() - n_bad * (n_bad + 1) / 2.0) / (n_bad * n_good) if n_bad and n_good else 0.5
        return float(errors.mean()), float(auc)


class AnomalyDetection(Reconstruction):
    name = "anomaly"
    description = "an autoencoder trained on normal samples; val samples flagged 0/1 (y_val), judged by ROC AUC"
    metric = METRICS["auc"]

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        return False  # the data says so: train samples without labels, val samples with flags

    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        y = numeric(where, y, "an anomaly flag (0 normal, 1 anomalous)")
        if y.ndim != 1 or not np.isin(y, (0, 1)).all():
            raise BadInput(f"{where} labels must be one 0/1 anomaly flag per sample (1: anomalous), [N]; got shape {y.shape}")
        if len(np.unique(y)) < 2:
            raise BadInput(f"{where} flags are all {int(y[0])}: an AUC needs normal and anomalous samples")
        return y.astype(np.uint8)

    def compared(self, inputs: Any, targets: np.ndarray) -> Any:
        return inputs, targets

    def scorer(self) -> Score:
        return _Auc()
