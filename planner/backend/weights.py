"""How a step stores weights: ratio-split weights, int8 frozen weights and LoRA adapters.

A step does not always take an ONNX initializer as it is. A weight updated by `ratio:r` arrives as
two tensors, its trainable head (first k output channels) and its frozen tail, concatenated inside
the graph. A frozen Conv/Gemm/MatMul weight of a candidate with `frozen_weights: int8` arrives as
int8 values plus one fp32 scale per output channel, dequantized inside the graph, so it occupies a
quarter of the board's RAM. A weight trained by `lora:r` arrives frozen, with two small trainable
factors B (output channels × r) and A (r × the rest) whose product is added to it inside the
graph (Hu et al., "LoRA", 2021; α = r, so the product is added unscaled). This module is the one
place that maps initializers to the step's inputs and back; back, the adapters are merged into
their weights, so a fine-tuned model has the original graph and initializers.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

QMAX = 127  # symmetric int8: -127..127, so that negating a weight cannot overflow


def head(name: str) -> str:
    """The trainable first channels of a ratio-updated weight."""
    return f"{name}@head"


def tail(name: str) -> str:
    """The frozen remaining channels of a ratio-updated weight."""
    return f"{name}@tail"


def int8(name: str) -> str:
    """The int8 values of a frozen weight stored quantized."""
    return f"{name}@int8"


def scale(name: str) -> str:
    """The per-output-channel fp32 scales of a frozen weight stored quantized."""
    return f"{name}@scale"


def lora_a(name: str) -> str:
    """A LoRA adapter's second factor, r × the weight's other dimensions (random at the start)."""
    return f"{name}@lora_a"


def lora_b(name: str) -> str:
    """A LoRA adapter's first factor, output channels × r (zero at the start)."""
    return f"{name}@lora_b"


def adapter_shapes(shape: Sequence[int], axis: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(B's shape, A's shape) of a rank-`rank` adapter for a weight of `shape`, output channels on `axis`."""
    rest = int(np.prod([d for i, d in enumerate(shape) if i != axis]))
    return (int(shape[axis]), rank), (rank, rest)


def adapter_delta(b: np.ndarray, a: np.ndarray, shape: Sequence[int], axis: int) -> np.ndarray:
    """B·A laid out as the weight: the output-channel axis back where it was."""
    others = [d for i, d in enumerate(shape) if i != axis]
    return np.moveaxis((b @ a).reshape(shape[axis], *others), 0, axis)


def initial_adapter(name: str, shape: Sequence[int], axis: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """LoRA's start: B zero (the model unchanged), A uniform in ±1/√fan-in as PyTorch (and PEFT)
    initialise it, seeded by the weight's name, so every run of a plan starts alike."""
    b_shape, a_shape = adapter_shapes(shape, axis, rank)
    bound = 1.0 / np.sqrt(a_shape[1])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return np.zeros(b_shape, np.float32), rng.uniform(-bound, bound, a_shape).astype(np.float32)


def origin(stored: str) -> str:
    """The initializer a step input stands for (`c.w@head` -> `c.w`)."""
    for part in ("@head", "@tail", "@int8", "@scale", "@lora_a", "@lora_b"):
        if stored.endswith(part):
            return stored[: -len(part)]
    return stored


def scale_shape(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    """One scale per output channel, shaped to broadcast against the weight."""
    return tuple(d if i == axis else 1 for i, d in enumerate(shape))


def quantize(weight: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8: `weight ≈ q * s`, |q| <= 127, the channel's largest |w| exact."""
    others = tuple(i for i in range(weight.ndim) if i != axis)
    peak = np.abs(weight).max(axis=others, keepdims=True).astype(np.float32)
    s = np.where(peak > 0, peak / QMAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(weight / s), -QMAX, QMAX).astype(np.int8)
    return q, s


def to_step(
    weights: dict[str, np.ndarray],
    splits: dict[str, tuple[int, int]],
    quantized: dict[str, int],
    adapters: dict[str, tuple[int, int]],
) -> dict[str, np.ndarray]:
    """Initializers as the step takes them (`splits`: weight -> (axis, k); `quantized`: weight ->
    axis; `adapters`: weight -> (axis, rank), started as `initial_adapter` unless given)."""
    out = dict(weights)
    for name, (axis, rank) in adapters.items():
        if name in out and lora_a(name) not in out:
            out[lora_b(name)], out[lora_a(name)] = initial_adapter(name, out[name].shape, axis, rank)
    for name, (axis, k) in splits.items():
        if name in out:
            out[head(name)], out[tail(name)] = np.split(out.pop(name), [k], axis=axis)
    for name, axis in quantized.items():
        if name in out:
            out[int8(name)], out[scale(name)] = quantize(out.pop(name), axis)
    return out


def from_step(
    parts: dict[str, np.ndarray],
    splits: dict[str, tuple[int, int]],
    quantized: dict[str, int],
    adapters: dict[str, tuple[int, int]],
) -> dict[str, np.ndarray]:
    """The inverse of `to_step`: initializers by ONNX name, int8 weights as the values they stand
    for, adapters merged into their weights."""
    out = dict(parts)
    for name, (axis, _) in splits.items():
        out[name] = np.concatenate([out.pop(head(name)), out.pop(tail(name))], axis=axis)
    for name in quantized:
        out[name] = out.pop(int8(name)).astype(np.float32) * out.pop(scale(name))
    for name, (axis, _) in adapters.items():
        delta = adapter_delta(out.pop(lora_b(name)), out.pop(lora_a(name)), out[name].shape, axis)
        out[name] = (out[name] + delta).astype(out[name].dtype)
    return out
