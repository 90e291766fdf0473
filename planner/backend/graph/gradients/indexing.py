"""Gradients of ops that move, select or mask values: slices, gathers, squeezes, triangles."""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad

from planner.backend.graph.gradients._common import Gradients, dims, ints


def _squeeze_grad(orig_var, orig_call, output_grad, ctx):
    """y = squeeze(x): dy/dx puts the removed unit axes back."""
    return [relax.op.reshape(output_grad, dims(orig_call.args[0]))]


def strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """y = x[begin:end:step] along `axes` (any step, a negative one reversing: `flip`): dy/dx is
    the output gradient put back where the slice came from, zeros elsewhere. A reversing axis
    flips the gradient first, which makes it the increasing slice of the same positions. Built
    from reshapes and padding only: along a strided axis each gradient value gets `step - 1`
    zeros after it (a unit axis padded, then merged), the run is cut or padded to the slice's end,
    then padded by its start. (TVM's slice_scatter would read past the end of its source for an
    even-sized `x[..., ::2]`.)"""
    x, axes, begin, end, *rest = orig_call.args
    shape = dims(x)
    steps = ints(rest[0]) if rest else [1] * len(ints(axes))
    grad = output_grad
    current = dims(output_grad)  # the shape of `grad` as each axis is put back
    for axis, b, e, step in zip(ints(axes), ints(begin), ints(end), steps):
        axis %= len(shape)
        positions = range(shape[axis])[slice(b, e, step)]  # the slice's semantics are Python's
        if step < 0:
            grad = relax.op.flip(grad, axis)
            positions = positions[::-1]
            step = -step
        taken = len(positions)
        start = positions[0] if taken else 0
        if step > 1 and taken > 0:  # value k at position k * step
            spread = [0] * (2 * (len(current) + 1))
            spread[2 * (axis + 1) + 1] = step - 1
            grad = relax.op.nn.pad(relax.op.expand_dims(grad, axis + 1), spread)
            current[axis] = taken * step
            grad = relax.op.reshape(grad, current)
        run = min(current[axis], shape[axis] - start)  # the last value's trailing zeros may overhang
        if run < current[axis]:
            grad = relax.op.strided_slice(grad, axes=[axis], begin=[0], end=[run])
        pad = [0] * (2 * len(shape))
        pad[2 * axis], pad[2 * axis + 1] = start, shape[axis] - start - run
        if any(pad):
            grad = relax.op.nn.pad(grad, pad)
        current[axis] = shape[axis]
    return [grad, no_grad(axes), no_grad(begin), no_grad(end), *(no_grad(r) for r in rest)]


def _take_grad(orig_var, orig_call, output_grad, ctx):
    """y = take(x, indices, axis). A constant scalar index (a class-token select, `qkv[0]`) puts
    the gradient back as one slice, zero-padded; an index tensor of any rank is flattened to the
    one-dimensional form TVM's scatter-add (`take_backward`) accepts."""
    x, indices = orig_call.args
    shape = dims(x)
    axis = int(orig_call.attrs.axis) % len(shape)  # the ONNX frontend always gives one
    index_shape = dims(indices)
    if not index_shape and isinstance(indices, tvm.ir.Constant):
        i = int(indices.value.numpy()) % shape[axis]
        pad = [0] * (2 * len(shape))
        pad[2 * axis], pad[2 * axis + 1] = i, shape[axis] - i - 1
        return [relax.op.nn.pad(relax.op.expand_dims(output_grad, axis), pad), no_grad(indices)]
    count = math.prod(index_shape)
    grad = relax.op.reshape(output_grad, [*shape[:axis], count, *shape[axis + 1 :]])
    flat = relax.op.clip(relax.op.reshape(indices, [count]), 0, shape[axis] - 1)  # as the forward clamps them
    return [relax.op.grad.take_backward(grad, x, flat, axis), no_grad(indices)]


def _trilu_grad(orig_var, orig_call, output_grad, ctx):
    """y = tril(x, k) or triu(x, k): a mask of x's positions, so dy/dx is the same mask of the
    output gradient. TVM 0.27 has none for tril, and its triu gradient returns one partial for the
    op's two arguments (x and the PrimValue k), which its gradient pass rejects."""
    k = orig_call.args[1]
    return [relax.Call(orig_call.op, [output_grad, k]), no_grad(k)]


def _gather_nd_grad(orig_var, orig_call, output_grad, ctx):
    """y = gather_nd(x, indices) (batch_dims 0): each index tuple picks a slice of x, so dx is
    the output gradient scatter-added into zeros of x's shape (a slice picked twice gets both).
    Each index is clamped to its axis first: TVM's scatter_nd writes wherever an index points."""
    x, indices = orig_call.args
    if int(orig_call.attrs.batch_dims) != 0:
        raise ValueError("planner's gather_nd gradient takes batch_dims 0 only")
    depth = dims(indices)[-1]
    dtype = str(indices.ty.dtype)
    last = relax.const([d - 1 for d in dims(x)[:depth]], dtype)
    clamped = relax.op.minimum(relax.op.maximum(indices, relax.const(0, dtype)), last)
    return [relax.op.scatter_nd(relax.op.zeros_like(x), clamped, output_grad, "add"), no_grad(indices)]


def _gather_elements_grad(orig_var, orig_call, output_grad, ctx):
    """y = gather_elements(x, indices, axis) (`torch.gather`): dx is dy scatter-added into zeros
    of x's shape where each index points (an element picked twice gets both)."""
    x, indices = orig_call.args
    axis = int(orig_call.attrs.axis)
    zeros = relax.op.zeros_like(x)
    return [relax.op.scatter_elements(zeros, indices, output_grad, axis, reduction="add"), no_grad(indices)]


GRADIENTS: Gradients = {
    "relax.squeeze": (_squeeze_grad, False),
    "relax.strided_slice": (strided_slice_grad, False),
    "relax.tril": (_trilu_grad, False),
    "relax.gather_nd": (_gather_nd_grad, False),
    "relax.gather_elements": (_gather_elements_grad, False),
    "relax.take": (_take_grad, True),  # TVM's takes one-dimensional indices only
    "relax.triu": (_trilu_grad, True),  # TVM's returns too few partials
}
