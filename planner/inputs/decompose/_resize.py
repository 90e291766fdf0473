"""`Resize` as gathers along each resized axis."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from planner.inputs.decompose._writer import Context, Writer, attr

# --- resize --------------------------------------------------------------------------------------


def resize(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`Resize` (nearest, linear, cubic; any coordinate mode) as gathers along each resized axis.

    ONNX's resize is separable: each output is a fixed combination of inputs along each axis in
    turn. The combination for one axis is read off ONNX's own reference, resizing one-hot inputs,
    so every mode and rounding rule is the reference's: per output position, the inputs it reads
    (`Gather`) and their weights (`Mul`, summed). Nearest reads one input at weight one."""
    shape = ctx.shape(node.input[0])
    out_shape = ctx.shape(node.output[0])
    if shape is None or out_shape is None:
        return False
    if attr(node, "coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        return False
    if attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        return False
    rank = len(shape)
    scales, sizes = ctx.const(node, 2), ctx.const(node, 3)
    axes = attr(node, "axes")
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


def _combine(w: Writer, x: str, axis: int, rank: int, matrix: np.ndarray, dtype: np.dtype) -> str:
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
