"""Every op planner claims to train through passes a correct gradient (float64 finite differences)."""

from __future__ import annotations

import pytest

from builders import OP_PATTERNS, TRAINABLE_OP, gradient_errors, op_pattern_model, tiny_cnn


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
