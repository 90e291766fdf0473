"""Which ONNX ops planner can train through, and which layers that makes trainable.

TVM's Relax gradient pass knows a fixed set of ops (planner adds the ones it lacks:
`planner.grads`); an ONNX model lowers to them through the ONNX frontend. The tables below list
the ONNX ops whose lowering planner has *verified* against finite differences
(tests/test_gradients.py); anything else is refused by name before any compile, so a user learns
which node blocks which layer instead of reading a TVM traceback.

A layer is trainable when its own op has a parameter gradient and every node between it and the
model output passes a gradient to its input: ops before every trained layer need none (they run
outside the differentiated part of the step). This module reads ONNX only — loading a model never
imports TVM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

# ONNX ops whose lowering passes a gradient from output to (data) input.
PASSES_GRADIENT: frozenset[str] = frozenset(
    {
        "Add",
        "AveragePool",
        "BatchNormalization",
        "Cast",
        "Clip",
        "Concat",
        "Conv",
        "Div",
        "Erf",
        "Expand",
        "Flatten",
        "Gather",
        "GatherND",
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
        "Neg",
        "Pow",
        "Reciprocal",
        "ReduceMean",
        "ReduceSum",
        "Relu",
        "Reshape",
        "Sigmoid",
        "Slice",
        "Softmax",
        "Split",
        "Sqrt",
        "Squeeze",
        "Sub",
        "Tanh",
        "Transpose",
        "Trilu",
        "Unsqueeze",
        "Where",
    }
)

# ONNX ops whose parameters (initializer inputs) planner can train.
HAS_PARAM_GRADIENT: frozenset[str] = frozenset(
    {"Add", "BatchNormalization", "Concat", "Conv", "Expand", "Gather", "Gemm", "LayerNormalization", "MatMul", "Mul", "Sub"}
)


def node_gradient_problem(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> str | None:
    """Why a gradient cannot flow through `node`, or None when it can (`constants`: the values
    of the graph's constant tensors, for ops whose gradient depends on them)."""
    if node.op_type not in PASSES_GRADIENT:
        return f"node '{node.name}' ({node.op_type}) has no gradient in planner"
    steps = constants.get(node.input[4]) if node.op_type == "Slice" and len(node.input) > 4 else None
    if steps is not None and (np.asarray(steps) < 0).any():
        return f"node '{node.name}' (Slice) reverses a tensor (a negative step): no gradient in planner"
    # x ** e passes dx = e * x ** (e - 1) * dy; a computed exponent would need de = y * ln(x) * dy,
    # undefined (NaN) wherever x <= 0, as a squared or cubed activation has it half the time.
    if node.op_type == "Pow" and node.input[1] not in constants:
        return f"node '{node.name}' (Pow) has a computed exponent: planner differentiates x ** constant only"
    batch_dims = next((a.i for a in node.attribute if a.name == "batch_dims"), 0)
    if node.op_type == "GatherND" and batch_dims:
        return f"node '{node.name}' (GatherND) has batch_dims {batch_dims}: planner differentiates batch_dims 0 only"
    return None


_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})


def blocking_nodes(
    nodes: Sequence[onnx.NodeProto], outputs: Sequence[str], types: Mapping[str, int], constants: Mapping[str, np.ndarray]
) -> dict[str, str]:
    """For each node, the first problem on its path to the model output ('' when none).

    Walks the graph backwards from the outputs: a node is blocked when any consumer of its output
    is blocked or cannot pass a gradient itself. A gradient flows only along float tensors the
    outputs depend on through float tensors: an integer or boolean tensor (an index, a mask) blocks
    nothing, and neither does a consumer whose outputs reach the outputs through such tensors only
    (a comparison, an argmax, or a ReduceMax whose result is only compared).
    """

    def carries_gradient(name: str) -> bool:
        return types.get(name, onnx.TensorProto.FLOAT) in _FLOAT_TYPES

    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    # the float tensors a gradient reaches, grown backwards from the outputs
    reached = set(filter(carries_gradient, outputs))
    result: dict[str, str] = {}
    for node in reversed(nodes):  # ONNX nodes are topologically sorted
        problem = ""
        for out in filter(carries_gradient, node.output):
            for user in consumers.get(out, []):
                if any(name in reached for name in user.output):
                    reached.add(out)
                    problem = problem or result[user.name] or (node_gradient_problem(user, constants) or "")
        result[node.name] = problem
    return result


def layer_problem(
    nodes: Sequence[onnx.NodeProto], downstream: Mapping[str, str], constants: Mapping[str, np.ndarray]
) -> str | None:
    """Why the parameters a layer's `nodes` take cannot be trained, or None when they can."""
    for node in nodes:
        if node.op_type not in HAS_PARAM_GRADIENT:
            return f"node '{node.name}' ({node.op_type}) has no parameter gradient in planner"
        own = node_gradient_problem(node, constants)
        if own:
            return own
    return next((downstream[n.name] for n in nodes if downstream.get(n.name)), None)
