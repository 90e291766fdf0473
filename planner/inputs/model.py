"""Load and validate an ONNX classifier, and describe its layers.

planner trains models whose inputs (an image, features, token ids and an attention mask) all
have the batch as their first dimension, with one `[batch, classes]` logits output. Everything else about a model (layers, parameters, shapes,
which layers can be trained) is read here once, so later stages never re-parse ONNX.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from planner import modes
from planner.errors import BadInput, UnsupportedOp, first_line
from planner.inputs.fixups import constant_values, for_import, name_nodes, tensor_ranks, tensor_types, tie_identities
from planner.inputs.names import folded_values, layer_name, standalone_name
from planner.inputs.operators import layer_slots, refused
from planner.inputs.trainability import Graph, blocking_nodes, layer_problem
from planner.types import Mode, ModelInput

# The batch the layer table is analysed at: the ops left once shapes are folded are the same at any batch;
# and the length every dynamic length (a sequence) is analysed at, for the same reason.
_ANALYSIS_BATCH = 1
_ANALYSIS_LENGTH = 8


@dataclass(frozen=True)
class Layer:
    """Parameters PyTorch keeps in one module (a convolution, a Linear — in ONNX a MatMul and the
    Add of its bias —, a norm, attention's input projection), or one parameter used on its own (a
    class token, a positional embedding), with the ONNX nodes that use them."""

    name: str  # the PyTorch module path (or parameter name) where the model records it
    op: str
    nodes: tuple[str, ...]  # ONNX node names; schemes and spaces accept these too
    weight: str | None
    bias: str | None
    buffers: tuple[str, ...]
    param_shapes: dict[str, tuple[int, ...]]
    param_bytes: int
    output_shape: tuple[int | str, ...]
    problem: str | None  # why planner cannot train it; None when it can
    out_axis: int | None = None  # the weight's output-channel axis (Conv, Gemm, MatMul)
    # other nodes the ONNX file gives the same parameters (tied weights, or equal tensors the
    # exporter stored once): they train together, the gradient summed over every use
    shared_by: tuple[str, ...] = ()

    @property
    def trainable(self) -> bool:
        return self.problem is None

    def params_for(self, mode: Mode | str) -> tuple[str, ...]:
        """Parameters updated by this layer in `mode` (`planner.modes`: `full` its weight and bias,
        `bias`, `weight`, `ratio` a slice of the weight and all the bias, `lora` the weight
        through an adapter merged into it, `frozen` none)."""
        kind = mode.kind if isinstance(mode, Mode) else str(mode).partition(":")[0]
        return modes.get(kind).params(self)


@dataclass
class Model:
    """A validated ONNX classifier."""

    path: Path
    proto: onnx.ModelProto  # the model's graph with its weights loaded, nodes named, ties undone
    sha256: str  # of the model file and its external data files
    data_files: tuple[str, ...]  # external data files, relative to the model's folder
    inputs: tuple[ModelInput, ...]  # every graph input that is not an initializer, in graph order
    fixed_batch: int | None  # the batch the model was exported with, when it is not symbolic
    n_classes: int
    parameters: tuple[str, ...]  # initializers that are parameters, in graph order
    layers: list[Layer]
    lengths: dict[str, int] = field(default_factory=dict)  # dynamic input lengths bound (`bind`)

    @property
    def key(self) -> str:
        """What identifies the model a step is built from: its files and the lengths bound."""
        if not self.lengths:
            return self.sha256
        return hashlib.sha256(json.dumps([self.sha256, sorted(self.lengths.items())]).encode()).hexdigest()

    @property
    def unbound(self) -> tuple[str, ...]:
        """The dynamic lengths (a sequence length) no data has bound yet."""
        return tuple(dict.fromkeys(d for i in self.inputs for d in i.shape if isinstance(d, str)))

    def bind(self, shapes: Sequence[Sequence[int]], where: str) -> Model:
        """The model with its dynamic lengths set from `shapes`, one per input (after the batch):
        the lengths the data has, as the batch is the candidate's. A fixed length must equal the
        data's, and two inputs sharing a length (`input_ids`, `attention_mask`) must agree;
        else BadInput naming `where` (the data)."""
        if len(shapes) != len(self.inputs):
            raise BadInput(f"{where}: {len(shapes)} arrays for the model's {len(self.inputs)} inputs")
        lengths: dict[str, int] = {}
        for spec, shape in zip(self.inputs, shapes):
            if len(shape) != len(spec.shape):
                raise BadInput(f"{where}: samples of shape {tuple(shape)}, the model's input '{spec.name}' needs {spec.shape}")
            for dim, size in zip(spec.shape, shape):
                fixed = dim if isinstance(dim, int) else lengths.setdefault(dim, int(size))
                if fixed != size:
                    raise BadInput(
                        f"{where}: samples of shape {tuple(shape)}, the model's input '{spec.name}' needs {spec.shape}"
                        + (f" with {dim} = {fixed} as in the other inputs" if isinstance(dim, str) else "")
                    )
        bound = {k: v for k, v in lengths.items() if k in self.unbound}
        if not bound:
            return self
        inputs = tuple(
            replace(i, shape=tuple(bound.get(d, d) if isinstance(d, str) else d for d in i.shape)) for i in self.inputs
        )
        return replace(self, inputs=inputs, lengths={**self.lengths, **bound})

    @cached_property
    def initializers(self) -> dict[str, np.ndarray]:
        """Every parameter by ONNX name, in graph order (the order TVM imports them)."""
        wanted = set(self.parameters)
        return {t.name: numpy_helper.to_array(t) for t in self.proto.graph.initializer if t.name in wanted}

    @property
    def only_input(self) -> ModelInput:
        """The model's one input, for data that has one array per sample (images, `x` arrays)."""
        if len(self.inputs) != 1:
            names = ", ".join(i.name for i in self.inputs)
            raise BadInput(
                f"{self.path.name} takes {len(self.inputs)} inputs ({names}): give one array per input, named as the input"
            )
        return self.inputs[0]

    @property
    def image_shape(self) -> tuple[int, ...]:
        """The one input's shape, which images are made into (they need a fixed size)."""
        spec = self.only_input
        if spec.shape != (shape := tuple(d for d in spec.shape if isinstance(d, int))):
            raise BadInput(f"{self.path.name}: input '{spec.name}' {spec.shape} has dynamic sizes; images need a fixed size")
        return shape

    @property
    def data_paths(self) -> dict[str, Path]:
        """Each external data file: its name as the model refers to it -> where it is."""
        return {location: self.path.parent / location for location in self.data_files}

    def import_proto(self, batch: int) -> onnx.ModelProto:
        """The graph as TVM imports it for a step of `batch` samples (see `planner.fixups`): a
        fresh copy, weights included, for the importer to read once."""
        if self.unbound:
            raise BadInput(
                f"{self.path.name}: its inputs' lengths {', '.join(self.unbound)} are bound by the data; load data first"
            )
        return for_import(self.proto, batch, set(self.parameters), self.lengths)

    def layer(self, name: str) -> Layer:
        """A layer by its name, or by the name of an ONNX node in it."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        for layer in self.layers:
            if name in layer.nodes:
                return layer
        raise BadInput(f"model has no layer named {name!r} (see `planner inspect {self.path}`)")


def load_model(path: str | Path) -> Model:
    """Read, check and normalize an ONNX classifier, or raise BadInput saying what is wrong.

    External data (the `NAME.onnx.data` file torch's exporter writes beside the model) is read
    from beside the model wherever planner runs, and is part of the model's hash."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"model file not found: {path}")
    raw = path.read_bytes()
    try:
        proto = onnx.load_from_string(raw)
    except Exception as exc:  # onnx raises several unrelated types for corrupt files
        raise BadInput(f"{path} is not a valid ONNX model: {first_line(exc)}") from None
    data_files = _external_data(proto, path)
    digest = hashlib.sha256(raw)
    for location in data_files:
        digest.update(location.encode() + b"\0")
        with open(path.parent / location, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    try:
        if data_files:
            external_data_helper.load_external_data_for_model(proto, str(path.parent))
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise BadInput(f"{path} is not a valid ONNX model: {first_line(exc)}") from None
    name_nodes(proto.graph)
    tie_identities(proto.graph)
    graph = proto.graph
    init_names = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init_names]
    if not inputs:
        raise BadInput(f"{path}: the model takes no input")
    batches = {d.dim_value if d.HasField("dim_value") else d.dim_param for i in inputs for d in i.type.tensor_type.shape.dim[:1]}
    if len(batches) > 1:
        raise BadInput(f"{path}: the inputs' first dimensions differ ({', '.join(map(str, batches))}); each must be the batch")
    if len(graph.output) != 1:
        raise BadInput(f"{path}: planner needs exactly one output (logits), found {len(graph.output)}")
    out_dims = graph.output[0].type.tensor_type.shape.dim
    if len(out_dims) != 2 or not out_dims[1].HasField("dim_value"):
        raise BadInput(f"{path}: output '{graph.output[0].name}' must be logits of shape [batch, classes]")
    parameters = _parameters(graph)
    return Model(
        path=path.absolute(),  # not resolved: its data files are beside the path given, a link included
        proto=proto,
        sha256=digest.hexdigest(),
        data_files=tuple(data_files),
        inputs=tuple(_model_input(path, i) for i in inputs),
        fixed_batch=batch if isinstance(batch := next(iter(batches)), int) and batch > 0 else None,
        n_classes=out_dims[1].dim_value,
        parameters=parameters,
        layers=_layers(proto, parameters),
    )


# The input types a step takes: float32 features, integer token ids and masks.
_INPUT_TYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.BOOL: "bool",
}


