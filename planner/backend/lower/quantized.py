"""int8 activations on a microcontroller: a convolution whose output is quantized writes the codes.

Why: under `precision: int8` every activation a layer hands on is `dequantize(quantize(v))`
(`planner.inputs.calibration`), so between two layers the step stores int8 codes — but TVM
computes a convolution's fp32 output whole before its bias, its ReLU and the quantization read
it: MobileNetV2-w0.35's expanded 64x64 maps are 4 bytes a value in SRAM where their codes are
one. Here each frozen convolution with an int8 weight (dense or depthwise) whose output only its
bias, a ReLU or a clip, and the quantization read — the unit an int8 kernel of TFLite or
TinyEngine computes — becomes one call of planner's C kernel (`planner_conv_q`,
`planner_dwconv_q`, runtime/dwconv.c), which reads the input's codes where they lie (or a float
input, the decoded image), keeps a few output pixels' columns in scratch and writes the codes.
Its sums of codes are integers, exact, scaled to the output's codes once in float32: the values
the step's fp32 kernels compute up to their rounding, without the fp32 output.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from planner.backend.graph.quantized import Unit, dequantized_codes, read_counts, units
from planner.backend.lower.portable import Rewrite, depthwise_conv, rewrite_bindings
from planner.backend.sgemm.gemm import forward_conv
from planner.backend.sgemm.gemm_kernels import FLOPS
from planner.backend.sgemm.im2col import Conv

CONV_Q, DWCONV_Q = "planner_conv_q", "planner_dwconv_q"  # and `_qf`, of a float input; `planner_conv_qp` of pixels
CHUNK_FLOATS = 4096  # a float-input dense kernel's columns and sums for this many floats at most (16 KiB)
CHUNK_CODES = 4096  # an int8-input dense kernel's int16 columns for this many values at most (8 KiB)


def int8_activations(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every quantized convolution (`graph.quantized.Unit`) a kernel here computes
    one call of it, the fp32 chain it replaces left to dead-code elimination."""

    def per_function(builder: relax.BlockBuilder, func: relax.Function) -> Rewrite:
        bindings = [b for block in func.body.blocks for b in block.bindings]
        uses = read_counts(func)
        found, bound = units(bindings, uses), {b.var: b.value for b in bindings}

        def rewrite(b: relax.VarBinding) -> list[relax.VarBinding] | None:
            if (pooled := _pooled(builder, b.value, bound, uses)) is not None:
                return [relax.VarBinding(b.var, pooled)]
            sizes = _sizes(found[b.var]) if b.var in found else None
            if sizes is None:
                return None
            unit, var = found[b.var], relax.DataflowVar if isinstance(b.var, relax.DataflowVar) else relax.Var
            scale, bias, folded = unit.weight[1], unit.bias, []
            if unit.times is not None:  # a BatchNorm folded: its factor into the weight's scales, the bias through it
                scaled = builder.normalize(builder.call_te(_times, scale, unit.times, primfunc_name_hint="folded_scale"))
                scale = var(f"{b.var.name}_scale", scaled.ty)
                folded = [relax.VarBinding(scale, scaled)]
                if unit.bias_before is not None:
                    after = [t for t in (unit.bias_before, unit.times, unit.bias) if t is not None]
                    through = builder.normalize(builder.call_te(_through, *after, primfunc_name_hint="folded_bias"))
                    bias = var(f"{b.var.name}_bias", through.ty)
                    folded.append(relax.VarBinding(bias, through))
            call = _call(builder, unit, scale, bias, *sizes, b.value.ty)
            both = var(f"{b.var.name}_q", call.ty)
            return [*folded, relax.VarBinding(both, call), relax.VarBinding(b.var, relax.TupleGetItem(both, 0))]

        return rewrite

    return rewrite_bindings(mod, per_function)


def _pooled(builder: relax.BlockBuilder, value: relax.Expr, bound: dict, uses: dict) -> relax.Expr | None:
    """`mean(dequantize(codes))`, the dequantized activation read by the mean alone (a global
    pooling), as one kernel summing the values the codes stand for: the sum TVM's mean makes over
    them, in its order, then its division, without the fp32 tensor (MobileNetV2-w0.35's last
    1280x4x4 map: 80 KiB, where its codes are 20); else None."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_MEAN)) or not isinstance(value.args[0], relax.Var):
        return None
    read = dequantized_codes(value.args[0], bound, uses)
    if read is None or read[0].ty.shape is None:
        return None
    codes, (scale, zero) = read
    shape = [int(d) for d in codes.ty.shape]
    axes = sorted(int(a) % len(shape) for a in value.attrs.axis) if value.attrs.axis is not None else list(range(len(shape)))
    keep = bool(value.attrs.keepdims)
    count = int(np.prod([shape[a] for a in axes]))

    def compute(q: te.Tensor) -> te.Tensor:
        reduce = {a: te.reduce_axis((0, shape[a]), f"r{a}") for a in axes}
        out_shape = [1 if a in reduce else n for a, n in enumerate(shape) if keep or a not in reduce]

        def dequantized(*out: tirx.PrimExpr) -> tirx.PrimExpr:
            """The value at output `out`'s reduced positions, as `dequantize` computes it."""
            spatial, at = iter(out), []
            for a in range(len(shape)):
                if a in reduce and keep:
                    next(spatial)  # the kept axis, of size 1
                at.append(reduce[a] if a in reduce else next(spatial))
            return (q[tuple(at)].astype("int32") - zero).astype("float32") * tirx.const(scale, "float32")

        total = te.compute(out_shape, lambda *i: te.sum(dequantized(*i), axis=list(reduce.values())), name="pooled_sum")
        return te.compute(out_shape, lambda *i: total(*i) / tirx.const(float(count), "float32"), name="pooled")

    return builder.call_te(compute, codes, primfunc_name_hint="mean_of_codes")


