"""Run a compiled training step: hold the weights on a device, step, predict, export.

One class serves the accuracy runs, the latency measurement and `planner run`, so all three call
the library the same way: `train_step(*inputs, *frozen, *trainable, *optim_states, labels)` returns the
loss and the updated trainable weights and optimizer states, which become the next step's inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from planner import faults
from planner.errors import EnvironmentFailure
from planner.runtime.convention import PREDICT_FUNC, STEP_FUNC
from planner.runtime.libraries import INSTALL_HINT, load_openblas, missing_library
from planner.runtime.threads import claim_cores
from planner.runtime.weights import from_step, to_step
from planner.tasks import task_named
from planner.types import StepSignature


def load_step(library: Path | str) -> tvm.runtime.Module:
    """The step's library, loaded after OpenBLAS (which it may need): a missing OpenBLAS is an
    `EnvironmentFailure` that says what to install."""
    load_openblas()
    try:
        return tvm.runtime.load_module(str(library))
    except Exception as exc:
        if missing_library(str(exc)):
            raise EnvironmentFailure(f"the step needs OpenBLAS, not found here: {INSTALL_HINT}") from None
        raise


# A batch of model inputs: one array for a model of one input, else one per input in its order.
Inputs = np.ndarray | Sequence[np.ndarray]


def example_batch(sig: StepSignature, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """A batch of the step's shapes for timing it (kernel times do not depend on the values):
    standard normal floats, uniform 8-bit codes; ones for integer inputs, an id every vocabulary
    has and a mask that attends everywhere; integer targets cycle through the classes."""
    xs = [
        rng.integers(0, 256, (sig.batch_size, *i.static), np.uint8)
        if i.encoding is not None
        else np.ones((sig.batch_size, *i.static), i.dtype)
        if i.integer
        else rng.standard_normal((sig.batch_size, *i.static)).astype(i.dtype)
        for i in sig.inputs
    ]
    shape, t = (sig.batch_size, *sig.target.static), sig.target
    if t.integer:
        return xs, (np.arange(int(np.prod(shape))) % max(1, sig.output_shape[-1])).reshape(shape).astype(t.dtype)
    return xs, rng.standard_normal(shape).astype(t.dtype)


def step_inputs(sig: StepSignature, x: Inputs) -> list[np.ndarray]:
    """`x` as the step's input arrays, each in its input's dtype (a float input the step takes in
    8 bits encoded: `Encoding.encode`): one array for a model of one input, else one per input in
    the signature's order."""
    arrays = [x] if isinstance(x, np.ndarray) else list(x)
    if len(arrays) != len(sig.inputs):
        raise ValueError(f"the step takes {len(sig.inputs)} inputs, given {len(arrays)}")
    return [
        np.ascontiguousarray(
            i.encoding.encode(np.asarray(a)) if i.encoding is not None else np.asarray(a).astype(i.dtype, copy=False)
        )
        for a, i in zip(arrays, sig.inputs)
    ]


def score(
    task: str, outputs_of: Callable[[Inputs], np.ndarray], chunks: Iterable[tuple[Inputs, np.ndarray]]
) -> tuple[float, float]:
    """(mean loss, the task's metric) over chunks with their targets, from a session's
    `outputs_of`: one scoring for every session, wherever its step runs."""
    judged = task_named(task)
    scorer = judged.scorer()
    for x, y in chunks:
        scorer.add(outputs_of(x), judged.compared(x, y))
    return scorer.result()


def padded(parts: list[np.ndarray], arrays: list[np.ndarray], batch: int, batched: bool) -> list[np.ndarray]:
    """A last micro-batch `parts` (of `arrays`) filled to `batch` samples: with repeats of its last
    sample (a padding row is a valid input, a token id or a mask, too; each sample's output is its
    own), or, for a model whose output is its batch's loss, with the chunk's first samples, so that
    no one sample weighs in many times."""
    pad = batch - len(parts[0])
    if not pad:
        return parts
    if batched:
        return [np.concatenate([p, np.repeat(p[-1:], pad, axis=0)]) for p in parts]
    return [np.resize(np.concatenate([p, a]), (batch, *p.shape[1:])) for p, a in zip(parts, arrays)]