def _model_input(path: Path, value: onnx.ValueInfoProto) -> ModelInput:
    """One graph input as a `ModelInput`, or BadInput when planner cannot feed it."""
    tensor = value.type.tensor_type
    dims = tensor.shape.dim
    if len(dims) < 2:
        raise BadInput(f"{path}: input '{value.name}' must be [batch, ...], got rank {len(dims)}")
    if any(not d.HasField("dim_value") and not d.dim_param for d in dims[1:]):
        raise BadInput(f"{path}: input '{value.name}' has an unnamed dynamic dimension; name it (dynamic_axes) or fix it")
    if tensor.elem_type not in _INPUT_TYPES:
        kind = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
        raise BadInput(f"{path}: input '{value.name}' is {kind}; planner feeds float32, int64, int32 or bool inputs")
    return ModelInput(value.name, tuple(d.dim_value or d.dim_param for d in dims[1:]), _INPUT_TYPES[tensor.elem_type])


def _external_data(proto: onnx.ModelProto, path: Path) -> list[str]:
    """The external data files the model names, each checked to be a file beside it (never a
    path out of the model's folder), in a fixed order."""
    locations = sorted(
        {
            entry.value
            for tensor in _tensors(proto.graph)
            if external_data_helper.uses_external_data(tensor)
            for entry in tensor.external_data
            if entry.key == "location"
        }
    )
    for location in locations:
        file = path.parent / location
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise BadInput(
                f"{path}: external data '{location}' lies outside the model's folder; planner reads only files beside the model"
            )
        if file.is_symlink():  # onnx refuses links too: one could point anywhere
            raise BadInput(f"{path}: external data '{location}' is a symbolic link; copy the file itself beside the model")
        if not file.is_file():
            raise BadInput(f"{path}: its weights are in '{location}', which is missing beside it (copy it next to {path.name})")
    return locations


