"""ONNX operators written as other ONNX operators, where TVM would import them without a gradient.

TVM's ONNX frontend lowers a padding, a tile, an einsum or a resize straight to TIR kernels of its
own (`call_tir`), which Relax's gradient pass cannot see through, and it imports `Celu` not at all.
Each is rewritten here into operators whose gradients planner has and proves (slices and
concatenations, broadcasts, matrix products, gathers), before TVM reads the graph: once, for every
later stage — the layer table judges what TVM will see, and the operator table's finite-difference
checks run through these very rewrites against ONNX's reference of the original node.

Only operators without parameters of their own are rewritten (a layer keeps its node, and so its
name). Shapes are fixed when this runs (`fixups.for_import` has bound the batch), and the
constants an operator reads (pads, repeats, scales) are known; a node whose constants are not, or
whose form is not handled, is left as it is for the operator table to judge.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

Shapes = Mapping[str, tuple[int, ...]]


class _Writer:
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


class _Context:
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


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


# --- padding -------------------------------------------------------------------------------------


def _pad(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`Pad` (any mode) as slices and concatenations, one axis at a time (as numpy's pad, which
    the reference runs, pads the corners)."""
    shape = ctx.shape(node.input[0])
    pads = ctx.const(node, 1)
    if shape is None or pads is None or (len(node.input) > 2 and node.input[2] and ctx.const(node, 2) is None):
        return False
    rank = len(shape)
    given = ctx.const(node, 3)
    axes = list(range(rank)) if given is None else [int(a) % rank for a in given]
    widths = [int(p) for p in pads]
    value = ctx.const(node, 2)
    mode = _attr(node, "mode", "constant")
    dtype = ctx.dtype(node.input[0])
    if min(widths) < 0:  # a crop: left to the table
        return False
    x, current = node.input[0], list(shape)
    for axis, before, after in zip(axes, widths[: len(axes)], widths[len(axes) :]):
        if not before and not after:
            continue
        size = current[axis]
        if mode == "reflect" and (before >= size or after >= size):
            return False
        if mode == "wrap" and (before > size or after > size):
            return False
        parts: list[str | None] = []
        for count, first in ((before, True), (after, False)):
            if not count:
                parts.append(None)
                continue
            if mode == "constant":
                fill = np.zeros(()) if value is None else np.asarray(value).reshape(())
                block = np.full([count if i == axis else d for i, d in enumerate(current)], fill, dtype)
                parts.append(w.const(block, "fill"))
            elif mode == "reflect":  # x[count], ..., x[1] before; x[L-2], ..., x[L-1-count] after
                start = count if first else size - 2
                end = 0 if first else size - 2 - count
                parts.append(w.slice(x, axis, start, end if end >= 0 else -size - 1, -1))
            elif mode == "edge":
                edge = w.slice(x, axis, 0 if first else size - 1, 1 if first else size)
                target = [count if i == axis else d for i, d in enumerate(current)]
                parts.append(w.op("Expand", [edge, w.const(np.array(target, np.int64))]))
            elif mode == "wrap":
                parts.append(w.slice(x, axis, size - count, size) if first else w.slice(x, axis, 0, count))
            else:
                return False
        x = w.op("Concat", [p for p in (parts[0], x, parts[1]) if p], axis=axis)
        current[axis] += before + after
    w.op("Identity", [x], node.output[0])
    return True


# --- tiles, cumulative sums, top-k, CELU, dropout -----------------------------------------------


