"""Values computed from weights alone, computed once per step rather than once per element.

Why: TVM's fusion puts a cheap producer inside its consumer's loop. When the producer is small and
the consumer large — a BatchNorm's per-channel factor `gamma / sqrt(var + eps)` feeding the
per-element `x * factor + shift` — the producer is computed again for every element of the
consumer: a square root and a division per activation, where one per channel does. On a
microcontroller's MobileNetV2-w0.35 at 128x128 those BatchNorm kernels were a quarter of the
step's instructions (19 per element).

So, between TVM's pattern annotation and its fusion: the kernels computed from weights alone
(from parameters that are not the model's inputs — weights, optimizer state, the learning rate)
are fused among themselves first, with every other kernel held out; then each such fused kernel
that does arithmetic and whose result reaches only kernels at least `_WIDER` times its size is
marked opaque, so
the second fusion leaves it a kernel of its own: its result, a few hundred floats, is computed
once and read by the large kernel. Pure layout (a reshape, an expand_dims) still fuses: reading
through it costs nothing.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import relax, tirx

_OPAQUE = 8  # TVM's OpPatternKind::kOpaque: fusion leaves the kernel alone
_WIDER = 8  # a consumer this many times larger recomputes the producer per element
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_ARITHMETIC = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Min, tirx.Max, tvm.ir.Call)


def fuse(mod: tvm.IRModule, n_inputs: int) -> tvm.IRModule:
    """`mod` (legalized, patterns annotated) fused as TVM's FuseOps and FuseTIR fuse it, except
    that weight-only values feeding much larger kernels are kernels of their own (module
    docstring). `n_inputs`: the model inputs every function of `mod` takes first."""
    fusion = tvm.transform.Sequential([relax.transform.FuseOps(), relax.transform.FuseTIR()])
    if not _widened(mod, n_inputs):
        return fusion(mod)
    held = {gv: mod[gv].attrs["op_pattern"] for gv in _calls(mod, n_inputs, weight_only=False)}
    for gv in held:
        mod[gv] = mod[gv].with_attr("op_pattern", _OPAQUE)
    mod = fusion(mod)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    for gv, pattern in held.items():
        if gv.name_hint in names:
            mod[gv] = mod[gv].with_attr("op_pattern", pattern)
    mod = relax.transform.AnnotateTIROpPattern()(mod)
    for gv in _widened(mod, n_inputs):
        mod[gv] = mod[gv].with_attr("op_pattern", _OPAQUE)
    return fusion(mod)


def _functions(mod: tvm.IRModule) -> list[relax.Function]:
    """The Relax functions of `mod` with one dataflow block (a step, a prediction)."""
    return [f for _, f in mod.functions_items() if isinstance(f, relax.Function) and len(f.body.blocks) == 1]


def _weight_only(func: relax.Function, n_inputs: int) -> set[relax.Var]:
    """The variables of `func` computed from no model input (parameters after the first `n_inputs`)."""
    only = set(func.params[n_inputs:])
    for b in func.body.blocks[0].bindings:
        used = relax.analysis.free_vars(b.value)
        if used and all(v in only for v in used):
            only.add(b.var)
    return only


def _calls(mod: tvm.IRModule, n_inputs: int, *, weight_only: bool) -> set[tvm.ir.GlobalVar]:
    """The kernels called by bindings that are (or, with `weight_only=False`, are not) weight-only."""
    out = set()
    for func in _functions(mod):
        only = _weight_only(func, n_inputs)
        for b in func.body.blocks[0].bindings:
            if isinstance(b.value, relax.Call) and b.value.op.same_as(_CALL_TIR) and (b.var in only) == weight_only:
                out.add(b.value.args[0])
    return out


def _widened(mod: tvm.IRModule, n_inputs: int) -> set[tvm.ir.GlobalVar]:
    """The kernels of weight-only bindings that compute (not only move) values and whose result
    reaches only activations' kernels at least `_WIDER` times larger, directly or through other
    weight-only values; none whose kernel an activation's call shares (marking it would stop that
    call's fusion too)."""
    shared = _calls(mod, n_inputs, weight_only=False)
    out = set()
    for func in _functions(mod):
        only = _weight_only(func, n_inputs)
        readers: dict[relax.Var, list[relax.Var]] = {}
        for b in func.body.blocks[0].bindings:
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, []).append(b.var)

        def reached(var: relax.Var) -> set[relax.Var]:
            """The activations' bindings `var` is read by, through weight-only ones."""
            found, todo, seen = set(), [var], {var}
            while todo:
                for r in readers.get(todo.pop(), []):
                    if r in only and r not in seen:
                        seen.add(r)
                        todo.append(r)
                    elif r not in only:
                        found.add(r)
            return found

        for b in func.body.blocks[0].bindings:
            if not (b.var in only and isinstance(b.value, relax.Call) and b.value.op.same_as(_CALL_TIR)):
                continue
            gv, size, ends = b.value.args[0], _elements(b.var), reached(b.var)
            if gv in shared or not ends or size is None:
                continue
            if all((_elements(r) or 0) >= _WIDER * size for r in ends) and _computes(mod[gv]):
                out.add(gv)
    return out


def _elements(var: relax.Var) -> int | None:
    """The elements of a tensor variable of static shape, else None."""
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values if isinstance(ty.shape, relax.ShapeExpr) else ty.shape
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return math.prod(int(d) for d in dims)


def _computes(func: tirx.PrimFunc) -> bool:
    """Whether a kernel's stored values involve arithmetic (a reshape's index arithmetic aside)."""
    found = []
    tvm_ffi.structural_walk(func.body, [(tirx.BufferStore, lambda store: found.append(_arithmetic(store.value)))], order="post")
    return any(found)


def _arithmetic(expr: tirx.PrimExpr) -> bool:
    if isinstance(expr, _ARITHMETIC):
        return True
    if isinstance(expr, tirx.Cast):
        return _arithmetic(expr.value)
    return False
