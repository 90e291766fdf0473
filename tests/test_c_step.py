"""A step as C (`planner.backend.mcu.cstep`): every kernel TVM's C code generator writes, and a driver
that calls them in the planned order with every tensor at a fixed offset in one static arena.

Built for this machine with gcc and no floating-point contraction, the C step is the VM's step
computed in the same order: losses and weights equal to the bit over several steps, for every kind
of update — the last layer, every layer, ratio-split and LoRA weights, int8 frozen weights,
momentum and Adam, micro-batches, recomputation, updates by copy.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from builders import blobs
from planner.backend.graph.training import build_training_module
from planner.backend.lower.pipeline import BuildOptions, lower_step
from planner.backend.mcu.ckernels import CLAMPS, MINMAXNM, include_dirs, kernels_source
from planner.backend.mcu.cstep import ALIGN, compile_host, emit
from planner.backend.vm.compile import compile_candidate
from planner.inputs.calibration import calibrate
from planner.inputs.data import load_dataset
from planner.inputs.model import Model, load_model
from planner.inputs.resources import shipped
from planner.inputs.schemes import load_scheme
from planner.runtime.session import TrainingSession
from planner.runtime.weights import from_step, to_step
from planner.types import Candidate, Kernels, StepSignature

# one core, no FMA: the VM's kernels multiply and add as C without contraction does
NO_FMA = tvm.target.Target({"kind": "llvm", "num-cores": 1, "mattr": ["-fma"]})
DIGITS = shipped("examples") / "digits"


class CSession:
    """The C step loaded with ctypes, holding the step's tensors as TrainingSession does."""

    def __init__(self, library: Path, sig: StepSignature, weights: dict[str, np.ndarray]):
        self.lib, self.sig = ctypes.CDLL(str(library)), sig
        self.stored = to_step(weights, sig.layouts, sig.quantized)
        self.names = [*sig.frozen, *sig.trainable]
        self.params = [np.ascontiguousarray(self.stored[n]) for n in self.names]
        self.params += [np.full(shape, fill, dtype) for shape, dtype, fill in sig.optim_states]
        self.pointers = (ctypes.c_void_p * len(self.params))(*(p.ctypes.data for p in self.params))
        self.header = ""  # train_step.h, as `emit` wrote it

    def step(self, x: np.ndarray | tuple[np.ndarray, ...], y: np.ndarray) -> float:
        xs = [np.ascontiguousarray(a) for a in (x if isinstance(x, tuple) else (x,))]
        y = np.ascontiguousarray(y, dtype=np.int64)
        loss = ctypes.c_float()
        inputs = (ctypes.c_void_p * len(xs))(*(a.ctypes.data for a in xs))
        assert self.lib.planner_step(inputs, self.pointers, ctypes.c_void_p(y.ctypes.data), ctypes.byref(loss)) == 0
        return loss.value

    def weights(self) -> dict[str, np.ndarray]:
        return from_step({**self.stored, **dict(zip(self.names, self.params))}, self.sig.layouts, self.sig.quantized)


def _both(model_path: Path | Model, candidate: Candidate, tmp_path: Path) -> tuple[TrainingSession, CSession, int]:
    model = model_path if isinstance(model_path, Model) else load_model(model_path)
    build = BuildOptions(NO_FMA, tmp_path / "cache", kernels=Kernels.TVM)
    vm = compile_candidate(model, candidate, build)
    mod, sig = build_training_module(model, candidate)
    step = emit(lower_step(mod, sig, candidate, build, None).lowered, sig)
    weights = dict(model.initializers)
    c = CSession(compile_host(step, tmp_path), sig.with_lr(candidate.lr), weights)
    c.header = step.header
    return TrainingSession(vm.library, vm.signature.with_lr(candidate.lr), weights), c, step.arena_bytes


def _equal_over_steps(
    vm: TrainingSession, c: CSession, shape: tuple[int, ...], classes: int, steps: int = 4, codes: bool = False
) -> None:
    rng = np.random.default_rng(0)
    batch = c.sig.batch_size
    for _ in range(steps):
        x = rng.integers(0, 256, (batch, *shape), np.uint8) if codes else rng.normal(0, 1, (batch, *shape)).astype(np.float32)
        y = rng.integers(0, classes, batch)
        assert c.step(x, y) == vm.step(x, y)
    expected, got = vm.weights(), c.weights()
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize("scheme", ["head-only", "last-conv", pytest.param("all-layers", marks=pytest.mark.slow)])
def test_the_c_step_is_the_vm_step_to_the_bit_on_the_bundled_example(scheme, tmp_path):
    model = load_model(DIGITS / "model.onnx")
    candidate = load_scheme(str(DIGITS / f"{scheme}.yaml")).candidate(model)
    vm, c, arena = _both(DIGITS / "model.onnx", candidate, tmp_path)
    assert arena % ALIGN == 0 and arena > 0
    _equal_over_steps(vm, c, model.only_input.shape, model.n_classes)


