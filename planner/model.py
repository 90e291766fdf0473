"""Load and validate an ONNX classifier, and describe its layers.

planner trains models with one image-like input whose first dimension is the batch and one
`[batch, classes]` logits output. Everything else about a model (layers, parameters, shapes,
which layers can be trained) is read here once, so later stages never re-parse ONNX.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import BadInput
from .grads import blocking_nodes, layer_problem

# Which initializer inputs of an op are its weight and its bias; the rest are frozen buffers.
_WEIGHT_BIAS_SLOTS: dict[str, tuple[int | None, int | None]] = {
    "Conv": (1, 2),
    "Gemm": (1, 2),
    "MatMul": (1, None),
    "BatchNormalization": (1, 2),  # scale, bias; running mean/var (3, 4) stay frozen
    "LayerNormalization": (1, 2),  # scale, bias
}
_ELEMENTWISE_PARAM = {"Add", "Mul"}  # a bias added after MatMul, a learned scale


@dataclass(frozen=True)
class Layer:
    """One ONNX node that owns parameters."""

    name: str
    op: str
    weight: str | None
    bias: str | None
    buffers: tuple[str, ...]
    param_shapes: dict[str, tuple[int, ...]]
    param_bytes: int
    output_shape: tuple[int | str, ...]
    problem: str | None  # why planner cannot train it; None when it can
    out_axis: int | None = None  # the weight's output-channel axis (Conv, Gemm, MatMul)

    @property
    def trainable(self) -> bool:
        return self.problem is None

    def params_for(self, mode: str) -> tuple[str, ...]:
        """Parameters updated by a layer in `mode` (`full`: weight and bias, `bias`, `weight`)."""
        if mode == "full" or mode.startswith("ratio"):  # ratio: a slice of the weight, all the bias
            return tuple(p for p in (self.weight, self.bias) if p)
        if mode == "bias":
            return (self.bias,) if self.bias else ()
        if mode == "weight":
            return (self.weight,) if self.weight else ()
        raise ValueError(f"unknown update mode {mode!r}")


@dataclass
class Model:
    """A validated ONNX classifier."""

    path: Path
    proto: onnx.ModelProto
    sha256: str
    input_name: str
    input_shape: tuple[int, ...]  # without the batch dimension
    n_classes: int
    layers: list[Layer]

    @cached_property
    def initializers(self) -> dict[str, np.ndarray]:
        """Every float initializer by ONNX name, in graph order (the order TVM imports them)."""
        return {t.name: numpy_helper.to_array(t) for t in self.proto.graph.initializer}

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise BadInput(f"model has no layer named {name!r} (see `planner inspect {self.path}`)")


def load_model(path: str | Path) -> Model:
    """Read, check and normalize an ONNX classifier, or raise BadInput saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"model file not found: {path}")
    raw = path.read_bytes()
    try:
        proto = onnx.load_from_string(raw)
        onnx.checker.check_model(proto)
    except Exception as exc:  # onnx raises several unrelated types for corrupt files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInput(f"{path} is not a valid ONNX model: {first}") from None
    _normalize(proto)
    graph = proto.graph
    init_names = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init_names]
    if len(inputs) != 1:
        raise BadInput(f"{path}: planner needs exactly one model input, found {len(inputs)}")
    dims = inputs[0].type.tensor_type.shape.dim
    if len(dims) < 2:
        raise BadInput(f"{path}: input '{inputs[0].name}' must be [batch, ...], got rank {len(dims)}")
    if any(not d.HasField("dim_value") for d in dims[1:]):
        raise BadInput(f"{path}: input '{inputs[0].name}' has dynamic non-batch dimensions")
    if len(graph.output) != 1:
        raise BadInput(f"{path}: planner needs exactly one output (logits), found {len(graph.output)}")
    out_dims = graph.output[0].type.tensor_type.shape.dim
    if len(out_dims) != 2 or not out_dims[1].HasField("dim_value"):
        raise BadInput(f"{path}: output '{graph.output[0].name}' must be logits of shape [batch, classes]")
    return Model(
        path=path.resolve(),
        proto=proto,
        sha256=hashlib.sha256(raw).hexdigest(),
        input_name=inputs[0].name,
        input_shape=tuple(d.dim_value for d in dims[1:]),
        n_classes=out_dims[1].dim_value,
        layers=_layers(proto),
    )


def _normalize(proto: onnx.ModelProto) -> None:
    """Name unnamed nodes and turn non-float initializers (shapes, axes) into Constant nodes.

    planner addresses layers by node name, and TVM imports every initializer as a function
    parameter when parameters are kept as inputs — a Reshape's shape must stay a constant.
    """
    graph = proto.graph
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)
    consts = [t for t in graph.initializer if t.data_type != onnx.TensorProto.FLOAT]
    for t in consts:
        graph.initializer.remove(t)
        graph.node.insert(0, onnx.helper.make_node("Constant", [], [t.name], name=f"const_{t.name}", value=t))
    for name in [t.name for t in consts]:
        for graph_input in list(graph.input):
            if graph_input.name == name:
                graph.input.remove(graph_input)


def _layers(proto: onnx.ModelProto) -> list[Layer]:
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:
        raise BadInput(f"ONNX shape inference failed: {str(exc).splitlines()[0]}") from None
    shapes: dict[str, tuple[int | str, ...]] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in vi.type.tensor_type.shape.dim)
    downstream = blocking_nodes(list(graph.node), [o.name for o in graph.output])
    layers = []
    for node in graph.node:
        owned = [name for name in node.input if name in inits]
        if not owned:
            continue
        w_slot, b_slot = _WEIGHT_BIAS_SLOTS.get(node.op_type, (None, None))
        if node.op_type in _ELEMENTWISE_PARAM:  # x + b, x * w: the initializer may stand on either side
            slot = 0 if node.input[0] in inits else 1
            w_slot, b_slot = (slot, None) if node.op_type == "Mul" else (None, slot)
        weight = node.input[w_slot] if w_slot is not None and len(node.input) > w_slot and node.input[w_slot] in inits else None
        bias = node.input[b_slot] if b_slot is not None and len(node.input) > b_slot and node.input[b_slot] in inits else None
        buffers = tuple(n for n in owned if n not in (weight, bias))
        param_shapes = {n: tuple(inits[n].dims) for n in owned}
        nbytes = sum(int(np.prod(s, dtype=np.int64)) * 4 for s in param_shapes.values())
        out_axis = {"Conv": 0, "MatMul": 1}.get(node.op_type)
        if node.op_type == "Gemm":
            out_axis = 0 if any(a.name == "transB" and a.i for a in node.attribute) else 1
        layers.append(
            Layer(
                name=node.name,
                op=node.op_type,
                weight=weight,
                bias=bias,
                buffers=buffers,
                param_shapes=param_shapes,
                param_bytes=nbytes,
                output_shape=shapes.get(node.output[0], ()),
                out_axis=out_axis if weight else None,
                problem=layer_problem(node, downstream) if (weight or bias) else f"node '{node.name}' ({node.op_type}) has no trainable parameters",
            )
        )
    return layers


def save_onnx(model: Model, weights: dict[str, np.ndarray], path: str | Path) -> None:
    """Write `model` with its initializers replaced by `weights` (same names, shapes, dtypes)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    for i, tensor in enumerate(proto.graph.initializer):
        if tensor.name in weights:
            value = np.asarray(weights[tensor.name], dtype=numpy_helper.to_array(tensor).dtype)
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(value, tensor.name))
    onnx.save(proto, str(path))
