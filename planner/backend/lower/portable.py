"""A microcontroller's own kernels (`kernels: portable`), chosen before TVM lowers the step: frozen
int8 weights read where they lie, and depthwise convolutions through planner's C kernel.

Why: on a board the frozen weights are flash and everything the step makes is SRAM. A weight stored
int8 (`frozen_weights: int8`) arrives dequantized (`astype(q) * scale`, `planner.backend.graph.weights`),
and TVM would make that copy in SRAM before its convolution runs: MobileNetV2-w0.35's last 1x1
convolution's is 573 KB, most of the board's. Here each convolution of such a weight — dense (its
forward and its input gradient, `gemm_kernels`' int8 forms over `GEMM_S8`) or depthwise
(`planner_dwconv_s8`) — reads the int8 values and scales each as it reads it, the value the copy
held, so the step computes what it computed with the copy, without it.

TVM's depthwise convolution emitted as C took 25 instructions per multiply-accumulate on a Cortex-M4,
as many instructions a MobileNetV2 step as its dense convolutions; planner's (`runtime/dwconv.c`)
reads each channel's filter into registers once and unrolls a 3x3 filter's taps (tests/test_mcu.py
measures both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm import relax, te, tirx

from planner.backend.graph.weights import dequantized
from planner.backend.sgemm.gemm import Lowering, built, forward_conv, input_grad_conv
from planner.backend.sgemm.gemm_kernels import FLOPS, Limits, forward_kernel, input_grad_kernel
from planner.backend.sgemm.im2col import Conv

DWCONV, DWCONV_S8 = "planner_dwconv", "planner_dwconv_s8"  # runtime/dwconv.c
MAX_TAPS = 7  # the C kernel's largest filter side (its MAX_TAPS: 7x7)

_DENSE_S8 = {
    "relax.nn.conv2d": (forward_conv, functools.partial(forward_kernel, quantized=True), "conv2d_gemm_s8"),
    "relax.nn.conv2d_transpose": (
        input_grad_conv,
        functools.partial(input_grad_kernel, quantized=True),
        "conv2d_input_grad_gemm_s8",
    ),
}


def depthwise_conv(call: relax.Call) -> Conv | None:
    """The sizes of a `relax.nn.conv2d` the C kernel computes (NCHW, one filter per channel, float32,
    undilated, static, at most `MAX_TAPS` a side), as a `Conv` whose `c` and `o` are the channels;
    None for any other."""
    a = call.attrs
    x, w = call.args[0].ty, call.args[1].ty
    shapes = [x.shape, w.shape, call.ty.shape]
    if not (
        (a.data_layout, a.kernel_layout, a.out_layout or "NCHW") == ("NCHW", "OIHW", "NCHW")
        and x.dtype == "float32"
        and call.ty.dtype == "float32"
        and all(s is not None and all(isinstance(d, tvm.tirx.IntImm) for d in s) for s in shapes)
        and all(int(d) == 1 for d in a.dilation)
    ):
        return None
    n, c, h, wd = (int(d) for d in x.shape)
    o, per, kh, kw = (int(d) for d in w.shape)
    if not (int(a.groups) == c == o and per == 1 and max(kh, kw) <= MAX_TAPS):
        return None
    _, _, oh, ow = (int(d) for d in call.ty.shape)
    sh, sw = (int(d) for d in a.strides)
    return Conv(n, c, h, wd, c, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))


def _depthwise_call(bb: relax.BlockBuilder, s: Conv, x: relax.Expr, weight: list[relax.Expr]) -> relax.Expr:
    """A call of the C depthwise kernel on `x` and `weight` (the fp32 filter, or int8 values and
    their scales), marked with its flops for the profile."""
    sizes = (s.n, s.c, s.h, s.w, s.kh, s.kw, s.oh, s.ow, s.sh, s.sw, s.pt, s.pl)
    symbol = DWCONV_S8 if len(weight) == 2 else DWCONV

    def compute(*tensors: te.Tensor) -> te.Tensor:
        return te.extern(
            [(s.n, s.c, s.oh, s.ow)],
            list(tensors),
            lambda ins, outs: tirx.call_extern("int32", symbol, *(t.data for t in ins), outs[0].data, *sizes),
            dtype="float32",
            name="depthwise_conv2d",
        )

    out = bb.call_te(compute, x, *weight, primfunc_name_hint="depthwise_conv2d_c" + ("_s8" if len(weight) == 2 else ""))
    gv = out.args[0]
    bb.update_func(gv, bb.get()[gv].with_attr(FLOPS, 2 * s.n * s.c * s.oh * s.ow * s.kh * s.kw))
    return out


def depthwise(bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering) -> relax.Expr:
    """`relax.nn.conv2d`: a depthwise convolution through the C kernel, anything else `fallback`."""
    s = depthwise_conv(call)
    return fallback(bb, call) if s is None else _depthwise_call(bb, s, call.args[0], [call.args[1]])


# a binding's replacement (None: kept as it is), as `rewrite_bindings` asks each function for it
Rewrite = Callable[[relax.VarBinding], "list[relax.VarBinding] | None"]


def int8_weights(mod: tvm.IRModule, threads: int, limits: Limits, *, cache: Path | None) -> tvm.IRModule:
    """`mod` with each convolution of a dequantized int8 weight that a kernel here can read in
    place (dense: forward and input gradient; depthwise: forward) calling that kernel on the
    int8 values and scales, the dequantized copy left to dead-code elimination."""

    def per_function(builder: relax.BlockBuilder, func: relax.Function) -> Rewrite:
        bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}

        def rewrite(b: relax.VarBinding) -> list[relax.VarBinding] | None:
            value = _int8_weight_call(builder, b.value, bound, threads, limits, cache)
            return None if value is None else [relax.VarBinding(b.var, value)]

        return rewrite

    return rewrite_bindings(mod, per_function)


def rewrite_bindings(mod: tvm.IRModule, per_function: Callable[[relax.BlockBuilder, relax.Function], Rewrite]) -> tvm.IRModule:
    """`mod` with each binding of each Relax function that `per_function(builder, func)`'s
    rewrite returns bindings for replaced by them (None: kept), the kernels it adds to `builder`
    in the module, and what the replaced bindings alone read left to dead-code elimination."""
    builder = relax.BlockBuilder(mod)
    rewritten = []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        rewrite = per_function(builder, func)
        blocks, changed = [], False
        for block in func.body.blocks:
            bindings = []
            for b in block.bindings:
                new = rewrite(b)
                changed |= new is not None
                bindings += [b] if new is None else new
            kind = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
            blocks.append(kind(bindings))
        if changed:
            body = relax.SeqExpr(blocks, func.body.body)
            builder.update_func(gv, relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs))
            rewritten.append(gv.name_hint)
    if not rewritten:
        return mod
    return relax.transform.DeadCodeElimination(rewritten)(builder.get())


def _int8_weight_call(
    builder: relax.BlockBuilder, value: relax.Expr, bound: dict, threads: int, limits: Limits, cache: Path | None
) -> relax.Expr | None:
    """`value` as a call of a kernel reading its int8 weight in place, if it is a convolution one
    computes and its weight a dequantized int8 weight; else None."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in _DENSE_S8):
        return None
    quantized = dequantized(value.args[1], bound)
    if quantized is None:
        return None
    conv_of, kernel, name = _DENSE_S8[value.op.name]
    s = conv_of(value)
    if s is not None:
        gv = builder.add_func(built(kernel, s, threads, limits, cache), name)
        return relax.call_tir(gv, relax.Tuple([value.args[0], *quantized]), out_ty=value.ty)
    s = depthwise_conv(value) if value.op.name == "relax.nn.conv2d" else None
    return None if s is None else _depthwise_call(builder, s, value.args[0], list(quantized))
