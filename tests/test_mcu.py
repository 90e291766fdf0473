"""Microcontroller targets: the `c` back end's firmware run and counted on qemu's Cortex-M boards.

The firmware trains where it is measured: on each emulated core the weights after 10 steps are
those of the VM's step on this machine (within 1e-5), the SRAM planner planned before linking is
the linked ELF's (within 1 %), and a plan made for an emulated board reproduces its accuracy when
`planner run` trains it there. What cannot run: nothing here (the toolchain and qemu come from the
package registries, `.ci/run`).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner import api
from planner.backend import backend_for
from planner.backend.mcu._firmware import _fpu_flags
from planner.backend.mcu.ckernels import CLAMPS
from planner.errors import BadInput, CandidateFailed, EnvironmentFailure
from planner.inputs.data import load_dataset
from planner.inputs.model import Model, load_model
from planner.inputs.resources import shipped
from planner.inputs.schemes import load_scheme
from planner.inputs.targets import load_target
from planner.measurement import runner_for
from planner.measurement.qemu import QemuSession, kernel_instructions
from planner.runtime.session import TrainingSession
from planner.search.evaluate import EvalSettings, Evaluator
from planner.types import Candidate, Encoding, TrialRecord, TrialResult, TrialState
from processes import PLANNED, planner

DIGITS = shipped("examples") / "digits"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _toolchain():
    missing = [t for t in ("arm-none-eabi-gcc", "qemu-system-arm") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install gcc-arm-none-eabi libnewlib-arm-none-eabi qemu-system-arm)")


def _weights_after_steps(
    target_name: str,
    model_path: Path | Model,
    candidate: Candidate,
    cache: Path,
    steps: int = 10,
    encoding: Encoding | None = None,
    rel: float = 1e-5,
):
    """(firmware, weights on the emulated board, weights of the VM's step here) after `steps` steps
    on the same batches, each step's loss within `rel` of the VM's; with `encoding`, both steps
    take the input in 8 bits."""
    model = model_path if isinstance(model_path, Model) else load_model(model_path)
    if encoding is not None:
        model = model.encoded({model.only_input.name: encoding})
    target = load_target(target_name)
    backend = backend_for(target, cache_dir=cache)
    firmware = backend.build(model, candidate)
    host = backend.host_build(model, candidate)
    vm = TrainingSession(host.library, host.signature, dict(model.initializers))
    rng = np.random.default_rng(1)

    def train(session) -> dict[str, np.ndarray]:
        for _ in range(steps):
            x = rng.normal(0, 1, (candidate.batch_size, *model.only_input.shape)).astype(np.float32)
            y = rng.integers(0, model.n_classes, candidate.batch_size)
            assert session.step(x, y) == pytest.approx(vm.step(x, y), rel=rel)
        return session.weights()

    return firmware, runner_for(target).train(firmware, dict(model.initializers), train), vm.weights()


def _close(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5, err_msg=name)


def test_the_firmware_trains_as_the_vm_on_the_emulated_cortex_m4(tmp_path):
    model = load_model(DIGITS / "model.onnx")
    candidate = load_scheme(str(DIGITS / "head-only.yaml")).candidate(model)
    firmware, got, expected = _weights_after_steps("cortex-m4-qemu", DIGITS / "model.onnx", candidate, tmp_path)
    _close(got, expected)
    changed = [n for n in candidate_params(candidate, model) if not np.array_equal(got[n], model.initializers[n])]
    assert changed, "the trained layer did not move"
    # planned before linking, measured from the ELF's sections: within 1 %
    assert abs(firmware.planned_sram_bytes - firmware.memory.total) <= 0.01 * firmware.memory.total
    # frozen weights are flash constants, not SRAM
    frozen = sum(model.initializers[n].nbytes for n in firmware.signature.frozen)
    assert firmware.memory.frozen_params == 0 and firmware.stored_bytes > frozen
    assert {f.name for f in firmware.files} >= {"train_step.elf", "train_step.c", "train_step.h", "train_step.mk"}


def candidate_params(candidate: Candidate, model) -> list[str]:
    return [p for name, mode in candidate.trainable for p in model.layer(name).params_for(mode)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["fc_autoencoder", "regression_mlp", "bert_tagger", "detector"])
def test_each_task_trains_as_the_vm_on_the_emulated_cortex_m4(family, tmp_path):
    """Every layer of a model of each kind of task (tests/torch_families.py's TASK_FAMILIES: an
    autoencoder, a tanh regression MLP, a token tagger with padding ignored, a detector computing
    its own loss with an `Abs`) steps on the emulated board as the VM's step does here: the same
    loss each step, the same weights after five. Before, the `c` back end refused the detector
    (TVM's C code generator has no `fabs`; a scalar output had no class count) and every tanh."""
    tf = pytest.importorskip("torch_families")
    from planner.tasks import TASKS

    model = load_model(tf.export(family, "dynamo"))
    if model.task.name != tf.TASK_FAMILIES[family].task:  # an autoencoder's output could be a classifier's
        model = model.with_task(TASKS[tf.TASK_FAMILIES[family].task])
    candidate = Candidate(tuple((layer.name, "full") for layer in model.layers), 2, "sgd", 0.05)
    target = load_target("cortex-m4-qemu")
    backend = backend_for(target, cache_dir=tmp_path)
    host = backend.host_build(model, candidate)
    vm = TrainingSession(host.library, host.signature, dict(model.initializers))

    def train(session) -> dict[str, np.ndarray]:
        for i in range(5):
            x, y = tf.sample_batch(family, 2, seed=i)
            assert session.step(x, y) == pytest.approx(vm.step(x, y), rel=1e-5)
        return session.weights()

    _close(runner_for(target).train(backend.build(model, candidate), dict(model.initializers), train), vm.weights())


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cortex-m7-qemu", "cortex-m55-qemu"])
def test_the_firmware_trains_as_the_vm_on_every_emulated_core(target, tmp_path):
    model = load_model(DIGITS / "model.onnx")
    candidate = load_scheme(str(DIGITS / "last-conv.yaml")).candidate(model)
    firmware, got, expected = _weights_after_steps(target, DIGITS / "model.onnx", candidate, tmp_path)
    _close(got, expected)
    assert abs(firmware.planned_sram_bytes - firmware.memory.total) <= 0.01 * firmware.memory.total


@pytest.mark.slow
def test_int8_frozen_weights_lora_and_adam_train_as_the_vm_on_the_board(tiny_model, tmp_path):
    candidate = Candidate(
        trainable=(("c1", "lora:2"), ("fc", "full")), batch_size=4, optimizer="adam", lr=0.01, frozen_weights="int8"
    )
    _, got, expected = _weights_after_steps("cortex-m4-qemu", tiny_model, candidate, tmp_path)
    _close(got, expected)


def test_int8_frozen_convolutions_are_read_from_flash_and_train_as_the_vm(tmp_path):
    """A frozen dense convolution stored int8 is multiplied where it lies, in flash: the step
    holds no dequantized copy of it in SRAM (DS-CNN's pointwise weights: 16 KiB each), so the
    int8 step takes the SRAM of the fp32 one but for its depthwise weights (still dequantized,
    by TVM's kernels), and it trains as the VM — with the input gradient crossing every frozen
    convolution on its way to the first layer's bias."""
    sys.path.insert(0, str(Path(__file__).parent))
    import zoo

    path = zoo.save(zoo.ds_cnn(), tmp_path / "ds_cnn.onnx")
    candidate = Candidate(
        (("conv1", "bias"), ("classifier", "full")), batch_size=2, optimizer="sgd", lr=0.01, frozen_weights="int8"
    )
    firmware, got, expected = _weights_after_steps("cortex-m4-qemu", path, candidate, tmp_path)
    _close(got, expected)
    for kernel in ("conv2d_gemm_s8", "conv2d_input_grad_gemm_s8"):
        assert any(name.startswith(kernel) for name, _ in firmware.calls), kernel

    model = load_model(path)
    backend = backend_for(load_target("cortex-m4-qemu"), cache_dir=tmp_path)
    lean = Candidate((("b3.pw_bn", "bias"), ("classifier", "bias")), batch_size=1, optimizer="sgd", lr=0.01)
    sram = {w: backend.build(model, replace(lean, frozen_weights=w)).memory.total for w in ("fp32", "int8")}
    depthwise = sum(4 * model.initializers[f"b{i}.dw.weight"].size for i in range(4))
    assert sram["int8"] <= sram["fp32"] + depthwise, sram


def test_weights_that_are_not_the_firmwares_are_refused(tmp_path):
    """Frozen weights are compiled into flash: a session given others says so, not trains wrong."""
    model = load_model(DIGITS / "model.onnx")
    candidate = load_scheme(str(DIGITS / "head-only.yaml")).candidate(model)
    target = load_target("cortex-m4-qemu")
    firmware = backend_for(target, cache_dir=tmp_path).build(model, candidate)
    other = {n: (w + 1).astype(w.dtype) for n, w in model.initializers.items()}
    with pytest.raises(CandidateFailed, match="frozen weights"):
        QemuSession(firmware, other, target.mcu)


def test_a_missing_emulator_is_the_machines_failure_not_the_candidates(tmp_path, monkeypatch):
    model = load_model(DIGITS / "model.onnx")
    candidate = load_scheme(str(DIGITS / "head-only.yaml")).candidate(model)
    target = load_target("cortex-m4-qemu")
    firmware = backend_for(target, cache_dir=tmp_path).build(model, candidate)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(EnvironmentFailure, match="qemu-system-arm"):
        runner_for(target).measure(firmware, dict(model.initializers), 1)


def test_a_microcontroller_target_needs_the_c_back_end_and_tvm_kernels(tmp_path):
    text = (shipped("hw_targets") / "cortex-m4-qemu.yaml").read_text()
    for change, error in (
        (("backend: c\nrunner: qemu", "backend: vm\nrunner: local"), "needs `backend: c`"),
        (("kernels: portable", "kernels: openblas"), "set `kernels: portable`"),
    ):
        path = tmp_path / "t.yaml"
        path.write_text(text.replace(*change))
        with pytest.raises(BadInput, match=error):
            api.check_target(str(path))


@pytest.mark.slow
def test_a_plan_for_an_emulated_board_reproduces_its_accuracy_when_run_there(tmp_path):
    """`planner plan --target cortex-m4-qemu` on the bundled example, then `planner run PLAN`:
    trained on the emulated board, the plan's measured accuracy comes back."""
    out = tmp_path / "plan"
    env = {"PLANNER_CACHE_DIR": str(tmp_path / "cache")}
    steps = "40"
    cli = [sys.executable, "-m", "planner"]
    common = {"capture_output": True, "text": True, "env": {**os.environ, **env}}
    done = subprocess.run(
        [*cli, "plan", "--target", "cortex-m4-qemu", "--out", str(out), "--trials", "2", "--accuracy-steps", steps], **common
    )
    assert done.returncode in PLANNED, done.stderr  # what is reproduced, not whether 40 steps learned
    plan = json.loads((out / "plan.json").read_text())
    assert plan["step"]["kind"] == "c-firmware" and plan["target"]["device"] == "qemu:mps2-an386"
    assert "instructions per step" in plan["measurement"]["latency"]
    assert plan["metrics"]["peak_memory_bytes"]["total"] <= 512 * 1024
    (image,) = plan["step"]["signature"]["inputs"]  # the board takes 8-bit codes spanning the data's range
    assert image["dtype"] == "uint8" and len(image["encoding"]["scale"]) == 1
    done = subprocess.run([*cli, "run", str(out), "--steps", steps, "--out", str(tmp_path / "run"), "--json"], **common)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["device"] == "qemu:mps2-an386"
    assert result["after"]["accuracy"] == pytest.approx(plan["metrics"]["accuracy"]["after"], abs=1e-9)


def test_the_portable_sgemm_is_blas_for_every_transposition_and_odd_size(tmp_path):
    """planner's C sgemm (the microcontroller kernels' products) against numpy: row-major,
    each operand plain or transposed, sizes around its 4x4 blocks, leading dimensions wider than
    the operands, beta 0 (C's old values ignored, NaN included) and 1. Its int8 form (a frozen
    weight read where it lies, each stored row times its scale) computes bit for bit what the
    fp32 sgemm computes on the dequantized weight: the copy it no longer makes."""
    from planner.backend.mcu._firmware import RUNTIME

    library = tmp_path / "sgemm.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(RUNTIME / "sgemm.c")], check=True)
    sgemm, sgemm_s8 = ctypes.CDLL(str(library)).planner_sgemm, ctypes.CDLL(str(library)).planner_sgemm_s8
    f, i, p = ctypes.c_float, ctypes.c_int32, ctypes.c_void_p
    sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    sgemm_s8.argtypes = [i, i, i, i, i, i, f, p, i, p, p, p, i, f, p, i]
    rng = np.random.default_rng(0)
    for m, n, k in [(1, 1, 1), (4, 4, 4), (5, 7, 3), (16, 9, 13), (3, 8, 0), (9, 4, 33)]:
        for ta, tb in [(111, 111), (111, 112), (112, 111), (112, 112)]:
            for beta in (0.0, 1.0):
                a = rng.normal(size=(k, m + 2) if ta == 112 else (m, k + 2)).astype(np.float32)
                b = rng.normal(size=(n, k + 1) if tb == 112 else (k, n + 1)).astype(np.float32)
                c = rng.normal(size=(m, n + 3)).astype(np.float32)
                if beta == 0.0:
                    c[:] = np.nan
                padding = c[:, n:].copy()
                op_a = a[:, :m].T if ta == 112 else a[:, :k]
                op_b = b[:, :k].T if tb == 112 else b[:, :n]
                expected = op_a.astype(np.float64) @ op_b + beta * np.nan_to_num(c[:, :n].astype(np.float64))
                q = rng.integers(-127, 128, size=a.shape).astype(np.int8)
                scale = rng.uniform(0.001, 0.1, size=a.shape[0]).astype(np.float32)
                dequantized = q.astype(np.float32) * scale[:, None]
                via_copy, in_place = c.copy(), c.copy()
                args = (101, ta, tb, m, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], beta)
                assert sgemm(*args, c.ctypes.data, c.shape[1]) == 0
                np.testing.assert_allclose(c[:, :n], expected, rtol=1e-5, atol=1e-5, err_msg=f"{m}x{n}x{k} {ta} {tb} {beta}")
                np.testing.assert_array_equal(c[:, n:], padding)  # nothing written past n
                copy = (101, ta, tb, m, n, k, 1.0, dequantized.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], beta)
                assert sgemm(*copy, via_copy.ctypes.data, c.shape[1]) == 0
                panel = np.full(4 * k + 1, np.nan, np.float32)  # the caller's scratch: anything in it before
                read = (101, ta, tb, m, n, k, 1.0, q.ctypes.data, a.shape[1], scale.ctypes.data, panel.ctypes.data)
                read += (b.ctypes.data, b.shape[1])
                assert sgemm_s8(*read, beta, in_place.ctypes.data, c.shape[1]) == 0
                np.testing.assert_array_equal(in_place, via_copy, err_msg=f"int8 {m}x{n}x{k} {ta} {tb} {beta}")