def test_a_batch_written_where_planner_inputs_points_is_read_there_and_its_bytes_reused(tmp_path):
    """`planner_inputs` points into the arena: a batch written there is the step's input (no copy,
    the VM's step to the bit), and once the first layers have read it its bytes hold later tensors
    — the SRAM a board saves, and why a caller writes a batch before every call."""
    model = load_model(DIGITS / "model.onnx")
    candidate = load_scheme(str(DIGITS / "head-only.yaml")).candidate(model)
    vm, c, _ = _both(DIGITS / "model.onnx", candidate, tmp_path)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (c.sig.batch_size, *model.only_input.shape)).astype(np.float32)
    y = np.ascontiguousarray(rng.integers(0, model.n_classes, c.sig.batch_size), dtype=np.int64)
    where = (ctypes.c_void_p * 1).in_dll(c.lib, "planner_inputs")
    ctypes.memmove(where[0], x.ctypes.data, x.nbytes)
    loss = ctypes.c_float()
    assert c.lib.planner_step(where, c.pointers, ctypes.c_void_p(y.ctypes.data), ctypes.byref(loss)) == 0
    assert loss.value == vm.step(x, y)
    left = np.frombuffer((ctypes.c_float * x.size).from_address(where[0]), np.float32)
    assert not np.array_equal(left, x.ravel()), "the input's bytes were never reused"


UPDATES = {
    "ratio, momentum": {"trainable": (("c2", "ratio:0.5"), ("fc", "full")), "optimizer": "momentum"},
    "lora, adam": {"trainable": (("c1", "lora:2"), ("fc", "full")), "optimizer": "adam", "lr": 0.01},
    "int8 frozen, adam": {
        "trainable": (("c2", "full"), ("fc", "full")),
        "optimizer": "adam",
        "lr": 0.01,
        "frozen_weights": "int8",
    },
    "micro-batches": {"trainable": (("c1", "full"), ("fc", "bias")), "grad_accum": 2, "batch_size": 2},
    "recompute": {"trainable": (("c1", "full"), ("c2", "full"), ("fc", "full")), "recompute": "auto"},
    "copy updates": {"trainable": (("c2", "bias"), ("fc", "full")), "updates": "copy", "optimizer": "momentum"},
}


@pytest.mark.slow
@pytest.mark.parametrize("update", UPDATES, ids=list(UPDATES))
def test_the_c_step_is_the_vm_step_to_the_bit_for_every_kind_of_update(update, tiny_model, tmp_path):
    fields = {"batch_size": 4, "optimizer": "sgd", "lr": 0.05, **UPDATES[update]}
    candidate = Candidate(**fields)
    model = load_model(tiny_model)
    vm, c, _ = _both(tiny_model, candidate, tmp_path)
    _equal_over_steps(vm, c, model.only_input.shape, model.n_classes)


def test_the_c_step_rounds_int8_codes_as_the_vm_to_the_bit(tiny_model, tmp_path):
    """Trained weights stored as int8 codes (an int8 candidate with SGD) are rounded stochastically,
    the chance drawn by a hash of each weight's index and the step count: the C step draws the
    VM's numbers, so its codes are the VM's, step after step (the board trains as this host)."""
    model = load_model(tiny_model)
    model = model.calibrated(calibrate(model, load_dataset(blobs(tmp_path / "d.npz", n=64), model), samples=32))
    candidate = Candidate((("c2", "full"), ("fc", "full")), batch_size=4, optimizer="sgd", lr=0.05, precision="int8")
    vm, c, _ = _both(model, candidate, tmp_path)
    assert {"c2.w@int8", "fc.w@int8"} <= set(c.sig.trainable)
    _equal_over_steps(vm, c, model.only_input.shape, model.n_classes, steps=6)


