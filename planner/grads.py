"""Which ONNX ops planner can train through, and which layers that makes trainable.

TVM's Relax gradient pass knows a fixed set of ops; an ONNX model lowers to them through the ONNX
frontend. The table below lists the ONNX ops whose lowering planner has *verified* against finite
differences (tests/test_gradients.py); anything else is refused by name before any compile, so a
user learns which node blocks which layer instead of reading a TVM traceback.

A layer is trainable when its own op has a parameter gradient and every node between it and the
model output passes a gradient to its input: ops upstream of every trainable layer need none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import onnx
import tvm
from tvm import relax
from tvm.relax.op.base import register_gradient
from tvm.relax.op.grad import no_grad

# ONNX ops whose lowering passes a gradient from output to (data) input.
PASSES_GRADIENT: frozenset[str] = frozenset(
    {
        "Add",
        "AveragePool",
        "BatchNormalization",
        "Clip",
        "Concat",
        "Conv",
        "Div",
        "Erf",
        "Expand",
        "Flatten",
        "Gather",
        "Gelu",
        "Gemm",
        "GlobalAveragePool",
        "HardSigmoid",
        "HardSwish",
        "Identity",
        "LayerNormalization",
        "MatMul",
        "MaxPool",
        "Mul",
        "ReduceMean",
        "Relu",
        "Reshape",
        "Sigmoid",
        "Slice",
        "Softmax",
        "Split",
        "Squeeze",
        "Sub",
        "Tanh",
        "Transpose",
        "Unsqueeze",
        "Where",
    }
)

# ONNX ops whose parameters (initializer inputs) planner can train.
HAS_PARAM_GRADIENT: frozenset[str] = frozenset(
    {"Add", "BatchNormalization", "Concat", "Conv", "Expand", "Gather", "Gemm", "LayerNormalization", "MatMul", "Mul", "Sub"}
)


def node_gradient_problem(node: onnx.NodeProto) -> str | None:
    """Why a gradient cannot flow through `node`, or None when it can."""
    if node.op_type not in PASSES_GRADIENT:
        return f"node '{node.name}' ({node.op_type}) has no gradient in planner"
    return None


_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})


def blocking_nodes(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str], types: Mapping[str, int]) -> dict[str, str]:
    """For each node, the first problem on its path to the model output ('' when none).

    Walks the graph backwards from the outputs: a node is blocked when any consumer of its output
    is blocked or cannot pass a gradient itself. No gradient flows along an integer or boolean
    tensor (an index, a mask), so such edges block nothing.
    """
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    result: dict[str, str] = {}
    for node in reversed(nodes):  # ONNX nodes are topologically sorted
        problem = ""
        for out in node.output:
            if types.get(out, onnx.TensorProto.FLOAT) not in _FLOAT_TYPES:
                continue
            for user in consumers.get(out, []):
                problem = problem or result[user.name] or (node_gradient_problem(user) or "")
        result[node.name] = problem
    return result


def layer_problem(nodes: Sequence[onnx.NodeProto], downstream: Mapping[str, str]) -> str | None:
    """Why the parameters a layer's `nodes` take cannot be trained, or None when they can."""
    for node in nodes:
        if node.op_type not in HAS_PARAM_GRADIENT:
            return f"node '{node.name}' ({node.op_type}) has no parameter gradient in planner"
        own = node_gradient_problem(node)
        if own:
            return own
    return next((downstream[n.name] for n in nodes if downstream.get(n.name)), None)


# --- Gradients TVM 0.27 lacks, or keeps more memory for, registered with Relax's own mechanism ----
# Each is checked against float64 finite differences in tests/test_gradients.py.
#
# ReLU and Clip (ReLU6) take their mask from the output, as PyTorch's in-place ReLU does: TVM's
# own ReLU gradient reads the input, so the backward pass kept every pre-activation alive next to
# the activation itself — one activation tensor too many per ReLU, and the input of a fused
# conv + BN + ReLU kernel is exactly the tensor fusion would not otherwise have to write.


def _relu_grad(orig_var, orig_call, output_grad, ctx):
    """y = max(x, 0): dy/dx = 1 where y > 0."""
    zero = relax.const(0.0, orig_var.ty.dtype)
    return [relax.op.where(relax.op.greater(orig_var, zero), output_grad, relax.op.zeros_like(output_grad))]


