"""Momentum SGD and Adam steps follow their textbook update, optimizer state included."""

from __future__ import annotations

import numpy as np
import tvm

from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model
from planner.runtime.session import TrainingSession
from planner.types import Candidate

HOST = tvm.target.Target({"kind": "llvm"})
TRAINABLE = (("c2", "full"), ("fc", "full"))


def _session(model, optimizer, lr, weights):
    step = compile_candidate(model, Candidate(TRAINABLE, 4, optimizer, lr), BuildOptions(HOST))
    return TrainingSession(step.library, step.signature, weights), step.signature.trainable


def _grads(model, weights, x, y):
    """The gradient at `weights`: one plain SGD step with lr = 1 is p - g."""
    session, names = _session(model, "sgd", 1.0, weights)
    session.step(x, y)
    after = session.weights()
    return {n: weights[n].astype(np.float64) - after[n] for n in names}


def _batches(model, n=2):
    rng = np.random.default_rng(3)
    return [
        (rng.normal(0, 1, (4, *model.only_input.shape)).astype(np.float32), rng.integers(0, model.n_classes, 4)) for _ in range(n)
    ]


def test_momentum_accumulates_velocity(tiny_model):
    model = load_model(tiny_model)
    w0 = model.initializers
    (x1, y1), (x2, y2) = _batches(model)
    session, names = _session(model, "momentum", 0.1, w0)
    session.step(x1, y1)
    w1 = session.weights()
    session.step(x2, y2)
    w2 = session.weights()
    g1, g2 = _grads(model, w0, x1, y1), _grads(model, w1, x2, y2)
    for n in names:
        np.testing.assert_allclose(w1[n], w0[n] - 0.1 * g1[n], atol=1e-5)
        np.testing.assert_allclose(w2[n], w1[n] - 0.1 * (0.9 * g1[n] + g2[n]), atol=1e-5)


def test_adam_first_step_is_bias_corrected(tiny_model):
    model = load_model(tiny_model)
    w0 = model.initializers
    ((x, y),) = _batches(model, 1)
    session, names = _session(model, "adam", 0.01, w0)
    session.step(x, y)
    w1 = session.weights()
    g = _grads(model, w0, x, y)
    for n in names:  # m_hat = g, v_hat = g^2 after bias correction: the step is lr * g / (|g| + eps)
        np.testing.assert_allclose(w1[n], w0[n] - 0.01 * g[n] / (np.abs(g[n]) + 1e-8), atol=1e-5)
