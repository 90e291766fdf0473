"""What planner's gradients share: reading static shapes and integer arguments off Relax calls."""

from __future__ import annotations

from collections.abc import Callable

from tvm import relax

# op -> (planner's gradient, whether it replaces TVM's own): the others fill gaps in TVM 0.27 and
# leave a gradient a later TVM has alone.
Gradients = dict[str, tuple[Callable, bool]]


def dims(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape]


def ints(expr: relax.Expr) -> list[int]:
    """The integers of an argument (a tuple of PrimValues or a shape)."""
    items = expr.fields if isinstance(expr, relax.Tuple) else expr.values
    return [int(getattr(v, "value", v)) for v in items]


def is_float(expr: relax.Expr) -> bool:
    return str(expr.ty.dtype).startswith(("float", "bfloat"))