def _tensors(graph: onnx.GraphProto):
    """Every tensor a graph holds: initializers and Constant values, subgraphs' included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _tensors(sub)


def _parameters(graph: onnx.GraphProto) -> tuple[str, ...]:
    """The float initializers that are parameters, in graph order (the order TVM imports them).

    A parameter fills a weight, bias or buffer slot of a layer op, or is a tensor of more than one
    value used anywhere (a class token, a positional embedding). A float scalar elsewhere — an
    attention scale, an epsilon — is a constant: it is never trained and is baked into the step;
    so is a value the exporter computed and stored (`names.folded_values`).
    """
    folded = folded_values(graph)
    floats = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.name not in folded}
    slotted: set[str] = set()
    for node in graph.node:
        if layer_slots(node) is not None:
            slotted.update(n for n in node.input[1:] if n in floats)
    return tuple(n for n, t in floats.items() if n in slotted or math.prod(t.dims) > 1)


def _layers(proto: onnx.ModelProto, parameters: tuple[str, ...]) -> list[Layer]:
    """The layer table, read off the graph as TVM will see it (shapes folded), so a layer is
    called trainable only when nothing but real computation lies between it and the logits.
    A node planner cannot run at all refuses the model (`UnsupportedOp`), naming it."""
    analysed, types, ranks = _analyse(proto, parameters)
    graph = analysed.graph
    table = Graph(graph.node, types, constant_values(graph), ranks)
    for node in graph.node:
        if why := refused(table.view(node)):
            raise UnsupportedOp(why)
    shapes = _display_shapes(proto, analysed)
    inits = {t.name: t for t in graph.initializer}
    params = set(parameters)
    consumers = _consumers(graph)
    downstream = blocking_nodes(table, [o.name for o in graph.output])
    claimed: dict[str, int] = {}  # parameter -> the layer (index) that owns it
    taken: set[str] = set()
    layers: list[Layer] = []
    shared: dict[int, list[onnx.NodeProto]] = {}  # layer -> further nodes using its parameters

    def add(
        nodes: list[onnx.NodeProto],
        weight: str | None,
        bias: str | None,
        buffers: tuple[str, ...],
        name: str,
        out_axis: int | None,
    ) -> None:
        owned = [p for p in (weight, bias, *buffers) if p]
        claimed.update(dict.fromkeys(owned, len(layers)))
        taken.add(name)
        param_shapes = {n: tuple(inits[n].dims) for n in owned}
        trained = {p for p in (weight, bias) if p}
        layers.append(
            Layer(
                name=name,
                op=nodes[0].op_type,
                nodes=tuple(n.name for n in nodes),
                weight=weight,
                bias=bias,
                buffers=buffers,
                param_shapes=param_shapes,
                param_bytes=sum(math.prod(s) * 4 for s in param_shapes.values()),
                output_shape=shapes.get(nodes[-1].output[0], ()),
                problem=layer_problem(table, nodes, trained, downstream)
                if trained
                else f"'{name}' ({nodes[0].op_type}) has no trainable parameters",
                out_axis=out_axis if weight else None,
            )
        )

    by_name = {n.name: n for n in graph.node}
    for node in graph.node:
        for owner in dict.fromkeys(claimed[n] for n in node.input if n in claimed):
            if node.name not in layers[owner].nodes:  # a second use of a layer's parameters
                shared.setdefault(owner, []).append(node)
        own = list(dict.fromkeys(n for n in node.input if n in params and n not in claimed))
        if not own:
            continue
        slots = layer_slots(node)
        if slots is None:
            for param in own:  # a parameter used on its own: an Add's is a bias, any other a weight
                is_bias = node.op_type in ("Add", "Sub")
                add([node], None if is_bias else param, param if is_bias else None, (), standalone_name(node, param, taken), None)
            continue
        w_slot, b_slot = slots
        weight = _slot(node, w_slot, own)
        bias = _slot(node, b_slot, own)
        nodes = [node]
        if node.op_type == "MatMul" and weight:
            follower = _bias_add(node, consumers, params - set(claimed), inits)
            if follower is not None:  # a Linear: MatMul, then the Add of its bias
                add_node, bias = follower
                nodes.append(add_node)
        buffers = tuple(n for n in own if n not in (weight, bias))
        add(nodes, weight, bias, buffers, layer_name(nodes, [p for p in (weight, bias) if p], taken), _out_axis(node))
    for i, others in shared.items():  # a tied layer trains only if every use passes a gradient
        layer = layers[i]
        uses = [by_name[n] for n in layer.nodes] + others
        trained = {p for p in (layer.weight, layer.bias) if p}
        problem = layer_problem(table, uses, trained, downstream) if trained else layer.problem
        layers[i] = replace(
            layer, nodes=layer.nodes + tuple(n.name for n in others), shared_by=tuple(n.name for n in others), problem=problem
        )
    return layers


def _analyse(proto: onnx.ModelProto, parameters: tuple[str, ...]) -> tuple[onnx.ModelProto, dict[str, int], dict[str, int]]:
    """The graph as TVM will import it, with its tensors' types and ranks: `_layers`'s input, kept apart from the layer walk."""
    try:
        init_names = {t.name for t in proto.graph.initializer}
        dynamic = {d.dim_param for i in proto.graph.input if i.name not in init_names for d in i.type.tensor_type.shape.dim[1:]}
        analysed = for_import(proto, _ANALYSIS_BATCH, set(parameters), dict.fromkeys(dynamic - {""}, _ANALYSIS_LENGTH))
        types = tensor_types(analysed)
        ranks = tensor_ranks(analysed)
    except BadInput:  # a fix-up's own refusal (a GRU with partial sequence lengths) says what it is
        raise
    except Exception as exc:  # onnx's shape inference and reference ops raise assorted types
        raise BadInput(f"ONNX shape inference failed: {first_line(exc)}") from None
    return analysed, types, ranks


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Each tensor's consuming nodes in graph order, so `_layers` can find a MatMul's bias Add."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def _out_axis(node: onnx.NodeProto) -> int | None:
    """The axis of `node`'s weight that indexes its outputs (a Gemm's follows transB), for `Layer.out_axis`."""
    out_axis = {"Conv": 0, "MatMul": 1}.get(node.op_type)
    if node.op_type == "Gemm":
        out_axis = 0 if any(a.name == "transB" and a.i for a in node.attribute) else 1
    return out_axis


def _slot(node: onnx.NodeProto, slot: int | None, own: list[str]) -> str | None:
    return node.input[slot] if slot is not None and len(node.input) > slot and node.input[slot] in own else None


def _bias_add(
    matmul: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], free: set[str], inits: dict[str, onnx.TensorProto]
) -> tuple[onnx.NodeProto, str] | None:
    """The Add of a 1-D bias that alone consumes a MatMul's output (how both exporters write a
    Linear on more than two dimensions), with that bias."""
    users = consumers.get(matmul.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add":
        return None
    other = [n for n in users[0].input if n != matmul.output[0]]
    if len(other) != 1 or other[0] not in free or len(inits[other[0]].dims) != 1:
        return None
    return users[0], other[0]


def _display_shapes(proto: onnx.ModelProto, analysed: onnx.ModelProto) -> dict[str, tuple[int | str, ...]]:
    """Tensor shapes for the layer table: as inferred over the symbolic batch where ONNX can,
    else as analysed at batch 1."""
    shapes: dict[str, tuple[int | str, ...]] = {}
    for model in (analysed, proto):  # the symbolic ones win
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # a failure is reported by the analysis itself
            continue
        for vi in [*inferred.graph.value_info, *inferred.graph.output]:
            dims = vi.type.tensor_type.shape.dim
            shape = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in dims)
            if shape and "?" not in shape:
                shapes[vi.name] = shape
    return shapes


def save_onnx(model: Model, weights: dict[str, np.ndarray], path: str | Path) -> None:
    """Write `model` with its initializers replaced by `weights` (same names, shapes, dtypes), the
    way it came: a model whose weights were in an external data file gets `NAME.data` beside it."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    for i, tensor in enumerate(proto.graph.initializer):
        if tensor.name in weights:
            value = np.asarray(weights[tensor.name], dtype=numpy_helper.to_array(tensor).dtype)
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(value, tensor.name))
    path = Path(path)
    if model.data_files:
        data = path.with_name(f"{path.name}.data")
        data.unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save(
            proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=0
        )
        data.chmod(path.stat().st_mode & 0o777)  # onnx creates it private (0600); it is the model, as readable
    else:
        onnx.save(proto, str(path))
