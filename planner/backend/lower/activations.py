"""Elementwise kernels that write their result over an activation nothing reads afterwards.

Why: where a convolution is an im2col + sgemm kernel (`kernels: openblas` or `portable`), what
TVM fuses after it (bias, BatchNorm, ReLU6) is a kernel of its own, and a functional step gives its
result a fresh buffer while the convolution's output is still alive: two maps of the same size at
once. On MobileNetV2-w0.35 at 96x96 that is an expanded 48x48 map of 48 channels twice, 884 KB
where 442 KB do, the difference between a microcontroller's SRAM and none. The same holds in the
backward pass (a ReLU's gradient over the incoming gradient).

So, in the step and in the prediction, a call whose kernel is elementwise over one of its inputs
(`inplace._elementwise_over`, judged before scheduling) becomes a `call_tir_inplace` over that
input when the input is a tensor the function made itself — not a parameter, not a view of another
tensor — and nothing after the call reads it, itself or through a view. Memory planning then
gives the two one buffer.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from planner.backend.graph.tir import in_place_kernel
from planner.backend.lower.inplace import _elementwise_over, _is_call_tir, _reads, _safe
from planner.runtime.convention import PREDICT_FUNC, STEP_FUNC

FUNCTIONS = (STEP_FUNC, PREDICT_FUNC)
Candidates = set[tuple[str, int]]  # (kernel, the input its output may overwrite)


def _calls(mod: tvm.IRModule, name: str):
    """The bindings of function `name`'s one dataflow block (none for another shape of function)."""
    func = mod[name] if name in [gv.name_hint for gv in mod.get_global_vars()] else None
    if not isinstance(func, relax.Function) or len(func.body.blocks) != 1:
        return []
    return list(func.body.blocks[0].bindings)


def candidates(fused: tvm.IRModule) -> Candidates:
    """`(kernel, input)` of the calls whose single output may be written over that input, judged
    on the fused, not yet scheduled module (each stage still a block of its own)."""
    found: Candidates = set()
    for name in FUNCTIONS:
        for b in _calls(fused, name):
            call = b.value
            if not _is_call_tir(call) or not isinstance(call.ty, relax.TensorType):
                continue
            args = list(call.args[1].fields)
            kernel = call.args[0].name_hint
            for i, arg in enumerate(args):
                same = isinstance(arg, relax.Var) and isinstance(arg.ty, relax.TensorType) and _same_type(arg.ty, call.ty)
                if same and (kernel, i) not in found and _elementwise_over(fused[kernel], i, len(args)):
                    found.add((kernel, i))
    return found


def _same_type(a: relax.TensorType, b: relax.TensorType) -> bool:
    return a.dtype == b.dtype and a.shape is not None and b.shape is not None and tvm_ffi.structural_equal(a.shape, b.shape)


def in_place(mod: tvm.IRModule, found: Candidates) -> tuple[tvm.IRModule, int]:
    """The scheduled module `mod` with each of `found`'s calls written over its input where that
    input dies at the call; also how many calls were."""
    builder = relax.BlockBuilder(mod)
    kernels: dict[tuple[str, int], relax.GlobalVar] = {}
    rewritten: dict[str, relax.Function] = {}
    done = 0
    for name in FUNCTIONS:
        bindings = _calls(mod, name)
        func = mod[name] if bindings else None
        if func is None:
            continue
        reads = _reads(mod, bindings)
        # tensors of the function's own: another kernel's fresh output, not a view of another tensor,
        # not a value updated in place (its buffer is a parameter's), not returned
        own = {b.var for b in bindings if _is_call_tir(b.value) and not _is_view(mod, b.value)}
        own -= set(relax.analysis.free_vars(func.body.body))
        last: dict[relax.Var, int] = {}  # a tensor -> the last binding that reads it (a view's reads count)
        for j, b in enumerate(bindings):
            for v in reads(b):
                last[v] = j
        order, count = list(bindings), 0
        for j, b in enumerate(bindings):
            call = b.value
            if not _is_call_tir(call) or not isinstance(call.ty, relax.TensorType):
                continue
            args = list(call.args[1].fields)
            kernel = call.args[0].name_hint
            i = next(
                (i for i, a in enumerate(args) if (kernel, i) in found and a in own and last.get(a) == j and args.count(a) == 1),
                None,
            )
            if i is None:
                continue
            if (kernel, i) not in kernels:
                kernels[kernel, i] = builder.add_func(in_place_kernel(mod[kernel], {0: i}, len(args)), f"{kernel}_over{i}")
            new = builder.normalize(relax.op.call_tir_inplace(kernels[kernel, i], call.args[1], [i], call.ty))
            order[j] = relax.VarBinding(b.var, new)
            count += 1
        if count and _safe(order, func.params, reads):
            block = relax.DataflowBlock(order)
            rewritten[name] = relax.Function(
                func.params, relax.SeqExpr([block], func.body.body), func.ret_ty, func.is_pure, func.attrs
            )
            done += count
    if not rewritten:
        return mod, 0
    out = builder.get()
    for name, func in rewritten.items():
        out[name] = func
    return out, done


def _is_view(mod: tvm.IRModule, value: relax.Expr) -> bool:
    """A kernel that only reshapes its one input: lowering makes it a view of the input's buffer."""
    return _is_call_tir(value) and len(value.args[1].fields) == 1 and relax.analysis.has_reshape_pattern(mod[value.args[0]])
