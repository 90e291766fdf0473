"""Which layers a model's operators let planner train, read off the operator table.

A layer is trainable when each of its own nodes passes a gradient into the input its parameter
fills, and every node between it and the model output passes a gradient into the input the path
enters by (`planner.inputs.operators`): ops before every trained layer need none (they run
outside the differentiated part of the step). This module reads ONNX only — loading a model never
imports TVM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from planner.inputs.operators import Node, gradient_problem, operator

_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})


class Graph:
    """An analysed graph (as TVM will import it) with what the table's forms are told apart by."""

    def __init__(
        self,
        nodes: Sequence[onnx.NodeProto],
        types: Mapping[str, int],
        constants: Mapping[str, np.ndarray],
        ranks: Mapping[str, int],
    ) -> None:
        self.nodes = list(nodes)
        self.types = types
        self.constants = constants
        self.ranks = ranks
        # a fake quantization's integers pass the gradient on, straight through (a QDQ model's QuantizeLinear)
        self.straight = {out for n in self.nodes if (row := operator(n)) is not None and row.straight_through for out in n.output}

    def view(self, node: onnx.NodeProto) -> Node:
        return Node(node, self.constants, self.ranks)

    def carries_gradient(self, name: str) -> bool:
        return name in self.straight or self.types.get(name, onnx.TensorProto.FLOAT) in _FLOAT_TYPES


def blocking_nodes(graph: Graph, outputs: Sequence[str]) -> dict[str, str]:
    """For each node, the first problem on its path to the model output ('' when none).

    Walks the graph backwards from the outputs: a node is blocked when any consumer of its output
    is blocked or cannot pass a gradient into the input that output fills. A gradient flows only
    along float tensors the outputs depend on through float tensors: an integer or boolean tensor
    (an index, a mask) blocks nothing, and neither does a consumer whose outputs reach the outputs
    through such tensors only (a comparison, an argmax, or a ReduceMax whose result is only
    compared), nor a step function's (a Sign, a Floor: its gradient is zero, as PyTorch's). A
    node none of whose outputs reaches the outputs otherwise gets no gradient at all: that is its
    problem (a parameter used only to build a mask would never move).
    """
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.nodes:
        for slot, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, slot))
    # the float tensors a gradient reaches, grown backwards from the outputs
    reached = set(filter(graph.carries_gradient, outputs))
    result: dict[str, str] = {}
    dead: dict[str, str] = {}  # a node no gradient reaches -> where its paths end, as its problem says
    for node in reversed(graph.nodes):  # ONNX nodes are topologically sorted
        problem, ends = "", []  # ends: why a gradient does not come back through a consumer
        for out in filter(graph.carries_gradient, node.output):
            for user, slot in consumers.get(out, []):
                row = operator(user)
                if not any(name in reached for name in user.output):
                    past = f"passes node '{user.name}' ({user.op_type}), past which no float tensor reaches it"
                    ends.append(dead.get(user.name, past) if any(map(graph.carries_gradient, user.output)) else past)
                elif row is not None and row.zero_gradient:  # a step function: nothing comes back, nothing is blocked
                    ends.append(f"passes node '{user.name}' ({user.op_type}), whose gradient is zero")
                else:
                    reached.add(out)
                    problem = problem or result[user.name] or (gradient_problem(graph.view(user), slot) or "")
        if not any(out in reached for out in node.output) and node.output:
            dead[node.name] = ends[0] if ends else "does not exist"
            problem = f"node '{node.name}' ({node.op_type}) gets no gradient: its path to the output {dead[node.name]}"
        result[node.name] = problem
    return result


def layer_problem(graph: Graph, nodes: Sequence[onnx.NodeProto], params: set[str], downstream: Mapping[str, str]) -> str | None:
    """Why the parameters `params` that a layer's `nodes` take cannot be trained, or None when they can."""
    for node in nodes:
        for slot, name in enumerate(node.input):
            if name in params and (problem := gradient_problem(graph.view(node), slot)):
                return problem
    return next((downstream[n.name] for n in nodes if downstream.get(n.name)), None)
