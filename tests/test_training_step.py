"""The compiled training step updates exactly what the candidate trains, with correct gradients."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

from planner.compile import compile_candidate
from planner.model import load_model
from planner.session import TrainingSession
from planner.space import Candidate

HOST = tvm.target.Target({"kind": "llvm"})


def _batch(model, B=4, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (B, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, model.n_classes, B)
    return x, y


def test_frozen_params_stay_and_trainable_ones_move(tiny_model):
    model = load_model(tiny_model)
    cand = Candidate(trainable=(("bn", "bias"), ("fc", "full")), batch_size=4, optimizer="sgd", lr=0.1)
    step = compile_candidate(model, cand, HOST)
    session = TrainingSession(step.library, step.signature, model.initializers)
    before = {k: v.copy() for k, v in session.weights().items()}
    session.step(*_batch(model))
    after = session.weights()
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved == {"bn.b", "fc.w", "fc.b"}
    assert set(step.signature.trainable) == {"bn.b", "fc.w", "fc.b"}
    assert "bn.s" in step.signature.frozen and "c1.w" in step.signature.frozen


def _float64_loss(proto: onnx.ModelProto, weights: dict, x: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy of the ONNX graph evaluated by onnx's reference runtime in float64."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    for i, t in enumerate(m.graph.initializer):
        m.graph.initializer[i].CopyFrom(numpy_helper.from_array(weights[t.name].astype(np.float64), t.name))
    for v in list(m.graph.input) + list(m.graph.output):
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    logits = ReferenceEvaluator(m).run(None, {"x": x.astype(np.float64)})[0]
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


@pytest.mark.parametrize(
    "trainable",
    [
        (("c1", "full"), ("bn", "full"), ("c2", "full"), ("fc", "full")),
        (("c1", "bias"), ("c2", "full")),
    ],
    ids=["all-full", "sparse"],
)
def test_gradients_match_float64_finite_differences(tiny_model, trainable):
    """SGD with lr=1 turns the step into p - grad: compare grad with central differences."""
    model = load_model(tiny_model)
    cand = Candidate(trainable=trainable, batch_size=4, optimizer="sgd", lr=1.0)
    step = compile_candidate(model, cand, HOST)
    w0 = {k: v.astype(np.float32) for k, v in model.initializers.items()}
    session = TrainingSession(step.library, step.signature, w0)
    x, y = _batch(model)
    session.step(x, y)
    w1 = session.weights()
    rng = np.random.default_rng(0)
    h = 1e-6
    for name in step.signature.trainable:
        grad = (w0[name].astype(np.float64) - w1[name].astype(np.float64)).ravel()
        idx = rng.choice(grad.size, size=min(grad.size, 12), replace=False)
        fd = []
        for i in idx:
            plus = {k: v.astype(np.float64) for k, v in w0.items()}
            minus = {k: v.astype(np.float64) for k, v in w0.items()}
            plus[name].ravel()[i] += h
            minus[name].ravel()[i] -= h
            fd.append((_float64_loss(model.proto, plus, x, y) - _float64_loss(model.proto, minus, x, y)) / (2 * h))
        fd = np.array(fd)
        err = np.linalg.norm(grad[idx] - fd) / max(np.linalg.norm(fd), 1e-12)
        assert err < 1e-3, f"{name}: relative gradient error {err:.2e}"
