"""Token tagging (slot filling, named entities): `[batch, length, classes]` logits, a class index
per token with padding marked -100 (PyTorch's ignore index), cross-entropy over the tokens that
count, judged by their accuracy."""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.errors import BadInput
from planner.tasks._base import IGNORE_INDEX, LossGraph, Score, Task, log_softmax, numeric, shape_text
from planner.types import ModelInput
from planner.types._metric import METRICS


class _TokenAccuracy(Score):
    def __init__(self) -> None:
        self.loss, self.correct, self.n = 0.0, 0, 0

    def add(self, outputs: np.ndarray, targets: np.ndarray) -> None:
        counted = targets != IGNORE_INDEX
        logp = log_softmax(outputs)[counted]
        y = targets[counted]
        self.loss += float(-logp[np.arange(len(y)), y].sum())
        self.correct += int((logp.argmax(axis=-1) == y).sum())
        self.n += len(y)

    def result(self) -> tuple[float, float]:
        return (self.loss / self.n, self.correct / self.n) if self.n else (float("nan"), 0.0)


class TokenClassification(Task):
    name = "token-classification"
    description = "a class per token: [batch, length, classes] logits, -100 for padding, cross-entropy, token accuracy"
    metric = METRICS["token_accuracy"]
    token_cross_entropy = True

    def _refuses(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> str | None:
        if len(output.shape) != 2 or not isinstance(output.shape[1], int):
            return f"its output '{output.name}' is {shape_text(output.shape)}, not logits [batch, length, classes]"
        return None

    def target(self, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
        return ModelInput("labels", output.static[:1], "int64")

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        return y is not None and y.ndim == 2 and y.dtype.kind in "iu" and len(output.shape) == 2

    def targets(self, where: str, y: np.ndarray, output: ModelInput) -> np.ndarray:
        length, n_classes = output.shape[0], int(output.shape[1])
        y = numeric(where, y, "a class index per token")
        if y.ndim != 2 or (isinstance(length, int) and y.shape[1] != length):
            raise BadInput(f"{where} labels of shape {y.shape}; token classification needs one per token, [{len(y)}, {length}]")
        if y.dtype.kind == "f" and not (y == np.round(y)).all():
            raise BadInput(f"{where} token labels must be whole class indices (or {IGNORE_INDEX} for padding)")
        bad = (y != IGNORE_INDEX) & ((y < 0) | (y >= n_classes))
        if bad.any():
            raise BadInput(
                f"{where} token label {int(y[bad][0])} is outside 0..{n_classes - 1} (the model's {n_classes} classes) "
                f"and is not {IGNORE_INDEX} (padding)"
            )
        return y.astype(np.int64)

    def check_train(self, where: str, targets: np.ndarray) -> None:
        counted = targets[targets != IGNORE_INDEX]
        if len(np.unique(counted)) < 2:
            raise BadInput(f"{where}: the train tokens hold {len(np.unique(counted))} class: a fine-tune learns nothing from it")

    def judged(self, targets: np.ndarray | None, n: int) -> int:
        return int((targets != IGNORE_INDEX).sum()) if targets is not None else n

    def loss(self, g: LossGraph, outputs: Any, targets: Any) -> Any:
        """Cross-entropy summed over the counted tokens over their count, written out: TVM 0.27's
        gradient of `nll_loss` with an `ignore_index` divides by every token, counted or not (a
        step 37/48 of PyTorch's on a batch with 11 padding tokens of 48)."""
        op = g.op
        flat = g.emit(op.reshape(outputs, (-1, g.shape(outputs)[-1])))
        labels = g.emit(op.reshape(targets, (-1,)))
        counted = g.emit(op.not_equal(labels, g.const(IGNORE_INDEX, "int64")))
        safe = g.emit(op.where(counted, labels, g.emit(op.zeros_like(labels))))  # an index every row has
        each = g.emit(op.nn.nll_loss(g.emit(op.nn.log_softmax(flat)), safe, reduction="none"))
        weight = g.emit(op.astype(counted, "float32"))
        total = g.emit(op.sum(g.emit(op.multiply(each, weight))))
        count = g.emit(op.maximum(g.emit(op.sum(weight)), g.const(1.0)))
        return g.emit(op.divide(total, count))

    def scorer(self) -> Score:
        return _TokenAccuracy()


class _Perplexity(_TokenAccuracy):
    def result(self) -> tuple[float, float]:
        loss, _ = super().result()
        return loss, float(np.exp(loss)) if np.isfinite(loss) else float("inf")


class CausalLM(TokenClassification):
    """Next-token prediction: logits `[batch, length, vocabulary]`, each token's target the token
    after it (a corpus chunked into the model's length and one more, `-100` where no next token
    counts), cross-entropy over the counted tokens, judged by perplexity (exp of that mean)."""

    name = "causal-lm"
    description = "next-token prediction over a text corpus: [batch, length, vocabulary] logits, cross-entropy, perplexity"
    metric = METRICS["perplexity"]

    def fits(self, y: np.ndarray | None, output: ModelInput) -> bool:
        return False  # a corpus says so (`planner.inputs.data`), or --task: per-token ids read as tags otherwise

    def check_train(self, where: str, targets: np.ndarray) -> None:
        if not (targets != IGNORE_INDEX).any():
            raise BadInput(f"{where}: no train token has a next token to predict")

    def scorer(self) -> Score:
        return _Perplexity()
