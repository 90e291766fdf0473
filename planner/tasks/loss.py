"""Models that bring their own loss: the graph's first output is the batch's scalar loss.

What ONNX Runtime's training artifacts and ExecuTorch train: a detector, a contrastive or a
distillation model exported with its loss inside (`forward(x, targets) -> loss`). The targets are
model inputs, given in the data as arrays named as the inputs; the step minimises the output as
it is, and the metric is that loss on the val split (each micro-batch's loss weighted by the
samples it holds: a last, short micro-batch is filled with the split's first samples)."""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.errors import BadInput
from planner.tasks._base import LossGraph, Score, Task
from planner.types import ModelInput
from planner.types._metric import METRICS


class _MeanLoss(Score):
    def __init__(self) -> None:
        self.sum, self.n = 0.0, 0

    def add(self, outputs: np.ndarray, targets: np.ndarray) -> None:
        self.sum += float(outputs.astype(np.float64).sum())  # a sample each: its micro-batch's loss
        self.n += len(outputs)

    def result(self) -> tuple[float, float]:
        return self.sum / self.n, self.sum / self.n


class LossInModel(Task):
    name = "loss-in-model"
    description = "the model computes its own loss: its first output is a scalar, targets are its inputs"
    metric = METRICS["loss"]
    labelled = False
    scalar_output = True

    def _refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        return None

    def target(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
        return ModelInput("unused", (), "float32")  # the step's last argument, which the loss ignores

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        return y is None

    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        raise BadInput(
            f"{where}: the model computes its own loss from its inputs; give its targets as arrays named as the inputs, not y"
        )

    def unlabelled(self, n: int) -> np.ndarray | None:
        return np.zeros(n, np.float32)

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        return outputs

    def scorer(self) -> Score:
        return _MeanLoss()
