"""Gradients of pools."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from planner.backend.graph.gradients._common import Gradients, dims
from planner.backend.graph.gradients.indexing import strided_slice_grad

_TVM_MAX_POOL2D_GRAD = tvm.ir.Op.get("relax.nn.max_pool2d").get_attr("FPrimalGradient")


def _max_pool2d_grad(orig_var, orig_call, output_grad, ctx):
    """y = max_pool2d(x) (NCHW): TVM's gradient where the pool is undilated; a dilated one
    (which TVM's cannot lower) routes dy to the first maximum of each window, as PyTorch does,
    one kernel tap at a time: tap (i, j) of every window is a strided slice of the padded input,
    the windows whose maximum it is (and no earlier tap's) take dy there, and the slice's own
    gradient puts it back in place."""
    a = orig_call.attrs
    dilation = [int(d) for d in a.dilation]
    if dilation == [1, 1] or a.layout != "NCHW":
        return _TVM_MAX_POOL2D_GRAD(orig_var, orig_call, output_grad, ctx)
    x = orig_call.args[0]
    n, c, *size = dims(x)
    out = dims(orig_var)[2:]
    kernel, strides = [int(k) for k in a.pool_size], [int(s) for s in a.strides]
    before = [int(a.padding[0]), int(a.padding[1])]
    reach = [(out[i] - 1) * strides[i] + (kernel[i] - 1) * dilation[i] + 1 for i in range(2)]  # rows the windows span
    after = [max(0, reach[i] - size[i] - before[i]) for i in range(2)]
    padded = relax.op.nn.pad(x, [0, 0, 0, 0, before[0], after[0], before[1], after[1]], pad_value=float("-inf"))
    padded = ctx.normalize(padded)
    taken = None
    total = None
    zero = relax.op.zeros_like(output_grad)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            start = [i * dilation[0], j * dilation[1]]
            end = [start[k] + (out[k] - 1) * strides[k] + 1 for k in range(2)]
            tap = ctx.normalize(relax.op.strided_slice(padded, axes=[2, 3], begin=start, end=end, strides=strides))
            hit = relax.op.equal(tap, orig_var)
            if taken is not None:
                hit = relax.op.logical_and(hit, relax.op.logical_not(taken))
            taken = hit if taken is None else relax.op.logical_or(taken, hit)
            part = strided_slice_grad(tap, tap, ctx.normalize(relax.op.where(hit, output_grad, zero)), ctx)[0]
            total = part if total is None else total + part
    assert total is not None
    return [relax.op.strided_slice(total, axes=[2, 3], begin=before, end=[before[0] + size[0], before[1] + size[1]])]


_TVM_AVG_POOL2D_GRAD = tvm.ir.Op.get("relax.nn.avg_pool2d").get_attr("FPrimalGradient")


def _divisors(size: int, out: int, kernel: int, stride: int, dilation: int, before: int, after: int) -> np.ndarray:
    """What each of an axis's `out` windows divides by when the padding counts (`count_include_pad`):
    its taps inside the padded input, as the forward (ONNX's, PyTorch's) counts them."""
    counts = [sum(-before <= o * stride - before + t * dilation < size + after for t in range(kernel)) for o in range(out)]
    return np.array(counts, np.float64)


def _avg_pool2d_grad(orig_var, orig_call, output_grad, ctx):
    """y = avg_pool2d(x) (NCHW): TVM's gradient, but where the pool counts the padding and its
    ceil mode lets the last windows run past it. There TVM's gradient divides by the whole
    kernel, where the forward (and PyTorch) divides by the taps inside the padded input: a
    wrong gradient (0.1-0.55 off) under a right forward. This one scales dy by each window's
    divisor, then puts it back one kernel tap at a time (a strided slice's gradient each)."""
    a = orig_call.attrs
    if not (a.ceil_mode and a.count_include_pad) or a.layout != "NCHW":
        return _TVM_AVG_POOL2D_GRAD(orig_var, orig_call, output_grad, ctx)
    x = orig_call.args[0]
    n, c, *size = dims(x)
    out = dims(orig_var)[2:]
    kernel, strides, dilation = ([int(v) for v in a.pool_size], [int(v) for v in a.strides], [int(v) for v in a.dilation])
    before, after = [int(a.padding[0]), int(a.padding[1])], [int(a.padding[2]), int(a.padding[3])]
    rows, cols = (_divisors(size[i], out[i], kernel[i], strides[i], dilation[i], before[i], after[i]) for i in range(2))
    dtype = str(x.ty.dtype)
    scaled = ctx.normalize(output_grad * relax.const((1.0 / np.outer(rows, cols)).astype(dtype).reshape(1, 1, *out), dtype))
    reach = [(out[i] - 1) * strides[i] + (kernel[i] - 1) * dilation[i] + 1 for i in range(2)]
    canvas = ctx.normalize(relax.op.zeros([n, c, max(reach[0], before[0] + size[0]), max(reach[1], before[1] + size[1])], dtype))
    total = None
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            start = [i * dilation[0], j * dilation[1]]
            end = [start[k] + (out[k] - 1) * strides[k] + 1 for k in range(2)]
            tap = ctx.normalize(relax.op.strided_slice(canvas, axes=[2, 3], begin=start, end=end, strides=strides))
            part = strided_slice_grad(tap, tap, scaled, ctx)[0]
            total = part if total is None else total + part
    assert total is not None
    return [relax.op.strided_slice(total, axes=[2, 3], begin=before, end=[before[0] + size[0], before[1] + size[1]])]


GRADIENTS: Gradients = {
    "relax.nn.max_pool2d": (_max_pool2d_grad, True),  # dilated ones
    "relax.nn.avg_pool2d": (_avg_pool2d_grad, True),  # ceil mode counting the padding
}
