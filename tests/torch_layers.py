"""Tiny PyTorch models of one torch.nn layer (or functional op) each, exported by both exporters.

The operator table (`planner.inputs.operators`) must cover every ONNX operator and attribute form
PyTorch's exporters write for torch.nn layers and functional ops; `LAYERS` is the catalogue that
holds it to that. Each entry is

    input -> pre (a small Linear or Conv, so something before the layer has parameters)
          -> LAYER -> flatten -> Linear head -> logits [batch, 3]

with the layer's attributes away from their defaults (strides, dilations, groups, padding modes,
ceil mode, align_corners, ...). An entry's input is a float `x` of `Entry.shape` (after the batch),
or token ids (`Entry.vocab`); `Entry.mask` adds a second, boolean input the layer also takes (an
attention mask).

- `export(name, exporter)`: the ONNX file, legacy (`dynamo=False`, dynamic batch through
  `dynamic_axes`) or dynamo (`dynamic_shapes`, external data), each exporter's default opset;
  cached under `$PLANNER_TORCH_EXPORTS/torch-<version>-layers/<name>-<exporter>-<recipe>/`, the
  recipe a digest of this file and the ONNX packages, as `torch_families.export` caches (an export
  the exporter refuses is cached too, as `torch_families.ExportFailed` and its message).
- `torch_module(name)`: the eval-mode model exported, with the same (seeded) weights.
- `sample_inputs(name, batch)`: a batch of inputs for it (one array per input).

Weights are PyTorch's seeded defaults, except that a parameter whose elements are all equal (a
norm's ones and zeros, PReLU's 0.25) gets noise: the exporters deduplicate equal tensors and drop
all-zero biases. BatchNorm statistics are random (variances in [0.5, 1.5]).
"""

from __future__ import annotations

import functools
import os
import sys
import types
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from torch_families import Exporter, cached_export, recipe, torch_export

# torchvision (installed for the families) is built against CUDA torch: its C-op registrations
# would fail to load if the dynamo exporter imported it (see `torch_families.torchvision`).
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))

torch.set_num_threads(1)

EXPORTERS: tuple[Exporter, ...] = ("legacy", "dynamo")
N_CLASSES = 3
SEED = 20250101


# ------------------------------------------------------------------------------------ the models


class Fn(nn.Module):
    """A functional op as a module: `f(self, x, *rest)`, with parameters of the given shapes
    (`self.<name>`, drawn N(0, 1/fan_in)) and constant buffers."""

    def __init__(self, f: Callable, params: dict[str, tuple[int, ...]] | None = None, buffers: dict | None = None) -> None:
        super().__init__()
        self.f = f
        for name, shape in (params or {}).items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape) / max(shape[-1], 1) ** 0.5))
        for name, value in (buffers or {}).items():
            self.register_buffer(name, torch.as_tensor(value))

    def forward(self, x, *rest):
        return self.f(self, x, *rest)


def fn(f: Callable, **params) -> Callable[[], nn.Module]:
    """A layer of one functional op `f(x)` (or `f(self, x)` when it has parameters)."""
    if params:
        return lambda: Fn(f, params)
    return lambda: Fn(lambda _, x, *rest: f(x, *rest))


def seq(*layers: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(*(make() for make in layers))


def cat_with(f: Callable) -> Callable[[], nn.Module]:
    """`x` and a reduction of it side by side (`f(x)` keeps its dims): both reach the logits."""
    return fn(lambda x: torch.cat([x, f(x)], 1))


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]  # one sample of the input (the token ids' length when `vocab`)
    layer: Callable[[], nn.Module]
    pre: str | None = "auto"  # linear (over the last axis), conv1d, conv2d, None; auto: by the input's rank (T: linear)
    vocab: int | None = None  # the input is int64 token ids in [0, vocab)
    mask: tuple[int, ...] | None = None  # a second input: a boolean mask of this shape, the layer's second argument
    what: str = ""

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("x", "mask") if self.mask is not None else ("x",)


def _pre(entry: Entry) -> nn.Module:
    kind = entry.pre
    if kind == "auto":  # a sequence of tokens (T) takes a Linear over its width
        kind = "linear" if entry.shape == T else {1: "linear", 2: "conv1d", 3: "conv2d"}.get(len(entry.shape), "linear")
    if kind is None or entry.vocab is not None:
        return nn.Identity()
    channels = entry.shape[0]
    if kind == "linear":
        return nn.Linear(entry.shape[-1], entry.shape[-1])
    if kind == "conv1d":
        return nn.Conv1d(channels, channels, 1)
    if kind == "conv2d":
        return nn.Conv2d(channels, channels, 1)
    raise ValueError(f"{entry.name}: unknown pre {kind!r}")


class Classifier(nn.Module):
    """`pre -> layer -> flatten -> head`, logits [batch, N_CLASSES]."""

    def __init__(self, entry: Entry) -> None:
        super().__init__()
        self.pre = _pre(entry)
        self.layer = entry.layer()
        with torch.no_grad():
            features = self._features(*example_inputs(entry, 2)).shape[1]
        self.head = nn.Linear(features, N_CLASSES)

    def _features(self, x, mask=None):
        h = self.layer(self.pre(x)) if mask is None else self.layer(self.pre(x), mask)
        if isinstance(h, tuple | list):
            raise TypeError("a layer must return one tensor")
        return h.flatten(1)

    def forward(self, x, mask=None):
        h = self._features(x, mask)
        return self.head(h if h.dtype == self.head.weight.dtype else h.to(self.head.weight.dtype))


# -------------------------------------------------------------------------------- the catalogue

V = (8,)  # features
S = (4, 16)  # a 1-D signal: channels, length
IM = (4, 9, 9)  # an image of odd size
IE = (4, 8, 8)  # an image of even size
T = (5, 8)  # a sequence: length, width
VOL = (2, 4, 5, 5)  # a volume (3-D convolutions and pools)
IDS = (6,)  # token ids


