"""Edge architectures train correctly: planner's gradients for a sparse trainable set vs float64 FD."""

from __future__ import annotations

import pytest
from builders import gradient_errors

from planner import zoo

FAMILIES = {
    "mobilenet_v2": (lambda: zoo.mobilenet_v2(width=0.35, resolution=32),
                     (("b1.dw", "full"), ("b1.dw_bn", "full"), ("b4.project", "full"), ("b6.project_bn", "bias"), ("classifier", "bias"))),
    "resnet8": (lambda: zoo.resnet(8, resolution=16),
                (("s0.b0.bn2", "full"), ("s1.b0.conv1", "full"), ("s1.b0.down", "full"), ("s2.b0.conv2", "bias"))),
    "mcunet": (lambda: zoo.mcunet(resolution=32),
               (("b1.dw", "full"), ("b3.expand", "full"), ("b7.dw_bn", "bias"))),
    "vit_block": (lambda: zoo.vit_block(resolution=16),
                  (("attn.norm", "full"), ("attn.q", "full"), ("attn.q.add_bias", "bias"), ("mlp.fc1", "full"), ("mlp.norm", "full"))),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_gradients_match_finite_differences(family, tmp_path):
    build, trainable = FAMILIES[family]
    path = zoo.save(build(), tmp_path / f"{family}.onnx")
    errors = gradient_errors(path, trainable, batch=2, samples=6)
    assert len(errors) >= len(trainable)
    assert all(e < 1e-3 for e in errors.values()), errors
