"""What an update mode is: the interface every mode implements, and the plain data it leaves in a step.

A mode says how one layer trains. Everything planner does with a layer's mode goes through this
interface, so that a new mode is one module and one registration (`planner.modes.MODES`): which
parameters it updates, which layers it fits, the number it carries (a ratio, a rank) and how a
search space draws it, how it reads in a report, and — for a mode that changes how a step takes
its weight — the weight's stored parts, how they are made from the weight and merged back
(numpy), and how the step rebuilds the weight from them (Relax).

No TVM here: the back end hands a mode Relax's operators (`tvm.relax.op`) when it builds a step,
so reading a plan or a search space never loads a compiler.
"""

from __future__ import annotations

import math
from abc import ABC
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np


class LayerLike(Protocol):
    """The part of `planner.inputs.model.Layer` a mode reads."""

    @property
    def name(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def weight(self) -> str | None: ...
    @property
    def bias(self) -> str | None: ...
    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...
    @property
    def out_axis(self) -> int | None: ...  # the weight's output-channel axis (Conv, Gemm, MatMul)


def _number(value: float) -> str:
    """A mode's number as text: a whole number as it is (`4`, never `4.0` or `1e+06`), a share
    in its shortest form (`0.25`)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class Argument:
    """The one number a mode carries (`ratio:0.25`, `lora:4`): its name in schemes, plans and
    Optuna parameters (`ratio`), the list a search space draws it from (`ratios`, default
    `defaults`), its type, and its bounds as text and as a check."""

    name: str
    plural: str
    type: type[int] | type[float]
    defaults: tuple[float, ...]
    bounds: str  # "in (0, 1]", "a whole number from 1"
    valid: Callable[[float], bool]

    def parse(self, value: object) -> int | float:
        """`value` (a number, or its text) as this argument's type, or ValueError naming the bounds."""
        number = math.nan
        if isinstance(value, int | float | str) and not isinstance(value, bool):
            try:
                number = float(value)
            except ValueError:
                pass
        if not math.isfinite(number) or (self.type is int and not number.is_integer()) or not self.valid(self.type(number)):
            raise ValueError(f"{self.name} must be {self.bounds} (not {value!r})")
        return self.type(number)


@dataclass(frozen=True)
class Layout:
    """How a step takes one weight its layer's mode reshapes: the mode, the weight's output-channel
    axis and a size the mode reads (channels trained, an adapter's rank). Plain data: a step's
    signature and plan.json keep it; the mode (`MODES[layout.mode]`) gives it behaviour."""

    mode: str
    axis: int
    size: int


@dataclass(frozen=True)
class Part:
    """One stored tensor a reshaped weight arrives as, and whether the step trains it."""

    name: str
    shape: tuple[int, ...]
    trainable: bool


class UpdateMode(ABC):
    """One way a layer trains. Subclasses set the class attributes and override what differs;
    the defaults describe a mode that updates some of a layer's parameters as they are stored."""

    name: ClassVar[str]
    description: ClassVar[str]  # what it updates, as `--help`, errors and the docs say it
    color: ClassVar[str]  # its colour in report.html's layer map
    argument: ClassVar[Argument | None] = None
    # The parts a reshaped weight is stored as (`{weight}@{suffix}`), and whether the weight
    # itself stays among the step's inputs (frozen) beside them.
    suffixes: ClassVar[tuple[str, ...]] = ()
    keeps_weight: ClassVar[bool] = True
    # Whether some of the weight's output channels stay frozen: on a classifier those are whole
    # classes that could not learn the new task, so `depths` trains its last layer in full instead.
    freezes_outputs: ClassVar[bool] = False

    def params(self, layer: LayerLike) -> tuple[str, ...]:
        """The parameters (ONNX initializer names) a layer in this mode updates."""
        return ()

    def refuses(self, layer: LayerLike, value: float | None) -> str | None:
        """Why `layer` cannot train in this mode (with `value`), or None when it can."""
        return None if self.params(layer) else f"layer '{layer.name}' ({layer.op}) has no parameters for mode {self.name}"

    def choices(self, layer: LayerLike, values: Sequence[float]) -> list[float]:
        """Of a search space's `values` for the argument, those `layer` takes."""
        return [v for v in values if self.refuses(layer, v) is None]

    def text(self, value: float | None) -> str:
        """How plans, trial records and cache keys write the mode (`ratio:0.25`, `lora:4`)."""
        return self.name if value is None else f"{self.name}:{_number(value)}"

    def label(self, value: float | None) -> str:
        """How a report reads it (`ratio 0.25`)."""
        return self.name if value is None else f"{self.name} {_number(value)}"

    # How a step stores the weight: only modes that reshape it override these.

    def layout(self, layer: LayerLike, value: float | None) -> Layout | None:
        """How a step takes `layer`'s weight in this mode: None when as it is."""
        return None

    def parts(self, layout: Layout, weight: str, shape: Sequence[int]) -> list[Part]:
        """The tensors the weight arrives as, besides itself when `keeps_weight`."""
        raise NotImplementedError(f"mode {self.name} does not reshape weights")

    def to_step(self, layout: Layout, weight: str, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The weight's parts from `weights` (the initializers, parts a run brought back kept)."""
        raise NotImplementedError(f"mode {self.name} does not reshape weights")

    def from_step(self, layout: Layout, weight: str, parts: Mapping[str, np.ndarray]) -> np.ndarray:
        """The weight (its ONNX initializer) from its parts, as a fine-tuned model keeps it."""
        raise NotImplementedError(f"mode {self.name} does not reshape weights")

    def rebuild(
        self, layout: Layout, op: Any, weight: Callable[[], Any] | None, parts: Mapping[str, Any], shape: Sequence[int]
    ) -> Any:
        """The weight as a Relax expression, from its parts' variables (`parts`, by suffix) and, when
        the mode `keeps_weight`, `weight()`, the stored weight's expression; `op` is `tvm.relax.op`."""
        raise NotImplementedError(f"mode {self.name} does not reshape weights")
