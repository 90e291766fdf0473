"""What a task is: the interface every task implements.

A task says what a model's output means and how training judges it: which outputs and targets
it takes (`check`, `target`), how raw labels become targets (`targets`), the loss the step
minimises (`loss`, built in Relax from the operators the back end hands it), and the metric a
fine-tune is judged by (`scorer`, in numpy over the model's outputs). A new task is one module
and one line in `planner.tasks.TASKS`.

No TVM here: the back end hands a task Relax's operators when it builds a step (as it does an
update mode), so reading a plan or checking data never loads a compiler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import numpy as np

from planner.errors import BadInput
from planner.types import ModelInput
from planner.types._metric import Metric

IGNORE_INDEX = -100  # a per-token target the loss and the metric skip: padding (PyTorch's default)


class LossGraph(Protocol):
    """What a task builds its loss with: Relax's operators (`tvm.relax.op`), `emit` (one binding
    in the step's dataflow block), `const` (a scalar of a dtype) and `shape` (an expression's static shape)."""

    op: Any

    def emit(self, expr: Any) -> Any: ...
    def const(self, value: float, dtype: str = "float32") -> Any: ...
    def shape(self, expr: Any) -> tuple[int, ...]: ...


class Score(ABC):
    """A metric and the mean loss, accumulated over chunks of a split (`add`), read at the end."""

    @abstractmethod
    def add(self, outputs: np.ndarray, targets: np.ndarray) -> None: ...

    @abstractmethod
    def result(self) -> tuple[float, float]:
        """(mean loss as the step computes it, the metric)."""


class Task(ABC):
    name: ClassVar[str]  # what --task, plan.json and the reports say
    description: ClassVar[str]
    metric: ClassVar[Metric]
    labelled: ClassVar[bool] = True  # the data holds targets; else the targets are the inputs

    scalar_output: ClassVar[bool] = False  # the model's output is the batch's loss, no batch dimension
    # The loss is the mean softmax cross-entropy over the last axis of every row whose target is not
    # IGNORE_INDEX: a back end may then compute the last projection and the loss in chunks of rows
    # (a language model's [batch, length, vocabulary] logits never whole).
    token_cross_entropy: ClassVar[bool] = False

    def refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        """Why a model with this output (shape after the batch) cannot be trained for this task;
        None when it can."""
        if self.scalar_output and output.batched:
            return f"its output '{output.name}' is {shape_text(output.shape)}, not a scalar loss"
        if not self.scalar_output and not output.batched:
            return f"its output '{output.name}' is a scalar (a loss the model computes itself: --task loss-in-model)"
        return self._refuses(output, inputs)

    @abstractmethod
    def _refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        """`refuses`, for an output batched as the task needs."""

    def unlabelled(self, n: int) -> np.ndarray | None:
        """What a split of `n` samples without labels holds as targets: None, the inputs
        themselves (an autoencoder's); a task whose targets are labels has none to give."""
        raise BadInput(f"{self.name} needs labels, and the data holds none")

    @abstractmethod
    def target(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
        """One sample's target: its shape and dtype, as the step takes it."""

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        """Whether raw labels `y` (None: the data has none) read as this task's targets: how the
        task is inferred when the user does not name it."""
        return y is not None and self.labelled

    @abstractmethod
    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        """Raw labels as the step's targets, checked (BadInput saying what is wrong)."""

    def compared(self, inputs: Any, targets: np.ndarray) -> Any:
        """What the scorer judges outputs against: the targets (an anomaly detector's val
        samples and their flags, since it scores a sample by how well it rebuilds it)."""
        return targets

    @abstractmethod
    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        """The mean loss of a batch, a float32 scalar, in Relax, from the model's `outputs` (float32)
        and the batch's `targets` (as `target` says)."""

    @abstractmethod
    def scorer(self) -> Score:
        """A fresh accumulator of the loss and the metric over a split."""

    def check_train(self, where: str, targets: np.ndarray) -> None:
        """Refuse training targets a fine-tune can learn nothing from."""

    def judged(self, targets: np.ndarray | None, n: int) -> int:
        """How many values the metric averages over `n` samples with these targets (how noisy it
        is): a sample each, unless a task judges more (tokens, labels)."""
        return n

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<task {self.name}>"


def shape_text(shape: tuple[int | str, ...]) -> str:
    return "[batch" + "".join(f", {d}" for d in shape) + "]"


def numeric(where: str, y: np.ndarray, what: str) -> np.ndarray:
    """`y` as numbers, or BadInput: names (strings) are class labels, not `what`."""
    if y.dtype.kind not in "biuf":
        raise BadInput(f"{where} labels are {y.dtype} (names?); {what} needs numbers")
    return y


def finite(where: str, y: np.ndarray) -> np.ndarray:
    if y.dtype.kind == "f" and not np.isfinite(y).all():
        raise BadInput(
            f"{where} targets hold NaN or infinity at sample {int(np.flatnonzero(~np.isfinite(y.reshape(len(y), -1)).all(1))[0])}"
        )
    return y


def same_shape(where: str, y: np.ndarray, shape: tuple[int, ...], task: str) -> None:
    if tuple(y.shape[1:]) != tuple(shape):
        raise BadInput(
            f"{where} targets of shape {tuple(y.shape)}, but for {task} the model's output {shape_text(shape)} needs "
            f"{(len(y), *shape)}"
        )


def log_softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    logits = logits.astype(np.float64)
    logits = logits - logits.max(axis=axis, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=axis, keepdims=True))
