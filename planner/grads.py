"""Which ONNX ops planner can train through, and which layers that makes trainable.

TVM's Relax gradient pass knows a fixed set of ops; an ONNX model lowers to them through the ONNX
frontend. The table below lists the ONNX ops whose lowering planner has *verified* against finite
differences (tests/test_gradients.py); anything else is refused by name before any compile, so a
user learns which node blocks which layer instead of reading a TVM traceback.

A layer is trainable when its own op has a parameter gradient and every node between it and the
model output passes a gradient to its input: ops upstream of every trainable layer need none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx

# ONNX ops whose lowering passes a gradient from output to (data) input.
PASSES_GRADIENT: frozenset[str] = frozenset(
    {
        "Add",
        "AveragePool",
        "BatchNormalization",
        "Conv",
        "Flatten",
        "Gemm",
        "GlobalAveragePool",
        "Identity",
        "MatMul",
        "MaxPool",
        "Relu",
        "Reshape",
    }
)

# ONNX ops whose parameters (initializer inputs) planner can train.
HAS_PARAM_GRADIENT: frozenset[str] = frozenset({"BatchNormalization", "Conv", "Gemm", "MatMul"})


def node_gradient_problem(node: onnx.NodeProto) -> str | None:
    """Why a gradient cannot flow through `node`, or None when it can."""
    if node.op_type not in PASSES_GRADIENT:
        return f"node '{node.name}' ({node.op_type}) has no gradient in planner"
    if node.op_type == "Conv":
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if group != 1:
            return f"node '{node.name}' (Conv, group={group}) has no gradient in planner"
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
