"""What fusion puts inside a kernel's loop: a value computed from weights alone (a BatchNorm's
per-channel factor) is computed once per channel, never once per element of the activation it
scales (`planner.backend.lower.hoist`), on every back end, in the step and in the prediction."""

from __future__ import annotations

import math

import pytest
import tvm
import tvm_ffi
from tvm import tirx

from planner.backend.graph.training import build_training_module
from planner.backend.lower import pipeline
from planner.inputs.model import load_model
from planner.types import Candidate, Kernels


def _largest_write_with(func: tirx.PrimFunc, intrinsic: str) -> int:
    """The elements of the largest buffer a kernel writes, if it calls `intrinsic`; else 0."""
    calls, written = [], []
    tvm_ffi.structural_walk(
        func.body,
        [
            (tvm.ir.Call, lambda c: calls.append(getattr(c.op, "name", ""))),
            (tirx.BufferStore, lambda s: written.append(math.prod(int(d) for d in s.buffer.shape))),
        ],
        order="post",
    )
    return max(written, default=0) if intrinsic in calls else 0


@pytest.mark.parametrize("kernels, target", [(Kernels.OPENBLAS, "llvm"), (Kernels.PORTABLE, "c"), (Kernels.TVM, "llvm")])
@pytest.mark.parametrize("trained", ["bn", "c1"])
def test_batchnorm_square_roots_are_taken_once_per_channel(tiny_model, kernels, target, trained):
    """tiny_model's BatchNorm normalizes 4 channels of 6x6 maps: whichever layer trains (the
    BatchNorm's own scale and shift, or the convolution before it, whose backward pass scales the
    gradient by the same factor), no kernel that takes a square root writes more than 4 values."""
    model = load_model(tiny_model)
    layer = next(la for la in model.layers if la.name == trained)
    candidate = Candidate(trainable=((layer.name, "full"),), batch_size=2, optimizer="sgd", lr=0.05)
    mod, sig = build_training_module(model, candidate)
    fused = pipeline._fuse(mod, tvm.target.Target(target), kernels, None, len(sig.inputs))
    widest = {
        gv.name_hint: _largest_write_with(f, "tirx.sqrt") for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)
    }
    assert any(widest.values()), "the BatchNorm's square root is computed somewhere"
    assert max(widest.values()) <= 4, {k: v for k, v in widest.items() if v > 4}
