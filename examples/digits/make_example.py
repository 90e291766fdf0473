"""Make the bundled example: a small CNN pretrained on one domain and a transfer task on another.

Data: scikit-learn's handwritten digits (1,797 real 8x8 scans, shipped with scikit-learn, no
download). Half the images, as scanned (dark ink on light paper, scaled to [0, 1]), pretrain the
CNN with planner's own TVM training path. The other half becomes the *transfer* task: the same
digits seen by a different sensor — inverted contrast, with a gain and offset. The pretrained
first layers respond to the wrong ink, so fine-tuning only the classifier head is clearly worse
than also updating the early layers, and that costs memory and time: a real trade-off to plan.

Run from the repository root (needs the `example` extra: scikit-learn):

    python examples/digits/make_example.py

It writes `model.onnx` (Conv-BN-ReLU x3, pooling, Gemm; symbolic batch) and `digits.npz`
(x_train, y_train, x_val, y_val of the transfer task) next to this file. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model, save_onnx
from planner.runtime.session import TrainingSession
from planner.types import Candidate

HERE = Path(__file__).resolve().parent


def build_cnn(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv-BN-ReLU(1->16), Conv-BN-ReLU(16->32), MaxPool, Conv-BN-ReLU(32->32), GAP, Gemm(32->10)."""
    inits: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def param(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def conv_bn_relu(i: int, x: str, cin: int, cout: int) -> str:
        w = param(f"conv{i}.weight", rng.normal(0.0, np.sqrt(2.0 / (cin * 9)), (cout, cin, 3, 3)))
        b = param(f"conv{i}.bias", np.zeros(cout))
        nodes.append(helper.make_node("Conv", [x, w, b], [f"conv{i}"], name=f"conv{i}", kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        bn = [param(f"bn{i}.{k}", v) for k, v in (("scale", np.ones(cout)), ("bias", np.zeros(cout)), ("mean", np.zeros(cout)), ("var", np.ones(cout)))]
        nodes.append(helper.make_node("BatchNormalization", [f"conv{i}", *bn], [f"bn{i}"], name=f"bn{i}"))
        nodes.append(helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"], name=f"relu{i}"))
        return f"relu{i}"

    x = conv_bn_relu(1, "image", 1, 16)
    x = conv_bn_relu(2, x, 16, 32)
    nodes.append(helper.make_node("MaxPool", [x], ["pool2"], name="pool2", kernel_shape=[2, 2], strides=[2, 2]))
    x = conv_bn_relu(3, "pool2", 32, 32)
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["features"], name="flatten"))
    w = param("fc.weight", rng.normal(0.0, np.sqrt(1.0 / 32), (10, 32)))
    b = param("fc.bias", np.zeros(10))
    nodes.append(helper.make_node("Gemm", ["features", w, b], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="planner-example")
    onnx.checker.check_model(model)
    return model


def sensor_shift(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The target domain: inverted contrast, per-image gain and offset."""
    gain = rng.uniform(0.6, 1.0, (len(x), 1, 1, 1))
    offset = rng.uniform(-0.1, 0.1, (len(x), 1, 1, 1))
    return ((1.0 - x) * gain + offset).astype(np.float32)


def pretrain(model_path: Path, x: np.ndarray, y: np.ndarray, steps: int, seed: int) -> dict[str, np.ndarray]:
    """Train every layer on the source domain with planner's compiled step (SGD)."""
    import tvm

    model = load_model(model_path)
    everything = tuple((layer.name, "full") for layer in model.layers)
    cand = Candidate(trainable=everything, batch_size=32, optimizer="sgd", lr=0.1)
    step = compile_candidate(model, cand, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    session = TrainingSession(step.library, step.signature, model.initializers)
    rng = np.random.default_rng(seed)
    for k in range(steps):
        idx = rng.choice(len(x), 32, replace=False)
        loss = session.step(x[idx], y[idx])
        if k % 200 == 0:
            print(f"pretrain step {k}: loss {loss:.3f}")
    print(f"pretrain: source accuracy {session.evaluate(x, y)[1]:.3f}")
    return session.weights()


def calibrate_batchnorm(model_path: Path, weights: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    """Give every BN layer the real running statistics of the source data, function unchanged.

    planner trains BN in inference form, so pretraining keeps the initial statistics (mean 0,
    var 1). Measuring each BN input on the source data and folding the difference into scale and
    bias yields a model that computes the same function but carries the statistics a real
    pretrained network has, which frozen BN layers then use on the new domain.
    """
    from onnx.reference import ReferenceEvaluator

    model = load_model(model_path)
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    bn_nodes = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
    for node in bn_nodes:
        proto.graph.output.append(helper.make_tensor_value_info(node.input[0], TensorProto.FLOAT, None))
    for i, t in enumerate(proto.graph.initializer):
        proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(weights[t.name], t.name))
    logits, *outs = ReferenceEvaluator(proto).run(None, {model.input_name: x})
    w = dict(weights)
    for node, act in zip(bn_nodes, outs):
        scale, bias, mean_name, var_name = node.input[1], node.input[2], node.input[3], node.input[4]
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        m, v = act.mean(axis=(0, 2, 3)), act.var(axis=(0, 2, 3))
        old = np.sqrt(w[var_name] + eps)  # scale/old is the slope before recalibration
        w[bias] = (w[bias] + w[scale] * (m - w[mean_name]) / old).astype(np.float32)
        w[scale] = (w[scale] * np.sqrt(v + eps) / old).astype(np.float32)
        w[mean_name], w[var_name] = m.astype(np.float32), v.astype(np.float32)
    for i, t in enumerate(proto.graph.initializer):
        proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(w[t.name], t.name))
    recalibrated = ReferenceEvaluator(proto).run(None, {model.input_name: x[:64]})[0]
    assert np.allclose(recalibrated, logits[:64], atol=1e-3), "BN recalibration changed the function"
    return w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    from sklearn.datasets import load_digits

    rng = np.random.default_rng(args.seed)
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int64)
    order = rng.permutation(len(x))
    source, target = order[: len(x) // 2], order[len(x) // 2 :]

    args.out.mkdir(parents=True, exist_ok=True)
    model_path = args.out / "model.onnx"
    onnx.save(build_cnn(rng), model_path)
    weights = pretrain(model_path, x[source], y[source], args.steps, args.seed)
    weights = calibrate_batchnorm(model_path, weights, x[source])
    save_onnx(load_model(model_path), weights, model_path)

    xt, yt = sensor_shift(x[target], rng), y[target]
    n_val = len(xt) // 3
    np.savez_compressed(args.out / "digits.npz", x_train=xt[n_val:], y_train=yt[n_val:], x_val=xt[:n_val], y_val=yt[:n_val])
    print(f"wrote {model_path} and {args.out / 'digits.npz'} ({len(xt) - n_val} train, {n_val} val)")


if __name__ == "__main__":
    main()
