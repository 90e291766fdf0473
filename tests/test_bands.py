"""Row bands (planner.backend.graph.bands): the frozen first layers computed a band of rows at a time
give the tensor the unbanded function gives, as TVM computes it, for every cut and band count."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

import zoo
from planner.backend.graph import bands
from planner.backend.graph.training import build_training_module
from planner.inputs.model import load_model
from planner.runtime.convention import PREDICT_FUNC, STEP_FUNC
from planner.types import Candidate


def _conv(bb, x, rng, cout, k, stride=1, pad=1, dilation=1, groups=1, bias=True):
    cin = int(x.ty.shape[1])
    w = relax.const(rng.standard_normal((cout, cin // groups, k, k)).astype("float32") * 0.3)
    y = bb.emit(relax.op.nn.conv2d(x, w, strides=stride, padding=pad, dilation=dilation, groups=groups))
    if bias:
        y = bb.emit(relax.op.add(y, relax.const(rng.standard_normal((1, cout, 1, 1)).astype("float32"))))
    return y


def _relu6(bb, x):
    return bb.emit(relax.op.clip(x, 0, 6))


def _stride_and_depthwise(bb, x, rng):
    x = _relu6(bb, _conv(bb, x, rng, 8, 3, stride=2))
    x = bb.emit(relax.op.nn.relu(_conv(bb, x, rng, 8, 3, groups=8)))
    return _conv(bb, x, rng, 4, 1, pad=0)


def _dilated_and_large(bb, x, rng):
    x = _relu6(bb, _conv(bb, x, rng, 6, 5, pad=4, dilation=2))
    return _conv(bb, x, rng, 5, 7, stride=2, pad=0)


def _inverted_residual(bb, x, rng):
    x = _relu6(bb, _conv(bb, x, rng, 4, 3))
    h = _relu6(bb, _conv(bb, x, rng, 12, 1, pad=0))
    h = _relu6(bb, _conv(bb, h, rng, 12, 3, groups=12))
    h = _conv(bb, h, rng, 4, 1, pad=0)
    x = bb.emit(relax.op.add(x, h))
    scale = relax.const(rng.uniform(0.5, 1.5, (4, 1, 1)).astype("float32"))  # a frozen BatchNorm's scale
    return bb.emit(relax.op.multiply(x, scale))


def _uneven_padding_and_stride_3(bb, x, rng):
    x = _relu6(bb, _conv(bb, x, rng, 6, 3, stride=3, pad=(2, 1, 0, 1)))
    return _conv(bb, x, rng, 6, 2, stride=2, pad=0, bias=False)  # an odd height's last row unread


NETS = {  # the frozen layers, the input's shape, the channels they end with
    "stride-2-depthwise": (_stride_and_depthwise, (2, 3, 13, 11), 4),
    "dilated-5x5-7x7": (_dilated_and_large, (1, 3, 24, 9), 5),
    "inverted-residual": (_inverted_residual, (2, 3, 16, 10), 4),
    "padding-2-0-stride-3": (_uneven_padding_and_stride_3, (1, 2, 29, 7), 6),
}


def _model(net: str, classes: int = 3) -> relax.Function:
    """`(x, head) -> logits`, as planner bands it (`(*inputs, *frozen, *trainable)`): `net`'s
    frozen layers from an image batch, then a trained classifier over each channel's mean."""
    body, shape, channels = (NETS | NETS_NOT_BANDED)[net]
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    w = relax.Var("head", relax.TensorType((channels, classes), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = body(bb, x, np.random.default_rng(sum(map(ord, net))))
            pooled = bb.emit(relax.op.mean(y, axis=[2, 3]))
            out = bb.emit_output(bb.emit(relax.op.matmul(pooled, w)))
        bb.emit_func_output(out)
    return relax.analysis.remove_all_unused(bb.get()["main"])


def _run(func: relax.Function, args: list[np.ndarray]) -> np.ndarray:
    exe = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


@pytest.mark.parametrize("net", NETS)
def test_every_cut_in_any_number_of_bands_computes_the_unbanded_result(net):
    func = _model(net)
    plans = bands.candidates(func, 1, 1)
    cuts = sorted({p.cut for p in plans})
    assert len(cuts) >= 2, "a cut after each frozen layer's output the rest reads alone"
    rng = np.random.default_rng(1)
    args = [rng.standard_normal([int(d) for d in v.ty.shape]).astype("float32") for v in func.params]
    want = _run(func, args)
    # each cut in 3 bands (uneven where the rows do not divide), and the most bands at the last cut
    chosen = [p for p in plans if len(p.rows) == 3] + [max((p for p in plans if p.cut == cuts[-1]), key=lambda p: len(p.rows))]
    for p in chosen:
        got = _run(bands.banded(func, 1, 1, p), args)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"cut at binding {p.cut}, rows {p.rows}")


def test_nothing_trained_or_read_twice_is_banded():
    """The bands stop before the first trained layer, and never cut where the rest of the network
    reads an earlier tensor too (inside a residual block, after its skip tensor)."""
    func = _model("inverted-residual")
    bindings = list(func.body.blocks[0].bindings)
    plans = bands.candidates(func, 1, 1)
    where = {b.var: i for i, b in enumerate(bindings)}
    add = next(i for i, b in enumerate(bindings) if bands._op(b) == "relax.add" and b.value.args[1] in where)
    skip = where[bindings[add].value.args[0]]
    assert {p.cut for p in plans} & {skip, add}
    assert not [p for p in plans if skip < p.cut < add]
    head = func.params[-1]
    assert all(head not in relax.analysis.free_vars(bindings[i].value) for p in plans for i in p.members)


def _count(op: str, func: relax.Function) -> int:
    return sum(bands._op(b) == op for block in func.body.blocks for b in block.bindings)


def _pointwise(bb, x, rng):
    return _conv(bb, x, rng, 4, 1, pad=0)


NETS_NOT_BANDED = {"pointwise": (_pointwise, (1, 3, 12, 12), 4)}


def test_banding_is_chosen_only_where_it_lowers_the_peak(tmp_path):
    """MobileNetV2-w0.35 at 96x96 trained at its classifier: its first maps go in bands, beside the
    input batch a quarter of the unbanded peak's activations, in the prediction and the step the
    `c` back end builds; a net whose widest tensor is its last frozen one is left as it was."""
    model = load_model(zoo.save(zoo.mobilenet_v2(width=0.35, resolution=96), tmp_path / "mbv2.onnx"))
    candidate = Candidate((("classifier", "full"),), batch_size=1, optimizer="sgd", lr=0.01)
    plain, sig = build_training_module(model, candidate)
    chosen = bands.plan(relax.analysis.remove_all_unused(plain[PREDICT_FUNC]), 1, len(sig.trainable))
    batch = 3 * 96 * 96 * 4  # in the arena throughout the bands, as before them
    assert chosen is not None and chosen.peak - batch <= 0.3 * (chosen.unbanded_peak - batch), chosen
    banded, _ = build_training_module(model, candidate, bands=True)
    for name in (PREDICT_FUNC, STEP_FUNC):
        assert _count("relax.concat", banded[name]) == _count("relax.concat", plain[name]) + 1

    func = _model("pointwise")
    assert bands.plan(func, 1, 1) is None
    assert tvm_ffi.structural_equal(bands.banded(func, 1, 1), func)