def _tile(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`Tile` as unsqueeze, expand and reshape: the copies are a new outer axis per axis."""
    shape, given = ctx.shape(node.input[0]), ctx.const(node, 1)
    if shape is None or given is None:
        return False
    reps = [int(r) for r in given]
    rank = len(shape)
    spread = w.op("Unsqueeze", [node.input[0], w.const(np.arange(0, 2 * rank, 2, dtype=np.int64))])
    expanded = w.op("Expand", [spread, w.const(np.array([v for r, d in zip(reps, shape) for v in (r, d)], np.int64))])
    w.op("Reshape", [expanded, w.const(np.array([r * d for r, d in zip(reps, shape)], np.int64))], node.output[0])
    return True


def _cumsum(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """A reversed or exclusive `CumSum` as the plain one (TVM writes the reversal as TIR): flips
    around it, and the input subtracted for an exclusive sum."""
    reverse, exclusive = _attr(node, "reverse", 0), _attr(node, "exclusive", 0)
    shape, given = ctx.shape(node.input[0]), ctx.const(node, 1)
    if not (reverse or exclusive):
        return False
    if shape is None or given is None:
        return False
    axis = int(np.asarray(given).reshape(())) % len(shape)
    size = shape[axis]

    def flip(t: str) -> str:
        return w.slice(t, axis, size - 1, -size - 1, -1)

    x = flip(node.input[0]) if reverse else node.input[0]
    total = w.op("CumSum", [x, node.input[1]])
    if exclusive:
        total = w.op("Sub", [total, x])
    w.op("Identity", [flip(total) if reverse else total], node.output[0])
    return True


def _topk(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`TopK`'s values as the input gathered at its indices: the indices carry no gradient, the
    gather passes one back to exactly the elements picked."""
    if not node.output[0]:
        return False
    axis = _attr(node, "axis", -1)
    indices = node.output[1] if len(node.output) > 1 and node.output[1] else w.fresh("indices")
    w.nodes.append(
        helper.make_node(
            "TopK",
            list(node.input),
            [w.fresh("values"), indices],
            name=w.fresh("topk"),
            **{a.name: helper.get_attribute_value(a) for a in node.attribute},
        )
    )
    w.op("GatherElements", [node.input[0], indices], node.output[0], axis=axis)
    return True


def _celu(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`Celu` (TVM has none) as `alpha * Elu(x / alpha)`, which it is."""
    alpha = float(_attr(node, "alpha", 1.0))
    scale = w.const(np.array(alpha, ctx.dtype(node.input[0])), "alpha")
    elu = w.op("Elu", [w.op("Div", [node.input[0], scale])], alpha=1.0)
    w.op("Mul", [elu, scale], node.output[0])
    return True


def _dropout(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`Dropout` outside training: the identity (a mask output, if read, is all true)."""
    training = ctx.const(node, 2)
    if len(node.input) > 2 and node.input[2] and (training is None or bool(np.asarray(training))):
        return False
    w.op("Identity", [node.input[0]], node.output[0])
    if len(node.output) > 1 and node.output[1]:
        shape = ctx.shape(node.input[0])
        if shape is None:
            return False
        w.op("Identity", [w.const(np.ones(shape, bool), "mask")], node.output[1])
    return True


# --- resize --------------------------------------------------------------------------------------


def _resize(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`Resize` (nearest, linear, cubic; any coordinate mode) as gathers along each resized axis.

    ONNX's resize is separable: each output is a fixed combination of inputs along each axis in
    turn. The combination for one axis is read off ONNX's own reference, resizing one-hot inputs,
    so every mode and rounding rule is the reference's: per output position, the inputs it reads
    (`Gather`) and their weights (`Mul`, summed). Nearest reads one input at weight one."""
    shape = ctx.shape(node.input[0])
    out_shape = ctx.shape(node.output[0])
    if shape is None or out_shape is None:
        return False
    if _attr(node, "coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        return False
    if _attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        return False
    rank = len(shape)
    scales, sizes = ctx.const(node, 2), ctx.const(node, 3)
    axes = _attr(node, "axes")
    axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    full_scales = full_sizes = None
    if scales is not None and scales.size:
        full_scales = np.ones(rank, np.float32)
        full_scales[axes] = scales
    elif sizes is not None and sizes.size:
        full_sizes = np.array(shape, np.int64)
        full_sizes[axes] = sizes
    else:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "axes"}
    dtype = ctx.dtype(node.input[0])
    x = node.input[0]
    for axis in range(rank):
        matrix = _resize_matrix(shape[axis], axis, rank, attrs, full_scales, full_sizes, ctx.opset)
        if matrix is None:
            return False
        if matrix.shape[0] != out_shape[axis]:
            return False
        if matrix.shape == (shape[axis], shape[axis]) and np.array_equal(matrix, np.eye(shape[axis])):
            continue
        x = _combine(w, x, axis, rank, matrix, dtype)
    w.op("Identity", [x], node.output[0])
    return True


def _resize_matrix(
    size: int, axis: int, rank: int, attrs: dict, scales: np.ndarray | None, sizes: np.ndarray | None, opset: int
) -> np.ndarray | None:
    """M [out, size]: along `axis`, output i is sum_k M[i, k] * input k (the reference's own numbers)."""
    shape = [1] * rank
    shape[axis] = size
    inputs = ["x", "", "scales" if scales is not None else "", "sizes" if sizes is not None else ""]
    while inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("Resize", inputs, ["y"], **attrs)
    feeds: dict[str, np.ndarray] = {}
    if scales is not None:
        one = np.ones(rank, np.float32)
        one[axis] = scales[axis]
        feeds["scales"] = one
    if sizes is not None:
        one_size = np.ones(rank, np.int64)
        one_size[axis] = sizes[axis]
        feeds["sizes"] = one_size
    columns = []
    try:
        evaluator = ReferenceEvaluator(node, opsets={"": max(opset, 13)})
        for k in range(size):
            basis = np.zeros(shape, np.float64)
            basis.reshape(-1)[k] = 1.0
            (column,) = evaluator.run(None, {"x": basis, **feeds})
            columns.append(np.asarray(column).reshape(-1))
    except Exception:  # a mode the reference does not run
        return None
    return np.stack(columns, axis=1)


def _combine(w: _Writer, x: str, axis: int, rank: int, matrix: np.ndarray, dtype: np.dtype) -> str:
    """`x` mixed along `axis` by `matrix` [out, in]: one gather per tap, weighted and summed."""
    taps = max(1, int((matrix != 0).sum(axis=1).max()))
    out = matrix.shape[0]
    index = np.zeros((taps, out), np.int64)
    weight = np.zeros((taps, out), np.float64)
    for i in range(out):
        nonzero = np.flatnonzero(matrix[i])
        index[: len(nonzero), i] = nonzero
        weight[: len(nonzero), i] = matrix[i, nonzero]
    nearest = taps == 1 and np.all((weight == 1.0) | (weight == 0.0)) and np.all((matrix != 0).sum(axis=1) == 1)
    total = None
    for t in range(taps):
        picked = w.op("Gather", [x, w.const(index[t], "index")], axis=axis)
        if not nearest:
            shape = [1] * rank
            shape[axis] = out
            picked = w.op("Mul", [picked, w.const(weight[t].astype(dtype).reshape(shape), "weight")])
        total = picked if total is None else w.op("Add", [total, picked])
    assert total is not None
    return total


# --- einsum ------------------------------------------------------------------------------------


def _einsum(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`Einsum` as transposes, sums and batched matrix products, two operands at a time: for each
    pair, the indices both share and something later needs are a batch, those only they share
    are contracted, and an index no one else needs is summed first. An operand that repeats an
    index (a diagonal or a trace) is left to the table."""
    found = [ctx.shape(name) for name in node.input]
    shapes = [s for s in found if s is not None]
    if len(shapes) != len(found):
        return False
    parsed = _parse_einsum(str(_attr(node, "equation", "")), [len(s) for s in shapes])
    if parsed is None:
        return False
    terms, output = parsed
    if any(len(set(t)) != len(t) for t in terms):
        return False
    sizes: dict[str, int] = {}
    for term, extents in zip(terms, shapes):
        for letter, size in zip(term, extents):
            if sizes.get(letter, 1) != size and size != 1 and sizes.get(letter, 1) != 1:
                return False
            sizes[letter] = max(sizes.get(letter, 1), size)
    operands = [(name, term, list(extents)) for name, term, extents in zip(node.input, terms, shapes)]

    def broadcast(name: str, term: str, shape: list[int]) -> tuple[str, list[int]]:
        full = [sizes[c] for c in term]
        if full != shape:
            name = w.op("Expand", [name, w.const(np.array(full, np.int64))])
        return name, full

    def summed(name: str, term: str, shape: list[int], keep: set[str]) -> tuple[str, str, list[int]]:
        drop = [i for i, c in enumerate(term) if c not in keep]
        if not drop:
            return name, term, shape
        name = w.op("ReduceSum", [name, w.const(np.array(drop, np.int64))], keepdims=0)
        return name, "".join(c for c in term if c in keep), [d for i, d in enumerate(shape) if i not in drop]

    def needed(rest: list[tuple[str, str, list[int]]]) -> set[str]:
        return set(output) | {c for _, t, _ in rest for c in t}

    name, term, shape = operands[0]
    name, term, shape = summed(name, term, shape, needed(operands[1:]))
    for i in range(1, len(operands)):
        other, other_term, other_shape = operands[i]
        later = needed(operands[i + 1 :])
        name, term, shape = summed(name, term, shape, later | set(other_term))
        other, other_term, other_shape = summed(other, other_term, other_shape, later | set(term))
        name, shape = broadcast(name, term, shape)
        other, other_shape = broadcast(other, other_term, other_shape)
        batch = [c for c in term if c in other_term and c in later]
        contracted = [c for c in term if c in other_term and c not in later]
        left = [c for c in term if c not in other_term]
        right = [c for c in other_term if c not in term]
        a = _arranged(w, name, term, batch + left + contracted)
        b = _arranged(w, other, other_term, batch + contracted + right)

        def prod(letters: list[str]) -> int:
            return int(np.prod([sizes[c] for c in letters], dtype=np.int64))

        a = w.op("Reshape", [a, w.const(np.array([prod(batch), prod(left), prod(contracted)], np.int64))])
        b = w.op("Reshape", [b, w.const(np.array([prod(batch), prod(contracted), prod(right)], np.int64))])
        product = w.op("MatMul", [a, b])
        term = "".join(batch + left + right)
        shape = [sizes[c] for c in term]
        name = w.op("Reshape", [product, w.const(np.array(shape, np.int64))])
    name, term, shape = summed(name, term, shape, set(output))
    name, shape = broadcast(name, term, shape)
    w.op("Identity", [_arranged(w, name, term, list(output))], node.output[0])
    return True


def _arranged(w: _Writer, name: str, term: str, order: list[str]) -> str:
    if list(term) == order:
        return name
    return w.op("Transpose", [name], perm=[term.index(c) for c in order])


def _parse_einsum(equation: str, ranks: list[int]) -> tuple[list[str], str] | None:
    """The equation's operand terms and output term, `...` spelled out as fresh letters (the
    broadcast axes, right-aligned); None when it does not parse."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return None
    used = set(equation) - set(".,->")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in used]
    width = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = "".join(spare[:width])
    spelled = []
    for term, rank in zip(terms, ranks):
        if "..." in term:
            own = rank - len(term.replace("...", ""))
            term = term.replace("...", ellipsis[width - own :] if own else "")
        if len(term) != rank or not all(c.isalpha() for c in term):
            return None
        spelled.append(term)
    if arrow:
        output = rhs.replace("...", ellipsis)
    else:  # implicit: the broadcast axes, then every index seen once, in alphabetical order
        counts: dict[str, int] = {}
        for c in "".join(spelled):
            counts[c] = counts.get(c, 0) + 1
        output = ellipsis + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ellipsis))
    if not all(c.isalpha() for c in output) or not set(output) <= set("".join(spelled)):
        return None
    return spelled, output


# --- automatic padding ---------------------------------------------------------------------------


def _auto_pad(node: onnx.NodeProto, ctx: _Context, w: _Writer) -> bool:
    """`auto_pad` SAME_UPPER, SAME_LOWER or VALID (the legacy exporter's `padding='same'`) as the
    explicit pads it stands for: TVM writes it as a TIR padding kernel before the operator, which
    has no gradient."""
    mode = _attr(node, "auto_pad", "NOTSET")
    if mode == "NOTSET":
        return False
    shape = ctx.shape(node.input[0])
    if shape is None:
        return False
    spatial = list(shape[2:])
    kernel = _attr(node, "kernel_shape")
    if kernel is None:
        weight = ctx.shape(node.input[1]) if len(node.input) > 1 else None
        if weight is None:
            return False
        kernel = list(weight[2:])
    strides = _attr(node, "strides") or [1] * len(spatial)
    dilations = _attr(node, "dilations") or [1] * len(spatial)
    before, after = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        if mode == "VALID":
            total = 0
        else:
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, large = total // 2, total - total // 2
        before.append(large if mode == "SAME_LOWER" else small)
        after.append(small if mode == "SAME_LOWER" else large)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in ("auto_pad", "pads")}
    w.nodes.append(
        helper.make_node(node.op_type, list(node.input), list(node.output), name=node.name, pads=before + after, **attrs)
    )
    return True


_REWRITES: dict[str, Callable[[onnx.NodeProto, _Context, _Writer], bool]] = {
    "Conv": _auto_pad,
    "MaxPool": _auto_pad,
    "AveragePool": _auto_pad,
    "Pad": _pad,
    "Tile": _tile,
    "CumSum": _cumsum,
    "TopK": _topk,
    "Celu": _celu,
    "Dropout": _dropout,
    "Resize": _resize,
    "Einsum": _einsum,
}


def decompose(
    proto: onnx.ModelProto, values: Mapping[str, np.ndarray], shapes: Shapes, types: Mapping[str, int], opset: int
) -> bool:
    """Every node of `proto` that `_REWRITES` handles, rewritten in place; whether any was."""
    ctx = _Context(values, shapes, types, opset)
    out: list[onnx.NodeProto] = []
    changed = False
    for node in proto.graph.node:
        rewrite = _REWRITES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        writer = _Writer(node)
        if rewrite is not None and rewrite(node, ctx, writer):
            out.extend(writer.nodes)
            changed = True
        else:
            out.append(node)
    if changed:
        del proto.graph.node[:]
        proto.graph.node.extend(out)
    return changed
