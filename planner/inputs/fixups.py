"""ONNX graph fix-ups: what exporters write that TVM's importer or planner's analysis cannot use as is.

PyTorch's exporters compute shapes inside the graph. The legacy exporter turns every `view`,
`flatten` and attention head split into chains of `Shape -> Gather -> Unsqueeze -> Concat ->
Reshape` over the symbolic batch; the dynamo exporter does less of it but still emits
`Shape`/`Expand` for a class token. TVM's importer rejects some of these chains outright
(`shape_of expects a tensor input, but received R.Shape`) and turns others into ops without a
gradient, and a shape computation on the path to a parameter would make planner call it
untrainable although no gradient ever flows through a shape.

A training step has a fixed batch, so every one of those shapes is a constant: `for_import`
binds the batch and folds every node whose inputs are all constants, evaluating each with ONNX's
own reference implementation (`onnx.reference`). Parameters are never constants — folding stops
at them, so no computation on a weight is ever baked in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from planner.inputs.calibration import fake_quantize
from planner.inputs.decompose import decompose
from planner.inputs.encodings import decode_inputs
from planner.inputs.names import recorded_parameters
from planner.inputs.recurrent import unroll_recurrent
from planner.types import Encoding, Int8Scale

# Largest tensor (in elements) a fold may produce: shape arithmetic is tiny; a constant this
# big is better computed by the step than stored in it.
_MAX_FOLDED_ELEMENTS = 1 << 20
_NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"}
)


def _reads(node: onnx.NodeProto) -> list[str]:
    """Every tensor name a node reads: its inputs, and what the bodies of its subgraphs (an If's
    branches, a Loop's body) read from outside them."""
    names = list(node.input)
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
            names += [name for inner in sub.node for name in _reads(inner)]
    return names


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give every unnamed (or duplicate-named) node a name: planner addresses nodes by name."""
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def tie_identities(graph: onnx.GraphProto) -> None:
    """Every use of `Identity(initializer)` reads the initializer itself, and the Identity is gone.

    Why: the legacy exporter writes a parameter used by several modules (ALBERT's layers sharing
    one set of weights) once, and every further use as an Identity of it — and it writes equal
    tensors the same way. The file says they are one tensor, so they train as one: one gradient
    summed over every use, one optimizer state, one tensor in the fine-tuned model (the dynamo
    exporter writes the one tensor itself, which gives the same). Made separate parameters, each
    copy would move by its own use's gradient only.
    """
    inits = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    tied: dict[str, str] = {}
    kept = []
    for node in graph.node:
        source = node.input[0] if node.op_type == "Identity" and len(node.input) == 1 else ""
        source = tied.get(source, source)
        if source in inits and node.output[0] not in outputs:
            tied[node.output[0]] = source
        else:
            kept.append(node)
    if not tied:
        return
    for node in kept:
        for i, name in enumerate(node.input):
            if name in tied:
                node.input[i] = tied[name]
        for attr in node.attribute:  # subgraphs (an If's branches) may read them too
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                _rename_reads(sub, tied)
    del graph.node[:]
    graph.node.extend(kept)


def dequantize_weights(graph: onnx.GraphProto) -> None:
    """Every `DequantizeLinear` of an initializer (a QDQ model's int8 weight, its int32 bias) is a
    float initializer of the values it stands for, under the name its output had; the integers,
    scales and zero points nothing else reads are gone.

    Why: in a model quantized the QDQ way (ONNX Runtime's `quantize_static`, PyTorch's PT2E
    export), a layer's weight is the output of a DequantizeLinear, not an initializer, so the
    layer would have nothing to train. The values are the quantized ones exactly (`(q - zero) *
    scale`, as ONNX's reference computes them), so the model computes what it computed; a
    candidate storing frozen weights int8 quantizes them again per output channel, which gives
    back the same integers (a symmetric per-channel scale is the channel's largest |w| / 127).
    """
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    kept, made = [], []
    for node in graph.node:
        reads = [n for n in node.input if n]
        if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx") and reads and all(n in inits for n in reads):
            opset = 21 if any(a.name == "block_size" for a in node.attribute) else 19
            (value,) = ReferenceEvaluator(node, opsets={"": opset}).run(None, {n: numpy_helper.to_array(inits[n]) for n in reads})
            made.append(numpy_helper.from_array(np.asarray(value, np.float32), node.output[0]))
        else:
            kept.append(node)
    if not made:
        return
    read = {n for node in kept for n in _reads(node)} | outputs
    dropped = [t for t in graph.initializer if t.name not in read]
    for t in dropped:
        graph.initializer.remove(t)
        for graph_input in [i for i in graph.input if i.name == t.name]:
            graph.input.remove(graph_input)
    graph.initializer.extend(made)
    del graph.node[:]
    graph.node.extend(kept)


def unpaired_quantization(graph: onnx.GraphProto) -> str | None:
    """What planner cannot train in a QDQ model's activations, or None: each QuantizeLinear of an
    activation must be read only by DequantizeLinears of its own one scale and zero point (a fake
    quantization, trained straight-through: `planner.backend.graph.rewrites`), and a
    DequantizeLinear of an activation must read such a QuantizeLinear. Called after
    `dequantize_weights`, when only activations are still quantized."""
    made = {out: node for node in graph.node for out in node.output}
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def constant(name: str) -> np.ndarray | None:
        if name in inits:
            return numpy_helper.to_array(inits[name])
        node = made.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def scale_and_zero(node: onnx.NodeProto) -> tuple | None:
        s = constant(node.input[1])
        z = constant(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        return (
            None if s is None or z is None or s.size != 1 or z.size != 1 else (float(s.reshape(())), int(z.reshape(())), z.dtype)
        )

    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            key = scale_and_zero(node)
            if key is None:
                return f"node {node.name!r}: an activation quantized with a scale per channel or a computed scale (planner trains one constant scale per tensor)"
            for r in readers.get(node.output[0], []):
                if r.op_type != "DequantizeLinear" or scale_and_zero(r) != key:
                    return f"node {node.name!r}: its integers are read by {r.name!r} ({r.op_type}), not dequantized at once with its own scale (planner trains fake quantization, QDQ pairs)"
        elif node.op_type == "DequantizeLinear":
            source = made.get(node.input[0])
            if source is None or source.op_type != "QuantizeLinear":
                return (
                    f"node {node.name!r}: dequantizes {node.input[0]!r}, which is neither a weight nor a QuantizeLinear's output"
                )
        elif node.op_type in _INTEGER_OPS:
            return (
                f"node {node.name!r} ({node.op_type}): integer operators are not supported; quantize the model in the QDQ format"
            )
    return None


_INTEGER_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul"})


def equal_initializers(graph: onnx.GraphProto) -> list[list[str]]:
    """Groups of float initializers of more than one value holding bitwise-equal tensors, in
    graph order: one tensor stored several times (or, in a model never trained, equal ones)."""
    groups: dict[tuple, list[str]] = {}
    for t in graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and math.prod(t.dims) > 1:
            value = numpy_helper.to_array(t)
            groups.setdefault((tuple(t.dims), hashlib.sha256(value.tobytes()).hexdigest()), []).append(t.name)
    return [names for names in groups.values() if len(names) > 1]


def tie_copies(graph: onnx.GraphProto) -> list[list[str]]:
    """Bitwise-equal initializers that the dynamo exporter wrote for one PyTorch parameter read
    as the first of them.

    Why: it writes a weight shared by several modules once per use when it transposes it for each
    (ALBERT's feed-forward weights, three copies for three layers), and each copy would train by
    its own use's gradient only. Each node records the FX node it came from, and so the
    parameters it computes with (`names.recorded_parameters`): copies whose readers all name a
    parameter in common are that parameter. Equal tensors with no such record are left apart:
    returned, so that `planner inspect` can say which."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def recorded(name: str) -> set[str]:
        found = [recorded_parameters(n) for n in readers.get(name, [])]
        return set.intersection(*found) if found else set()

    tied: dict[str, str] = {}
    apart = []
    for names in equal_initializers(graph):
        if set.intersection(*(recorded(n) for n in names)):
            tied.update({n: names[0] for n in names[1:]})
        else:
            apart.append(names)
    if tied:
        _rename_reads(graph, tied)
        for tensor in [t for t in graph.initializer if t.name in tied]:
            graph.initializer.remove(tensor)
    return apart


def tie_transposes(graph: onnx.GraphProto) -> list[list[str]]:
    """A 2-D initializer holding another's transpose bitwise, read as `Transpose` of it: one tensor.

    Why: a language model whose LM head is tied to its token embedding (GPT-2, Llama and most
    decoders with `tie_word_embeddings`) is written by both exporters as the table, which the
    embedding's Gather reads, and its transpose, which the head's MatMul reads. Trained apart, the
    embedding moves by the embedding's gradient and the head by its own, where PyTorch sums both
    into the one tensor. They are tied when the readers' records name one parameter (the dynamo
    exporter), or, without records (the legacy exporter), when the table is read by Gathers only
    and the transpose by MatMuls and Gemms only: an embedding and its head. Other pairs are left
    apart and returned, so that `planner inspect` can say which."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    order: dict[str, int] = {}
    found: dict[tuple, str] = {}
    pairs = []
    for t in graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 and t.dims[0] != t.dims[1] and math.prod(t.dims) > 1:
            value = numpy_helper.to_array(t)
            if np.unique(value).size < 2:
                continue
            order[t.name] = len(order)
            flipped = np.ascontiguousarray(value.T)
            other = found.get((flipped.shape, hashlib.sha256(flipped.tobytes()).hexdigest()))
            if other is not None:
                pairs.append((other, t.name))
            found[(value.shape, hashlib.sha256(value.tobytes()).hexdigest())] = t.name

    def gathered(name: str) -> bool:  # an embedding table: what a Gather reads rows of
        return any(n.op_type == "Gather" and n.input[0] == name for n in readers.get(name, []))

    tied: list[tuple[str, str]] = []
    apart = []
    for first, second in pairs:
        table, copy = (second, first) if gathered(second) and not gathered(first) else (first, second)
        records = [recorded_parameters(n) for n in readers.get(copy, []) + readers.get(table, [])]
        same = bool(records) and bool(set.intersection(*records))
        head = all(n.op_type == "Gather" and n.input[0] == table for n in readers.get(table, [])) and all(
            n.op_type in ("MatMul", "Gemm") for n in readers.get(copy, [])
        )
        if same or (head and not any(records)):
            tied.append((table, copy))
        else:
            apart.append([table, copy])
    for table, copy in tied:
        graph.initializer.remove(next(t for t in graph.initializer if t.name == copy))
        at = next(i for i, n in enumerate(graph.node) if copy in n.input)  # after the embedding: it names the layer
        graph.node.insert(at, onnx.helper.make_node("Transpose", [table], [copy], name=f"{copy}/tied", perm=[1, 0]))
    return apart


def _rename_reads(graph: onnx.GraphProto, renamed: Mapping[str, str]) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                _rename_reads(sub, renamed)


def _static_shapes(proto: onnx.ModelProto) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Every tensor whose shape ONNX shape inference knows fully, and every tensor's element type."""
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, int] = {}
    g = inferred.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        types[vi.name] = tt.elem_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in tt.shape.dim)
    for t in g.initializer:
        shapes[t.name] = tuple(t.dims)
        types[t.name] = t.data_type
    return shapes, types


def tensor_info(proto: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """The element type (`onnx.TensorProto.FLOAT`, …) of every tensor shape inference can type,
    and the rank of every tensor it knows the shape of (its sizes fixed or not): one inference."""
    g = onnx.shape_inference.infer_shapes(proto).graph
    types = {t.name: t.data_type for t in g.initializer}
    ranks = {t.name: len(t.dims) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        types[vi.name] = vi.type.tensor_type.elem_type
        if vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    return types, ranks


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The value of every tensor a `Constant` node of `graph` holds (as `for_import` writes them)."""
    return {
        node.output[0]: numpy_helper.to_array(node.attribute[0].t)
        for node in graph.node
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"
    }


def _shape_value(node: onnx.NodeProto, shape: tuple[int, ...]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(math.prod(shape), np.int64)
    attrs = {a.name: a.i for a in node.attribute}
    rank = len(shape)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (start, end))
    return np.array(shape[start:end], np.int64)


def _evaluate(node: onnx.NodeProto, values: dict[str, np.ndarray], opset: int) -> list[np.ndarray] | None:
    """The node's outputs by ONNX's reference implementation, or None when it cannot run it."""
    try:
        out = ReferenceEvaluator(node, opsets={"": opset}).run(None, {n: values[n] for n in node.input if n})
    except Exception:  # an op or attribute combination the reference does not implement
        return None
    return [np.asarray(v) for v in out]


def bind_batch(proto: onnx.ModelProto, batch: int, lengths: Mapping[str, int]) -> None:
    """The model's input and output batch dimension set to `batch`, and each dynamic length
    named in `lengths` (a sequence length) to its size (in place)."""
    g = proto.graph
    inits = {t.name for t in g.initializer}
    for vi in [*(i for i in g.input if i.name not in inits), *g.output]:
        dims = vi.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value"):
                continue
            size = batch if axis == 0 else lengths[dim.dim_param] if dim.dim_param in lengths else None
            if size is not None:
                dim.Clear()
                dim.dim_value = size
    del g.value_info[:]  # inferred for a symbolic batch; inferred again where needed


def for_import(
    proto: onnx.ModelProto,
    batch: int,
    parameters: set[str],
    lengths: Mapping[str, int] | None = None,
    codes: Mapping[str, Encoding] | None = None,
    activations: Mapping[str, Int8Scale] | None = None,
) -> onnx.ModelProto:
    """A copy of `proto` as planner hands it to TVM: batch `batch`, dynamic lengths `lengths`, every initializer that is
    not in `parameters` a Constant node, every GRU, LSTM and RNN node unrolled over its fixed
    sequence (`planner.inputs.recurrent`: TVM imports none of them), every computation on
    constants (shapes included) folded into a Constant, and every operator TVM would import
    without a gradient written as ones it has (`planner.inputs.decompose`), and the inputs named in
    `codes` taken in 8 bits and decoded (`planner.inputs.encodings`), and the tensors named in
    `activations` fake-quantized to int8 (`planner.inputs.calibration`)."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    bind_batch(out, batch, lengths or {})
    g = out.graph
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 17)
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer if t.name not in parameters}
    for t in [t for t in g.initializer if t.name not in parameters]:
        g.initializer.remove(t)
        for graph_input in [i for i in g.input if i.name == t.name]:
            g.input.remove(graph_input)
    nodes = [_constant(n, v) for n, v in values.items()] + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    unroll_recurrent(out)
    while _fold_constants(out, values, opset):  # a folded shape lets inference see further
        pass
    shapes, types = _static_shapes(out)
    if decompose(out, values, shapes, types, opset):  # what TVM would import without a gradient
        while _fold_constants(out, values, opset):
            pass
    fake_quantize(out, activations or {})
    decode_inputs(out, codes or {})
    return out


def _fold_constants(proto: onnx.ModelProto, values: dict[str, np.ndarray], opset: int) -> bool:
    """One pass: every node computable from `values` (and the shapes inference knows) becomes a
    Constant; `values` grows by the folded outputs. Whether anything was folded."""
    g = proto.graph
    shapes, _ = _static_shapes(proto)
    kept: list[onnx.NodeProto] = []
    folded_any = False
    for node in g.node:
        taken = _taken_branch(node, values)
        if taken is not None:  # an If whose condition is a constant once shapes are fixed
            kept.extend(taken)
            folded_any = True
            continue
        folded = _fold(node, values, shapes, opset)
        if folded is None:
            kept.append(node)
        else:
            folded_any = folded_any or node.op_type != "Constant"
            values.update(zip(node.output, folded))
    needed = [n for n in dict.fromkeys(i for node in kept for i in _reads(node)) if n in values]
    needed += [o.name for o in g.output if o.name in values and o.name not in needed]
    del g.node[:]
    g.node.extend([_constant(n, values[n]) for n in needed] + kept)
    return folded_any


def _taken_branch(node: onnx.NodeProto, values: Mapping[str, np.ndarray]) -> list[onnx.NodeProto] | None:
    """An `If` whose condition is known, as the nodes of the branch it takes, or None.

    Why: the legacy exporter guards shape arithmetic with If (`repeat`, `diagonal`,
    `LocalResponseNorm` test an input's rank), and TVM imports no control flow; with the batch
    bound the condition is a constant. The branch's own tensors get the If's name as a prefix; its
    outputs become the If's."""
    if node.op_type != "If" or node.domain not in ("", "ai.onnx") or node.input[0] not in values:
        return None
    branch = next(a.g for a in node.attribute if a.name == ("then_branch" if bool(values[node.input[0]]) else "else_branch"))
    renamed = {out.name: mine for out, mine in zip(branch.output, node.output)}
    for inner in branch.node:
        for name in inner.output:
            renamed.setdefault(name, f"{node.name}/{name}")
    for t in branch.initializer:
        renamed.setdefault(t.name, f"{node.name}/{t.name}")
    nodes = [_constant(renamed[t.name], numpy_helper.to_array(t)) for t in branch.initializer]
    for inner in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        copy.name = f"{node.name}/{inner.name or inner.op_type}"
        for i, name in enumerate(copy.input):
            copy.input[i] = renamed.get(name, name)
        for i, name in enumerate(copy.output):
            copy.output[i] = renamed[name]
        nodes.append(copy)
    produced = {name for n in nodes for name in n.output}
    for out, mine in zip(branch.output, node.output):  # an output the branch passes through from outside
        if mine not in produced:
            nodes.append(helper.make_node("Identity", [out.name], [mine], name=f"{node.name}/{out.name}"))
    return nodes


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"const:{name}", value=numpy_helper.from_array(np.asarray(value), name))


def _fold(
    node: onnx.NodeProto, values: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]], opset: int
) -> list[np.ndarray] | None:
    """The node's outputs when they are constants (None when the node must stay)."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _NONDETERMINISTIC:
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
        return [_shape_value(node, shapes[node.input[0]])]
    if node.op_type == "Constant":
        known = values.get(node.output[0])
        return [known] if known is not None else _evaluate(node, values, opset)
    if not all(n in values for n in node.input if n):
        return None
    out = _evaluate(node, values, opset)
    if out is None or any(v.size > _MAX_FOLDED_ELEMENTS for v in out):
        return None
    return out