# PyTorch's exports (tests/torch_families.py) in C: a Conv1d, a transformer encoder, token ids. The VM's step of each matches PyTorch's autograd
# (tests/test_pytorch_families.py); bit for bit the same, so does the C step.
FAMILY_CASES = [("sensor_cnn", "dynamo"), ("encoder_prenorm", "dynamo"), ("token_bag", "legacy")]


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter", FAMILY_CASES, ids=[f"{f}-{e}" for f, e in FAMILY_CASES])
def test_the_c_step_of_pytorch_exports_is_the_vm_step_to_the_bit(family, exporter, tmp_path):
    pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    import torch_families as tf

    path = tf.export(family, exporter)
    model = load_model(path)
    layers = [layer for layer in model.layers if layer.trainable]
    first = next((layer.name for layer in layers if layer.bias), layers[0].name)
    trained = ((first, "bias" if model.layer(first).bias else "full"), *((layer.name, "full") for layer in layers[-2:]))
    candidate = Candidate(tuple(dict(trained).items()), batch_size=2, optimizer="momentum", lr=0.05)
    vm, c, _ = _both(path, candidate, tmp_path)
    for seed in range(3):
        x, y = tf.sample_batch(family, 2, seed)
        assert c.step(x, y) == vm.step(x, y)
    expected, got = vm.weights(), c.weights()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def _scale(factor: float) -> tvm.tirx.PrimFunc:
    @T.prim_func
    def scale(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32")):
        for i in range(4):
            b[i] = a[i] * T.float32(factor)

    return scale


def test_each_kernel_gets_its_own_exact_constants_when_two_print_alike():
    """MobileNetV3's hard-swish rounds 1/6 two ways in two kernels; TVM prints both 1.666667e-01f.
    Each kernel's C gets the exact constant of its own TIR."""
    down, up = float.fromhex("0x1.555554p-3"), float.fromhex("0x1.555556p-3")
    source = kernels_source(tvm.IRModule({"scale_down": _scale(down), "scale_up": _scale(up)}))
    bodies = source.split("__tvm_ffi_scale_up(void* self_handle, void* args, int32_t num_args, void* result) {")
    assert "0x1.5555540000000p-3f" in bodies[0] and "0x1.5555560000000p-3f" in bodies[1]
    assert "1.666667e-01f" not in source


@T.prim_func
def _specials(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"), c: T.Buffer((4,), "float64")):
    for i in range(4):
        b[i] = T.max(a[i], T.float32(float("-inf"))) + T.float32(float("nan")) + T.float32(float("inf"))
        c[i] = T.float64(float("nan"))


@pytest.mark.parametrize("compiler", ["cc", "arm-none-eabi-gcc"])
def test_infinities_and_nans_are_c99_that_any_compiler_takes(compiler, tmp_path):
    """An attention mask's -inf: TVM prints `-inff` (and `nanf`, `nan`), which no C compiler
    declares; every transformer planned for a microcontroller failed on it."""
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} on PATH")
    source = kernels_source(tvm.IRModule({"specials": _specials}))
    assert "-INFINITY" in source and "NAN" in source and "inff" not in source and "nanf" not in source
    (tmp_path / "k.c").write_text(source)
    includes = [f"-I{d}" for d in include_dirs()]
    res = subprocess.run(
        [compiler, "-std=gnu11", "-Werror", "-Wno-unused", "-c", "k.c", "-o", "k.o", *includes],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]


_CLAMPED = [float("nan"), float("-inf"), float("inf"), -0.0, 0.0, 6.0, -2.5, 1e-30, -1e-30, 5.999999, 6.000001, 3.0, -7.0]
_BOUNDS = [6.0, -2.5, 1e-30]


@pytest.mark.parametrize("minmaxnm", [False, True], ids=["comparisons", "fminf-fmaxf"])
def test_each_clamp_is_the_comparison_tvm_writes_for_every_value(minmaxnm, tmp_path):
    """`ckernels.CLAMPS`, the clamps of a step's C: with fminf/fmaxf (`PLANNER_MINMAXNM`, VMINNM
    and VMAXNM on a Cortex-M7) or without, min(x, c), max(x, c) and max(x, 0) are TVM's `x < c ?
    x : c` bit for bit — NaN, both zeros, infinities, the bound itself."""
    values = ", ".join(
        f"{v!r}f".replace("nanf", "NAN").replace("-inff", "-INFINITY").replace("inff", "INFINITY") for v in _CLAMPED
    )
    bounds = ", ".join(f"{c!r}f" for c in _BOUNDS)
    (tmp_path / "c.c").write_text(
        "#include <math.h>\n#include <stdio.h>\n#include <stdint.h>\n#include <string.h>\n"
        + CLAMPS
        + f"static const float xs[] = {{{values}}}, cs[] = {{{bounds}}};\n"
        + "static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }\n"
        + "int main(void) {\n  for (int i = 0; i < (int)(sizeof xs / 4); ++i) {\n"
        + '    volatile float x = xs[i];\n    printf("%08x\\n", bits(PLANNER_RELUF(x)));\n'
        + "    for (int j = 0; j < (int)(sizeof cs / 4); ++j)\n"
        + '      printf("%08x %08x\\n", bits(PLANNER_MINF(x, cs[j])), bits(PLANNER_MAXF(x, cs[j])));\n  }\n  return 0;\n}\n'
    )
    flags = [f"-D{MINMAXNM}"] if minmaxnm else []
    built = subprocess.run(["gcc", "-O2", *flags, "c.c", "-o", "c", "-lm"], cwd=tmp_path, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    got = subprocess.run([str(tmp_path / "c")], capture_output=True, text=True, check=True).stdout.split()

    def f32(v: float) -> str:
        return np.float32(v).view(np.uint32).tobytes()[::-1].hex()

    expected = []
    for x in map(np.float32, _CLAMPED):
        expected.append(f32(x if x > 0 else np.float32(0.0)))
        for c in map(np.float32, _BOUNDS):
            expected += [f32(x if x < c else c), f32(x if x > c else c)]
    assert got == expected
