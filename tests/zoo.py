"""Edge architectures built in code with `onnx.helper` — nothing is downloaded.

MobileNetV2, a CIFAR-style ResNet, MLPerf Tiny's keyword-spotting DS-CNN, an MCUNet-style net (MobileNetV2 blocks with mixed kernel
sizes and expansion ratios), a small vision transformer block, and the tiny CNN of the first
baseline measurements. Weights are random (He init,
BN with real-looking statistics); they exist so planner's op coverage, gradients, memory and
speed are exercised on the graphs users bring. Node names follow `block.part` (e.g. `b2.dw`), the
names a scheme file or `planner inspect` uses.

    import zoo  # tests/ on sys.path, as tests/conftest.py and benchmarks/*.py put it
    zoo.save(zoo.mobilenet_v2(width=0.35, resolution=128), "mbv2.onnx")
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Graph:
    """A tiny builder: named nodes, initializers, and a running tensor name."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []

    def param(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value)))
        return name

    def node(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(self, x: str, name: str, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, bias: bool = False) -> str:
        w = self.param(f"{name}.weight", self.rng.normal(0, np.sqrt(2.0 / (cin // groups * k * k)), (cout, cin // groups, k, k)))
        inputs = [x, w] + ([self.param(f"{name}.bias", np.zeros(cout))] if bias else [])
        return self.node("Conv", inputs, name, kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=groups)

    def bn(self, x: str, name: str, c: int) -> str:
        r = self.rng
        ps = [
            self.param(f"{name}.scale", r.uniform(0.8, 1.2, c)),
            self.param(f"{name}.bias", r.normal(0, 0.05, c)),
            self.param(f"{name}.mean", r.normal(0, 0.1, c)),
            self.param(f"{name}.var", r.uniform(0.8, 1.2, c)),
        ]
        return self.node("BatchNormalization", [x, *ps], name)

    def relu6(self, x: str, name: str) -> str:
        lo = self.const(f"{name}.min", np.array(0.0, np.float32))
        hi = self.const(f"{name}.max", np.array(6.0, np.float32))
        return self.node("Clip", [x, lo, hi], name)

    def head(self, x: str, c: int, classes: int) -> str:
        x = self.node("GlobalAveragePool", [x], "pool")
        x = self.node("Flatten", [x], "flatten")
        w = self.param("classifier.weight", self.rng.normal(0, np.sqrt(1.0 / c), (classes, c)))
        b = self.param("classifier.bias", np.zeros(classes))
        self.nodes.append(helper.make_node("Gemm", [x, w, b], ["logits"], name="classifier", transB=1))
        return "logits"

    def model(self, name: str, input_shape: tuple[int, ...], classes: int) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *input_shape])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], producer_name="planner-tests")
        onnx.checker.check_model(model)
        return model


def _divisible(v: float, d: int = 8) -> int:
    """MobileNet's channel rounding: nearest multiple of d, never below 90 % of v."""
    new = max(d, int(v + d / 2) // d * d)
    return new + d if new < 0.9 * v else new


def _inverted_residual(g: _Graph, x: str, name: str, cin: int, cout: int, expand: int, k: int, stride: int) -> str:
    hidden = cin * expand
    h = x
    if expand != 1:
        h = g.relu6(g.bn(g.conv(h, f"{name}.expand", cin, hidden, 1), f"{name}.expand_bn", hidden), f"{name}.expand_act")
    h = g.relu6(
        g.bn(g.conv(h, f"{name}.dw", hidden, hidden, k, stride, groups=hidden), f"{name}.dw_bn", hidden), f"{name}.dw_act"
    )
    h = g.bn(g.conv(h, f"{name}.project", hidden, cout, 1), f"{name}.project_bn", cout)
    if stride == 1 and cin == cout:
        h = g.node("Add", [x, h], f"{name}.add")
    return h


# (expansion, channels, repeats, stride) of MobileNetV2
_MBV2 = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


def mobilenet_v2(width: float = 0.35, resolution: int = 128, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """MobileNetV2 (Sandler et al. 2018): ReLU6 inverted residuals with depthwise convolutions."""
    g = _Graph(seed)
    c = _divisible(32 * width)
    x = g.relu6(g.bn(g.conv("input", "stem", 3, c, 3, 2), "stem_bn", c), "stem_act")
    i = 0
    for t, ch, n, s in _MBV2:
        out = _divisible(ch * width)
        for j in range(n):
            x = _inverted_residual(g, x, f"b{i}", c, out, t, 3, s if j == 0 else 1)
            c, i = out, i + 1
    last = _divisible(1280 * max(1.0, width))
    x = g.relu6(g.bn(g.conv(x, "last", c, last, 1), "last_bn", last), "last_act")
    g.head(x, last, classes)
    return g.model(f"mobilenet_v2_w{width}_{resolution}", (3, resolution, resolution), classes)


# (expansion, kernel, channels, stride) of an MCUNet-style network (mixed kernels and ratios)
_MCUNET = [
    (1, 3, 8, 1),
    (3, 7, 16, 2),
    (6, 3, 16, 1),
    (5, 7, 24, 2),
    (4, 5, 24, 1),
    (5, 5, 40, 2),
    (5, 5, 48, 1),
    (6, 7, 96, 2),
    (4, 3, 96, 1),
    (6, 5, 160, 1),
]


def mcunet(resolution: int = 64, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """An MCUNet-style net (Lin et al. 2020): MobileNetV2 blocks with searched kernels and ratios."""
    g = _Graph(seed)
    c = 16
    x = g.relu6(g.bn(g.conv("input", "stem", 3, c, 3, 2), "stem_bn", c), "stem_act")
    for i, (t, k, out, s) in enumerate(_MCUNET):
        x = _inverted_residual(g, x, f"b{i}", c, out, t, k, s)
        c = out
    g.head(x, c, classes)
    return g.model(f"mcunet_{resolution}", (3, resolution, resolution), classes)


def ds_cnn(classes: int = 12, seed: int = 0) -> onnx.ModelProto:
    """MLPerf Tiny's keyword-spotting DS-CNN (Zhang et al. 2017, "Hello Edge"): 49 frames of 10 MFCC
    features; a 10x4 convolution (stride 2, TensorFlow's "same" padding) to 64 channels, four
    depthwise-separable blocks of 64, average pooling, 12 keywords. BatchNorm after every conv."""
    g = _Graph(seed)
    w = g.param("conv1.weight", g.rng.normal(0, np.sqrt(2.0 / 40), (64, 1, 10, 4)))
    b = g.param("conv1.bias", np.zeros(64))
    x = g.node("Conv", ["input", w, b], "conv1", kernel_shape=[10, 4], strides=[2, 2], pads=[4, 1, 5, 1])
    x = g.node("Relu", [g.bn(x, "conv1_bn", 64)], "conv1_act")
    for i in range(4):
        x = g.node("Relu", [g.bn(g.conv(x, f"b{i}.dw", 64, 64, 3, groups=64), f"b{i}.dw_bn", 64)], f"b{i}.dw_act")
        x = g.node("Relu", [g.bn(g.conv(x, f"b{i}.pw", 64, 64, 1), f"b{i}.pw_bn", 64)], f"b{i}.pw_act")
    g.head(x, 64, classes)
    return g.model("ds_cnn_kws", (1, 49, 10), classes)


def tiny_cnn(resolution: int = 28, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """Conv(1→16, 3×3) ReLU Conv(16→32, 3×3, stride 2) ReLU, global average pool, Gemm(32→10):
    the tiny CNN of planner's first baseline measurements (MNIST-sized input)."""
    g = _Graph(seed)
    x = g.node("Relu", [g.conv("input", "conv1", 1, 16, 3, bias=True)], "relu1")
    x = g.node("Relu", [g.conv(x, "conv2", 16, 32, 3, stride=2, bias=True)], "relu2")
    g.head(x, 32, classes)
    return g.model(f"tiny_cnn_{resolution}", (1, resolution, resolution), classes)


def resnet(depth: int = 8, resolution: int = 32, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """A CIFAR-style ResNet (He et al. 2016): depth = 6n + 2 with basic blocks over 16/32/64 channels."""
    n = (depth - 2) // 6
    if 6 * n + 2 != depth:
        raise ValueError("ResNet depth must be 6n + 2 (8, 14, 20, ...)")
    g = _Graph(seed)
    x = g.node("Relu", [g.bn(g.conv("input", "stem", 3, 16, 3), "stem_bn", 16)], "stem_act")
    c = 16
    for stage, width in enumerate((16, 32, 64)):
        for j in range(n):
            name, stride = f"s{stage}.b{j}", 2 if stage > 0 and j == 0 else 1
            h = g.node("Relu", [g.bn(g.conv(x, f"{name}.conv1", c, width, 3, stride), f"{name}.bn1", width)], f"{name}.act1")
            h = g.bn(g.conv(h, f"{name}.conv2", width, width, 3), f"{name}.bn2", width)
            shortcut = (
                x
                if stride == 1 and c == width
                else g.bn(g.conv(x, f"{name}.down", c, width, 1, stride), f"{name}.down_bn", width)
            )
            x = g.node("Relu", [g.node("Add", [h, shortcut], f"{name}.add")], f"{name}.act2")
            c = width
    g.head(x, c, classes)
    return g.model(f"resnet{depth}_{resolution}", (3, resolution, resolution), classes)


def vit_block(
    resolution: int = 32, patch: int = 4, dim: int = 32, mlp: int = 64, classes: int = 10, seed: int = 0, blocks: int = 1
) -> onnx.ModelProto:
    """Patch embedding, `blocks` pre-norm transformer blocks (single-head attention, GELU MLP),
    mean-pool head. One block's layers are `attn.q`, `mlp.fc1`, …, several blocks' `block0.attn.q`, …"""
    g = _Graph(seed)
    r = g.rng
    tokens = (resolution // patch) ** 2
    x = g.node(
        "Conv",
        ["input", g.param("embed.weight", r.normal(0, 0.1, (dim, 3, patch, patch))), g.param("embed.bias", np.zeros(dim))],
        "embed",
        kernel_shape=[patch, patch],
        strides=[patch, patch],
    )
    x = g.node("Reshape", [x, g.const("embed.shape", np.array([0, dim, tokens], np.int64))], "embed.flatten")
    x = g.node("Transpose", [x], "tokens", perm=[0, 2, 1])  # [batch, tokens, dim]

    def linear(h: str, name: str, din: int, dout: int) -> str:
        h = g.node("MatMul", [h, g.param(f"{name}.weight", r.normal(0, np.sqrt(1.0 / din), (din, dout)))], name)
        return g.node("Add", [h, g.param(f"{name}.bias", np.zeros(dout))], f"{name}.add_bias")

    def norm(h: str, name: str) -> str:
        return g.node(
            "LayerNormalization",
            [h, g.param(f"{name}.scale", np.ones(dim)), g.param(f"{name}.bias", np.zeros(dim))],
            name,
            axis=-1,
        )

    for b in range(blocks):
        p = "" if blocks == 1 else f"block{b}."
        h = norm(x, f"{p}attn.norm")
        q, k, v = (linear(h, f"{p}attn.{n}", dim, dim) for n in "qkv")
        scores = g.node("MatMul", [q, g.node("Transpose", [k], f"{p}attn.kT", perm=[0, 2, 1])], f"{p}attn.scores")
        scale = g.const(f"{p}attn.scale", np.array(1.0 / np.sqrt(dim), np.float32))
        attn = g.node("Softmax", [g.node("Mul", [scores, scale], f"{p}attn.scaled")], f"{p}attn.softmax", axis=-1)
        h = linear(g.node("MatMul", [attn, v], f"{p}attn.mix"), f"{p}attn.out", dim, dim)
        x = g.node("Add", [x, h], f"{p}attn.residual")
        h = linear(norm(x, f"{p}mlp.norm"), f"{p}mlp.fc1", dim, mlp)
        h = linear(g.node("Gelu", [h], f"{p}mlp.gelu"), f"{p}mlp.fc2", mlp, dim)
        x = g.node("Add", [x, h], f"{p}mlp.residual")
    x = g.node("ReduceMean", [x, g.const("pool.axes", np.array([1], np.int64))], "pool", keepdims=0)
    w = g.param("classifier.weight", r.normal(0, np.sqrt(1.0 / dim), (classes, dim)))
    g.nodes.append(
        helper.make_node("Gemm", [x, w, g.param("classifier.bias", np.zeros(classes))], ["logits"], name="classifier", transB=1)
    )
    return g.model(
        f"vit_block_{resolution}" if blocks == 1 else f"vit_{blocks}x{dim}_{resolution}", (3, resolution, resolution), classes
    )


def save(model: onnx.ModelProto, path: str | Path) -> Path:
    onnx.save(model, str(path))
    return Path(path)


def synthetic_task(input_shape: tuple[int, ...], classes: int = 10, n: int = 512, seed: int = 0) -> dict[str, np.ndarray]:
    """A learnable stand-in dataset: one smooth random template per class, plus noise.

    For exercising planner on architectures whose real datasets cannot be downloaded here; its
    accuracies are a proxy, not a benchmark. Returns x/y arrays (the last 20 % become val).
    """
    rng = np.random.default_rng(seed)
    c, h, w = input_shape
    coarse = rng.normal(0, 1, (classes, c, max(1, h // 8), max(1, w // 8)))
    templates = coarse.repeat(h // coarse.shape[2] + 1, axis=2)[:, :, :h].repeat(w // coarse.shape[3] + 1, axis=3)[:, :, :, :w]
    y = rng.integers(0, classes, n)
    x = templates[y] + rng.normal(0, 1.0, (n, c, h, w))
    return {"x": x.astype(np.float32), "y": y.astype(np.int64)}