class TrainingSession:
    """A compiled step loaded on `device` with a full set of weights."""

    def __init__(self, library: Path | tvm.runtime.Module, sig: StepSignature, weights: dict[str, np.ndarray], device=None):
        claim_cores()  # before this process runs a step (see `planner.runtime.threads`)
        self.sig = sig
        self.device = device or tvm.cpu()
        lib = load_step(library) if isinstance(library, Path | str) else library
        self.vm = relax.VirtualMachine(lib, self.device)
        self._set_input = self.vm.module["set_input"]
        self._output = self.vm.module["get_output"]
        self.set_weights(weights)
        # where the step runs elsewhere (a board over RPC), the board's own clock and heap:
        # `timed_invoke` runs one step there and returns its seconds; `heap` reads its C heap
        self.timed_invoke: Callable[[], float] | None = None
        self.heap: Callable[[], int | None] | None = None

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Start over from `weights` (by ONNX initializer name) and fresh optimizer state."""
        sig = self.sig
        weights = to_step(weights, sig.layouts, sig.quantized)
        missing = [n for n in (*sig.frozen, *sig.trainable) if n not in weights]
        if missing:
            raise KeyError(f"weights lack {', '.join(missing)}")
        put = self._put
        self.frozen = [put(weights[n]) for n in sig.frozen]
        self.trainable = [put(weights[n]) for n in sig.trainable]
        self.states = [put(np.full(shape, fill, dtype)) for shape, dtype, fill in sig.optim_states]
        self.step_seconds: list[float] = []  # each step's call of the compiled step (`planner run` checks them)

    def _put(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.asarray(array, order="C"), self.device)

    def step_args(self, x: Inputs, y: np.ndarray) -> list:
        inputs = [self._put(a) for a in step_inputs(self.sig, x)]
        return [*inputs, *self.frozen, *self.trainable, *self.states, self._put(y.astype(self.sig.target.dtype))]

    def step(self, x: Inputs, y: np.ndarray) -> float:
        """One training step on a full batch; returns its loss."""
        # set_input/invoke_stateful/get_output work alike on a local and an RPC device, where a
        # returned tuple cannot be indexed directly. The VM module's own set_input: the Python
        # wrapper's type dispatch over every argument (~270 for MobileNetV2, each already a
        # Tensor) cost a tenth of a batch-1 step.
        self._set_input(STEP_FUNC, *self.step_args(x, y))
        if self.timed_invoke is not None:
            self.step_seconds.append(self.timed_invoke())
        else:
            start = time.perf_counter()
            self.vm.invoke_stateful(STEP_FUNC)
            faults.point("step")
            self.step_seconds.append(time.perf_counter() - start)
        # The step's flat tuple read field by field: the VM's `get_outputs` builds a recursive
        # closure over the VM each call, a reference cycle that keeps it, and over RPC the board's
        # session, alive until a garbage collection (the next trial's board request waited for
        # the session's timeout). Its fields: the loss, each trainable weight, each optimizer state.
        n = len(self.trainable)
        out = [self._output(STEP_FUNC, i) for i in range(1 + n + len(self.states))]
        self.trainable = list(out[1 : 1 + n])
        self.states = list(out[1 + n :])
        return float(out[0].numpy()) / self.sig.loss_scale

    def outputs(self, x: Inputs) -> np.ndarray:
        """The model's outputs for any number of samples (the compiled batch is padded for the last
        chunk). A model whose output is its batch's loss gives each sample its micro-batch's loss,
        a short last micro-batch filled with the chunk's first samples (not one sample repeated)."""
        B, batched = self.sig.micro_batch, self.sig.batched_output
        arrays = step_inputs(self.sig, x)
        chunks = []
        for i in range(0, len(arrays[0]), B):
            parts = [a[i : i + B] for a in arrays]
            pad = B - len(parts[0])
            parts = padded(parts, arrays, B, batched)
            out = self.vm[PREDICT_FUNC](*map(self._put, parts), *self.frozen, *self.trainable).numpy()
            chunks.append(out[: B - pad] if batched else np.full(B - pad, float(out), np.float32))
        return np.concatenate(chunks) if chunks else np.zeros((0, *self.sig.output_shape), "float32")

    def evaluate(self, x: Inputs, y: np.ndarray) -> tuple[float, float]:
        """(mean loss, the task's metric) on a set with its targets."""
        return self.evaluate_chunks([(x, y)])

    def evaluate_chunks(self, chunks: Iterable[tuple[Inputs, np.ndarray]]) -> tuple[float, float]:
        """(mean loss, the task's metric) over chunks: a set too large to hold at once."""
        return score(self.sig.task, self.outputs, chunks)

    def resident_bytes(self) -> int:
        """Bytes of what the step holds between steps (weights, optimizer state) and of one
        batch of its inputs and labels, from their shapes."""
        held = sum(int(np.prod(t.shape)) * np.dtype(str(t.dtype)).itemsize for t in (*self.frozen, *self.trainable, *self.states))
        inputs = sum(int(np.prod(i.static)) * np.dtype(i.dtype).itemsize for i in self.sig.inputs)
        target = int(np.prod(self.sig.target.static)) * np.dtype(self.sig.target.dtype).itemsize
        return held + self.sig.batch_size * (inputs + target)

    def weights(self) -> dict[str, np.ndarray]:
        """All weights by ONNX initializer name (trainable ones as updated so far)."""
        names = (*self.sig.frozen, *self.sig.trainable)
        parts = {n: t.numpy() for n, t in zip(names, (*self.frozen, *self.trainable))}
        return from_step(parts, self.sig.layouts, self.sig.quantized)
