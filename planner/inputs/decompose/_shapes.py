"""Rewrites of operators that move or repeat values: paddings, tiles, cumulative sums, top-k,
CELU, dropout and `auto_pad`."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from planner.inputs.decompose._writer import Context, Writer, attr

# --- padding -------------------------------------------------------------------------------------


def pad(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Pad` (any mode; a negative width crops) as slices and concatenations, one axis at a time
    (as numpy's pad, which the reference runs, pads the corners)."""
    shape = ctx.shape(node.input[0])
    pads = ctx.const(node, 1)
    if shape is None or pads is None or (len(node.input) > 2 and node.input[2] and ctx.const(node, 2) is None):
        return False
    rank = len(shape)
    given = ctx.const(node, 3)
    axes = list(range(rank)) if given is None else [int(a) % rank for a in given]
    widths = [int(p) for p in pads]
    value = ctx.const(node, 2)
    mode = attr(node, "mode", "constant")
    dtype = ctx.dtype(node.input[0])
    x, current = node.input[0], list(shape)
    for axis, before, after in zip(axes, widths[: len(axes)], widths[len(axes) :]):
        if before < 0 or after < 0:  # a crop (`F.pad` with a negative width) first
            x = w.slice(x, axis, max(-before, 0), current[axis] - max(-after, 0))
            current[axis] -= max(-before, 0) + max(-after, 0)
            before, after = max(before, 0), max(after, 0)
        if not before and not after:
            continue
        size = current[axis]
        if mode == "reflect" and (before >= size or after >= size):
            return False
        if mode == "wrap" and (before > size or after > size):
            return False
        parts: list[str | None] = []
        for count, first in ((before, True), (after, False)):
            if not count:
                parts.append(None)
                continue
            if mode == "constant":
                fill = np.zeros(()) if value is None else np.asarray(value).reshape(())
                block = np.full([count if i == axis else d for i, d in enumerate(current)], fill, dtype)
                parts.append(w.const(block, "fill"))
            elif mode == "reflect":  # x[count], ..., x[1] before; x[L-2], ..., x[L-1-count] after
                start = count if first else size - 2
                end = 0 if first else size - 2 - count
                parts.append(w.slice(x, axis, start, end if end >= 0 else -size - 1, -1))
            elif mode == "edge":
                edge = w.slice(x, axis, 0 if first else size - 1, 1 if first else size)
                target = [count if i == axis else d for i, d in enumerate(current)]
                parts.append(w.op("Expand", [edge, w.const(np.array(target, np.int64))]))
            elif mode == "wrap":
                parts.append(w.slice(x, axis, size - count, size) if first else w.slice(x, axis, 0, count))
            else:
                return False
        x = w.op("Concat", [p for p in (parts[0], x, parts[1]) if p], axis=axis)
        current[axis] += before + after
    w.op("Identity", [x], node.output[0])
    return True


# --- tiles, cumulative sums, top-k, CELU, dropout -----------------------------------------------


