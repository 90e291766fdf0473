"""The planned peak is what the runtime really allocates (glibc's own count, TVM's pooled allocator)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import tvm
from tvm import relax

from planner import zoo
from planner.compile import compile_candidate
from planner.graph import STEP_FUNC
from planner.model import load_model
from planner.session import TrainingSession
from planner.space import Candidate


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd  # heap bytes in use + mmapped chunks


@pytest.mark.parametrize(
    "trainable",
    [
        pytest.param("full", marks=pytest.mark.xfail(
            strict=True, reason="kernel scratch of the backward convolutions (TVM's workspace pool) is not "
            "modelled yet: measured 11.6 MB held vs 9.2 MB planned")),
        "last-3",
    ],
)
def test_planned_step_memory_matches_what_the_runtime_allocates(trainable, tmp_path):
    path = zoo.save(zoo.resnet(8, resolution=32), tmp_path / "resnet8.onnx")
    model = load_model(path)
    layers = model.layers if trainable == "full" else model.layers[-3:]
    cand = Candidate(tuple((layer.name, "full") for layer in layers), batch_size=8, optimizer="sgd", lr=0.01)
    step = compile_candidate(model, cand, tvm.target.Target({"kind": "llvm"}))
    session = TrainingSession(step.library, step.signature, model.initializers)
    sig = step.signature
    x = np.random.default_rng(0).normal(size=sig.input_shape).astype(np.float32)
    args = session.step_args(x, np.arange(sig.batch_size) % sig.n_classes)

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(step.library)), tvm.cpu())  # pooled, TVM's default
    tvm.get_global_func("vm.builtin.memory_manager.clear")()
    vm.set_input(STEP_FUNC, *args)
    before = _malloc_in_use()
    vm.invoke_stateful(STEP_FUNC)
    allocated = _malloc_in_use() - before

    mem = step.memory
    batch = x.nbytes + sig.batch_size * 8
    planned = mem.activations - batch + mem.gradients  # what the step itself allocates
    assert planned > 1 << 20, "the check needs a step that allocates megabytes"
    assert abs(allocated - planned) <= 0.10 * planned, f"runtime {allocated:,} B vs planned {planned:,} B"
