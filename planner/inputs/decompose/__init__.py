"""ONNX operators written as other ONNX operators, where TVM would import them without a gradient.

TVM's ONNX frontend lowers a padding, a tile, an einsum or a resize straight to TIR kernels of its
own (`call_tir`), which Relax's gradient pass cannot see through, and it imports `Celu` and the losses a model computing its own loss holds (`SoftmaxCrossEntropyLoss`,
`NegativeLogLikelihoodLoss`) not at all.
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

from collections.abc import Callable, Mapping

import numpy as np
import onnx

from planner.inputs.decompose._einsum import einsum
from planner.inputs.decompose._losses import negative_log_likelihood, softmax_cross_entropy
from planner.inputs.decompose._resize import resize
from planner.inputs.decompose._shapes import auto_pad, celu, cumsum, dropout, hyperbolic, pad, power, tile, topk
from planner.inputs.decompose._writer import Context, Shapes, Writer

_REWRITES: dict[str, Callable[[onnx.NodeProto, Context, Writer], bool]] = {
    "Conv": auto_pad,
    "MaxPool": auto_pad,
    "AveragePool": auto_pad,
    "Pad": pad,
    "Tile": tile,
    "CumSum": cumsum,
    "TopK": topk,
    "Celu": celu,
    "Pow": power,
    "Sinh": hyperbolic,
    "Cosh": hyperbolic,
    "Dropout": dropout,
    "Resize": resize,
    "Einsum": einsum,
    "SoftmaxCrossEntropyLoss": softmax_cross_entropy,
    "NegativeLogLikelihoodLoss": negative_log_likelihood,
}


def decompose(
    proto: onnx.ModelProto, values: Mapping[str, np.ndarray], shapes: Shapes, types: Mapping[str, int], opset: int
) -> bool:
    """Every node of `proto` that `_REWRITES` handles, rewritten in place; whether any was."""
    ctx = Context(values, shapes, types, opset)
    out: list[onnx.NodeProto] = []
    changed = False
    for node in proto.graph.node:
        rewrite = _REWRITES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        writer = Writer(node)
        if rewrite is not None and rewrite(node, ctx, writer):
            out.extend(writer.nodes)
            changed = True
        else:
            out.append(node)
    if changed:
        del proto.graph.node[:]
        proto.graph.node.extend(out)
    return changed
