"""Real PyTorch models exported to ONNX, and what PyTorch autograd says one SGD step does to them.

Tests use this to check planner's gradients against PyTorch itself on graphs made by
`torch.onnx.export`, with both exporters:

- `FAMILIES`: torchvision classifiers and two small transformer encoders, each at a small input
  size (odd and even sizes: padding, `ceil_mode` pooling and strided convs differ between them);
  text classifiers on `input_ids` and `attention_mask` (a token bag, and Hugging Face BERT, GPT-2
  and Llama from small configs) and a Conv1d sensor CNN; `sample_batch(family, n)` gives inputs
  (one array, or a tuple of one per input) and labels.
- `OPERATOR_FAMILIES`: small models that each put one kind of operator on the gradient path (ALBERT's
  shared weights, weight norm, 1-D pools, tanh-GELU, padding, transposed convolutions, GroupNorm,
  `torch.gather`), checked by tests/test_operator_families.py; every function here takes them too.
- `export(family, exporter)`: the ONNX file, cached per torch/torchvision version
  (`dynamic_length`: with a dynamic sequence length).
- `torch_module(family)`: the same eval-mode model with the same weights.
- `reference_update(family, onnx_path, x, y, lr, names)`: every named initializer after one plain
  SGD step on the mean cross-entropy, computed by PyTorch autograd (float64 by default) on the
  original architecture holding exactly the ONNX file's weights; `reference_logits` its forward.
- `parameter_map(family, onnx_path)`: which PyTorch tensor each initializer is.
- `update_error(before, after, expected)`: how far an update is from the expected one;
  `undecidable_kinks(family, onnx_path, x)`: the activation inputs float32 cannot place on a
  side of a ReLU's kink, for `reference_update(..., flip=kink)`.
- `pytorch_layer_names(family)`: the layer names a PyTorch user knows.

Weights are random, drawn from a seeded generator, never torchvision's defaults: the exporters
deduplicate equal initializers (dynamo shares one tensor, legacy adds Identity nodes) and the
dynamo one drops all-zero conv biases, so with default weights (BatchNorm at 1/0/0/1) several
layers would share, or lose, their parameters. Every parameter and BatchNorm statistic differs
here, so each ONNX initializer is exactly one PyTorch tensor.

The exporters rename what they rewrite: BatchNorm is folded into the conv before it (dynamo keeps
`conv1.weight` and names the new bias `conv1.weight_bias`, legacy writes `onnx::Conv_193`),
Linear weights multiplied from the right become transposed constants (`val_6`,
`onnx::MatMul_379`). So initializers are matched to the BatchNorm-folded PyTorch model by value
(up to float32 rounding, transposed or not), and a name that is a PyTorch name must agree.

torchvision from the registry is built against CUDA torch and its C ops do not load with CPU
torch; the classification models need none of them, so the two modules that register them are
stubbed before torchvision is imported (see `_torchvision_models`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import math
import os
import shutil
import sys
import tempfile
import types
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

# One thread: the float64 reference of depthwise convolutions runs PyTorch's slow path, thousands
# of per-group GEMMs, and with two OpenMP threads beside TVM's runtime threads it took 29 s for
# mobilenet_v2 at batch 2 where one thread takes 0.3 s.
torch.set_num_threads(1)

Exporter = Literal["dynamo", "legacy"]
EXPORTERS: tuple[Exporter, ...] = ("dynamo", "legacy")
NUM_CLASSES = 10
SEED = 20240611  # the base of every family's weights; change it and every export changes


# ---------------------------------------------------------------------------------- the families


@dataclass(frozen=True)
class Tokens:
    """Text input as Hugging Face models take it: `input_ids` [batch, length] drawn from a
    vocabulary of `vocab`, and `attention_mask` [batch, length], ones then zeros (padding)."""

    length: int
    vocab: int

    def draw(self, rng: np.random.Generator, batch: int) -> list[np.ndarray]:
        ids = rng.integers(0, self.vocab, (batch, self.length)).astype(np.int64)
        kept = rng.integers(self.length // 2, self.length + 1, batch)  # each sample's own length
        mask = (np.arange(self.length) < kept[:, None]).astype(np.int64)
        return [ids, mask]


@dataclass(frozen=True)
class Family:
    """One test model: how to build the architecture and what one input example looks like."""

    name: str
    input_shape: tuple[int, ...]  # one example, without the batch dimension (float input `x`)
    build: Callable[[], nn.Module]  # the architecture; its initial weights are all replaced
    num_classes: int = NUM_CLASSES  # the output's last size: classes, labels, regression targets
    tokens: Tokens | None = None  # text: `input_ids` and `attention_mask` instead of `x`
    task: str = "classification"  # what the output is trained for (`planner.tasks`): its targets and loss
    # inputs after `x` that a model computing its own loss takes its targets by: (name, shape, dtype);
    # an integer one is a class index below `num_classes`
    targets: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    # modules whose parameter the dynamo exporter folds into a value it stores (a position table
    # looked up at the fixed positions 0..L-1, weight norm's g * v / ||v||:
    # `planner.inputs.names.folded_values`): no layer there
    folded_by_dynamo: frozenset[str] = frozenset()

    @property
    def input_names(self) -> tuple[str, ...]:
        return (("x",) if self.tokens is None else ("input_ids", "attention_mask")) + tuple(t[0] for t in self.targets)

    def draw(self, rng: np.random.Generator, batch: int) -> list[np.ndarray]:
        """A batch of inputs, one array per input: standard normal floats (what BatchNorm was
        calibrated on), or token ids and masks."""
        if self.tokens is not None:
            return self.tokens.draw(rng, batch)
        targets = [
            rng.integers(0, self.num_classes, (batch, *shape)).astype(dtype)
            if dtype.startswith("int")
            else rng.standard_normal((batch, *shape)).astype(dtype)
            for _, shape, dtype in self.targets
        ]
        return [rng.standard_normal((batch, *self.input_shape)).astype(np.float32), *targets]


def torchvision() -> types.ModuleType:
    """torchvision, importable with CPU torch (see the module docstring)."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import torchvision

    return torchvision


def _torchvision_models() -> types.ModuleType:
    return torchvision().models


def _torchvision_version() -> str:
    _torchvision_models()
    import torchvision

    return torchvision.__version__


def _torchvision(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(_torchvision_models(), name)(num_classes=NUM_CLASSES)


def _vit() -> nn.Module:
    return _torchvision_models().VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=NUM_CLASSES
    )


class EncoderClassifier(nn.Module):
    """Sequence classifier on `nn.TransformerEncoder`: input [batch, 16, 8], logits [batch, 10].

    Linear(8->32) token embedding + a learned position table + 2 encoder layers (4 heads,
    feed-forward 64, no dropout) + mean over the sequence + Linear(32->10). `norm_first` picks
    pre-norm or post-norm layers: the LayerNorms sit on different sides of the residual adds.
    """

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.pos = nn.Parameter(torch.zeros(1, 16, 32))
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x) + self.pos).mean(dim=1))


def small_config(kind: str, **common):
    """A Hugging Face config of `kind` (bert, gpt2, llama) from small sizes: width 32, 2 layers of 2
    heads, feed-forward 64, 16 positions; `common` beside them (vocabulary, labels, padding id)."""
    _torchvision_models()  # transformers imports torchvision: its C-op registrations stubbed first
    import transformers

    if kind == "bert":
        return transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=16, **common
        )
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, **common)
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        **common,
    )