def _heads(x: torch.Tensor, heads: int = 2) -> torch.Tensor:
    b, n, d = x.shape
    return x.reshape(b, n, heads, d // heads).transpose(1, 2)


def _sdpa(**kw) -> Callable[[], nn.Module]:
    def f(self, x, mask=None):
        q, k, v = (_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        if mask is not None:
            kw["attn_mask"] = mask.unsqueeze(1)  # [batch, 1, L, L]: every head
        return F.scaled_dot_product_attention(q, k, v, **kw).transpose(1, 2).flatten(2)

    def make():
        m = Fn(f)
        m.qkv = nn.Linear(8, 24)
        return m

    return make


def _mha(need_weights: bool = False, causal: bool = False, kdim: int | None = None, batch_first: bool = True):
    def f(self, x, mask=None):
        attn_mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1) if causal else None
        kv = x[..., :kdim] if kdim else x
        q = x if batch_first else x.transpose(0, 1)
        kv = kv if batch_first else kv.transpose(0, 1)
        padding = None if mask is None else ~mask
        out, w = self.attn(q, kv, kv, need_weights=need_weights, attn_mask=attn_mask, key_padding_mask=padding)
        out = out if batch_first else out.transpose(0, 1)
        return torch.cat([out.flatten(1), w.flatten(1)], 1) if need_weights else out

    def make():
        m = Fn(f)
        m.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim)
        return m

    return make


def _recurrent(cls: type, pick: str = "out", **kw) -> Callable[[], nn.Module]:
    def f(self, x):
        out, hidden = self.rnn(x)
        if pick == "out":
            return out
        h = hidden[0] if isinstance(hidden, tuple) else hidden  # LSTM: (h, c)
        return h.transpose(0, 1)

    def make():
        m = Fn(f)
        m.rnn = cls(8, 6, batch_first=True, **kw)
        return m

    return make


def _cell(cls: type) -> Callable[[], nn.Module]:
    def f(self, x):
        out = self.cell(x)
        return torch.cat(out, 1) if isinstance(out, tuple) else out

    def make():
        m = Fn(f)
        m.cell = cls(8, 6)
        return m

    return make


