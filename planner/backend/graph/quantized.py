"""The quantized convolutions of an int8 step: what an int8 kernel computes in one call.

Under `precision: int8` every activation a layer hands on is `dequantize(quantize(v))`
(`planner.inputs.calibration`). A frozen convolution with an int8 weight whose output only its
bias (or an inference BatchNorm's per-channel multiply-add), a ReLU or a clip, and the
quantization read is the unit TFLite's and TinyEngine's int8 kernels compute:
`quantize(clip(conv2d(dequantize(codes), w) * times + bias, lo, hi))`, the BatchNorm folded into
the weight's per-channel scales as their converters fold it. Found here, once,
for the microcontroller's kernels that write its codes (`planner.backend.lower.quantized`) and
for the row bands' estimate of what the step holds (`planner.backend.graph.bands`): the unit's
fp32 values — the convolution's output, its sum with the bias, its clip, the dequantized input
it alone reads — never lie in memory whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from planner.backend.graph.rewrites import scalar
from planner.backend.graph.weights import dequantized

UNCLIPPED = float(np.finfo(np.float32).max)  # a side no clip bounds: min(v, FLT_MAX) is v
MAX_SIDE = 7  # the kernels' largest filter side (dwconv.c's MAX_TAPS: 7x7; a dense one's im2col too)
_OPS = {
    name: tvm.ir.Op.get(f"relax.{name}")
    for name in ("quantize", "dequantize", "nn.relu", "clip", "add", "multiply", "astype", "nn.conv2d")
}


@dataclass(frozen=True)
class Unit:
    """`quantize(clip((conv2d(x, w) + bias_before) * times + bias, lo, hi), *out)`, x possibly
    `dequantize(codes)`."""

    conv: relax.Call
    x: relax.Expr  # the input as a kernel reads it: the int8 codes (when `codes`) or the fp32 tensor
    codes: tuple[float, int] | None  # the input's (scale, zero point) when `x` is its codes
    decode: tuple[relax.Expr, relax.Expr] | None  # 8-bit pixels' scale and offset per channel when `x` is them
    weight: tuple[relax.Expr, relax.Expr]  # int8 values and fp32 scales per output channel
    times: relax.Expr | None  # one factor per output channel (an inference BatchNorm's), else 1
    bias: relax.Expr | None
    bias_before: relax.Expr | None  # with `times`, the convolution's own bias, added before it
    clip: tuple[float, float]
    out: tuple[float, int]
    fused: tuple[relax.Var, ...]  # the fp32 values the unit computes and only it reads


def units(bindings: list[relax.VarBinding], uses: dict[relax.Var, int]) -> dict[relax.Var, Unit]:
    """Each quantized convolution among `bindings`, by the variable of its int8 output; `uses`:
    how many times each variable is read (`read_counts`)."""
    bound = {b.var: b.value for b in bindings}
    found = {}
    for b in bindings:
        unit = _unit(b.value, bound, uses)
        if unit is not None:
            found[b.var] = unit
    return found


def unheld(bindings: list[relax.VarBinding], uses: dict[relax.Var, int], elementwise: frozenset[str]) -> set[relax.Var]:
    """The fp32 values of an int8 step that never lie in memory whole: each unit's own, and those
    of an `elementwise` chain that ends in a quantization, each read once — a dequantized input,
    a BatchNorm's scaling, a residual sum: TVM fuses the chain into the kernel that writes its
    codes. A dequantized activation that units read as codes and one other operation reads is the
    chain's first value."""
    bound = {b.var: b.value for b in bindings}
    found = units(bindings, uses)
    out = {v for unit in found.values() for v in unit.fused}
    as_codes: dict[relax.Var, int] = {}
    for unit in found.values():
        if unit.codes is not None and isinstance(unit.conv.args[0], relax.Var):
            as_codes[unit.conv.args[0]] = as_codes.get(unit.conv.args[0], 0) + 1

    def chain(value: relax.Expr) -> None:
        for arg in value.args:
            inner = bound.get(arg) if isinstance(arg, relax.Var) else None
            fused = isinstance(inner, relax.Call) and isinstance(inner.op, tvm.ir.Op) and inner.op.name in elementwise
            if fused and str(arg.ty.dtype) == "float32" and uses.get(arg, 0) - as_codes.get(arg, 0) <= 1 and arg not in out:
                out.add(arg)
                chain(inner)

    for b in bindings:
        if b.var not in found and isinstance(b.value, relax.Call) and b.value.op.same_as(_OPS["quantize"]):
            chain(b.value)
    return out


