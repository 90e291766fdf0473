"""planner's own lowerings, under planner's default schedule, compute what TVM's do: the
transposed convolution by taps, the OpenBLAS convolutions (forward, input and weight
gradient) over odd and even sizes, strides, padding, bands and thread blocks, and the softmax
by rows. (The OpenBLAS matrix products: tests/test_matmul_kernels.py.)"""

from __future__ import annotations

import inspect
import os
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

from planner.backend import tvmscript
from planner.backend.graph import gradients
from planner.backend.lower.kernels import legalize
from planner.backend.lower.schedule import default_schedule
from planner.backend.sgemm import gemm, gemm_kernels
from planner.backend.sgemm.im2col import Conv
from planner.runtime.libraries import load_openblas
from planner.types import Kernels

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
    mine = legalize(HOST, Kernels.TVM)(bb.get())
    assert "conv2d_transpose_taps" in str(mine)
    with HOST:
        scheduled = default_schedule()(mine)
    results = []
    for mod in (relax.transform.LegalizeOps()(bb.get()), mine, scheduled):
        vm = relax.VirtualMachine(relax.build(mod, HOST), tvm.cpu())
        results.append(vm["main"](*map(tvm.runtime.tensor, args)).numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[2], results[0], rtol=1e-5, atol=1e-5)


def _conv_and_gradients(n, c, h, w, o, k, stride, pad) -> tvm.IRModule:
    """loss = sum(conv2d(x, w) * r) and its gradients by x and w, as planner's steps get them
    (TVM's Gradient pass with planner's gradients installed)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, c, h, w), "float32"))
    wt = relax.Var("w", relax.TensorType((o, c, k, k), "float32"))
    oh, ow = ((h + pad[0] + pad[2] - k) // stride + 1, (w + pad[1] + pad[3] - k) // stride + 1)
    r = relax.Var("r", relax.TensorType((n, o, oh, ow), "float32"))
    with bb.function("main", [x, wt, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, wt, strides=stride, padding=pad))
            loss = bb.emit_output(bb.emit(relax.op.sum(relax.op.multiply(y, r))))
        bb.emit_func_output(loss)
    with gradients.installed():
        return relax.transform.Gradient("main", require_grads=[x, wt])(bb.get())


_TVMS: dict[tuple, list[np.ndarray]] = {}  # TVM's own results, by shape and cores: one build each, not one per case


def _loss_and_gradients(mod: tvm.IRModule, target: tvm.target.Target, args: list[np.ndarray]) -> list[np.ndarray]:
    with target:
        mod = default_schedule()(mod)
    vm = relax.VirtualMachine(relax.build(mod, target), tvm.cpu())
    loss, (dx, dw) = vm["main_adjoint"](*map(tvm.runtime.tensor, args))
    return [loss.numpy(), dx.numpy(), dw.numpy()]


_CONV_SHAPES = (  # n, c, h, w, o, k, stride, pad
    (2, 3, 7, 7, 4, 3, 1, (1, 1, 1, 1)),  # odd size, same padding
    (1, 4, 8, 6, 5, 3, 2, (1, 1, 1, 1)),  # even, not square, stride 2 (last padding unread)
    (3, 2, 9, 9, 3, 3, 2, (1, 1, 0, 0)),  # asymmetric padding
    (2, 5, 5, 5, 6, 1, 1, (0, 0, 0, 0)),  # 1x1: its columns read where they lie in x
    (3, 4, 3, 5, 6, 1, 1, (0, 0, 0, 0)),  # 1x1 on a flat map: tiles of several images, or a row
    (2, 3, 4, 5, 4, 1, 1, (1, 0, 0, 1)),  # a padded 1x1: its columns are not x
    (2, 3, 6, 6, 4, 1, 2, (0, 0, 0, 0)),  # a 1x1 stride-2 shortcut
    (1, 3, 11, 11, 4, 7, 2, (3, 3, 3, 3)),  # a 7x7 stride-2 stem
    (2, 4, 7, 6, 3, 5, 3, (2, 2, 2, 2)),  # 5x5, stride 3
    (2, 8, 5, 7, 1, 3, 1, (1, 1, 1, 1)),  # one output channel
    (7, 4, 3, 3, 5, 3, 1, (1, 1, 1, 1)),  # many small images: tiles of several, a short last one
    (1, 16, 48, 48, 8, 1, 1, (0, 0, 0, 0)),  # a large image (zeroed as one 36,864-lane vector, LLVM aborted)
    # stride 1 as wide as the image: the taps' columns are shifted runs of the image's rows
    (2, 3, 6, 5, 4, 3, 1, (0, 2, 2, 0)),  # all padding left and below: shifts right by 0-2
    (2, 3, 6, 5, 4, 3, 1, (2, 0, 0, 2)),  # all padding above and right: shifts left by 0-2
    (1, 4, 9, 8, 3, 5, 1, (2, 2, 2, 2)),  # 5x5 same padding
    (2, 3, 6, 7, 4, 3, 1, (0, 1, 0, 1)),  # fewer output rows than the image's
    (2, 3, 5, 7, 4, 3, 1, (3, 1, 2, 1)),  # more: whole rows of padding
)
_BANDS = {"tiles-default": gemm_kernels.LIMITS.band_bytes, "tiles-small": 6000, "tile-per-row": 1}
_CORES = {"cores-host": None, "cores-3": 3}
# every weight gradient here split by tiles, or none: by columns into dWᵀ, or into dW in place
_DW_SPLITS = {
    "dw-per-thread": {"NARROW": 1 << 30, "MIN_PIXELS": 0},
    "dw-by-columns": {"NARROW": 0},
    "dw-by-columns-in-place": {"private_bytes": 0},
}


# PLANNER_KERNEL_CASES=all: every shape under every (tiling, split) pair, 153 builds (~5 minutes of
# CI on 2 cores); by default each shape under three of them, 51
_ALL = os.environ.get("PLANNER_KERNEL_CASES") == "all"


def _conv_cases() -> list:
    """Every shape under each tiling and each weight-gradient split, in a Latin square: shape i
    takes split (j + i) mod 3 under tiling j, so every (shape, tiling), (shape, split) and
    (tiling, split) pair is built (each of the last on five or six shapes), at a third of the
    full product's builds; the thread count alternates, so each shape runs on both."""
    cases = []
    for i, shape in enumerate(_CONV_SHAPES):
        for b, (band_id, band) in enumerate(_BANDS.items()):
            for d, (dw_id, split) in enumerate(_DW_SPLITS.items()):
                if not _ALL and d != (b + i) % len(_DW_SPLITS):
                    continue
                cores_id = list(_CORES)[(i + b) % 2]
                marks = [pytest.mark.slow] if dw_id == "dw-by-columns-in-place" else []
                case_id = f"{'-'.join(map(str, shape[:7]))}-pad{''.join(map(str, shape[7]))}-{band_id}-{cores_id}-{dw_id}"
                cases.append(pytest.param(*shape, band, _CORES[cores_id], split, marks=marks, id=case_id))
    return cases