def _wrapped(wrap: Callable, make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: wrap(make())


def _gather(x: torch.Tensor) -> torch.Tensor:
    index = torch.tensor([[7, 0, 3, 3, 5]]).expand(x.shape[0], -1)
    return torch.gather(x, 1, index)


def _scatter(x: torch.Tensor, add: bool = False) -> torch.Tensor:
    index = torch.tensor([[6, 1, 4]]).expand(x.shape[0], -1)
    src = x[:, :3] * 2
    return x.scatter_add(1, index, src) if add else x.scatter(1, index, src)


def _index_put(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[:, [1, 2]] = x[:, [5, 6]] * 2
    return y


def _unpool(x: torch.Tensor) -> torch.Tensor:
    pooled, indices = F.max_pool2d(x, 2, return_indices=True)
    return F.max_unpool2d(pooled, indices, 2, output_size=x.shape[2:])


def _grid_sample(self, x):
    grid = F.affine_grid(self.theta.expand(x.shape[0], 2, 3), [x.shape[0], *x.shape[1:]], align_corners=False)
    return F.grid_sample(x, grid, align_corners=False)


def _theta():
    def make():
        m = Fn(_grid_sample)
        m.theta = nn.Parameter(torch.tensor([[[0.9, 0.1, 0.05], [-0.1, 0.8, 0.0]]]))
        return m

    return make


def _bilinear():
    def make():
        m = Fn(lambda self, x: self.bl(x, x.flip(1)))
        m.bl = nn.Bilinear(8, 8, 4)
        return m

    return make


def _decoder() -> nn.Module:
    m = Fn(lambda self, x: self.dec(x, x))
    m.dec = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return m


_BOUNDS = {"lo": torch.linspace(-1.0, 0.0, 8), "hi": torch.linspace(0.2, 1.2, 8)}

_ENTRIES: list[Entry] = [
    # --- convolutions
    Entry("conv1d_k3", S, lambda: nn.Conv1d(4, 6, 3)),
    Entry("conv1d_stride2_pad1", S, lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1)),
    Entry("conv1d_dilation2", S, lambda: nn.Conv1d(4, 6, 3, dilation=2)),
    Entry("conv1d_groups2", S, lambda: nn.Conv1d(4, 6, 3, groups=2)),
    Entry("conv1d_depthwise_nobias", S, lambda: nn.Conv1d(4, 4, 3, groups=4, padding=1, bias=False)),
    Entry("conv1d_same_dilation2", S, lambda: nn.Conv1d(4, 6, 3, padding="same", dilation=2)),
    Entry("conv1d_same_even_kernel", S, lambda: nn.Conv1d(4, 6, 4, padding="same")),
    Entry("conv1d_reflect", S, lambda: nn.Conv1d(4, 6, 3, padding=1, padding_mode="reflect")),
    Entry("conv1d_replicate", S, lambda: nn.Conv1d(4, 6, 3, padding=2, padding_mode="replicate")),
    Entry("conv1d_circular", S, lambda: nn.Conv1d(4, 6, 3, padding=2, padding_mode="circular")),
    Entry("conv2d_stride2_pad1", IM, lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1)),
    Entry("conv2d_asymmetric", IM, lambda: nn.Conv2d(4, 6, (3, 1), stride=(2, 1), padding=(1, 0))),
    Entry("conv2d_dilation2", IM, lambda: nn.Conv2d(4, 6, 3, dilation=2, padding=2)),
    Entry("conv2d_groups2", IM, lambda: nn.Conv2d(4, 6, 3, groups=2)),
    Entry("conv2d_depthwise_x2", IM, lambda: nn.Conv2d(4, 8, 3, groups=4, padding=1)),
    Entry("conv2d_same", IM, lambda: nn.Conv2d(4, 6, 3, padding="same")),
    Entry("conv2d_same_even_kernel", IM, lambda: nn.Conv2d(4, 6, 4, padding="same")),
    Entry("conv2d_zeros_pad12", IM, lambda: nn.Conv2d(4, 6, 3, padding=(1, 2))),
    Entry("conv2d_reflect", IM, lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect")),
    Entry("conv2d_replicate", IM, lambda: nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode="replicate")),
    Entry("conv2d_circular", IM, lambda: nn.Conv2d(4, 6, 3, padding=(2, 1), padding_mode="circular")),
    Entry("conv2d_nobias", IM, lambda: nn.Conv2d(4, 6, 3, bias=False)),
    Entry(
        "conv2d_weight_standardized",
        IM,
        fn(
            lambda self, x: F.conv2d(x, (self.w - self.w.mean((1, 2, 3), keepdim=True)) / self.w.std((1, 2, 3), keepdim=True)),
            w=(6, 4, 3, 3),
        ),
        what="a weight computed from a parameter",
    ),
    Entry("conv3d", VOL, lambda: nn.Conv3d(2, 3, 3, padding=1), pre="linear"),
    # --- transposed convolutions
    Entry("convT1d_k4s2p1", S, lambda: nn.ConvTranspose1d(4, 3, 4, stride=2, padding=1)),
    Entry("convT1d_output_padding", S, lambda: nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1, output_padding=1)),
    Entry("convT1d_dilation2", S, lambda: nn.ConvTranspose1d(4, 3, 3, dilation=2)),
    Entry("convT1d_groups2", S, lambda: nn.ConvTranspose1d(4, 6, 3, groups=2, stride=2)),
    Entry("convT2d_s2p1_op1", IM, lambda: nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)),
    Entry("convT2d_k4s2p1", IM, lambda: nn.ConvTranspose2d(4, 3, 4, stride=2, padding=1)),
    Entry("convT2d_dilation2", IM, lambda: nn.ConvTranspose2d(4, 3, 3, dilation=2, padding=1)),
    Entry("convT2d_groups2_nobias", IM, lambda: nn.ConvTranspose2d(4, 6, 3, groups=2, stride=2, bias=False)),
    Entry(
        "convT2d_asymmetric", IM, lambda: nn.ConvTranspose2d(4, 3, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0))
    ),
    # --- pooling
    Entry("maxpool1d_k3s2", S, lambda: nn.MaxPool1d(3, 2)),
    Entry("maxpool1d_ceil", S, lambda: nn.MaxPool1d(3, 2, ceil_mode=True)),
    Entry("maxpool1d_dilation2_pad1", S, lambda: nn.MaxPool1d(3, 1, padding=1, dilation=2)),
    Entry("maxpool2d_k2", IE, lambda: nn.MaxPool2d(2)),
    Entry("maxpool2d_ceil", IM, lambda: nn.MaxPool2d(2, ceil_mode=True)),
    Entry("maxpool2d_k3s2p1", IM, lambda: nn.MaxPool2d(3, 2, padding=1)),
    Entry("maxpool2d_dilation2", IM, lambda: nn.MaxPool2d(3, 1, dilation=2)),
    Entry("maxpool2d_ceil_pad1", IE, lambda: nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)),
    Entry("maxpool3d", VOL, lambda: nn.MaxPool3d(2), pre="linear"),
    Entry("avgpool1d_k3s2", S, lambda: nn.AvgPool1d(3, 2)),
    Entry("avgpool1d_ceil", S, lambda: nn.AvgPool1d(3, 2, ceil_mode=True)),
    Entry("avgpool1d_pad1_exclude", S, lambda: nn.AvgPool1d(3, 2, padding=1, count_include_pad=False)),
    Entry("avgpool1d_pad1_include", S, lambda: nn.AvgPool1d(3, 2, padding=1)),
    Entry("avgpool2d_k2", IE, lambda: nn.AvgPool2d(2)),
    Entry("avgpool2d_ceil", IM, lambda: nn.AvgPool2d(2, ceil_mode=True)),
    Entry("avgpool2d_pad1_exclude", IM, lambda: nn.AvgPool2d(3, 2, padding=1, count_include_pad=False)),
    Entry("avgpool2d_pad1_include", IM, lambda: nn.AvgPool2d(3, 2, padding=1)),
    Entry("avgpool2d_ceil_pad1_exclude", IE, lambda: nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False)),
    Entry("avgpool2d_divisor_override", IM, lambda: nn.AvgPool2d(3, divisor_override=2)),
    Entry("avgpool3d", VOL, lambda: nn.AvgPool3d(2), pre="linear"),
    Entry("lppool1d", S, lambda: nn.LPPool1d(2, 3, 2)),
    Entry("lppool2d", IM, lambda: nn.LPPool2d(2, 3, 2)),
    Entry("maxunpool2d", IE, fn(_unpool)),
    Entry("adaptiveavg1d_1", S, lambda: nn.AdaptiveAvgPool1d(1)),
    Entry("adaptiveavg1d_4", S, lambda: nn.AdaptiveAvgPool1d(4)),
    Entry("adaptiveavg1d_5", S, lambda: nn.AdaptiveAvgPool1d(5), what="not a divisor of the length"),
    Entry("adaptiveavg2d_1", IM, lambda: nn.AdaptiveAvgPool2d(1)),
    Entry("adaptiveavg2d_3", IM, lambda: nn.AdaptiveAvgPool2d(3)),
    Entry("adaptiveavg2d_4", IM, lambda: nn.AdaptiveAvgPool2d((4, 3)), what="not a divisor of the size"),
    Entry("adaptiveavg3d_1", VOL, lambda: nn.AdaptiveAvgPool3d(1), pre="linear"),
    Entry("adaptivemax1d_4", S, lambda: nn.AdaptiveMaxPool1d(4)),
    Entry("adaptivemax2d_1", IM, lambda: nn.AdaptiveMaxPool2d(1)),
    Entry("adaptivemax2d_3", IM, lambda: nn.AdaptiveMaxPool2d(3)),
    Entry("adaptivemax2d_4", IM, lambda: nn.AdaptiveMaxPool2d(4), what="not a divisor of the size"),
    # --- normalization
    Entry("batchnorm1d_features", V, lambda: nn.BatchNorm1d(8)),
    Entry("batchnorm1d_signal", S, lambda: nn.BatchNorm1d(4)),
    Entry("batchnorm2d", IM, lambda: nn.BatchNorm2d(4), what="after a conv: folded into it"),
    Entry("batchnorm2d_after_relu", IM, seq(nn.ReLU, lambda: nn.BatchNorm2d(4)), what="not foldable"),
    Entry("batchnorm2d_no_affine", IM, seq(nn.ReLU, lambda: nn.BatchNorm2d(4, affine=False))),
    Entry("batchnorm3d", VOL, lambda: nn.BatchNorm3d(2), pre="linear"),
    Entry("layernorm", V, lambda: nn.LayerNorm(8)),
    Entry("layernorm_2d_shape", IM, lambda: nn.LayerNorm([9, 9])),
    Entry("layernorm_no_bias", T, lambda: nn.LayerNorm(8, bias=False)),
    Entry("layernorm_no_affine", V, lambda: nn.LayerNorm(8, elementwise_affine=False)),
    Entry("groupnorm2d", IM, lambda: nn.GroupNorm(2, 4)),
    Entry("groupnorm1d", S, lambda: nn.GroupNorm(2, 4)),
    Entry("groupnorm_no_affine", IM, lambda: nn.GroupNorm(2, 4, affine=False)),
    Entry("instancenorm1d_affine", S, lambda: nn.InstanceNorm1d(4, affine=True)),
    Entry("instancenorm2d_affine", IM, lambda: nn.InstanceNorm2d(4, affine=True)),
    Entry("instancenorm2d_plain", IM, lambda: nn.InstanceNorm2d(4)),
    Entry("instancenorm2d_running", IM, lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True)),
    Entry("instancenorm3d_affine", VOL, lambda: nn.InstanceNorm3d(2, affine=True), pre="linear"),
    Entry("rmsnorm", V, lambda: nn.RMSNorm(8)),
    Entry("rmsnorm_2d_shape", IM, lambda: nn.RMSNorm([9, 9])),
    Entry("rmsnorm_eps", T, lambda: nn.RMSNorm(8, eps=1e-3)),
    Entry("localresponsenorm2d", IM, lambda: nn.LocalResponseNorm(3)),
    Entry("localresponsenorm1d", S, lambda: nn.LocalResponseNorm(2, alpha=0.1, beta=0.5, k=2.0)),
    # --- activations
    Entry("relu", V, nn.ReLU),
    Entry("relu6", V, nn.ReLU6),
    Entry("leakyrelu", V, lambda: nn.LeakyReLU(0.1)),
    Entry("prelu", V, nn.PReLU),
    Entry("prelu_channels", IM, lambda: nn.PReLU(4)),
    Entry("rrelu_eval", V, nn.RReLU),
    Entry("elu", V, lambda: nn.ELU(0.5)),
    Entry("selu", V, nn.SELU),
    Entry("celu", V, lambda: nn.CELU(0.7)),
    Entry("gelu", V, nn.GELU),
    Entry("gelu_tanh", V, lambda: nn.GELU(approximate="tanh")),
    Entry("silu", V, nn.SiLU),
    Entry("mish", V, nn.Mish),
    Entry("hardswish", V, nn.Hardswish),
    Entry("hardsigmoid", V, nn.Hardsigmoid),
    Entry("hardtanh", V, lambda: nn.Hardtanh(-0.5, 0.7)),
    Entry("hardshrink", V, lambda: nn.Hardshrink(0.3)),
    Entry("softshrink", V, lambda: nn.Softshrink(0.3)),
    Entry("tanhshrink", V, nn.Tanhshrink),
    Entry("softplus", V, nn.Softplus),
    Entry("softplus_beta_threshold", V, lambda: nn.Softplus(beta=2.0, threshold=1.0)),
    Entry("softsign", V, nn.Softsign),
    Entry("sigmoid", V, nn.Sigmoid),
    Entry("logsigmoid", V, nn.LogSigmoid),
    Entry("tanh", V, nn.Tanh),
    Entry("threshold", V, lambda: nn.Threshold(0.1, 20.0)),
    Entry("threshold_zero", V, lambda: nn.Threshold(0.1, 0.0)),
    Entry("softmax", V, lambda: nn.Softmax(dim=1)),
    Entry("softmax_channels", IM, lambda: nn.Softmax(dim=1)),
    Entry("softmax2d", IM, nn.Softmax2d),
    Entry("logsoftmax", V, lambda: nn.LogSoftmax(dim=1)),
    Entry("softmin", V, lambda: nn.Softmin(dim=1)),
    Entry("glu", V, nn.GLU),
    Entry("glu_channels", IM, lambda: nn.GLU(dim=1)),
    # --- embeddings
    Entry("embedding", IDS, lambda: nn.Embedding(20, 8), vocab=20),
    Entry("embedding_padding_idx", IDS, lambda: nn.Embedding(20, 8, padding_idx=0), vocab=20),
    Entry("embeddingbag_mean", IDS, lambda: nn.EmbeddingBag(20, 8, mode="mean"), vocab=20),
    Entry("embeddingbag_sum", IDS, lambda: nn.EmbeddingBag(20, 8, mode="sum"), vocab=20),
    Entry("embeddingbag_max", IDS, lambda: nn.EmbeddingBag(20, 8, mode="max"), vocab=20),
    Entry("one_hot", IDS, fn(lambda x: F.one_hot(x, 20)), vocab=20),
    # --- attention
    Entry("mha", T, _mha()),
    Entry("mha_weights", T, _mha(need_weights=True)),
    Entry("mha_causal_mask", T, _mha(causal=True)),
    Entry("mha_key_padding_mask", T, _mha(), mask=(5,)),
    Entry("mha_kdim_vdim", T, _mha(kdim=4)),
    Entry("mha_sequence_first", T, _mha(batch_first=False)),
    Entry("sdpa", T, _sdpa()),
    Entry("sdpa_bool_mask", T, _sdpa(), mask=(5, 5)),
    Entry("sdpa_causal", T, _sdpa(is_causal=True)),
    Entry("sdpa_scale", T, _sdpa(scale=0.3)),
    Entry("transformer_encoder_layer", T, lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)),
    Entry("transformer_decoder_layer", T, _decoder),
    # --- resampling
    Entry("upsample_nearest_x2", IM, lambda: nn.Upsample(scale_factor=2)),
    Entry("upsample_nearest_size", IM, lambda: nn.Upsample(size=(13, 13))),
    Entry("upsample_nearest_asymmetric", IM, lambda: nn.Upsample(scale_factor=(2, 1))),
    Entry("upsample_nearest_1d", S, lambda: nn.Upsample(scale_factor=2)),
    Entry("upsample_nearest_exact", IM, fn(lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest-exact"))),
    Entry("upsample_bilinear", IM, lambda: nn.Upsample(scale_factor=2, mode="bilinear")),
    Entry("upsample_bilinear_align_corners", IM, lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)),
    Entry("upsample_bilinear_size", IM, fn(lambda x: F.interpolate(x, size=(12, 7), mode="bilinear"))),
    Entry("upsample_bicubic", IM, lambda: nn.Upsample(scale_factor=2, mode="bicubic")),
    Entry("upsample_bicubic_align_corners", IM, lambda: nn.Upsample(scale_factor=2, mode="bicubic", align_corners=True)),
    Entry("upsample_linear_1d", S, lambda: nn.Upsample(scale_factor=2, mode="linear")),
    Entry("upsample_linear_1d_align_corners", S, lambda: nn.Upsample(size=21, mode="linear", align_corners=True)),
    Entry("upsample_trilinear", VOL, lambda: nn.Upsample(scale_factor=2, mode="trilinear"), pre="linear"),
    Entry("downsample_nearest", IM, fn(lambda x: F.interpolate(x, scale_factor=0.5, mode="nearest"))),
    Entry("downsample_bilinear", IM, fn(lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear"))),
    Entry("downsample_bilinear_antialias", IE, fn(lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True))),
    Entry(
        "interpolate_recompute_scale",
        IM,
        fn(lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear", recompute_scale_factor=True)),
    ),
    Entry("interpolate_area", IM, fn(lambda x: F.interpolate(x, size=(3, 3), mode="area"))),
    Entry("pixelshuffle", (8, 4, 4), lambda: nn.PixelShuffle(2)),
    Entry("pixelunshuffle", IE, lambda: nn.PixelUnshuffle(2)),
    Entry("channelshuffle", IE, lambda: nn.ChannelShuffle(2)),
    Entry("flatten_unflatten", IM, seq(lambda: nn.Flatten(2), lambda: nn.Unflatten(1, (2, 2)))),
    Entry("grid_sample", IM, _theta()),
    # --- padding
    Entry("pad1d_constant", S, fn(lambda x: F.pad(x, (2, 1), value=0.5))),
    Entry("pad1d_reflect", S, fn(lambda x: F.pad(x, (2, 1), mode="reflect"))),
    Entry("pad1d_replicate", S, fn(lambda x: F.pad(x, (2, 1), mode="replicate"))),
    Entry("pad1d_circular", S, fn(lambda x: F.pad(x, (2, 1), mode="circular"))),
    Entry("pad2d_constant", IM, fn(lambda x: F.pad(x, (1, 2, 0, 1)))),
    Entry("pad2d_reflect", IM, fn(lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"))),
    Entry("pad2d_replicate", IM, fn(lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"))),
    Entry("pad2d_circular", IM, fn(lambda x: F.pad(x, (1, 2, 2, 1), mode="circular"))),
    Entry("pad2d_negative", IM, fn(lambda x: F.pad(x, (-1, 1, 0, -2)))),
    Entry("pad_channels", IM, fn(lambda x: F.pad(x, (0, 0, 0, 0, 1, 1)))),
    # --- scans, reordering, indexing
    Entry("cumsum", V, fn(lambda x: x.cumsum(1))),
    Entry("cumsum_reversed", V, fn(lambda x: x.flip(1).cumsum(1).flip(1))),
    Entry("cumsum_image", IM, fn(lambda x: x.cumsum(-1))),
    Entry("cumprod", V, fn(lambda x: x.cumprod(1))),
    Entry("flip", V, fn(lambda x: x.flip(1))),
    Entry("flip_2d", IM, fn(lambda x: x.flip(2, 3))),
    Entry("roll", V, fn(lambda x: x.roll(3, 1))),
    Entry("roll_2d", IM, fn(lambda x: x.roll((1, -2), (2, 3)))),
    Entry("strided_slice", V, fn(lambda x: x[:, 1:7:2])),
    Entry("gather", V, fn(_gather)),
    Entry("gather_sorted", V, fn(lambda x: torch.gather(x, 1, x.argsort(1)))),
    Entry("sort", V, fn(lambda x: torch.sort(x, 1, descending=True).values)),
    Entry("index_select", V, fn(lambda x: x.index_select(1, torch.tensor([0, 3, 3, 6])))),
    Entry("advanced_index", IM, fn(lambda x: x[:, [2, 0], 1:4])),
    Entry("scatter", V, fn(_scatter)),
    Entry("scatter_add", V, fn(lambda x: _scatter(x, add=True))),
    Entry("index_put", V, fn(_index_put)),
    Entry("masked_fill", V, fn(lambda x: x.masked_fill(x > 0.5, 0.0))),
    Entry("topk", V, fn(lambda x: torch.topk(x, 3, dim=1).values)),
    Entry("topk_smallest", V, fn(lambda x: torch.topk(x, 3, dim=1, largest=False).values)),
    Entry("topk_unsorted", V, fn(lambda x: torch.topk(x, 3, dim=1, sorted=False).values)),
    Entry("argmax_one_hot", V, fn(lambda x: x * F.one_hot(x.argmax(1), 8))),
    Entry("amax", V, cat_with(lambda x: x.amax(1, keepdim=True))),
    Entry("amin", V, cat_with(lambda x: x.amin(1, keepdim=True))),
    Entry("max_dim", V, cat_with(lambda x: x.max(1, keepdim=True).values)),
    Entry("min_dim", V, cat_with(lambda x: x.min(1, keepdim=True).values)),
    Entry("max_all", V, fn(lambda x: x - x.max())),
    Entry("maximum", V, fn(lambda x: torch.maximum(x, x.flip(1)))),
    Entry("minimum", V, fn(lambda x: torch.minimum(x, x.flip(1)))),
    Entry("clamp_tensor_bounds", V, lambda: Fn(lambda self, x: torch.clamp(x, min=self.lo, max=self.hi), None, _BOUNDS)),
    Entry("clamp_scalars", V, fn(lambda x: x.clamp(-0.5, 0.5))),
    Entry("clamp_min", V, fn(lambda x: x.clamp(min=0.1))),
    Entry("clamp_min_tensor", V, lambda: Fn(lambda self, x: torch.clamp(x, min=self.lo), None, _BOUNDS)),
    Entry("where", V, fn(lambda x: torch.where(x > 0, x, 0.1 * x))),
    Entry("where_tensors", V, fn(lambda x: torch.where(x > 0, x, x.flip(1)))),
    Entry("tril_triu", IM, fn(lambda x: x.tril(-1) + 0.5 * x.triu(1))),
    Entry("permute", IM, fn(lambda x: x.permute(0, 2, 3, 1))),
    # --- einsum and products
    Entry("einsum_matmul", V, fn(lambda self, x: torch.einsum("bi,oi->bo", x, self.w), w=(6, 8))),
    Entry("einsum_batched", T, fn(lambda x: torch.einsum("bij,bkj->bik", x, x))),
    Entry("einsum_summed_index", T, fn(lambda self, x: torch.einsum("bij,jk->bk", x, self.w), w=(8, 4))),
    Entry("einsum_outer", V, fn(lambda x: torch.einsum("bi,bj->bij", x, x))),
    Entry("einsum_diagonal", IM, fn(lambda x: torch.einsum("bcii->bci", x))),
    Entry("bilinear", V, _bilinear()),
    Entry("bmm", T, fn(lambda x: torch.bmm(x, x.transpose(1, 2)))),
    Entry("addmm", V, fn(lambda self, x: torch.addmm(self.b, x, self.w, beta=0.5, alpha=2.0), w=(8, 6), b=(6,))),
    Entry("baddbmm", T, fn(lambda x: torch.baddbmm(x[:, :, :5], x, x.transpose(1, 2), beta=0.5, alpha=0.3))),
    Entry("cdist", T, fn(lambda self, x: torch.cdist(x, self.w.expand(x.shape[0], -1, -1)), w=(3, 8))),
    Entry("diagonal", IM, fn(lambda x: torch.diagonal(x, 1, 2, 3))),
    # --- unfold, fold, repeat, split
    Entry("unfold", IM, fn(lambda x: F.unfold(x, 3, padding=1, stride=2))),
    Entry("unfold_dilation", IM, fn(lambda x: F.unfold(x, 2, dilation=2))),
    Entry("fold", IE, fn(lambda x: F.fold(F.unfold(x, 3, padding=1), (8, 8), 3, padding=1))),
    Entry("tensor_unfold", V, fn(lambda x: x.unfold(1, 3, 2))),
    Entry("repeat", V, fn(lambda x: x.repeat(1, 2))),
    Entry("repeat_image", IM, fn(lambda x: x.repeat(1, 1, 2, 1))),
    Entry("tile", V, fn(lambda x: x.tile((1, 3)))),
    Entry("repeat_interleave", V, fn(lambda x: x.repeat_interleave(2, dim=1))),
    Entry("expand", V, fn(lambda x: x.unsqueeze(1).expand(-1, 3, -1))),
    Entry("chunk", V, fn(lambda x: torch.mul(*x.chunk(2, 1)))),
    Entry("split_sizes", V, fn(lambda x: torch.cat(torch.split(x, [3, 5], 1)[::-1], 1))),
    Entry("unbind_stack", T, fn(lambda x: torch.stack(x.unbind(1)[::-1], 1))),
    # --- recurrent
    Entry("gru", T, _recurrent(nn.GRU)),
    Entry("gru_2layer_bidirectional", T, _recurrent(nn.GRU, num_layers=2, bidirectional=True)),
    Entry("gru_hidden", T, _recurrent(nn.GRU, pick="hidden")),
    Entry("lstm", T, _recurrent(nn.LSTM)),
    Entry("lstm_bidirectional", T, _recurrent(nn.LSTM, bidirectional=True)),
    Entry("lstm_hidden", T, _recurrent(nn.LSTM, pick="hidden")),
    Entry("lstm_proj", T, _recurrent(nn.LSTM, proj_size=3)),
    Entry("rnn_tanh", T, _recurrent(nn.RNN)),
    Entry("rnn_relu_2layer", T, _recurrent(nn.RNN, nonlinearity="relu", num_layers=2)),
    Entry("grucell", V, _cell(nn.GRUCell)),
    Entry("lstmcell", V, _cell(nn.LSTMCell)),
    Entry("rnncell", V, _cell(nn.RNNCell)),
    # --- identities in eval mode
    Entry("dropout", V, lambda: nn.Dropout(0.5)),
    Entry("dropout2d", IM, lambda: nn.Dropout2d(0.5)),
    Entry("alphadropout", V, lambda: nn.AlphaDropout(0.5)),
    Entry("identity", V, nn.Identity),
    # --- parametrizations
    Entry("weight_norm_linear", V, _wrapped(nn.utils.parametrizations.weight_norm, lambda: nn.Linear(8, 8))),
    Entry("weight_norm_conv2d", IM, _wrapped(nn.utils.parametrizations.weight_norm, lambda: nn.Conv2d(4, 4, 3))),
    Entry("spectral_norm_linear", V, _wrapped(nn.utils.parametrizations.spectral_norm, lambda: nn.Linear(8, 8))),
    Entry("spectral_norm_conv2d", IM, _wrapped(nn.utils.parametrizations.spectral_norm, lambda: nn.Conv2d(4, 4, 3))),
    # --- norms and similarities
    Entry("norm", V, cat_with(lambda x: torch.norm(x, dim=1, keepdim=True))),
    Entry("norm_p1", V, cat_with(lambda x: torch.norm(x, p=1, dim=1, keepdim=True))),
    Entry("norm_frobenius_2d", IM, fn(lambda x: torch.norm(x, dim=(2, 3)))),
    Entry("vector_norm_p3", V, cat_with(lambda x: torch.linalg.vector_norm(x, 3, dim=1, keepdim=True))),
    Entry("vector_norm_inf", V, cat_with(lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True))),
    Entry("logsumexp", V, cat_with(lambda x: x.logsumexp(1, keepdim=True))),
    Entry("normalize", V, fn(lambda x: F.normalize(x, dim=1))),
    Entry("normalize_channels", IM, fn(lambda x: F.normalize(x, dim=1))),
    Entry("cosine_similarity", T, fn(lambda x: F.cosine_similarity(x, x.flip(1), dim=-1))),
    Entry("cosine_similarity_param", T, fn(lambda self, x: F.cosine_similarity(x, self.w, dim=-1), w=(8,))),
    Entry("pairwise_distance", T, fn(lambda x: F.pairwise_distance(x, x.roll(1, 1)))),
    Entry("mean_var_std", T, fn(lambda x: torch.cat([x.mean(1), x.var(1), x.std(1)], 1))),
    Entry("prod", V, cat_with(lambda x: x.prod(1, keepdim=True))),
    # --- elementwise math
    *(
        Entry(f"math_{name}", V, fn(f))
        for name, f in {
            "exp": torch.exp,
            "log": lambda x: torch.log(x.abs() + 0.5),
            "sqrt": lambda x: torch.sqrt(x * x + 0.5),
            "rsqrt": lambda x: torch.rsqrt(x * x + 0.5),
            "reciprocal": lambda x: torch.reciprocal(x * x + 0.5),
            "pow3": lambda x: x**3,
            "pow_float": lambda x: (x.abs() + 0.5) ** 1.5,
            "pow_tensor": lambda x: (x.abs() + 0.5) ** x.flip(1),
            "exp2": lambda x: 2**x,
            "square": torch.square,
            "abs": torch.abs,
            "sin": torch.sin,
            "cos": torch.cos,
            "tan": lambda x: torch.tan(0.5 * x),
            "atan": torch.atan,
            "asin": lambda x: torch.asin(0.5 * torch.tanh(x)),
            "acos": lambda x: torch.acos(0.5 * torch.tanh(x)),
            "sinh": torch.sinh,
            "cosh": torch.cosh,
            "asinh": torch.asinh,
            "acosh": lambda x: torch.acosh(x * x + 1.5),
            "atanh": lambda x: torch.atanh(0.5 * torch.tanh(x)),
            "atan2": lambda x: torch.atan2(x, x.flip(1) + 3.0),
            "log1p": lambda x: torch.log1p(x.abs()),
            "expm1": torch.expm1,
            "erf": torch.erf,
            "sign": lambda x: x * torch.sign(x),
            "floor": lambda x: x + torch.floor(x),
            "round": lambda x: x + torch.round(x),
            "trunc_frac": lambda x: torch.trunc(x) + 2 * torch.frac(x),
            "fmod": lambda x: torch.fmod(x, 0.7),
            "remainder": lambda x: torch.remainder(x, 0.7),
            "lerp": lambda x: torch.lerp(x, x.flip(1), 0.3),
            "addcmul": lambda x: torch.addcmul(x, x, x.flip(1), value=0.5),
            "hypot": lambda x: torch.hypot(x, x.flip(1)),
            "logit": lambda x: torch.logit(torch.sigmoid(x) * 0.9 + 0.05),
        }.items()
    ),
]


LAYERS: dict[str, Entry] = {e.name: e for e in _ENTRIES}
assert len(LAYERS) == len(_ENTRIES), "entry names must be unique"


def _entry(name: str) -> Entry:
    try:
        return LAYERS[name]
    except KeyError:
        raise KeyError(f"unknown layer entry {name!r}") from None


# ----------------------------------------------------------------------------------- the weights


def example_inputs(entry: Entry, batch: int, seed: int = 0) -> list[torch.Tensor]:
    """Inputs for `entry` as PyTorch takes them (float32, int64 ids, bool mask)."""
    return [torch.from_numpy(a) for a in _draw_inputs(entry, batch, seed)]


def _draw_inputs(entry: Entry, batch: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, zlib.crc32(entry.name.encode())])
    if entry.vocab is not None:
        out = [rng.integers(0, entry.vocab, (batch, *entry.shape)).astype(np.int64)]
    else:
        out = [rng.standard_normal((batch, *entry.shape)).astype(np.float32)]
    if entry.mask is not None:
        mask = rng.random((batch, *entry.mask)) < 0.7  # True: attend
        mask[..., 0] = True  # every query keeps a key (an all-masked row is NaN in PyTorch)
        out.append(mask)
    return out


def sample_inputs(name: str, batch: int, seed: int = 1) -> list[np.ndarray]:
    """A batch of inputs for entry `name`, one array per model input."""
    return _draw_inputs(_entry(name), batch, seed)


@functools.cache
def _seeded_module(name: str) -> nn.Module:
    entry = _entry(name)
    seed = zlib.crc32(f"{SEED}:{name}".encode())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Classifier(entry).eval()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                flat = param.detach().flatten()
                if flat.numel() > 0 and bool((flat == flat[0]).all()):  # ones, zeros, 0.25: equal values
                    param.add_(0.1 * torch.randn(param.shape, generator=gen))
            for mname, module in model.named_modules():
                if isinstance(module, nn.modules.batchnorm._NormBase) and module.running_mean is not None:
                    module.running_mean.copy_(0.2 * torch.randn(module.running_mean.shape, generator=gen))
                    module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=gen))
    return model


def torch_module(name: str) -> nn.Module:
    """The eval-mode model `export(name, ...)` exports, with the same weights (a fresh copy)."""
    import copy

    return copy.deepcopy(_seeded_module(name))


# ------------------------------------------------------------------------------------- exporting


def default_export_dir() -> Path:
    env = os.environ.get("PLANNER_TORCH_EXPORTS")
    root = Path(env) if env else Path(os.environ.get("PLANNER_CACHE_DIR", Path.home() / ".cache" / "planner")) / "torch-exports"
    return root / f"torch-{torch.__version__}-layers"


def _export_to(name: str, exporter: Exporter, path: Path) -> None:
    entry = _entry(name)
    args = tuple(example_inputs(entry, 2))  # batch 2: a batch of 1 would be specialized
    torch_export(torch_module(name), args, path, names=entry.input_names, exporter=exporter)


def export(name: str, exporter: Exporter, directory: Path | None = None) -> Path:
    """Entry `name` exported by `exporter` ("legacy" or "dynamo"): the .onnx path, cached (see the
    module docstring); ExportFailed, with the exporter's message, when it cannot export it."""
    _entry(name)
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, not {exporter!r}")
    root = Path(directory) if directory is not None else default_export_dir()
    return cached_export(
        root / f"{name}-{exporter}-{recipe(__file__)}",
        f"{name}.onnx",
        lambda path: _export_to(name, exporter, path),
        keep_failure=True,
    )


# The entries the suite steps by default: every (exporter, operator, attribute form, rank) the
# whole catalogue's exports hold is in one of them, refusals included. Recomputed by
# `python tests/test_torch_layers.py --cover` (a greedy cover of the catalogue's survey).
CORE: tuple[str, ...] = (
    "adaptiveavg1d_1",
    "adaptiveavg1d_4",
    "adaptiveavg1d_5",
    "adaptiveavg2d_1",
    "adaptiveavg2d_3",
    "adaptiveavg3d_1",
    "adaptivemax1d_4",
    "adaptivemax2d_1",
    "addmm",
    "amax",
    "amin",
    "argmax_one_hot",
    "avgpool3d",
    "batchnorm1d_features",
    "batchnorm2d_after_relu",
    "batchnorm3d",
    "cdist",
    "celu",
    "channelshuffle",
    "chunk",
    "clamp_tensor_bounds",
    "conv1d_dilation2",
    "conv1d_groups2",
    "conv1d_replicate",
    "conv1d_same_dilation2",
    "conv1d_same_even_kernel",
    "conv1d_stride2_pad1",
    "conv2d_dilation2",
    "conv2d_groups2",
    "conv2d_reflect",
    "conv2d_same_even_kernel",
    "conv2d_stride2_pad1",
    "conv2d_weight_standardized",
    "conv3d",
    "convT1d_dilation2",
    "convT1d_groups2",
    "convT1d_k4s2p1",
    "convT1d_output_padding",
    "convT2d_dilation2",
    "convT2d_groups2_nobias",
    "convT2d_k4s2p1",
    "convT2d_s2p1_op1",
    "cosine_similarity",
    "cosine_similarity_param",
    "cumsum",
    "cumsum_image",
    "diagonal",
    "einsum_diagonal",
    "einsum_summed_index",
    "elu",
    "embedding",
    "embeddingbag_mean",
    "fold",
    "gather_sorted",
    "gelu",
    "gelu_tanh",
    "glu",
    "glu_channels",
    "grid_sample",
    "groupnorm2d",
    "gru_2layer_bidirectional",
    "hardshrink",
    "hardsigmoid",
    "hardswish",
    "index_put",
    "instancenorm2d_affine",
    "instancenorm3d_affine",
    "layernorm",
    "layernorm_2d_shape",
    "leakyrelu",
    "localresponsenorm1d",
    "localresponsenorm2d",
    "logsoftmax",
    "logsumexp",
    "lppool1d",
    "lppool2d",
    "lstm_proj",
    "math_acos",
    "math_acosh",
    "math_asin",
    "math_asinh",
    "math_atan2",
    "math_atanh",
    "math_cos",
    "math_erf",
    "math_exp",
    "math_exp2",
    "math_floor",
    "math_fmod",
    "math_lerp",
    "math_log1p",
    "math_logit",
    "math_reciprocal",
    "math_round",
    "math_rsqrt",
    "math_sign",
    "math_sin",
    "math_tan",
    "max_dim",
    "maxpool1d_dilation2_pad1",
    "maxpool1d_k3s2",
    "maxpool2d_dilation2",
    "maxpool2d_k2",
    "maxpool3d",
    "maxunpool2d",
    "mean_var_std",
    "mha_kdim_vdim",
    "mha_key_padding_mask",
    "mha_weights",
    "min_dim",
    "mish",
    "norm_p1",
    "normalize",
    "normalize_channels",
    "one_hot",
    "pad_channels",
    "pixelshuffle",
    "pixelunshuffle",
    "prelu",
    "prelu_channels",
    "prod",
    "relu",
    "repeat",
    "repeat_image",
    "repeat_interleave",
    "rmsnorm",
    "rmsnorm_2d_shape",
    "rmsnorm_eps",
    "rnn_tanh",
    "scatter",
    "scatter_add",
    "sdpa_bool_mask",
    "selu",
    "softmax_channels",
    "softmin",
    "softplus",
    "transformer_decoder_layer",
    "tril_triu",
    "unbind_stack",
    "upsample_linear_1d",
    "upsample_nearest_1d",
    "upsample_trilinear",
    "vector_norm_p3",
)
