"""Every op planner claims to train through passes a correct gradient (float64 finite differences)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from builders import OP_PATTERNS, TRAINABLE_OP, gradient_errors, op_pattern_model, step_gradients, tiny_cnn
from planner.inputs.model import load_model


@pytest.mark.parametrize("pattern", sorted(OP_PATTERNS))
def test_gradient_through_op_matches_finite_differences(pattern, tmp_path):
    path = op_pattern_model(tmp_path / "m.onnx", pattern)
    trainable = (("c", "full"),) + ((("op", "full"),) if pattern in TRAINABLE_OP else ())
    errors = gradient_errors(path, trainable)
    assert errors and all(e < 1e-3 for e in errors.values()), errors


def test_an_op_without_gradient_before_the_trained_layers_is_not_differentiated(tmp_path):
    """A Floor (no gradient in Relax) before the head: the head still trains, exactly — the part
    of the graph before it is computed outside the differentiated function."""
    errors = gradient_errors(tiny_cnn(tmp_path / "m.onnx", extra_op="Floor"), (("fc", "full"),))
    assert errors and all(e < 1e-3 for e in errors.values()), errors


def test_masked_attention_scores_get_zero_gradient_never_nan(tmp_path):
    """Scores masked with -inf before a softmax (a causal mask): the softmax gives those
    positions weight 0 and the gradient there must be exactly 0 — an inf or NaN would reach every
    weight upstream. The position bias is added before the mask, so its gradient shows what the
    masked scores get."""
    path = op_pattern_model(tmp_path / "m.onnx", "CausalAttention(Trilu+Where -inf+Softmax)")
    *_, grads = step_gradients(path, (("c", "full"), ("op", "full")))
    assert all(np.isfinite(g).all() for g in grads.values()), grads
    bias = grads["op.bias"]
    masked = ~np.tril(np.ones(bias.shape, bool))  # the pattern's Trilu mask: strictly above the diagonal
    assert not bias[masked].any() and bias[~masked].any(), bias


def test_a_pow_with_a_computed_exponent_is_refused_by_name(tmp_path, monkeypatch):
    """`2 ** h`: planner differentiates Pow through its base, for a constant exponent only (what
    tanh-GELU's x^3 and RMSNorm's x^2 are); the layer before a computed exponent is untrainable,
    and the node is named."""

    def two_to_the(nodes, p, h, C, rng):
        two = numpy_helper.from_array(np.array(2.0, np.float32))
        nodes.append(helper.make_node("Constant", [], ["two"], name="const_two", value=two))
        nodes.append(helper.make_node("Pow", ["two", h], ["o"], name="op"))
        return "o"

    monkeypatch.setitem(OP_PATTERNS, "2**h", two_to_the)
    layer = load_model(op_pattern_model(tmp_path / "m.onnx", "2**h")).layer("c")
    assert not layer.trainable and "'op' (Pow) has a computed exponent" in layer.problem