def _clip_grad(orig_var, orig_call, output_grad, ctx):
    """y = clip(x, lo, hi): dy/dx = 1 where lo < y < hi (ReLU6, HardSwish, HardSigmoid)."""
    _, lo, hi = orig_call.args
    dtype = orig_var.ty.dtype

    def bound(prim: relax.PrimValue) -> relax.Constant:
        return relax.const(float(getattr(prim.value, "value", prim.value)), dtype)

    inside = relax.op.logical_and(relax.op.greater(orig_var, bound(lo)), relax.op.less(orig_var, bound(hi)))
    return [relax.op.where(inside, output_grad, relax.op.zeros_like(output_grad)), no_grad(lo), no_grad(hi)]


def _erf_grad(orig_var, orig_call, output_grad, ctx):
    """y = erf(x): dy/dx = 2/sqrt(pi) * exp(-x^2)."""
    x = orig_call.args[0]
    dtype = x.ty.dtype
    return [output_grad * relax.const(2.0 / math.sqrt(math.pi), dtype) * relax.op.exp(relax.op.negative(x * x))]


def _gelu_grad(orig_var, orig_call, output_grad, ctx):
    """y = x * Phi(x): dy/dx = Phi(x) + x * phi(x), Phi the normal CDF, phi its density."""
    x = orig_call.args[0]
    dtype = x.ty.dtype
    half = relax.const(0.5, dtype)
    cdf = half * (relax.const(1.0, dtype) + relax.op.erf(x * relax.const(1.0 / math.sqrt(2.0), dtype)))
    pdf = relax.const(1.0 / math.sqrt(2.0 * math.pi), dtype) * relax.op.exp(relax.op.negative(half * x * x))
    return [output_grad * (cdf + x * pdf)]


_TVM_CONV2D_GRAD = tvm.ir.Op.get("relax.nn.conv2d").get_attr("FPrimalGradient")


def _conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """TVM's conv2d gradient, over the padding the convolution really reads.

    A strided convolution can leave its last padded rows and columns unread (3x3, stride 2, pad 1
    on an even size: the bottom and right padding). TVM's weight gradient is a convolution over the
    full padding that yields a 4x4 kernel and slices it to 3x3 — 16/9 of the work, and the
    slice a kernel of its own. The same convolution with the unread padding dropped has the same
    output and an exact weight gradient (and its input gradient needs no output padding).
    """
    a = orig_call.attrs
    data, weight = orig_call.args
    trimmed = list(a.padding)
    for axis, (before, after) in enumerate(((0, 2), (1, 3))):
        size, kernel = int(data.ty.shape[2 + axis]), int(weight.ty.shape[2 + axis])
        span = (kernel - 1) * int(a.dilation[axis]) + 1
        unread = (size + int(a.padding[before]) + int(a.padding[after]) - span) % int(a.strides[axis])
        trimmed[after] = int(a.padding[after]) - min(int(a.padding[after]), unread)
    if trimmed != [int(p) for p in a.padding]:
        orig_call = relax.op.nn.conv2d(
            data, weight, a.strides, trimmed, a.dilation, a.groups, a.data_layout, a.kernel_layout, a.out_layout, a.out_dtype
        )
    return _TVM_CONV2D_GRAD(orig_var, orig_call, output_grad, ctx)



def _shape(expr: relax.Expr) -> list[int]:
    return [int(d) for d in expr.ty.shape]


def _squeeze_grad(orig_var, orig_call, output_grad, ctx):
    """y = squeeze(x): dy/dx puts the removed unit axes back."""
    return [relax.op.reshape(output_grad, _shape(orig_call.args[0]))]


def _ints(expr: relax.Expr) -> list[int]:
    """The integers of a strided_slice argument (a tuple of PrimValues or a shape)."""
    items = expr.fields if isinstance(expr, relax.Tuple) else expr.values
    return [int(getattr(v, "value", v)) for v in items]


