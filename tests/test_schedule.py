"""planner's default schedule computes exactly what TVM's unscheduled lowering computes.

A silently wrong gradient is the worst defect planner can have, and a schedule is where one hides:
`DefaultCPU` rewrites every kernel of a step (inlining, vectorising, register tiles), and TVM
mishandles some rewritten kernels for some shapes only. MaxPool's gradient came out wrong only
when its output rows were a multiple of the vector and its windows overhung the input; the
classifier's update only at batch size 1; a 2x2 MaxPool's gradient only when its input had a
second consumer (`_vectorizes_a_let` and `_inline` in `planner.backend.lower.schedule`). So each case is a small
model whose branches exercise a kernel of every kind a training step contains, at shapes, batch
sizes and candidate options drawn with a seeded RNG (CI runs the same cases every time); its
fused step (forward, backward and update fused as the real step fuses them) is built twice,
unscheduled and scheduled, and run on the same inputs: the loss, every updated weight and every
optimizer state must agree to the rounding of the step's precision. Two more tests pin each TVM
pitfall to the smallest kernel that shows it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, te
from tvm.script import tirx as T

from planner.backend.graph.training import build_training_module
from planner.backend.lower.inplace import in_place_candidates, update_in_place
from planner.backend.lower.pipeline import _fuse, _schedule
from planner.backend.lower.schedule import default_schedule
from planner.inputs.model import load_model
from planner.runtime.convention import STEP_FUNC
from planner.runtime.weights import to_step
from planner.types import Candidate, Kernels

HOST = tvm.target.Target({"kind": "llvm"})
# The unscheduled step, built without LLVM's optimisations: it computes the same bits (TVM allows
# LLVM no fast-math) and builds in a fraction of the time LLVM spends optimising its scalar loops.
REFERENCE = tvm.target.Target({"kind": "llvm", "opt-level": 0})
RTOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-2}  # about ten roundings of the compute precision

Op = tuple  # ("conv", k, stride, pads, groups, out_channels), ("maxpool", k, stride, pad, ceil), ...


@dataclass(frozen=True)
class Case:
    """Input [batch, 3, size, size] -> 3x3 stem conv (to `channels`) -> each branch -> global
    average pool -> concat -> Gemm. Every layer trains with `optimizer` (lr 1, so that an SGD
    update is the gradient itself; Adam's 0.01) unless `modes` says otherwise; `options` are
    further `Candidate` fields."""

    size: int
    channels: int
    batch: int
    branches: tuple[tuple[Op, ...], ...]
    optimizer: str = "sgd"
    updates: str = "in-place"  # or "copy": the updated weights in buffers of their own
    modes: tuple[tuple[str, str], ...] = ()  # (layer, mode); mode "frozen" leaves it out
    options: tuple[tuple[str, object], ...] = ()

    @property
    def id(self) -> str:
        extra = [f"{k}={v}" for k, v in (*self.modes, *self.options)]
        head = f"{self.size}px-b{self.batch}-c{self.channels}-{self.optimizer}-{self.updates}"
        return " | ".join([head, *(" ".join(map(_describe, b)) for b in self.branches), *extra])


def _describe(op: Op) -> str:
    kind, *args = op
    if kind == "conv":
        k, s, pads, groups, out = args
        pad = pads[0] if len(set(pads)) == 1 else ",".join(map(str, pads))
        return f"conv{k}x{k}/s{s}/p{pad}/{groups}" + f"->{out}" * bool(out)
    if kind in ("maxpool", "avgpool"):
        k, s, pad, ceil, *cip = args
        return f"{kind}{k}x{k}/s{s}/p{pad}" + "/ceil" * ceil + "/count_pad" * bool(cip and cip[0])
    return kind + ("" if not args else "(" + ",".join(map(str, args)) + ")")


# -- the cases: every kernel kind, its free parameters drawn with a seeded RNG ---------------------

CONVS = [  # (kernel, stride, groups): kernels 1/3/5/7, strides 1/2/3, dense, depthwise and grouped
    (1, 1, "dense"),
    (1, 2, "dense"),
    (3, 1, "dense"),
    (3, 2, "dense"),
    (3, 3, "dense"),
    (5, 1, "dense"),
    (5, 2, "dense"),
    (7, 1, "dense"),
    (7, 2, "dense"),
    (3, 1, "depthwise"),
    (3, 2, "depthwise"),
    (3, 3, "depthwise"),
    (5, 1, "depthwise"),
    (5, 2, "depthwise"),
    (7, 2, "depthwise"),
    (1, 1, "depthwise"),
    (1, 1, "grouped"),
    (3, 1, "grouped"),
    (3, 2, "grouped"),
    (5, 2, "grouped"),
]
MAXPOOLS = [  # (kernel, stride, pad, ceil_mode)
    (2, 2, 0, 0),
    (2, 2, 0, 1),
    (3, 1, 1, 0),
    (3, 2, 0, 0),
    (3, 2, 0, 1),
    (3, 2, 1, 0),
    (3, 2, 1, 1),
    (3, 3, 0, 1),
    (5, 2, 2, 0),
    (5, 3, 2, 1),
]
AVGPOOLS = [  # (kernel, stride, pad, ceil_mode, count_include_pad)
    (2, 2, 0, 0, 0),
    (2, 2, 0, 1, 0),
    (3, 1, 1, 0, 1),
    (3, 2, 1, 0, 0),
    (3, 2, 1, 0, 1),
    (3, 2, 1, 1, 0),
    (3, 2, 1, 1, 1),
    (3, 3, 0, 1, 0),
    (5, 3, 2, 0, 1),
]
ACTIVATIONS = ["Relu", "Clip", "HardSwish", "Sigmoid", "Gelu", "Tanh", "HardSigmoid", "Erf"]
OTHERS: list[tuple[Op, ...]] = [
    (("softmax", 1),),
    (("softmax", -1),),
    (("channels_last", "layernorm"),),
    (("channels_last", "linear"),),  # MatMul (a batched [N, H, W, C] x [C, 2C]) + bias, GELU, MatMul back
    (("attention",),),  # softmax(q kT) v: batched MatMuls of two activations, reshapes, transposes
    (("split_concat",),),
    (("reduce", "ReduceMean", 2),),
    (("reduce", "ReduceSum", 1),),
    (("reduce", "ReduceMean", 3),),
    (("residual",),),  # h + conv(relu(bn(conv(h)))): a 3x3 block with BatchNorm
    (("scale_shift",),),  # learned per-channel Mul and Add, a Sub and Div by constants
    (("slice", 1),),  # rows 1 to the last but one, every other column: strided_slice and its gradient
    (("slice", 2),),  # ... every other row too
    (("select_row",),),  # Gather of one row (a class token's select), Unsqueeze back
    (("token",),),  # a [1, C, 1, 1] parameter Expanded over the activation, multiplied in
    (("where",),),  # Where with a constant per-channel mask
]
BRANCHES_PER_CASE = 3  # a model compiles in about the same time for one branch as for three
SIZES = [5, 6, 7, 8, 9, 10, 11, 12, 13, 16]


def _draw_cases(seed: int = 0) -> list[Case]:
    """Every configuration above once, three to a model, with padding style, activations and
    group counts, channels (8, 16: the lane tiling applies) and batch (1-4: a batch of one makes
    weight gradients reductions over one sample) drawn from `seed`, and a size (odd or even) at
    which the most windows' output rows are vectorised; then the candidate options a step can
    have, each on one of those models."""
    rng = random.Random(seed)
    branches: list[tuple[Op, ...]] = []
    for k, s, groups in CONVS:
        pad = k // 2 if rng.random() < 0.75 else 0
        pads = (pad, pad, pad + 1, pad + 1) if s > 1 and rng.random() < 0.3 else (pad,) * 4  # SAME_UPPER-like
        out = 16 if groups == "dense" and rng.random() < 0.5 else 0
        act = rng.choice(ACTIVATIONS)
        norm = (("bn",),) if rng.random() < 0.4 else ()
        branches.append((("conv", k, s, pads, groups, out), *norm, ("act", act)))
    branches += [(("act", "Relu"), ("maxpool", *p)) for p in MAXPOOLS]
    branches += [(("avgpool", *p),) for p in AVGPOOLS]
    branches += OTHERS
    rng.shuffle(branches)
    cases = []
    for i in range(0, len(branches), BRANCHES_PER_CASE):
        group = branches[i : i + BRANCHES_PER_CASE]
        fits = [s for s in SIZES if s >= _smallest(group)]
        most = max(_vector_rows(group, s) for s in fits)
        cases.append(
            Case(
                size=rng.choice([s for s in fits if _vector_rows(group, s) == most]),
                channels=rng.choice([8, 16]),
                batch=rng.choice([1, 2, 3, 4]),
                updates=rng.choice(["in-place", "copy"]),
                branches=tuple(branches[i : i + BRANCHES_PER_CASE]),
            )
        )

    variants = [
        {"optimizer": "momentum"},
        {"optimizer": "adam"},
        {"options": (("precision", "fp16"),)},
        {"options": (("precision", "bf16"),)},
        {"options": (("grad_accum", 2),)},  # the step slices its batch in two
    ]
    for j, variant in enumerate(variants):
        cases[j] = replace(cases[j], **variant)
    with_conv = [
        (j, [f"b{b}.0.conv" for b, ops in enumerate(c.branches) if ops[0][0] == "conv"])
        for j, c in enumerate(cases)
        if j >= len(variants)
    ]
    (ratio, convs), (int8, frozen) = [(j, convs) for j, convs in with_conv if convs][:2]
    # a ratio update (its first half of channels) and a bias-only one
    cases[ratio] = replace(cases[ratio], modes=((convs[0], "ratio:0.5"), ("stem", "bias")))
    # frozen convolutions stored int8
    cases[int8] = replace(cases[int8], modes=tuple((n, "frozen") for n in frozen), options=(("frozen_weights", "int8"),))
    return cases


def _windows(branches: list[tuple[Op, ...]]) -> list[tuple[int, int, int, bool]]:
    """(kernel, stride, padding either side, ceil_mode) of every windowed op of `branches`."""
    return [
        (op[1], op[2], op[3][0] + op[3][2] if op[0] == "conv" else 2 * op[3], op[0] != "conv" and bool(op[4]))
        for b in branches
        for op in b
        if op[0] in ("conv", "maxpool", "avgpool")
    ]


def _smallest(branches: list[tuple[Op, ...]]) -> int:
    """The smallest input every window of `branches` fits in."""
    return max((k - pad for k, _, pad, _ in _windows(branches)), default=1)


def _vector_rows(branches: list[tuple[Op, ...]], size: int) -> int:
    """How many windowed ops of `branches` have output rows of a multiple of 4 at `size`: the
    rows `DefaultCPU` vectorises, and where a miscompiled vector shows."""
    rows = [-(-(size + pad - k) // s) + 1 if ceil else (size + pad - k) // s + 1 for k, s, pad, ceil in _windows(branches)]
    return sum(r % 4 == 0 for r in rows)


CASES = _draw_cases()


# -- the models ----------------------------------------------------------------------------------


class _Graph:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def param(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def const(self, name: str, value) -> str:
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(value))))
        return name

    def node(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(self, h: str, name: str, cin: int, cout: int, k: int, stride: int = 1, pads=(0, 0, 0, 0), groups: int = 1) -> str:
        w = self.param(f"{name}.w", self.rng.normal(0, 0.5, (cout, cin // groups, k, k)))
        b = self.param(f"{name}.b", self.rng.normal(0, 0.1, cout))
        return self.node("Conv", [h, w, b], name, kernel_shape=[k, k], strides=[stride, stride], pads=list(pads), group=groups)

    def bn(self, h: str, name: str, c: int) -> str:
        r = self.rng
        stats = [
            self.param(f"{name}.{p}", v)
            for p, v in (
                ("s", r.uniform(0.5, 1.5, c)),
                ("b", r.normal(0, 0.1, c)),
                ("m", r.normal(0, 0.1, c)),
                ("v", r.uniform(0.5, 1.5, c)),
            )
        ]
        return self.node("BatchNormalization", [h, *stats], name)

    def act(self, h: str, name: str, kind: str) -> str:
        if kind == "Clip":  # ReLU6, with tensor bounds as every exporter writes it
            return self.node("Clip", [h, self.const(f"{name}.lo", np.float32(0)), self.const(f"{name}.hi", np.float32(6))], name)
        return self.node(kind, [h], name)


def _emit(g: _Graph, op: Op, h: str, c: int, name: str) -> tuple[str, int]:
    """`op` applied to `h` ([batch, c, H, W]); returns the output and its channels."""
    kind, *args = op
    r = g.rng
    if kind == "conv":
        k, s, pads, groups, out = args
        out = out or c
        n_groups = {"dense": 1, "depthwise": c, "grouped": int(r.choice([2, 4]))}[groups]
        return g.conv(h, name, c, out, k, s, pads, n_groups), out
    if kind == "bn":
        return g.bn(h, name, c), c
    if kind == "act":
        return g.act(h, name, args[0]), c
    if kind == "maxpool":
        k, s, pad, ceil = args
        return g.node("MaxPool", [h], name, kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4, ceil_mode=ceil), c
    if kind == "avgpool":
        k, s, pad, ceil, cip = args
        return g.node(
            "AveragePool", [h], name, kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4, ceil_mode=ceil, count_include_pad=cip
        ), c
    if kind == "softmax":
        return g.node("Softmax", [h], name, axis=args[0]), c
    if kind == "channels_last":
        t = g.node("Transpose", [h], f"{name}.nhwc", perm=[0, 2, 3, 1])
        if args[0] == "layernorm":
            t = g.node(
                "LayerNormalization",
                [t, g.param(f"{name}.s", r.uniform(0.5, 1.5, c)), g.param(f"{name}.b", r.normal(0, 0.1, c))],
                f"{name}.ln",
                axis=-1,
            )
        else:
            t = g.node("MatMul", [t, g.param(f"{name}.up.w", r.normal(0, 0.5, (c, 2 * c)))], f"{name}.up")
            t = g.node("Add", [t, g.param(f"{name}.up.b", r.normal(0, 0.1, 2 * c))], f"{name}.up.bias")
            t = g.node("Gelu", [t], f"{name}.gelu")
            t = g.node("MatMul", [t, g.param(f"{name}.down.w", r.normal(0, 0.5, (2 * c, c)))], f"{name}.down")
        return g.node("Transpose", [t], name, perm=[0, 3, 1, 2]), c
    if kind == "attention":
        tokens = g.node(
            "Transpose",
            [g.node("Reshape", [h, g.const(f"{name}.flat", np.array([0, c, -1]))], f"{name}.reshape")],
            f"{name}.tokens",
            perm=[0, 2, 1],
        )
        q, k = (g.node("MatMul", [tokens, g.param(f"{name}.{p}.w", r.normal(0, 0.3, (c, c)))], f"{name}.{p}") for p in "qk")
        scores = g.node("MatMul", [q, g.node("Transpose", [k], f"{name}.kT", perm=[0, 2, 1])], f"{name}.scores")
        mixed = g.node("MatMul", [g.node("Softmax", [scores], f"{name}.softmax", axis=-1), tokens], f"{name}.mix")
        back = g.node("Transpose", [mixed], f"{name}.channels", perm=[0, 2, 1])
        return g.node("Reshape", [back, g.const(f"{name}.shape", np.array([0, 0, -1, 1]))], name), c
    if kind == "split_concat":
        halves = [f"{name}.lo", f"{name}.hi"]
        g.nodes.append(
            helper.make_node(
                "Split", [h, g.const(f"{name}.sizes", np.array([c // 2, c // 2]))], halves, name=f"{name}.split", axis=1
            )
        )
        lo = g.conv(halves[0], f"{name}.conv", c // 2, c // 2, 3, pads=(1, 1, 1, 1))
        return g.node("Concat", [lo, g.act(halves[1], f"{name}.sigmoid", "Sigmoid")], name, axis=1), c
    if kind == "reduce":
        op_type, axis = args
        reduced = g.node(op_type, [h, g.const(f"{name}.axes", np.array([axis]))], f"{name}.reduce", keepdims=1)
        return g.node("Add", [h, reduced], name), c
    if kind == "residual":
        y = g.act(g.bn(g.conv(h, f"{name}.conv1", c, c, 3, pads=(1, 1, 1, 1)), f"{name}.bn", c), f"{name}.relu", "Relu")
        return g.node("Add", [h, g.conv(y, f"{name}.conv2", c, c, 3, pads=(1, 1, 1, 1))], name), c
    if kind == "scale_shift":
        y = g.node("Mul", [h, g.param(f"{name}.scale", r.uniform(0.5, 1.5, (1, c, 1, 1)))], f"{name}.mul")
        y = g.node("Add", [y, g.param(f"{name}.shift", r.normal(0, 0.1, (1, c, 1, 1)))], f"{name}.add")
        y = g.node("Sub", [y, g.const(f"{name}.k", np.float32(0.5))], f"{name}.sub")
        return g.node("Div", [y, g.const(f"{name}.d", np.float32(1.5))], name), c
    if kind == "slice":  # negative and past-the-end bounds, as exporters write them
        bounds = [
            g.const(f"{name}.{k}", np.array(v))
            for k, v in (("starts", [1, 1]), ("ends", [-1, 2**31 - 1]), ("axes", [2, 3]), ("steps", [args[0], 2]))
        ]
        return g.node("Slice", [h, *bounds], name), c
    if kind == "select_row":
        row = g.node("Gather", [h, g.const(f"{name}.index", np.array(1))], f"{name}.gather", axis=2)
        return g.node("Unsqueeze", [row, g.const(f"{name}.axes", np.array([2]))], name), c
    if kind == "token":
        token = g.node(
            "Expand",
            [g.param(f"{name}.token", r.normal(1, 0.3, (1, c, 1, 1))), g.node("Shape", [h], f"{name}.shape")],
            f"{name}.expand",
        )
        return g.node("Mul", [h, token], name), c
    if kind == "where":
        mask = g.const(f"{name}.mask", r.uniform(size=(1, c, 1, 1)) > 0.5)
        return g.node("Where", [mask, h, g.const(f"{name}.fill", np.float32(-0.5))], name), c
    raise ValueError(f"unknown op {kind!r}")


def build_model(case: Case, path: Path, classes: int = 4) -> Path:
    g = _Graph(seed=0)
    h = g.conv("x", "stem", 3, case.channels, 3, pads=(1, 1, 1, 1))
    pooled, width = [], 0
    for b, ops in enumerate(case.branches):
        y, c = h, case.channels
        for i, op in enumerate(ops):
            y, c = _emit(g, op, y, c, f"b{b}.{i}.{op[0]}")
        pooled.append(g.node("GlobalAveragePool", [y], f"b{b}.gap"))
        width += c
    features = g.node("Flatten", [g.node("Concat", pooled, "concat", axis=1) if len(pooled) > 1 else pooled[0]], "flatten")
    fc = [g.param("fc.w", g.rng.normal(0, 0.5, (classes, width))), g.param("fc.b", g.rng.normal(0, 0.1, classes))]
    g.nodes.append(helper.make_node("Gemm", [features, *fc], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        g.nodes,
        "case",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, case.size, case.size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


# -- the property --------------------------------------------------------------------------------


def _run(mod: tvm.IRModule, target: tvm.target.Target, args: list[np.ndarray]) -> list[np.ndarray]:
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    return [out.numpy().astype(np.float64) for out in vm[STEP_FUNC](*map(tvm.runtime.tensor, args))]


_EXPECTED: dict[str, list[np.ndarray]] = {}  # by case: the same graph, weights and batch for both `kernels`


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [Kernels.OPENBLAS, Kernels.TVM])  # the VM's (portable is the c back end's)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_scheduled_step_computes_what_the_unscheduled_one_does(case, kernels, tmp_path):
    """The step as compiled (planner's schedules; dense convolutions through OpenBLAS or TVM's
    lowering) computes what TVM's own unscheduled lowering of the same graph does."""
    model = load_model(build_model(case, tmp_path / "case.onnx"))
    modes = dict(case.modes)
    trainable = tuple(
        (layer.name, modes.get(layer.name, "full"))
        for layer in model.layers
        if layer.trainable and modes.get(layer.name) != "frozen"
    )
    options = dict(case.options)
    candidate = Candidate(
        trainable=trainable,
        batch_size=case.batch,
        optimizer=case.optimizer,
        lr=0.01 if case.optimizer == "adam" else 1.0,
        updates=case.updates,
        **options,
    )
    mod, sig = build_training_module(model, candidate)
    fused = _fuse(mod, HOST, kernels, None, len(sig.inputs))
    # as `compile_candidate` builds it: scheduled, then its updates written over their weights
    in_place = in_place_candidates(fused, sig) if candidate.updates == "in-place" else set()
    scheduled = _schedule(tvm.IRModule(dict(fused.functions_items()), attrs=fused.attrs), HOST)  # it rewrites its argument
    scheduled, _ = update_in_place(scheduled, sig, in_place)

    rng = np.random.default_rng(1)
    weights = to_step(model.initializers, sig.layouts, sig.quantized)
    args = [
        rng.normal(0, 1, (sig.batch_size, *sig.inputs[0].shape)).astype(np.float32),
        *(weights[n] for n in (*sig.frozen, *sig.trainable)),
        *(np.full(shape, fill, dtype) for shape, dtype, fill in sig.optim_states),
        rng.integers(0, sig.n_classes, sig.batch_size).astype(np.int64),
    ]
    if case.id not in _EXPECTED:  # TVM's unscheduled lowering: one build for both `kernels`
        _EXPECTED[case.id] = _run(_fuse(mod, HOST, Kernels.TVM, None, len(sig.inputs)), REFERENCE, args)
    expected, got = _EXPECTED[case.id], _run(scheduled, HOST, args)

    rtol = RTOL[options.get("precision", "fp32")]
    # OpenBLAS sums a product's terms in another order than TVM's loops: float32 roundings of a
    # different sequence, up to ~1e-5 of the largest value on these sizes
    atol_share = 1.0 if kernels == Kernels.OPENBLAS else 0.1
    names = ["loss", *sig.trainable, *(f"optimizer state {i}" for i in range(len(sig.optim_states)))]
    assert len(expected) == len(got) == len(names)
    wrong = {}
    for name, want, have in zip(names, expected, got):
        scale = float(np.abs(want).max()) or 1.0
        if not np.allclose(have, want, rtol=rtol, atol=rtol * atol_share * scale):
            wrong[name] = float(np.abs(have - want).max() / scale)
    assert not wrong, f"scheduled step differs (max error / max magnitude): {wrong}"


# -- the two TVM pitfalls `DefaultCPU` steers around, each as the smallest kernel that shows it -----


@T.prim_func(s_tir=True)
def _shift_right(a: T.Buffer((4, 8), "float32"), b: T.Buffer((4, 8), "float32")):
    for i, j in T.grid(4, 8):
        with T.sblock("shift"):
            vi, vj = T.axis.remap("SS", [i, j])
            # a let bound to a value with a padding condition that varies along the row
            v: T.let[T.float32] = T.if_then_else(1 <= vj, a[vi, vj - 1], T.float32(-1))
            b[vi, vj] = v


@T.prim_func(s_tir=True)
def _sgd_at_batch_one(
    x: T.Buffer((8, 1), "float32"),
    dy: T.Buffer((1, 8), "float32"),
    w: T.Buffer((8, 8), "float32"),
    new_w: T.Buffer((8, 8), "float32"),
):
    grad = T.sblock_alloc_buffer((8, 8))
    for i, j, k in T.grid(8, 8, 1):
        with T.sblock("grad"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                grad[vi, vj] = T.float32(0)
            grad[vi, vj] = grad[vi, vj] + x[vi, vk] * dy[vk, vj]
    for i, j in T.grid(8, 8):
        with T.sblock("update"):
            vi, vj = T.axis.remap("SS", [i, j])
            new_w[vi, vj] = w[vi, vj] - grad[vi, vj]


# -- elementwise kernels with a broadcast operand (`_broadcast_runs`), over runs of odd lengths ----


def _bias_relu(n: int, c: int, h: int, w: int):
    @T.prim_func(s_tir=True)
    def kernel(x: T.Buffer((n, c, h, w), "float32"), bias: T.Buffer((c,), "float32"), y: T.Buffer((n, c, h, w), "float32")):
        for i0, i1, i2, i3 in T.grid(n, c, h, w):
            with T.sblock("bias_relu"):
                v0, v1, v2, v3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                y[v0, v1, v2, v3] = T.max(x[v0, v1, v2, v3] + bias[v1], T.float32(0))

    return kernel


def _pool_gradient(n: int, c: int, h: int, w: int):
    """A global average pool's gradient through the ReLU before it: one value per image and channel."""

    @T.prim_func(s_tir=True)
    def kernel(dy: T.Buffer((n, c), "float32"), x: T.Buffer((n, c, h, w), "float32"), dx: T.Buffer((n, c, h, w), "float32")):
        for i0, i1, i2, i3 in T.grid(n, c, h, w):
            with T.sblock("pool_gradient"):
                v0, v1, v2, v3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                dx[v0, v1, v2, v3] = T.Select(T.float32(0) < x[v0, v1, v2, v3], dy[v0, v1] / T.float32(h * w), T.float32(0))

    return kernel


def _row_scale(n: int, c: int, h: int, w: int):
    """A scale per image row (broadcast over a middle axis): only the last axis is a whole run."""

    @T.prim_func(s_tir=True)
    def kernel(x: T.Buffer((n, c, h, w), "float32"), s: T.Buffer((h,), "float32"), y: T.Buffer((n, c, h, w), "float32")):
        for i0, i1, i2, i3 in T.grid(n, c, h, w):
            with T.sblock("row_scale"):
                v0, v1, v2, v3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                y[v0, v1, v2, v3] = x[v0, v1, v2, v3] * s[v2]

    return kernel


BROADCASTS = [
    (make, shape)
    for make in (_bias_relu, _pool_gradient, _row_scale)
    for shape in ((2, 16, 28, 28), (3, 5, 14, 14), (1, 7, 7, 7), (2, 3, 1, 1), (1, 4, 9, 6))
]


@pytest.mark.parametrize(
    "kernel",
    [_shift_right, _sgd_at_batch_one, *(make(*shape) for make, shape in BROADCASTS)],
    ids=[
        "let-in-a-vector",
        "reduction-over-one",
        *(f"{make.__name__[1:]}-{'x'.join(map(str, shape))}" for make, shape in BROADCASTS),
    ],
)
def test_scheduled_kernel_computes_what_the_unscheduled_one_does(kernel):
    """`_vectorizes_a_let` and `_inline` in `planner.backend.lower.schedule`: TVM miscompiles the first when it
    is vectorised, and inlines the second's update into its unit-extent reduction wrongly. The
    broadcast kernels check `_broadcast_runs`'s split into parallel rows and vector runs."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype(np.float32) for p in kernel.params]
    with HOST:
        scheduled = default_schedule()(tvm.IRModule({"main": kernel}))
    results = []
    for mod in (tvm.IRModule({"main": kernel}), scheduled):
        tensors = [tvm.runtime.tensor(a) for a in args]
        tvm.compile(mod, HOST)["main"](*tensors)
        results.append(tensors[-1].numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)


@pytest.mark.parametrize("op", ["erf", "exp", "gelu-gradient", "tanh", "gelu-tanh"])
def test_erf_tanh_and_exp_run_as_vector_polynomials(op):
    """`_vector_erf_tanh` and `_vector_exp`: every float32 erf and tanh, and every exp the schedule vectorises,
    computed by TVM's fast forms (no libm call left in the kernel) within 2e-6 of libm's
    (relative: exp's range reduction loses that much near 88), over what GELUs and softmaxes
    read: zero, tiny, large and huge arguments of both signs."""
    n = 4096
    x = te.placeholder((n,), "float32", "x")
    forms = {
        "erf": lambda i: te.erf(x[i]),
        "exp": lambda i: te.exp(x[i]),
        "gelu-gradient": lambda i: 0.5 * (1.0 + te.erf(x[i] * 0.7071)) + x[i] * 0.3989 * te.exp(-0.5 * x[i] * x[i]),
        "tanh": lambda i: te.tanh(x[i]),
        "gelu-tanh": lambda i: 0.5 * x[i] * (1.0 + te.tanh(0.7978846 * (x[i] + 0.044715 * x[i] * x[i] * x[i]))),
    }
    kernel = te.create_prim_func([x, te.compute((n,), forms[op], name="y")])
    with HOST:
        scheduled = default_schedule()(tvm.IRModule({"main": kernel}))
    assert not any(f"T.{f}" in scheduled.script() for f in ("erf", "exp", "tanh"))
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [[0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, -1e9, 3.4e38, -3.4e38], rng.standard_normal(n - 10) * 6]
    )
    args = values.astype(np.float32)
    results = []
    for mod in (tvm.IRModule({"main": kernel}), scheduled):
        tensors = [tvm.runtime.tensor(args), tvm.runtime.tensor(np.zeros(n, np.float32))]
        tvm.compile(mod, HOST)["main"](*tensors)
        results.append(tensors[-1].numpy())
    finite = np.isfinite(results[0])
    np.testing.assert_allclose(results[1][finite], results[0][finite], rtol=2e-6, atol=1e-6)
