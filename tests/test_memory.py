"""The planned peak is what the runtime really allocates (glibc's own count, TVM's pooled allocator)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tvm

import zoo
from planner.backend.graph.memory import PAGE
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.sgemm import gemm_kernels
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model
from planner.types import Candidate, Kernels

# Run in a fresh process: TVM's workspace pool is per thread and outlives a VirtualMachine, so a
# step measured after another would find its scratch already held.
_ONE_STEP = """
import ctypes, json, sys
import numpy as np, tvm
from tvm import relax
from planner.runtime.convention import STEP_FUNC
from planner.types import StepSignature
from planner.inputs.model import load_model
from planner.runtime.session import TrainingSession

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

def in_use():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd  # heap bytes in use + mmapped chunks

model_path, library, sig_json = sys.argv[1:]
model = load_model(model_path)
sig = StepSignature.from_json(json.loads(sig_json))
session = TrainingSession(library, sig, model.initializers)
x = np.random.default_rng(0).normal(size=(sig.batch_size, *sig.inputs[0].shape)).astype(np.float32)
args = session.step_args(x, np.arange(sig.batch_size) % sig.n_classes)
vm = relax.VirtualMachine(tvm.runtime.load_module(library), tvm.cpu())  # pooled, TVM's default
vm.set_input(STEP_FUNC, *args)
before = in_use()
vm.invoke_stateful(STEP_FUNC)
print(in_use() - before)
"""


@pytest.mark.parametrize(
    "trainable, recompute, batch, accum",
    [("full", "none", 8, 1), ("last-3", "none", 8, 1), ("full", "auto", 8, 1), ("full", "none", 2, 4)],
    ids=["full", "last-3", "full-recompute", "full-micro-batches"],
)
def test_planned_step_memory_matches_what_the_runtime_allocates(trainable, recompute, batch, accum, tmp_path):
    path = zoo.save(zoo.resnet(8, resolution=32), tmp_path / "resnet8.onnx")
    model = load_model(path)
    layers = model.layers if trainable == "full" else model.layers[-3:]
    cand = Candidate(tuple((layer.name, "full") for layer in layers), batch, "adam", 0.01, grad_accum=accum, recompute=recompute)
    step = compile_candidate(model, cand, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    sig = step.signature
    res = subprocess.run(
        [sys.executable, "-c", _ONE_STEP, str(path), str(step.library), json.dumps(sig.to_json())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    allocated = int(res.stdout.split()[-1])

    mem = step.memory
    batch = sig.batch_size * int(np.prod(sig.inputs[0].shape)) * 4 + sig.batch_size * 8
    planned = mem.activations - batch + mem.gradients + mem.scratch  # what the step itself allocates
    assert planned > 1 << 20, "the check needs a step that allocates megabytes"
    assert abs(allocated - planned) <= 0.10 * planned, f"runtime {allocated:,} B vs planned {planned:,} B"


def test_scheduled_kernels_keep_no_whole_tensor_scratch(tmp_path):
    """Unscheduled, each fused stage of a kernel (a conv's output before its BN epilogue, a
    transposed conv's dilated input) is a tensor of scratch: 2.3 MiB on this step. Scheduled,
    a reduction runs row by row inside its epilogue, and no kernel holds a tensor's worth."""
    model = load_model(zoo.save(zoo.resnet(8, resolution=32), tmp_path / "resnet8.onnx"))
    cand = Candidate(tuple((layer.name, "full") for layer in model.layers), batch_size=8, optimizer="sgd", lr=0.01)
    build = BuildOptions(tvm.target.Target({"kind": "llvm"}), kernels=Kernels.TVM)
    mem = compile_candidate(model, cand, build).memory
    smallest_activation = 8 * 64 * 8 * 8 * 4  # the last stage's feature map
    assert mem.scratch < smallest_activation, mem


def test_openblas_convolutions_keep_one_band_of_columns_at_any_batch(tmp_path):
    """The OpenBLAS convolutions' im2col workspace is a few tiles per thread (and a small weight
    gradient's per-thread copies): planned, and within the band and the private copies (`gemm_kernels.LIMITS`) at batch 8
    and at batch 32 (the whole batch's columns of the first stage alone would be 4.5 and 18 MiB)."""
    model = load_model(zoo.save(zoo.resnet(8, resolution=32), tmp_path / "resnet8.onnx"))
    build = BuildOptions(tvm.target.Target({"kind": "llvm"}), kernels=Kernels.OPENBLAS)
    scratch = []
    for batch in (8, 32):
        cand = Candidate(tuple((layer.name, "full") for layer in model.layers), batch_size=batch, optimizer="sgd", lr=0.01)
        scratch.append(compile_candidate(model, cand, build).memory.scratch)
    assert all(0 < bytes_ <= gemm_kernels.LIMITS.band_bytes + gemm_kernels.LIMITS.private_bytes for bytes_ in scratch), scratch


def test_int8_frozen_weights_hold_less_than_fp32_ones_through_the_backward_pass(tmp_path):
    """The backward pass reads every frozen weight between the loss and the first trained layer
    again; a dequantized copy kept from the forward pass for it held more than fp32 storage."""
    model = load_model(zoo.save(zoo.mobilenet_v2(0.35, 32), tmp_path / "mbv2.onnx"))
    names = [layer.name for layer in model.layers if layer.trainable]
    peaks = {}
    for weights in ("fp32", "int8"):
        cand = Candidate(((names[0], "full"), (names[-1], "full")), 4, "sgd", 0.01, frozen_weights=weights)
        peaks[weights] = compile_candidate(model, cand, BuildOptions(tvm.target.Target({"kind": "llvm"}))).memory
    assert peaks["int8"].total < peaks["fp32"].total, peaks


def test_micro_batches_hold_one_micro_batch_and_one_sum_per_weight(tmp_path):
    """Eight micro-batches of 2 in one step: each reuses the last one's activations, and its
    gradients are added where the running sums lie. The step holds what one micro-batch of 2
    holds, plus the other samples of the batch and one sum per trained weight."""
    model = load_model(zoo.save(zoo.resnet(8, resolution=32), tmp_path / "resnet8.onnx"))
    build = BuildOptions(tvm.target.Target({"kind": "llvm"}))
    full = tuple((layer.name, "full") for layer in model.layers)
    one, eight = (compile_candidate(model, Candidate(full, 2, "adam", 0.01, grad_accum=k), build) for k in (1, 8))
    batch16 = compile_candidate(model, Candidate(full, 16, "adam", 0.01), build).memory
    samples = 14 * (3 * 32 * 32 * 4 + 8)
    sums = eight.memory.trainable_params + PAGE * len(eight.signature.trainable)  # each rounded up to pages
    one, eight = one.memory, eight.memory
    assert eight.total <= one.total + samples + sums, (one, eight)
    assert eight.total < batch16.total / 2, (eight, batch16)