class SequenceClassifier(nn.Module):
    """A Hugging Face `*ForSequenceClassification` model built from a small config (random
    weights, nothing downloaded), called as exported models are: `(input_ids, attention_mask)`
    -> logits."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        _torchvision_models()  # transformers imports torchvision: its C-op registrations stubbed first
        import transformers

        common = dict(vocab_size=64, num_labels=NUM_CLASSES, pad_token_id=0)
        if kind == "albert":
            # three layers sharing one layer group: every layer reads the same weights. Exact GELU
            # (ALBERT's default is tanh-GELU, "gelu_new"), so the check is about the sharing alone:
            # tanh-GELU has a family of its own (gelu_decoder)
            config = transformers.AlbertConfig(
                embedding_size=16,
                hidden_size=32,
                num_hidden_layers=3,
                num_hidden_groups=1,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=16,
                hidden_act="gelu",
                classifier_dropout_prob=0.0,
                **common,
            )
            self.model = transformers.AlbertForSequenceClassification(config)
        else:
            kinds = {
                "bert": transformers.BertForSequenceClassification,
                "gpt2": transformers.GPT2ForSequenceClassification,
                "llama": transformers.LlamaForSequenceClassification,
            }
            self.model = kinds[kind](small_config(kind, **common))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class TokenClassifier(nn.Module):
    """Text classifier on token ids and an attention mask: input_ids, attention_mask [batch, 12],
    logits [batch, 10]. An embedding table (vocabulary 64, width 16), the mean of the unmasked
    tokens' embeddings, Linear(16->32), ReLU, Linear(32->10): the embedding-bag classifiers of
    keyboard and intent personalisation."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(dim=1) / mask.sum(dim=1)
        return self.fc2(torch.relu(self.fc1(pooled)))


class SensorCNN(nn.Module):
    """Activity recognition on IMU windows: input [batch, 6, 45] (six axes, an odd window),
    logits [batch, 10]. Three Conv1d-BatchNorm-ReLU blocks (kernel 5 padded 2; kernel 3, stride 2;
    a depthwise kernel 3), global average pooling, Linear(32->10)."""

    def __init__(self) -> None:
        super().__init__()

        def block(c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
            conv = nn.Conv1d(c_in, c_out, k, stride=stride, padding=k // 2, groups=groups)
            return nn.Sequential(conv, nn.BatchNorm1d(c_out), nn.ReLU())

        self.features = nn.Sequential(block(6, 16, 5), block(16, 32, 3, stride=2), block(32, 32, 3, groups=32))
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=2))


# ----------------------------------------------------------- the operator families (see OPERATOR_FAMILIES)


class TemporalConvNet(nn.Module):
    """A temporal convolutional network on [batch, 4, 45]: three residual blocks of a causal
    dilated Conv1d (kernel 3, dilation 1, 2, 4; 4 -> 8 -> 8 -> 8 channels) under
    `parametrizations.weight_norm` and a ReLU, then the mean over time and Linear(8->10).

    Causal two ways: block 0 and 2 pad on the left with `F.pad` (constant 0), block 1 pads both
    sides (`padding=`) and slices the end off (the "chomp" of the TCN paper). Block 0's residual
    is a 1x1 conv (4 -> 8 channels), the others' the identity."""

    def __init__(self) -> None:
        super().__init__()
        weight_norm = nn.utils.parametrizations.weight_norm
        self.dilations = (1, 2, 4)
        self.convs = nn.ModuleList(
            weight_norm(nn.Conv1d(4 if i == 0 else 8, 8, 3, dilation=d, padding=2 * d if i == 1 else 0))
            for i, d in enumerate(self.dilations)
        )
        self.relus = nn.ModuleList(nn.ReLU() for _ in self.dilations)
        self.downsample = nn.Conv1d(4, 8, 1)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv, relu, d) in enumerate(zip(self.convs, self.relus, self.dilations)):
            if i == 1:
                y = conv(x)[..., : -2 * d]  # padded both sides: the look-ahead sliced off
            else:
                y = conv(nn.functional.pad(x, (2 * d, 0)))
            x = relu(y) + (self.downsample(x) if i == 0 else x)
        return self.head(x.mean(dim=2))


class InceptionBlock1d(nn.Module):
    """Inception's four parallel branches on a sequence, concatenated: Conv1d kernel 1, 3 and 5
    (same length), and MaxPool1d(3, stride 1, padding 1) followed by a 1x1 Conv1d."""

    def __init__(self, c_in: int, width: int) -> None:
        super().__init__()
        self.branch1 = nn.Conv1d(c_in, width, 1)
        self.branch3 = nn.Conv1d(c_in, width, 3, padding=1)
        self.branch5 = nn.Conv1d(c_in, width, 5, padding=2)
        self.pool = nn.MaxPool1d(3, stride=1, padding=1)
        self.branch_pool = nn.Conv1d(c_in, width, 1)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = (self.branch1(x), self.branch3(x), self.branch5(x), self.branch_pool(self.pool(x)))
        return self.act(torch.cat(branches, dim=1))


class Inception1d(nn.Module):
    """An Inception-style 1-D net on [batch, 3, 37]: Conv1d(3->8, kernel 3)-BatchNorm-ReLU stem,
    an Inception block (4 x 4 channels), a strided MaxPool1d(3, stride 2), a second block
    (4 x 6), AvgPool1d(2, stride 2), the mean over time and Linear(24->10)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(3, 8, 3), nn.BatchNorm1d(8), nn.ReLU())
        self.block1 = InceptionBlock1d(8, 4)
        self.down = nn.MaxPool1d(3, stride=2)
        self.block2 = InceptionBlock1d(16, 6)
        self.avg = nn.AvgPool1d(2, stride=2)
        self.head = nn.Linear(24, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avg(self.block2(self.down(self.block1(self.stem(x)))))
        return self.head(x.mean(dim=2))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (`torch.triu` of -inf) and key padding from
    an attention mask; a packed q/k/v Linear and an output Linear."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.triu(torch.full((n, n), float("-inf"), dtype=x.dtype), diagonal=1)
        weights = torch.softmax(scores + causal + padding, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, d))


class DecoderBlock(nn.Module):
    """A pre-norm GPT block: LayerNorm, causal self-attention, LayerNorm, Linear-GELU(tanh)-Linear."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(approximate="tanh"), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), padding)
        return x + self.mlp(self.ln2(x))


