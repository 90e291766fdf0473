"""The layer table: which parameters belong together, what PyTorch calls them, and whether they train.

Read off the graph as TVM will import it (`fixups.for_import`: shapes folded, ops decomposed), so a
layer is called trainable only when nothing but real computation lies between it and the logits,
judged by the operator table (`planner.inputs.operators`, `planner.inputs.trainability`). A layer is
what PyTorch keeps in one module: a convolution, a Linear (in ONNX a MatMul and the Add of its
bias), a norm — a GroupNorm as both exporters write it, a unit-affine InstanceNormalization between
two reshapes, then the Mul of its weight and the Add of its bias — or one parameter used on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import onnx
from onnx import numpy_helper

from planner import modes
from planner.errors import BadInput, UnsupportedOp, first_line
from planner.inputs.fixups import constant_values, for_import, tensor_info
from planner.inputs.names import folded_values, has_record, layer_name, recorded_parameters, standalone_name
from planner.inputs.operators import layer_slots, operator, refused
from planner.inputs.trainability import Graph, blocking_nodes, layer_problem
from planner.types import Mode

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
    # a weight the exporter computed from the module's parameters and stored as a constant (a
    # `weight_norm` or `spectral_norm` parametrization, by the dynamo exporter): it stays frozen
    folded_weight: str | None = None

    @property
    def trainable(self) -> bool:
        return self.problem is None

    def params_for(self, mode: Mode | str) -> tuple[str, ...]:
        """Parameters updated by this layer in `mode` (`planner.modes`: `full` its weight and bias,
        `bias`, `weight`, `ratio` a slice of the weight and all the bias, `lora` the weight
        through an adapter merged into it, `frozen` none)."""
        kind = mode.kind if isinstance(mode, Mode) else str(mode).partition(":")[0]
        return modes.get(kind).params(self)


def parameters_of(graph: onnx.GraphProto) -> tuple[str, ...]:
    """The float initializers that are parameters, in graph order (the order TVM imports them).

    A parameter fills a weight, bias or buffer slot of a layer op, or is a tensor of more than one
    value used anywhere (a class token, a positional embedding). A float scalar elsewhere — an
    attention scale, an epsilon — is a constant: it is never trained and is baked into the step;
    so is a value the exporter computed and stored (`names.folded_values`), the ones and zeros
    a GroupNorm's InstanceNormalization scales by (`_unit_affine`), a tensor the dynamo exporter
    made with no parameter behind it (`_exporter_constants`), and one read only where no gradient
    goes (a Resize's scales, a Clip's bounds: the operator table's `grads`).
    """
    folded = folded_values(graph) | _unit_affine(graph) | _exporter_constants(graph)
    floats = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.name not in folded}
    slotted: set[str] = set()
    gradient_reaches: set[str] = set()  # read where a gradient can reach it
    for node in graph.node:
        if layer_slots(node) is not None:
            slotted.update(n for n in node.input[1:] if n in floats)
        op = operator(node)
        gradient_reaches.update(n for slot, n in enumerate(node.input) if op is None or op.passes_to(slot))
    return tuple(n for n, t in floats.items() if n in slotted or (math.prod(t.dims) > 1 and n in gradient_reaches))


def layers_of(proto: onnx.ModelProto, parameters: tuple[str, ...]) -> list[Layer]:
    """The layer table, read off the graph as TVM will see it (shapes folded), so a layer is
    called trainable only when nothing but real computation lies between it and the logits.
    A node planner cannot run at all refuses the model (`UnsupportedOp`), naming it."""
    analysed, types, ranks = _analyse(proto, parameters)
    folded = folded_values(proto.graph)
    graph = analysed.graph
    table = Graph(graph.node, types, constant_values(graph), ranks)
    for node in graph.node:
        if why := refused(table.view(node)):
            raise UnsupportedOp(why)
    shapes = _display_shapes(proto, analysed)
    inits = {t.name: t for t in graph.initializer}
    params = set(parameters)
    consumers = _consumers(graph)
    producers = {out: node for node in graph.node for out in node.output}
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
        w_slot = (layer_slots(nodes[0]) or (None, None))[0]
        computed = nodes[0].input[w_slot] if w_slot is not None and len(nodes[0].input) > w_slot else None
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
                else _no_parameters(name, nodes[0], computed if computed in folded else None),
                out_axis=out_axis if weight else None,
                folded_weight=computed if computed in folded and not weight else None,
            )
        )

    by_name = {n.name: n for n in graph.node}
    for node in graph.node:
        for owner in dict.fromkeys(claimed[n] for n in node.input if n in claimed):
            if node.name not in layers[owner].nodes:  # a second use of a layer's parameters
                shared.setdefault(owner, []).append(node)
        own = list(dict.fromkeys(n for n in node.input if n in params and n not in claimed))
        if own:
            free = params - set(claimed)
            for nodes, weight, bias, buffers, naming, out_axis in _groupings(node, own, free, producers, consumers, table, inits):
                add(nodes, weight, bias, buffers, naming(taken), out_axis)
        elif (slots := layer_slots(node)) and slots[0] is not None and node.input[slots[0]] in folded:
            add([node], None, None, (), layer_name([node], [], taken), None)  # a layer whose weight the exporter folded
    for i, others in shared.items():  # a tied layer trains only if every use passes a gradient
        layer = layers[i]
        uses = [by_name[n] for n in layer.nodes] + others
        trained = {p for p in (layer.weight, layer.bias) if p}
        problem = layer_problem(table, uses, trained, downstream) if trained else layer.problem
        layers[i] = replace(
            layer, nodes=layer.nodes + tuple(n.name for n in others), shared_by=tuple(n.name for n in others), problem=problem
        )
    return layers


Grouping = tuple[list[onnx.NodeProto], str | None, str | None, tuple[str, ...], Callable[[set[str]], str], int | None]


def _groupings(
    node: onnx.NodeProto,
    own: list[str],
    free: set[str],
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
    table: Graph,
    inits: dict[str, onnx.TensorProto],
) -> list[Grouping]:
    """The layers `node` begins, given the parameters it is the first to read (`own`; `free`: every
    parameter no layer has yet): (nodes, weight, bias, buffers, its name given the names taken,
    the weight's output axis)."""
    norm = _group_norm(node, producers, consumers, free, table.constants) if node.op_type == "Mul" else None
    if norm is not None:  # a GroupNorm: the InstanceNormalization, its reshape, the scale and the shift
        nodes, scale, shift = norm
        return [(nodes, scale, shift, (), partial(layer_name, nodes, [scale, shift]), None)]
    slots = layer_slots(node)
    if slots is None:  # a parameter used on its own: an Add's is a bias, any other a weight
        bias_like = node.op_type in ("Add", "Sub")
        return [
            ([node], None if bias_like else p, p if bias_like else None, (), partial(standalone_name, node, p), None) for p in own
        ]
    weight, bias = _slot(node, slots[0], own), _slot(node, slots[1], own)
    nodes = [node]
    if node.op_type == "MatMul" and weight:
        follower = _bias_add(node, consumers, free, inits)
        if follower is not None:  # a Linear: MatMul, then the Add of its bias
            add_node, bias = follower
            nodes.append(add_node)
    buffers = tuple(n for n in own if n not in (weight, bias))
    return [(nodes, weight, bias, buffers, partial(layer_name, nodes, [p for p in (weight, bias) if p]), _out_axis(node))]


def _analyse(proto: onnx.ModelProto, parameters: tuple[str, ...]) -> tuple[onnx.ModelProto, dict[str, int], dict[str, int]]:
    """The graph as TVM will import it, with its tensors' types and ranks: `_layers`'s input, kept apart from the layer walk."""
    try:
        init_names = {t.name for t in proto.graph.initializer}
        dynamic = {d.dim_param for i in proto.graph.input if i.name not in init_names for d in i.type.tensor_type.shape.dim[1:]}
        analysed = for_import(proto, _ANALYSIS_BATCH, set(parameters), dict.fromkeys(dynamic - {""}, _ANALYSIS_LENGTH))
        types, ranks = tensor_info(analysed)
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


def _no_parameters(name: str, node: onnx.NodeProto, folded: str | None) -> str:
    if folded:
        return (
            f"its weight '{folded}' is a constant the exporter computed from parameters (a parametrization, a "
            "computed weight) and it has no bias: export with dynamo=False to train it"
        )
    return f"'{name}' ({node.op_type}) has no trainable parameters"


def _exporter_constants(graph: onnx.GraphProto) -> set[str]:
    """Initializers of a dynamo export that no reader computes a PyTorch parameter with: each node
    records the FX node it came from and so the parameters it reads (`names.recorded_parameters`);
    where every reader records one and none names a parameter, the tensor is the exporter's (the
    ones and zeros of a norm without affine parameters, a buffer), never trained. A reader without
    a record (another exporter, a node an optimizer made) decides nothing."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    found = set()
    for t in graph.initializer:
        users = readers.get(t.name, [])
        if users and all(has_record(n) for n in users) and not any(recorded_parameters(n) for n in users):
            found.add(t.name)
    return found


def _unit_affine(graph: onnx.GraphProto) -> set[str]:
    """The ones and zeros both exporters give a GroupNorm's InstanceNormalization (which then
    reshapes back and scales and shifts by the GroupNorm's weight and bias): constants, however
    stored (the dynamo exporter stores them as initializers)."""
    inits = {t.name: t for t in graph.initializer}
    consumers = _consumers(graph)
    found: set[str] = set()
    for node in graph.node:
        if node.op_type != "InstanceNormalization" or len(node.input) < 3:
            continue
        after = consumers.get(node.output[0], [])
        if not (len(after) == 1 and after[0].op_type == "Reshape"):
            continue
        scale, shift = (inits.get(n) for n in node.input[1:3])
        if scale is not None and shift is not None:
            if np.all(numpy_helper.to_array(scale) == 1) and not np.any(numpy_helper.to_array(shift)):
                found |= {scale.name, shift.name}
    return found


def _group_norm(
    mul: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
    free: set[str],
    constants: Mapping[str, np.ndarray],
) -> tuple[list[onnx.NodeProto], str, str] | None:
    """A GroupNorm as both exporters write it, seen from the Mul of its weight:
    InstanceNormalization(x, ones, zeros) -> Reshape -> Mul(weight) -> Add(bias), each alone
    consuming the one before. The nodes, the weight and the bias."""
    data, weight = (mul.input[0], mul.input[1]) if mul.input[1] in free else (mul.input[1], mul.input[0])
    reshape = producers.get(data)
    if reshape is None or reshape.op_type != "Reshape":
        return None
    norm = producers.get(reshape.input[0])
    if weight not in free or norm is None or norm.op_type != "InstanceNormalization" or len(norm.input) < 3:
        return None
    scale, shift = (constants.get(n) for n in norm.input[1:3])
    if scale is None or shift is None or not np.all(scale == 1) or np.any(shift):
        return None
    users = consumers.get(mul.output[0], [])
    if len(users) != 1 or users[0].op_type != "Add":
        return None
    bias = next((n for n in users[0].input if n != mul.output[0]), "")
    if bias not in free or len(consumers.get(reshape.output[0], [])) != 1:
        return None
    return [norm, reshape, mul, users[0]], weight, bias


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
