"""Rewrites of the losses PyTorch's exporters write for a model that computes its own loss:
`F.cross_entropy` (`SoftmaxCrossEntropyLoss`) and `F.nll_loss` (`NegativeLogLikelihoodLoss`).

TVM imports neither. Each is written as the log-probabilities picked by a one-hot of the labels
(a product and a sum, whose gradients planner has), an ignored label (`ignore_index`) masked out
of the sum and of the count the mean divides by, as ONNX defines them."""

from __future__ import annotations

import numpy as np
import onnx

from planner.inputs.decompose._writer import Context, Writer, attr


def _picked(node: onnx.NodeProto, ctx: Context, w: Writer, logp: str) -> bool:
    """-logp[label] per element, reduced as the node says, into the node's first output."""
    shape = ctx.shape(logp) or ctx.shape(node.input[0])
    if shape is None or len(shape) < 2 or (len(node.input) > 2 and node.input[2]):
        return False  # class weights: not written here, left for the operator table to refuse
    labels, classes = node.input[1], shape[1]
    dtype = ctx.dtype(node.input[0])
    float_type = onnx.helper.np_dtype_to_tensor_dtype(dtype)
    ignore = attr(node, "ignore_index")
    counted = None
    if ignore is not None:
        ignored = w.op("Equal", [labels, w.const(np.array(ignore, np.int64))])
        labels = w.op("Where", [ignored, w.const(np.array(0, np.int64)), labels])
        counted = w.op("Sub", [w.const(np.array(1.0, dtype)), w.op("Cast", [ignored], to=float_type)])
    one_hot = w.op("OneHot", [labels, w.const(np.array(classes, np.int64)), w.const(np.array([0.0, 1.0], dtype))], axis=1)
    one_hot = w.op("Cast", [one_hot], to=float_type)  # TVM's import makes it float64 whatever its values are
    each = w.op("Neg", [w.op("ReduceSum", [w.op("Mul", [logp, one_hot]), w.const(np.array([1], np.int64))], keepdims=0)])
    if counted is not None:
        each = w.op("Mul", [each, counted])
    reduction = attr(node, "reduction", "mean")
    if reduction == "none":
        w.op("Identity", [each], node.output[0])
    elif reduction == "sum":
        w.op("ReduceSum", [each], node.output[0], keepdims=0)
    elif counted is None:
        w.op("ReduceMean", [each], node.output[0], keepdims=0)
    else:
        total = w.op("ReduceSum", [each], keepdims=0)
        count = w.op("Max", [w.op("ReduceSum", [counted], keepdims=0), w.const(np.array(1.0, dtype))])
        w.op("Div", [total, count], node.output[0])
    return True


def softmax_cross_entropy(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`SoftmaxCrossEntropyLoss(scores [N, C, ...], labels [N, ...])`: LogSoftmax over the classes,
    then the negative log-likelihood; its optional second output, the log-probabilities."""
    logp = w.op("LogSoftmax", [node.input[0]], axis=1)
    if not _picked(node, ctx, w, logp):
        return False
    if len(node.output) > 1 and node.output[1]:
        w.op("Identity", [logp], node.output[1])
    return True


def negative_log_likelihood(node: onnx.NodeProto, ctx: Context, w: Writer) -> bool:
    """`NegativeLogLikelihoodLoss(log_probs [N, C, ...], labels [N, ...])`."""
    return _picked(node, ctx, w, node.input[0])
