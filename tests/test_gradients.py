"""Every op planner claims to train through passes a correct gradient (float64 finite differences)."""

from __future__ import annotations

import pytest
from builders import OP_PATTERNS, TRAINABLE_OP, gradient_errors, op_pattern_model


@pytest.mark.parametrize("pattern", sorted(OP_PATTERNS))
def test_gradient_through_op_matches_finite_differences(pattern, tmp_path):
    path = op_pattern_model(tmp_path / "m.onnx", pattern)
    trainable = (("c", "full"),) + ((("op", "full"),) if pattern in TRAINABLE_OP else ())
    errors = gradient_errors(path, trainable)
    assert errors and all(e < 1e-3 for e in errors.values()), errors