_MEAN = tvm.ir.Op.get("relax.mean")


def _sizes(unit: Unit) -> tuple[Conv, bool] | None:
    """The unit's convolution as a kernel here computes it, and whether dense (groups 1) or
    depthwise; None for any other (a grouped one, a dilated one)."""
    s = depthwise_conv(unit.conv) if unit.decode is None else None  # pixels: the dense kernel reads them
    if s is not None:
        return s, False
    s = forward_conv(unit.conv) if int(unit.conv.attrs.groups) == 1 else None
    return None if s is None else (s, True)


def scratch_floats(s: Conv, dense: bool, codes: bool) -> tuple[int, int]:
    """(output pixels a dense kernel sums at once, the floats of scratch its call takes): a
    dense kernel's int16 columns for `CHUNK_CODES` values at most when it reads `codes`, else its
    weight panel, columns and sums for `CHUNK_FLOATS`; a depthwise one's input plane padded, as
    int16, when it reads `codes`, else its output plane."""
    if dense and codes:
        k = s.c * s.kh * s.kw
        chunk = min(s.oh * s.ow, max(2, CHUNK_CODES // k // 2 * 2))
        return chunk, (chunk * k + 1) // 2
    if dense:
        k = s.c * s.kh * s.kw
        chunk = min(s.oh * s.ow, max(4, CHUNK_FLOATS // (k + s.o) // 4 * 4))
        return chunk, 4 * k + (k + s.o) * chunk
    if codes:  # the input plane as int16 with its padding
        return 0, ((s.oh - 1) * s.sh + s.kh) * ((s.ow - 1) * s.sw + s.kw) // 2 + 1
    return 0, s.oh * s.ow


def _channel(t: te.Tensor, o: tirx.PrimExpr) -> tirx.PrimExpr:
    """Channel `o`'s value of a per-channel `t` (`[1, O, 1, 1]`, `[O, 1, 1]`: on its third axis from the end)."""
    return t[tuple(o if i == len(t.shape) - 3 else 0 for i in range(len(t.shape)))]


def _times(scale: te.Tensor, times: te.Tensor) -> te.Tensor:
    """`scale` (o, 1, 1, 1) times `times`, one value per channel."""
    return te.compute(scale.shape, lambda o, *_: scale[o, 0, 0, 0] * _channel(times, o))


def _through(before: te.Tensor, times: te.Tensor, after: te.Tensor | None = None) -> te.Tensor:
    """The bias of `(conv + before) * times + after` as `conv * times + bias`, one per channel."""
    n = before.shape[len(before.shape) - 3]
    return te.compute((n,), lambda o: _channel(before, o) * _channel(times, o) + (0 if after is None else _channel(after, o)))


def _call(
    bb: relax.BlockBuilder, unit: Unit, scale: relax.Expr, bias: relax.Expr | None, s: Conv, dense: bool, ty: relax.TensorType
) -> relax.Call:
    """The kernel's call for `unit` (`scale` and `bias`: its weight's and its own, a BatchNorm
    folded in): its int8 output, then its scratch (a second output, which the arena holds for the
    call alone)."""
    k = s.c * s.kh * s.kw
    sizes: tuple[int, ...]
    chunk, scratch = scratch_floats(s, dense, unit.codes is not None)
    if dense:
        sizes = (chunk, s.n, s.c, s.h, s.w, s.o)
    else:
        sizes = (s.n, s.c, s.h, s.w)
    sizes += (s.kh, s.kw, s.oh, s.ow, s.sh, s.sw, s.pt, s.pl)
    x_scale, x_zero = unit.codes or (1.0, 0)
    (lo, hi), (out_scale, out_zero) = unit.clip, unit.out
    bias = bias if bias is not None else relax.const(np.zeros(s.o, np.float32))
    f32, i32 = (lambda v: tirx.FloatImm("float32", v)), (lambda v: tirx.IntImm("int32", v))

    def compute(x: te.Tensor, *rest: te.Tensor) -> list[te.Tensor]:
        def body(ins, outs):
            codes = () if unit.codes is None else (f32(x_scale), i32(x_zero))
            head = (ins[0].data, *codes, *(t.data for t in ins[1:]))
            tail = (f32(lo), f32(hi), f32(out_scale), i32(out_zero), outs[0].data, outs[1].data)
            symbol = (CONV_Q if dense else DWCONV_Q) + ("" if unit.codes else "p" if unit.decode else "f")
            return tirx.call_extern("int32", symbol, *head, *tail, *sizes)

        return te.extern([tuple(ty.shape), (scratch,)], [x, *rest], body, dtype=["int8", "float32"], name="conv_q")

    call = bb.call_te(
        compute,
        unit.x,
        *(unit.decode or ()),  # 8-bit pixels' per-channel scale and offset
        unit.weight[0],
        scale,
        bias,
        primfunc_name_hint="conv2d_q" if dense else "depthwise_conv2d_q",
    )
    gv = call.args[0]
    bb.update_func(gv, bb.get()[gv].with_attr(FLOPS, 2 * s.n * s.o * s.oh * s.ow * (k if dense else s.kh * s.kw)))
    return bb.normalize(call)
