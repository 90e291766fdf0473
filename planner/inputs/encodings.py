"""An 8-bit input's decoding, written into the graph TVM imports (`Model.encoded`, `types.Encoding`).

The step takes the input as uint8 codes and its first operations are the float32 value the model
was exported for: `Cast`, then `Mul` by the scale and `Add` of the offset per channel. Written in
ONNX, before the import, every back end builds the same decoding and the frozen layers' row bands
(`backend.graph.bands`) cover it like any elementwise operation: only a band of the input is ever
float32 on a microcontroller.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
from onnx import helper, numpy_helper

from planner.types import Encoding


def decode_inputs(proto: onnx.ModelProto, codes: Mapping[str, Encoding]) -> None:
    """`proto`'s inputs named in `codes` made uint8 and decoded before any other node reads them (in place)."""
    g = proto.graph
    decoded: dict[str, str] = {}
    first: list[onnx.NodeProto] = []
    for value in g.input:
        code = codes.get(value.name)
        if code is None:
            continue
        name, rank = value.name, len(value.type.tensor_type.shape.dim) - 1
        value.type.tensor_type.elem_type = onnx.TensorProto.UINT8
        scale, offset = code.factors(rank)
        first += [
            helper.make_node("Cast", [name], [f"{name}:float"], name=f"decode:{name}:cast", to=onnx.TensorProto.FLOAT),
            _constant(f"{name}:scale", scale),
            helper.make_node("Mul", [f"{name}:float", f"{name}:scale"], [f"{name}:scaled"], name=f"decode:{name}:scale"),
            _constant(f"{name}:offset", offset),
            helper.make_node("Add", [f"{name}:scaled", f"{name}:offset"], [f"{name}:decoded"], name=f"decode:{name}"),
        ]
        decoded[name] = f"{name}:decoded"
    if not decoded:
        return
    for node in g.node:
        node.input[:] = [decoded.get(i, i) for i in node.input]
    nodes = first + list(g.node)
    del g.node[:]
    g.node.extend(nodes)


def _constant(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"decode:{name}", value=numpy_helper.from_array(value, name))
