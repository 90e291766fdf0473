"""The operator table's types: a row (`Operator`), a lesser form of it (`Form`), and the node a
form is told apart by (`Node`)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx


class Support(enum.Enum):
    TRAINS = "trains"
    FROZEN = "frozen only"
    REFUSED = "refused"


@dataclass(frozen=True)
class Node:
    """An ONNX node with what the analysis knows around it: the values of constant tensors and
    the rank of every tensor shape inference could type (a form is told apart by these)."""

    proto: onnx.NodeProto
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)
    ranks: Mapping[str, int] = field(default_factory=dict)

    def attr(self, name: str, default=None):
        for a in self.proto.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def const(self, slot: int) -> np.ndarray | None:
        """The value of input `slot` when it is a constant (None when absent or computed)."""
        if slot >= len(self.proto.input) or not self.proto.input[slot]:
            return None
        return self.constants.get(self.proto.input[slot])

    def rank(self, slot: int) -> int | None:
        if slot >= len(self.proto.input):
            return None
        return self.ranks.get(self.proto.input[slot])

    def text(self, name: str, default: str) -> str:
        value = self.attr(name, default)
        return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Form:
    """An attribute form of an operator whose support is less than the operator's."""

    support: Support
    what: str  # the form, as docs and `inspect` name it: "a 3-D convolution"
    why: str  # why it is not supported further
    applies: Callable[[Node], bool]


@dataclass(frozen=True)
class Operator:
    """One row of the table."""

    name: str  # the ONNX op type
    support: Support
    what: str  # what PyTorch writes it for (docs)
    # the inputs a gradient flows into (None: every input; integer and boolean inputs never carry one)
    grads: tuple[int, ...] | None = None
    # the inputs that are a layer's weight and bias when they hold parameters (a convolution's 1 and 2)
    layer: tuple[int | None, int | None] | None = None
    forms: tuple[Form, ...] = ()
    why: str = ""  # for a frozen-only or refused operator: why
    folded: bool = False  # computed once at import, from shapes and constants (it never reaches TVM)
    # a step function: its gradient is zero wherever it exists (as PyTorch's), so a path through it
    # teaches what is before it nothing — and blocks nothing
    zero_gradient: bool = False
    # its gradient is not its derivative but the straight-through estimator PyTorch's fake
    # quantization has: proven against PyTorch's autograd, not by finite differences
    straight_through: bool = False
    section: str = ""  # set by the table: where docs list it

    def passes_to(self, slot: int) -> bool:
        return self.grads is None or slot in self.grads

    def limits(self) -> list[str]:
        """What the row says beyond its support: why not further, each lesser form, which inputs a gradient reaches."""
        out = [self.why] if self.why else []
        if self.zero_gradient:
            out.append(
                "its gradient is zero wherever it exists, as PyTorch's: a path through it teaches nothing and blocks nothing"
            )
        out += [f"{f.what}: {f.support.value} ({f.why})" for f in self.forms]
        if self.grads is not None and self.support is Support.TRAINS:
            out.append(f"gradient to input{'s' if len(self.grads) > 1 else ''} {', '.join(map(str, self.grads))} only")
        return out

    def to_json(self) -> dict:
        return {
            "operator": self.name,
            "support": self.support.value,
            "section": self.section,
            "pytorch": self.what,
            "limits": self.limits(),
        }