class GeluDecoder(nn.Module):
    """A small causal transformer decoder on `input_ids`, `attention_mask` [batch, 11]: token
    embedding (vocabulary 64, width 24) plus a learned position table `pos`, two pre-norm blocks
    (2 heads, tanh-GELU MLP of 48), a final LayerNorm, and Linear(24->10) on each sample's last
    unpadded token (as GPT-2's classifier picks it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 24)
        self.pos = nn.Parameter(torch.zeros(1, 11, 24))
        self.blocks = nn.ModuleList(DecoderBlock(24, 2) for _ in range(2))
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, NUM_CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos
        padding = (1.0 - attention_mask.to(x.dtype))[:, None, None, :] * -1e4  # keys past each sample's end
        for block in self.blocks:
            x = block(x, padding)
        last = attention_mask.sum(dim=1) - 1
        return self.head(self.norm(x)[torch.arange(x.shape[0]), last])


class PadEncoder(nn.Module):
    """A Conv1d encoder on [batch, 2, 40] whose every convolution reads a padded input: `F.pad`
    reflect (2, 2) -> Conv1d(2->8, 5); `nn.ReflectionPad1d(1)` -> Conv1d(8->8, 3);
    `nn.ReplicationPad1d((2, 0))` -> Conv1d(8->12, 3, stride 2); `F.pad` constant 0.5 (1, 1) ->
    Conv1d(12->12, 3); SiLU after each; mean over time and Linear(12->10)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 8, 5)
        self.reflect = nn.ReflectionPad1d(1)
        self.conv2 = nn.Conv1d(8, 8, 3)
        self.replicate = nn.ReplicationPad1d((2, 0))
        self.conv3 = nn.Conv1d(8, 12, 3, stride=2)
        self.conv4 = nn.Conv1d(12, 12, 3)
        self.act = nn.SiLU()
        self.head = nn.Linear(12, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv1(nn.functional.pad(x, (2, 2), mode="reflect")))
        x = self.act(self.conv2(self.reflect(x)))
        x = self.act(self.conv3(self.replicate(x)))
        x = self.act(self.conv4(nn.functional.pad(x, (1, 1), value=0.5)))
        return self.head(x.mean(dim=2))


class ConvAutoencoder(nn.Module):
    """A conv autoencoder classifier on [batch, 3, 15, 15]: Conv2d stride-2 encoder (3 -> 8 ->
    16 channels, 15 -> 8 -> 4), a ConvTranspose2d decoder (stride 2, padding 1, output padding 1:
    4 -> 8; then grouped (2) and dilated (2), padding 2: 8 -> 16), the decoded map averaged over
    its rows into a sequence [batch, 8, 16], a ConvTranspose1d(8->6, kernel 4, stride 2, padding
    1: 16 -> 32), the mean and Linear(6->10). Every ConvTranspose is on the gradient path."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.enc2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.dec1 = nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1)
        self.dec2 = nn.ConvTranspose2d(8, 8, 3, stride=2, padding=2, output_padding=1, groups=2, dilation=2)
        self.up1d = nn.ConvTranspose1d(8, 6, 4, stride=2, padding=1)
        self.act = nn.Tanh()
        self.head = nn.Linear(6, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.enc2(self.act(self.enc1(x))))
        x = self.act(self.dec2(self.act(self.dec1(x))))
        x = self.act(self.up1d(x.mean(dim=2)))
        return self.head(x.mean(dim=2))


class GroupNormAudio(nn.Module):
    """An audio encoder on log-mel frames [batch, 1, 16, 21] (16 mels, 21 frames): Conv2d(1->8,
    3, padding 1)-GroupNorm(2 groups)-SiLU, Conv2d(8->16, 3, stride 2, padding 1)-GroupNorm(4)-
    GELU, the mean over mels, Conv1d(16->16, 3, padding 1)-InstanceNorm1d(affine)-SiLU, the mean
    over time and Linear(16->10)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(4, 16)
        self.conv3 = nn.Conv1d(16, 16, 3, padding=1)
        self.norm3 = nn.InstanceNorm1d(16, affine=True)
        self.silu = nn.SiLU()
        self.gelu = nn.GELU()
        self.head = nn.Linear(16, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.silu(self.norm1(self.conv1(x)))
        x = self.gelu(self.norm2(self.conv2(x))).mean(dim=2)
        x = self.silu(self.norm3(self.conv3(x)))
        return self.head(x.mean(dim=2))


class RelativePositionAttention(nn.Module):
    """Self-attention with a learned relative-position bias on [batch, 9, 8]: Linear(8->16)
    embedding, packed q/k/v Linear (2 heads of 8), scores plus `bias[h, j - i + 8]` (query i, key j) taken from
    the table `rel_bias` [1, 2, 1, 17] by `torch.gather` (ONNX GatherElements) with a constant
    relative-index matrix expanded over the batch, softmax, output Linear, residual, LayerNorm,
    the mean over the sequence and Linear(16->10)."""

    def __init__(self, length: int = 9, heads: int = 2, width: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Linear(8, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.rel_bias = nn.Parameter(torch.zeros(1, heads, 1, 2 * length - 1))  # stored as gathered: no reshape to fold
        index = torch.arange(length)[None, :] - torch.arange(length)[:, None] + length - 1  # [query, key]
        self.register_buffer("index", index, persistent=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        b, n, d = x.shape
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        table = self.rel_bias.expand(b, self.heads, n, self.rel_bias.shape[-1])
        bias = torch.gather(table, 3, self.index.expand(b, self.heads, n, n))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias, dim=-1)
        x = self.norm(x + self.proj((weights @ v).transpose(1, 2).reshape(b, n, d)))
        return self.head(x.mean(dim=1))


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("mobilenet_v2", (3, 33, 33), _torchvision("mobilenet_v2")),
        Family("mobilenet_v3_small", (3, 40, 40), _torchvision("mobilenet_v3_small")),
        Family("efficientnet_b0", (3, 35, 35), _torchvision("efficientnet_b0")),
        Family("mnasnet0_5", (3, 32, 32), _torchvision("mnasnet0_5")),
        Family("resnet18", (3, 32, 32), _torchvision("resnet18")),
        Family("regnet_x_400mf", (3, 33, 33), _torchvision("regnet_x_400mf")),
        Family("shufflenet_v2_x0_5", (3, 40, 40), _torchvision("shufflenet_v2_x0_5")),
        # odd: its MaxPools use ceil_mode=True, which at 35 (17 -> 8 -> 4 -> 2) keeps partial windows
        Family("squeezenet1_1", (3, 35, 35), _torchvision("squeezenet1_1")),
        Family("vit", (3, 32, 32), _vit),
        Family("encoder_prenorm", (16, 8), lambda: EncoderClassifier(norm_first=True)),
        Family("encoder_postnorm", (16, 8), lambda: EncoderClassifier(norm_first=False)),
        Family("token_bag", (12,), TokenClassifier, tokens=Tokens(length=12, vocab=64)),
        Family("sensor_cnn", (6, 45), SensorCNN),
        Family(
            "bert",
            (12,),
            lambda: SequenceClassifier("bert"),
            tokens=Tokens(length=12, vocab=64),
            folded_by_dynamo=frozenset({"model.bert.embeddings.position_embeddings"}),
        ),
        Family(
            "gpt2",
            (12,),
            lambda: SequenceClassifier("gpt2"),
            tokens=Tokens(length=12, vocab=64),
            folded_by_dynamo=frozenset({"model.transformer.wpe"}),
        ),
        Family("llama", (12,), lambda: SequenceClassifier("llama"), tokens=Tokens(length=12, vocab=64)),
    )
}


# Models made to put one kind of operator each on the gradient path, as PyTorch users write
# them (tests/test_operator_families.py): weights shared by several layers (ALBERT), weight norm
# and dilated causal convolutions, 1-D max and average pools, tanh-GELU, padding, transposed
# convolutions, GroupNorm and InstanceNorm, and a `torch.gather` of a parameter. Apart from
# FAMILIES: tests/test_pytorch_families.py measures and plans every one of those.
OPERATOR_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "albert",
            (12,),
            lambda: SequenceClassifier("albert"),
            tokens=Tokens(length=12, vocab=64),
            folded_by_dynamo=frozenset({"model.albert.embeddings.position_embeddings"}),
        ),
        Family(
            "tcn", (4, 45), TemporalConvNet, folded_by_dynamo=frozenset(f"convs.{i}.parametrizations.weight" for i in range(3))
        ),
        Family("inception1d", (3, 37), Inception1d),
        Family("gelu_decoder", (11,), GeluDecoder, tokens=Tokens(length=11, vocab=64)),
        Family("pad_encoder", (2, 40), PadEncoder),
        Family("conv_autoencoder", (3, 15, 15), ConvAutoencoder),
        Family("groupnorm_audio", (1, 16, 21), GroupNormAudio),
        Family("relpos_attention", (9, 8), RelativePositionAttention),
    )
}


