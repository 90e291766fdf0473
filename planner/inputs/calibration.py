"""Activations in int8 (`precision: int8`): which tensors, at what scales, and how the graph says so.

Post-training quantization as TFLite and TinyEngine do it: every activation a layer hands the
next is int8 per tensor, asymmetric (`types.Int8Scale`), its range measured on training samples
by ONNX Runtime's calibrator (MinMax over each tensor). The scales are written into the graph TVM
imports as `QuantizeLinear -> DequantizeLinear` pairs, a fake quantization the step trains
straight through (`planner.backend.graph.rewrites`): the QDQ form ONNX Runtime's
`quantize_static` writes, so a model a user quantized and one planner quantized train alike.

Which tensors: the output of every operation that computes (a convolution, a product, a sum, a
pooling average, an activation), as an int8 kernel requantizes it; not a convolution's output
that only a ReLU, a clip or a BatchNorm reads (the kernel applies those before requantizing, so
the tensor is never stored), not what merely moves values (a reshape, a max-pool: they stay on their input's
codes), not the model's output (the loss reads floats). The input is the step's own 8-bit codes
(`planner.inputs.encodings`) where the target takes 8-bit inputs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper, numpy_helper

from planner.errors import BadInput, first_line
from planner.types import Int8Scale

if TYPE_CHECKING:
    from planner.inputs.data import Dataset
    from planner.inputs.model import Model

__all__ = ["CALIBRATION_SAMPLES", "calibrate", "fake_quantize", "quantized_tensors"]

# training samples whose activations set the scales (evenly spaced over the split: folders of
# images are sorted by class), in batches of `_BATCH`
CALIBRATION_SAMPLES = 256
_BATCH = 16

# operations whose output an int8 kernel requantizes: each such tensor is stored in int8
_COMPUTING = frozenset(
    {
        "Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Relu", "Clip", "LeakyRelu",
        "HardSigmoid", "HardSwish", "Sigmoid", "Tanh", "Gelu", "Softmax", "GlobalAveragePool", "AveragePool",
        "ReduceMean", "Concat", "BatchNormalization", "LayerNormalization",
    }
)  # fmt: skip
# what an int8 kernel applies to its accumulators before it requantizes: activations, and after a
# convolution an inference BatchNorm (folded into its per-channel scales and bias, as TFLite's and
# TinyEngine's converters fold it)
_FUSED = frozenset({"Relu", "Clip", "LeakyRelu", "HardSwish", "HardSigmoid"})
_FOLDED = {"Conv": _FUSED | {"BatchNormalization"}}


def quantized_tensors(proto: onnx.ModelProto) -> list[str]:
    """The activations `precision: int8` stores in int8, in graph order (see the module's docstring)."""
    graph = proto.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    floats = _float_tensors(proto)
    chosen = []
    for node in graph.node:
        if node.op_type not in _COMPUTING or node.domain not in ("", "ai.onnx") or node.output[:1] == []:
            continue
        if node.output[0] not in floats:  # an integer sum (position ids): not an activation
            continue
        tensor, read = node.output[0], readers.get(node.output[0], [])
        fused = _FOLDED.get(node.op_type, _FUSED)
        if tensor in outputs or not read or all(r.op_type in fused and r.input[0] == tensor for r in read):
            continue
        chosen.append(tensor)
    return chosen


def _float_tensors(proto: onnx.ModelProto) -> set[str]:
    """The float32 values `proto` computes, as ONNX's shape inference types them (one it cannot
    type is left float and unquantized)."""
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    values = [*inferred.value_info, *inferred.output]
    return {v.name for v in values if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}


def calibrate(model: Model, dataset: Dataset, *, samples: int = CALIBRATION_SAMPLES) -> dict[str, Int8Scale]:
    """Each activation of `model` that `precision: int8` quantizes -> its scale, spanning the
    values it takes over `samples` training samples of `dataset` (ONNX Runtime runs the float
    model, the graph TVM imports, and records each tensor's least and greatest value)."""
    from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator

    from planner.inputs.fixups import for_import

    plain = model.exported  # calibrated on the floats an 8-bit input decodes to
    n = min(samples, len(dataset.train))
    batch = min(_BATCH, n)
    n -= n % batch
    proto = for_import(plain.proto, batch, set(plain.parameters), plain.lengths)
    proto.ir_version = min(proto.ir_version, 10)  # what ONNX Runtime reads
    try:
        tensors = quantized_tensors(proto)
    except onnx.shape_inference.InferenceError as exc:  # a graph ONNX cannot type: not one to calibrate
        raise BadInput(
            f"{model.path.name}: ONNX cannot type its values to calibrate int8 activations: {first_line(exc)}"
        ) from None
    if not tensors:
        return {}
    index = np.linspace(0, len(dataset.train) - 1, n).astype(np.int64)
    names = [i.name for i in plain.inputs]

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            self.starts = iter(range(0, n, batch))

        def get_next(self) -> dict[str, np.ndarray] | None:
            start = next(self.starts, None)
            if start is None:
                return None
            x, _ = dataset.train.batch(index[start : start + batch])
            return dict(zip(names, [x] if isinstance(x, np.ndarray) else x))

    producers = {node.output[0]: node.op_type for node in proto.graph.node if node.output}
    with tempfile.TemporaryDirectory(prefix="planner-calibration-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save(proto, path)
        try:
            calibrator = create_calibrator(
                path,
                op_types_to_calibrate=sorted({producers[t] for t in tensors}),
                augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                calibrate_method=CalibrationMethod.MinMax,
            )
            calibrator.collect_data(Batches())
            ranges = calibrator.compute_data()
        except Exception as exc:  # ONNX Runtime refusing an operator or an opset: the model, not planner
            raise BadInput(
                f"{model.path.name}: ONNX Runtime could not run it to calibrate int8 activations: {first_line(exc)}"
            ) from None
    spans = {t: [float(np.asarray(v).reshape(-1)[0]) for v in ranges[t].range_value] for t in tensors if t in ranges}
    # a tensor reaching an infinity (an attention mask's -inf) has no int8 scale: it stays float
    return {t: Int8Scale.spanning(lo, hi) for t, (lo, hi) in spans.items() if np.isfinite(lo) and np.isfinite(hi)}


def fake_quantize(proto: onnx.ModelProto, scales: Mapping[str, Int8Scale]) -> None:
    """Each tensor named in `scales` quantized to int8 and dequantized right after the node that
    computes it, every reader taking the dequantized values (in place)."""
    g = proto.graph
    computed = {o for node in g.node for o in node.output}
    # a value this batch's graph folded into a constant (a constant computation small enough at batch 1,
    # not at the calibration's 16) is not quantized: it is no activation
    scales = {t: a for t, a in scales.items() if t in computed}
    renamed = {t: f"{t}:int8:fake" for t in scales}
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        nodes.append(node)
        for t in node.output:
            if t in scales:
                nodes += _quantized(t, scales[t], renamed[t])
    del g.node[:]
    g.node.extend(nodes)


def _quantized(tensor: str, at: Int8Scale, out: str) -> list[onnx.NodeProto]:
    """`QuantizeLinear` of `tensor` to int8 and `DequantizeLinear` back, into `out`."""
    scale, zero = f"{tensor}:int8:scale", f"{tensor}:int8:zero"
    return [
        helper.make_node(
            "Constant", [], [scale], name=scale, value=numpy_helper.from_array(np.array(at.scale, np.float32), scale)
        ),
        helper.make_node("Constant", [], [zero], name=zero, value=numpy_helper.from_array(np.array(at.zero, np.int8), zero)),
        helper.make_node("QuantizeLinear", [tensor, scale, zero], [f"{tensor}:int8"], name=f"{tensor}:quantize"),
        helper.make_node("DequantizeLinear", [f"{tensor}:int8", scale, zero], [out], name=f"{tensor}:dequantize"),
    ]
