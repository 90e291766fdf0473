"""What every rewrite uses: a writer of the replacing nodes and what is known around the node."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

Shapes = Mapping[str, tuple[int, ...]]


class Writer:
    """Nodes replacing one node: names derived from the original's, so messages still point at it."""

    def __init__(self, node: onnx.NodeProto) -> None:
        self.node = node
        self.nodes: list[onnx.NodeProto] = []
        self._count = itertools.count()

    def fresh(self, what: str) -> str:
        return f"{self.node.name}/{what}_{next(self._count)}"

    def const(self, value: np.ndarray | list, what: str = "c") -> str:
        name = self.fresh(what)
        self.nodes.append(
            helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(value), name))
        )
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        out = output or self.fresh(op_type.lower())
        self.nodes.append(
            helper.make_node(op_type, inputs, [out], name=out if output is None else self.fresh(op_type.lower()), **attrs)
        )
        return out

    def slice(self, x: str, axis: int, start: int, end: int, step: int = 1) -> str:
        return self.op("Slice", [x, self.const([start]), self.const([end]), self.const([axis]), self.const([step])])


class Context:
    def __init__(self, values: Mapping[str, np.ndarray], shapes: Shapes, types: Mapping[str, int], opset: int) -> None:
        self.values, self.shapes, self.types, self.opset = values, shapes, types, opset

    def const(self, node: onnx.NodeProto, slot: int) -> np.ndarray | None:
        if slot >= len(node.input) or not node.input[slot]:
            return None
        return self.values.get(node.input[slot])

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name)

    def dtype(self, name: str) -> np.dtype:
        return helper.tensor_dtype_to_np_dtype(self.types.get(name, onnx.TensorProto.FLOAT))


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default