def _strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """y = x[begin:end:stride] along `axes`: dy/dx is the output gradient placed back where the
    slice came from, zeros elsewhere — padding for unit strides, a scatter per strided axis."""
    x, axes, begin, end, *rest = orig_call.args
    shape = _shape(x)
    strides = _ints(rest[0]) if rest else [1] * len(_ints(axes))
    grad = output_grad
    pad = [0] * (2 * len(shape))
    for axis, b, e, s in zip(_ints(axes), _ints(begin), _ints(end), strides):
        axis %= len(shape)
        if s < 1:
            raise ValueError("planner has no gradient for a reversing slice (negative step)")
        start = min(max(b + shape[axis] if b < 0 else b, 0), shape[axis])
        stop = min(max(e + shape[axis] if e < 0 else e, 0), shape[axis])
        taken = len(range(start, stop, s))
        if s == 1:
            pad[2 * axis], pad[2 * axis + 1] = start, shape[axis] - start - taken
            continue
        full = _shape(grad)
        full[axis] = shape[axis]
        zeros = relax.op.zeros(full, x.ty.dtype)
        grad = ctx.normalize(relax.op.slice_scatter(zeros, grad, start, start + (taken - 1) * s + 1, s, axis))
    if any(pad):
        grad = relax.op.nn.pad(grad, pad)
    return [grad, no_grad(axes), no_grad(begin), no_grad(end), *(no_grad(r) for r in rest)]


def _take_grad(orig_var, orig_call, output_grad, ctx):
    """y = take(x, indices, axis). A scalar index (a class-token select, `qkv[0]`) puts the
    gradient back as one slice, zero-padded; an index tensor of any rank is flattened to the
    one-dimensional form TVM's scatter-add (`take_backward`) accepts."""
    x, indices = orig_call.args
    shape = _shape(x)
    axis = int(orig_call.attrs.axis) % len(shape) if orig_call.attrs.axis is not None else None
    if axis is None:  # take over the flattened tensor
        flat = relax.op.reshape(x, [-1])
        grad = relax.op.grad.take_backward(relax.op.reshape(output_grad, [-1]), flat, relax.op.reshape(indices, [-1]), 0)
        return [relax.op.reshape(grad, shape), no_grad(indices)]
    index_shape = _shape(indices)
    if not index_shape and isinstance(indices, tvm.ir.Constant):
        i = int(indices.value.numpy()) % shape[axis]
        pad = [0] * (2 * len(shape))
        pad[2 * axis], pad[2 * axis + 1] = i, shape[axis] - i - 1
        return [relax.op.nn.pad(relax.op.expand_dims(output_grad, axis), pad), no_grad(indices)]
    count = 1
    for d in index_shape:
        count *= d
    grad = relax.op.reshape(output_grad, [*shape[:axis], count, *shape[axis + 1 :]])
    return [relax.op.grad.take_backward(grad, x, relax.op.reshape(indices, [count]), axis), no_grad(indices)]


def _layer_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = (x - mean) * rstd * gamma + beta over `axes`, mean and rstd recomputed from x:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma; dgamma and dbeta are
    dy * xhat and dy summed over the other axes."""
    x, gamma, beta = orig_call.args
    a = orig_call.attrs
    rank = len(_shape(x))
    axes = sorted(int(d) % rank for d in a.axes)
    dtype = x.ty.dtype
    mean = relax.op.mean(x, axes, keepdims=True)
    centred = x - mean
    rstd = relax.op.rsqrt(relax.op.mean(centred * centred, axes, keepdims=True) + relax.const(float(a.epsilon), dtype))
    xhat = centred * rstd
    g = output_grad * gamma if a.scale else output_grad
    dx = rstd * (g - relax.op.mean(g, axes, keepdims=True) - xhat * relax.op.mean(g * xhat, axes, keepdims=True))
    others = [d for d in range(rank) if d not in axes]
    dgamma = relax.op.reshape(relax.op.sum(output_grad * xhat, others), _shape(gamma))
    dbeta = relax.op.reshape(relax.op.sum(output_grad, others), _shape(beta))
    return [dx, dgamma if a.scale else no_grad(gamma), dbeta if a.center else no_grad(beta)]


for _op, _grad in (
    ("relax.clip", _clip_grad),
    ("relax.erf", _erf_grad),
    ("relax.nn.gelu", _gelu_grad),
    ("relax.squeeze", _squeeze_grad),
    ("relax.strided_slice", _strided_slice_grad),
    ("relax.nn.layer_norm", _layer_norm_grad),
):
    if tvm.ir.Op.get(_op).get_attr("FPrimalGradient") is None:
        register_gradient(_op, _grad)
register_gradient("relax.nn.relu", _relu_grad, level=11)  # replaces TVM's (level 10)
register_gradient("relax.nn.conv2d", _conv2d_grad, level=11)
register_gradient("relax.take", _take_grad, level=11)  # TVM's takes one-dimensional indices only
