"""`ratio:R`: the first R·C output channels of a layer's weight train, and all of its bias.

The sparse update of TinyEngine (Lin et al., "On-Device Training Under 256KB Memory", 2022): the
weight arrives as two tensors, its trainable head (the first k = round(R·C) output channels) and
its frozen tail, concatenated where the step uses it, so only the head gets a gradient and
optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from planner.modes._base import Argument, LayerLike, Layout, Part, UpdateMode


def head(weight: str) -> str:
    """The trainable first channels of a ratio-updated weight."""
    return f"{weight}@head"


def tail(weight: str) -> str:
    """The frozen remaining channels of a ratio-updated weight."""
    return f"{weight}@tail"


class Ratio(UpdateMode):
    name = "ratio"
    description = "a share of the weight's output channels (the first ones) and the bias"
    color = "#31a354"
    argument = Argument("ratio", "ratios", float, (0.125, 0.25, 0.5), "in (0, 1]", lambda r: 0 < r <= 1)
    suffixes = ("head", "tail")
    keeps_weight = False
    freezes_outputs = True

    def params(self, layer: LayerLike) -> tuple[str, ...]:
        return tuple(p for p in (layer.weight, layer.bias) if p)

    def refuses(self, layer: LayerLike, value: float | None) -> str | None:
        if layer.weight is None or layer.out_axis is None:
            return f"ratio updates need a Conv, Gemm or MatMul weight; layer '{layer.name}' is {layer.op}"
        return None

    def layout(self, layer: LayerLike, value: float | None) -> Layout | None:
        assert layer.weight is not None and layer.out_axis is not None and value is not None
        channels = layer.param_shapes[layer.weight][layer.out_axis]
        k = max(1, min(channels, round(value * channels)))
        return Layout(self.name, layer.out_axis, k) if k < channels else None  # every channel: as it is

    def _shapes(self, layout: Layout, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        first, rest = list(shape), list(shape)
        first[layout.axis], rest[layout.axis] = layout.size, shape[layout.axis] - layout.size
        return tuple(first), tuple(rest)

    def parts(self, layout: Layout, weight: str, shape: Sequence[int]) -> list[Part]:
        first, rest = self._shapes(layout, shape)
        return [Part(head(weight), first, True), Part(tail(weight), rest, False)]

    def to_step(self, layout: Layout, weight: str, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        first, rest = np.split(weights[weight], [layout.size], axis=layout.axis)
        return {head(weight): first, tail(weight): rest}

    def from_step(self, layout: Layout, weight: str, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([parts[head(weight)], parts[tail(weight)]], axis=layout.axis)

    def rebuild(
        self, layout: Layout, op: Any, weight: Callable[[], Any] | None, parts: Mapping[str, Any], shape: Sequence[int]
    ) -> Any:
        return op.concat([parts["head"], parts["tail"]], axis=layout.axis)
