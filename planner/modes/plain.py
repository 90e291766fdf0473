"""The modes that update a layer's parameters as they are stored: none, its bias, its weight, or both."""

from __future__ import annotations

from planner.modes._base import LayerLike, UpdateMode


class Frozen(UpdateMode):
    name = "frozen"
    description = "nothing trains"
    color = "#e5e5e5"

    def refuses(self, layer: LayerLike, value: float | None) -> str | None:
        return None


class Bias(UpdateMode):
    name = "bias"
    description = "the bias only (TinyTL)"
    color = "#9ecae1"

    def params(self, layer: LayerLike) -> tuple[str, ...]:
        return (layer.bias,) if layer.bias else ()


class Weight(UpdateMode):
    name = "weight"
    description = "the weight only"
    color = "#6baed6"

    def params(self, layer: LayerLike) -> tuple[str, ...]:
        return (layer.weight,) if layer.weight else ()


class Full(UpdateMode):
    name = "full"
    description = "weight and bias"
    color = "#1f77b4"

    def params(self, layer: LayerLike) -> tuple[str, ...]:
        return tuple(p for p in (layer.weight, layer.bias) if p)