def read_counts(func: relax.Function) -> dict[relax.Var, int]:
    """How many times each variable is read in `func`."""
    counts: dict[relax.Var, int] = {}

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return counts


def _call_of(expr: relax.Expr, op: str, bound: dict, uses: dict | None = None) -> relax.Call | None:
    """The call of `op` bound to `expr` (read only once, with `uses`), else None."""
    value = bound.get(expr) if isinstance(expr, relax.Var) else None
    if not (isinstance(value, relax.Call) and value.op.same_as(_OPS[op])):
        return None
    return value if uses is None or uses.get(expr, 0) == 1 else None


def _quantization(call: relax.Call) -> tuple[float, int] | None:
    """A per-tensor quantize or dequantize's (scale, zero point) to int8, else None."""
    s, z = scalar(call.args[1]), scalar(call.args[2])
    int8 = "int8" in (str(call.ty.dtype), str(call.args[0].ty.dtype))
    return None if s is None or z is None or not int8 else (s, int(z))


def dequantized_codes(expr: relax.Expr, bound: dict, uses: dict | None = None) -> tuple[relax.Expr, tuple[float, int]] | None:
    """(the int8 codes, their (scale, zero point)) when `expr` is bound to their per-tensor
    `dequantize` (read only once, with `uses`), else None."""
    dq = _call_of(expr, "dequantize", bound, uses)
    at = None if dq is None else _quantization(dq)
    return None if dq is None or at is None else (dq.args[0], at)


def _number(arg: relax.Expr) -> float:
    """A clip's bound (a PrimValue of a float immediate)."""
    value = arg.value
    return float(getattr(value, "value", value))


def _computed(conv: relax.Call) -> bool:
    """Whether the kernels compute `conv`: float32 NCHW/OIHW, static, undilated, dense or
    depthwise, at most `MAX_SIDE` taps a side."""
    a = conv.attrs
    shapes = [conv.args[0].ty.shape, conv.args[1].ty.shape, conv.ty.shape]
    if (a.data_layout, a.kernel_layout, a.out_layout or "NCHW") != ("NCHW", "OIHW", "NCHW") or str(conv.ty.dtype) != "float32":
        return False
    if not all(s is not None and all(isinstance(d, tvm.tirx.IntImm) for d in s) for s in shapes):
        return False
    c, (o, per, kh, kw), groups = int(shapes[0][1]), (int(d) for d in shapes[1]), int(a.groups)
    depthwise = groups == c == o and per == 1
    return (groups == 1 or depthwise) and all(int(d) == 1 for d in a.dilation) and max(kh, kw) <= MAX_SIDE


def _per_channel(add: relax.Call, conv: relax.Call) -> bool:
    """Whether `add` is `conv`'s output plus (or times) one value per output channel (a bias
    `[1, O, 1, 1]` or `[O, 1, 1]`), of the convolution's shape."""
    shape = [int(d) for d in add.args[1].ty.shape] if add.args[1].ty.shape is not None else []
    same = [int(d) for d in add.ty.shape] == [int(d) for d in conv.ty.shape]
    return (
        same
        and len(shape) >= 3
        and shape[-3] == int(conv.ty.shape[1])
        and all(d == 1 for i, d in enumerate(shape) if i != len(shape) - 3)
    )


