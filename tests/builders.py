"""Small ONNX models and datasets built in code for the tests (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def tiny_cnn(path: Path, seed: int = 0, extra_op: str | None = None, n_classes: int = 3) -> Path:
    """Conv-BN-ReLU(1->4) MaxPool Conv(4->6)-ReLU GAP Flatten Gemm(6->C), input [batch,1,6,6].

    `extra_op` inserts a single-input op (e.g. "Sigmoid") right before the classifier head.
    """
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def p(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    nodes.append(helper.make_node("Conv", ["x", p("c1.w", rng.normal(0, 0.5, (4, 1, 3, 3))), p("c1.b", rng.normal(0, 0.1, 4))], ["a1"], name="c1", pads=[1, 1, 1, 1]))
    bn = [p("bn.s", rng.uniform(0.5, 1.5, 4)), p("bn.b", rng.normal(0, 0.1, 4)), p("bn.m", rng.normal(0, 0.1, 4)), p("bn.v", rng.uniform(0.5, 1.5, 4))]
    nodes.append(helper.make_node("BatchNormalization", ["a1", *bn], ["a2"], name="bn"))
    nodes.append(helper.make_node("Relu", ["a2"], ["a3"], name="r1"))
    nodes.append(helper.make_node("MaxPool", ["a3"], ["a4"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
    nodes.append(helper.make_node("Conv", ["a4", p("c2.w", rng.normal(0, 0.4, (6, 4, 3, 3))), p("c2.b", rng.normal(0, 0.1, 6))], ["a5"], name="c2", pads=[1, 1, 1, 1]))
    nodes.append(helper.make_node("Relu", ["a5"], ["a6"], name="r2"))
    nodes.append(helper.make_node("GlobalAveragePool", ["a6"], ["a7"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["a7"], ["a8"], name="flat"))
    feat = "a8"
    if extra_op:
        nodes.append(helper.make_node(extra_op, ["a8"], ["a9"], name="blocker"))
        feat = "a9"
    nodes.append(helper.make_node("Gemm", [feat, p("fc.w", rng.normal(0, 0.5, (n_classes, 6))), p("fc.b", rng.normal(0, 0.1, n_classes))], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", n_classes])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def blobs(path: Path, n: int = 240, n_classes: int = 3, seed: int = 0, shape=(1, 6, 6), **overrides) -> Path:
    """A learnable task: one random template per class plus noise; x/y splits (last 20 % val)."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(0, 1, (n_classes, *shape))
    y = rng.integers(0, n_classes, n)
    x = templates[y] + rng.normal(0, 0.8, (n, *shape))
    arrays = {"x": x.astype(np.float32), "y": y.astype(np.int64)}
    arrays.update(overrides)
    np.savez(path, **arrays)
    return path
