"""Low-rank adapters applied as two thin products, never merged into their weight.

A LoRA layer's weight is rebuilt where the step uses it as `W + B·A` (`planner.modes.lora`), and a
matrix product of an activation by it, `x (W + B·A)`, then computes the merged `[in, out]` weight
and, in the backward pass, its whole gradient `xᵀ dy` — a product as large as the layer's own —
only to reduce it to the factors' `dB = dW Aᵀ`, `dA = Bᵀ dW`. Written `x W + (x B) A` the step
computes the same value with two products of width R and gets the factors' gradients from
products of width R too: GPT-2-small with rank-8 adapters on its 48 projections spent 174 GFLOP
a step on the merged weights' gradients, a third of its matrix work (`benchmarks/causal_lm_step.py`).
PyTorch's PEFT applies adapters the same way.

`factored` rewrites every `matmul(x, M)` whose `M` is a 2-D weight plus a product of two 2-D
factors, through transposes (a Gemm's `transB`, a MatMul weight stored `[in, out]`) and
reshapes that keep the shape: `M = Pᵀ?(W + Q)` with `Q` the factors' product (transposed or not)
becomes `x Pᵀ?(W) + (x F) G`, `F G` being `Pᵀ?(Q)`. Anything else (a convolution's adapter, a
weight read other than by a product) keeps its merged weight.

The same holds of a `ratio:r` layer's weight, its trainable head and frozen tail concatenated
along the output channels (`planner.modes.ratio`): `x [H T]` is `[x H, x T]`, so the step never
builds the whole weight (MobileNetV2's classifier: 50 KiB in fp32 on a microcontroller, where the
head a quarter of it trains is 12.5) nor, backward, its whole gradient — only the head's.
"""

from __future__ import annotations

import tvm
from tvm import relax

_MATMUL = tvm.ir.Op.get("relax.matmul")
_ADD = tvm.ir.Op.get("relax.add")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_CONCAT = tvm.ir.Op.get("relax.concat")


def _shape(e: relax.Expr) -> list[int] | None:
    ty = e.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return [int(d) for d in ty.shape]
    except TypeError:
        return None


def _transposed(e: relax.Expr) -> relax.Expr:
    return relax.op.permute_dims(e, [1, 0])


def _matrix(e: relax.Expr) -> bool:
    shape = _shape(e)
    return shape is not None and len(shape) == 2


def _is_transpose(call: relax.Call) -> bool:
    axes = call.attrs.axes
    return _matrix(call) and axes is not None and [int(a) for a in axes] == [1, 0]


@relax.expr_functor.mutator
class _Factored(relax.PyExprMutator):
    def __init__(self) -> None:
        super().__init__()
        self.rewritten = 0

    def _value(self, e: relax.Expr) -> relax.Expr:
        while isinstance(e, relax.Var):
            bound = self.lookup_binding(e)
            if bound is None:
                return e
            e = bound
        return e

    def _product(self, e: relax.Expr) -> tuple[relax.Expr, relax.Expr] | None:
        """(F, G) with `e == F G`, both 2-D, or None."""
        v = self._value(e)
        if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op):
            return None
        if v.op.same_as(_MATMUL):
            f, g = v.args
            return (f, g) if _matrix(f) and _matrix(g) else None
        if v.op.same_as(_RESHAPE) and _shape(v) is not None and _shape(v) == _shape(v.args[0]):
            return self._product(v.args[0])
        if v.op.same_as(_PERMUTE) and _is_transpose(v):
            inner = self._product(v.args[0])
            return None if inner is None else (_transposed(inner[1]), _transposed(inner[0]))
        return None

    def _split(self, e: relax.Expr) -> tuple[relax.Expr, tuple[relax.Expr, relax.Expr]] | None:
        """(W', (F, G)) with `e == W' + F G`, or None."""
        v = self._value(e)
        if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op) or not _matrix(v):
            return None
        if v.op.same_as(_ADD):
            a, b = v.args
            if _shape(a) == _shape(v) and (found := self._product(b)) is not None:
                return a, found
            if _shape(b) == _shape(v) and (found := self._product(a)) is not None:
                return b, found
            return None
        if v.op.same_as(_PERMUTE) and _is_transpose(v):
            inner = self._split(v.args[0])
            if inner is None:
                return None
            base, (f, g) = inner
            return _transposed(base), (_transposed(g), _transposed(f))
        return None

    def _columns(self, e: relax.Expr) -> list[relax.Expr] | None:
        """The matrices `e` (2-D) concatenates along its columns (axis 1), through transposes, or None."""
        v = self._value(e)
        if not isinstance(v, relax.Call) or not isinstance(v.op, tvm.ir.Op) or not _matrix(v):
            return None
        if v.op.same_as(_CONCAT) and isinstance(v.args[0], relax.Tuple) and all(_matrix(f) for f in v.args[0].fields):
            return list(v.args[0].fields) if int(v.attrs.axis) % 2 == 1 else None
        if v.op.same_as(_PERMUTE) and _is_transpose(v):
            rows = self._rows(v.args[0])
            return None if rows is None else [_transposed(f) for f in rows]
        return None

    def _rows(self, e: relax.Expr) -> list[relax.Expr] | None:
        """The matrices `e` (2-D) concatenates along its rows (axis 0), or None."""
        v = self._value(e)
        if not isinstance(v, relax.Call) or not v.op.same_as(_CONCAT) or not isinstance(v.args[0], relax.Tuple):
            return None
        fields = list(v.args[0].fields)
        return fields if _matrix(v) and all(_matrix(f) for f in fields) and int(v.attrs.axis) % 2 == 0 else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(_MATMUL)):
            return call
        x, m = call.args
        if str(call.attrs.out_dtype) not in ("", "void", "None", str(call.ty.dtype)):
            return call  # a product accumulating in another type than it reads
        if (columns := self._columns(m)) is not None:  # `x [H T]` as `[x H, x T]`
            self.rewritten += 1
            return relax.op.concat([self.builder_.emit(relax.op.matmul(x, c)) for c in columns], axis=-1)
        found = self._split(m)
        if found is None:
            return call
        base, (f, g) = found
        self.rewritten += 1
        whole = self.builder_.emit(relax.op.matmul(x, base))
        thin = self.builder_.emit(relax.op.matmul(self.builder_.emit(relax.op.matmul(x, f)), g))
        return relax.op.add(whole, thin)


def factored(func: relax.Function) -> relax.Function:
    """`func` with every matrix product by an adapted weight applied as the weight's product plus
    the adapter's two thin ones, and by a ratio-split weight as its parts' products (see the
    module); the merged weights it no longer reads removed."""
    mutator = _Factored()
    out = mutator.visit_expr(func)
    return relax.analysis.remove_all_unused(out) if mutator.rewritten else func
