"""erf and exp as TVM's fast polynomials, and tanh through exp, so that a kernel's erfs, tanhs and
vectorised exps run as vectors: LLVM lowers each to a libm call per lane. `default_schedule`
(`schedule`) runs `_vector_erf_tanh` before its schedule rule and `_vector_exp` after it. They are apart from the rule:
rewrites of the expressions a kernel computes, not of how its loops run.
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import te, tirx, topi

_ERF = tvm.ir.Op.get("tirx.erf")
_EXP = tvm.ir.Op.get("tirx.exp")
_TANH = tvm.ir.Op.get("tirx.tanh")
_FLOOR = tvm.ir.Op.get("tirx.floor")
_TENSOR_LOAD = tvm.ir.Op.get("te.tensor_load")


@functools.cache
def _fast(op: tvm.ir.Op) -> tirx.PrimExpr:
    """TVM's vectorisable float32 form of `op` (topi's `fast_erf`, a rational polynomial within
    5e-7 of libm's, or `fast_exp`, Cephes' range reduction and polynomial, within 7e-7 relative
    for |x| < 20 and 2e-6 near the end of float32's range) of one
    placeholder element, which it loads with `te.tensor_load`; its `floor` as truncation less
    one where that rounded up, since SSE2 (x86-64's baseline, the generic `llvm` target) has no
    vector floor and LLVM called libm's `floorf` lane by lane. Made once per op for the process:
    it is asked for erf and exp only, so its unbounded cache holds two."""
    fast = topi.fast_erf if op.same_as(_ERF) else topi.fast_exp

    def floor(call: tvm.ir.Call) -> tirx.PrimExpr:
        if not call.op.same_as(_FLOOR):
            return call
        (y,) = call.args
        t = tirx.Cast("float32", tirx.Cast("int32", y))
        return tirx.Select(t > y, t - tirx.const(1.0, "float32"), t)

    return tvm_ffi.structural_map(fast(te.placeholder((1,), "float32", "x")).op.body[0], (tvm.ir.Call, floor))


def _calls_to_fast(expr, ops: tuple[tvm.ir.Op, ...]):
    """`expr` with every float32 call of one of `ops` computed by its `_fast` form."""

    def fast(call: tvm.ir.Call) -> tirx.PrimExpr:
        op = next((o for o in ops if call.op.same_as(o)), None)
        if op is None or str(call.ty) != "float32":
            return call
        (x,) = call.args
        if op.same_as(_TANH):
            return _tanh(x)
        return tvm_ffi.structural_map(_fast(op), (tvm.ir.Call, lambda c: x if c.op.same_as(_TENSOR_LOAD) else c))

    return tvm_ffi.structural_map(expr, (tvm.ir.Call, fast))


def _tanh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """tanh(x) = 2 / (1 + exp(-2x)) - 1: ±1 at either end of float32's range (exp's overflow to
    infinity included), within 1e-7 of libm's `tanhf` absolutely, its `exp` vectorised where the
    loop is (`_vector_exp`), and `x` read once — a recurrent cell's kernels hold a tanh of a tanh
    of ..., and a form reading it twice grew exponentially (a GRU's compile never ended). Not
    topi's `fast_tanh`: its rational polynomial carries constants that TVM's C code generator
    prints alike (`planner.backend.mcu.ckernels` refuses such a kernel)."""
    one, two = tirx.const(1.0, "float32"), tirx.const(2.0, "float32")
    return two / (one + tirx.exp(-two * x)) - one


def _calls(func: tirx.PrimFunc, op: tvm.ir.Op) -> bool:
    found: list[tvm.ir.Call] = []
    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, lambda c: found.append(c) if c.op.same_as(op) else None)])
    return any(str(c.ty) == "float32" for c in found)


def _vector_erf_tanh(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tirx.PrimFunc:
    """`func` with every float32 `erf` and `tanh` computed by its `_fast` form.

    Why: TVM lowers `erf` to libm's scalar `erff`, so a vectorised GELU, or its gradient, calls
    it lane by lane: a BERT encoder's GELU kernels ran at 0.6-0.9 GFLOP/s, a quarter of its step
    once its products went through OpenBLAS; with the polynomial, 13-18x faster. `tanh` likewise
    (`tanhf`): GPT-2's tanh-GELU."""
    found = tuple(op for op in (_ERF, _TANH) if _calls(func, op))
    return func.with_body(_calls_to_fast(func.body, found)) if found else func


def _vector_exp(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tirx.PrimFunc:
    """`func` with every float32 `exp` inside a vectorised loop computed by its `_fast` form.

    Why: LLVM has no vector `exp` without a vector math library, so it splits one into a libm
    `expf` call per lane; the polynomial vectorises. Only inside vectorised loops: a scalar
    polynomial ran slower than libm's `expf` (a softmax's scalar row sums, 1.4x)."""
    if not _calls(func, _EXP):
        return func

    def loop(node: tirx.For) -> tirx.For:
        if node.kind != tirx.ForKind.VECTORIZED:
            return node
        body = _calls_to_fast(node.body, (_EXP,))
        return tirx.For(node.loop_var, node.min, node.extent, node.kind, body, node.thread_binding, node.annotations)

    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, loop)))