class FcAutoencoder(nn.Module):
    """MLPerf Tiny's anomaly-detection autoencoder, narrowed: input [batch, 40] (log-mel frames),
    Linear 40 -> 32 -> 16 -> 4 (the bottleneck) -> 16 -> 32 -> 40, ReLU between; the output
    reconstructs the input."""

    def __init__(self) -> None:
        super().__init__()
        sizes = (40, 32, 16, 4, 16, 32, 40)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return x


class RegressionMLP(nn.Module):
    """Sensor calibration: input [batch, 7], Linear(7->16), Tanh, Linear(16->3): three float targets."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class MultilabelCNN(nn.Module):
    """Sound tagging: a spectrogram [batch, 1, 9, 11], Conv2d(1->6, 3, padding 1), ReLU,
    Conv2d(6->8, 3, stride 2), ReLU, the mean over the map, Linear(8->5): five tags at once."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


class BertTagger(nn.Module):
    """Hugging Face's `BertForTokenClassification` from a small config (random weights): token ids
    and an attention mask [batch, 12] -> logits [batch, 12, 10], a class per token."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.model = transformers.BertForTokenClassification(
            small_config("bert", vocab_size=64, num_labels=NUM_CLASSES, pad_token_id=0)
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class CausalLM(nn.Module):
    """A Hugging Face `*ForCausalLM` decoder from a small config (random weights): token ids and an
    attention mask [batch, 12] -> logits [batch, 12, 64] over the vocabulary, its LM head tied to
    the token embedding as GPT-2 and Llama ship it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        config = small_config(kind, vocab_size=64, pad_token_id=0, tie_word_embeddings=True)
        import transformers

        self.model = (transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM)(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class Detector(nn.Module):
    """A one-object detector that computes its own loss, as ORT training and ExecuTorch take one:
    an image [batch, 1, 10, 10], its box [batch, 4] and class [batch] (int64) in; a conv trunk,
    a box head and a class head; out the scalar loss, smooth-L1 of the box plus cross-entropy of
    the class (and, second, the class logits, which planner does not train)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.box = nn.Linear(8, 4)
        self.cls = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean(dim=(2, 3))
        logits = self.cls(h)
        d = self.box(h) - boxes  # smooth L1, written out: the legacy exporter has no smooth_l1_loss
        box = torch.where(d.abs() < 1.0, 0.5 * d * d, d.abs() - 0.5).mean()
        loss = box + nn.functional.cross_entropy(logits, labels)
        return loss, logits


# Models whose output is not a classifier's (tests/test_tasks.py): each trained for its task, its
# loss and gradient checked against PyTorch's on the same weights and targets.
TASK_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("fc_autoencoder", (40,), FcAutoencoder, num_classes=40, task="reconstruction"),
        Family("regression_mlp", (7,), RegressionMLP, num_classes=3, task="regression"),
        Family("multilabel_cnn", (1, 9, 11), MultilabelCNN, num_classes=5, task="multilabel"),
        Family(
            "bert_tagger",
            (12,),
            BertTagger,
            tokens=Tokens(length=12, vocab=64),
            task="token-classification",
            folded_by_dynamo=frozenset({"model.bert.embeddings.position_embeddings"}),
        ),
        Family(
            "gpt2_lm",
            (12,),
            lambda: CausalLM("gpt2"),
            num_classes=64,
            tokens=Tokens(length=12, vocab=64),
            task="causal-lm",
            folded_by_dynamo=frozenset({"model.transformer.wpe"}),
        ),
        Family(
            "llama_lm", (12,), lambda: CausalLM("llama"), num_classes=64, tokens=Tokens(length=12, vocab=64), task="causal-lm"
        ),
        Family(
            "detector",
            (1, 10, 10),
            Detector,
            num_classes=3,
            task="loss-in-model",
            targets=(("boxes", (4,), "float32"), ("labels", (), "int64")),
        ),
    )
}


def _family(name: str) -> Family:
    try:
        return FAMILIES.get(name) or OPERATOR_FAMILIES.get(name) or TASK_FAMILIES[name]
    except KeyError:
        known = ", ".join([*FAMILIES, *OPERATOR_FAMILIES, *TASK_FAMILIES])
        raise KeyError(f"unknown model family {name!r}; known: {known}") from None


def _rng(family: str, purpose: str) -> np.random.Generator:
    """A generator for one use of one family: numpy's PCG64 draws the same numbers everywhere."""
    return np.random.default_rng([SEED, zlib.crc32(family.encode()), zlib.crc32(purpose.encode())])


def sample_batch(family: str, batch: int, seed: int = 0) -> tuple[np.ndarray | tuple[np.ndarray, ...], np.ndarray]:
    """A random input batch (`Family.draw`: one array, or a tuple of one per input) and random
    targets for `family`'s task: class indices (int64), 0/1 rows, standard normal floats, the
    input itself (reconstruction), a class per token with -100 at padding and at a few tokens."""
    fam = _family(family)
    rng = np.random.default_rng([seed, zlib.crc32(family.encode())])
    xs = fam.draw(rng, batch)
    x = xs[0] if len(xs) == 1 else tuple(xs)
    C = fam.num_classes
    match fam.task:
        case "classification":
            y = rng.integers(0, C, batch).astype(np.int64)
        case "multilabel":
            y = rng.integers(0, 2, (batch, C)).astype(np.float32)
        case "regression":
            y = rng.standard_normal((batch, C)).astype(np.float32)
        case "reconstruction":
            y = xs[0].astype(np.float32)
        case "token-classification":
            y = rng.integers(0, C, (batch, xs[0].shape[1])).astype(np.int64)
            y[(xs[1] == 0) | (rng.random(y.shape) < 0.1)] = -100
        case "loss-in-model":  # the targets are inputs: the step's own is unused
            y = np.zeros(batch, np.float32)
        case "causal-lm":  # each token's target the next one; none after the last, nor in the padding
            y = np.full(xs[0].shape, -100, np.int64)
            y[:, :-1] = xs[0][:, 1:]
            y[xs[1] == 0] = -100
    return x, y


def task_loss(task: str, outputs: torch.Tensor, y: np.ndarray) -> torch.Tensor:
    """PyTorch's own loss of `task` (mean over the batch, as planner's): the reference."""
    target = torch.as_tensor(np.asarray(y))
    match task:
        case "loss-in-model":  # the model's first output
            return outputs[0] if isinstance(outputs, tuple) else outputs
        case "classification":
            return nn.functional.cross_entropy(outputs, target.to(torch.int64))
        case "multilabel":
            return nn.functional.binary_cross_entropy_with_logits(outputs, target.to(outputs.dtype))
        case "regression" | "reconstruction":
            return nn.functional.mse_loss(outputs, target.to(outputs.dtype))
        case "token-classification" | "causal-lm":
            return nn.functional.cross_entropy(outputs.flatten(0, 1), target.flatten().to(torch.int64), ignore_index=-100)
    raise ValueError(task)


def _tensors(x: np.ndarray | tuple[np.ndarray, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """A batch as PyTorch's model takes it: floats in `dtype`, integer inputs as they are."""
    arrays = [x] if isinstance(x, np.ndarray) else list(x)
    return [torch.as_tensor(a, dtype=dtype) if a.dtype.kind == "f" else torch.as_tensor(a) for a in arrays]


# ------------------------------------------------------------------------------------ the weights


def _draw(module: nn.Module, name: str, shape: torch.Size, rng: np.random.Generator) -> np.ndarray:
    """Values for one parameter, in ranges that keep activations O(1) through the whole network.

    Conv and Linear weights are He/LeCun normal (gain sqrt(2) before ReLU-like convs, 1 for
    Linear; a transposed conv's fan-in is its input channels per group times the kernel taps
    per stride; weight norm's direction v as the conv's weight, its magnitude g sqrt(2) times
    uniform [0.7, 1.3]); norm scales uniform in [0.7, 1.3] (not 1: a scale of ones would be deduplicated);
    biases N(0, 0.1) (never zero: the dynamo exporter drops zero conv biases); standalone tensors
    (class token, position tables) N(0, 0.5).

    BatchNorm shifts are N(0.5, 0.1), not centred: with BatchNorm outputs ~N(0, 1) half of all
    ReLU inputs sit near the kink, the random network is chaotic (float32 rounding grows ~200x
    through regnet_x_400mf) and a few ReLUs switch sides between float32 and float64, which
    moves whole gradients by up to 1e-2. Shifted, most ReLUs are on and float32 and float64
    gradients agree to ~1e-5 (median ~3e-6, batches of 4). A ReLU still lands within rounding of
    its kink now and then (about one batch in ten for the deepest ReLU nets, mobilenet_v2,
    mnasnet0_5, regnet_x_400mf: then ~1e-2), which is why `reference_update` also does float32.
    """
    size = tuple(shape)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and name == "bias":
        return rng.normal(0.5, 0.1, size)
    if name.endswith("bias"):
        return rng.normal(0.0, 0.1, size)
    if isinstance(module, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)) or type(module).__name__.endswith(
        "RMSNorm"
    ):
        return rng.uniform(0.7, 1.3, size)
    if type(module).__name__ == "Conv1D" and len(size) == 2:  # transformers' GPT-2 Linear, stored [in, out]
        return rng.normal(0.0, 1.0 / math.sqrt(size[0]), size)
    if isinstance(module, nn.utils.parametrize.ParametrizationList) and name in ("original0", "original1"):
        # weight norm's magnitude g [out, 1, ...] (original0) and direction v (original1) of a
        # conv's weight, g * v / ||v||: v as the weight would be, g near the norm He gives a row
        # (sqrt(2)), each different
        if name == "original0":
            return math.sqrt(2.0) * rng.uniform(0.7, 1.3, size)
        return rng.normal(0.0, math.sqrt(2.0 / math.prod(size[1:])), size)
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and name == "weight":
        # [in, out / groups, *kernel]: each output sums in / groups channels over kernel / stride taps
        taps = math.prod(size[2:]) / math.prod(module.stride)
        return rng.normal(0.0, math.sqrt(2.0 / (size[0] // module.groups * taps)), size)
    if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear, nn.MultiheadAttention)) and len(size) >= 2:
        fan_in = math.prod(size[1:])
        gain = math.sqrt(2.0) if isinstance(module, nn.modules.conv._ConvNd) else 1.0
        return rng.normal(0.0, gain / math.sqrt(fan_in), size)
    return rng.normal(0.0, 0.5, size)


def _calibrate_batchnorm(model: nn.Module, fam: Family, rng: np.random.Generator) -> None:
    """Set every BatchNorm's running statistics to those of its actual input on random inputs.

    Random running statistics (rather than measured ones) compound through 20-50 BatchNorms:
    logits blow up or collapse. Measured ones make each BatchNorm normalize for real, so every
    layer sees O(1) activations and a gradient worth checking. The batch is large (256) because
    the last stages see only 1-4 positions per image: statistics of 16 images fit those images
    and not others (efficientnet_b0's logits then have std ~7 on new inputs, ~1 with 256).
    Float32, as the model (float64 is several times slower): the statistics came out
    bit-identical with 1 and 2 threads.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, exactly that batch's statistics
        m.train()  # only the norms: dropout and stochastic depth stay off
    with torch.no_grad():
        model(*map(torch.from_numpy, fam.draw(rng, 256)))
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
        m.eval()


def _normalize_head(model: nn.Module, fam: Family, rng: np.random.Generator) -> None:
    """Scale the classifier (the last module owning a weight) so logits have std 1 on random
    inputs: softmax neither saturated nor flat, every sample's gradient counts. Without it the
    std ranges 0.2 (mobilenet_v3_small) to 5 (regnet_x_400mf, whose residual stream grows)."""
    if fam.task == "loss-in-model":  # its output is a loss, not logits to scale
        return
    head = [m for m in model.modules() if isinstance(getattr(m, "weight", None), nn.Parameter)][-1]
    with torch.no_grad():
        scale = 1.0 / float(model(*map(torch.from_numpy, fam.draw(rng, 32))).std())
        for param in head.parameters(recurse=False):
            param.mul_(scale)


@functools.cache
def _seeded_module(family: str) -> nn.Module:
    fam = _family(family)
    rng = _rng(family, "weights")
    with torch.random.fork_rng(devices=[]):  # the default init draws from torch's global generator
        model = fam.build().eval()
    with torch.no_grad():
        for _, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                param.copy_(torch.from_numpy(_draw(module, name, param.shape, rng)))
    _calibrate_batchnorm(model, fam, rng)
    _normalize_head(model, fam, rng)
    return model


def torch_module(family: str) -> nn.Module:
    """The eval-mode PyTorch model that `export(family, ...)` exports, with the same weights.

    Deterministic: the same weights in every call and every process on a machine (the
    BatchNorm statistics are measured in float32, see `_calibrate_batchnorm`). A fresh copy
    each call: change it freely.
    """
    return copy.deepcopy(_seeded_module(family))


@functools.cache
def _folded_module(family: str) -> tuple[nn.Module, frozenset[str]]:
    """`torch_module(family)` in float64 with each BatchNorm folded into the conv before it, as
    both exporters do in eval mode, and the module paths of the folded BatchNorms.

    The fold changes what the parameters are (a conv gains a bias; BN's scale and statistics
    disappear into the conv's weight and bias), so gradients must be taken on the folded model
    to be comparable with those of the ONNX graph.
    """
    model = torch_module(family).double()
    norms = {p for p, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if not norms:
        return model, frozenset()
    from torch.fx.experimental.optimization import fuse

    folded = fuse(model)
    for param in folded.parameters():
        param.requires_grad_(True)  # the fold makes the new conv biases from buffers: no grad
    left = {p for p, m in folded.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    return folded, frozenset(norms - left)


def pytorch_layer_names(family: str, exporter: Exporter = "legacy") -> set[str]:
    """What a PyTorch user calls the trainable layers of `family` as `exporter` writes it.

    The paths of the torch.nn modules that own parameters directly (`layer1.0.conv1`,
    `encoder.layers.0.self_attn` for its packed input projection, `...self_attn.out_proj`), and
    the full names of parameters that user-written modules own directly (`class_token`,
    `encoder.pos_embedding`, `pos`): those are layers on their own. So are the tensors of a
    parametrization (weight norm's magnitude and direction, `convs.0.parametrizations.weight.
    original0` and `original1`): the graph computes the module's weight from them with ops of
    their own (legacy: ReduceL2, Div, Mul), and the module itself keeps its bias. A BatchNorm folded into its
    conv is not a layer of the exported graph; the conv is. transformers' `Conv1D` (GPT-2's Linear,
    its weight stored [in, out]) is a layer as a Linear is. The dynamo exporter's folded modules
    (`Family.folded_by_dynamo`) are none in its exports.
    """
    model = _seeded_module(family)
    _, folded = _folded_module(family)
    names: set[str] = set()
    for path, module in model.named_modules():
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if not own or path in folded or (exporter == "dynamo" and path in _family(family).folded_by_dynamo):
            continue
        parametrization = isinstance(module, nn.utils.parametrize.ParametrizationList)
        if (type(module).__module__.startswith("torch.nn.") and not parametrization) or type(module).__name__ == "Conv1D":
            names.add(path)
        else:
            names.update(f"{path}.{name}" if path else name for name in own)
    return names


def tied_modules(family: str) -> dict[str, str]:
    """Each module path of `family` that shares a parameter tensor with an earlier module (a
    decoder's LM head tied to its token embedding) -> that earlier module's path: one layer in
    planner, which an exporter names after either module (legacy: the embedding; dynamo: the head)."""
    owner: dict[int, str] = {}
    tied: dict[str, str] = {}
    for path, module in _seeded_module(family).named_modules():
        for _, param in module.named_parameters(recurse=False):
            first = owner.setdefault(id(param), path)
            if first != path:
                tied[path] = first
    return tied


# ------------------------------------------------------------------------------------- exporting


def _default_cache_dir() -> Path:
    """`$PLANNER_CACHE_DIR`, else `~/.cache/planner` (as planner's compile cache)."""
    env = os.environ.get("PLANNER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "planner"


def default_export_dir() -> Path:
    """Where `export` caches files: one folder per torch and torchvision version, under
    `$PLANNER_TORCH_EXPORTS` (`.ci/run` keeps it between runs: the dynamo exporter takes 10-40 s
    a model, and an export changes only with torch, this file or the ONNX packages), else in the
    compile cache's folder."""
    env = os.environ.get("PLANNER_TORCH_EXPORTS")
    root = Path(env) if env else _default_cache_dir() / "torch-exports"
    return root / f"torch-{torch.__version__}-tv-{_torchvision_version()}"


class ExportFailed(Exception):
    """The exporter refused the model (cached: the message of its first failure)."""


@functools.cache
def recipe(source: str) -> str:
    """A digest of everything else an export depends on: the module `source` that builds the
    models (sizes, weights) and the ONNX packages the dynamo exporter writes and optimizes with."""
    digest = hashlib.sha256(Path(source).read_bytes())
    for package in ("onnx", "onnxscript", "onnx-ir"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            digest.update(f"{package}={importlib.metadata.version(package)}".encode())
    return digest.hexdigest()[:10]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Swallow the exporters' progress lines, warnings and C++ messages (file descriptors 1 and
    2 included); if the block raises, their tail is attached to the exception."""
    with tempfile.TemporaryFile(mode="w+") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        except BaseException as exc:
            log.flush()
            log.seek(0)
            exc.add_note("exporter output (tail):\n" + log.read()[-4000:])
            raise
        finally:
            log.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def torch_export(
    model: nn.Module,
    args: tuple,
    path: Path,
    *,
    names: Sequence[str],
    exporter: Exporter,
    opset: int | None = None,
    max_length: int | None = None,
    outputs: Sequence[str] = ("logits",),
) -> None:
    """`model` on `args` (inputs `names`, output `logits`) written to `path` by `exporter`, the batch
    dynamic (and with `max_length`, axis 1 too: a sequence up to that long); dynamo's weights in
    `<path>.data` beside it."""
    batch = torch.export.Dim("batch")
    dims = {0: batch} if max_length is None else {0: batch, 1: torch.export.Dim("sequence", max=max_length)}
    axes = {0: "batch"} if max_length is None else {0: "batch", 1: "sequence"}
    common = dict(input_names=list(names), output_names=list(outputs), opset_version=opset)
    with quiet():
        if exporter == "dynamo":
            torch.onnx.export(
                model,
                args,
                str(path),
                dynamo=True,
                dynamic_shapes=tuple(dims for _ in names),
                external_data=True,
                verbose=False,
                **common,
            )
        else:
            torch.onnx.export(
                model,
                args,
                str(path),
                dynamo=False,
                dynamic_axes={**{n: axes for n in names}, **{o: {0: "batch"} for o in outputs if o != "loss"}},
                **common,
            )


def cached_export(entry: Path, filename: str, write: Callable[[Path], None], *, keep_failure: bool = False) -> Path:
    """`entry/filename`, made by `write(path)` unless it is there. Written to a temporary folder
    first and renamed into place as a whole, so a concurrent reader (another test worker) sees
    the complete files or nothing; if two workers export at once, the first rename wins and the
    other's copy is discarded. `keep_failure`: an exporter's refusal is cached too, and raised as
    `ExportFailed` with its message (here and on every later call)."""
    path, failed = entry / filename, entry / "export-failed.txt"
    if path.exists():
        return path
    if failed.exists():
        raise ExportFailed(failed.read_text())
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        try:
            write(staging / filename)
        except Exception as exc:  # the exporters raise assorted types; the first line says why
            if not keep_failure:
                raise
            for leftover in staging.iterdir():
                leftover.unlink()
            (staging / failed.name).write_text(_why(exc))
        try:
            staging.rename(entry)
        except OSError:
            if not entry.exists():  # not "another worker was first"
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached_export(entry, filename, write, keep_failure=keep_failure)


def _why(exc: Exception) -> str:
    """An exporter's failure in a line: the dynamo exporter's own summary names the exception inside."""
    text = str(exc)
    lines = [line.strip() for line in text.split("## Exception summary", 1)[-1].splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:1000]


def _export_to(family: str, exporter: Exporter, path: Path, opset: int | None, dynamic_length: bool) -> None:
    args = tuple(_tensors(sample_batch(family, 2, seed=1)[0], torch.float32))  # batch 2: a batch of 1 would be specialized
    length = _family(family).input_shape[0] if dynamic_length else None
    fam = _family(family)
    outputs = ("loss", "logits") if fam.task == "loss-in-model" else ("logits",)
    torch_export(
        torch_module(family),
        args,
        path,
        names=fam.input_names,
        exporter=exporter,
        opset=opset,
        max_length=length,
        outputs=outputs,
    )


def export(
    family: str, exporter: Exporter, directory: Path | None = None, opset: int | None = None, dynamic_length: bool = False
) -> Path:
    """`torch_module(family)` exported to ONNX: input `x` (or `input_ids`, `attention_mask`),
    output `logits`, dynamic batch (and, `dynamic_length`, a dynamic sequence length `sequence`), the
    exporter's default opset unless `opset` says another. Returns the .onnx path (dynamo: its weights in `<name>.onnx.data`
    beside it).

    Cached in `directory` (default: `default_export_dir()`) under `<family>-<exporter>-<recipe>/`,
    the recipe a digest of this file and the ONNX packages' versions, so an edit here never reads
    a stale export (see `cached_export`).
    """
    _family(family)
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, not {exporter!r}")
    root = Path(directory) if directory is not None else default_export_dir()
    variant = f"{'' if opset is None else f'-opset{opset}'}{'-dynlen' if dynamic_length else ''}"
    return cached_export(
        root / f"{family}-{exporter}{variant}-{recipe(__file__)}",
        f"{family}.onnx",
        lambda path: _export_to(family, exporter, path, opset, dynamic_length),
    )


# ------------------------------------------------------------------------ initializer <-> tensor


@dataclass(frozen=True)
class TorchTensor:
    """Which tensor of the BatchNorm-folded PyTorch model an ONNX initializer holds."""

    name: str  # parameter name in the folded model, e.g. "layer1.0.conv1.bias" (the folded bias)
    transposed: bool  # the initializer is the 2-D transpose of the parameter (Linear as MatMul)

    def to_onnx(self, value: np.ndarray, onnx_shape: tuple[int, ...]) -> np.ndarray:
        """A value of the PyTorch tensor, laid out as the initializer."""
        if self.transposed:
            value = value.reshape(_squeezed(value.shape)).T
        return value.reshape(onnx_shape)

    def to_torch(self, value: np.ndarray, torch_shape: tuple[int, ...]) -> np.ndarray:
        """A value of the initializer, laid out as the PyTorch tensor."""
        if self.transposed:
            value = value.reshape(_squeezed(value.shape)).T
        return value.reshape(torch_shape)


_MATCH_RTOL = 1e-4  # of the tensor's largest magnitude: float32 rounding of the exporters' folding


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    scale = max(float(np.max(np.abs(b))), 1e-30)
    return float(np.max(np.abs(a - b))) <= _MATCH_RTOL * scale


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _layouts(onnx_shape: tuple[int, ...], torch_shape: tuple[int, ...]) -> list[bool]:
    """The ways (transposed or not) an initializer of `onnx_shape` can hold a tensor of
    `torch_shape`; size-1 dimensions do not count (a [1,1,64] token may become [64])."""
    o, t = _squeezed(onnx_shape), _squeezed(torch_shape)
    if math.prod(onnx_shape) != math.prod(torch_shape):
        return []
    out = [False] if o == t else []
    if len(t) == 2 and o == t[::-1]:
        out.append(True)
    return out


def _float_initializers(onnx_path: Path) -> dict[str, np.ndarray]:
    """The ONNX file's float initializers (external data included), in float64."""
    model = onnx.load(str(onnx_path))
    out = {}
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        if value.dtype.kind == "f":
            out[init.name] = value.astype(np.float64)
    return out


def _expected_name(onnx_name: str, torch_names: set[str]) -> str | None:
    """The PyTorch tensor an initializer's name claims to be, if it names one (dynamo: the
    parameter's own name; `X.weight_bias` for the bias a BatchNorm fold gave conv X)."""
    if onnx_name in torch_names:
        return onnx_name
    if onnx_name.endswith(".weight_bias") and (name := onnx_name.removesuffix("weight_bias") + "bias") in torch_names:
        return name
    return None


def _match_all(inits: dict[str, np.ndarray], folded: nn.Module) -> tuple[dict[str, list[TorchTensor]], dict[str, str]]:
    """Every float initializer's candidate tensors (all layouts whose values agree), and the
    reason an initializer is wrongly matched where its name says another tensor."""
    params = {n: p.detach().numpy() for n, p in folded.named_parameters()}
    candidates: dict[str, list[TorchTensor]] = {}
    problems: dict[str, str] = {}
    for onnx_name, value in inits.items():
        found = []
        for torch_name, tensor in params.items():
            for transposed in _layouts(value.shape, tensor.shape):
                ref = TorchTensor(torch_name, transposed)
                if _close(value, ref.to_onnx(tensor, value.shape)):
                    found.append(ref)
        candidates[onnx_name] = found
        claimed = _expected_name(onnx_name, set(params))
        if claimed is not None and [r.name for r in found] != [claimed]:
            problems[onnx_name] = (
                f"its name says PyTorch tensor {claimed!r} but its values match {[r.name for r in found] or 'nothing'}"
            )
    return candidates, problems


def parameter_map(family: str, onnx_path: Path, names: Iterable[str] | None = None) -> dict[str, TorchTensor]:
    """Which tensor of the BatchNorm-folded PyTorch model each named initializer holds.

    `names` defaults to the trainable ones: every float initializer with more than one element.
    Raises ValueError, saying which and why, unless each name is exactly one PyTorch tensor and
    no other named initializer is that tensor too (the two copies would be trained apart). A copy
    not named — one the dynamo exporter wrote per use, which planner reads as the first — holds
    the same values; the reference's gradient of the tensor sums every use, as a tied copy's does.
    """
    return _parameter_map(family, Path(onnx_path), _float_initializers(Path(onnx_path)), names)[0]


def _parameter_map(
    family: str, onnx_path: Path, inits: dict[str, np.ndarray], names: Iterable[str] | None
) -> tuple[dict[str, TorchTensor], dict[str, list[TorchTensor]]]:
    folded, _ = _folded_module(family)
    candidates, problems = _match_all(inits, folded)
    wanted = list(names) if names is not None else [n for n, v in inits.items() if v.size > 1]
    owners: dict[str, list[str]] = {}
    for onnx_name, refs in candidates.items():
        for ref in refs:
            owners.setdefault(ref.name, []).append(onnx_name)
    shapes = {n: tuple(p.shape) for n, p in folded.named_parameters()}
    errors, mapping = [], {}
    for name in wanted:
        if name not in inits:
            errors.append(f"{name!r}: no float initializer of that name")
            continue
        refs = candidates[name]
        if name in problems:
            errors.append(f"{name!r}: {problems[name]}")
        elif len(refs) != 1:
            same = [n for n, s in shapes.items() if math.prod(s) == inits[name].size]
            errors.append(
                f"{name!r} {list(inits[name].shape)}: its values match {len(refs)} PyTorch tensors "
                f"{[r.name for r in refs]} (same size: {same})"
            )
        elif len(others := [o for o in owners[refs[0].name] if o != name and o in wanted]) > 0:
            # another copy the caller also trains: the two would move apart (a copy the caller
            # does not name holds the same values, and the tensor's gradient sums every use)
            errors.append(f"{name!r}: PyTorch tensor {refs[0].name!r} is also in {others}")
        else:
            mapping[name] = refs[0]
    if errors:
        more = [f"... and {len(errors) - 20} more"] if len(errors) > 20 else []
        raise ValueError(
            f"{family}: cannot map initializers of {onnx_path} to the BatchNorm-folded PyTorch model "
            f"(is the file an unmodified export of {family!r}?):\n  " + "\n  ".join(errors[:20] + more)
        )
    return mapping, candidates


# ----------------------------------------------------------------------------- the reference step


def _with_onnx_weights(
    family: str, onnx_path: Path, names: Iterable[str] | None, dtype: torch.dtype, overrides: dict[str, np.ndarray] | None = None
) -> tuple[nn.Module, dict[str, TorchTensor], dict[str, np.ndarray]]:
    """A fresh BatchNorm-folded model of `family` in `dtype` holding exactly the weights of
    `onnx_path` (those in `overrides` replaced, after they were matched to PyTorch tensors by
    the file's values), the map of `names` (see `parameter_map`), and the float initializers."""
    onnx_path = Path(onnx_path)
    inits = _float_initializers(onnx_path)
    mapping, candidates = _parameter_map(family, onnx_path, inits, names)
    inits = {**inits, **(overrides or {})}
    model = copy.deepcopy(_folded_module(family)[0])
    params = dict(model.named_parameters())
    covered: set[str] = set()
    with torch.no_grad():
        for onnx_name, refs in candidates.items():
            for ref in refs:
                param = params[ref.name]
                param.copy_(torch.from_numpy(ref.to_torch(inits[onnx_name], tuple(param.shape))))
                covered.add(ref.name)
    # a folded module's parameter is in no initializer: the value the exporter stored is computed from it
    folded = {f"{m}.{n}" for m in _family(family).folded_by_dynamo for n, _ in model.get_submodule(m).named_parameters()}
    missing = [n for n, p in params.items() if n not in covered | folded and bool(torch.any(p != 0))]
    if missing:
        raise ValueError(f"{family}: PyTorch tensors in no initializer of {onnx_path}: {missing}")
    return model.to(dtype), mapping, inits


def reference_logits(
    family: str, onnx_path: Path, x: np.ndarray | tuple[np.ndarray, ...], *, dtype: torch.dtype = torch.float64
) -> np.ndarray:
    """The logits PyTorch computes for `x` with exactly the weights of `onnx_path` (the model
    `reference_update` differentiates), in `dtype`."""
    model, _, _ = _with_onnx_weights(family, onnx_path, (), dtype)
    with torch.no_grad():
        return model(*_tensors(x, dtype)).numpy()


def reference_update(
    family: str,
    onnx_path: Path,
    x: np.ndarray | tuple[np.ndarray, ...],
    y: np.ndarray,
    lr: float,
    names: Iterable[str],
    *,
    dtype: torch.dtype = torch.float64,
    overrides: dict[str, np.ndarray] | None = None,
    flip: Kink | None = None,
) -> dict[str, np.ndarray]:
    """Each named initializer of `onnx_path` after ONE plain SGD step, `w <- w - lr * dL/dw`,
    `L` the family's task's mean loss (`task_loss`: cross-entropy of the logits for int labels
    `y`, for a classifier) for inputs `x` and targets `y`; initializers
    in `overrides` hold the values given there instead of the file's; `flip` puts one
    activation input on the other side of its kink (see `undecidable_kinks`).

    Computed by PyTorch autograd in `dtype` (float64 by default: the reference; float32 shows
    how much of a difference is float32 noise) on the original PyTorch architecture, BatchNorm
    folded into the convs as the exporters do, with every parameter set to the ONNX file's
    value (read with onnx.load, external data included): a weight the exporter rounded (the
    folded ones) is the weight used. Returned in the initializers' layouts (transposed Linear
    weights stay transposed), as `dtype` arrays.

    Raises ValueError if a name is not exactly one PyTorch tensor (see `parameter_map`), or if
    a PyTorch tensor (other than an all-zero bias the dynamo exporter drops) is in no
    initializer: the reference would not be computing with the file's weights.
    """
    model, mapping, inits = _with_onnx_weights(family, onnx_path, list(names), dtype, overrides)
    if flip is not None:
        _flip_at(model, flip)
    loss = task_loss(_family(family).task, model(*_tensors(x, dtype)), y)
    loss.backward()
    params = dict(model.named_parameters())
    out = {}
    for name, ref in mapping.items():
        param = params[ref.name]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        out[name] = ref.to_onnx((param.detach() - lr * grad).numpy(), inits[name].shape)
    return out


# Piecewise activations and the inputs where their derivative jumps.
_KINKS: dict[type[nn.Module], tuple[float, ...]] = {
    nn.ReLU: (0.0,),
    nn.ReLU6: (0.0, 6.0),
    nn.Hardswish: (-3.0, 3.0),
    nn.Hardsigmoid: (-3.0, 3.0),
}


@dataclass(frozen=True)
class Kink:
    """One input of a piecewise activation (the `call`-th call of module `module`, element
    `index`) that lies `closeness` float32 errors from the kink `at`."""

    module: str
    call: int
    index: tuple[int, ...]
    at: float
    closeness: float


def _activation_inputs(model: nn.Module, x: list[torch.Tensor]) -> dict[tuple[str, int], torch.Tensor]:
    """Every piecewise activation's input, by (module name, call): ResNet calls one ReLU twice."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module) in _KINKS:

            def record(module, args, name=name):
                calls = sum(1 for key in seen if key[0] == name)
                seen[(name, calls)] = args[0].detach().clone().to(torch.float64)

            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        model(*x)
    for hook in hooks:
        hook.remove()
    return seen


def undecidable_kinks(family: str, onnx_path: Path, x: np.ndarray | tuple[np.ndarray, ...], factor: float = 10.0) -> list[Kink]:
    """The activation inputs that float32 cannot place on a side of their kink: those within
    `factor` times float32's worst error at that activation (PyTorch's float32 forward against
    its float64 one on the same weights and batch) of a kink, the closest first.

    Why: a ReLU whose input is 8.5e-7 in float64 is computed as -1e-7 by a float32 sum in
    another order (OpenBLAS's AVX-512 kernels on MobileNetV2's 1×1 convolutions), and then the
    step is the float64 step with that one mask flipped: 2.4e-4 off float64 autograd, 2.9e-6 off
    the flipped reference. The flip is float32's limit, not a wrong gradient."""
    inputs = {}
    for dtype in (torch.float64, torch.float32):
        model, _, _ = _with_onnx_weights(family, onnx_path, (), dtype)
        inputs[dtype] = (model, _activation_inputs(model, _tensors(x, dtype)))
    model, exact = inputs[torch.float64]
    modules = dict(model.named_modules())
    found = []
    for (name, call), a64 in exact.items():
        error = float((inputs[torch.float32][1][(name, call)] - a64).abs().max())
        for at in _KINKS[type(modules[name])]:
            distance = (a64 - at).abs()
            for index in (distance < factor * error).nonzero().tolist():
                found.append(Kink(name, call, tuple(index), at, float(distance[tuple(index)]) / error))
    return sorted(found, key=lambda k: k.closeness)


def _flip_at(model: nn.Module, kink: Kink) -> None:
    """Reflect the kink's input across its kink in `model`'s forward: the other side, the same
    distance from it (a change of at most `closeness` float32 errors in one activation)."""
    calls = [0]

    def flip(module, args):
        calls[0] += 1
        if calls[0] - 1 != kink.call:
            return None
        value = args[0].clone()
        value[kink.index] = 2 * kink.at - value[kink.index]
        return (value, *args[1:])

    dict(model.named_modules())[kink.module].register_forward_pre_hook(flip)


def update_error(before: np.ndarray, after: np.ndarray, expected: np.ndarray) -> float:
    """Relative error of an update: `||(after-before) - (expected-before)|| / ||expected-before||`
    (Frobenius norms, all in float64).

    The step is compared with the step, not the weights with the weights: a one-step update
    moves a weight by a tiny fraction of itself, so a relative error of the weights would be
    small even for a wrong gradient. 0 is exact, 1 is as wrong as not updating at all.

    `before` is the weight the step started from (the ONNX initializer). The error's floor is
    float32 storage: if `after` is float32, its rounding (~6e-8 of the weight) counts against
    the step, so pick `lr` to make the step well above that. Returns inf if the expected step
    is zero and the update is not (0.0 if both are).
    """
    b, a, e = (np.asarray(v, dtype=np.float64) for v in (before, after, expected))
    num = float(np.linalg.norm((a - b) - (e - b)))
    den = float(np.linalg.norm(e - b))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
