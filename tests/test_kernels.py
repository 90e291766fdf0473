"""planner's own lowerings, under planner's default schedule, compute what TVM's do."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from planner.backend.kernels import legalize
from planner.backend.schedule import default_schedule

HOST = tvm.target.Target({"kind": "llvm"})


@pytest.mark.parametrize(
    "n, o, c, size, k, stride, pad, out_pad",
    [
        (2, 8, 16, 7, 3, 2, (1, 1, 0, 0), 0),  # a 3x3 stride-2 layer's (unread padding trimmed)
        (2, 8, 4, 7, 3, 2, (1, 1, 1, 1), 1),
        (4, 4, 4, 3, 7, 2, (3, 3, 2, 2), 0),  # 7x7 stride 2: four taps per phase
        (4, 4, 3, 5, 3, 2, (1, 1, 0, 0), 0),  # fewer output channels than vector lanes
        (1, 4, 12, 8, 4, 2, (1, 1, 1, 1), 0),
        (2, 4, 8, 5, 3, 3, (1, 1, 0, 0), 0),  # stride 3
        (2, 6, 3, 5, 1, 2, (0, 0, 0, 0), 1),  # a 1x1 stride-2 shortcut's
        (1, 4, 8, 5, 3, 2, (1, 1, 1, 1), 0),  # 9x9 output, no whole phases: left unscheduled
    ],
)
def test_transposed_convolution_by_taps_equals_tvms_dilated_one(n, o, c, size, k, stride, pad, out_pad):
    """The input gradient of a strided convolution, without multiplying the dilation's zeros."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, o, size, size), "float32"))
    w = relax.Var("w", relax.TensorType((o, c, k, k), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(
                relax.op.nn.conv2d_transpose(x, w, strides=stride, padding=pad, output_padding=out_pad, kernel_layout="IOHW")
            )
            result = bb.emit_output(y)
        bb.emit_func_output(result)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((n, o, size, size)).astype("float32"), rng.standard_normal((o, c, k, k)).astype("float32")]
    mine = legalize()(bb.get())
    assert "conv2d_transpose_taps" in str(mine) or "conv2d_input_grad_gemm" in str(mine)
    with HOST:
        scheduled = default_schedule()(mine)
    results = []
    for mod in (relax.transform.LegalizeOps()(bb.get()), mine, scheduled):
        vm = relax.VirtualMachine(relax.build(mod, HOST), tvm.cpu())
        results.append(vm["main"](*map(tvm.runtime.tensor, args)).numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[2], results[0], rtol=1e-5, atol=1e-5)
