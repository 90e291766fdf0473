"""Models quantized the QDQ way (ONNX Runtime's `quantize_static`, PyTorch's PT2E export) plan and run.

A QDQ model's weights are `DequantizeLinear` of int8 initializers: planner reads them as the float
values they stand for, which train (`planner.inputs.fixups.dequantize_weights`). Its activations
are quantized and dequantized at once, a fake quantization, which trains straight-through as
PyTorch's `fake_quantize` does (`planner.backend.graph.rewrites`). What nobody here wrote judges
both: PyTorch's autograd the gradient, ONNX Runtime the model planner writes back. What cannot
run: nothing (ONNX Runtime and PyTorch are in the test extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner import api
from planner.errors import BadInput
from planner.inputs.model import load_model
from planner.inputs.resources import shipped

DIGITS = shipped("examples") / "digits"


def _quantized_by_onnx_runtime(source: Path, out: Path, x: np.ndarray) -> Path:
    """`source` quantized by ONNX Runtime's `quantize_static`: QDQ, int8 weights per channel,
    int8 activations calibrated on the first 32 samples of `x`."""
    ort_quant = pytest.importorskip("onnxruntime.quantization", reason="ONNX Runtime is in the test extra")
    model = onnx.load(source)
    model.ir_version = min(model.ir_version, 10)  # the newest ONNX Runtime reads IR 10
    plain = out.with_suffix(".float.onnx")
    onnx.save(model, plain)
    name = model.graph.input[0].name

    class Calibration(ort_quant.CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{name: x[i : i + 1]} for i in range(32)])

        def get_next(self):
            return next(self.batches, None)

    ort_quant.quantize_static(
        str(plain),
        str(out),
        Calibration(),
        quant_format=ort_quant.QuantFormat.QDQ,
        per_channel=True,
        activation_type=ort_quant.QuantType.QInt8,
        weight_type=ort_quant.QuantType.QInt8,
    )
    return out


@pytest.mark.slow
def test_a_model_onnx_runtime_quantized_plans_runs_and_ort_runs_what_it_wrote(tmp_path):
    """The bundled example quantized by ONNX Runtime: its layers train (their weights the
    dequantized int8 values), `measure` and `run` fine-tune it, and the model planner writes back
    — still QDQ on its activations — is one ONNX Runtime runs, to the accuracy planner measured."""
    import onnxruntime

    data = np.load(DIGITS / "digits.npz")
    path = _quantized_by_onnx_runtime(DIGITS / "model.onnx", tmp_path / "digits_qdq.onnx", data["x_train"])
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    model = load_model(path)
    trainable = [layer.name for layer in model.layers if layer.trainable]
    assert {"conv1", "conv2", "conv3", "fc"} <= set(trainable)
    scheme = tmp_path / "scheme.yaml"
    scheme.write_text(
        "trainable:\n  - {layer: conv3, mode: full}\n  - {layer: fc, mode: full}\nbatch_size: 8\noptimizer: {name: adam, lr: 0.005}\n"
    )
    result = api.measure(
        path, scheme=scheme, data=DIGITS / "digits.npz", out=tmp_path / "plan", accuracy_steps=60, latency_repeats=2
    )
    accuracy = result.plan.metrics.accuracy
    assert accuracy.after > accuracy.before + 0.2
    run = api.run(tmp_path / "plan", data=DIGITS / "digits.npz", steps=60, out=tmp_path / "tuned")
    tuned = onnx.load(tmp_path / "tuned" / "model.onnx")
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in tuned.graph.node}
    session = onnxruntime.InferenceSession(str(tmp_path / "tuned" / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: data["x_val"]})[0]
    ort_accuracy = float((logits.argmax(1) == data["y_val"]).mean())
    assert ort_accuracy == pytest.approx(run.after["accuracy"], abs=0.03)


def _fake_quantized_cnn(path: Path, rng: np.random.Generator, qdq: bool = True) -> Path:
    """input -> QDQ (scale 0.05) -> Conv 1->4 3x3 -> Relu -> QDQ (scale 0.01, zero -128: [0, 2.55]) ->
    GlobalAveragePool -> Flatten -> Gemm -> logits, as a QDQ export writes it; without `qdq`, the
    float model (input -> Conv -> Relu -> ...)."""

    def const(name: str, value) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(value)))

    nodes = [
        const("s_in", np.float32(0.05)),
        const("z_in", np.int8(0)),
        helper.make_node("QuantizeLinear", ["input", "s_in", "z_in"], ["q_in"], name="quant_in"),
        helper.make_node("DequantizeLinear", ["q_in", "s_in", "z_in"], ["x"], name="dequant_in"),
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        const("s_act", np.float32(0.01)),
        const("z_act", np.int8(-128)),
        helper.make_node("QuantizeLinear", ["r", "s_act", "z_act"], ["q_act"], name="quant_act"),
        helper.make_node("DequantizeLinear", ["q_act", "s_act", "z_act"], ["a"], name="dequant_act"),
        helper.make_node("GlobalAveragePool", ["a"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
    ]
    if not qdq:
        nodes = [n for n in nodes if n.op_type not in ("Constant", "QuantizeLinear", "DequantizeLinear")]
        nodes[0].input[0], nodes[2].input[0] = "input", "r"
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.8, (4, 1, 3, 3)).astype(np.float32), "conv.weight"),
        numpy_helper.from_array(rng.normal(0, 0.3, 4).astype(np.float32), "conv.bias"),
        numpy_helper.from_array(rng.normal(0, 0.5, (3, 4)).astype(np.float32), "fc.weight"),
        numpy_helper.from_array(np.zeros(3, np.float32), "fc.bias"),
    ]
    graph = helper.make_graph(
        nodes,
        "fake_quantized_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    return path


def test_fake_quantization_trains_straight_through_as_pytorchs(tmp_path):
    """One SGD step of a CNN with its input and its ReLU's output fake-quantized is PyTorch's step
    with `torch.fake_quantize_per_tensor_affine` at the same scales: the forward rounds as it does,
    and the gradient passes straight through where a value is inside the integers' range and not
    where it is clipped (some activations here are above the range's 2.55)."""
    torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate

    rng = np.random.default_rng(0)
    model = load_model(_fake_quantized_cnn(tmp_path / "m.onnx", rng))
    x = rng.normal(0, 1.5, (4, 1, 6, 6)).astype(np.float32)
    y = np.array([0, 1, 2, 1])
    lr = 0.1
    candidate = Candidate((("conv", "full"), ("fc", "full")), 4, "sgd", lr)
    step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    session = TrainingSession(step.library, step.signature, model.initializers)
    loss = session.step(x, y)
    after = session.weights()

    params = {n: torch.tensor(v, requires_grad=True) for n, v in model.initializers.items()}
    fq = torch.fake_quantize_per_tensor_affine
    xq = fq(torch.from_numpy(x), 0.05, 0, -128, 127)
    r = torch.relu(torch.nn.functional.conv2d(xq, params["conv.weight"], params["conv.bias"], padding=1))
    assert (r > 2.55).any() and ((r > 0) & (r < 2.55)).any()  # both sides of the range count
    a = fq(r, 0.01, -128, -128, 127)
    logits = a.mean(dim=(2, 3)) @ params["fc.weight"].T + params["fc.bias"]
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
    expected.backward()
    assert loss == pytest.approx(float(expected), rel=1e-5)
    for name, p in params.items():
        np.testing.assert_allclose(after[name], (p - lr * p.grad).detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(params["conv.weight"].grad.numpy()).max() > 0  # a gradient crossed the fake quantization


def test_a_quantized_activation_read_as_integers_is_one_line(tmp_path):
    """A QuantizeLinear whose integers something other than its DequantizeLinear reads is not a
    fake quantization planner can train: refused at load, naming the node."""
    rng = np.random.default_rng(0)
    path = _fake_quantized_cnn(tmp_path / "m.onnx", rng)
    model = onnx.load(path)
    model.graph.node.append(helper.make_node("Cast", ["q_act"], ["leak"], name="leak", to=TensorProto.FLOAT))
    model.graph.output.append(helper.make_tensor_value_info("leak", TensorProto.FLOAT, ["batch", 4, 6, 6]))
    onnx.save(model, tmp_path / "leaky.onnx")
    with pytest.raises(BadInput, match="quant_act.*read by 'leak'"):
        load_model(tmp_path / "leaky.onnx")


@pytest.mark.slow
def test_a_qdq_model_trains_on_the_emulated_cortex_m4_as_the_vm(tmp_path):
    """The QDQ digits model's step as C (quantize and dequantize in its kernels, frozen weights int8
    read in place) on qemu's Cortex-M4: 10 steps, the weights the VM's."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_mcu import _close, _toolchain, _weights_after_steps  # noqa: F401 - the fixture skips without the toolchain

    from planner.types import Candidate

    data = np.load(DIGITS / "digits.npz")
    path = _quantized_by_onnx_runtime(DIGITS / "model.onnx", tmp_path / "digits_qdq.onnx", data["x_train"])
    candidate = Candidate((("conv1", "bias"), ("fc", "full")), batch_size=4, optimizer="sgd", lr=0.05, frozen_weights="int8")
    _, got, expected = _weights_after_steps("cortex-m4-qemu", path, candidate, tmp_path)
    _close(got, expected)


def test_an_int8_step_updates_its_weights_codes_as_pytorch_fake_quantized_sgd(tmp_path):
    """`precision: int8` stores a trained conv's and Gemm's weights as int8 codes and per-channel
    scales, as TinyEngine does: one SGD step gives the codes of PyTorch's step from the weights the
    codes stand for (activations fake-quantized at the calibrated scales, gradients straight
    through), rounded at the scales stochastically (up with the chance of the value's fraction of
    a code, the chance drawn by the hash below), each scale grown where its channel's largest |w|
    outgrew 127 codes (this step's large rate grows some, not all); the biases train in fp32."""
    torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate, Int8Scale

    rng = np.random.default_rng(3)
    act = {"r": Int8Scale(0.01, -128), "p": Int8Scale(0.004, -128)}  # the ReLU's [0, 2.55], the pool's [0, 1.02]
    model = load_model(_fake_quantized_cnn(tmp_path / "m.onnx", rng, qdq=False)).calibrated(act)
    x = rng.normal(0, 1.5, (4, 1, 6, 6)).astype(np.float32)
    y = np.array([0, 1, 2, 1])
    lr = 0.5
    candidate = Candidate((("conv", "full"), ("fc", "full")), 4, "sgd", lr, precision="int8")
    step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    assert set(step.signature.activations) == set(act)
    assert {"conv.weight@int8", "fc.weight@int8"} <= set(step.signature.trainable)
    session = TrainingSession(step.library, step.signature, model.initializers)
    loss = session.step(x, y)
    after = session.weights()

    scales, params = {}, {}
    for name, w in model.initializers.items():
        if name.endswith("weight"):  # per output channel, symmetric: the channel's largest |w| is code 127
            scales[name] = np.abs(w).max(axis=tuple(range(1, w.ndim)), keepdims=True) / 127
            w = np.clip(np.rint(w / scales[name]), -127, 127) * scales[name]
        params[name] = torch.tensor(w.astype(np.float32), requires_grad=True)
    fq = torch.fake_quantize_per_tensor_affine
    r = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x), params["conv.weight"], params["conv.bias"], padding=1))
    pooled = fq(fq(r, 0.01, -128, -128, 127).mean(dim=(2, 3)), 0.004, -128, -128, 127)
    expected = torch.nn.functional.cross_entropy(pooled @ params["fc.weight"].T + params["fc.bias"], torch.from_numpy(y))
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    grew = {}
    for name, p in params.items():
        new = (p - lr * p.grad).detach().numpy().astype(np.float64)
        if name not in scales:
            np.testing.assert_allclose(after[name], new, rtol=1e-5, atol=1e-6, err_msg=name)
            continue
        peak = np.abs(new).max(axis=tuple(range(1, new.ndim)), keepdims=True)
        grown = np.maximum(scales[name], peak / 127)
        grew[name] = (grown > scales[name] * (1 + 1e-6)).ravel()
        codes, before = np.rint(after[name] / grown), np.rint(p.detach().numpy() / grown)
        np.testing.assert_allclose(after[name], codes * grown, rtol=1e-5, err_msg=name)  # on the grid: codes
        salt = ["conv.weight", "fc.weight"].index(name)  # the coded weights' order in the step
        exact, u = new / grown, _uniform(np.arange(new.size, dtype=np.uint64), 0, salt).reshape(new.shape)
        tie = np.abs(exact - np.floor(exact) - u) < 1e-3  # float32 sums may round either way
        assert np.array_equal(codes[~tie], (np.floor(exact) + (u < exact - np.floor(exact)))[~tie]), name
        assert (codes != before).sum() > codes.size // 4, name  # the update moved codes, not only rounded away
    assert any(g.any() for g in grew.values()) and not all(g.all() for g in grew.values())


def _uniform(index: np.ndarray, steps: int, salt: int) -> np.ndarray:
    """The number in [0, 1) a coded weight's stochastic rounding draws for each flat `index` at
    the optimizer's step count `steps` (0 on the first step) for the coded weight `salt`: the hash
    `planner.backend.graph.weights` states, written again here from its statement."""
    m = np.uint64(0xFFFFFFFF)

    def mul(a, k: int):
        return (a * np.uint64(k)) & m

    x = (mul(index & m, 0x9E3779B1) + mul(np.uint64(steps), 0x85EBCA6B) + mul(np.uint64(salt), 0xC2B2AE35)) & m
    x = mul(x ^ (x >> np.uint64(16)), 0x7FEB352D)
    x = mul(x ^ (x >> np.uint64(15)), 0x846CA68B)
    x = x ^ (x >> np.uint64(16))
    return (x >> np.uint64(8)).astype(np.float64) / (1 << 24)
