"""`precision: int8`: a float model quantized as TFLite and TinyEngine quantize it, calibrated on the user's data.

Activations int8 per tensor at scales ONNX Runtime's calibrator measures on training samples,
frozen weights int8 per output channel; the step trains the fake-quantized graph straight through
(its gradient against PyTorch's `fake_quantize`: tests/test_qdq.py). What nobody here wrote judges
it: ONNX's reference evaluator the ranges, ONNX Runtime the quantized forward.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
import tvm
from onnx.reference import ReferenceEvaluator

from builders import blobs, tiny_cnn
from planner import api
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.errors import BadInput, CandidateFailed
from planner.inputs.calibration import calibrate, fake_quantize, quantized_tensors
from planner.inputs.data import load_dataset
from planner.inputs.model import load_model
from planner.inputs.resources import shipped
from planner.inputs.spaces import load_space
from planner.runtime.session import TrainingSession
from planner.types import Candidate, FrozenWeights, Int8Scale, Precision

DIGITS = shipped("examples") / "digits"
VM_INT8 = "tvm_target: {kind: llvm}\nram_budget_bytes: 1MiB\nprecisions: [fp32, int8]\n"


@pytest.mark.parametrize("lo, hi", [(-1.0, 3.0), (0.0, 6.0), (0.5, 2.0), (-4.0, -1.0), (-0.3, 0.3), (0.0, 0.0)])
def test_an_int8_scale_spans_the_range_and_zero_is_a_code(lo, hi):
    """256 codes from min(lo, 0) to max(hi, 0): both ends within half a step of a code, 0 itself a code."""
    a = Int8Scale.spanning(lo, hi)
    assert -128 <= a.zero <= 127 and a.scale > 0 and np.float32(a.scale) == a.scale
    if hi > lo:
        first, last = (-128 - a.zero) * a.scale, (127 - a.zero) * a.scale
        half = a.scale * 0.5001  # the zero point rounded to a code moves the span by at most half a step
        assert first <= min(lo, 0) + half and last >= max(hi, 0) - half
        assert last - first == pytest.approx(255 * a.scale)
    assert Int8Scale.from_json(json.loads(json.dumps(a.to_json()))) == a
    with pytest.raises(ValueError):
        Int8Scale(0.0, 0)


def test_the_tensors_quantized_are_what_a_layer_hands_on(tmp_path):
    """The tiny CNN (Conv-BN-ReLU, MaxPool, Conv-ReLU, GAP, Flatten, Gemm): a ReLU's output is
    quantized; a conv read only by its BatchNorm or its ReLU, and a BatchNorm read only by its
    ReLU, are not (the kernel applies them before requantizing), the max-pool and flatten only
    move codes, the logits stay float."""
    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    proto = model.import_proto(2)
    graph = proto.graph
    made = {o: n.op_type for n in graph.node for o in n.output}
    chosen = quantized_tensors(proto)
    assert [made[t] for t in chosen] == ["Relu", "Relu", "GlobalAveragePool"]
    assert graph.output[0].name not in chosen
    assert not {"MaxPool", "Flatten"} & {made[t] for t in chosen}


def test_an_integer_sum_is_not_an_activation():
    """Position ids `ids + 1` (int64) feeding an embedding: the sum computes but is no float: not
    quantized (ONNX Runtime's calibrator would not even measure it)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Add", ["ids", "one"], ["pos"], name="positions"),
        helper.make_node("Gather", ["table", "pos"], ["emb"], name="embed"),
        helper.make_node("Mul", ["emb", "emb"], ["sq"], name="square"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["logits"], name="mean", keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.ones((8, 3), np.float32), "table"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        "ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert quantized_tensors(proto) == ["sq"]


def test_calibrated_scales_span_each_activation_over_the_training_samples(tmp_path):
    """Each scale spans the least and greatest value its tensor takes over the calibration samples,
    as ONNX's reference evaluator computes them (an oracle ONNX Runtime's calibrator is not)."""
    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    dataset = load_dataset(blobs(tmp_path / "d.npz", n=100), model)
    scales = calibrate(model, dataset, samples=32)
    index = np.linspace(0, len(dataset.train) - 1, 32).astype(np.int64)
    x, _ = dataset.train.batch(index)
    proto = model.import_proto(32)
    assert list(scales) == quantized_tensors(proto)
    del proto.graph.output[:]
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in scales)
    values = ReferenceEvaluator(proto).run(None, {model.only_input.name: x})
    for (name, a), v in zip(scales.items(), values):
        expected = Int8Scale.spanning(float(v.min()), float(v.max()))  # up to the last bits of float sums
        assert a.scale == pytest.approx(expected.scale, rel=1e-5) and abs(a.zero - expected.zero) <= 1, name


def test_the_int8_step_computes_what_onnx_runtime_computes_of_the_quantized_model(tmp_path):
    """An int8 candidate's forward is the model with QuantizeLinear/DequantizeLinear at its
    calibrated scales as ONNX Runtime runs it (frozen weights int8 per channel on both sides)."""
    onnxruntime = pytest.importorskip("onnxruntime", reason="ONNX Runtime is in the test extra")
    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    dataset = load_dataset(blobs(tmp_path / "d.npz", n=100), model)
    model = model.calibrated(calibrate(model, dataset, samples=32))
    candidate = Candidate((("fc", "full"),), 8, "sgd", 0.1, precision="int8")
    step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    assert step.signature.activations == model.calibration and step.signature.quantized
    weights = dict(model.initializers)
    session = TrainingSession(step.library, step.signature, weights)
    x = np.random.default_rng(1).normal(0, 1.2, (8, *model.only_input.static)).astype(np.float32)

    proto = model.import_proto(8)  # the float graph, its frozen weights as int8 gives them back
    for name, axis in step.signature.quantized.items():
        w = weights[name]
        s = np.abs(w).max(axis=tuple(d for d in range(w.ndim) if d != axis), keepdims=True) / 127
        value = np.clip(np.rint(w / s), -127, 127) * s
        proto.graph.initializer.remove(next(t for t in proto.graph.initializer if t.name == name))
        proto.graph.initializer.append(onnx.numpy_helper.from_array(value.astype(np.float32), name))
    fake_quantize(proto, model.calibration)
    proto.ir_version = min(proto.ir_version, 10)
    options = onnxruntime.SessionOptions()  # each node as ONNX defines it: no QLinear kernels fused in
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    ort = onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    expected = ort.run(None, {model.only_input.name: x})[0]
    np.testing.assert_allclose(session.outputs(x), expected, rtol=1e-4, atol=1e-4)
    float_step = compile_candidate(
        model, Candidate((("fc", "full"),), 8, "sgd", 0.1), BuildOptions(tvm.target.Target({"kind": "llvm"}))
    )
    assert not np.allclose(TrainingSession(float_step.library, float_step.signature, weights).outputs(x), expected, atol=1e-4)


def test_int8_candidates_store_frozen_weights_int8_whatever_a_space_draws(tmp_path):
    c = Candidate((("fc", "full"),), 4, "sgd", 0.1, precision="int8", frozen_weights="fp32")
    assert c.precision is Precision.INT8 and c.frozen_weights is FrozenWeights.INT8
    assert Candidate.from_json(c.to_json()) == c
    import optuna

    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    space = load_space("sparse-update").for_target(["fp32", "int8"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    precisions = set()
    for _ in range(30):
        trial = study.ask()
        c = space.sample(trial, model)
        assert c.precision is not Precision.INT8 or c.frozen_weights is FrozenWeights.INT8
        precisions.add(c.precision)
        study.tell(trial, 0.0)
    assert precisions == {Precision.FP32, Precision.INT8}


@pytest.mark.parametrize("optimizer, coded", [("sgd", True), ("momentum", False), ("adam", False)])
def test_trained_weights_are_int8_codes_with_plain_sgd_only(optimizer, coded, tmp_path):
    """An int8 candidate's trained conv and Gemm weights are codes (a byte each on the board) with
    SGD, whose steps cross a code; with momentum or Adam, whose steps of about the rate round away
    and whose fp32 state outweighs the weight anyway, an fp32 master. Biases stay fp32."""
    from planner.backend.graph.weights import stored_weights

    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    how = stored_weights(model, Candidate((("c1", "full"), ("fc", "full")), 4, optimizer, 0.01, precision="int8"))
    assert set(how.coded) == ({"c1.w", "fc.w"} if coded else set())
    assert ("fc.w@int8" in how.signed_trainable) == coded and "fc.b" in how.signed_trainable
    fp32 = stored_weights(model, Candidate((("c1", "full"), ("fc", "full")), 4, "sgd", 0.01))
    assert not fp32.coded and "fc.w" in fp32.signed_trainable


def test_sgd_steps_of_a_fraction_of_a_code_move_coded_weights_as_they_move_fp32_ones(tmp_path):
    """A rate whose steps are mostly under half a code (rounded to nearest, those are lost: the
    ratio below was -0.03): over 100 steps the coded weights of an int8 candidate move along an
    fp32 candidate's path about as far as it does (0.92), each update's fraction of a code rounded
    up that often, and about it at random (the rounding's noise, a walk no direction favours)."""
    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    with np.load(blobs(tmp_path / "d.npz", n=100)) as d:
        x, y = d["x"], d["y"]
    model = model.calibrated(calibrate(model, load_dataset(tmp_path / "d.npz", model), samples=32))
    options = BuildOptions(tvm.target.Target({"kind": "llvm"}))
    moved: dict[str, np.ndarray] = {}
    first: dict[str, np.ndarray] = {}
    for precision in ("fp32", "int8"):
        candidate = Candidate((("c2", "full"), ("fc", "full")), 8, "sgd", 0.002, precision=precision)
        step = compile_candidate(model, candidate, options)
        assert ("c2.w@int8" in step.signature.trainable) == (precision == "int8")
        session = TrainingSession(step.library, step.signature, dict(model.initializers))
        start = session.weights()
        rng = np.random.default_rng(0)
        for i in range(100):
            batch = rng.choice(len(x), 8, replace=False)
            session.step(x[batch], y[batch])
            if i == 0 and precision == "fp32":
                first = {n: session.weights()[n] - start[n] for n in ("c2.w", "fc.w")}
        moved[precision] = np.concatenate([(session.weights()[n] - start[n]).ravel() for n in ("c2.w", "fc.w")])
    for name, w in model.initializers.items():  # fp32's first update, in codes of the int8 weight
        if name in first:
            code = np.abs(w).max(axis=tuple(range(1, w.ndim)), keepdims=True) / 127
            assert np.median(np.abs(first[name]) / code) < 0.5, name
    fp32, int8 = moved["fp32"], moved["int8"]
    # int8's movement along fp32's, in units of fp32's: the rounding's noise is no direction
    assert 0.75 < int8 @ fp32 / (fp32 @ fp32) < 1.33


def test_an_int8_plan_records_its_scales_and_run_trains_the_same_quantized_model(tmp_path):
    """`measure` of an int8 scheme: the plan records each activation's scale (schema 10); `run`
    rebuilds the step from them — its val metrics before training are the plan's — and fine-tunes."""
    model, data = tiny_cnn(tmp_path / "m.onnx"), blobs(tmp_path / "d.npz")
    (tmp_path / "t.yaml").write_text(VM_INT8)
    (tmp_path / "s.yaml").write_text(
        "trainable: [{layer: c1}, {layer: fc}]\nbatch_size: 4\noptimizer: {name: sgd, lr: 0.1}\nprecision: int8\n"
    )
    api.measure(
        model, scheme=tmp_path / "s.yaml", data=data, target=str(tmp_path / "t.yaml"), out=tmp_path / "m", accuracy_steps=30
    )
    plan = json.loads((tmp_path / "m" / "plan.json").read_text())
    assert plan["schema_version"] == 10 and plan["choice"]["precision"] == "int8"
    recorded = {k: Int8Scale.from_json(v) for k, v in plan["step"]["signature"]["activations"].items()}
    loaded = load_model(model)
    assert recorded == calibrate(loaded, load_dataset(data, loaded))
    run = api.run(tmp_path / "m", steps=30, out=tmp_path / "ft")
    assert run.before["accuracy"] == pytest.approx(plan["metrics"]["accuracy"]["before"])
    assert run.after["loss"] < run.before["loss"]


def test_int8_on_a_target_without_it_is_refused_before_any_compile(tmp_path):
    model, data = tiny_cnn(tmp_path / "m.onnx"), blobs(tmp_path / "d.npz")
    (tmp_path / "s.yaml").write_text("trainable: [{layer: fc}]\nbatch_size: 4\noptimizer: {lr: 0.1}\nprecision: int8\n")
    with pytest.raises(BadInput, match="supports only fp32"):
        api.measure(model, scheme=tmp_path / "s.yaml", data=data, out=tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_an_int8_build_of_a_model_never_calibrated_is_one_line(tmp_path):
    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    with pytest.raises(CandidateFailed, match="int8 needs its activations calibrated"):
        model.for_precision(Precision.INT8)


@pytest.mark.slow
def test_an_int8_step_trains_on_the_emulated_cortex_m4_as_the_vm_in_less_sram(tmp_path):
    """The bundled example calibrated and trained in int8 on qemu's Cortex-M4: its frozen
    convolutions write their int8 codes (planner's kernels, integer sums, no fp32 output in
    between), 10 steps give the VM's weights within a code's effect (the VM sums the dequantized
    values in fp32: a value on a rounding boundary may take the next code), and the step holds
    less SRAM than the same scheme's in fp32."""
    from test_mcu import _toolchain, _weights_after_steps  # noqa: F401 - the fixture skips without the toolchain

    from planner.backend import backend_for
    from planner.inputs.targets import load_target

    model = load_model(DIGITS / "model.onnx")
    model = model.calibrated(calibrate(model, load_dataset(DIGITS / "digits.npz", model)))
    candidate = Candidate((("conv3", "full"), ("fc", "full")), batch_size=4, optimizer="sgd", lr=0.05, precision="int8")
    firmware, got, expected = _weights_after_steps("cortex-m4-qemu", model, candidate, tmp_path, rel=1e-3)
    coded = {n.removesuffix("@int8") for n in firmware.signature.trainable if n.endswith("@int8")}
    assert coded == {"conv3.weight", "fc.weight"}  # trained weights are int8 codes on the board
    for name, w in expected.items():  # a trained weight's value may take its next code, one scale step
        code = np.abs(w).max(axis=tuple(range(1, w.ndim)), keepdims=True) / 127 if name in coded else 0.0
        assert np.all(np.abs(got[name] - w) <= 1e-3 + 1.01 * code), name
    assert firmware.signature.activations == model.calibration
    assert sum(kernel.startswith("conv2d_q") for kernel, _ in firmware.calls) == 2  # conv1 (a float input), conv2 (codes)
    head = Candidate((("fc", "full"),), batch_size=4, optimizer="sgd", lr=0.05, precision="int8")  # its frozen layers' peak
    backend = backend_for(load_target("cortex-m4-qemu"), cache_dir=tmp_path)
    int8, fp32 = (backend.build(model, replace(head, precision=p)) for p in ("int8", "fp32"))
    assert int8.memory.activations < 0.6 * fp32.memory.activations


def _reference(x, codes, w, bias, clip, out, strides, pads, depthwise):
    """The int8-activation convolution in numpy, operation by operation as the kernels define it.
    A float input: sums in float32 over (channel, row, column) in order from 0 of the dequantized
    weight (`q * scale`), the bias added, the clip, then `quantize`: divided by the scale, rounded
    half to even, the zero point added, saturated. int8 codes: sums of `(x - zero) * q` exact in
    integers, times `x_scale * scale / out_scale` plus `bias / out_scale` in float32, clamped to
    the clip's and int8's codes, rounded half to even, the zero point added."""
    f32 = np.float32
    q, scale = w
    xs = (x.astype(np.int64) - codes[1]) if codes else x
    ws = q.astype(np.int64) if codes else q.astype(f32) * scale.reshape(-1, 1, 1, 1)
    (sh, sw), (pt, pl, pb, pr) = strides, pads
    padded = np.pad(xs, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    n, c, h, wd_ = x.shape
    o, per, kh, kw = q.shape
    oh, ow = (h + pt + pb - kh) // sh + 1, (wd_ + pl + pr - kw) // sw + 1
    acc = np.zeros((n, o, oh, ow), np.int64 if codes else f32)
    for ci in range(per):
        for ky in range(kh):
            for kx in range(kw):
                taps = padded[:, :, ky : ky + sh * (oh - 1) + 1 : sh, kx : kx + sw * (ow - 1) + 1 : sw]
                tap = taps if depthwise else taps[:, ci : ci + 1]
                acc = acc + ws[None, :, ci, ky, kx, None, None] * tap
    if codes:  # the sum over the output's scale, clamped to the codes the clip and int8 leave, rounded
        m, b = f32(codes[0]) * scale / f32(out[0]), bias / f32(out[0])
        v = acc.astype(f32) * m[None, :, None, None] + b[None, :, None, None]
        with np.errstate(over="ignore"):
            lo, hi = (np.clip(np.rint(f32(bound) / f32(out[0])), -128 - out[1], 127 - out[1]) for bound in clip)
        return (np.rint(np.clip(v, lo, hi)) + out[1]).astype(np.int8), (oh, ow)
    v = np.maximum(np.minimum(acc + bias[None, :, None, None], f32(clip[1])), f32(clip[0]))
    rounded = np.rint(v / f32(out[0])) + f32(out[1])
    return np.clip(rounded, -128, 127).astype(np.int8), (oh, ow)


def test_the_int8_activation_kernels_are_numpys_float32_arithmetic_bit_for_bit(tmp_path):
    """planner's C convolutions that write int8 activations (`planner_conv_q`, `planner_dwconv_q`
    and their float- and pixel-input forms) against numpy's integers and float32, operation by operation, in
    plain C and in the DSP extension's order (SMLAD, SXTB16, emulated on the host): dense kernels
    1, 3 and 5 and depthwise 3 and 5, odd and even maps, strides 1 and 2 (and unlike ones),
    no padding, "same" and TensorFlow's uneven "same", several images, the chunks of output
    pixels and the scratch the lowering gives each call (`scratch_floats`), no clip, a ReLU, a
    ReLU6; each output code the same."""
    import ctypes
    import subprocess

    from planner.backend.graph.quantized import UNCLIPPED
    from planner.backend.lower.quantized import scratch_floats
    from planner.backend.mcu._firmware import RUNTIME
    from planner.backend.sgemm.im2col import Conv

    sources = [str(RUNTIME / "dwconv.c"), str(RUNTIME / "sgemm.c")]
    libraries = []
    for simd in ([], ["-DPLANNER_SIMD32"]):  # plain C, and the order of the DSP extension's SMLAD and SXTB16
        library = tmp_path / f"q{len(simd)}.so"
        command = ["gcc", "-O2", "-ffp-contract=off", "-shared", "-fPIC", *simd, "-o", str(library), *sources]
        subprocess.run(command, check=True)
        libraries.append(ctypes.CDLL(str(library)))
    p, i, f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
    rng = np.random.default_rng(0)
    clips = ((-UNCLIPPED, UNCLIPPED), (0.0, UNCLIPPED), (0.0, 6.0))
    cases = 0
    for depthwise, k, (h, w), strides, pads, codes in [
        (False, 1, (7, 5), (1, 1), (0, 0, 0, 0), True),  # 10 channels: two words of 4 and 2 more; odd pixels
        (False, 1, (8, 8), (1, 1), (0, 0, 0, 0), False),
        (False, 1, (6, 6), (1, 1), (0, 0, 0, 0), "words"),  # 8 channels: two words of 4, no remainder
        (False, 3, (9, 7), (2, 2), (1, 1, 1, 1), True),
        (False, 3, (8, 8), (2, 2), (0, 0, 1, 1), True),  # TensorFlow's "same" at stride 2: padded after only
        (False, 3, (6, 5), (1, 2), (1, 0, 1, 2), False),
        (False, 5, (11, 10), (2, 1), (2, 2, 2, 2), True),
        (False, 3, (40, 40), (1, 1), (1, 1, 1, 1), True),  # several chunks of pixels, the last one short
        (False, 3, (9, 8), (2, 2), (1, 1, 1, 1), "pixels"),  # 8-bit pixels decoded per channel as read
        (True, 3, (9, 7), (2, 2), (1, 1, 1, 1), True),
        (True, 3, (8, 8), (1, 1), (1, 1, 1, 1), False),
        (True, 5, (7, 10), (1, 2), (2, 1, 2, 2), True),
        (True, 3, (5, 5), (1, 1), (0, 0, 0, 0), True),
    ]:
        n, c = 2, 8 if codes == "words" else 10 if k == 1 and not depthwise else 3
        codes = True if codes == "words" else codes
        o = c if depthwise else 5
        x = rng.integers(-128, 128, (n, c, h, w)).astype(np.int8) if codes else rng.normal(0, 2, (n, c, h, w)).astype(np.float32)
        x_codes = (0.05, int(rng.integers(-20, 20))) if codes is True else None
        decode = (rng.uniform(0.01, 0.02, c).astype(np.float32), rng.uniform(-2, 2, c).astype(np.float32))
        pixels = rng.integers(0, 256, (n, c, h, w)).astype(np.uint8)
        if codes == "pixels":  # the reference reads them decoded as the step decodes them (float32 `p * s + o`)
            x = pixels.astype(np.float32) * decode[0][:, None, None] + decode[1][:, None, None]
        q = rng.integers(-127, 128, (o, 1 if depthwise else c, k, k)).astype(np.int8)
        scale = rng.uniform(0.005, 0.05, o).astype(np.float32)
        bias = rng.normal(0, 0.5, o).astype(np.float32)
        for clip in clips:
            out = (float(np.float32(rng.uniform(0.02, 0.1))), int(rng.integers(-128, 0)))
            expected, (oh, ow) = _reference(x, x_codes, (q, scale), bias, clip, out, strides, pads, depthwise)
            sizes = Conv(n, c, h, w, o, k, k, oh, ow, *strides, pads[0], pads[1])
            chunk, floats = scratch_floats(sizes, not depthwise, codes is True)
            y, scratch = np.full(expected.shape, 77, np.int8), np.full(floats + 64, np.nan, np.float32)  # 64 guards
            args = [p(x.ctypes.data), *((f(x_codes[0]), i(x_codes[1])) if x_codes else ())]
            if codes == "pixels":
                args = [p(pixels.ctypes.data), p(decode[0].ctypes.data), p(decode[1].ctypes.data)]
            args += [p(q.ctypes.data), p(scale.ctypes.data), p(bias.ctypes.data), f(clip[0]), f(clip[1]), f(out[0])]
            args += [i(out[1]), p(y.ctypes.data), p(scratch.ctypes.data)]
            dims = [n, c, h, w, *(() if depthwise else (o,)), k, k, oh, ow, *strides, pads[0], pads[1]]
            name = ("planner_dwconv_q" if depthwise else "planner_conv_q") + {True: "", False: "f", "pixels": "p"}[codes]
            for simd, lib in enumerate(libraries):
                y[:] = 77
                kernel = getattr(lib, name)
                kernel.restype = i
                assert kernel(*args, *([] if depthwise else [i(chunk)]), *map(i, dims)) == 0, name
                message = f"{name} k{k} {h}x{w} {strides} {pads} clip {clip} simd32 {simd}"
                np.testing.assert_array_equal(y, expected, err_msg=message)
                assert np.isnan(scratch[floats:]).all(), f"{message}: wrote past its scratch"
            assert len(np.unique(expected)) > 4  # the codes span a range: the case tests something
            cases += 1
    assert cases == 39


def _conv_unit(
    bias_shape=(1, 5, 1, 1), groups=1, dilation=1, out=(5, 6, 5), second_reader=False, times_shape=None, bias_before=False
):
    """A Relax function `quantize(relu(conv2d(x, astype(q) * s) [* t] + b))` over a [1, 5, 6, 5]
    input (ow == o: a bias along the wrong axis broadcasts without error), its int8 output
    returned; with `times_shape`, the conv times `t` first (an inference BatchNorm's `x * a + b`),
    with `bias_before` the conv plus `b` before that."""
    from tvm import relax

    o, oh, ow = out
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 5, 6, 5), "float32"))
    q = relax.Var("q", relax.TensorType((o, 5 // groups, 3, 3), "int8"))
    s = relax.Var("s", relax.TensorType((o, 1, 1, 1), "float32"))
    b = relax.Var("b", relax.TensorType(bias_shape, "float32"))
    t = relax.Var("t", relax.TensorType(times_shape or (1,), "float32"))
    with bb.function("f", [x, q, s, b, t]):
        with bb.dataflow():
            w = bb.emit(relax.op.multiply(bb.emit(relax.op.astype(q, "float32")), s))
            conv = bb.emit(relax.op.nn.conv2d(x, w, padding=dilation, dilation=dilation, groups=groups))
            if bias_before:
                conv = bb.emit(relax.op.add(conv, b))
            if times_shape is not None:
                conv = bb.emit(relax.op.multiply(conv, t))
            r = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(conv, b))))
            y = bb.emit(relax.op.quantize(r, relax.const(0.05, "float32"), relax.const(-128, "int8"), axis=1, out_dtype="int8"))
            outputs = (y, conv) if second_reader else y
            gv = bb.emit_output(relax.Tuple(outputs) if second_reader else outputs)
        bb.emit_func_output(gv)
    return bb.get()["f"]


@pytest.mark.parametrize(
    "case, found",
    [
        ({}, True),
        ({"bias_shape": (5, 1, 1)}, True),
        ({"bias_shape": (5,)}, False),  # broadcast along the columns, not the channels
        ({"bias_shape": (1, 1, 1, 5)}, False),
        ({"groups": 5}, True),  # depthwise
        ({"groups": 5, "out": (10, 6, 5), "bias_shape": (1, 10, 1, 1)}, False),  # two filters a channel: grouped
        ({"dilation": 2}, False),
        ({"second_reader": True}, False),  # the fp32 output is read elsewhere: it must exist
        ({"times_shape": (5, 1, 1)}, True),  # a BatchNorm's multiply-add, folded
        ({"times_shape": (1, 1, 1, 5)}, False),
        ({"times_shape": (5, 1, 1), "bias_before": True}, True),  # a convolution's own bias, then its BatchNorm
        ({"bias_before": True}, False),  # two biases, no factor: not a unit the kernel computes
    ],
)
def test_a_quantized_convolution_is_a_unit_only_when_its_kernel_computes_it_exactly(case, found):
    from planner.backend.graph.quantized import read_counts, units

    func = _conv_unit(**case)
    bindings = [b for block in func.body.blocks for b in block.bindings]
    assert bool(units(bindings, read_counts(func))) is found


@pytest.mark.slow
def test_mobilenet_v2_in_int8_computes_on_the_emulated_cortex_m7_what_the_vm_does(tmp_path):
    """MobileNetV2 (BatchNorm after each convolution, ReLU6, residual sums) calibrated in int8,
    its first layers frozen and its input 8-bit pixels, on qemu's Cortex-M7: its dense and
    depthwise convolutions, each BatchNorm folded in, write their codes (planner's kernels), its
    residual sums read and write codes in TVM's fused kernels, its pooling reads codes. The
    board's sums are exact integers, the VM's fp32 sums of the dequantized values: a value within
    their last bits of a rounding boundary takes the next code, and in a network of random
    weights the next layers carry it on. So over 12 batches (the weights unchanged: each step a
    forward on new data) most losses are the VM's to float precision and none is off by more
    than a few percent; a wrong kernel or a wrong fold would move every one (the kernels' own
    arithmetic is checked to the bit in
    `test_the_int8_activation_kernels_are_numpys_float32_arithmetic_bit_for_bit`, training
    through them in `test_an_int8_step_trains_on_the_emulated_cortex_m4_as_the_vm_in_less_sram`)."""
    from test_mcu import _toolchain  # noqa: F401 - the fixture skips without the toolchain

    import zoo
    from planner.backend import backend_for
    from planner.inputs.targets import load_target
    from planner.measurement import runner_for
    from planner.types import Encoding

    path = zoo.save(zoo.mobilenet_v2(0.35, 32), tmp_path / "mbv2.onnx")
    model = load_model(path)
    names = [layer.name for layer in model.layers if layer.trainable]
    data = blobs(tmp_path / "d.npz", n=64, n_classes=model.n_classes, shape=(3, 32, 32))
    model = model.encoded({model.only_input.name: Encoding((0.02, 0.03, 0.025), (-2.0, -1.5, -1.8))})
    model = model.calibrated(calibrate(model, load_dataset(data, model), samples=32))
    candidate = Candidate(((names[-2], "full"), (names[-1], "full")), batch_size=2, optimizer="sgd", lr=0.0, precision="int8")
    target = load_target("cortex-m7-qemu")
    backend = backend_for(target, cache_dir=tmp_path)
    firmware, host = backend.build(model, candidate), backend.host_build(model, candidate)
    vm = TrainingSession(host.library, host.signature, dict(model.initializers))
    rng, losses = np.random.default_rng(1), []

    def forward(session) -> dict[str, np.ndarray]:
        for _ in range(12):
            x = rng.normal(0, 1, (candidate.batch_size, *model.only_input.shape)).astype(np.float32)
            y = rng.integers(0, model.n_classes, candidate.batch_size)
            losses.append((session.step(x, y), vm.step(x, y)))
        return session.weights()

    runner_for(target).train(firmware, dict(model.initializers), forward)
    apart = [abs(board - here) / here for board, here in losses]
    assert sum(d < 1e-5 for d in apart) >= 8 and max(apart) < 5e-2, apart
    here = [h for _, h in losses]
    assert max(here) > 1.2 * min(here)  # the losses follow the batches: equal ones would prove nothing
    kernels = [kernel for kernel, _ in firmware.calls]
    assert sum(k.startswith("conv2d_q") for k in kernels) > 20 and sum(k.startswith("depthwise_conv2d_q") for k in kernels) > 10
    assert any(k.startswith("mean_of_codes") for k in kernels)  # the global pooling sums the last map's codes


def test_one_code_for_every_channel_reads_the_pixels_as_a_code_per_channel_does(tmp_path):
    """An input in 8 bits under one scale and offset (an array's code) is read by the first
    convolution as pixels, as under a scale and offset per channel of the same values: the same
    kernels, the same SRAM (the decoded fp32 image is never held)."""
    from test_mcu import _toolchain  # noqa: F401 - the fixture skips without the toolchain

    from planner.backend import backend_for
    from planner.inputs.targets import load_target
    from planner.types import Encoding

    model = load_model(tiny_cnn(tmp_path / "m.onnx", channels=3))
    data = blobs(tmp_path / "d.npz", n=64, shape=(3, 6, 6))
    candidate = Candidate((("fc", "full"),), batch_size=2, optimizer="sgd", lr=0.05, precision="int8")
    backend = backend_for(load_target("cortex-m4-qemu"), cache_dir=tmp_path)
    built = []
    for code in (Encoding((0.02,), (-2.0,)), Encoding((0.02,) * 3, (-2.0,) * 3)):
        encoded = load_model(tmp_path / "m.onnx").encoded({model.only_input.name: code})
        encoded = encoded.calibrated(calibrate(encoded, load_dataset(data, encoded), samples=32))
        built.append(backend.build(encoded, candidate))
    one, per_channel = built
    assert [k for k, _ in one.calls] == [k for k, _ in per_channel.calls]
    assert one.memory == per_channel.memory