@pytest.mark.parametrize("n, c, h, w, o, k, stride, pad, band_bytes, cores, dw_split", _conv_cases())
def test_openblas_convolution_and_gradients_equal_tvms_lowering(
    monkeypatch, n, c, h, w, o, k, stride, pad, band_bytes, cores, dw_split
):
    """Forward, weight gradient and input gradient through OpenBLAS equal TVM's own unscheduled
    lowering of the same gradient module, and the weight gradient added to a running sum
    (gradient accumulation) equals that sum plus TVM's; tiles of one image's band multiply their
    output (or output gradient) in place, tiles of several images a copy."""
    assert load_openblas() is not None
    split = dict(dw_split)  # the parameter's own dict is shared by every test of it
    limits = gemm_kernels.Limits(band_bytes, split.pop("private_bytes", gemm_kernels.LIMITS.private_bytes))
    monkeypatch.setattr(gemm_kernels, "LIMITS", limits)
    for name, value in split.items():
        monkeypatch.setattr(gemm_kernels, name, value)
    target = tvm.target.Target({"kind": "llvm", **({"num-cores": cores} if cores else {})})
    mod = _conv_and_gradients(n, c, h, w, o, k, stride, pad)
    mine = legalize(target, Kernels.OPENBLAS)(mod)
    kernels = {gv.name_hint.rstrip("0123456789_") for gv, f in mine.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert {"conv2d_gemm", "conv2d_weight_grad_gemm", "conv2d_input_grad_gemm"} <= kernels, kernels
    rng = np.random.default_rng(1)
    shapes = [[int(d) for d in p.ty.shape] for p in mod["main_adjoint"].params]
    args = [rng.standard_normal(s).astype("float32") for s in shapes]
    key = (n, c, h, w, o, k, stride, pad, cores)  # TVM's lowering knows nothing of planner's tiles and splits
    if key not in _TVMS:
        _TVMS[key] = _loss_and_gradients(relax.transform.LegalizeOps()(mod), target, args)
    results = [_TVMS[key], _loss_and_gradients(mine, target, args)]
    for mine_value, tvms in zip(results[1], results[0]):
        np.testing.assert_allclose(mine_value, tvms, rtol=1e-4, atol=1e-4)
    # the same weight gradient added onto a running sum where it lies (a micro-batch of several)
    x, _, dy = args
    oh, ow = dy.shape[2:]
    s = Conv(n, c, h, w, o, k, k, oh, ow, stride, stride, pad[0], pad[1])
    kernel = gemm_kernels.weight_grad_kernel(s, gemm.pool_threads(target), limits, accumulate=True).with_attr(
        "global_symbol", "main"
    )
    total = rng.standard_normal((o, c, k, k)).astype("float32")
    out = tvm.runtime.tensor(total)
    tvm.compile(tvm.IRModule({"main": kernel}), target)["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(dy), out)
    np.testing.assert_allclose(out.numpy(), total + results[0][2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape, scale",
    [
        ((8, 4, 128, 128), 5.0),  # attention's scores
        ((3, 5, 8), 1.0),  # rows one vector long, fewer than the threads' shares
        ((7, 136), 30.0),  # odd rows, 17 vectors a row; exponentials that underflow
        ((2, 16), 1e3),
    ],
)
@pytest.mark.parametrize("cores", [None, 3], ids=["cores-host", "cores-3"])
def test_softmax_by_rows_equals_tvms_lowering(shape, scale, cores):
    """`softmax_rows` (rows as vectors along them, fast exp) equals TVM's unscheduled softmax,
    masked rows included (-1e9 and float32's lowest, as attention masks write them); a row
    length no vector divides keeps TVM's kernel."""
    target = tvm.target.Target({"kind": "llvm", **({"num-cores": cores} if cores else {})})
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * scale).astype("float32")
    x[..., : shape[-1] // 2] = np.where(
        rng.random(x[..., : shape[-1] // 2].shape) < 0.3, np.float32(-1e9), x[..., : shape[-1] // 2]
    )
    x.reshape(-1, shape[-1])[0, 1:] = np.finfo(np.float32).min
    bb = relax.BlockBuilder()
    v = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [v]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(v, axis=-1)))
        bb.emit_func_output(out)
    mine = legalize(target, Kernels.TVM)(bb.get())
    assert "softmax_rows" in str(mine)
    results = []
    for mod in (relax.transform.LegalizeOps()(bb.get()), mine):
        with target:
            mod = default_schedule()(mod)
        results.append(relax.VirtualMachine(relax.build(mod, target), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)
    assert not np.isnan(results[1]).any()
    odd = relax.BlockBuilder()
    w = relax.Var("x", relax.TensorType((4, 9), "float32"))
    with odd.function("main", [w]):
        with odd.dataflow():
            out = odd.emit_output(odd.emit(relax.op.nn.softmax(w, axis=-1)))
        odd.emit_func_output(out)
    assert "softmax_rows" not in str(legalize(target, Kernels.TVM)(odd.get()))


def test_kernel_macros_find_their_parser_without_reading_the_stacks_sources(monkeypatch):
    """TVMScript's macros (im2col's) expand without `inspect.getouterframes`, whose source reads
    cost a compile a third of its legalization (`planner.backend.tvmscript`): the kernel's one
    `T.prim_func` reads the stack once, its macro calls never; the kernel is the one a fresh
    parse on a thread of its own makes."""
    s = Conv(2, 3, 7, 7, 4, 3, 3, 7, 7, 1, 1, 1, 1)
    threads = gemm.pool_threads(HOST)
    fresh = tvmscript.parsed(gemm_kernels.weight_grad_kernel, s, threads, gemm_kernels.LIMITS)
    readers = []

    def outer_frames(*args, _read=inspect.getouterframes, **kwargs):
        readers.append(sys._getframe(1).f_code.co_name)
        return _read(*args, **kwargs)

    monkeypatch.setattr(inspect, "getouterframes", outer_frames)
    deep = gemm_kernels.weight_grad_kernel(s, threads, gemm_kernels.LIMITS)
    assert readers and "_find_parser_def" not in readers, readers  # the stack read by `T.prim_func`, not by macros
    tvm.ir.assert_structural_equal(deep, fresh)
