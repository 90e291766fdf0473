"""Operators as exporters compose them (attention, RMSNorm, rotary embeddings, pooling by a mask)
pass a correct gradient through planner's whole step (float64 finite differences; each operator
on its own: tests/test_operators.py), and planner's gradients are in force only while planner
differentiates."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tvm
from onnx import helper, numpy_helper
from tvm import relax

from builders import OP_PATTERNS, TRAINABLE_OP, gradient_errors, op_pattern_model, step_gradients, tiny_cnn
from planner.backend.graph import gradients
from planner.backend.graph.training import build_training_module
from planner.errors import CandidateFailed
from planner.inputs.model import load_model
from planner.runtime.convention import STEP_FUNC
from planner.types import Candidate


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


def test_a_pow_with_a_computed_exponent_trains_through_it(tmp_path, monkeypatch):
    """`2 ** h`: the layer before a computed exponent trains, its gradient (2^h ln 2) exact."""

    def two_to_the(nodes, p, h, C, rng):
        two = numpy_helper.from_array(np.array(2.0, np.float32))
        nodes.append(helper.make_node("Constant", [], ["two"], name="const_two", value=two))
        nodes.append(helper.make_node("Pow", ["two", h], ["o"], name="op"))
        return "o"

    monkeypatch.setitem(OP_PATTERNS, "2**h", two_to_the)
    path = op_pattern_model(tmp_path / "m.onnx", "2**h")
    assert load_model(path).layer("c").trainable
    errors = gradient_errors(path, (("c", "full"),))
    assert errors and all(e < 1e-3 for e in errors.values()), errors


def _gradient(op: str):
    return tvm.ir.Op.get(op).get_attr("FPrimalGradient")


# ops whose gradient planner replaces, and ops TVM 0.27 has none for
REPLACED = ("relax.nn.relu", "relax.nn.conv2d", "relax.take", "relax.triu", "relax.astype")
MISSING = ("relax.clip", "relax.erf", "relax.nn.gelu", "relax.squeeze", "relax.strided_slice", "relax.tril")


@pytest.fixture
def tvms():
    """TVM's own gradients of the ops planner replaces, as this process had them before the test;
    the test fails unless they are the same afterwards and the missing ones still missing."""
    theirs = {op: _gradient(op) for op in REPLACED}
    assert all(g is not None for g in theirs.values()) and all(_gradient(op) is None for op in MISSING)
    yield theirs
    assert all(_gradient(op).same_as(g) for op, g in theirs.items()), "TVM's gradients were not restored"
    assert all(_gradient(op) is None for op in MISSING), "planner's gradients were left for other TVM users"


def _installed(theirs: dict) -> bool:
    replaced = all(not _gradient(op).same_as(g) for op, g in theirs.items())
    filled = all(_gradient(op) is not None for op in MISSING)
    assert replaced == filled, "half of planner's gradients in force"
    return replaced


def _relu_masks(func: relax.Function) -> list[tuple[str, str]]:
    """(comparison, the op its first operand comes from) for every comparison in `func`."""
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    found = []
    for value in bound.values():
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") in ("relax.greater", "relax.less"):
            source = bound.get(value.args[0])
            found.append((value.op.name, source.op.name if isinstance(source, relax.Call) else "an input"))
    return found


def test_a_build_uses_planners_gradients_and_leaves_tvms_in_place(tmp_path, tvms):
    """TVM's Relax keeps one gradient per op for the process: planner's are set for the build only.
    In force during it: a ReLU's mask is taken from its output (TVM's reads its input), and a
    ReLU6 (Clip, which TVM has no gradient for) before the output lets the layer before it train.
    Afterwards every other TVM user in the process has TVM's again, also after a failed build."""
    model = load_model(tiny_cnn(tmp_path / "m.onnx"))
    mod, _ = build_training_module(model, Candidate(trainable=(("c1", "full"),), batch_size=2, optimizer="sgd", lr=0.1))
    masks = _relu_masks(mod[STEP_FUNC])
    assert masks and all(m == ("relax.greater", "relax.nn.relu") for m in masks), masks
    assert not _installed(tvms)
    clipped = load_model(op_pattern_model(tmp_path / "clip.onnx", "Clip(ReLU6)"))
    build_training_module(clipped, Candidate(trainable=(("c", "full"),), batch_size=2, optimizer="sgd", lr=0.1))
    assert not _installed(tvms)
    with pytest.raises(CandidateFailed, match="nothing to train"):
        build_training_module(model, Candidate(trainable=(), batch_size=2, optimizer="sgd", lr=0.1))
    assert not _installed(tvms)


def test_planners_gradients_hold_while_any_thread_differentiates(tvms):
    """Builds run in several threads and nest: planner's gradients are set by the first to begin
    and TVM's put back by the last to end, an exception included."""
    started, finish = threading.Event(), threading.Event()

    def other_build():
        with gradients.installed():
            started.set()
            finish.wait(60)

    thread = threading.Thread(target=other_build)
    thread.start()
    try:
        assert started.wait(60) and _installed(tvms)
        with pytest.raises(RuntimeError), gradients.installed():
            with gradients.installed():
                assert _installed(tvms)
            raise RuntimeError
        assert _installed(tvms)  # the other thread's build is still differentiating
    finally:
        finish.set()
        thread.join()
    assert not _installed(tvms)
    with pytest.raises(RuntimeError), gradients.installed():
        raise RuntimeError
    assert not _installed(tvms)