def tile(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Tile` as unsqueeze, expand and reshape: the copies are a new outer axis per axis."""
    shape, given = ctx.shape(node.input[0]), ctx.const(node, 1)
    if shape is None or given is None:
        return False
    reps = [int(r) for r in given]
    rank = len(shape)
    spread = w.op("Unsqueeze", [node.input[0], w.const(np.arange(0, 2 * rank, 2, dtype=np.int64))])
    expanded = w.op("Expand", [spread, w.const(np.array([v for r, d in zip(reps, shape) for v in (r, d)], np.int64))])
    w.op("Reshape", [expanded, w.const(np.array([r * d for r, d in zip(reps, shape)], np.int64))], node.output[0])
    return True


def cumsum(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """A reversed or exclusive `CumSum` as the plain one (TVM writes the reversal as TIR): flips
    around it, and the input subtracted for an exclusive sum; its axis a scalar (the legacy
    exporter writes `[1]`, which TVM refuses)."""
    reverse, exclusive = attr(node, "reverse", 0), attr(node, "exclusive", 0)
    shape, given = ctx.shape(node.input[0]), ctx.const(node, 1)
    if shape is None or given is None or not (reverse or exclusive or np.ndim(given)):
        return False
    axis = int(np.asarray(given).reshape(())) % len(shape)
    size = shape[axis]

    def flip(t: str) -> str:
        return w.slice(t, axis, size - 1, -size - 1, -1)

    x = flip(node.input[0]) if reverse else node.input[0]
    total = w.op("CumSum", [x, w.const(np.array(axis, np.asarray(given).dtype), "axis")])
    if exclusive:
        total = w.op("Sub", [total, x])
    w.op("Identity", [flip(total) if reverse else total], node.output[0])
    return True


def topk(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`TopK`'s values as the input gathered at its indices: the indices carry no gradient, the
    gather passes one back to exactly the elements picked. Sorted always (TVM imports no other
    TopK), which an unsorted one may be."""
    if not node.output[0]:
        return False
    axis = attr(node, "axis", -1)
    indices = node.output[1] if len(node.output) > 1 and node.output[1] else w.fresh("indices")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute} | {"sorted": 1}
    w.nodes.append(helper.make_node("TopK", list(node.input), [w.fresh("values"), indices], name=w.fresh("topk"), **attrs))
    w.op("GatherElements", [node.input[0], indices], node.output[0], axis=axis)
    return True


def power(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Pow` of a float by a constant exponent of 2 or 3 as products (`x·x`, `x·x·x`), as PyTorch
    computes them; by another constant integer exponent (`torch.linalg.vector_norm(x, 3)`, as the
    dynamo exporter writes it) with the exponent in the base's type: TVM's import refuses the mix.

    Why the products: TVM lowers a float power to libm's `powf`, one call per element, and its
    gradient to another: GPT-2's tanh-GELU cube and its gradient ran at 0.5 and 4.6 GFLOP/s,
    0.39 s of a 4.9 s GPT-2-small step (`benchmarks/causal_lm_step.py`)."""
    exponent = ctx.const(node, 1)
    x = node.input[0]
    if exponent is None or ctx.dtype(x).kind != "f":
        return False
    shape = ctx.shape(x)
    if exponent.size == 1 and float(exponent.ravel()[0]) in (2.0, 3.0) and shape is not None and exponent.ndim <= len(shape):
        w.op("Mul", [w.op("Mul", [x, x]), x] if float(exponent.ravel()[0]) == 3.0 else [x, x], node.output[0])
        return True
    if exponent.dtype.kind not in "iu":
        return False
    w.op("Pow", [node.input[0], w.const(exponent.astype(ctx.dtype(node.input[0])), "exponent")], node.output[0])
    return True


def hyperbolic(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Sinh` and `Cosh` as (e^x -+ e^-x) / 2: TVM 0.27 compiles neither for a CPU."""
    x = node.input[0]
    up, down = w.op("Exp", [x]), w.op("Exp", [w.op("Neg", [x])])
    half = w.const(np.array(0.5, ctx.dtype(x)), "half")
    w.op("Mul", [w.op("Sub" if node.op_type == "Sinh" else "Add", [up, down]), half], node.output[0])
    return True


def celu(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Celu` (TVM has none) as `alpha * Elu(x / alpha)`, which it is."""
    alpha = float(attr(node, "alpha", 1.0))
    scale = w.const(np.array(alpha, ctx.dtype(node.input[0])), "alpha")
    elu = w.op("Elu", [w.op("Div", [node.input[0], scale])], alpha=1.0)
    w.op("Mul", [elu, scale], node.output[0])
    return True


def dropout(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Dropout` outside training: the identity (a mask output, if read, is all true)."""
    training = ctx.const(node, 2)
    if len(node.input) > 2 and node.input[2] and (training is None or bool(np.asarray(training))):
        return False
    w.op("Identity", [node.input[0]], node.output[0])
    if len(node.output) > 1 and node.output[1]:
        shape = ctx.shape(node.input[0])
        if shape is None:
            return False
        w.op("Identity", [w.const(np.ones(shape, bool), "mask")], node.output[1])
    return True


# --- automatic padding ---------------------------------------------------------------------------


def auto_pad(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`auto_pad` SAME_UPPER, SAME_LOWER or VALID (the legacy exporter's `padding='same'`) as the
    explicit pads it stands for: TVM writes it as a TIR padding kernel before the operator, which
    has no gradient."""
    mode = attr(node, "auto_pad", "NOTSET")
    if mode == "NOTSET":
        return False
    shape = ctx.shape(node.input[0])
    if shape is None:
        return False
    spatial = list(shape[2:])
    kernel = attr(node, "kernel_shape")
    if kernel is None:
        weight = ctx.shape(node.input[1]) if len(node.input) > 1 else None
        if weight is None:
            return False
        kernel = list(weight[2:])
    strides = attr(node, "strides") or [1] * len(spatial)
    dilations = attr(node, "dilations") or [1] * len(spatial)
    before, after = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        if mode == "VALID":
            total = 0
        else:
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, large = total // 2, total - total // 2
        before.append(large if mode == "SAME_LOWER" else small)
        after.append(small if mode == "SAME_LOWER" else large)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in ("auto_pad", "pads")}
    w.nodes.append(
        helper.make_node(node.op_type, list(node.input), list(node.output), name=node.name, pads=before + after, **attrs)
    )
    return True