@pytest.mark.slow
def test_dense_convolutions_take_at_most_4_instructions_per_mac_on_the_cortex_m4(tmp_path):
    """Instruction counts are deterministic under `-icount` (no wall clock): every dense convolution
    kernel call of the example's all-layers step, forward and both gradients, counted on the
    emulated Cortex-M4, takes at most 4 instructions per multiply-accumulate (TVM's scalar loops
    as C: about 13.5)."""
    model = load_model(DIGITS / "model.onnx")
    target = load_target("cortex-m4-qemu")
    candidate = load_scheme(str(DIGITS / "all-layers.yaml")).candidate(model)
    firmware = backend_for(target, cache_dir=tmp_path).build(model, candidate)
    counts = kernel_instructions(firmware, dict(model.initializers), target.mcu)
    dense = {
        f"{name} #{i}": count / (flops // 2) for i, ((name, flops), count) in enumerate(zip(firmware.calls, counts)) if flops
    }
    assert len(dense) >= 8, dense  # the 3 layers' forward, input and weight gradients
    assert max(dense.values()) <= 4.0, dense


def test_the_portable_depthwise_convolution_is_numpys_for_every_shape(tmp_path):
    """planner's C depthwise convolution (the microcontroller's, `runtime/dwconv.c`) against numpy's
    sums over a zero-padded image in float64: kernels 1, 3, 5 and 7 (3x3 its unrolled interior),
    odd and even maps narrower and wider than the kernel, strides 1 to 3, padding none, symmetric
    and TensorFlow's uneven "same", several images and channels. Its int8 form equals the fp32 one
    on the dequantized filter bit for bit."""
    from planner.backend.mcu._firmware import RUNTIME

    library = tmp_path / "dwconv.so"
    sources = [str(RUNTIME / "dwconv.c"), str(RUNTIME / "sgemm.c")]  # its int8-activation dense kernel calls the sgemm
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), *sources], check=True)
    lib = ctypes.CDLL(str(library))
    i, p = ctypes.c_int32, ctypes.c_void_p
    lib.planner_dwconv.argtypes = [p, p, p, *[i] * 12]
    lib.planner_dwconv_s8.argtypes = [p, p, p, p, *[i] * 12]
    rng = np.random.default_rng(0)
    cases = 0
    for k in (1, 3, 5, 7):
        for h, w in ((1, 1), (2, 9), (7, 6), (8, 8), (13, 4)):
            for stride in (1, 2, 3):
                for pads in ((0, 0, 0, 0), (k // 2,) * 4, (k // 2, (k - 1) // 2, (k - 1) // 2, k // 2)):
                    pt, pl, pb, pr = pads
                    oh, ow = (h + pt + pb - k) // stride + 1, (w + pl + pr - k) // stride + 1
                    if oh < 1 or ow < 1:
                        continue
                    n, c = 2, 3
                    x = rng.normal(size=(n, c, h, w)).astype(np.float32)
                    q = rng.integers(-127, 128, size=(c, 1, k, k)).astype(np.int8)
                    scale = rng.uniform(0.01, 0.1, size=c).astype(np.float32)
                    f = q.astype(np.float32) * scale[:, None, None, None]
                    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
                    expected = np.zeros((n, c, oh, ow))
                    for ki in range(k):
                        for kj in range(k):
                            taps = padded[
                                :, :, ki : ki + stride * (oh - 1) + 1 : stride, kj : kj + stride * (ow - 1) + 1 : stride
                            ]
                            expected += taps * f[None, :, 0, ki, kj, None, None]
                    y, y_q = (np.full((n, c, oh, ow), np.nan, np.float32) for _ in range(2))
                    sizes = (n, c, h, w, k, k, oh, ow, stride, stride, pt, pl)
                    assert lib.planner_dwconv(x.ctypes.data, f.ctypes.data, y.ctypes.data, *sizes) == 0
                    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5, err_msg=f"k{k} {h}x{w} s{stride} {pads}")
                    assert lib.planner_dwconv_s8(x.ctypes.data, q.ctypes.data, scale.ctypes.data, y_q.ctypes.data, *sizes) == 0
                    np.testing.assert_array_equal(y_q, y)
                    cases += 1
    assert cases > 150


@pytest.mark.slow
@pytest.mark.parametrize("frozen_start", [False, True], ids=["first-bias", "frozen-start-in-bands"])
def test_mobilenet_v2_trains_as_the_vm_with_its_activations_overwritten(frozen_start, tmp_path):
    """MobileNetV2's blocks (BatchNorm and ReLU6 after each im2col convolution, residual adds) on
    the board: its elementwise kernels write over activations nothing reads afterwards
    (`planner.backend.lower.activations`), and the weights after 10 steps are still the VM's. With its
    first layers frozen, the board computes them in row bands (`planner.backend.graph.bands`) and the
    classifier's product through sgemm beside the convolutions', the VM neither; its input taken
    as 8-bit pixels, decoded band by band, on a Cortex-M7 (clamps by VMINNM/VMAXNM)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import zoo

    path = zoo.save(zoo.mobilenet_v2(0.35, 32), tmp_path / "mbv2.onnx")
    names = [layer.name for layer in load_model(path).layers if layer.trainable]
    if frozen_start:
        candidate = Candidate(((names[-2], "full"), (names[-1], "ratio:0.25")), batch_size=4, optimizer="sgd", lr=0.01)
    else:
        trained = ((names[0], "bias"), *((n, "full") for n in names[-4:]))
        candidate = Candidate(trained, batch_size=2, optimizer="momentum", lr=0.01)
    pixels = Encoding((0.02, 0.03, 0.025), (-2.0, -1.5, -1.8)) if frozen_start else None
    core = "cortex-m7-qemu" if frozen_start else "cortex-m4-qemu"  # the M7's ReLU6: VMINNM and VMAXNM
    firmware, got, expected = _weights_after_steps(core, path, candidate, tmp_path, encoding=pixels)
    _close(got, expected)
    assert abs(firmware.planned_sram_bytes - firmware.memory.total) <= 0.01 * firmware.memory.total
    if frozen_start:  # the 8-bit input is a quarter of the float one, read where the board writes it
        assert firmware.signature.inputs[0].dtype == "uint8"


@pytest.mark.slow
def test_a_transformer_with_an_attention_mask_is_measured_on_the_emulated_board(tmp_path):
    """A BERT's mask is -inf in places: its C (constants and kernels alike) spells it C99's way."""
    pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    import torch_families as tf
    from builders import keyword_texts, word_tokenizer

    model = tf.export("bert", "legacy")
    head = load_model(model).layers[-1].name
    texts = tmp_path / "texts.csv"
    texts.write_text("text,label\n" + "".join(f"{t},{c}\n" for t, c in keyword_texts(60)))
    tokenizer = word_tokenizer(tmp_path / "tok.json", [t for t, _ in keyword_texts(60)])
    scheme = tmp_path / "head.yaml"
    scheme.write_text(f"trainable:\n  - {{layer: {head}, mode: full}}\nbatch_size: 4\noptimizer: {{name: adam, lr: 0.001}}\n")
    result = api.measure(
        model,
        scheme=scheme,
        data=texts,
        tokenizer=tokenizer,
        target="cortex-m4-qemu",
        out=tmp_path / "m",
        accuracy_steps=5,
        latency_repeats=2,
    )
    assert result.plan.metrics.step_latency_ms.median > 0 and result.plan.target.name == "cortex-m4-qemu"
    assert "inff" not in (tmp_path / "m" / "train_step.c").read_text()


def test_the_firmware_builds_from_the_plan_directory_alone_as_the_docs_say(tmp_path):
    """docs/microcontrollers.md's command and main, on a copy of the files `train_step.mk` lists
    and the headers beside them: no Python package's include directory, nothing else installed."""
    plan = tmp_path / "m4"
    api.measure(
        DIGITS / "model.onnx",
        scheme=DIGITS / "head-only.yaml",
        data=DIGITS / "digits.npz",
        target="cortex-m4-qemu",
        out=plan,
        accuracy_steps=2,
        latency_repeats=1,
    )
    make = dict(line.split(" = ", 1) for line in (plan / "train_step.mk").read_text().splitlines() if line.startswith("PLANNER_"))
    sources = make["PLANNER_SOURCES"].split()
    project = tmp_path / "firmware"
    project.mkdir()
    for name in [*sources, "train_step.h", "train_step.tvm.h", "train_step.weights.bin"]:
        shutil.copyfile(plan / name, project / name)
    docs = (ROOT / "docs" / "microcontrollers.md").read_text()
    snippet = docs.split("```c\n", 1)[1].split("```", 1)[0]
    include, body = snippet.split("\n", 1)
    (project / "main.c").write_text(
        f"#include <string.h>\n{include}\n"
        "static float batch[PLANNER_BATCH * 64];\nstatic planner_label_t labels[PLANNER_BATCH];\n"
        f"int main(void) {{\n{body}return 0;\n}}\n"
    )
    command = docs.split("```sh\narm-none-eabi-gcc ", 1)[1].split("#", 1)[0].split()
    argv = ["arm-none-eabi-gcc"]
    for word in command:
        argv += make[word[2:-1]].split() if word.startswith("$(") else [word]
    # the SDK's start-up and linker script: newlib's stubs and its default layout stand in for them
    done = subprocess.run([*argv, "--specs=nosys.specs"], cwd=project, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (project / "firmware.elf").stat().st_size > 0
    header = (plan / "train_step.h").read_text()
    assert "0: image, uint8 [PLANNER_BATCH, 1, 8, 8]\n      8-bit codes the step decodes" in header
    assert "typedef uint8_t planner_label_t;" in header  # ten classes: a byte a label
    # the report shows the flash the step takes and says the latency is an instruction count
    report = (plan / "report.md").read_text()
    assert "| flash | " in report and "(budget 2,048.0 KiB)" in report
    assert "an estimate: instructions counted on the emulated core" in report


def test_a_step_the_board_cannot_link_is_over_budget_not_a_failed_trial(tmp_path):
    """A board whose SRAM is smaller than the target's budget (the estimate lets the candidate
    through): the linker's refusal is an infeasible trial with the memory it needed, so the
    search ranks it by how far over it is, and `planner measure` of it says so in one line."""
    target = tmp_path / "tiny-board.yaml"
    text = (shipped("hw_targets") / "cortex-m4-qemu.yaml").read_text()
    old = "sram: {origin: 0x20000000, bytes: 4MiB}"
    assert old in text
    target.write_text(text.replace(old, "sram: {origin: 0x20000000, bytes: 12KiB}"))
    out = tmp_path / "plan"
    res = planner("plan", "--target", target, "--trials", "2", "--accuracy-steps", "5", "--out", out, "-v")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "FAIL" not in res.stderr and res.stderr.count("over linked") == 2, res.stderr
    assert "beyond the board's RAM: not run" in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no feasible plan: 0 of 2 trials completed; 2 too large for the board to link"), last

    result = TrialResult()
    model = load_model(DIGITS / "model.onnx")
    candidate = load_scheme(str(DIGITS / "head-only.yaml")).candidate(model)
    settings = EvalSettings(cache_dir=tmp_path / "cache", seed=0, accuracy_steps=5, latency_repeats=1)
    evaluator = Evaluator(model, load_dataset(DIGITS / "digits.npz", model), load_target(str(target)), settings)
    constraints = evaluator.evaluate(candidate, result)
    record = TrialRecord.of(0, TrialState.COMPLETE, result, constraints)
    assert record.ended_over_budget and not record.memory_estimated and record.fail_reason is None
    assert record.memory is not None and record.memory.total > 12 * 1024
    assert 0 < constraints["ram_budget"] and not record.feasible

    measured = planner(
        "measure",
        DIGITS / "model.onnx",
        "--data",
        DIGITS / "digits.npz",
        "--scheme",
        DIGITS / "head-only.yaml",
        "--target",
        target,
        "--out",
        tmp_path / "m",
    )
    assert measured.returncode == 1 and "Traceback" not in measured.stderr, measured.stderr
    assert "region `RAM' overflowed by" in measured.stderr.strip().splitlines()[-1]


def test_the_cores_with_vminnm_clamp_with_it_and_the_others_compare():
    """`-DPLANNER_MINMAXNM` (`ckernels.CLAMPS`) for the boards whose FPU is FPv5, in the flags the
    firmware is built with and `train_step.mk` gives; never for a Cortex-M4's FPv4."""
    mcus = ("cortex-m4-qemu", "cortex-m7-qemu", "cortex-m55-qemu", "nrf52840-dk", "stm32f746-disco", "stm32h743")
    flags = {name: _fpu_flags(load_target(name).mcu.cflags) for name in mcus}
    assert {name for name, f in flags.items() if f} == {"cortex-m7-qemu", "cortex-m55-qemu", "stm32f746-disco", "stm32h743"}
    assert _fpu_flags(["-mcpu=cortex-m7", "-mfloat-abi=soft"]) == []
    assert _fpu_flags(["-mcpu=cortex-m7", "-mfloat-abi=hard"]) == flags["stm32f746-disco"]  # gcc's own FPv5
    assert _fpu_flags(["-mcpu=cortex-m33+nofp", "-mfloat-abi=hard"]) == []
    assert _fpu_flags(["-mcpu=cortex-m7", "-mfpu=fpv5-sp-d16", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16"]) == []  # the last wins
    # and the M7's clamps are the instructions: VMINNM and VMAXNM, no comparison
    source = "#include <math.h>\n" + CLAMPS + "float relu6(float x) { return PLANNER_RELUF(PLANNER_MINF(x, 6.0f)); }\n"
    argv = [
        "arm-none-eabi-gcc",
        "-O2",
        *load_target("stm32f746-disco").mcu.cflags,
        *flags["stm32f746-disco"],
        "-S",
        "-o",
        "-",
        "-x",
        "c",
        "-",
    ]
    asm = subprocess.run(argv, input=source, capture_output=True, text=True, check=True).stdout
    assert "vminnm.f32" in asm and "vmaxnm.f32" in asm and "vcmp" not in asm
