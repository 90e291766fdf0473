"""Gradients of reductions: the maximum and minimum over axes, and stacking (how TVM imports the
ONNX `Max`, `Min`, `Sum` and `Mean` of several tensors)."""

from __future__ import annotations

from tvm import relax

from planner.backend.graph.gradients._common import Gradients, dims


def _extreme_grad(orig_var, orig_call, output_grad, ctx):
    """y = max (or min) of x over `axis`: the gradient goes to the elements equal to the result,
    shared equally among ties (as PyTorch's `amax` shares it). The comparison is exact: y is one
    of the x it came from."""
    x = orig_call.args[0]
    shape = dims(x)
    axes = list(range(len(shape))) if orig_call.attrs.axis is None else [int(a) % len(shape) for a in orig_call.attrs.axis]
    kept = [1 if i in axes else d for i, d in enumerate(shape)]
    y, dy = relax.op.reshape(orig_var, kept), relax.op.reshape(output_grad, kept)
    hit = relax.op.astype(relax.op.equal(x, y), x.ty.dtype)
    return [hit * dy / relax.op.sum(hit, axes, keepdims=True)]


def _stack_grad(orig_var, orig_call, output_grad, ctx):
    """y = stack(x_1, ..., x_n, axis): x_i's gradient is slice i of dy along `axis`, that axis removed."""
    tensors = orig_call.args[0]
    axis = int(orig_call.attrs.axis) % len(dims(orig_var))
    count = len(tensors.fields)
    parts = relax.op.split(output_grad, count, axis)
    return [relax.Tuple([relax.op.squeeze(relax.TupleGetItem(parts, i), [axis]) for i in range(count)])]


GRADIENTS: Gradients = {
    "relax.max": (_extreme_grad, False),
    "relax.min": (_extreme_grad, False),
    "relax.stack": (_stack_grad, False),
}
