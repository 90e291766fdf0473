"""`lora:R`: a rank-R adapter beside the layer's frozen weight (Hu et al., "LoRA", 2021).

The weight arrives frozen (fp32, or int8 with `frozen_weights: int8`) with two small trainable
factors, B (output channels × R, zero at first) and A (R × the rest, uniform ±1/√fan-in, seeded by
the weight's name), and W + B·A is formed where the step uses it (α = R: the product is added
unscaled), so the gradient reaches the factors only. Back from a step, B·A is merged into W: a
fine-tuned model has the original graph and initializers.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from planner.modes._base import Argument, LayerLike, Layout, Part, UpdateMode


def max_rank(layer: LayerLike) -> int:
    """The largest rank a layer's weight takes: min(output channels, the rest), 0 for a layer
    without a Conv, Gemm or 2-D MatMul weight (a rank beyond it is no low-rank update)."""
    if layer.weight is None or layer.out_axis is None:
        return 0
    shape = layer.param_shapes[layer.weight]
    if len(shape) != 2 and layer.out_axis != 0:
        return 0
    return min(shape[layer.out_axis], math.prod(d for i, d in enumerate(shape) if i != layer.out_axis))


def adapter_shapes(shape: Sequence[int], axis: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(B's shape, A's shape) of a rank-`rank` adapter for a weight of `shape`, output channels on `axis`."""
    rest = int(np.prod([d for i, d in enumerate(shape) if i != axis]))
    return (int(shape[axis]), rank), (rank, rest)


def adapter_delta(b: np.ndarray, a: np.ndarray, shape: Sequence[int], axis: int) -> np.ndarray:
    """B·A laid out as the weight: the output-channel axis back where it was."""
    others = [d for i, d in enumerate(shape) if i != axis]
    return np.moveaxis((b @ a).reshape(shape[axis], *others), 0, axis)


def initial_adapter(name: str, shape: Sequence[int], axis: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """LoRA's start: B zero (the model unchanged), A uniform in ±1/√fan-in as PyTorch (and PEFT)
    initialise it, seeded by the weight's name, so every run of a plan starts alike."""
    b_shape, a_shape = adapter_shapes(shape, axis, rank)
    bound = 1.0 / np.sqrt(a_shape[1])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return np.zeros(b_shape, np.float32), rng.uniform(-bound, bound, a_shape).astype(np.float32)


def lora_a(weight: str) -> str:
    """An adapter's second factor, R × the weight's other dimensions (random at the start)."""
    return f"{weight}@lora_a"


def lora_b(weight: str) -> str:
    """An adapter's first factor, output channels × R (zero at the start)."""
    return f"{weight}@lora_b"


class Lora(UpdateMode):
    name = "lora"
    description = "a low-rank adapter beside the frozen weight, merged into it by `planner run`"
    color = "#e6550d"
    argument = Argument("rank", "ranks", int, (4, 8), "a whole number from 1", lambda r: r >= 1)
    suffixes = ("lora_a", "lora_b")
    keeps_weight = True

    def params(self, layer: LayerLike) -> tuple[str, ...]:
        return (layer.weight,) if layer.weight else ()

    def refuses(self, layer: LayerLike, value: float | None) -> str | None:
        if layer.weight is None or layer.out_axis is None:
            return f"lora updates need a Conv, Gemm or MatMul layer; '{layer.name}' is {layer.op}"
        if value is not None and value > max_rank(layer):
            return (
                f"layer '{layer.name}' ({layer.op}, weight {list(layer.param_shapes[layer.weight])}) takes "
                f"LoRA adapters up to rank {max_rank(layer)}, not {value}"
            )
        return None

    def label(self, value: float | None) -> str:
        return f"lora rank {value}"

    def layout(self, layer: LayerLike, value: float | None) -> Layout | None:
        assert layer.out_axis is not None and value is not None
        return Layout(self.name, layer.out_axis, int(value))

    def parts(self, layout: Layout, weight: str, shape: Sequence[int]) -> list[Part]:
        b_shape, a_shape = adapter_shapes(shape, layout.axis, layout.size)
        return [Part(lora_a(weight), a_shape, True), Part(lora_b(weight), b_shape, True)]

    def to_step(self, layout: Layout, weight: str, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        w = weights[weight]
        if lora_a(weight) in weights:  # a run's adapters, brought back
            return {weight: w, lora_a(weight): weights[lora_a(weight)], lora_b(weight): weights[lora_b(weight)]}
        b, a = initial_adapter(weight, w.shape, layout.axis, layout.size)
        return {weight: w, lora_b(weight): b, lora_a(weight): a}

    def from_step(self, layout: Layout, weight: str, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        w = parts[weight]
        return (w + adapter_delta(parts[lora_b(weight)], parts[lora_a(weight)], w.shape, layout.axis)).astype(w.dtype)

    def rebuild(
        self, layout: Layout, op: Any, weight: Callable[[], Any] | None, parts: Mapping[str, Any], shape: Sequence[int]
    ) -> Any:
        assert weight is not None, "an adapter is added to its weight"
        others = [d for i, d in enumerate(shape) if i != layout.axis]
        product = op.reshape(op.matmul(parts["lora_b"], parts["lora_a"]), [shape[layout.axis], *others])
        if layout.axis != 0:
            order = list(range(1, len(shape)))
            order.insert(layout.axis, 0)
            product = op.permute_dims(product, order)
        return weight() + product
