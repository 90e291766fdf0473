"""Candidates share compiled kernels: a new candidate compiles only kernels no earlier one had, and
a step linked from reused kernels trains exactly like one compiled from scratch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from planner.backend.graph.training import build_training_module
from planner.backend.lower import link, pipeline
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model
from planner.runtime.convention import PREDICT_FUNC, STEP_FUNC
from planner.runtime.session import TrainingSession
from planner.types import Candidate, Kernels

HOST = tvm.target.Target({"kind": "llvm"})


def _objects(cache: Path) -> set[str]:
    return {p.name for p in link.objects_dir(cache, HOST).glob("*.o")}


def _train(model, step, steps: int = 3) -> tuple[list[float], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    session = TrainingSession(step.library, step.signature, model.initializers)
    losses = [
        session.step(rng.normal(0, 1, (4, *model.only_input.shape)).astype(np.float32), rng.integers(0, model.n_classes, 4))
        for _ in range(steps)
    ]
    return losses, session.weights()


def test_a_candidate_compiles_only_kernels_no_earlier_candidate_had(tiny_model, tmp_path):
    model = load_model(tiny_model)
    names = [layer.name for layer in model.layers if layer.weight or layer.bias]
    head = Candidate(trainable=((names[-1], "full"),), batch_size=4, optimizer="sgd", lr=0.05)
    two = Candidate(trainable=tuple((n, "full") for n in names[-2:]), batch_size=4, optimizer="sgd", lr=0.05)

    warm = tmp_path / "warm"
    compile_candidate(model, head, BuildOptions(HOST, warm))
    before = _objects(warm)
    reused = compile_candidate(model, two, BuildOptions(HOST, warm))
    compiled_now = _objects(warm) - before
    assert compiled_now, "the second layer's backward kernels are new"
    assert len(compiled_now) < reused.kernels, "the forward pass was compiled again"

    scratch = compile_candidate(model, two, BuildOptions(HOST, tmp_path / "cold"))
    assert _objects(tmp_path / "cold") <= _objects(warm)  # same kernels, same names
    (losses_a, weights_a), (losses_b, weights_b) = _train(model, reused), _train(model, scratch)
    assert losses_a == losses_b
    for name, w in weights_b.items():
        np.testing.assert_array_equal(weights_a[name], w, err_msg=name)


@pytest.mark.parametrize("optimizer, precision", [("sgd", "fp32"), ("momentum", "fp32"), ("adam", "fp32"), ("sgd", "fp16")])
def test_a_candidate_differing_only_in_lr_reuses_the_step_and_trains_at_its_own_lr(tiny_model, tmp_path, optimizer, precision):
    """The learning rate is an input of the step: a search's many lrs of one structure compile once,
    and each trains at its own rate (a first update is proportional to lr for all three
    optimizers; fp16's loss scale is divided out of it)."""
    model = load_model(tiny_model)
    names = [layer.name for layer in model.layers if layer.weight or layer.bias]
    slow, fast = (Candidate(((names[-1], "full"),), 4, optimizer, lr, precision) for lr in (0.01, 0.04))
    build = BuildOptions(HOST, tmp_path)
    first = compile_candidate(model, slow, build)
    objects = _objects(tmp_path)
    again = compile_candidate(model, fast, build)
    assert again.cached and again.directory == first.directory and _objects(tmp_path) == objects

    moved = []
    for step in (first, again):
        after = _train(model, step, steps=1)[1]
        moved.append({n: after[n].astype(np.float64) - model.initializers[n] for n in step.signature.trainable})
    for name, small in moved[0].items():
        assert np.abs(small).max() > 0, name
        np.testing.assert_allclose(moved[1][name], 4 * small, rtol=1e-3, atol=1e-7, err_msg=name)


def _kernels_called(mod: tvm.IRModule, func: str) -> set[str]:
    call_tir, found = tvm.ir.Op.get("relax.call_tir"), set()

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            found.add(link._symbol(mod[expr.args[0]]))

    relax.analysis.post_order_visit(mod[func], visit)
    return found


@pytest.mark.parametrize("trained", [1, 2])
def test_evaluating_a_candidate_needs_no_kernel_of_its_own(tiny_model, trained):
    """The prediction function (every evaluation of the val split) runs the step's forward
    kernels: compiling it costs nothing more. A BatchNorm's output once reached its ReLU through
    a `(y, mean, var)[0]` tuple that fusion does not look through, and each such ReLU became a
    kernel only the prediction function called."""
    model = load_model(tiny_model)
    names = [layer.name for layer in model.layers if layer.weight or layer.bias]
    candidate = Candidate(trainable=tuple((n, "full") for n in names[-trained:]), batch_size=4, optimizer="sgd", lr=0.05)
    mod, sig = build_training_module(model, candidate)
    scheduled = pipeline._schedule(pipeline._fuse(mod, HOST, Kernels.OPENBLAS, None, len(sig.inputs)), HOST)
    assert _kernels_called(scheduled, PREDICT_FUNC) <= _kernels_called(scheduled, STEP_FUNC)
