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
        "Flatten",
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
        "Softmax",
        "Sub",
        "Tanh",
        "Transpose",
    }
)

# ONNX ops whose parameters (initializer inputs) planner can train.
HAS_PARAM_GRADIENT: frozenset[str] = frozenset({"Add", "BatchNormalization", "Conv", "Gemm", "LayerNormalization", "MatMul", "Mul"})


def node_gradient_problem(node: onnx.NodeProto) -> str | None:
    """Why a gradient cannot flow through `node`, or None when it can."""
    if node.op_type not in PASSES_GRADIENT:
        return f"node '{node.name}' ({node.op_type}) has no gradient in planner"
    return None


def blocking_nodes(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> dict[str, str]:
    """For each node, the first problem on its path to the model output ('' when none).

    Walks the graph backwards from the outputs: a node is blocked when any consumer of its output
    is blocked or cannot pass a gradient itself.
    """
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    result: dict[str, str] = {}
    for node in reversed(nodes):  # ONNX nodes are topologically sorted
        problem = ""
        for out in node.output:
            for user in consumers.get(out, []):
                problem = problem or result[user.name] or (node_gradient_problem(user) or "")
        result[node.name] = problem
    return result


def layer_problem(node: onnx.NodeProto, downstream: Mapping[str, str]) -> str | None:
    """Why the parameters of `node` cannot be trained, or None when they can."""
    if node.op_type not in HAS_PARAM_GRADIENT:
        return f"node '{node.name}' ({node.op_type}) has no parameter gradient in planner"
    own = node_gradient_problem(node)
    if own:
        return own
    return downstream.get(node.name) or None


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


for _op, _grad in (("relax.clip", _clip_grad), ("relax.erf", _erf_grad), ("relax.nn.gelu", _gelu_grad)):
    if tvm.ir.Op.get(_op).get_attr("FPrimalGradient") is None:
        register_gradient(_op, _grad)
register_gradient("relax.nn.relu", _relu_grad, level=11)  # replaces TVM's (level 10)
register_gradient("relax.nn.conv2d", _conv2d_grad, level=11)