def _decoded(x: relax.Expr, bound: dict, uses: dict) -> tuple[list[relax.Var], relax.Expr, tuple[relax.Expr, relax.Expr]] | None:
    """`x` as 8-bit pixels decoded per channel, `astype(p, "float32") * scale + offset`
    (`planner.inputs.encodings`; one scale and offset for all channels taken as one per channel),
    each step read once: (those steps' values, p, (scale, offset)); else None."""
    add = _call_of(x, "add", bound, uses)
    mul = None if add is None else _call_of(add.args[0], "multiply", bound, uses)
    cast = None if mul is None else _call_of(mul.args[0], "astype", bound, uses)
    if add is None or mul is None or cast is None or str(cast.args[0].ty.dtype) != "uint8" or cast.args[0].ty.shape is None:
        return None
    if str(cast.ty.dtype) != "float32" or not all(v.ty.shape is not None for v in (mul, add)):
        return None
    if [int(d) for d in add.ty.shape] != [int(d) for d in cast.args[0].ty.shape]:
        return None  # the decode broadcast the pixels to another shape
    channels = int(cast.args[0].ty.shape[1])
    factors = []
    for factor in (mul.args[1], add.args[1]):
        if factor.ty.shape is None:
            return None
        shape = [int(d) for d in factor.ty.shape]
        if all(d == 1 for d in shape) and isinstance(factor, tvm.ir.Constant):  # one for all channels (an array's code)
            factor = relax.const(np.full(channels, float(factor.value.numpy().reshape(-1)[0]), np.float32))
        elif len(shape) < 3 or shape[-3] != channels or any(d != 1 for i, d in enumerate(shape) if i != len(shape) - 3):
            return None
        factors.append(factor)
    return [x, add.args[0], mul.args[0]], cast.args[0], (factors[0], factors[1])


def _unit(value: relax.Expr, bound: dict, uses: dict) -> Unit | None:
    """`value` as a quantized convolution, else None."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_OPS["quantize"])) or str(value.ty.dtype) != "int8":
        return None
    out = _quantization(value)
    v, lo, hi, fused = value.args[0], -UNCLIPPED, UNCLIPPED, []
    if (relu := _call_of(v, "nn.relu", bound, uses)) is not None:
        fused.append(v)
        v, lo = relu.args[0], 0.0
    elif (clip := _call_of(v, "clip", bound, uses)) is not None:
        fused.append(v)
        v, lo, hi = clip.args[0], _number(clip.args[1]), _number(clip.args[2])
    bias = times = None
    if (add := _call_of(v, "add", bound, uses)) is not None:
        fused.append(v)
        v, bias = add.args[0], add.args[1]
    inner = bias_before = None
    if (mul := _call_of(v, "multiply", bound, uses)) is not None:  # a BatchNorm's `x * a + b`
        fused.append(v)
        v, times = mul.args[0], mul.args[1]
        if (inner := _call_of(v, "add", bound, uses)) is not None:  # of a convolution with a bias
            fused.append(v)
            v, bias_before = inner.args[0], inner.args[1]
    conv = _call_of(v, "nn.conv2d", bound, uses)
    if out is None or conv is None or not _computed(conv):
        return None
    if any(op is not None and not _per_channel(op, conv) for op in (add, mul, inner)):
        return None
    fused.append(v)
    weight = dequantized(conv.args[1], bound)
    if weight is None:
        return None
    x, codes = conv.args[0], None
    decode = None
    if (read := dequantized_codes(x, bound)) is not None:
        if uses.get(x, 0) == 1:
            fused.append(x)
        x, codes = read
    elif int(conv.attrs.groups) == 1 and (pixels := _decoded(x, bound, uses)) is not None:
        fused += pixels[0]
        x, decode = pixels[1], pixels[2]
    if str(x.ty.dtype) not in ("int8", "float32", *(("uint8",) if decode is not None else ())):
        return None
    return Unit(conv, x, codes, decode, weight, times, bias, bias_before, (lo, hi), out, tuple(fused))
